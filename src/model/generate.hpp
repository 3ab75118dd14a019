// Sampling and generation (DESIGN 8): greedy, temperature, top-p,
// repetition penalty, seeded.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "model/llama.hpp"

namespace kvcodec::model {

struct SamplingOptions {
  double temperature = 0.0;  // 0: greedy (argmax)
  double top_p = 1.0;        // nucleus: keep the smallest set of tokens whose probability reaches top_p
  uint64_t seed = 0;
  // CTRL-style penalty on the tokens among the last `repetition_window`
  // observed ones: a positive logit is divided by it, a negative one
  // multiplied (1 = off). Small models at low temperature otherwise repeat
  // one line forever.
  double repetition_penalty = 1.0;
  int repetition_window = 64;
};

// Deterministic for a seed on every platform (own generator and arithmetic,
// no std:: distributions, whose output is implementation-defined).
class Sampler {
 public:
  // Throws Error(kConfig) naming temperature / top_p / repetition_penalty /
  // repetition_window when out of range.
  explicit Sampler(const SamplingOptions& options);
  int32_t sample(const float* logits, int vocab);
  // A token of the text so far (prompt and generated), for the penalty.
  void observe(int32_t token);

 private:
  double next_uniform();  // [0, 1)
  const float* penalized(const float* logits, int vocab);
  SamplingOptions options_;
  uint64_t state_;
  std::vector<std::pair<float, int32_t>> scratch_;
  std::vector<int32_t> recent_;  // the last repetition_window observed tokens, oldest first
  std::vector<float> penalized_;
};

// Index of the largest logit (lowest index among equals).
int32_t argmax(const float* logits, int vocab);

struct GenerateOptions {
  int64_t max_tokens = 128;
  SamplingOptions sampling;
  int32_t eos_token = -1;  // stop when sampled; -1: never
  bool reference = false;  // use Session::forward_reference (speed baseline)
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated, without the prompt (EOS included when hit)
  int64_t prompt_tokens = 0;
  bool stopped_at_eos = false;
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;  // all decode steps
  int64_t decode_steps = 0;
};

// Prefills the prompt (must be non-empty) through the session, then samples
// up to max_tokens tokens, calling on_token for each as it is produced.
GenerateResult generate(Session& session, const std::vector<int32_t>& prompt, const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token = {});

// The same; on_step also gets the logits [vocab] the token was sampled from
// (before any sampling penalty), e.g. for a server's per-token logprobs.
using StepFn = std::function<void(int32_t token, const float* logits)>;
GenerateResult generate_with_logits(Session& session, const std::vector<int32_t>& prompt,
                                    const GenerateOptions& options, const StepFn& on_step);

}  // namespace kvcodec::model

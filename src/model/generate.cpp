#include "model/generate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "kvcodec/error.hpp"

namespace kvcodec::model {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int32_t argmax(const float* logits, int vocab) {
  int32_t best = 0;
  for (int i = 1; i < vocab; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

Sampler::Sampler(const SamplingOptions& options) : options_(options), state_(options.seed) {
  if (!std::isfinite(options.temperature) || options.temperature < 0.0 || options.temperature > 100.0)
    throw_config_error("temperature", std::to_string(options.temperature), "[0, 100] (0 = greedy)");
  if (!(options.top_p > 0.0 && options.top_p <= 1.0))
    throw_config_error("top_p", std::to_string(options.top_p), "(0, 1]");
  if (!(options.repetition_penalty >= 1.0 && options.repetition_penalty <= 10.0))
    throw_config_error("repetition_penalty", std::to_string(options.repetition_penalty), "[1, 10] (1 = off)");
  if (options.repetition_window < 0 || options.repetition_window > (1 << 20))
    throw_config_error("repetition_window", std::to_string(options.repetition_window), "[0, 1048576]");
}

void Sampler::observe(int32_t token) {
  if (options_.repetition_window == 0) return;
  if (int(recent_.size()) == options_.repetition_window) recent_.erase(recent_.begin());
  recent_.push_back(token);
}

// The logits with the penalty applied to every recent token once (a token
// seen twice is not penalised twice), or the logits themselves when off.
const float* Sampler::penalized(const float* logits, int vocab) {
  if (options_.repetition_penalty == 1.0 || recent_.empty()) return logits;
  penalized_.assign(logits, logits + vocab);
  const float p = float(options_.repetition_penalty);
  for (int32_t t : recent_) {
    if (t < 0 || t >= vocab || penalized_[size_t(t)] != logits[t]) continue;
    penalized_[size_t(t)] = logits[t] > 0.0f ? logits[t] / p : logits[t] * p;
  }
  return penalized_.data();
}

// splitmix64: small, fast, and the same on every platform.
double Sampler::next_uniform() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return double(z >> 11) * (1.0 / 9007199254740992.0);
}

int32_t Sampler::sample(const float* raw_logits, int vocab) {
  const float* logits = penalized(raw_logits, vocab);
  if (options_.temperature == 0.0) return argmax(logits, vocab);
  // Softmax at temperature T, highest first; ties by index keep it deterministic.
  const float mx = logits[argmax(logits, vocab)];
  scratch_.resize(size_t(vocab));
  double total = 0.0;
  for (int i = 0; i < vocab; ++i) {
    const float p = float(std::exp((double(logits[i]) - mx) / options_.temperature));
    scratch_[size_t(i)] = {p, i};
    total += p;
  }
  std::sort(scratch_.begin(), scratch_.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  // Nucleus: the smallest prefix whose mass reaches top_p (at least one token).
  size_t keep = 0;
  double mass = 0.0;
  while (keep < scratch_.size() && (keep == 0 || mass < options_.top_p * total)) mass += scratch_[keep++].first;
  const double u = next_uniform() * mass;
  double acc = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    acc += scratch_[i].first;
    if (u < acc) return scratch_[i].second;
  }
  return scratch_[keep - 1].second;
}

GenerateResult generate(Session& session, const std::vector<int32_t>& prompt, const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token) {
  if (!on_token) return generate_with_logits(session, prompt, options, {});
  return generate_with_logits(session, prompt, options, [&](int32_t t, const float*) { on_token(t); });
}

GenerateResult generate_with_logits(Session& session, const std::vector<int32_t>& prompt,
                                    const GenerateOptions& options, const StepFn& on_step) {
  if (prompt.empty()) throw Error(ErrorCode::kInvalidArgument, "generate needs a non-empty prompt");
  if (options.max_tokens < 0)
    throw_config_error("max_tokens", std::to_string(options.max_tokens), ">= 0");
  Sampler sampler(options.sampling);
  for (int32_t t : prompt) sampler.observe(t);
  const int vocab = session.model().config().vocab_size;
  GenerateResult result;
  result.prompt_tokens = int64_t(prompt.size());
  std::vector<float> logits;
  auto step = [&](const int32_t* t, int64_t n) {
    if (options.reference) session.forward_reference(t, n, logits, false);
    else session.forward(t, n, logits, false);
  };
  auto t0 = std::chrono::steady_clock::now();
  step(prompt.data(), int64_t(prompt.size()));
  result.prefill_seconds = seconds_since(t0);
  for (int64_t i = 0; i < options.max_tokens; ++i) {
    const int32_t next = sampler.sample(logits.data(), vocab);
    result.tokens.push_back(next);
    sampler.observe(next);
    if (on_step) on_step(next, logits.data());
    if (next == options.eos_token) {
      result.stopped_at_eos = true;
      break;
    }
    if (i + 1 == options.max_tokens) break;  // no need to feed the last token
    t0 = std::chrono::steady_clock::now();
    step(&next, 1);
    result.decode_seconds += seconds_since(t0);
    ++result.decode_steps;
  }
  return result;
}

}  // namespace kvcodec::model

// Perplexity / KL evaluation of cache methods (DESIGN 8 protocol).
//
// For each window of `window_length` tokens: prefill the first `context`
// tokens through the cache under test, then score the next `score` tokens one
// decode step at a time (logits at position context-1 predict token context;
// `score` predictions, of tokens context .. context+score-1). Reported per
// method: mean NLL and perplexity of those predictions, KL(p_baseline ||
// p_method) averaged over the same positions, top-1 agreement with the
// baseline (the fp16 cache), compression ratio (sum over layers and windows
// of the cache's bytes when the last token has been scored) and tokens/s.
//
// Whole-window mode (whole_window = true): each window goes through the cache
// as one prefill of all its tokens, and every position 0..W-2 predicts the
// next (W-1 predictions). Attention at every position reads the method's
// reconstruction of the keys/values up to and including itself, so a lossy
// method's error is seen by every prediction. This is the protocol of the
// "whole window scored" reference figure.
//
// Stored-prefix mode (stored_prefix = true, docs/eval.md): the first
// context - 1 tokens are prefilled through the BASELINE's caches (exact), and
// their keys and values, every layer at once, go through the method's
// PrefixCoder (as a prefix store stores a prompt); the scored tokens, from
// token context - 1 on (so the same `score` targets as above), then run on
// top of the restored prefix in baseline caches, as one forward pass with
// logits at every position (baseline caches hold them as given, so this
// equals decoding them one at a time up to float summation order). The
// ratio is the prefix's f16 bytes over every byte stored for it; tokens/s
// counts the scored tokens over the time spent storing, restoring and
// scoring.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvcodec/cache.hpp"
#include "model/eval_prefix.hpp"
#include "model/llama.hpp"

namespace kvcodec::model {

struct EvalOptions {
  int64_t context = 1024;
  int64_t score = 512;
  int64_t windows = 8;        // how many windows, from first_window
  int64_t first_window = 0;
  int64_t window_length = 2048;
  bool whole_window = false;  // see above; context/score are then ignored
  bool stored_prefix = false;  // see above; excludes whole_window
};

struct MethodSpec {
  std::string name;
  CacheFactory factory;
  // Stored-prefix mode only: how the prefix is stored; empty = each layer
  // through one fresh cache of `factory` (per_layer_prefix_coder).
  PrefixCoder prefix_coder = {};
};

struct EvalResult {
  std::string method;
  int64_t scored = 0;        // predictions scored
  double nll = 0.0;          // mean, nats/token
  double ppl = 0.0;          // exp(nll)
  double ppl_change = 0.0;   // ppl / the baseline's ppl - 1
  double ppl_change_se = 0.0;  // standard error of the per-window ppl change across windows (0 for one window)
  double kl = 0.0;           // mean KL(p_baseline || p_method), nats
  double top1 = 0.0;         // share of positions whose argmax equals the baseline's
  double compression_ratio = 0.0;  // stored-prefix mode: of the stored prefixes
  double tokens_per_s = 0.0;  // tokens fed through the model per second of forward passes
  double seconds = 0.0;
  CacheStats stats;          // summed over layers and windows (stored-prefix mode: of the stored prefixes)
};

// Reads a .u16 token file (little-endian uint16). Throws Error(kIo / kFormat).
std::vector<int32_t> load_u16_tokens(const std::string& path);

// Throws Error(kNotFound) when `n_tokens` tokens read from `source` cannot
// hold the windows `options` asks for, naming how many tokens they need.
void require_corpus_tokens(const EvalOptions& options, int64_t n_tokens, const std::string& source);

// (done, total) in forward steps, for a progress bar.
using ProgressFn = std::function<void(int64_t done, int64_t total)>;

// Runs `baseline` and every method over the windows; one result per method,
// in order. A method named like the baseline reuses the baseline's run.
// Throws Error(kConfig) naming context / score / windows when they do not fit
// the tokens.
std::vector<EvalResult> evaluate(const LlamaModel& model, const std::vector<int32_t>& tokens,
                                 const std::vector<MethodSpec>& methods, const MethodSpec& baseline,
                                 const EvalOptions& options, const ProgressFn& progress = {});

// log_softmax of one row of logits [vocab], in double (a stable KL between
// nearly equal rows); out is resized.
void log_softmax(const float* logits, int vocab, std::vector<double>& out);

}  // namespace kvcodec::model

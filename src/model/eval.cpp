#include "model/eval.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>

#include "kvcodec/error.hpp"
#include "model/generate.hpp"

namespace kvcodec::model {

void log_softmax(const float* logits, int vocab, std::vector<double>& out) {
  out.resize(size_t(vocab));
  double mx = logits[0];
  for (int i = 1; i < vocab; ++i) mx = std::max(mx, double(logits[i]));
  double sum = 0.0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(double(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  for (int i = 0; i < vocab; ++i) out[size_t(i)] = double(logits[i]) - lse;
}

namespace {

struct WindowRun {
  std::vector<float> logits;  // [predictions, vocab]: row i predicts target[i]
  double seconds = 0.0;
  int64_t fed = 0;
  CacheStats stats;
};

// Stored-prefix mode, the part every method shares: the first context - 1
// tokens prefilled through the baseline's caches, each layer's keys and
// values [1, H_kv, S, D] f32.
std::vector<KVPair> exact_prefix(const LlamaModel& model, const CacheFactory& baseline, const int32_t* window,
                                 const EvalOptions& o) {
  std::vector<float> logits;
  Session exact(model, baseline);
  exact.forward(window, o.context - 1, logits, false);
  std::vector<KVPair> prefix;
  for (const auto& cache : exact.caches()) prefix.push_back(cache->fetch(DType::kF32));
  return prefix;
}

// Stored-prefix mode: `prefix` stored by `coder`, the scored tokens run on
// top of the restored prefix in fresh baseline caches. They go in as one
// forward pass with logits at every position: the baseline caches on top
// hold them as given, so each position's attention reads what one decode
// step at a time would (up to float summation order), at a tenth of the time.
WindowRun run_stored_prefix(const LlamaModel& model, const CacheFactory& baseline, const PrefixCoder& coder,
                            const std::vector<KVPair>& prefix, const int32_t* window, const EvalOptions& o,
                            const std::function<void()>& tick) {
  const int64_t stored = o.context - 1;
  WindowRun run;
  const auto t0 = std::chrono::steady_clock::now();
  StoredPrefix sp = coder(model.config(), prefix);
  if (sp.restored.size() != prefix.size())
    throw Error(ErrorCode::kShapeMismatch, "stored prefix: " + std::to_string(sp.restored.size()) +
                                               " layers restored, " + std::to_string(prefix.size()) + " stored");
  for (size_t l = 0; l < sp.restored.size(); ++l)
    if (sp.restored[l].keys.shape() != prefix[l].keys.shape() || sp.restored[l].values.shape() != prefix[l].values.shape())
      throw Error(ErrorCode::kShapeMismatch, "stored prefix: layer " + std::to_string(l) + " restored as " +
                                                 shape_string(sp.restored[l].keys.shape()) + ", stored " +
                                                 shape_string(prefix[l].keys.shape()));
  Session on_top(model, prefilled_factory(baseline, std::make_shared<const std::vector<KVPair>>(std::move(sp.restored))));
  on_top.forward(window + stored, o.score, run.logits, true);
  for (int64_t i = 0; i < o.score; ++i) tick();
  run.fed = o.score;
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  run.stats = sp.stats;
  return run;
}

// Runs one window through a fresh set of caches, collecting the logits of
// every scored prediction.
WindowRun run_window(const LlamaModel& model, const MethodSpec& method, const MethodSpec& baseline,
                     const std::vector<KVPair>& prefix, const int32_t* window, const EvalOptions& o,
                     const std::function<void()>& tick) {
  if (o.stored_prefix)
    return run_stored_prefix(model, baseline.factory,
                             method.prefix_coder ? method.prefix_coder : per_layer_prefix_coder(method.factory),
                             prefix, window, o, tick);
  const int vocab = model.config().vocab_size;
  Session session(model, method.factory);
  WindowRun run;
  std::vector<float> step;
  const auto t0 = std::chrono::steady_clock::now();
  if (o.whole_window) {
    session.forward(window, o.window_length, step, true);
    run.fed = o.window_length;
    step.resize(size_t(o.window_length - 1) * size_t(vocab));  // the last position predicts nothing here
    run.logits = std::move(step);
    tick();
  } else {
    run.logits.resize(size_t(o.score) * size_t(vocab));
    session.forward(window, o.context, step, false);
    std::copy(step.begin(), step.end(), run.logits.begin());
    tick();
    for (int64_t i = 1; i < o.score; ++i) {
      session.forward(window + o.context + i - 1, 1, step, false);
      std::copy(step.begin(), step.end(), run.logits.begin() + i * vocab);
      tick();
    }
    run.fed = o.context + o.score - 1;
  }
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  run.stats = session.cache_stats();
  return run;
}

void validate(const EvalOptions& o, int64_t n_tokens) {
  if (o.window_length < 2) throw_config_error("window_length", std::to_string(o.window_length), ">= 2");
  const int64_t available = n_tokens / o.window_length;
  if (o.first_window < 0 || o.first_window >= available)
    throw_config_error("first_window", std::to_string(o.first_window),
                       "[0, " + std::to_string(available - 1) + "] (" + std::to_string(available) +
                           " windows of " + std::to_string(o.window_length) + " tokens)");
  if (o.windows < 1 || o.windows > available - o.first_window)
    throw_config_error("windows", std::to_string(o.windows),
                       "[1, " + std::to_string(available - o.first_window) + "] from window " +
                           std::to_string(o.first_window));
  if (o.whole_window && o.stored_prefix) throw_config_error("stored_prefix", "true", "not with whole_window");
  if (o.whole_window) return;
  if (o.context < (o.stored_prefix ? 2 : 1) || o.context >= o.window_length)
    throw_config_error("context", std::to_string(o.context),
                       "[" + std::string(o.stored_prefix ? "2" : "1") + ", " + std::to_string(o.window_length - 1) +
                           "]" + (o.stored_prefix ? " (a stored prefix of context - 1 tokens)" : ""));
  if (o.score < 1 || o.context + o.score > o.window_length)
    throw_config_error("score", std::to_string(o.score),
                       "[1, " + std::to_string(o.window_length - o.context) + "] (context + score <= window " +
                           std::to_string(o.window_length) + ")");
}

}  // namespace

std::vector<int32_t> load_u16_tokens(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw Error(ErrorCode::kIo, "cannot open token file " + path);
  const std::streamoff size = in.tellg();
  if (size < 0 || size % 2 != 0)
    throw Error(ErrorCode::kFormat, "token file " + path + " has " + std::to_string(size) +
                                        " bytes, not a whole number of uint16 tokens");
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(bytes.data()), size);
  if (!in) throw Error(ErrorCode::kIo, "cannot read token file " + path);
  std::vector<int32_t> tokens(bytes.size() / 2);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(bytes[2 * i]) | (int32_t(bytes[2 * i + 1]) << 8);
  return tokens;
}

void require_corpus_tokens(const EvalOptions& o, int64_t n_tokens, const std::string& source) {
  const int64_t needed = (o.first_window + o.windows) * o.window_length;
  if (o.first_window < 0 || o.windows < 1 || o.window_length < 2 || n_tokens >= needed) return;  // validate() names these
  throw Error(ErrorCode::kNotFound,
              source + " has " + std::to_string(n_tokens) + " tokens; " + std::to_string(o.windows) + " window(s) of " +
                  std::to_string(o.window_length) + " from window " + std::to_string(o.first_window) + " need " +
                  std::to_string(needed) + " (fewer --windows, a shorter --window-length, or more text)");
}

std::vector<EvalResult> evaluate(const LlamaModel& model, const std::vector<int32_t>& tokens,
                                 const std::vector<MethodSpec>& methods, const MethodSpec& baseline,
                                 const EvalOptions& o, const ProgressFn& progress) {
  validate(o, int64_t(tokens.size()));
  const int vocab = model.config().vocab_size;
  for (int64_t w = o.first_window; w < o.first_window + o.windows; ++w)
    for (int64_t i = 0; i < o.window_length; ++i) {
      const int32_t t = tokens[size_t(w * o.window_length + i)];
      if (t < 0 || t >= vocab)
        throw Error(ErrorCode::kFormat, "token " + std::to_string(t) + " at window " + std::to_string(w) +
                                            ", position " + std::to_string(i) + " is outside the vocabulary [0, " +
                                            std::to_string(vocab) + ")");
    }

  // Which runs are needed: the baseline, then every method not named like it.
  std::vector<const MethodSpec*> runs{&baseline};
  std::vector<int> run_of(methods.size());
  for (size_t m = 0; m < methods.size(); ++m) {
    if (methods[m].name == baseline.name) {
      run_of[m] = 0;
    } else {
      run_of[m] = int(runs.size());
      runs.push_back(&methods[m]);
    }
  }
  const int64_t steps_per_window = o.whole_window ? 1 : o.score;
  const int64_t total_steps = steps_per_window * o.windows * int64_t(runs.size());
  int64_t done = 0;
  auto tick = [&] {
    ++done;
    if (progress) progress(done, total_steps);
  };

  struct Acc {
    double nll = 0, kl = 0, seconds = 0;
    int64_t top1 = 0, scored = 0, fed = 0;
    CacheStats stats;
    std::vector<double> window_nll;  // mean NLL of each window, for the spread
  };
  std::vector<Acc> acc(runs.size());
  std::vector<double> base_lp, lp;
  std::vector<std::vector<double>> base_rows;
  std::vector<int32_t> base_top;

  for (int64_t w = o.first_window; w < o.first_window + o.windows; ++w) {
    const int32_t* window = tokens.data() + w * o.window_length;
    // Prediction i is scored against target[i].
    const int32_t* target = o.whole_window ? window + 1 : window + o.context;
    const int64_t n_pred = o.whole_window ? o.window_length - 1 : o.score;
    const std::vector<KVPair> prefix = o.stored_prefix ? exact_prefix(model, baseline.factory, window, o) : std::vector<KVPair>{};
    for (size_t r = 0; r < runs.size(); ++r) {
      WindowRun run = run_window(model, *runs[r], baseline, prefix, window, o, tick);
      Acc& a = acc[r];
      a.seconds += run.seconds;
      a.fed += run.fed;
      a.stats += run.stats;
      a.scored += n_pred;
      const double nll_before = a.nll;
      if (r == 0) {
        base_rows.assign(size_t(n_pred), {});
        base_top.assign(size_t(n_pred), 0);
      }
      for (int64_t i = 0; i < n_pred; ++i) {
        const float* row = run.logits.data() + i * vocab;
        log_softmax(row, vocab, lp);
        a.nll -= lp[size_t(target[i])];
        const int32_t top = argmax(row, vocab);
        if (r == 0) {
          base_rows[size_t(i)] = lp;  // keeps the baseline's distributions for KL
          base_top[size_t(i)] = top;
          ++a.top1;
          continue;
        }
        const std::vector<double>& b = base_rows[size_t(i)];
        double kl = 0.0;
        for (int v = 0; v < vocab; ++v) kl += std::exp(b[size_t(v)]) * (b[size_t(v)] - lp[size_t(v)]);
        a.kl += std::max(0.0, kl);  // rounding can give -1e-17 for equal rows
        a.top1 += top == base_top[size_t(i)];
      }
      a.window_nll.push_back((a.nll - nll_before) / double(n_pred));
    }
  }

  const double baseline_ppl = std::exp(acc[0].nll / double(acc[0].scored));
  // Standard error of the per-window perplexity change (ppl_w / base_w - 1)
  // across windows: how far the pooled figure could move on other windows.
  const auto window_spread = [](const std::vector<double>& nll, const std::vector<double>& base) {
    const size_t n = nll.size();
    if (n < 2) return 0.0;
    double mean = 0, sq = 0;
    for (size_t w = 0; w < n; ++w) mean += std::expm1(nll[w] - base[w]);
    mean /= double(n);
    for (size_t w = 0; w < n; ++w) sq += std::pow(std::expm1(nll[w] - base[w]) - mean, 2);
    return std::sqrt(sq / double(n - 1) / double(n));
  };
  std::vector<EvalResult> results;
  for (size_t m = 0; m < methods.size(); ++m) {
    const Acc& a = acc[size_t(run_of[m])];
    EvalResult r;
    r.method = methods[m].name;
    r.scored = a.scored;
    r.nll = a.nll / double(a.scored);
    r.ppl = std::exp(r.nll);
    r.ppl_change = r.ppl / baseline_ppl - 1.0;
    r.ppl_change_se = window_spread(a.window_nll, acc[0].window_nll);
    r.kl = a.kl / double(a.scored);
    r.top1 = double(a.top1) / double(a.scored);
    r.stats = a.stats;
    r.compression_ratio = a.stats.compression_ratio();
    r.seconds = a.seconds;
    r.tokens_per_s = a.seconds > 0 ? double(a.fed) / a.seconds : 0.0;
    results.push_back(std::move(r));
  }
  return results;
}

}  // namespace kvcodec::model

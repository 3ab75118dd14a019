#include "model/calibrate.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "kvcodec/error.hpp"
#include "linalg/pca.hpp"

namespace kvcodec::model {

CalibrationSamples collect_calibration_samples(const LlamaModel& model, const std::vector<int32_t>& tokens,
                                               const CalibrateOptions& o, const CalibrationProgress& progress) {
  const ModelConfig& c = model.config();
  const int64_t per_window = o.tokens_per_window > 0 ? o.tokens_per_window : o.window_length;
  if (o.windows < 1 || o.first_window < 0 || o.window_length < 1 || per_window > o.window_length ||
      (o.first_window + o.windows) * o.window_length > int64_t(tokens.size()))
    throw_config_error("calibrate.windows",
                       std::to_string(o.first_window) + "-" + std::to_string(o.first_window + o.windows - 1),
                       "windows inside the token file (" + std::to_string(tokens.size() / size_t(std::max<int64_t>(o.window_length, 1))) +
                           " windows of " + std::to_string(o.window_length) + " tokens), tokens per window <= window length");
  if (o.sinks < 0 || o.sinks >= per_window)
    throw_config_error("calibrate.sinks", std::to_string(o.sinks), "[0, tokens per window)");
  const int H = c.n_kv_heads, D = c.head_dim;
  const int64_t V = int64_t(H) * D;
  const int64_t kept = per_window - o.sinks;
  CalibrationSamples s;
  s.n_layers = c.n_layers;
  s.n_kv_heads = H;
  s.head_dim = D;
  s.tokens = kept * o.windows;
  s.keys.assign(size_t(c.n_layers), std::vector<float>(size_t(s.tokens * V)));
  s.values.assign(size_t(c.n_layers), std::vector<float>(size_t(s.tokens * V)));
  const std::vector<double> inv_freq = rope_inv_freq(D, c.rope_theta);
  std::vector<float> logits;
  for (int64_t w = 0; w < o.windows; ++w) {
    if (progress) progress(w, o.windows, "window " + std::to_string(o.first_window + w));
    Session session(model, method_cache_factory("fp16"));
    const int32_t* tok = tokens.data() + (o.first_window + w) * o.window_length;
    session.forward(tok, per_window, logits, false);
    for (int l = 0; l < c.n_layers; ++l) {
      // [1, H, S, D] f32 -> token-major [S - sinks, H * D] rows of this window.
      const KVPair kv = session.caches()[size_t(l)]->fetch(DType::kF32);
      const float* k = kv.keys.data_as<float>();
      const float* v = kv.values.data_as<float>();
      float* dk = s.keys[size_t(l)].data() + w * kept * V;
      float* dv = s.values[size_t(l)].data() + w * kept * V;
      for (int64_t t = 0; t < kept; ++t)
        for (int h = 0; h < H; ++h) {
          std::copy_n(k + (int64_t(h) * per_window + o.sinks + t) * D, D, dk + t * V + h * D);
          std::copy_n(v + (int64_t(h) * per_window + o.sinks + t) * D, D, dv + t * V + h * D);
        }
      rope_rotate_tokens(dk, kept, H, D, o.sinks, inv_freq, /*inverse=*/true);
    }
  }
  if (progress) progress(o.windows, o.windows, "collected " + std::to_string(s.tokens) + " tokens per layer");
  return s;
}

namespace {

// Entropy-coded payload bytes of x [n, dim] in blocks of 64, as the cache stores it.
double payload_bytes(const kvtc::HeadParams& p, const float* x, int64_t n, int64_t dim) {
  constexpr int64_t kBlock = 64;
  double bytes = 0;
  for (int64_t i = 0; i + kBlock <= n; i += kBlock) bytes += double(kvtc::encode_block(p, x + i * dim, kBlock).size());
  return bytes;
}

kvtc::HeadParams fit_one(const std::vector<float>& x, int64_t n, int dim, const CalibrateOptions& o,
                         double* achieved_ratio) {
  const linalg::PcaBasis pca = linalg::fit_pca(x.data(), n, dim);
  kvtc::CodecOptions codec = o.codec;
  const int64_t measured = (n / 64) * 64;
  auto ratio_of = [&](const kvtc::HeadParams& p) {
    const double bytes = payload_bytes(p, x.data(), measured, dim);
    return bytes > 0 ? double(measured) * dim * 2.0 / bytes : 1e30;
  };
  if (o.target_ratio > 0.0) {
    // Largest budget (bits per token vector) meeting the ratio; the coded rate
    // is monotone in the budget up to entropy-coder noise, so bisection.
    int lo = 1, hi = 16 * dim;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      codec.bit_budget = mid;
      const auto trial = kvtc::fit_head(x.data(), n, dim, pca.mean, pca.components, pca.eigenvalues, codec);
      if (ratio_of(trial) >= o.target_ratio) lo = mid; else hi = mid - 1;
    }
    codec.bit_budget = lo;
  }
  kvtc::HeadParams p = kvtc::fit_head(x.data(), n, dim, pca.mean, pca.components, pca.eigenvalues, codec);
  if (achieved_ratio) *achieved_ratio = ratio_of(p);
  return p;
}

}  // namespace

KvtcCalibration fit_calibration(const ModelConfig& config, const std::string& config_hash,
                                const CalibrationSamples& s, const CalibrateOptions& o,
                                const CalibrationProgress& progress) {
  if (s.n_layers != config.n_layers || s.n_kv_heads != config.n_kv_heads || s.head_dim != config.head_dim)
    throw Error(ErrorCode::kShapeMismatch, "calibration samples do not match the model config");
  if (s.tokens < 64) throw Error(ErrorCode::kInvalidArgument, "calibration needs at least 64 tokens per layer");
  KvtcCalibration cal;
  cal.n_layers = config.n_layers;
  cal.n_kv_heads = config.n_kv_heads;
  cal.head_dim = config.head_dim;
  cal.rope_theta = config.rope_theta;
  cal.config_hash = config_hash;
  cal.keys.resize(size_t(config.n_layers));
  cal.values.resize(size_t(config.n_layers));
  const int dim = cal.vector_dim();
  std::vector<double> ratios(size_t(2 * config.n_layers));
  for (int l = 0; l < config.n_layers; ++l) {
    if (progress) progress(l, config.n_layers, "fitting layer " + std::to_string(l));
    // Keys and values of a layer in parallel (each fit is single-threaded).
#pragma omp parallel for num_threads(2) schedule(static)
    for (int t = 0; t < 2; ++t) {
      auto& dst = t == 0 ? cal.keys[size_t(l)] : cal.values[size_t(l)];
      dst = fit_one(t == 0 ? s.keys[size_t(l)] : s.values[size_t(l)], s.tokens, dim, o, &ratios[size_t(2 * l + t)]);
    }
    if (progress) {
      std::ostringstream m;
      m.precision(3);
      m << "layer " << l << ": key " << cal.keys[size_t(l)].n_kept() << " components, payload ratio "
        << ratios[size_t(2 * l)] << "x; value " << cal.values[size_t(l)].n_kept() << " components, "
        << ratios[size_t(2 * l + 1)] << "x";
      progress(l + 1, config.n_layers, m.str());
    }
  }
  std::ostringstream info;
  cal.info["tokens_per_layer"] = std::to_string(s.tokens);
  cal.info["sinks"] = std::to_string(o.sinks);
  cal.info["windows"] = std::to_string(o.first_window) + "-" + std::to_string(o.first_window + o.windows - 1);
  cal.info["allocator"] = kvtc::allocator_name(o.codec.allocator);
  cal.info["coder"] = kvtc::coder_name(o.codec.coder);
  cal.info["target_ratio"] = o.target_ratio > 0 ? std::to_string(o.target_ratio) : "none";
  cal.info["bit_budget"] = o.target_ratio > 0 ? "from target_ratio" : std::to_string(o.codec.bit_budget > 0 ? o.codec.bit_budget : 4 * dim);
  return cal;
}

std::string model_config_hash(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(ErrorCode::kNotFound, "cannot read " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  return hash_hex(text.data(), text.size());
}

void check_calibration_for_model(const KvtcCalibration& cal, const ModelConfig& config, const std::string& config_hash) {
  CacheConfig cc;
  cc.n_layers = config.n_layers;
  cc.n_kv_heads = config.n_kv_heads;
  cc.head_dim = config.head_dim;
  check_calibration_matches(cal, cc, config.rope_theta, "(calibration)");
  if (!cal.config_hash.empty() && !config_hash.empty() && cal.config_hash != config_hash)
    throw_config_error("kvtc.calibration", "config hash " + cal.config_hash,
                       "a calibration of this model (config.json hash " + config_hash + ")");
}

}  // namespace kvcodec::model

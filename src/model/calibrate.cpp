#include "model/calibrate.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <Eigen/Dense>

#include "alloc/allocator.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"
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

// --- measured-distortion allocation (issue 5, build item 3) -----------------

// f16 rounding, as HeadParams stores the mean and basis.
float round_f16(float v) { return f16_to_f32(f32_to_f16(v)); }

// Squared error and code histogram of one coefficient column quantized with
// a midrise uniform quantizer of `levels` levels and step `step` (the codec's
// half_offset grid: code = clamp(floor(c / step + levels / 2)), reconstruction
// (code - levels / 2 + 0.5) * step).
double midrise_sq_error(const float* c, int64_t n, int64_t stride, double step, int levels,
                        std::vector<uint64_t>* counts) {
  const double inv = 1.0 / step, half = levels / 2;
  double err = 0.0;
  if (counts) counts->assign(size_t(levels), 0);
  for (int64_t i = 0; i < n; ++i) {
    const double v = c[i * stride];
    const double code = std::clamp(std::floor(v * inv + half), 0.0, double(levels - 1));
    const double r = (code - half + 0.5) * step;
    err += (v - r) * (v - r);
    if (counts) ++(*counts)[size_t(code)];
  }
  return err;
}

double entropy_bits(const std::vector<uint64_t>& counts, int64_t n) {
  double h = 0.0;
  for (uint64_t c : counts)
    if (c) h -= double(c) * std::log2(double(c) / double(n));
  return h / double(n);
}

}  // namespace

MeasuredTables measure_component_tables(const float* x, int64_t n, int dim, const std::vector<float>& mean,
                                        const std::vector<float>& components, const std::vector<int>& bit_choices) {
  if (n < 1 || dim < 1 || mean.size() != size_t(dim) || components.size() != size_t(dim) * size_t(dim))
    throw Error(ErrorCode::kInvalidArgument, "measure_component_tables: " + std::to_string(n) + " tokens of dim " +
                                                 std::to_string(dim) + ", mean " + std::to_string(mean.size()) +
                                                 ", components " + std::to_string(components.size()));
  for (int b : bit_choices)
    if (b < 0 || b > 12)
      throw Error(ErrorCode::kInvalidArgument, "measure_component_tables: width " + std::to_string(b) +
                                                   " outside [0, 12]");
  MeasuredTables t;
  t.bit_choices = bit_choices;
  t.tokens = n;
  t.mean.resize(size_t(dim));
  for (int d = 0; d < dim; ++d) t.mean[size_t(d)] = round_f16(mean[size_t(d)]);
  t.axes.resize(components.size());
  for (size_t i = 0; i < components.size(); ++i) t.axes[i] = round_f16(components[i]);
  // Coefficients on the basis as stored: [n, D] row-major.
  t.coeffs.resize(size_t(n) * size_t(dim));
  {
    using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    Eigen::Map<const RowMat> xm(x, n, dim), axes(t.axes.data(), dim, dim);
    Eigen::Map<const Eigen::RowVectorXf> mu(t.mean.data(), dim);
    Eigen::Map<RowMat> out(t.coeffs.data(), n, dim);
    out.noalias() = (xm.rowwise() - mu) * axes.transpose();
  }
  const size_t J = bit_choices.size();
  t.rate.assign(size_t(dim), std::vector<double>(J, 0.0));
  t.distortion.assign(size_t(dim), std::vector<double>(J, 0.0));
  t.step.assign(size_t(dim), std::vector<double>(J, 0.0));
  // The step search runs on a subsample (every s-th token, >= 4096 tokens);
  // rate and distortion are then measured on every token at the chosen step.
  const int64_t sub = std::max<int64_t>(1, n / 4096);
  const int64_t n_sub = (n + sub - 1) / sub;
#pragma omp parallel for schedule(dynamic, 1)
  for (int k = 0; k < dim; ++k) {
    const float* c = t.coeffs.data() + k;
    double energy = 0.0;
    for (int64_t i = 0; i < n; ++i) energy += double(c[i * dim]) * c[i * dim];
    const double sigma = std::sqrt(energy / double(n));
    std::vector<uint64_t> counts;
    for (size_t j = 0; j < J; ++j) {
      const int b = bit_choices[j];
      if (b == 0) {
        t.distortion[size_t(k)][j] = energy / double(n);  // reconstructed as the mean
        continue;
      }
      const int levels = 1 << b;
      // Golden-section search of the MSE over log(step) around the Gaussian
      // Lloyd-Max step (the data are rarely Gaussian: heavier tails want a
      // wider range, light ones a finer step).
      const double g = sigma > 0 ? sigma * 4.0 / double(levels) : 1e-30;
      auto mse = [&](double log_step) {
        return midrise_sq_error(c, n_sub, dim * sub, std::exp(log_step), levels, nullptr);
      };
      double lo = std::log(g * 0.15), hi = std::log(g * 3.0);
      const double phi = 0.6180339887498949;
      double a = hi - phi * (hi - lo), bb = lo + phi * (hi - lo);
      double fa = mse(a), fb = mse(bb);
      for (int it = 0; it < 24; ++it) {
        if (fa <= fb) {
          hi = bb; bb = a; fb = fa; a = hi - phi * (hi - lo); fa = mse(a);
        } else {
          lo = a; a = bb; fa = fb; bb = lo + phi * (hi - lo); fb = mse(bb);
        }
      }
      const double step = std::max(std::exp(fa <= fb ? a : bb), 1e-30);
      // The codec stores the step as f32.
      const double stored = double(float(step));
      t.step[size_t(k)][j] = stored;
      t.distortion[size_t(k)][j] = midrise_sq_error(c, n, dim, stored, levels, &counts) / double(n);
      t.rate[size_t(k)][j] = entropy_bits(counts, n);
    }
  }
  return t;
}

kvtc::HeadParams build_head_params(const MeasuredTables& t, const float* x, int64_t n, int dim,
                                   const std::vector<double>& eigenvalues, const std::vector<int>& bits) {
  if (bits.size() != size_t(dim) || t.rate.size() != size_t(dim))
    throw Error(ErrorCode::kInvalidArgument, "build_head_params: " + std::to_string(bits.size()) + " widths for dim " +
                                                 std::to_string(dim));
  kvtc::HeadParams p;
  p.dim = dim;
  p.basis_bits = 16;
  p.eigenvalues = eigenvalues;
  p.mean = t.mean;
  p.bits.assign(size_t(dim), 0);
  for (int k = 0; k < dim; ++k) {
    const int b = bits[size_t(k)];
    if (b == 0) continue;
    const auto it = std::find(t.bit_choices.begin(), t.bit_choices.end(), b);
    if (it == t.bit_choices.end())
      throw Error(ErrorCode::kInvalidArgument, "build_head_params: width " + std::to_string(b) + " not measured");
    kvtc::ComponentQuantizer q;
    q.levels = uint16_t(1u << b);
    q.zero = uint16_t(q.levels / 2);
    q.half_offset = true;
    q.step = float(t.step[size_t(k)][size_t(it - t.bit_choices.begin())]);
    p.bits[size_t(k)] = b;
    p.kept.push_back(uint16_t(k));
    p.quant.push_back(q);
    p.row_scale.push_back(0.0f);
    p.basis.insert(p.basis.end(), t.axes.begin() + int64_t(k) * dim, t.axes.begin() + int64_t(k + 1) * dim);
    p.fixed_widths.push_back(uint8_t(b));
  }
  // Entropy models from the calibration tokens' codes, as kvtc::fit_head
  // builds them (every symbol at a nonzero probability; 12/13-bit scales).
  const int kept = p.n_kept();
  p.coder = kvtc::CoderChoice::kFixed;
  std::vector<uint16_t> codes(size_t(n) * size_t(kept));
  kvtc::quantize_block(p, x, n, codes.data());
  for (int k = 0; k < kept; ++k) {
    std::vector<uint64_t> counts(p.quant[size_t(k)].levels, 0);
    for (int64_t i = 0; i < n; ++i) ++counts[codes[size_t(i) * size_t(kept) + size_t(k)]];
    const uint32_t scale = std::clamp<uint32_t>(uint32_t(p.fixed_widths[size_t(k)]) + 1, 12, 13);
    p.rans_tables.push_back(entropy::FrequencyTable::from_counts(counts, scale));
  }
  p.coder = kvtc::CoderChoice::kRans;
  p.build_decoders();
  return p;
}

namespace {

kvtc::HeadParams fit_one(const std::vector<float>& x, int64_t n, int dim, const CalibrateOptions& o,
                         double target_ratio, double* achieved_ratio) {
  const linalg::PcaBasis pca = linalg::fit_pca(x.data(), n, dim);
  kvtc::CodecOptions codec = o.codec;
  const int64_t measured = (n / 64) * 64;
  auto ratio_of = [&](const kvtc::HeadParams& p) {
    const double bytes = payload_bytes(p, x.data(), measured, dim);
    return bytes > 0 ? double(measured) * dim * 2.0 / bytes : 1e30;
  };
  if (o.measured_allocation) {
    const MeasuredTables t = measure_component_tables(x.data(), n, dim, pca.mean, pca.components, codec.bit_choices);
    auto fit_at = [&](double budget) {
      const alloc::AllocationResult a = alloc::allocate_bits_measured(t.rate, t.distortion, t.bit_choices, budget);
      return build_head_params(t, x.data(), n, dim, pca.eigenvalues, a.bits);
    };
    if (target_ratio <= 0.0) {
      kvtc::HeadParams p = fit_at(codec.bit_budget > 0 ? codec.bit_budget : 4.0 * dim);
      if (achieved_ratio) *achieved_ratio = ratio_of(p);
      return p;
    }
    // The measured rates predict the entropy-coded payload closely (the coder
    // adds its flush bytes per block and the cost of the tables' precision, a
    // nearly constant number of bits per token): start at the target's bits
    // per token and correct the budget by the measured excess (secant-like,
    // additive), bisecting whenever a step leaves the bracket, until the
    // ratio is met with less than 0.5% to spare.
    const double target_bits = 16.0 * dim / target_ratio;
    double budget = target_bits, best_budget = -1.0;
    double lo = 0.0, hi = 8.0 * dim + 1.0;  // budgets known to meet / miss the target
    for (int round = 0; round < 24; ++round) {
      const double r = ratio_of(fit_at(budget));
      const double bits = 16.0 * dim / r;  // payload bits per token
      if (r >= target_ratio) {
        lo = std::max(lo, budget);
        best_budget = std::max(best_budget, budget);
        if (r < target_ratio * 1.005) break;
      } else {
        hi = std::min(hi, budget);
      }
      double next = budget - (bits - target_bits) - (r < target_ratio ? 0.002 * target_bits : 0.0);
      if (!(next > lo && next < hi)) next = 0.5 * (lo + hi);
      if (hi - lo < 1e-3) break;
      budget = next;
    }
    if (best_budget < 0) best_budget = lo;
    kvtc::HeadParams p = fit_at(best_budget);
    if (achieved_ratio) *achieved_ratio = ratio_of(p);
    return p;
  }
  if (target_ratio > 0.0) {
    // Largest budget (bits per token vector) meeting the ratio; the coded rate
    // is monotone in the budget up to entropy-coder noise, so bisection.
    int lo = 1, hi = 16 * dim;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      codec.bit_budget = mid;
      const auto trial = kvtc::fit_head(x.data(), n, dim, pca.mean, pca.components, pca.eigenvalues, codec);
      if (ratio_of(trial) >= target_ratio) lo = mid; else hi = mid - 1;
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
      const double ratio = t == 0 ? (o.key_target_ratio > 0 ? o.key_target_ratio : o.target_ratio)
                                  : (o.value_target_ratio > 0 ? o.value_target_ratio : o.target_ratio);
      dst = fit_one(t == 0 ? s.keys[size_t(l)] : s.values[size_t(l)], s.tokens, dim, o, ratio,
                    &ratios[size_t(2 * l + t)]);
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
  cal.info["allocator"] = o.measured_allocation ? "measured" : kvtc::allocator_name(o.codec.allocator);
  cal.info["coder"] = kvtc::coder_name(o.codec.coder);
  cal.info["target_ratio"] = o.target_ratio > 0 ? std::to_string(o.target_ratio) : "none";
  if (o.key_target_ratio > 0) cal.info["key_target_ratio"] = std::to_string(o.key_target_ratio);
  if (o.value_target_ratio > 0) cal.info["value_target_ratio"] = std::to_string(o.value_target_ratio);
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

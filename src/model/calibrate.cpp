#include "model/calibrate.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include <Eigen/Dense>

#include "alloc/allocator.hpp"
#include "core/first_exception.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"
#include "linalg/pca.hpp"
#include "model/eval.hpp"

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
  s.query_energy.assign(size_t(c.n_layers), std::vector<double>(size_t(V), 0.0));
  const std::vector<double> inv_freq = rope_inv_freq(D, c.rope_theta);
  const int group = c.n_heads / H;  // query heads per KV head
  std::vector<float> logits;
  for (int64_t w = 0; w < o.windows; ++w) {
    if (progress) progress(w, o.windows, "window " + std::to_string(o.first_window + w));
    Session session(model, method_cache_factory("fp16"));
    // Query energy of the non-sink tokens, per KV head and dimension, summed
    // over the group's query heads (q is [n, H_q * D], post-RoPE: a RoPE
    // pair's energy is the same before and after).
    session.set_query_observer([&](int layer, const float* q, int64_t n) {
      auto& e = s.query_energy[size_t(layer)];
      for (int64_t t = o.sinks; t < n; ++t)
        for (int h = 0; h < c.n_heads; ++h) {
          const float* qh = q + t * int64_t(c.n_heads) * D + int64_t(h) * D;
          double* eg = e.data() + int64_t(h / group) * D;
          for (int d = 0; d < D; ++d) eg[d] += double(qh[d]) * qh[d];
        }
    });
    const int32_t* tok = tokens.data() + (o.first_window + w) * o.window_length;
    s.window_tokens.emplace_back(tok, tok + per_window);
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
  // Means over tokens and query heads, averaged over each rotate-half pair
  // (i, i + D/2).
  for (auto& e : s.query_energy)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < D / 2; ++i) {
        double& a = e[size_t(h * D + i)];
        double& b = e[size_t(h * D + i + D / 2)];
        a = b = 0.5 * (a + b) / double(s.tokens * group);
      }
  if (progress) progress(o.windows, o.windows, "collected " + std::to_string(s.tokens) + " tokens per layer");
  return s;
}

std::pair<std::vector<float>, std::vector<float>> attention_weights(const LlamaModel& model,
                                                                    const CalibrationSamples& s, int layer,
                                                                    double floor) {
  const ModelConfig& c = model.config();
  const int H = c.n_kv_heads, D = c.head_dim, group = c.n_heads / H;
  if (layer < 0 || layer >= c.n_layers || s.query_energy.size() != size_t(c.n_layers) ||
      s.query_energy[size_t(layer)].size() != size_t(H) * size_t(D))
    throw Error(ErrorCode::kInvalidArgument, "attention_weights: no query energy for layer " + std::to_string(layer));
  // Output-projection column norms: wo is [hidden, H_q * D]; dimension d of
  // KV head g feeds columns (g * group + j) * D + d, j < group.
  const std::vector<float>& wo = model.weights().layers[size_t(layer)].wo;
  const int64_t qd = int64_t(c.n_heads) * D;
  std::vector<double> ve(size_t(H) * size_t(D), 0.0);
  for (int64_t row = 0; row < c.hidden_size; ++row)
    for (int64_t col = 0; col < qd; ++col) {
      const double v = wo[size_t(row * qd + col)];
      ve[size_t((col / D) / group * D + col % D)] += v * v;
    }
  auto normalise = [floor](const std::vector<double>& e) {
    double mean = 0.0;
    for (double v : e) mean += v;
    mean /= double(e.size());
    std::vector<float> w(e.size());
    for (size_t d = 0; d < e.size(); ++d)
      w[d] = float(std::sqrt(mean > 0 ? std::max(e[d] / mean, floor) : 1.0));
    return w;
  };
  return {normalise(s.query_energy[size_t(layer)]), normalise(ve)};
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

// Squared error and code histogram of one coefficient column on one of the
// codec's uniform grids of `levels` levels and step `step`:
//   midrise (half_offset): code = clamp(floor(c / step + levels / 2)),
//                          reconstruction (code - levels / 2 + 0.5) * step;
//   midtread:              code = clamp(floor(c / step + 0.5 + zero)),
//                          reconstruction (code - zero) * step, zero = levels / 2.
//
// centroid (not null): also the centroid reconstruction's offsets of the
// cells (kvtc::ComponentQuantizer::centroid: per class, the mean of |v| /
// step - |m| over its coefficients, clamped to [-1/2, 1/2] and rounded to
// f16 as stored) and, in *centroid_err, the error with them. The lattice's
// error returned is summed as without them, to the bit.
double grid_sq_error(const float* c, int64_t n, int64_t stride, double step, int levels, bool midtread,
                     std::vector<uint64_t>* counts, std::array<float, 3>* centroid = nullptr,
                     double* centroid_err = nullptr) {
  const double inv = 1.0 / step, half = levels / 2;
  const double code_offset = midtread ? half + 0.5 : half, zero = midtread ? half : half - 0.5;
  double err = 0.0;
  if (counts) counts->assign(size_t(levels), 0);
  // Per class: count, sum and sum of squares of e = |v| / step - |m| (v and
  // its lattice point m * step share their sign, or v is 0), so that the
  // class's error at offset o is step^2 (S2 - 2 o S1 + N o^2).
  double cnt[3] = {}, s1[3] = {}, s2[3] = {}, zero_cell = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = c[i * stride];
    const double code = std::clamp(std::floor(v * inv + code_offset), 0.0, double(levels - 1));
    const double r = (code - zero) * step;
    err += (v - r) * (v - r);
    if (counts) ++(*counts)[size_t(code)];
    if (!centroid) continue;
    const double m = code - zero;
    const int cls = kvtc::centroid_class(m);
    if (cls < 0) {
      zero_cell += v * v;
      continue;
    }
    const double e = std::fabs(v) * inv - std::fabs(m);
    cnt[cls] += 1, s1[cls] += e, s2[cls] += e * e;
  }
  if (centroid) {
    double ce = zero_cell;
    for (int k = 0; k < 3; ++k) {
      const double o = cnt[k] > 0 ? double(round_f16(float(std::clamp(s1[k] / cnt[k], -0.5, 0.5)))) : 0.0;
      (*centroid)[size_t(k)] = float(o);
      ce += step * step * std::max(0.0, s2[k] - 2 * o * s1[k] + cnt[k] * o * o);
    }
    *centroid_err = ce;
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

const char* reconstruction_name(Reconstruction r) {
  return r == Reconstruction::kLattice ? "lattice" : r == Reconstruction::kCentroid ? "centroid" : "centroid_allocated";
}

const char* quantizer_family_name(QuantizerFamily f) {
  return f == QuantizerFamily::kMidtread ? "midtread" : "midrise";
}

double midtread_step_ratio(int label) {
  if (label < 1 || label > kMidtreadChoices)
    throw Error(ErrorCode::kInvalidArgument, "midtread choice " + std::to_string(label) + " outside [1, " +
                                                 std::to_string(kMidtreadChoices) + "]");
  return 5.0 * std::pow(0.76, label - 1);
}


MeasuredTables measure_component_tables(const float* x, int64_t n, int dim, const std::vector<float>& mean,
                                        const std::vector<float>& components, const std::vector<int>& bit_choices,
                                        QuantizerFamily family, Reconstruction reconstruction) {
  const bool centroid = reconstruction != Reconstruction::kLattice;
  if (n < 1 || dim < 1 || mean.size() != size_t(dim) || components.size() != size_t(dim) * size_t(dim))
    throw Error(ErrorCode::kInvalidArgument, "measure_component_tables: " + std::to_string(n) + " tokens of dim " +
                                                 std::to_string(dim) + ", mean " + std::to_string(mean.size()) +
                                                 ", components " + std::to_string(components.size()));
  MeasuredTables t;
  t.family = family;
  if (family == QuantizerFamily::kMidtread) {
    for (int j = 0; j <= kMidtreadChoices; ++j) t.bit_choices.push_back(j);
  } else {
    for (int b : bit_choices)
      if (b < 0 || b > 12)
        throw Error(ErrorCode::kInvalidArgument, "measure_component_tables: width " + std::to_string(b) +
                                                     " outside [0, 12]");
    t.bit_choices = bit_choices;
  }
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
  const size_t J = t.bit_choices.size();
  t.rate.assign(size_t(dim), std::vector<double>(J, 0.0));
  t.distortion.assign(size_t(dim), std::vector<double>(J, 0.0));
  t.step.assign(size_t(dim), std::vector<double>(J, 0.0));
  t.levels.assign(size_t(dim), std::vector<int>(J, 1));
  if (centroid) {
    t.centroid.assign(size_t(dim), std::vector<std::array<float, 3>>(J, std::array<float, 3>{}));
    t.centroid_distortion = t.distortion;  // width 0: the same error (the mean)
  }
  // The step search runs on a subsample (every s-th token, >= 4096 tokens);
  // rate and distortion are then measured on every token at the chosen step.
  const int64_t sub = std::max<int64_t>(1, n / 4096);
  const int64_t n_sub = (n + sub - 1) / sub;
  FirstException failure;
#pragma omp parallel for schedule(dynamic, 1)
  for (int k = 0; k < dim; ++k) failure.capture([&] {
    const float* c = t.coeffs.data() + k;
    double energy = 0.0, largest = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      energy += double(c[i * dim]) * c[i * dim];
      largest = std::max(largest, double(std::fabs(c[i * dim])));
    }
    const double sigma = std::sqrt(energy / double(n));
    std::vector<uint64_t> counts;
    for (size_t j = 0; j < J; ++j) {
      const int b = t.bit_choices[j];
      if (b == 0) {
        t.distortion[size_t(k)][j] = energy / double(n);  // reconstructed as the mean
        if (centroid) t.centroid_distortion[size_t(k)][j] = t.distortion[size_t(k)][j];
        continue;
      }
      if (family == QuantizerFamily::kMidtread) {
        // The codec stores the step as f32; levels cover the largest
        // calibration coefficient (rarer outliers at run time are clamped):
        // every level needs a nonzero probability in the entropy model, so
        // unused levels cost rate. Within the codec's 4095-level limit.
        const double step = double(float(std::max(sigma * midtread_step_ratio(b), 1e-30)));
        const double half = std::clamp(std::ceil(largest / step - 0.5), 1.0, 2047.0);
        const int levels = 2 * int(half) + 1;
        t.step[size_t(k)][j] = step;
        t.levels[size_t(k)][j] = levels;
        double ce = 0.0;
        t.distortion[size_t(k)][j] =
            grid_sq_error(c, n, dim, step, levels, true, &counts, centroid ? &t.centroid[size_t(k)][j] : nullptr, &ce) /
            double(n);
        if (centroid) t.centroid_distortion[size_t(k)][j] = ce / double(n);
        t.rate[size_t(k)][j] = entropy_bits(counts, n);
        continue;
      }
      const int levels = 1 << b;
      // Golden-section search of the MSE over log(step) around the Gaussian
      // Lloyd-Max step (the data are rarely Gaussian: heavier tails want a
      // wider range, light ones a finer step).
      const double g = sigma > 0 ? sigma * 4.0 / double(levels) : 1e-30;
      auto mse = [&](double log_step) {
        return grid_sq_error(c, n_sub, dim * sub, std::exp(log_step), levels, false, nullptr);
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
      t.levels[size_t(k)][j] = levels;
      double ce = 0.0;
      t.distortion[size_t(k)][j] =
          grid_sq_error(c, n, dim, stored, levels, false, &counts, centroid ? &t.centroid[size_t(k)][j] : nullptr, &ce) /
          double(n);
      if (centroid) t.centroid_distortion[size_t(k)][j] = ce / double(n);
      t.rate[size_t(k)][j] = entropy_bits(counts, n);
    }
  });
  failure.rethrow();
  if (reconstruction == Reconstruction::kCentroidAllocated) t.distortion = t.centroid_distortion;
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
  const bool midtread = t.family == QuantizerFamily::kMidtread;
  for (int k = 0; k < dim; ++k) {
    const int b = bits[size_t(k)];
    if (b == 0) continue;
    const auto it = std::find(t.bit_choices.begin(), t.bit_choices.end(), b);
    if (it == t.bit_choices.end())
      throw Error(ErrorCode::kInvalidArgument, "build_head_params: choice " + std::to_string(b) + " not measured");
    const size_t j = size_t(it - t.bit_choices.begin());
    kvtc::ComponentQuantizer q;
    q.levels = uint16_t(t.levels[size_t(k)][j]);
    q.zero = uint16_t(q.levels / 2);
    q.half_offset = !midtread;
    q.step = float(t.step[size_t(k)][j]);
    if (!t.centroid.empty()) q.centroid = t.centroid[size_t(k)][j];
    // The width a fixed-width code would need (telemetry and pre-entropy size).
    int width = 0;
    while ((1 << width) < q.levels) ++width;
    p.bits[size_t(k)] = width;
    p.kept.push_back(uint16_t(k));
    p.quant.push_back(q);
    p.row_scale.push_back(0.0f);
    p.basis.insert(p.basis.end(), t.axes.begin() + int64_t(k) * dim, t.axes.begin() + int64_t(k + 1) * dim);
    p.fixed_widths.push_back(uint8_t(width));
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
    // Midtread alphabets are sparse in their tails: 3 bits above the
    // alphabet keep the slots of never-seen levels a small share.
    const uint32_t scale = std::clamp<uint32_t>(uint32_t(p.fixed_widths[size_t(k)]) + (midtread ? 3 : 1), 12,
                                                midtread ? 14 : 13);
    p.rans_tables.push_back(entropy::FrequencyTable::from_counts(counts, scale));
  }
  p.coder = kvtc::CoderChoice::kRans;
  p.build_decoders();
  return p;
}

namespace {

// Payload ratio (f16 bytes / entropy-coded bytes) of p on x's whole blocks.
double payload_ratio(const kvtc::HeadParams& p, const std::vector<float>& x, int64_t n, int dim) {
  const int64_t measured = (n / 64) * 64;
  const double bytes = payload_bytes(p, x.data(), measured, dim);
  return bytes > 0 ? double(measured) * dim * 2.0 / bytes : 1e30;
}

// Measured allocation meeting target_ratio (or bit_budget when target_ratio
// <= 0) from precomputed tables.
kvtc::HeadParams fit_measured(const MeasuredTables& t, const linalg::PcaBasis& pca, const std::vector<float>& x,
                              int64_t n, int dim, const CalibrateOptions& o, double target_ratio,
                              double* achieved_ratio) {
  const kvtc::CodecOptions& codec = o.codec;
  auto ratio_of = [&](const kvtc::HeadParams& p) { return payload_ratio(p, x, n, dim); };
  {
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
    // The rounds' budgets stay near target_bits: one DP table for budgets up
    // to 1.5x it gives each round's allocation by walking back from its
    // budget, the same bits as a DP per round (alloc::MeasuredAllocator); a
    // budget above it rebuilds the table for the bracket's top. A
    // cross-layer fit (768 components) ran up to 24 DPs per target.
    // Where a table would be over the DP's size limit, a DP per round.
    std::optional<alloc::MeasuredAllocator> table;
    double table_max = -1.0;
    auto fit_in_table = [&](double b) {
      if (b > table_max) {
        table.reset();
        table_max = b <= 1.5 * target_bits ? std::min(1.5 * target_bits, std::max(hi, target_bits))
                                           : std::max(hi, target_bits);
        try {
          table.emplace(t.rate, t.distortion, t.bit_choices, table_max);
        } catch (const Error&) {
          table_max = std::numeric_limits<double>::infinity();  // over the size limit: a DP per round
        }
      }
      if (!table) return fit_at(b);
      return build_head_params(t, x.data(), n, dim, pca.eigenvalues, table->at(b).bits);
    };
    for (int round = 0; round < 24; ++round) {
      const double r = ratio_of(fit_in_table(budget));
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
    kvtc::HeadParams p = fit_in_table(best_budget);
    if (achieved_ratio) *achieved_ratio = ratio_of(p);
    return p;
  }
}

kvtc::HeadParams fit_one(const std::vector<float>& x, int64_t n, int dim, const CalibrateOptions& o,
                         double target_ratio, double* achieved_ratio) {
  const linalg::PcaBasis pca = linalg::fit_pca(x.data(), n, dim);
  kvtc::CodecOptions codec = o.codec;
  auto ratio_of = [&](const kvtc::HeadParams& p) { return payload_ratio(p, x, n, dim); };
  if (o.measured_allocation) {
    const MeasuredTables t = measure_component_tables(x.data(), n, dim, pca.mean, pca.components, codec.bit_choices,
                                                      o.quantizers, o.reconstruction);
    return fit_measured(t, pca, x, n, dim, o, target_ratio, achieved_ratio);
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

std::vector<kvtc::HeadParams> fit_tensor_at_ratios(const std::vector<float>& x, int64_t n, int dim,
                                                   const CalibrateOptions& o, const std::vector<double>& targets,
                                                   std::vector<double>* achieved) {
  if (n < 64 || int64_t(x.size()) != n * dim)
    throw Error(ErrorCode::kInvalidArgument, "fit_tensor_at_ratios: x holds " + std::to_string(x.size()) +
                                                 " values, expected " + std::to_string(n) + " x " + std::to_string(dim) +
                                                 " with at least 64 tokens");
  std::vector<kvtc::HeadParams> out;
  if (achieved) achieved->assign(targets.size(), 0.0);
  if (!o.measured_allocation) {
    for (size_t i = 0; i < targets.size(); ++i) out.push_back(fit_one(x, n, dim, o, targets[i], achieved ? &(*achieved)[i] : nullptr));
    return out;
  }
  // One PCA and one set of measured tables serve every target.
  const linalg::PcaBasis pca = linalg::fit_pca(x.data(), n, dim);
  const MeasuredTables t = measure_component_tables(x.data(), n, dim, pca.mean, pca.components, o.codec.bit_choices,
                                                    o.quantizers, o.reconstruction);
  for (size_t i = 0; i < targets.size(); ++i)
    out.push_back(fit_measured(t, pca, x, n, dim, o, targets[i], achieved ? &(*achieved)[i] : nullptr));
  return out;
}

namespace {

// --- sensitivity-weighted allocation across tensors -------------------------

// An fp16 cache whose appended keys (or values) are first replaced by their
// reconstruction through one tensor's calibrated parameters (tokens at
// positions >= sinks; keys with RoPE removed and re-applied, weights applied
// and undone, as the calibrated cache does): one tensor of one layer carries
// the coding error, everything else is exact.
//
// window == 0: every token is coded as it is appended. window > 0 (batch 1):
// a token stays raw until it has left the window as a streaming cache would
// code it: an append of tokens [o, o + m) first codes the held raw tokens
// below sinks + floor((o + 1 - window - sinks) / block) * block (what the
// append's first query would see coded), re-appending them to the inner
// cache (trim, then append) as their reconstruction.
class ReconstructingCache final : public KVCache {
 public:
  ReconstructingCache(const CacheConfig& config, const kvtc::HeadParams& params, const std::vector<float>* scale,
                      bool is_key, int sinks, int window = 0, int block = 1)
      : inner_(make_cache("fp16", config)), params_(params), scale_(scale), is_key_(is_key), sinks_(sinks),
        window_(window), block_(std::max(block, 1)), coded_(sinks),
        inv_freq_(rope_inv_freq(config.head_dim, config.rope_theta)) {}

  std::string method() const override { return "reconstructing"; }
  const CacheConfig& config() const override { return inner_->config(); }
  int64_t offset() const override { return inner_->offset(); }
  bool is_trimmable() const override { return false; }
  int64_t trim(int64_t) override { throw Error(ErrorCode::kUnsupported, "sensitivity cache: trim"); }
  std::vector<uint8_t> save() const override { return inner_->save(); }
  void load(const uint8_t*, size_t) override { throw Error(ErrorCode::kUnsupported, "sensitivity cache: load"); }
  CacheStats stats() const override { return inner_->stats(); }
  void for_each_block(const BlockVisitor& visit) const override { inner_->for_each_block(visit); }

  void append(const TensorView& keys, const TensorView& values) override {
    if (window_ > 0) return append_windowed(keys, values);
    const TensorView& src = is_key_ ? keys : values;
    const int64_t B = src.shape[0], H = src.shape[1], n = src.shape[2], D = src.shape[3], V = H * D;
    std::vector<float> heads(size_t(B * H * n * D)), x(size_t(n * V));
    copy_to_contiguous(src, heads.data(), DType::kF32);
    const int64_t first = std::max<int64_t>(0, sinks_ - offset());  // first coded token of this append
    for (int64_t b = 0; b < B; ++b) {
      float* hb = heads.data() + b * H * n * D;
      to_rows(hb, H, n, D, x.data());
      if (n - first > 0) reconstruct_rows(x.data() + first * V, n - first, offset() + first, H, D);
      from_rows(x.data(), H, n, D, hb);
    }
    const TensorView changed = TensorView::contiguous(heads.data(), DType::kF32, {B, H, n, D});
    const TensorView& other = is_key_ ? values : keys;
    inner_->append(is_key_ ? changed : other, is_key_ ? other : changed);
  }

 private:
  // [H, n, D] <-> token-major [n, H * D]
  static void to_rows(const float* heads, int64_t H, int64_t n, int64_t D, float* rows) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < n; ++t) std::copy_n(heads + (h * n + t) * D, D, rows + (t * H + h) * D);
  }
  static void from_rows(const float* rows, int64_t H, int64_t n, int64_t D, float* heads) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < n; ++t) std::copy_n(rows + (t * H + h) * D, D, heads + (h * n + t) * D);
  }

  // Token rows xs [m, H * D] at positions first.. replaced by their reconstruction.
  void reconstruct_rows(float* xs, int64_t m, int64_t first, int64_t H, int64_t D) const {
    const int64_t V = H * D;
    if (is_key_) rope_rotate_tokens(xs, m, int(H), int(D), first, inv_freq_, /*inverse=*/true);
    if (scale_)
      for (int64_t t = 0; t < m; ++t)
        for (int64_t d = 0; d < V; ++d) xs[t * V + d] *= (*scale_)[size_t(d)];
    std::vector<uint16_t> codes(size_t(m) * size_t(params_.n_kept()));
    kvtc::quantize_block(params_, xs, m, codes.data());
    kvtc::dequantize_block(params_, codes.data(), m, xs);
    if (scale_)
      for (int64_t t = 0; t < m; ++t)
        for (int64_t d = 0; d < V; ++d) xs[t * V + d] /= (*scale_)[size_t(d)];
    if (is_key_) rope_rotate_tokens(xs, m, int(H), int(D), first, inv_freq_, /*inverse=*/false);
  }

  void append_windowed(const TensorView& keys, const TensorView& values) {
    const int64_t H = keys.shape[1], n = keys.shape[2], D = keys.shape[3], V = H * D;
    if (keys.shape[0] != 1) throw Error(ErrorCode::kUnsupported, "sensitivity cache with a window: batch 1 only");
    const int64_t o = offset();
    // Code what the first query of this append would see coded.
    const int64_t reach = o + 1 - window_ - sinks_;
    const int64_t target = std::min<int64_t>(o, sinks_ + (reach > 0 ? reach / block_ * block_ : 0));
    if (target > coded_) {
      const int64_t held = o - coded_;  // raw tokens [coded_, o) in pending_k_ / pending_v_
      inner_->trim(held);
      std::vector<float>& pend = is_key_ ? pending_k_ : pending_v_;
      reconstruct_rows(pend.data(), target - coded_, coded_, H, D);
      std::vector<float> kh(size_t(held * V)), vh(size_t(held * V));
      from_rows(pending_k_.data(), H, held, D, kh.data());
      from_rows(pending_v_.data(), H, held, D, vh.data());
      inner_->append(TensorView::contiguous(kh.data(), DType::kF32, {1, H, held, D}),
                     TensorView::contiguous(vh.data(), DType::kF32, {1, H, held, D}));
      const size_t drop = size_t((target - coded_) * V);
      pending_k_.erase(pending_k_.begin(), pending_k_.begin() + ptrdiff_t(drop));
      pending_v_.erase(pending_v_.begin(), pending_v_.begin() + ptrdiff_t(drop));
      coded_ = target;
    }
    // The new tokens at positions >= sinks stay raw (pending) until coded.
    const int64_t first = std::max<int64_t>(0, coded_ - o);
    if (n > first) {
      std::vector<float> heads(size_t(H * n * D)), rows(size_t(n * V));
      for (int kv = 0; kv < 2; ++kv) {
        copy_to_contiguous(kv == 0 ? keys : values, heads.data(), DType::kF32);
        to_rows(heads.data(), H, n, D, rows.data());
        std::vector<float>& pend = kv == 0 ? pending_k_ : pending_v_;
        pend.insert(pend.end(), rows.begin() + first * V, rows.end());
      }
    }
    inner_->append(keys, values);
  }

  std::unique_ptr<KVCache> inner_;
  const kvtc::HeadParams& params_;
  const std::vector<float>* scale_;
  bool is_key_;
  int sinks_;
  int window_, block_;
  int64_t coded_;                              // window > 0: tokens below this are coded (or sinks)
  std::vector<float> pending_k_, pending_v_;   // window > 0: raw rows [coded_, offset) [*, H * D]
  std::vector<double> inv_freq_;
};

}  // namespace

std::unique_ptr<KVCache> make_reconstructing_cache(const CacheConfig& config, const kvtc::HeadParams& params,
                                                   const std::vector<float>* scale, bool is_key, int sinks,
                                                   int stream_window, int stream_block) {
  return std::make_unique<ReconstructingCache>(config, params, scale, is_key, sinks, stream_window, stream_block);
}

// Mean KL(clean || one tensor coded) over the non-sink positions of the first
// `windows` calibration windows, for every tensor (order: layer 0 key,
// layer 0 value, layer 1 key, ...). stream_window > 0: measured as a
// streaming cache codes (CalibrateOptions::sensitivity_window).
std::vector<double> measure_tensor_kl(const LlamaModel& model, const CalibrationSamples& s,
                                      const KvtcCalibration& cal, int windows, int sinks, int stream_window,
                                      int stream_block, const CalibrationProgress& progress) {
  const ModelConfig& c = model.config();
  const int vocab = c.vocab_size;
  const int tensors = 2 * c.n_layers;
  std::vector<double> kl(size_t(tensors), 0.0);
  int64_t scored = 0;
  std::vector<float> logits;
  std::vector<double> lp;
  windows = std::min<int>(windows, int(s.window_tokens.size()));
  for (int w = 0; w < windows; ++w) {
    const std::vector<int32_t>& tok = s.window_tokens[size_t(w)];
    const int64_t n = int64_t(tok.size());
    // With a stream window the runs go in chunks of stream_block tokens
    // (the clean one too, so that both sum their attention alike).
    const int64_t chunk = stream_window > 0 ? std::max(stream_block, 1) : n;
    const auto run_all = [&](Session& run) {
      std::vector<float> part;
      logits.resize(size_t(n) * size_t(vocab));
      for (int64_t a = 0; a < n; a += chunk) {
        const int64_t m = std::min(chunk, n - a);
        run.forward(tok.data() + a, m, part, /*all_logits=*/true);
        std::copy_n(part.data(), size_t(m) * size_t(vocab), logits.data() + a * vocab);
      }
    };
    {
      Session clean(model, method_cache_factory("fp16"));
      if (stream_window > 0) run_all(clean);
      else clean.forward(tok.data(), n, logits, /*all_logits=*/true);
    }
    std::vector<double> ref(size_t(n) * size_t(vocab));
    for (int64_t i = 0; i < n; ++i) {
      log_softmax(logits.data() + i * vocab, vocab, lp);
      std::copy(lp.begin(), lp.end(), ref.begin() + i * vocab);
    }
    for (int t = 0; t < tensors; ++t) {
      const int layer = t / 2;
      const bool is_key = t % 2 == 0;
      const kvtc::HeadParams& p = (is_key ? cal.keys : cal.values)[size_t(layer)];
      const std::vector<float>* scale =
          cal.weighted() ? &(is_key ? cal.key_scale : cal.value_scale)[size_t(layer)] : nullptr;
      CacheFactory factory = [&](const CacheConfig& cc) -> std::unique_ptr<KVCache> {
        if (cc.layer == layer)
          return std::make_unique<ReconstructingCache>(cc, p, scale, is_key, sinks, stream_window, stream_block);
        return make_cache("fp16", cc);
      };
      Session run(model, factory);
      if (stream_window > 0) run_all(run);
      else run.forward(tok.data(), n, logits, /*all_logits=*/true);
      double sum = 0.0;
      for (int64_t i = sinks; i < n; ++i) {
        log_softmax(logits.data() + i * vocab, vocab, lp);
        const double* r = ref.data() + i * vocab;
        double k = 0.0;
        for (int v = 0; v < vocab; ++v) k += std::exp(r[v]) * (r[v] - lp[size_t(v)]);
        sum += std::max(0.0, k);
      }
      kl[size_t(t)] += sum;
      if (progress)
        progress(int64_t(w) * tensors + t + 1, int64_t(windows) * tensors,
                 "sensitivity: window " + std::to_string(w) + ", layer " + std::to_string(layer) +
                     (is_key ? " key" : " value"));
    }
    scored += n - sinks;
  }
  for (double& v : kl) v /= double(std::max<int64_t>(scored, 1));
  return kl;
}

namespace {

// Predicted distortion (sum over components of the measured table) of widths.
double predicted_distortion(const MeasuredTables& t, const std::vector<int>& bits) {
  double d = 0.0;
  for (size_t k = 0; k < bits.size(); ++k) {
    const auto it = std::find(t.bit_choices.begin(), t.bit_choices.end(), bits[k]);
    d += t.distortion[k][size_t(it - t.bit_choices.begin())];
  }
  return d;
}

// Widths minimising alpha * distortion + lambda * rate per component (the
// Lagrangian of sum_t alpha_t D_t under a total rate), and their total
// measured rate in bits per token vector.
std::vector<int> lagrangian_widths(const MeasuredTables& t, double alpha, double lambda, double* rate) {
  std::vector<int> bits(t.rate.size(), 0);
  for (size_t k = 0; k < t.rate.size(); ++k) {
    size_t best = 0;
    double best_cost = 0.0;
    for (size_t j = 0; j < t.bit_choices.size(); ++j) {
      const double cost = alpha * t.distortion[k][j] + lambda * t.rate[k][j];
      if (j == 0 || cost < best_cost) {
        best = j;
        best_cost = cost;
      }
    }
    bits[k] = t.bit_choices[best];
    *rate += t.rate[k][best];
  }
  return bits;
}

}  // namespace

KvtcCalibration fit_calibration(const ModelConfig& config, const std::string& config_hash,
                                const CalibrationSamples& s, const CalibrateOptions& o,
                                const CalibrationProgress& progress, const LlamaModel* model,
                                std::vector<TensorSensitivity>* sensitivities) {
  if (sensitivities) sensitivities->clear();
  if (o.attention_weighting && !model)
    throw Error(ErrorCode::kInvalidArgument, "fit_calibration: attention weighting needs the model");
  if (o.attention_weighting && !(o.weight_floor > 0.0 && o.weight_floor <= 1.0))
    throw_config_error("kvtc.weight_floor", std::to_string(o.weight_floor), "(0, 1]");
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
  const int L = config.n_layers;
  if (o.sensitivity_allocation) {
    if (!model) throw Error(ErrorCode::kInvalidArgument, "fit_calibration: sensitivity allocation needs the model");
    if (!o.measured_allocation)
      throw_config_error("kvtc.sensitivity", "kl", "allocator=measured (the allocation is on measured tables)");
    if (!(o.target_ratio > 0.0 || (o.key_target_ratio > 0.0 && o.value_target_ratio > 0.0)))
      throw_config_error("kvtc.sensitivity", "kl", "a target_ratio (the total payload to share out)");
    if (o.sensitivity_windows < 1 || size_t(o.sensitivity_windows) > s.window_tokens.size())
      throw_config_error("kvtc.sensitivity_windows", std::to_string(o.sensitivity_windows),
                         "[1, calibration windows = " + std::to_string(s.window_tokens.size()) + "]");
  }
  // Per tensor (t = 2 * layer + {0 key, 1 value}) the data the codec is
  // fitted on: x * w when weighted (copies; the samples are shared by every
  // fit of a --target-ratios run).
  std::vector<std::vector<float>> weighted(size_t(2 * L));
  if (o.attention_weighting)
    for (int l = 0; l < L; ++l) {
      auto [kw, vw] = attention_weights(*model, s, l, o.weight_floor);
      for (int t = 0; t < 2; ++t) {
        const std::vector<float>& w = t == 0 ? kw : vw;
        auto& x = weighted[size_t(2 * l + t)];
        x = t == 0 ? s.keys[size_t(l)] : s.values[size_t(l)];
        for (int64_t i = 0; i < s.tokens; ++i)
          for (int d = 0; d < dim; ++d) x[size_t(i * dim + d)] *= w[size_t(d)];
      }
      cal.key_scale.push_back(std::move(kw));
      cal.value_scale.push_back(std::move(vw));
    }
  auto data = [&](int t) -> const std::vector<float>& {
    return o.attention_weighting ? weighted[size_t(t)] : t % 2 == 0 ? s.keys[size_t(t / 2)] : s.values[size_t(t / 2)];
  };
  auto tensor_ratio = [&](int t) {
    return t % 2 == 0 ? (o.key_target_ratio > 0 ? o.key_target_ratio : o.target_ratio)
                      : (o.value_target_ratio > 0 ? o.value_target_ratio : o.target_ratio);
  };
  auto params_of = [&](int t) -> kvtc::HeadParams& {
    return t % 2 == 0 ? cal.keys[size_t(t / 2)] : cal.values[size_t(t / 2)];
  };
  std::vector<double> ratios(size_t(2 * L));
  auto report_layer = [&](int l, const std::string& what) {
    if (!progress) return;
    std::ostringstream m;
    m.precision(3);
    m << what << "layer " << l << ": key " << cal.keys[size_t(l)].n_kept() << " components, payload ratio "
      << ratios[size_t(2 * l)] << "x; value " << cal.values[size_t(l)].n_kept() << " components, "
      << ratios[size_t(2 * l + 1)] << "x";
    progress(l + 1, L, m.str());
  };
  // Measured tables, kept for the global allocation.
  std::vector<MeasuredTables> tables(o.sensitivity_allocation ? size_t(2 * L) : 0);
  std::vector<linalg::PcaBasis> bases(tables.size());
  for (int l = 0; l < L; ++l) {
    if (progress) progress(l, L, "fitting layer " + std::to_string(l));
    if (!o.sensitivity_allocation) {
      // Keys and values of a layer in parallel (each fit is single-threaded).
      FirstException failure;
#pragma omp parallel for num_threads(2) schedule(static)
      for (int t = 2 * l; t < 2 * l + 2; ++t)
        failure.capture([&] { params_of(t) = fit_one(data(t), s.tokens, dim, o, tensor_ratio(t), &ratios[size_t(t)]); });
      failure.rethrow();
    } else {
      for (int t = 2 * l; t < 2 * l + 2; ++t) {
        bases[size_t(t)] = linalg::fit_pca(data(t).data(), s.tokens, dim);
        MeasuredTables& mt = tables[size_t(t)];
        mt = measure_component_tables(data(t).data(), s.tokens, dim, bases[size_t(t)].mean,
                                      bases[size_t(t)].components, o.codec.bit_choices, o.quantizers,
                                      o.reconstruction);
        mt.coeffs = {};  // not needed past the tables
        params_of(t) = fit_measured(mt, bases[size_t(t)], data(t), s.tokens, dim, o, tensor_ratio(t),
                                    &ratios[size_t(t)]);
      }
    }
    report_layer(l, "");
  }
  if (o.sensitivity_allocation) {
    // Sensitivity of each tensor at its equal-ratio fit.
    const std::vector<double> kl = measure_tensor_kl(*model, s, cal, o.sensitivity_windows, o.sinks, o.sensitivity_window,
                                                     o.sensitivity_block, progress);
    std::vector<double> alpha(size_t(2 * L));
    std::ostringstream sens;
    sens.precision(4);
    for (int t = 0; t < 2 * L; ++t) {
      TensorSensitivity ts;
      ts.kl = kl[size_t(t)];
      ts.distortion = predicted_distortion(tables[size_t(t)], params_of(t).bits);
      alpha[size_t(t)] = ts.per_distortion();
      if (sensitivities) sensitivities->push_back(ts);
      sens << (t ? " " : "") << "L" << t / 2 << (t % 2 == 0 ? "K" : "V") << "=" << ts.kl;
    }
    cal.info["sensitivity_kl"] = sens.str();
    if (o.sensitivity_window > 0)
      cal.info["sensitivity_measured"] = "streaming: raw window " + std::to_string(o.sensitivity_window) +
                                         ", block " + std::to_string(o.sensitivity_block);
    // One Lagrangian allocation over every tensor's components under the
    // total payload the per-tensor targets give; the multiplier is bisected
    // on the measured rates, then the total corrected by the coder's real
    // payload (as fit_measured does for one tensor).
    double target_bits = 0.0;
    for (int t = 0; t < 2 * L; ++t) target_bits += 16.0 * dim / tensor_ratio(t);
    double budget = target_bits, best_bits = -1.0;
    std::vector<kvtc::HeadParams> best;
    for (int round = 0; round < 10; ++round) {
      auto total_rate = [&](double lambda, std::vector<std::vector<int>>* widths) {
        double rate = 0.0;
        for (int t = 0; t < 2 * L; ++t) {
          std::vector<int> b = lagrangian_widths(tables[size_t(t)], alpha[size_t(t)], lambda, &rate);
          if (widths) (*widths)[size_t(t)] = std::move(b);
        }
        return rate;
      };
      double lo = -40.0, hi = 40.0;  // log10 lambda: rate falls as lambda grows
      for (int it = 0; it < 100; ++it) {
        const double mid = 0.5 * (lo + hi);
        if (total_rate(std::pow(10.0, mid), nullptr) > budget) lo = mid; else hi = mid;
      }
      std::vector<std::vector<int>> widths(size_t(2 * L));
      total_rate(std::pow(10.0, hi), &widths);
      std::vector<kvtc::HeadParams> trial(size_t(2 * L));
      double bits = 0.0;
      FirstException failure;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : bits)
      for (int t = 0; t < 2 * L; ++t)
        failure.capture([&] {
          trial[size_t(t)] = build_head_params(tables[size_t(t)], data(t).data(), s.tokens, dim,
                                               bases[size_t(t)].eigenvalues, widths[size_t(t)]);
          bits += 16.0 * dim / payload_ratio(trial[size_t(t)], data(t), s.tokens, dim);
        });
      failure.rethrow();
      if (progress) {
        std::ostringstream m;
        m.precision(4);
        m << "global allocation round " << round << ": " << bits << " payload bits per token (target "
          << target_bits << ")";
        progress(round + 1, 10, m.str());
      }
      if (bits <= target_bits && bits > best_bits) {
        best_bits = bits;
        best = std::move(trial);
      }
      if (bits <= target_bits && bits > target_bits * 0.995) break;
      budget -= (bits - target_bits) + (bits > target_bits ? 0.002 * target_bits : 0.0);
    }
    if (best.empty())
      throw Error(ErrorCode::kInternal, "calibrate: the global allocation did not meet the payload target");
    for (int t = 0; t < 2 * L; ++t) {
      params_of(t) = std::move(best[size_t(t)]);
      ratios[size_t(t)] = payload_ratio(params_of(t), data(t), s.tokens, dim);
    }
    for (int l = 0; l < L; ++l) report_layer(l, "global: ");
  }
  if (o.refine_ratio > 0.0) {
    // Residuals of the calibration tokens after the final base code, in the
    // space the codec works in (weighted, RoPE removed); the refinement codec
    // is fitted on them like a base tensor.
    if (!o.measured_allocation) throw_config_error("kvtc.refine_ratio", std::to_string(o.refine_ratio),
                                                   "unset unless allocator=measured");
    cal.key_refine.resize(size_t(L));
    cal.value_refine.resize(size_t(L));
    std::vector<double> refine_ratios(size_t(2 * L));
    FirstException failure;
#pragma omp parallel for num_threads(2) schedule(dynamic, 1)
    for (int t = 0; t < 2 * L; ++t) failure.capture([&] {
      const kvtc::HeadParams& base = params_of(t);
      const std::vector<float>& x = data(t);
      std::vector<uint16_t> codes(size_t(s.tokens) * size_t(base.n_kept()));
      std::vector<float> residual(x.size());
      kvtc::quantize_block(base, x.data(), s.tokens, codes.data());
      kvtc::dequantize_block(base, codes.data(), s.tokens, residual.data());
      for (size_t i = 0; i < x.size(); ++i) residual[i] = x[i] - residual[i];
      const linalg::PcaBasis pca = linalg::fit_pca(residual.data(), s.tokens, dim);
      const MeasuredTables mt = measure_component_tables(residual.data(), s.tokens, dim, pca.mean, pca.components,
                                                         o.codec.bit_choices, o.quantizers,
                                                         o.reconstruction);
      (t % 2 == 0 ? cal.key_refine : cal.value_refine)[size_t(t / 2)] =
          fit_measured(mt, pca, residual, s.tokens, dim, o, o.refine_ratio, &refine_ratios[size_t(t)]);
    });
    failure.rethrow();
    if (progress)
      for (int l = 0; l < L; ++l) {
        std::ostringstream m;
        m.precision(3);
        m << "refinement layer " << l << ": key " << cal.key_refine[size_t(l)].n_kept() << " components, "
          << refine_ratios[size_t(2 * l)] << "x; value " << cal.value_refine[size_t(l)].n_kept() << " components, "
          << refine_ratios[size_t(2 * l + 1)] << "x";
        progress(l + 1, L, m.str());
      }
    cal.info["refine_ratio"] = std::to_string(o.refine_ratio);
  }
  std::ostringstream info;
  cal.info["tokens_per_layer"] = std::to_string(s.tokens);
  cal.info["sinks"] = std::to_string(o.sinks);
  cal.info["windows"] = std::to_string(o.first_window) + "-" + std::to_string(o.first_window + o.windows - 1);
  cal.info["allocator"] = o.measured_allocation ? "measured" : kvtc::allocator_name(o.codec.allocator);
  cal.info["coder"] = kvtc::coder_name(o.codec.coder);
  if (o.measured_allocation) cal.info["quantizers"] = quantizer_family_name(o.quantizers);
  if (o.reconstruction != Reconstruction::kLattice) cal.info["reconstruction"] = reconstruction_name(o.reconstruction);
  cal.info["allocation"] = o.sensitivity_allocation ? "global by KL sensitivity (" + std::to_string(o.sensitivity_windows) + " windows)" : "per tensor";
  cal.info["weighting"] = o.attention_weighting ? "attention (floor " + std::to_string(o.weight_floor) + ")" : "none";
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

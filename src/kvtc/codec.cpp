#include "kvtc/codec.hpp"

#include <Eigen/Core>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "alloc/allocator.hpp"
#include "core/cpu_features.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"
#include "core/held_bytes.hpp"
#include "kvtc/block_codes.hpp"
#include "kvtc/step_error.hpp"
#include "kvtc/proj8.hpp"
#include "kvtc/recon8.hpp"
#include "kvtc/raw_convert.hpp"

// The AVX2/FMA/F16C kernels below are compiled for those alone and run
// where simd_avx2(); every one has a plain counterpart giving the same bits.
#ifdef KVCODEC_HAVE_AVX2_PATHS
#include <immintrin.h>
#define KVCODEC_KVTC_GEMM 1
#endif

namespace kvcodec::kvtc {

namespace {

// See HeadParams::kernels and HeadKernels::set: hand-assembled parameters (kNone) take the plain
// paths; a set built without `need` must not (other codes or bits).
void require_kernels(const HeadParams& p, KernelSet need, const char* who) {
  if (p.kernel_set() == KernelSet::kNone || (uint8_t(p.kernel_set()) & uint8_t(need))) return;
  throw Error(ErrorCode::kInvalidArgument, std::string(who) + ": parameters built for " +
                                               (need == KernelSet::kEncode ? "decoding" : "encoding") +
                                               " only (HeadKernels::build)");
}

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstRowMap = Eigen::Map<const RowMatrix>;
using RowMap = Eigen::Map<RowMatrix>;

// Step of the MSE-optimal uniform quantizer of a unit Gaussian with 2^b
// levels (Max 1960 / Lloyd), b = 1..8; beyond 8 bits each bit halves it.
double gaussian_uniform_step(int bits) {
  static const double kStep[9] = {0.0, 1.596, 0.9957, 0.5860, 0.3352, 0.1881, 0.1041, 0.0568, 0.0307};
  if (bits <= 8) return kStep[bits];
  return kStep[8] * std::ldexp(1.0, 8 - bits);
}

float round_f16(float v) { return f16_to_f32(f32_to_f16(v)); }

// What code value reconstructs to 0 ((code - recon_offset) * step).
float recon_offset(const ComponentQuantizer& q) {
  return q.half_offset ? float(q.levels / 2) - 0.5f : float(q.zero);
}

int ceil_log2(uint32_t v) {
  int b = 0;
  while ((1u << b) < v) ++b;
  return b;
}

// Empirical entropy (bits per symbol) of round(c / step) over n samples.
double measured_entropy(const float* coeffs, int64_t n, int stride, double step,
                        std::vector<uint32_t>& scratch) {
  if (n == 0) return 0.0;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (int64_t i = 0; i < n; ++i) {
    const double v = std::floor(coeffs[i * stride] / step + 0.5);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  const double span = hi - lo + 1;
  if (span <= 1) return 0.0;
  if (span > 1e6) return std::log2(double(n));  // pathological: treat as incompressible
  scratch.assign(size_t(span), 0);
  for (int64_t i = 0; i < n; ++i)
    ++scratch[size_t(std::floor(coeffs[i * stride] / step + 0.5) - lo)];
  double h = 0.0;
  for (uint32_t c : scratch)
    if (c) h -= double(c) * std::log2(double(c) / double(n));
  return h / double(n);
}

// Projects x [n, D] on every stored axis of p (fit-time helper, all D rows).
RowMatrix project_all(const float* x, int64_t n, int dim, const std::vector<float>& mean,
                      const std::vector<float>& axes, int n_axes) {
  ConstRowMap xm(x, n, dim);
  Eigen::Map<const Eigen::RowVectorXf> mu(mean.data(), dim);
  ConstRowMap basis(axes.data(), n_axes, dim);
  RowMatrix centred = xm.rowwise() - mu;
  return centred * basis.transpose();
}

// Squared error sum of the fit tokens x [n, D] through the codec of h, as a
// decoder reconstructs them (codes by quantize_block, values by
// dequantize_block), in double.
double codec_squared_error(const HeadParams& h, const float* x, int64_t n) {
  const size_t D = size_t(h.dim);
  std::vector<uint16_t> codes(size_t(n) * size_t(h.n_kept()));
  std::vector<float> rec(size_t(n) * D);
  quantize_block(h, x, n, codes.data());
  dequantize_block(h, codes.data(), n, rec.data());
  double err = 0.0;
  for (size_t i = 0; i < rec.size(); ++i) {
    const double e = double(rec[i]) - double(x[i]);
    err += e * e;
  }
  return err;
}

}  // namespace

int centroid_class(double m) {
  const double a = std::fabs(m);
  if (a < 0.25) return -1;  // the zero cell (midtread m = 0)
  // midtread |m| = 1, 2, 3.. and midrise 1/2, 3/2, 5/2..: floor(|m| - 1/4)
  // is 0 at both grids' first cell, 1 at the second, 2 from the third on.
  return int(std::min(2.0, std::floor(a - 0.25)));
}

double reconstruction_steps(const ComponentQuantizer& q, uint32_t code) {
  const double m = double(code) - double(recon_offset(q));
  if (!q.has_centroid()) return m;
  const int c = centroid_class(m);
  if (c < 0) return 0.0;
  return std::copysign(std::fabs(m) + double(q.centroid[size_t(c)]), m);
}

const char* allocator_name(Allocator a) { return a == Allocator::kDp ? "dp" : "rate"; }

const char* coder_name(CoderChoice c) {
  switch (c) {
    case CoderChoice::kRans: return "rans";
    case CoderChoice::kHuffman: return "huffman";
    case CoderChoice::kFixed: return "fixed";
    case CoderChoice::kAuto: return "auto";
  }
  return "?";
}

HeadParams fit_head(const float* x, int64_t n, int dim, const std::vector<float>& mean,
                    const std::vector<float>& components, const std::vector<double>& eigenvalues,
                    const CodecOptions& options) {
  // The kernels the encoder will code with: the fit measures what they give.
  const KernelSet kernels = options.int8_kernels ? KernelSet::kBoth | KernelSet::kInt8 : KernelSet::kBoth;
  if (n < 1 || dim < 1) throw Error(ErrorCode::kInvalidArgument, "kvtc fit needs tokens and dim >= 1");
  for (const int b : options.bit_choices)
    if (b < 0 || b > kMaxComponentBits)
      throw Error(ErrorCode::kInvalidArgument, "kvtc fit: bit choice " + std::to_string(b) + " outside [0, " +
                                                   std::to_string(kMaxComponentBits) + "]");
  HeadParams p;
  p.dim = dim;
  p.basis_bits = options.basis_bits;
  p.eigenvalues = eigenvalues;
  p.mean.resize(size_t(dim));
  for (int d = 0; d < dim; ++d) p.mean[size_t(d)] = round_f16(mean[size_t(d)]);

  // Round the whole basis as it would be stored, so the allocation and the
  // quantizer ranges see the coefficients the encoder will really produce.
  std::vector<float> stored_axes(components.size());
  std::vector<float> axis_scale(size_t(dim), 0.0f);
  if (options.basis_bits == 16) {
    for (size_t i = 0; i < components.size(); ++i) stored_axes[i] = round_f16(components[i]);
  } else {
    // int8 rows with an f16 scale: scale = max|row| / 127.
    for (int k = 0; k < dim; ++k) {
      const float* row = &components[size_t(k) * size_t(dim)];
      float amax = 0.0f;
      for (int d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(row[d]));
      const float scale = round_f16(amax / 127.0f);
      axis_scale[size_t(k)] = scale;
      for (int d = 0; d < dim; ++d)
        stored_axes[size_t(k) * size_t(dim) + size_t(d)] =
            scale == 0.0f ? 0.0f : float(std::clamp(std::nearbyint(row[d] / scale), -127.0f, 127.0f)) * scale;
    }
  }
  RowMatrix coeffs = project_all(x, n, dim, p.mean, stored_axes, dim);  // [n, D]

  std::vector<ComponentQuantizer> quant(static_cast<size_t>(dim));
  // The rate allocator's quantizers at one step for every component: the
  // codes span the fit coefficients' range (at most 4096 levels); a
  // component whose codes are all equal keeps levels 0 and drops out. The
  // ranges do not depend on the step: found once, lazily (dp needs none).
  std::vector<float> coef_min, coef_max;
  auto uniform_quantizers = [&](double step) {
    if (coef_min.empty()) {
      coef_min.assign(size_t(dim), std::numeric_limits<float>::infinity());
      coef_max.assign(size_t(dim), -std::numeric_limits<float>::infinity());
      for (int64_t i = 0; i < n; ++i)
        for (int k = 0; k < dim; ++k) {
          coef_min[size_t(k)] = std::min(coef_min[size_t(k)], coeffs(i, k));
          coef_max[size_t(k)] = std::max(coef_max[size_t(k)], coeffs(i, k));
        }
    }
    std::vector<ComponentQuantizer> out(static_cast<size_t>(dim));
    for (int k = 0; k < dim; ++k) {
      const double lo_code = std::floor(coef_min[size_t(k)] / step + 0.5);
      const double hi_code = std::floor(coef_max[size_t(k)] / step + 0.5);
      const double levels = hi_code - lo_code + 1;
      if (levels <= 1) continue;
      ComponentQuantizer& q = out[size_t(k)];
      q.levels = uint16_t(std::min(levels, 4096.0));
      q.zero = uint16_t(std::clamp(-lo_code, 0.0, double(q.levels - 1)));
      q.half_offset = false;
      q.step = float(step);
    }
    return out;
  };
  // Keeps in h the components of more than one level: their quantizers,
  // int8 row scales and stored axes.
  auto keep_components = [&](HeadParams& h, const std::vector<ComponentQuantizer>& q) {
    for (int k = 0; k < dim; ++k)
      if (q[size_t(k)].levels > 1) {
        h.kept.push_back(uint16_t(k));
        h.quant.push_back(q[size_t(k)]);
        h.row_scale.push_back(axis_scale[size_t(k)]);
        h.basis.insert(h.basis.end(), stored_axes.begin() + int64_t(k) * dim, stored_axes.begin() + int64_t(k + 1) * dim);
      }
  };
  p.bits.assign(size_t(dim), 0);
  const int budget = options.bit_budget > 0 ? options.bit_budget : 4 * dim;

  if (options.allocator == Allocator::kDp) {
    std::vector<double> variances(static_cast<size_t>(dim));
    for (int k = 0; k < dim; ++k) variances[size_t(k)] = std::max(0.0, eigenvalues[size_t(k)]);
    const alloc::AllocationResult a = alloc::allocate_bits_dp(variances, budget, options.bit_choices, options.beta);
    for (int k = 0; k < dim; ++k) {
      const int b = a.bits[size_t(k)];
      if (b == 0) continue;
      const double sigma = std::sqrt(variances[size_t(k)]);
      ComponentQuantizer& q = quant[size_t(k)];
      q.levels = uint16_t(1u << b);
      q.half_offset = true;
      q.zero = uint16_t(q.levels / 2);
      q.step = float(std::max(gaussian_uniform_step(b) * sigma, 1e-30));
      p.bits[size_t(k)] = b;
    }
  } else {
    // One step for all components (reverse water-filling for entropy-coded
    // uniform quantizers): bisect log2(step) until the measured entropy of the
    // fit codes meets the budget. Components whose codes are all 0 drop out.
    std::vector<uint32_t> scratch;
    auto rate_at = [&](double step) {
      double bits = 0.0;
      for (int k = 0; k < dim; ++k) bits += measured_entropy(coeffs.data() + k, n, dim, step, scratch);
      return bits;
    };
    double max_abs = 0.0;
    for (int64_t i = 0; i < coeffs.size(); ++i) max_abs = std::max(max_abs, double(std::fabs(coeffs.data()[i])));
    if (max_abs == 0.0) max_abs = 1.0;
    // Steps finer than max_abs / 2047 would need more than 4096 levels.
    double lo = std::log2(max_abs / 2047.0), hi = std::log2(max_abs * 4.0);
    if (options.target_rel_mse > 0.0) {
      // Distortion target instead of a rate budget: the coarsest step whose
      // squared error on the fit tokens stays within target * ||x||^2 (the
      // energy of the uncentred vectors, as rel_mse is reported).
      double energy = 0.0;
      for (int64_t i = 0; i < n * dim; ++i) energy += double(x[i]) * x[i];
      const double allowed = options.target_rel_mse * energy;
      auto distortion_at = [&](double step) {
        return step_rounding_error(coeffs.data(), int64_t(coeffs.size()), step, /*simd=*/true);
      };
      auto coarsest_step = [&](double target, double a, double b) {
        for (int it = 0; it < 40; ++it) {
          const double mid = 0.5 * (a + b);
          if (distortion_at(std::exp2(mid)) > target) b = mid; else a = mid;
        }
        return a;  // log2 of the coarsest step meeting the target
      };
      const double lo0 = lo, hi0 = hi;
      double log_step = coarsest_step(allowed, lo0, hi0);
      // The rounded basis is not exactly orthonormal, dropped components
      // and clamped codes add error, and the decoder's reconstruction has
      // its own rounding: measure the error of the fit tokens as the codec
      // reconstructs them (quantize_block, dequantize_block) at the chosen
      // step, and tighten the coefficient-domain target by the excess until
      // that error meets the allowed one. The bisection on the tightened
      // target can land on the same step again (the error is a step
      // function of the step), so every round also steps down by a growing
      // minimum (1/1024 octave, 2/1024, ...): a few rounds usually, and the
      // finest step (lo0) at the latest after 64.
      double coef_target = allowed;
      for (int round = 0; round < 64; ++round) {
        HeadParams trial = p;
        keep_components(trial, uniform_quantizers(std::exp2(log_step)));
        trial.build_kernels(kernels);
        const double signal_err = codec_squared_error(trial, x, n);
        if (signal_err <= allowed || log_step <= lo0) break;
        double next = log_step;
        coef_target -= signal_err - allowed;
        if (coef_target > 0.0) next = coarsest_step(coef_target, lo0, hi0);
        log_step = std::max(lo0, std::min(next, log_step - double(round + 1) / 1024.0));
      }
      hi = log_step;
    } else {
      for (int it = 0; it < 40; ++it) {
        const double mid = 0.5 * (lo + hi);
        if (rate_at(std::exp2(mid)) > budget) lo = mid; else hi = mid;
      }
    }
    quant = uniform_quantizers(std::exp2(hi));
    for (int k = 0; k < dim; ++k)
      if (quant[size_t(k)].levels > 1) p.bits[size_t(k)] = ceil_log2(quant[size_t(k)].levels);
  }
  keep_components(p, quant);

  // Entropy models: histograms of the fit tokens' codes, every symbol kept
  // at a nonzero probability so later tokens always code.
  const int kept = p.n_kept();
  std::vector<uint16_t> codes(size_t(n) * size_t(kept));
  p.coder = CoderChoice::kFixed;
  // In pieces, so the per-thread block scratch stays at a block's size
  // rather than growing to (and holding) the whole fit's.
  constexpr int64_t kPiece = 256;
  for (int64_t i = 0; i < n; i += kPiece)
    quantize_block(p, x + i * dim, std::min(kPiece, n - i), codes.data() + size_t(i) * size_t(kept));
  std::vector<std::vector<uint64_t>> counts(static_cast<size_t>(kept));
  for (int k = 0; k < kept; ++k) counts[size_t(k)].assign(p.quant[size_t(k)].levels, 0);
  for (int64_t i = 0; i < n; ++i)
    for (int k = 0; k < kept; ++k) ++counts[size_t(k)][codes[size_t(i) * size_t(kept) + size_t(k)]];

  p.fixed_widths.resize(size_t(kept));
  for (int k = 0; k < kept; ++k) p.fixed_widths[size_t(k)] = uint8_t(ceil_log2(p.quant[size_t(k)].levels));

  CoderChoice coder = options.coder;
  if (coder == CoderChoice::kRans || coder == CoderChoice::kAuto) {
    // 12-bit models (13 for the largest alphabets): the decoder's slot tables
    // of all components then stay in L2. Wider scales only help symbols the
    // fit never saw, and cost a cache miss on every decoded symbol.
    for (int k = 0; k < kept; ++k) {
      const uint32_t scale = std::clamp<uint32_t>(uint32_t(ceil_log2(p.quant[size_t(k)].levels)) + 1, 12, 13);
      p.rans_tables.push_back(entropy::FrequencyTable::from_counts(counts[size_t(k)], scale));
    }
  }
  if (coder == CoderChoice::kHuffman || coder == CoderChoice::kAuto) {
    for (int k = 0; k < kept; ++k) p.huffman_tables.push_back(entropy::huffman_build(counts[size_t(k)]));
  }
  if (coder == CoderChoice::kAuto) {
    // Strictly smaller wins (tables included, as serialised), on the fit tokens.
    auto total_bytes = [&](CoderChoice c) {
      HeadParams trial = p;
      trial.coder = c;
      if (c != CoderChoice::kRans) trial.rans_tables.clear();
      if (c != CoderChoice::kHuffman) trial.huffman_tables.clear();
      trial.build_kernels(kernels);
      return trial.serialized_size() + encode_block(trial, x, n).size();
    };
    const size_t fixed = total_bytes(CoderChoice::kFixed);
    const size_t huff = total_bytes(CoderChoice::kHuffman);
    const size_t rans = total_bytes(CoderChoice::kRans);
    coder = CoderChoice::kFixed;
    size_t best = fixed;
    if (huff < best) { coder = CoderChoice::kHuffman; best = huff; }
    if (rans < best) { coder = CoderChoice::kRans; best = rans; }
  }
  p.coder = coder;
  if (coder != CoderChoice::kRans) p.rans_tables.clear();
  if (coder != CoderChoice::kHuffman) p.huffman_tables.clear();
  p.build_kernels(kernels);
  return p;
}

namespace {

size_t round_up8(size_t v) { return (v + 7) / 8 * 8; }

// basis [K, D] -> out [D, K8] (zero-padded columns K..K8).
void transpose_basis(const HeadParams& p, std::vector<float>& out) {
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim), K8 = round_up8(K);
  out.assign(D * K8, 0.0f);
  for (size_t k = 0; k < K; ++k)
    for (size_t d = 0; d < D; ++d) out[d * K8 + k] = p.basis[k * D + d];
}

// std::nearbyint (round half to even, the default rounding mode) for the
// kernels' weights, without the libm call (builds without SSE4.1 do not
// inline it): at |v| < 2^51, v + 1.5 * 2^52 has a unit ulp, so the addition
// rounds v to an integer as nearbyint does. Only the sign of a zero result
// may differ, which no caller reads (int16 weights, squares, magnitudes).
inline double round_even(double v) {
  if (!(std::fabs(v) < 0x1p51)) return std::nearbyint(v);
  constexpr double kShift = 0x1.8p52;
  return (v + kShift) - kShift;  // not reassociated: no -ffast-math here
}
// round_even where the caller knows |v| < 2^51 (and v is not NaN): the
// addition alone, branch-free, so the weight loops vectorise (a cache
// opening its heads per call builds these weights on every fetch).
template <bool kPlain>
inline double round_weight(double v) {
  if constexpr (kPlain) return round_even(v);
  constexpr double kShift = 0x1.8p52;
  return (v + kShift) - kShift;
}

// What the kernels' conditions ask of the mean's and the basis's values,
// found in one pass of bit tests without an early exit (the loop
// vectorises): none is NaN or infinite; every nonzero magnitude is >= 2^-40
// (HeadKernels::recon_skip_zeros); none is -0.
struct ValueScan {
  bool finite = true, no_tiny = true, no_negative_zero = true;
};
ValueScan scan_values(const std::vector<float>& v) {
  constexpr uint32_t kInf = 0x7f800000u, kTiny = std::bit_cast<uint32_t>(0x1p-40f);
  uint32_t nonfinite = 0, tiny = 0, negative_zero = 0;
  for (const float x : v) {
    const uint32_t bits = std::bit_cast<uint32_t>(x), mag = bits & 0x7fffffffu;
    nonfinite |= uint32_t(mag >= kInf);
    tiny |= uint32_t(mag != 0) & uint32_t(mag < kTiny);
    negative_zero |= uint32_t(bits == 0x80000000u);
  }
  return {nonfinite == 0, tiny == 0, negative_zero == 0};
}
// The same by the plain loops (HeadKernels::build_reference).
ValueScan scan_values_plain(const std::vector<float>& v) {
  ValueScan out;
  const float tiny = std::ldexp(1.0f, -40);
  for (float x : v) {
    out.finite &= std::isfinite(x);
    out.no_tiny &= !std::isfinite(x) || x == 0.0f || std::fabs(x) >= tiny;
    out.no_negative_zero &= !(x == 0.0f && std::signbit(x));
  }
  return out;
}

// The integer reconstruction's tables (HeadKernels::recon_int); false, with
// the tables cleared, when some level count or value does not allow them.
// Whether some weight of a row lies outside int16's symmetric range
// (integer compares only: the loop vectorises).
uint32_t outside_int16(const int32_t* w, size_t n) {
  uint32_t outside = 0;
  for (size_t i = 0; i < n; ++i) outside |= uint32_t(w[i] > 32767) | uint32_t(w[i] < -32767);
  return outside;
}

// Row k of the reconstruction's weights into recon_w's layout: 8 columns
// at a time (stride 2 within a block of 16), or by recon_w_index (kPlain).
template <bool kPlain>
void scatter_recon_row(const int32_t* row, size_t k, size_t D, size_t kp2, int16_t* w) {
  if constexpr (kPlain) {
    for (size_t d = 0; d < D; ++d) w[recon_w_index(k, d, kp2)] = int16_t(row[d]);
  } else {
    for (size_t d0 = 0; d0 < D; d0 += 8) {
      int16_t* dst = w + recon_w_index(k, d0, kp2);
      const size_t n = std::min<size_t>(8, D - d0);
      for (size_t i = 0; i < n; ++i) dst[2 * i] = int16_t(row[d0 + i]);
    }
  }
}

// One row k of the integer reconstruction's weights (build_recon_int):
// w[d] = round(step * basis[d] / 2 / unit[d]) into row_w, bound[d] +=
// cmax * |w[d]|. Apart, with restrict pointers and the range check after
// the loop (a flag from double compares keeps GCC from vectorising it),
// so that it vectorises. The callers' units keep |w| <= 32767, far inside
// int32.
template <bool kPlain>
void round_recon_row(const float* __restrict basis, double step, double inv_code_unit, double cmax,
                     const double* __restrict unit, size_t D, int32_t* __restrict row_w, double* __restrict bound) {
  for (size_t d = 0; d < D; ++d) {
    const double r = round_weight<kPlain>(step * double(basis[d]) * inv_code_unit / unit[d]);
    row_w[d] = int32_t(r);
    bound[d] += cmax * std::fabs(r);
  }
}

// values_finite: the mean and the basis hold no NaN or infinity
// (scan_values). kPlain: the plain rounding (the reference).
template <bool kPlain>
bool build_recon_int(const HeadParams& p, HeadKernels& out, bool values_finite) {
  out.recon_zero2.clear(), out.recon_scale.clear(), out.recon_w.clear();
  out.recon_lut.clear(), out.recon_lut_base.clear();
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim);
  if (K == 0 || D == 0 || p.mean.size() != D || p.basis.size() != K * D || p.quant.size() != K) return false;
  if (!values_finite) return false;
  std::vector<double> cmax(K);  // the largest |c| = |2 code - zero2| of a valid code
  std::vector<int16_t> zero2(K);
  bool centroid = false;
  double widest = 0.0;  // the largest |reconstruction_steps| of a valid code
  for (size_t k = 0; k < K; ++k) {
    const ComponentQuantizer& q = p.quant[k];
    const int64_t z2 = q.half_offset ? 2 * int64_t(q.levels / 2) - 1 : 2 * int64_t(q.zero);
    const int64_t top = 2 * (int64_t(q.levels) - 1) - z2;
    const int64_t m = std::max(std::abs(z2), std::abs(top));
    if (q.levels == 0 || m > 32767 || !std::isfinite(q.step)) return false;
    zero2[k] = int16_t(z2);
    cmax[k] = double(m);
    centroid |= q.has_centroid();
    widest = std::max({widest, std::fabs(reconstruction_steps(q, 0)), std::fabs(reconstruction_steps(q, q.levels - 1u))});
  }
  std::vector<int16_t> lut;
  std::vector<uint32_t> lut_base;
  double code_unit = 2.0;
  if (centroid) {
    // One power of two for the head (see HeadKernels::recon_lut).
    code_unit = 4096.0;
    while (code_unit > 1.0 && code_unit * widest > 32767.0) code_unit /= 2;
    for (size_t k = 0; k < K; ++k) {
      const ComponentQuantizer& q = p.quant[k];
      lut_base.push_back(uint32_t(lut.size()));
      double top = 0.0;
      for (uint32_t code = 0; code < q.levels; ++code) {
        const double c = round_even(code_unit * reconstruction_steps(q, code));
        lut.push_back(int16_t(c));
        top = std::max(top, std::fabs(c));
      }
      cmax[k] = top;
    }
  }
  const size_t kp2 = (K + 1) / 2;
  std::vector<float> scale(D, 0.0f);
  std::vector<int16_t> w(((D + 7) / 8) * kp2 * 16, 0);
  // Row by row (k outer, d inner: contiguous loops the compiler vectorises;
  // a cache opens these per call), every column's sums still taken in
  // ascending k, so each value is the column-by-column loop's. The exact
  // weight step * basis / 2 is computed again where it is rounded (the same
  // double) instead of held in a K x D array.
  std::vector<double> work(4 * D, 0.0);
  double *amax = work.data(), *sum = amax + D, *unit_of = sum + D, *bound = unit_of + D;
  // code_unit is a power of two (2, or 1..4096), so multiplying by its
  // inverse is the division, bit for bit (both round the same real
  // x * 2^-m), at a fraction of a division's cost.
  const double inv_code_unit = 1.0 / code_unit;
  const auto exact = [&](size_t k, size_t d) { return double(p.quant[k].step) * double(p.basis[k * D + d]) * inv_code_unit; };
  for (size_t k = 0; k < K; ++k)
    for (size_t d = 0; d < D; ++d) {
      const double e = exact(k, d);
      amax[d] = std::max(amax[d], std::fabs(e));
      sum[d] += cmax[k] * std::fabs(e);
    }
  for (size_t d = 0; d < D; ++d) {
    unit_of[d] = 1.0;  // a column of zero weights (x = mean): its weights round to 0, scale 0
    if (!(amax[d] > 0)) continue;
    // 15 bits for the largest weight, unless the worst-case sum of valid
    // codes needs a coarser unit to stay below 2^30 (+ the roundings).
    double unit = std::max(amax[d] / 32767, sum[d] / 1073741824.0);
    float su = float(unit);
    if (double(su) < unit) su = std::nextafter(su, std::numeric_limits<float>::infinity());
    if (!std::isfinite(su) || !std::isnormal(su)) return false;
    scale[d] = su;
    unit_of[d] = double(su);
  }
  // |exact / unit| <= 32767 (su >= amax / 32767; a zero column divides 0
  // by 1): round_weight's range, and int32's. A row's weights are rounded
  // into row_w, then scattered to the madd layout.
  uint32_t outside = 0;
  std::vector<int32_t> row_w(D);
  for (size_t k = 0; k < K; ++k) {
    round_recon_row<kPlain>(p.basis.data() + k * D, double(p.quant[k].step), inv_code_unit, cmax[k], unit_of, D, row_w.data(),
                            bound);
    outside |= outside_int16(row_w.data(), D);
    scatter_recon_row<kPlain>(row_w.data(), k, D, kp2, w.data());
  }
  if (outside) return false;  // not reached: su >= amax / 32767
  for (size_t d = 0; d < D; ++d)
    if (bound[d] > 2147483647.0) return false;  // not reached: <= 2^30 + K * 32767 / 2
  out.recon_zero2 = std::move(zero2), out.recon_scale = std::move(scale), out.recon_w = std::move(w);
  out.recon_lut = std::move(lut), out.recon_lut_base = std::move(lut_base);
  return true;
}

#ifdef KVCODEC_KVTC_GEMM
// build_recon_int<false> compiled for AVX2 (as build_proj_int_avx2 below:
// every call inlined, the same operations per lane in the plain loop's
// order, no FMA contraction): 4 doubles per division where SSE2 has 2.
KVCODEC_TARGET_AVX2 __attribute__((flatten)) bool build_recon_int_avx2(const HeadParams& p, HeadKernels& out,
                                                                       bool values_finite) {
  return build_recon_int<false>(p, out, values_finite);
}
#endif

// The integer projection's tables (HeadKernels::proj_int); false, with the
// tables cleared, when the basis or a quantizer does not allow them.
// Row k of the projection's weights into proj_w's layout: pairs of
// columns 16 apart, or by proj_w_index (kPlain).
template <bool kPlain>
void scatter_proj_row(const int32_t* row, size_t k, size_t D, size_t dp2, int16_t* w) {
  if constexpr (kPlain) {
    for (size_t d = 0; d < D; ++d) w[proj_w_index(k, d, dp2)] = int16_t(row[d]);
  } else {
    // A pair of columns (adjacent in the layout) per 32-bit store.
    int16_t* dst = w + proj_w_index(k, 0, dp2);
    size_t d = 0;
    for (; d + 2 <= D; d += 2) {
      const uint32_t pair = uint32_t(uint16_t(row[d])) | uint32_t(uint16_t(row[d + 1])) << 16;
      std::memcpy(dst + (d / 2) * 16, &pair, sizeof pair);
    }
    if (d < D) dst[(d / 2) * 16] = int16_t(row[d]);
  }
}

// One row of the integer projection's weights (build_proj_int): w[d] =
// round(basis[d] * unit), |w| <= 32767 by the caller's unit; apart so
// that the loop vectorises (as round_recon_row).
template <bool kPlain>
void round_proj_row(const float* __restrict basis, double unit, size_t D, int32_t* __restrict row_w) {
  for (size_t d = 0; d < D; ++d) row_w[d] = int32_t(round_weight<kPlain>(double(basis[d]) * unit));
}

// build_proj_int's largest |b| (into bmax) and largest row norm (returned)
// of a finite basis [K, D]: the plain loops' values (see there).
double basis_norms(const float* basis, size_t K, size_t D, double& bmax) {
  uint32_t mag = 0;
  for (size_t i = 0; i < K * D; ++i) mag = std::max(mag, std::bit_cast<uint32_t>(basis[i]) & 0x7fffffffu);
  bmax = double(std::bit_cast<float>(mag));
  double nmax = 0;
  size_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const float *r0 = basis + k * D, *r1 = r0 + D, *r2 = r1 + D, *r3 = r2 + D;
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t d = 0; d < D; ++d) {
      const double b0 = r0[d], b1 = r1[d], b2 = r2[d], b3 = r3[d];
      s0 += b0 * b0, s1 += b1 * b1, s2 += b2 * b2, s3 += b3 * b3;
    }
    nmax = std::max({nmax, std::sqrt(s0), std::sqrt(s1), std::sqrt(s2), std::sqrt(s3)});
  }
  for (; k < K; ++k) {
    double ss = 0;
    for (size_t d = 0; d < D; ++d) {
      const double b = basis[k * D + d];
      ss += b * b;
    }
    nmax = std::max(nmax, std::sqrt(ss));
  }
  return nmax;
}

// basis_finite: the basis holds no NaN or infinity (scan_values). kPlain:
// the plain rounding (the reference).
template <bool kPlain>
bool build_proj_int(const HeadParams& p, HeadKernels& out, bool basis_finite) {
  out.proj_w.clear(), out.proj_qscale.clear();
  out.proj_unit = out.proj_scale = out.proj_max_abs = out.proj_max_sq = 0.0f;
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim);
  if (K == 0 || D == 0 || p.basis.size() != K * D || p.quant.size() != K) return false;
  if (!basis_finite) return false;
  double bmax = 0, nmax = 0, range_sq = 0;
  if constexpr (kPlain) {
    for (size_t k = 0; k < K; ++k) {
      double ss = 0;
      for (size_t d = 0; d < D; ++d) {
        const double b = p.basis[k * D + d];
        bmax = std::max(bmax, std::fabs(b));
        ss += b * b;
      }
      nmax = std::max(nmax, std::sqrt(ss));
    }
  } else {
    // The same values: the largest |b| by integer compares of the magnitude
    // bits (finite floats order as their bits do; a max has no rounding),
    // and each row's square sum in the plain loop's order (d ascending, the
    // same double operations), four rows side by side so that their add
    // chains overlap instead of one waiting on the next.
    nmax = basis_norms(p.basis.data(), K, D, bmax);
  }
  for (size_t k = 0; k < K; ++k) {
    const ComponentQuantizer& q = p.quant[k];
    const double step = q.step, offset = code_offset(q);
    if (!std::isfinite(step) || !(step > 0) || q.levels == 0) return false;
    // The coefficients the quantizer's cells cover: |c| <= step * max(offset, levels - offset).
    const double r = step * std::max(offset, double(q.levels) - offset);
    range_sq += r * r;
  }
  if (!(bmax > 0) || !std::isfinite(range_sq)) return false;
  // 15 bits for the largest weight, or fewer when the rows' norms would
  // pass ~sqrt(2^31): the two roundings (of x and of W) weigh about the
  // same when ||x|| and ||W|| do, and their product must stay below 2^31.
  const double unit = std::min(32767.0 / bmax, 46340.0 / nmax);
  float fu = float(unit);
  if (double(fu) > unit) fu = std::nextafter(fu, 0.0f);
  if (!std::isnormal(fu)) return false;
  const size_t dp2 = (D + 1) / 2, K8 = round_up8(K);
  // Written in place (a per-thread opening reuses the capacity); cleared
  // by the caller when this returns false.
  std::vector<int16_t>& w = out.proj_w;
  w.assign(K8 / 8 * dp2 * 16, 0);
  // |basis * fu| <= 32767 (fu <= 32767 / bmax): round_weight's range, and
  // int32's. A row's weights are rounded into row_w (their squares then
  // summed in order d, exact integers as doubles), then scattered.
  double wn = 0;
  uint32_t outside = 0;
  thread_local std::vector<int32_t> row_w;
  row_w.resize(D);
  for (size_t k = 0; k < K; ++k) {
    round_proj_row<kPlain>(p.basis.data() + k * D, double(fu), D, row_w.data());
    outside |= outside_int16(row_w.data(), D);
    double ss = 0;
    if constexpr (kPlain) {
      for (size_t d = 0; d < D; ++d) ss += double(row_w[d]) * double(row_w[d]);
    } else {
      // The same double: with |w| <= 32767 (else `outside` refuses the
      // tables) each square is below 2^30 and D < 2^16, so every partial
      // sum, in any order, is an integer below 2^46, which doubles hold
      // exactly: four interleaved sums (vectorised) give the plain loop's.
      double acc[4] = {0, 0, 0, 0};
      size_t d = 0;
      for (; d + 4 <= D; d += 4)
        for (size_t j = 0; j < 4; ++j) acc[j] += double(row_w[d + j]) * double(row_w[d + j]);
      for (; d < D; ++d) acc[0] += double(row_w[d]) * double(row_w[d]);
      ss = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
    scatter_proj_row<kPlain>(row_w.data(), k, D, dp2, w.data());
    wn = std::max(wn, std::sqrt(ss));
  }
  if (outside) return false;  // not reached: fu <= 32767 / bmax
  // ||x||_2 <= x_norm keeps ||x|| * max ||W|| < 2^31; the rows' scaled
  // norms stay below it less the rounding of x (sqrt(D) / 2).
  const double x_norm = 2147483647.0 / (wn * (1 + 1e-9) + 1) - std::sqrt(double(D)) / 2 - 1;
  if (!(x_norm >= 1024)) return false;  // not reached for unit rows: ~46000
  // One scale for every row: a row as long as the quantizers' cells reach
  // (sqrt(range_sq)) fills x_norm; longer rows, or with an element past
  // 32767, take the float projection (their coefficients mostly clamp).
  const float sc = float(x_norm / std::sqrt(range_sq));
  if (!std::isnormal(sc)) return false;
  const float margin = 1.0f - 0x1p-10f;  // covers the float roundings of the row checks
  std::vector<float>& qscale = out.proj_qscale;
  qscale.assign(K8, 0.0f);
  for (size_t k = 0; k < K; ++k) {
    qscale[k] = float(1.0 / (double(fu) * double(sc) * double(p.quant[k].step)));
    if (!std::isfinite(qscale[k]) || qscale[k] == 0.0f) return false;
  }
  out.proj_unit = fu, out.proj_scale = sc;
  out.proj_max_abs = 32767.0f * margin;
  out.proj_max_sq = float(x_norm * x_norm) * margin;
  return true;
}

#ifdef KVCODEC_KVTC_GEMM
// build_proj_int<false> compiled for AVX2 (every call inlined into this
// function, so its loops take 256-bit vectors): the same values, each
// lane doing the plain loop's operations in its order (no FMA contraction:
// -ffp-contract=off); a cache opening its heads per call builds these for
// every head it codes. Codec.KernelsEqualTheirReference compares.
KVCODEC_TARGET_AVX2 __attribute__((flatten)) bool build_proj_int_avx2(const HeadParams& p, HeadKernels& out,
                                                                      bool basis_finite) {
  return build_proj_int<false>(p, out, basis_finite);
}
#endif

// HeadKernels::build (kPlain false) and build_reference (true), into out:
// a fresh object, or one built before (HeadOpener), every field of which is
// set again (the encoder's vectors keeping their capacity).
template <bool kPlain>
void build_kernels(const HeadParams& p, KernelSet which, HeadKernels& out) {
  out.set = which;
  const bool decoding = uint8_t(which) & uint8_t(KernelSet::kDecode);
  const bool encoding = uint8_t(which) & uint8_t(KernelSet::kEncode);
  out.recon_skip_zeros = false;
  out.rans_decode.clear();
  out.rans_groups = entropy::RansGroupTables{};
  // The mean's scan only for the decoder's conditions (the projection
  // centres by the mean but asks nothing of its values).
  const auto scan = [](const std::vector<float>& v) { return kPlain ? scan_values_plain(v) : scan_values(v); };
  const ValueScan mean = decoding || kPlain ? scan(p.mean) : ValueScan{}, basis = scan(p.basis);
  const auto recon = [&](bool values_finite) {
#ifdef KVCODEC_KVTC_GEMM
    if (!kPlain && simd_avx2()) return build_recon_int_avx2(p, out, values_finite);
#endif
    return build_recon_int<kPlain>(p, out, values_finite);
  };
  out.recon_int = decoding && recon(mean.finite && basis.finite);
  if (!out.recon_int) out.recon_zero2.clear(), out.recon_scale.clear(), out.recon_w.clear();
  // The 8-bit reconstruction where asked for (build_recon8 clears its
  // tables when it fails; a reused kernel object drops earlier ones here).
  const bool int8 = uint8_t(which) & uint8_t(KernelSet::kInt8);
  out.recon8 = out.recon_int && int8 && build_recon8(p, out, kPlain);
  if (!(out.recon_int && int8)) {
    std::vector<int8_t>().swap(out.recon8_w), std::vector<int32_t>().swap(out.recon8_bias2);
    std::vector<float>().swap(out.recon8_scale);
  }
  if (out.recon8) {
    // recon8 takes every decode: the 16-bit tables it was built from would
    // only be held (a decode loop keeps its heads, counted as resident).
    out.recon_int = false;
    std::vector<int16_t>().swap(out.recon_zero2), std::vector<float>().swap(out.recon_scale);
    std::vector<int16_t>().swap(out.recon_w);
  }
  const auto proj = [&] {
#ifdef KVCODEC_KVTC_GEMM
    if (!kPlain && simd_avx2()) return build_proj_int_avx2(p, out, basis.finite);
#endif
    return build_proj_int<kPlain>(p, out, basis.finite);
  };
  out.proj_int = encoding && proj();
  if (!out.proj_int) {
    // Released, as the tables of a fresh build that fails hold nothing.
    std::vector<int16_t>().swap(out.proj_w), std::vector<float>().swap(out.proj_qscale);
    out.proj_unit = out.proj_scale = out.proj_max_abs = out.proj_max_sq = 0.0f;
  }
  // The 8-bit projection where asked for (build_proj8 clears its tables
  // when it fails; a reused kernel object drops earlier ones here).
  const bool want8 = out.proj_int && (uint8_t(which) & uint8_t(KernelSet::kInt8 | KernelSet::kProj8));
  out.proj8 = want8 && build_proj8(p, out, kPlain);
  if (!want8) {
    std::vector<int8_t>().swap(out.proj8_w), std::vector<int32_t>().swap(out.proj8_bias);
    std::vector<float>().swap(out.proj8_qscale);
    out.proj8_gate_m = out.proj8_gate_ss = 0.0f;
  }
  if (uint8_t(which) & uint8_t(KernelSet::kHeld) & ~uint8_t(KernelSet::kBoth))
    transpose_basis(p, out.basis_t);
  else
    std::vector<float>().swap(out.basis_t);
  if (encoding) {
    // Held at exact size; a table built before is rebuilt in place.
    out.rans_encode.resize(p.rans_tables.size());
    for (size_t k = 0; k < p.rans_tables.size(); ++k) out.rans_encode[k].assign(p.rans_tables[k]);
  } else {
    out.rans_encode.clear();
  }
  if (!decoding) return;
  out.rans_decode.reserve(p.rans_tables.size());
  for (const auto& t : p.rans_tables) out.rans_decode.emplace_back(t);
  // See recon_skip_zeros: no -0, NaN or infinity in the mean; the basis
  // finite with no nonzero value below 2^-40 in magnitude; steps >= 2^-39
  // (so a nonzero coefficient, |code - offset| >= 1/2 steps, is >= 2^-40).
  out.recon_skip_zeros = p.mean.size() == size_t(p.dim) && p.basis.size() == size_t(p.n_kept()) * size_t(p.dim) &&
                         p.quant.size() == size_t(p.n_kept()) && mean.finite && mean.no_negative_zero &&
                         basis.finite && basis.no_tiny;
  const float tiny = std::ldexp(1.0f, -40);
  for (const ComponentQuantizer& q : p.quant) {
    // A bound on the smallest nonzero |coefficient| in steps: 1/2 on the
    // lattice; with centroids also the least nonzero |m| + offset of a class.
    double least = 0.5;
    if (q.has_centroid()) {
      for (int c = 0; c < 3; ++c) {
        const double r = (q.half_offset ? 0.5 : 1.0) + c + double(q.centroid[size_t(c)]);
        if (r > 0) least = std::min(least, r);
      }
    }
    out.recon_skip_zeros &= std::isfinite(q.step) && double(q.step) * least >= double(tiny);
  }
  if (!out.rans_decode.empty()) {
    std::vector<const entropy::RansDecodeTable*> tables;
    for (const auto& t : out.rans_decode) tables.push_back(&t);
    out.rans_groups = kPlain ? entropy::rans_group_tables_reference(tables) : entropy::rans_group_tables(tables);
    // The columns the scalar lanes decode throughout get their lookup
    // table: all of them when the group decoder does not apply, else the
    // small alphabets of its scalar groups (a group holding an alphabet it
    // cannot search), whose search table is 64 bytes. The other columns
    // there (34..65 symbols) bisect (RansLookup::kAuto): an 8 KB slot table
    // each would add 0.34 MB to the tinycode dump's cache at defaults.
    // Replaced in place: the addresses the group tables were built from
    // stay valid.
    const size_t K = out.rans_decode.size();
    std::vector<uint8_t> scalar(K, uint8_t(!out.rans_groups.usable));
    if (out.rans_groups.usable && out.rans_groups.any_scalar) {
      size_t k0 = 0;
      do {
        if (out.rans_groups.groups[out.rans_groups.group_at[k0]].scalar)
          for (size_t j = 0; j < entropy::kRansLanes; ++j) scalar[(k0 + j) % K] = 1;
        k0 = (k0 + entropy::kRansLanes) % K;
      } while (k0 != 0);
    }
    for (size_t k = 0; k < K; ++k)
      if (scalar[k] && (!out.rans_groups.usable || p.rans_tables[k].alphabet_size <= entropy::kRansSearchMax))
        out.rans_decode[k] = entropy::RansDecodeTable(p.rans_tables[k], entropy::RansLookup::kScalar);
  }
}

}  // namespace

std::shared_ptr<const HeadKernels> HeadKernels::build(const HeadParams& p, KernelSet which) {
  auto built = std::make_shared<HeadKernels>();
  build_kernels<false>(p, which, *built);
  return built;
}

std::shared_ptr<const HeadKernels> HeadKernels::build_reference(const HeadParams& p, KernelSet which) {
  auto built = std::make_shared<HeadKernels>();
  build_kernels<true>(p, which, *built);
  return built;
}

uint64_t HeadParams::params_held_bytes() const {
  uint64_t n = held_bytes(mean) + held_bytes(kept) + held_bytes(basis) + held_bytes(row_scale) + held_bytes(quant) +
               held_bytes(fixed_widths) + held_bytes(eigenvalues) + held_bytes(bits);
  n += uint64_t(rans_tables.capacity()) * sizeof(entropy::FrequencyTable);
  for (const auto& t : rans_tables) n += t.held_bytes();
  n += uint64_t(huffman_tables.capacity()) * sizeof(entropy::HuffmanTable);
  for (const auto& t : huffman_tables) n += t.held_bytes();
  return n;
}

uint64_t HeadKernels::held_bytes() const {
  uint64_t n = sizeof(HeadKernels) + uint64_t(rans_decode.capacity()) * sizeof(entropy::RansDecodeTable);
  for (const auto& t : rans_decode) n += t.held_bytes();
  n += uint64_t(rans_encode.capacity()) * sizeof(entropy::RansEncodeTable);
  for (const auto& t : rans_encode) n += t.held_bytes();
  n += rans_groups.held_bytes() + kvcodec::held_bytes(recon_zero2) + kvcodec::held_bytes(recon_lut) +
       kvcodec::held_bytes(recon_lut_base) + kvcodec::held_bytes(recon_scale) +
       kvcodec::held_bytes(recon_w) + kvcodec::held_bytes(proj_w) + kvcodec::held_bytes(proj_qscale) +
       kvcodec::held_bytes(proj8_w) + kvcodec::held_bytes(proj8_bias) + kvcodec::held_bytes(proj8_qscale) +
       kvcodec::held_bytes(recon8_w) + kvcodec::held_bytes(recon8_bias2) + kvcodec::held_bytes(recon8_scale) +
       kvcodec::held_bytes(basis_t);
  return n;
}

const HeadKernels& HeadParams::no_kernels() {
  static const HeadKernels none;
  return none;
}

// --- small dense products -----------------------------------------------------
//
// A block is [n, D] x [D, K] (projection) or [n, K] x [K, D] (reconstruction)
// with n = 64 and D, K <= 128 typically: Eigen's general product spends much
// of such a call packing operands. The kernel below keeps a tile of R rows x
// 8*NV columns of the result in registers, broadcasts one A element per row
// and loads NV vectors of B per inner step (the whole B of a head sits in L1).
namespace {

// C[M, N] = A[M, K] * B[K, N] (+ init[N] on every row, when not null),
// row-major with leading dimensions, by plain loops: per element one
// single-rounding fma per k, in ascending k, from init (or 0), which is
// what each lane of the AVX2 tiles (gemm, gemm_quant, sparse_row) does, so
// both paths give the same bits.
void gemm_plain(const float* A, size_t lda, const float* B, size_t ldb, size_t M, size_t N, size_t K,
                const float* init, float* C, size_t ldc) {
  for (size_t i = 0; i < M; ++i) {
    float* c = C + i * ldc;
    for (size_t j = 0; j < N; ++j) c[j] = init ? init[j] : 0.0f;
    for (size_t k = 0; k < K; ++k) {
      const float a = A[i * lda + k];
      const float* b = B + k * ldb;
      for (size_t j = 0; j < N; ++j) c[j] = std::fma(a, b[j], c[j]);
    }
  }
}

#ifdef KVCODEC_KVTC_GEMM
KVCODEC_AVX2_BEGIN
// Accumulators as named variables: GCC keeps an array of __m256 in
// registers but also stores it back on every iteration.
#define KVTC_TILE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <int R, int NV>
inline void gemm_tile(const float* A, size_t lda, const float* B, size_t ldb, size_t K, const float* init, float* C,
                      size_t ldc) {
  static_assert(R >= 1 && R <= 6 && (NV == 1 || NV == 2), "tile shape");
  const __m256 i0 = init ? _mm256_loadu_ps(init) : _mm256_setzero_ps();
  const __m256 i1 = NV == 2 ? (init ? _mm256_loadu_ps(init + 8) : _mm256_setzero_ps()) : _mm256_setzero_ps();
#define KVTC_DECL(r) __m256 c##r##0 = i0, c##r##1 = i1;
  KVTC_TILE_ROWS(KVTC_DECL)
#undef KVTC_DECL
  for (size_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb);
    const __m256 b1 = NV == 2 ? _mm256_loadu_ps(B + k * ldb + 8) : _mm256_setzero_ps();
#define KVTC_FMA(r)                                               \
  if constexpr (R > r) {                                          \
    const __m256 a = _mm256_broadcast_ss(A + size_t(r) * lda + k); \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                    \
    if constexpr (NV == 2) c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1); \
  }
    KVTC_TILE_ROWS(KVTC_FMA)
#undef KVTC_FMA
  }
#define KVTC_STORE(r)                                                    \
  if constexpr (R > r) {                                                 \
    _mm256_storeu_ps(C + size_t(r) * ldc, c##r##0);                      \
    if constexpr (NV == 2) _mm256_storeu_ps(C + size_t(r) * ldc + 8, c##r##1); \
  }
  KVTC_TILE_ROWS(KVTC_STORE)
#undef KVTC_STORE
}
#undef KVTC_TILE_ROWS

template <int NV>
void gemm_panel(const float* A, size_t lda, const float* B, size_t ldb, size_t M, size_t K, const float* init,
                float* C, size_t ldc) {
  size_t i = 0;
  for (; i + 6 <= M; i += 6) gemm_tile<6, NV>(A + i * lda, lda, B, ldb, K, init, C + i * ldc, ldc);
  if (i + 4 <= M) {
    gemm_tile<4, NV>(A + i * lda, lda, B, ldb, K, init, C + i * ldc, ldc);
    i += 4;
  }
  for (; i < M; ++i) gemm_tile<1, NV>(A + i * lda, lda, B, ldb, K, init, C + i * ldc, ldc);
}

// Quantisation constants per coefficient column, zero-padded to the
// kernel's width K8 (padded columns compute junk codes that are never stored).
struct QuantConsts {
  const float* inv_step;
  const float* offset;
  const float* max_code;
};

// codes = quantize(A[M, K] * B[K, N]) straight from the accumulators: the
// tile of gemm_tile, whose epilogue applies the float projection's per-code
// operations (mul, add, then floor and clamp, in the equivalent form below)
// to the registers instead of storing the coefficients and reading them
// back: the same codes as gemm + the quantisation loop. Unrolled by 8
// (1.04-1.12x, bench_kvtc BM_QuantizeAB before the integer projection).
// codes is [M, kept] row-major; columns >= kept are not written.
#define KVTC_TILE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <int R, int NV>
inline void gemm_quant_tile(const float* A, size_t lda, const float* B, size_t ldb, size_t K, size_t col,
                            const QuantConsts& q, uint16_t* codes, size_t kept) {
  static_assert(R >= 1 && R <= 6 && (NV == 1 || NV == 2), "tile shape");
#define KVTC_DECL(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
  KVTC_TILE_ROWS(KVTC_DECL)
#undef KVTC_DECL
#pragma GCC unroll 8
  for (size_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb);
    const __m256 b1 = NV == 2 ? _mm256_loadu_ps(B + k * ldb + 8) : _mm256_setzero_ps();
#define KVTC_FMA(r)                                                   \
  if constexpr (R > r) {                                              \
    const __m256 a = _mm256_broadcast_ss(A + size_t(r) * lda + k);     \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                        \
    if constexpr (NV == 2) c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1); \
  }
    KVTC_TILE_ROWS(KVTC_FMA)
#undef KVTC_FMA
  }
  const auto store = [&](__m256 c, size_t r, size_t v) {
    const size_t k0 = col + 8 * v;
    if (k0 >= kept) return;
    __m256 x = _mm256_add_ps(_mm256_mul_ps(c, _mm256_loadu_ps(q.inv_step + k0)), _mm256_loadu_ps(q.offset + k0));
    // floor, then the clamp to [0, max_code]: min(max_code, x) then
    // truncation and the unsigned saturating pack give the same codes in
    // fewer operations (truncation is the floor for x >= 0; x in (-1, 0)
    // truncates to 0 where the floor's -1 clamps to 0; x <= -1, and NaN,
    // which min passes on and cvtt turns into INT_MIN, saturate to 0).
    x = _mm256_min_ps(_mm256_loadu_ps(q.max_code + k0), x);
    const __m256i i32 = _mm256_cvttps_epi32(x);
    const __m128i u16 = _mm_packus_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    uint16_t* out = codes + r * kept + k0;
    if (k0 + 8 <= kept) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), u16);
    } else {
      // The row's last, partial group: a full store would spill into the
      // next row's codes (written by an earlier panel).
      alignas(16) uint16_t tmp[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(tmp), u16);
      std::memcpy(out, tmp, (kept - k0) * sizeof(uint16_t));
    }
  };
#define KVTC_STORE(r)                          \
  if constexpr (R > r) {                       \
    store(c##r##0, r, 0);                      \
    if constexpr (NV == 2) store(c##r##1, r, 1); \
  }
  KVTC_TILE_ROWS(KVTC_STORE)
#undef KVTC_STORE
}
#undef KVTC_TILE_ROWS

template <int NV>
void gemm_quant_panel(const float* A, size_t lda, const float* B, size_t ldb, size_t M, size_t K, size_t col,
                      const QuantConsts& q, uint16_t* codes, size_t kept) {
  size_t i = 0;
  for (; i + 6 <= M; i += 6) gemm_quant_tile<6, NV>(A + i * lda, lda, B, ldb, K, col, q, codes + i * kept, kept);
  if (i + 4 <= M) {
    gemm_quant_tile<4, NV>(A + i * lda, lda, B, ldb, K, col, q, codes + i * kept, kept);
    i += 4;
  }
  for (; i < M; ++i) gemm_quant_tile<1, NV>(A + i * lda, lda, B, ldb, K, col, q, codes + i * kept, kept);
}

// codes[M, kept] = quantize(A[M, K] * B[K, N]), N = round_up8(kept).
void gemm_quant(const float* A, size_t lda, const float* B, size_t ldb, size_t M, size_t N, size_t K,
                const QuantConsts& q, uint16_t* codes, size_t kept) {
  size_t j = 0;
  for (; j + 16 <= N; j += 16) gemm_quant_panel<2>(A, lda, B + j, ldb, M, K, j, q, codes, kept);
  if (j < N) gemm_quant_panel<1>(A, lda, B + j, ldb, M, K, j, q, codes, kept);
}

// C[M, N] = A[M, K] * B[K, N] (+ init[N] on every row, when not null);
// row-major with leading dimensions; N a multiple of 8.
void gemm(const float* A, size_t lda, const float* B, size_t ldb, size_t M, size_t N, size_t K, const float* init,
          float* C, size_t ldc) {
  size_t j = 0;
  for (; j + 16 <= N; j += 16) gemm_panel<2>(A, lda, B + j, ldb, M, K, init ? init + j : nullptr, C + j, ldc);
  if (j < N) gemm_panel<1>(A, lda, B + j, ldb, M, K, init ? init + j : nullptr, C + j, ldc);
}

// --- reconstruction without the zero coefficients ---------------------------
//
// At the issue-2 settings (rate allocator, 1% target) ~27% of a block's
// codes are their component's zero code (~50% at 5%), and each costs the
// dense kernel as much as any other code. Row by row, the nonzero
// coefficients are packed (value and basis row offset) and one row of
// 8 * NV output columns is accumulated over them only: per term one
// broadcast and NV FMAs with a load, as many FMAs per term as the tiled
// kernel, so the skipped terms are the saving. The FMAs of an output
// element run in the same (ascending k) order from the same initial value
// as in gemm, so only the 0 * b terms are missing (see
// HeadKernels::recon_skip_zeros for why that changes no bit).

// For every 8-bit mask, the positions of its set bits, lowest first: the
// lane permutation that packs the selected lanes to the front.
struct PackLut {
  alignas(8) uint8_t idx[256][8];
  PackLut() {
    for (unsigned m = 0; m < 256; ++m) {
      unsigned c = 0;
      for (unsigned j = 0; j < 8; ++j)
        if (m >> j & 1u) idx[m][c++] = uint8_t(j);
      for (; c < 8; ++c) idx[m][c] = 0;
    }
  }
};
const PackLut& pack_lut() {
  static const PackLut lut;
  return lut;
}

// The nonzero coefficients of one row [K]: their values and offsets
// k * ldb, packed; returns their count. vals and offs hold K + 8 entries
// (a packed store writes 8).
inline size_t pack_nonzero(const float* coef, size_t K, size_t ldb, float* vals, int32_t* offs) {
  const PackLut& lut = pack_lut();
  size_t cnt = 0, k = 0;
  const __m256i stride8 = _mm256_set1_epi32(int32_t(8 * ldb));
  __m256i ko = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(int32_t(ldb)));
  for (; k + 8 <= K; k += 8) {
    const __m256 c = _mm256_loadu_ps(coef + k);
    // Unordered counts as nonzero, like the scalar c != 0.0f below.
    const unsigned m = unsigned(_mm256_movemask_ps(_mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_NEQ_UQ)));
    const __m256i perm = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(lut.idx[m])));
    _mm256_storeu_ps(vals + cnt, _mm256_permutevar8x32_ps(c, perm));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(offs + cnt), _mm256_permutevar8x32_epi32(ko, perm));
    cnt += size_t(__builtin_popcount(m));
    ko = _mm256_add_epi32(ko, stride8);
  }
  for (; k < K; ++k)
    if (coef[k] != 0.0f) vals[cnt] = coef[k], offs[cnt] = int32_t(k * ldb), ++cnt;
  return cnt;
}

#define KVTC_ROW_VECS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
// out[0, 8 * NV) = init + sum_j vals[j] * B[offs[j] + (0, 8 * NV)], in j order.
template <int NV>
inline void sparse_row(const float* vals, const int32_t* offs, size_t cnt, const float* B, const float* init,
                       float* out) {
  static_assert(NV >= 1 && NV <= 8, "row width");
#define KVTC_DECL(v) __m256 a##v = NV > v ? _mm256_loadu_ps(init + 8 * v) : _mm256_setzero_ps();
  KVTC_ROW_VECS(KVTC_DECL)
#undef KVTC_DECL
  for (size_t j = 0; j < cnt; ++j) {
    const __m256 c = _mm256_broadcast_ss(vals + j);
    const float* b = B + offs[j];
#define KVTC_FMA(v) \
  if constexpr (NV > v) a##v = _mm256_fmadd_ps(c, _mm256_loadu_ps(b + 8 * v), a##v);
    KVTC_ROW_VECS(KVTC_FMA)
#undef KVTC_FMA
  }
#define KVTC_STORE(v) \
  if constexpr (NV > v) _mm256_storeu_ps(out + 8 * v, a##v);
  KVTC_ROW_VECS(KVTC_STORE)
#undef KVTC_STORE
}
#undef KVTC_ROW_VECS

// out[n, D] = mean + coef[n, K] * basis over the nonzero coefficients only
// (D a multiple of 8; D > 64 in chunks of 64 columns, each over the row's
// same packed list).
void dequantize_sparse(const HeadParams& p, const float* coef, int64_t n, float* vals, int32_t* offs, float* out) {
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim);
  const float* B = p.basis.data();
  const float* mean = p.mean.data();
  for (int64_t i = 0; i < n; ++i) {
    const size_t cnt = pack_nonzero(coef + size_t(i) * K, K, D, vals, offs);
    float* o = out + size_t(i) * D;
    size_t c0 = 0;
    for (; c0 + 64 <= D; c0 += 64) sparse_row<8>(vals, offs, cnt, B + c0, mean + c0, o + c0);
    switch ((D - c0) / 8) {
      case 0: break;
      case 1: sparse_row<1>(vals, offs, cnt, B + c0, mean + c0, o + c0); break;
      case 2: sparse_row<2>(vals, offs, cnt, B + c0, mean + c0, o + c0); break;
      case 3: sparse_row<3>(vals, offs, cnt, B + c0, mean + c0, o + c0); break;
      case 4: sparse_row<4>(vals, offs, cnt, B + c0, mean + c0, o + c0); break;
      case 5: sparse_row<5>(vals, offs, cnt, B + c0, mean + c0, o + c0); break;
      case 6: sparse_row<6>(vals, offs, cnt, B + c0, mean + c0, o + c0); break;
      default: sparse_row<7>(vals, offs, cnt, B + c0, mean + c0, o + c0); break;
    }
  }
}
KVCODEC_AVX2_END
#endif

}  // namespace

// --- integer reconstruction (HeadKernels::recon_int) ------------------------

namespace {

// Whether p's integer tables match its shapes (parameters edited after
// build_decoders() without calling it again fall back to the float product).
// Centroid heads' centred code of component k (HeadKernels::recon_lut;
// codes past a component's levels, which decoders reject before, read its
// last level).
inline int16_t table_code(const HeadParams& p, size_t k, uint16_t code) {
  return p.derived().recon_lut[p.derived().recon_lut_base[k] + std::min<uint32_t>(code, p.quant[k].levels - 1u)];
}

bool recon_int_ready(const HeadParams& p) {
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim);
  return p.derived().recon_int && p.derived().recon_zero2.size() == K && p.derived().recon_scale.size() == D &&
         (p.derived().recon_lut.empty() || p.derived().recon_lut_base.size() == K) &&
         p.derived().recon_w.size() == (D + 7) / 8 * ((K + 1) / 2) * 16 && p.mean.size() == D;
}

#ifdef KVCODEC_KVTC_GEMM
KVCODEC_AVX2_BEGIN
// c[i][k] = 2 code[i][k] - zero2[k] as int16 (modulo 2^16 for codes past a
// component's levels, which decoders reject before), rows padded to Kp.
void doubled_codes(const HeadParams& p, const uint16_t* codes, int64_t n, int16_t* c, size_t kp) {
  const size_t K = size_t(p.n_kept());
  const int16_t* z = p.derived().recon_zero2.data();
  if (!p.derived().recon_lut.empty()) {  // centroid reconstruction: the table's values
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t* r = codes + size_t(i) * K;
      int16_t* o = c + size_t(i) * kp;
      for (size_t k = 0; k < K; ++k) o[k] = table_code(p, k, r[k]);
      if (kp > K) o[K] = 0;
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t* r = codes + size_t(i) * K;
    int16_t* o = c + size_t(i) * kp;
    for (size_t k = 0; k < K; ++k) o[k] = doubled_code(r[k], z[k]);
    if (kp > K) o[K] = 0;
  }
}

// A tile of R rows x 8 * NV output columns of an int16 product (the
// integer reconstruction: doubled codes x weights; the integer projection:
// scaled rows x weights): per pair of inner indices one broadcast of the
// row's two values (one 32-bit word) and NV madds of 8 columns'
// interleaved weight pairs, accumulated in int32; then store(r, v, acc)
// for row r's v-th group of 8 columns. At most 4 rows: 8 accumulators,
// 2 weight vectors, the broadcast and a madd result fit the 16 registers
// (6 rows made GCC keep accumulators on the stack). Unrolled by 4: a
// 32-step loop ends often enough for its exit to show (in a standalone copy
// of the projection's tiles the rolled loop ran at the float kernel's speed,
// unrolled 1.3-1.5x it; the integer reconstruction went from 1.04-1.20x to
// 1.45-1.55x the float product, bench_kvtc BM_ReconstructAB).
// acc + the pairwise int16 products of a and w, per int32 lane, modulo
// 2^32 in both forms (madd's pair sum wraps as vpdpwssd's does): madd then
// add, or AVX512-VNNI's vpdpwssd (one instruction where two ran; 1.17x
// the tile's loop on Zen 4), written as asm because this code is compiled
// for AVX2 alone and simd_vnni() picks it at run time.
template <bool kVnni>
inline __m256i madd_acc(__m256i acc, __m256i a, __m256i w) {
  if constexpr (kVnni) {
    __asm__("vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(w));
    return acc;
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, w));
  }
}

#define KVTC_TILE_ROWS(X) X(0) X(1) X(2) X(3)
template <int R, int NV, bool kVnni, class Store>
inline void madd_tile(const int16_t* A, size_t lda, const int16_t* W, size_t block_stride, size_t kp2,
                      const Store& store) {
  static_assert(R >= 1 && R <= 4 && (NV == 1 || NV == 2), "tile shape");
#define KVTC_DECL(r) __m256i c##r##0 = _mm256_setzero_si256(), c##r##1 = _mm256_setzero_si256();
  KVTC_TILE_ROWS(KVTC_DECL)
#undef KVTC_DECL
#pragma GCC unroll 4
  for (size_t j = 0; j < kp2; ++j) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + j * 16));
    const __m256i w1 =
        NV == 2 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + block_stride + j * 16)) : _mm256_setzero_si256();
#define KVTC_MADD(r)                                                                \
  if constexpr (R > r) {                                                            \
    int32_t pair;                                                                   \
    std::memcpy(&pair, A + size_t(r) * lda + 2 * j, sizeof(pair));                  \
    const __m256i a = _mm256_set1_epi32(pair);                                      \
    c##r##0 = madd_acc<kVnni>(c##r##0, a, w0);                                      \
    if constexpr (NV == 2) c##r##1 = madd_acc<kVnni>(c##r##1, a, w1);                \
  }
    KVTC_TILE_ROWS(KVTC_MADD)
#undef KVTC_MADD
  }
#define KVTC_STORE(r)                          \
  if constexpr (R > r) {                       \
    store(size_t(r), 0, c##r##0);              \
    if constexpr (NV == 2) store(size_t(r), 1, c##r##1); \
  }
  KVTC_TILE_ROWS(KVTC_STORE)
#undef KVTC_STORE
}
#undef KVTC_TILE_ROWS

// The tiles of M rows x 8 * NV columns; store_at(i) gives the store of the
// tile starting at row i.
template <int NV, bool kVnni, class StoreAt>
void madd_panel_with(const int16_t* A, size_t lda, const int16_t* W, size_t block_stride, size_t kp2, size_t M,
                     const StoreAt& store_at) {
  size_t i = 0;
  for (; i + 4 <= M; i += 4) madd_tile<4, NV, kVnni>(A + i * lda, lda, W, block_stride, kp2, store_at(i));
  if (i + 2 <= M) {
    madd_tile<2, NV, kVnni>(A + i * lda, lda, W, block_stride, kp2, store_at(i));
    i += 2;
  }
  for (; i < M; ++i) madd_tile<1, NV, kVnni>(A + i * lda, lda, W, block_stride, kp2, store_at(i));
}
template <int NV, class StoreAt>
void madd_panel(const int16_t* A, size_t lda, const int16_t* W, size_t block_stride, size_t kp2, size_t M,
                const StoreAt& store_at) {
  if (simd_vnni())
    madd_panel_with<NV, true>(A, lda, W, block_stride, kp2, M, store_at);
  else
    madd_panel_with<NV, false>(A, lda, W, block_stride, kp2, M, store_at);
}

// Integer reconstruction of the 8 * NV output columns from b (a multiple of 8).
template <int NV>
void recon_int_panel(const HeadParams& p, const int16_t* c, size_t kp, size_t kp2, size_t n, size_t b, float* out) {
  const size_t D = size_t(p.dim), block_stride = kp2 * 16;  // int16 entries of one 8-column block
  const float* scale = p.derived().recon_scale.data() + b;
  const float* mean = p.mean.data() + b;
  // madd then add, not VNNI: with this tile's 8 accumulators vpdpwssd's
  // 4-5 cycle chains showed (0.94x the decode on Zen 4). VNNI CPUs take
  // recon_int_panel32's 16-accumulator tiles for every 32 columns first.
  madd_panel_with<NV, false>(c, kp, p.derived().recon_w.data() + (b / 8) * block_stride, block_stride, kp2, n,
                             [&](size_t i) {
    float* C = out + i * D + b;
    return [=](size_t r, size_t v, __m256i acc) {
      _mm256_storeu_ps(C + r * D + 8 * v,
                       _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_loadu_ps(scale + 8 * v), _mm256_loadu_ps(mean + 8 * v)));
    };
  });
}
KVCODEC_AVX2_END

// --- AVX512-VNNI tiles of 32 columns on 256-bit registers -------------------
// madd_tile holds 8 accumulators (4 rows x 16 columns) because AVX2 has 16
// registers; vpdpwssd's accumulator chains (4-5 cycles) are then too few to
// keep both multiply pipes busy, which is why the reconstruction ran madd
// then add (at ~68% of the madd peak on Zen 4). With the EVEX encoding the
// same 256-bit instructions reach 32 registers: 4 rows x 32 columns = 16
// accumulators, 4 weight vectors and the broadcast, one vpdpwssd per 16
// products and no separate add. Same integers (exact sums, any order), so
// the same bits as madd_tile and the plain loops.
KVCODEC_VNNI_BEGIN
template <int R, class Store>
inline void vnni_tile32(const int16_t* A, size_t lda, const int16_t* W, size_t block_stride, size_t kp2,
                        const Store& store) {
  static_assert(R >= 1 && R <= 4, "tile rows");
  __m256i acc[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_si256();
#pragma GCC unroll 1
  for (size_t j = 0; j < kp2; ++j) {
    __m256i w[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + size_t(v) * block_stride + j * 16));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + size_t(r) * lda + 2 * j, sizeof(pair));
      const __m256i a = _mm256_set1_epi32(pair);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc[r][v]) : "v"(a), "v"(w[v]));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) store(size_t(r), size_t(v), acc[r][v]);
}

// madd_panel_with's rows for 32 columns (4 blocks of 8 from W).
template <class StoreAt>
void vnni_panel32(const int16_t* A, size_t lda, const int16_t* W, size_t block_stride, size_t kp2, size_t M,
                  const StoreAt& store_at) {
  size_t i = 0;
  for (; i + 4 <= M; i += 4) vnni_tile32<4>(A + i * lda, lda, W, block_stride, kp2, store_at(i));
  if (i + 2 <= M) {
    vnni_tile32<2>(A + i * lda, lda, W, block_stride, kp2, store_at(i));
    i += 2;
  }
  for (; i < M; ++i) vnni_tile32<1>(A + i * lda, lda, W, block_stride, kp2, store_at(i));
}

// recon_int_panel for the 32 output columns from b.
void recon_int_panel32(const HeadParams& p, const int16_t* c, size_t kp, size_t kp2, size_t n, size_t b, float* out) {
  const size_t D = size_t(p.dim), block_stride = kp2 * 16;
  const float* scale = p.derived().recon_scale.data() + b;
  const float* mean = p.mean.data() + b;
  vnni_panel32(c, kp, p.derived().recon_w.data() + (b / 8) * block_stride, block_stride, kp2, n, [&](size_t i) {
    float* C = out + i * D + b;
    return [=](size_t r, size_t v, __m256i acc) {
      _mm256_storeu_ps(C + r * D + 8 * v,
                       _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_loadu_ps(scale + 8 * v), _mm256_loadu_ps(mean + 8 * v)));
    };
  });
}
KVCODEC_VNNI_END
#endif

// out[n, D] by the integer reconstruction from codes [n, K] (recon_int_ready(p)):
// the madd tiles, or (no AVX2, D % 8 != 0) the plain loops of the
// reference, which the tiles equal bit for bit.
void recon_int(const HeadParams& p, const uint16_t* codes, int64_t n, float* out, std::vector<int16_t>& c) {
  const size_t D = size_t(p.dim);
#ifdef KVCODEC_KVTC_GEMM
  if (simd_avx2() && D % 8 == 0) {
    const size_t K = size_t(p.n_kept()), kp = (K + 1) / 2 * 2, kp2 = kp / 2;
    c.resize(size_t(n) * kp);
    doubled_codes(p, codes, n, c.data(), kp);
    size_t b = 0;
    if (simd_vnni())
      for (; b + 32 <= D; b += 32) recon_int_panel32(p, c.data(), kp, kp2, size_t(n), b, out);
    for (; b + 16 <= D; b += 16) recon_int_panel<2>(p, c.data(), kp, kp2, size_t(n), b, out);
    if (b < D) recon_int_panel<1>(p, c.data(), kp, kp2, size_t(n), b, out);
    return;
  }
#else
  (void)c, (void)D;
#endif
  dequantize_block_integer_reference(p, codes, n, out);
}

}  // namespace

// --- quantization: fast path (Eigen) and plain reference ------------------

// Per-thread scratch of the block hot paths: a block is ~10 us of work, so
// heap allocations and Eigen temporaries per call would show.
struct BlockScratch {
  // Grow-only (row_buffer): an Eigen matrix frees and allocates on every
  // change of size, and fit_head's whole-fit call between blocks made each
  // head's first block free ~1 MB, trimming the heap (brk) and faulting the
  // pages back in: 7% of local kvtc's encode at head_dim 128.
  std::vector<float> centred, coeffs;  // [n, dim], [n, kept]
  std::vector<uint16_t> codes;
  std::vector<uint16_t> codes2;  // the second block's of a pair (encode_block_pair)
  std::vector<float> a, b, c;
  std::vector<float> basis_t;   // the float projection's operand (transpose_basis)
  // Rows a projection does not take, gathered [m, D], and their codes by
  // the next path [m, K] (rows_aside): the 16-bit projection's (for the
  // float one) and the 8-bit one's (for the 16-bit one, which may set some
  // aside in turn, hence two).
  struct RowsAside {
    std::vector<float> rows;
    std::vector<uint16_t> codes;
  };
  RowsAside unfit, refused8;
  std::vector<float> vals;      // a row's nonzero coefficients (dequantize_sparse)
  std::vector<int32_t> offs;    // and their basis row offsets
  std::vector<int16_t> doubled; // doubled centred codes [n, Kp] (integer reconstruction)
  std::vector<int16_t> scaled;  // scaled centred rows [n, Dp] (integer projection)
  std::vector<uint8_t> fits;    // whether each row takes the integer projection [n]
  std::vector<uint8_t> scaled8; // the 8-bit projection's rows, x + 128 [n, Dp4]
  std::vector<float> factor8;   // and their factors [n]
  std::vector<uint8_t> fits8;   // whether each row takes it [n]
  std::vector<uint32_t> row_of8;  // the block row of each row it takes, gathered [m]
  std::vector<uint8_t> codes8;  // codes as bytes [n, Kp4] (the 8-bit reconstruction)
};
BlockScratch& scratch() {
  thread_local BlockScratch s;
  return s;
}

// buf as at least `size` floats, its capacity kept across calls.
float* row_buffer(std::vector<float>& buf, size_t size) {
  if (buf.size() < size) buf.resize(size);
  return buf.data();
}

namespace {

// Whether p's integer projection tables match its shapes (parameters
// edited after build_decoders() without calling it again: the float kernel).
bool proj_int_ready(const HeadParams& p) {
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim);
  return p.derived().proj_int && p.quant.size() == K && p.derived().proj_qscale.size() == round_up8(K) &&
         p.derived().proj_w.size() == round_up8(K) / 8 * ((D + 1) / 2) * 16 && p.derived().proj_scale > 0.0f;
}

#ifdef KVCODEC_KVTC_GEMM
KVCODEC_AVX2_BEGIN
// The largest of the 8 lanes.
inline float hmax(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// 8 centred values v of a row into its scaling: their |v| into the row's
// running max vm, v^2 into its square-sum lanes acc (lane l takes the
// d = l mod 8 terms, in order), v * s rounded to nearest even as int16 to
// o[0, 8) (junk for a row that does not fit: finish_scaled_row zeroes it).
inline void scale_chunk(__m256 v, __m256 vs, __m256 abs_mask, __m256& vm, __m256& acc, int16_t* o) {
  vm = _mm256_max_ps(vm, _mm256_and_ps(v, abs_mask));
  acc = _mm256_fmadd_ps(v, v, acc);
  const __m256i xi = _mm256_cvtps_epi32(_mm256_mul_ps(v, vs));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_packs_epi32(_mm256_castsi256_si128(xi), _mm256_extracti128_si256(xi, 1)));
}

// scale_rows' whole chunks of 8 of one row [D] by scale_chunk: the row's
// largest |c| of them into m, their square-sum lanes into lane [8];
// returns where the plain loop goes on.
size_t scale_chunks_avx2(const float* row, size_t D, float sc, int16_t* o, float* lane, float& m) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 vs = _mm256_set1_ps(sc);
  __m256 vm = _mm256_setzero_ps(), acc = _mm256_setzero_ps();
  size_t d = 0;
  for (; d + 8 <= D; d += 8) scale_chunk(_mm256_loadu_ps(row + d), vs, abs_mask, vm, acc, o + d);
  _mm256_storeu_ps(lane, acc);
  m = hmax(vm);
  return d;
}
KVCODEC_AVX2_END
#endif

// Whether a scaled row fits, from its largest |c| and square-sum lanes
// (lane l: the c[d]^2 of d = l mod 8, summed in order by fmas); a row that
// does not gets zeros in o [Dp].
bool finish_scaled_row(const HeadParams& p, float m, const float* lane, int16_t* o) {
  const size_t D = size_t(p.dim), Dp = (D + 1) / 2 * 2;
  const bool fits = scaled_row_fits(m, lane, p.derived().proj_scale, p.derived().proj_max_abs, p.derived().proj_max_sq);
  if (!fits) std::fill(o, o + Dp, int16_t(0));
  if (Dp > D) o[D] = 0;
  return fits;
}

// The centred rows c [n, D] times proj_scale as int16 x [n, Dp] (Dp = D
// rounded up to even, the pad 0), rounded to nearest even; fits[t] says
// whether row t may take the integer projection: its largest |c| times
// the scale within proj_max_abs and its squared norm times the scale's
// square within proj_max_sq, both finite. A row that does not fit gets
// zeros (and its codes from the float projection afterwards). The square
// sums run in one fixed order, in the AVX2 and the plain loops alike
// (lane l of a row sums c[d]^2 for d = l mod 8 by single-rounding fmas,
// then a fixed tree), so the kernel and the reference loops decide alike.
void scale_rows(const HeadParams& p, const float* c, int64_t n, int16_t* x, uint8_t* fits) {
  const size_t D = size_t(p.dim), Dp = (D + 1) / 2 * 2;
  const float sc = p.derived().proj_scale;
  for (int64_t t = 0; t < n; ++t) {
    const float* row = c + size_t(t) * D;
    int16_t* o = x + size_t(t) * Dp;
    alignas(32) float lane[8] = {};
    float m = 0.0f;
    size_t d = 0;
#ifdef KVCODEC_KVTC_GEMM
    if (simd_avx2()) d = scale_chunks_avx2(row, D, sc, o, lane, m);
#endif
    // (A NaN may or may not reach m; the square sum catches it.) Values
    // past the int16 range, NaN included, only occur in rows that do not
    // fit: 0 for them (a float-to-int conversion out of range is undefined).
    for (; d < D; ++d) {
      m = std::max(m, std::fabs(row[d]));
      lane[d % 8] = std::fma(row[d], row[d], lane[d % 8]);
      const float v = row[d] * sc;
      o[d] = std::fabs(v) <= 32767.0f ? int16_t(int32_t(std::nearbyint(v))) : int16_t(0);
    }
    fits[t] = uint8_t(finish_scaled_row(p, m, lane, o));
  }
}

// codes [n, K] of the scaled rows x [n, Dp] by plain loops (exact int32
// sums: a fitting row keeps every partial sum below 2^31).
void proj_int_loops(const HeadParams& p, const int16_t* x, int64_t n, uint16_t* codes) {
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim), dp2 = (D + 1) / 2;
  for (int64_t t = 0; t < n; ++t)
    for (size_t k = 0; k < K; ++k) {
      int32_t acc = 0;
      for (size_t d = 0; d < D; ++d) acc += int32_t(x[size_t(t) * 2 * dp2 + d]) * int32_t(p.derived().proj_w[proj_w_index(k, d, dp2)]);
      const ComponentQuantizer& q = p.quant[k];
      codes[size_t(t) * K + k] = proj_code(acc, p.derived().proj_qscale[k], code_offset(q), float(q.levels - 1));
    }
}

#ifdef KVCODEC_KVTC_GEMM
KVCODEC_AVX2_BEGIN
// codes [n, K] of the scaled rows x [n, Dp] by the madd tiles: the sums of
// proj_int_loops (exact in any order), then proj_code's operations on 8
// codes at a time.
void proj_int(const HeadParams& p, const int16_t* x, size_t n, uint16_t* codes) {
  const size_t K = size_t(p.n_kept()), dp2 = (size_t(p.dim) + 1) / 2, block_stride = dp2 * 16;
  const float* qscale = p.derived().proj_qscale.data();
  // Offsets and largest codes padded to K8 (the epilogue reads groups of 8).
  BlockScratch& s = scratch();
  s.b.assign(round_up8(K), 0.0f), s.c.assign(round_up8(K), 0.0f);
  for (size_t k = 0; k < K; ++k) {
    s.b[k] = code_offset(p.quant[k]);
    s.c[k] = float(p.quant[k].levels - 1);
  }
  const float* const offset = s.b.data();
  const float* const max_code = s.c.data();
  // The store of the tile at row i of the panel of codes from col.
  const auto store_at = [&](size_t col) {
    return [&, col](size_t i) {
      return [=](size_t r, size_t v, __m256i acc) {
        const size_t k0 = col + 8 * v;
        if (k0 >= K) return;
        __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_loadu_ps(qscale + k0), _mm256_loadu_ps(offset + k0));
        y = _mm256_min_ps(_mm256_loadu_ps(max_code + k0), y);
        const __m256i i32 = _mm256_cvttps_epi32(y);
        const __m128i u16 = _mm_packus_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
        uint16_t* out = codes + (i + r) * K + k0;
        if (k0 + 8 <= K) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out), u16);
        } else {
          alignas(16) uint16_t tmp[8];  // the row's last, partial group
          _mm_store_si128(reinterpret_cast<__m128i*>(tmp), u16);
          std::memcpy(out, tmp, (K - k0) * sizeof(uint16_t));
        }
      };
    };
  };
  const int16_t* const w = p.derived().proj_w.data();
  const auto panel = [&](auto nv, size_t col) {
    madd_panel<decltype(nv)::value>(x, 2 * dp2, w + (col / 8) * block_stride, block_stride, dp2, n, store_at(col));
  };
  size_t col = 0;
  // VNNI panels up to K rounded up to 8, the blocks proj_w holds (its pad
  // columns are zero weights, and store() drops codes from K on): K = 94
  // takes three 32-column panels, not two and the 8-accumulator tiles for
  // the last 30 columns (those ran at ~0.7 of the VNNI panel's rate).
  if (simd_vnni())
    for (; col + 32 <= round_up8(K); col += 32)
      vnni_panel32(x, 2 * dp2, w + (col / 8) * block_stride, block_stride, dp2, n, store_at(col));
  for (; col + 16 <= K; col += 16) panel(std::integral_constant<int, 2>{}, col);
  if (col + 8 < K)
    panel(std::integral_constant<int, 2>{}, col);
  else if (col < K)
    panel(std::integral_constant<int, 1>{}, col);
}
KVCODEC_AVX2_END
#endif

// Which integer projection's scaled rows the caller has filled in the
// scratch (encode_block_rows fuses the scaling into its centring).
enum class Prescaled { kNo, kInt16, kInt8 };
void quantize_centred(const HeadParams& p, const float* c, int64_t n, uint16_t* codes, QuantPath path,
                      Prescaled prescaled = Prescaled::kNo);

// The codes of the rows a projection did not take (fits[t] false), by
// `path`, gathered into one call (a row's codes depend on that row alone,
// so they are those of the rows one by one) through `aside`.
void rows_aside(const HeadParams& p, const float* c, int64_t n, const uint8_t* fits, uint16_t* codes,
                QuantPath path, BlockScratch::RowsAside& aside) {
  const size_t D = size_t(p.dim), K = size_t(p.n_kept());
  size_t m = 0;
  for (int64_t t = 0; t < n; ++t) m += !fits[t];
  if (m == 0) return;
  aside.rows.resize(m * D);
  aside.codes.resize(m * K);
  for (int64_t t = 0, j = 0; t < n; ++t)
    if (!fits[t]) std::copy_n(c + size_t(t) * D, D, aside.rows.data() + size_t(j++) * D);
  quantize_centred(p, aside.rows.data(), int64_t(m), aside.codes.data(), path);
  for (int64_t t = 0, j = 0; t < n; ++t)
    if (!fits[t]) std::copy_n(aside.codes.data() + size_t(j++) * K, K, codes + size_t(t) * K);
}

// Projection and quantisation of centred rows [n, dim] into codes [n, kept]
// (the second half of quantize_block; the scratch's centred may be c).
// prescaled: the caller has filled the scratch's scaled rows and fits
// (scale_rows' values, or proj8_scale_rows' with its factors).
void quantize_centred(const HeadParams& p, const float* c, int64_t n, uint16_t* codes, QuantPath path,
                      Prescaled prescaled) {
  const int kept = p.n_kept();
  BlockScratch& s = scratch();
  const int dim = p.dim;
  const size_t K = static_cast<size_t>(kept);
  const bool integer = proj_int_ready(p);
  if (path == QuantPath::kInteger && !integer)
    throw Error(ErrorCode::kInvalidArgument,
                "kvtc: the integer projection needs HeadKernels::proj_int (run build_decoders())");
  const bool eight = integer && proj8_ready(p);
  if (path == QuantPath::kInteger8 && !eight)
    throw Error(ErrorCode::kInvalidArgument,
                "kvtc: the 8-bit projection needs HeadKernels::proj8 (build with KernelSet::kInt8 or kProj8)");
  if (eight && (path == QuantPath::kAuto || path == QuantPath::kInteger8)) {
    const size_t Dp4 = proj8_row_len(size_t(dim));
    if (prescaled != Prescaled::kInt8) {
      s.scaled8.resize(size_t(n) * Dp4), s.factor8.resize(size_t(n)), s.fits8.resize(size_t(n));
      proj8_scale_rows(p, c, n, s.scaled8.data(), s.factor8.data(), s.fits8.data(), simd_avx2());
    }
    // The rows it takes, gathered (a refused row's products would be
    // thrown away: rows of outliers may be most of a block).
    size_t m = 0;
    for (int64_t t = 0; t < n; ++t) m += s.fits8[size_t(t)];
    if (m == size_t(n)) {
      proj8_codes(p, s.scaled8.data(), s.factor8.data(), n, codes);
      return;
    }
    s.row_of8.resize(m);
    for (size_t t = 0, j = 0; t < size_t(n); ++t) {
      if (!s.fits8[t]) continue;
      if (j != t) {
        std::copy_n(s.scaled8.data() + t * Dp4, Dp4, s.scaled8.data() + j * Dp4);
        s.factor8[j] = s.factor8[t];
      }
      s.row_of8[j++] = uint32_t(t);
    }
    proj8_codes(p, s.scaled8.data(), s.factor8.data(), int64_t(m), codes, s.row_of8.data());
    // The refused rows by the 16-bit projection (then the float one).
    rows_aside(p, c, n, s.fits8.data(), codes, QuantPath::kInteger, s.refused8);
    return;
  }
  if (integer && path != QuantPath::kFloat) {
    if (prescaled != Prescaled::kInt16) {
      s.scaled.resize(size_t(n) * ((size_t(dim) + 1) / 2 * 2));
      s.fits.resize(size_t(n));
      scale_rows(p, c, n, s.scaled.data(), s.fits.data());
    }
#ifdef KVCODEC_KVTC_GEMM
    if (simd_avx2())
      proj_int(p, s.scaled.data(), size_t(n), codes);
    else
#endif
      proj_int_loops(p, s.scaled.data(), n, codes);
    rows_aside(p, c, n, s.fits.data(), codes, QuantPath::kFloat, s.unfit);
    return;
  }
  const size_t K8 = round_up8(K);
  // Held by kHeld kernels; else transposed per call (the default, integer,
  // projection does not need it, and K x D copies are ~1/n of this
  // product's work for a whole block of rows).
  const bool held = p.derived().basis_t.size() == size_t(dim) * K8;
  if (!held) transpose_basis(p, s.basis_t);
  const std::vector<float>& basis_t = held ? p.derived().basis_t : s.basis_t;
#ifdef KVCODEC_KVTC_GEMM
  if (simd_avx2()) {
    // Constants padded to K8 (the kernel reads whole groups of 8).
    s.a.assign(K8, 0.0f), s.b.assign(K8, 0.0f), s.c.assign(K8, 0.0f);
    for (size_t k = 0; k < K; ++k) {
      s.a[k] = 1.0f / p.quant[k].step;
      s.b[k] = code_offset(p.quant[k]);
      s.c[k] = float(p.quant[k].levels - 1);
    }
    const QuantConsts q{s.a.data(), s.b.data(), s.c.data()};
    gemm_quant(c, size_t(dim), basis_t.data(), K8, size_t(n), K8, size_t(dim), q, codes, K);
    return;
  }
#endif
  // Coefficients [n, kept], as gemm_quant's accumulators hold them.
  row_buffer(s.coeffs, size_t(n) * size_t(kept));
  gemm_plain(c, size_t(dim), basis_t.data(), K8, size_t(n), K, size_t(dim), nullptr, s.coeffs.data(), K);
  const size_t ldc = K;
  s.a.resize(K), s.b.resize(K), s.c.resize(K);
  float* const inv_step = s.a.data();
  float* const offset = s.b.data();
  float* const max_code = s.c.data();
  for (size_t k = 0; k < K; ++k) {
    inv_step[k] = 1.0f / p.quant[k].step;
    offset[k] = code_offset(p.quant[k]);
    max_code[k] = float(p.quant[k].levels - 1);
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* ci = s.coeffs.data() + size_t(i) * ldc;
    uint16_t* out = codes + i * kept;
    // The clamp of quantize_block_reference (max(0, NaN) is 0 here, where
    // std::clamp would pass the NaN on); the AVX2 epilogue of gemm_quant
    // gives the same codes (mul, add, then an equivalent of floor and clamp).
    for (size_t k = 0; k < K; ++k) {
      const float v = std::floor(ci[k] * inv_step[k] + offset[k]);
      out[k] = uint16_t(int32_t(std::min(std::max(0.0f, v), max_code[k])));
    }
  }
}

}  // namespace

void quantize_block(const HeadParams& p, const float* x, int64_t n, uint16_t* codes) {
  quantize_block_path(p, x, n, codes, QuantPath::kAuto);
}

void quantize_block_path(const HeadParams& p, const float* x, int64_t n, uint16_t* codes, QuantPath path) {
  require_kernels(p, KernelSet::kEncode, "kvtc quantize_block");
  const int kept = p.n_kept();
  if (n == 0 || kept == 0) return;
  BlockScratch& s = scratch();
  const int dim = p.dim;
  // Same arithmetic as project_all (centre, then one product), into reused buffers.
  RowMap centred(row_buffer(s.centred, size_t(n) * size_t(dim)), n, dim);
  ConstRowMap xm(x, n, dim);
  Eigen::Map<const Eigen::RowVectorXf> mu(p.mean.data(), dim);
  centred.noalias() = xm.rowwise() - mu;
  quantize_centred(p, s.centred.data(), n, codes, path);
}

void quantize_centred_block(const HeadParams& p, const float* c, int64_t n, uint16_t* codes, QuantPath path) {
  require_kernels(p, KernelSet::kEncode, "kvtc quantize_centred_block");
  if (n == 0 || p.n_kept() == 0) return;
  quantize_centred(p, c, n, codes, path);
}

namespace {

void dequantize_impl(const HeadParams& p, const uint16_t* codes, int64_t n, float* out, ReconPath path) {
  require_kernels(p, KernelSet::kDecode, "kvtc dequantize_block");
  const int kept = p.n_kept();
  const int dim = p.dim;
  Eigen::Map<const Eigen::RowVectorXf> mu(p.mean.data(), dim);
  RowMap xo(out, n, dim);
  if (kept == 0) {
    xo.rowwise() = mu;
    return;
  }
  BlockScratch& s = scratch();
  const bool integer = recon_int_ready(p);
  if (path == ReconPath::kInteger && !integer)
    throw Error(ErrorCode::kInvalidArgument,
                "kvtc: the integer reconstruction needs HeadKernels::recon_int (run build_decoders())");
  const bool eight = recon8_ready(p);
  if (path == ReconPath::kInteger8 && !eight)
    throw Error(ErrorCode::kInvalidArgument,
                "kvtc: the 8-bit reconstruction needs HeadKernels::recon8 (build with KernelSet::kInt8)");
  if (eight && (path == ReconPath::kAuto || path == ReconPath::kInteger8)) {
    recon8_values(p, codes, n, out, s.codes8);
    return;
  }
  if (integer && (path == ReconPath::kAuto || path == ReconPath::kInteger)) {
    recon_int(p, codes, n, out, s.doubled);
    return;
  }
  row_buffer(s.coeffs, size_t(n) * size_t(kept));
  const size_t K = static_cast<size_t>(kept);
  s.a.resize(K), s.b.resize(K);
  float* const step = s.a.data();
  float* const offset = s.b.data();
  for (size_t k = 0; k < K; ++k) {
    step[k] = p.quant[k].step;
    offset[k] = recon_offset(p.quant[k]);
  }
  size_t zeros = 0;
  bool centroid = false;
  for (const ComponentQuantizer& q : p.quant) centroid |= q.has_centroid();
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t* c = codes + i * kept;
    float* o = s.coeffs.data() + i * kept;
    // A 32-bit count per row: the vectorised loop then adds compare masks
    // lane-wise instead of widening them to 64 bits.
    uint32_t row_zeros = 0;
    if (centroid) {
      for (size_t k = 0; k < K; ++k) {
        o[k] = float(reconstruction_steps(p.quant[k], c[k]) * double(step[k]));
        row_zeros += o[k] == 0.0f;
      }
    } else {
      for (size_t k = 0; k < K; ++k) {
        o[k] = (float(c[k]) - offset[k]) * step[k];
        row_zeros += o[k] == 0.0f;
      }
    }
    zeros += row_zeros;
  }
#ifdef KVCODEC_KVTC_GEMM
  const bool simd = simd_avx2();
  // The zero-skipping rows cost ~1.5x the tiled kernel per term (one row
  // in registers, the packing), so they pay only past ~1/3 zero
  // coefficients (bench_kvtc BM_Reconstruct: 1.2x at the 5% target's ~50%,
  // 0.8x at the 1% target's ~27%): the block's count decides.
  const bool sparse = path == ReconPath::kSkipZeros || (path == ReconPath::kAuto && 5 * zeros >= 2 * size_t(n) * K);
  if (simd && sparse && p.derived().recon_skip_zeros && dim % 8 == 0 && p.basis.size() == K * size_t(dim) &&
      size_t(dim) * K <= size_t(INT32_MAX)) {
    s.vals.resize(K + 8);
    s.offs.resize(K + 8);
    dequantize_sparse(p, s.coeffs.data(), n, s.vals.data(), s.offs.data(), out);
    return;
  }
  if (simd && dim % 8 == 0) {
    gemm(s.coeffs.data(), K, p.basis.data(), size_t(dim), size_t(n), size_t(dim), K, p.mean.data(), out, size_t(dim));
    return;
  }
#else
  (void)path, (void)zeros;
#endif
  gemm_plain(s.coeffs.data(), K, p.basis.data(), size_t(dim), size_t(n), size_t(dim), K, p.mean.data(), out,
             size_t(dim));
}

}  // namespace

void dequantize_block(const HeadParams& p, const uint16_t* codes, int64_t n, float* out) {
  dequantize_impl(p, codes, n, out, ReconPath::kAuto);
}

void dequantize_block_path(const HeadParams& p, const uint16_t* codes, int64_t n, float* out, ReconPath path) {
  dequantize_impl(p, codes, n, out, path);
}

void quantize_block_reference(const HeadParams& p, const float* x, int64_t n, uint16_t* codes) {
  const int kept = p.n_kept();
  for (int64_t i = 0; i < n; ++i)
    for (int k = 0; k < kept; ++k) {
      double acc = 0.0;
      for (int d = 0; d < p.dim; ++d)
        acc += double(x[i * p.dim + d] - p.mean[size_t(d)]) * double(p.basis[size_t(k) * size_t(p.dim) + size_t(d)]);
      const ComponentQuantizer& q = p.quant[size_t(k)];
      const double v = std::floor(acc / double(q.step) + double(code_offset(q)));
      codes[i * kept + k] = uint16_t(std::clamp(v, 0.0, double(q.levels - 1)));
    }
}

void quantize_block_integer_reference(const HeadParams& p, const float* x, int64_t n, uint16_t* codes) {
  if (!proj_int_ready(p))
    throw Error(ErrorCode::kInvalidArgument, "kvtc: the integer projection needs HeadKernels::proj_int");
  const size_t D = size_t(p.dim), K = size_t(p.n_kept()), Dp = (D + 1) / 2 * 2, rows = static_cast<size_t>(n);
  const float sc = p.derived().proj_scale;
  std::vector<float> c(rows * D);
  for (size_t t = 0; t < rows; ++t)
    for (size_t d = 0; d < D; ++d) c[t * D + d] = x[t * D + d] - p.mean[d];
  std::vector<int16_t> scaled(rows * Dp, 0);
  std::vector<uint8_t> fits(rows);
  for (size_t t = 0; t < rows; ++t) {
    // Which rows fit: the same largest |c| and square sum (lane order) as the kernel's.
    float m = 0.0f, lane[8] = {};
    for (size_t d = 0; d < D; ++d) {
      const float v = c[t * D + d];
      m = std::max(m, std::fabs(v));
      lane[d % 8] = std::fma(v, v, lane[d % 8]);
    }
    const float ss = lane_square_sum(lane);
    fits[t] = std::fabs(ss) < std::numeric_limits<float>::infinity() && m * sc <= p.derived().proj_max_abs &&
              ss * (sc * sc) <= p.derived().proj_max_sq;
    if (fits[t])
      for (size_t d = 0; d < D; ++d) scaled[t * Dp + d] = int16_t(int32_t(std::nearbyint(c[t * D + d] * sc)));
  }
  proj_int_loops(p, scaled.data(), n, codes);
  // A row that does not fit takes the float projection.
  for (size_t t = 0; t < rows; ++t)
    if (!fits[t]) quantize_block_path(p, x + t * D, 1, codes + t * K, QuantPath::kFloat);
}

void quantize_block_int8_reference(const HeadParams& p, const float* x, int64_t n, uint16_t* codes) {
  if (!proj8_ready(p) || !proj_int_ready(p))
    throw Error(ErrorCode::kInvalidArgument, "kvtc: the 8-bit projection needs HeadKernels::proj8");
  const size_t D = size_t(p.dim), K = size_t(p.n_kept()), Dp4 = proj8_row_len(D), rows = static_cast<size_t>(n);
  const HeadKernels& kern = p.derived();
  std::vector<float> c(D);
  std::vector<int8_t> xq(Dp4);
  for (size_t t = 0; t < rows; ++t) {
    for (size_t d = 0; d < D; ++d) c[d] = x[t * D + d] - p.mean[d];
    // The kernel's largest |c| and square sum (lane order), its gate.
    float m = 0.0f, lane[8] = {};
    for (size_t d = 0; d < D; ++d) {
      m = std::max(m, std::fabs(c[d]));
      lane[d % 8] = std::fma(c[d], c[d], lane[d % 8]);
    }
    const float ss = lane_square_sum(lane);
    if (!proj8_row_fits(m, ss, kern.proj8_gate_m, kern.proj8_gate_ss)) {
      quantize_block_integer_reference(p, x + t * D, 1, codes + t * K);
      continue;
    }
    const float sc = proj8_row_scale(m), factor = proj8_row_factor(m);
    for (size_t d = 0; d < D; ++d) xq[d] = int8_t(int32_t(std::nearbyint(c[d] * sc)));
    for (size_t k = 0; k < K; ++k) {
      int32_t acc = 0;
      for (size_t d = 0; d < D; ++d) acc += int32_t(xq[d]) * int32_t(kern.proj8_w[proj8_w_index(k, d, Dp4 / 4)]);
      const ComponentQuantizer& q = p.quant[k];
      codes[t * K + k] = proj8_code(acc, factor, kern.proj8_qscale[k], code_offset(q), float(q.levels - 1));
    }
  }
}

void dequantize_block_int8_reference(const HeadParams& p, const uint16_t* codes, int64_t n, float* out) {
  if (!recon8_ready(p))
    throw Error(ErrorCode::kInvalidArgument, "kvtc: the 8-bit reconstruction needs HeadKernels::recon8");
  std::vector<uint8_t> unused;
  recon8_values(p, codes, n, out, unused, /*plain=*/true);
}

void dequantize_block_reference(const HeadParams& p, const uint16_t* codes, int64_t n, float* out) {
  const int kept = p.n_kept();
  for (int64_t i = 0; i < n; ++i)
    for (int d = 0; d < p.dim; ++d) {
      double acc = p.mean[size_t(d)];
      for (int k = 0; k < kept; ++k) {
        const ComponentQuantizer& q = p.quant[size_t(k)];
        const double c = reconstruction_steps(q, codes[i * kept + k]) * double(q.step);
        acc += c * double(p.basis[size_t(k) * size_t(p.dim) + size_t(d)]);
      }
      out[i * p.dim + d] = float(acc);
    }
}

void dequantize_block_integer_reference(const HeadParams& p, const uint16_t* codes, int64_t n, float* out) {
  if (!recon_int_ready(p))
    throw Error(ErrorCode::kInvalidArgument, "kvtc: the integer reconstruction needs HeadKernels::recon_int");
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim), kp2 = (K + 1) / 2;
  for (int64_t i = 0; i < n; ++i)
    for (size_t d = 0; d < D; ++d) {
      int64_t acc = 0;
      for (size_t k = 0; k < K; ++k) {
        const uint16_t code = codes[size_t(i) * K + k];
        const int16_t c = p.derived().recon_lut.empty()
                              ? doubled_code(code, p.derived().recon_zero2[k])
                              : table_code(p, k, code);
        acc += int64_t(c) * int64_t(p.derived().recon_w[recon_w_index(k, d, kp2)]);
      }
      out[size_t(i) * D + d] = std::fma(float(int32_t(uint32_t(uint64_t(acc)))), p.derived().recon_scale[d], p.mean[d]);
    }
}

// --- entropy coding of a block ---------------------------------------------


std::vector<uint8_t> encode_block(const HeadParams& p, const float* x, int64_t n) {
  BlockScratch& s = scratch();
  s.codes.resize(size_t(n) * size_t(p.n_kept()));
  // quantize_block reuses s.centred/s.coeffs/s.a..c but not s.codes.
  quantize_block(p, x, n, s.codes.data());
  return entropy_encode_codes(p, s.codes.data(), n);
}

std::pair<std::vector<uint8_t>, std::vector<uint8_t>> encode_block_pair(const HeadParams& p, const float* x_a,
                                                                        const float* x_b, int64_t n) {
  BlockScratch& s = scratch();
  s.codes.resize(size_t(n) * size_t(p.n_kept()));
  s.codes2.resize(s.codes.size());
  quantize_block(p, x_a, n, s.codes.data());
  quantize_block(p, x_b, n, s.codes2.data());
  return entropy_encode_codes_pair(p, s.codes.data(), n, p, s.codes2.data(), n);
}

#ifdef KVCODEC_KVTC_GEMM
KVCODEC_AVX2_BEGIN
// A centred row's largest |c| and square-sum lanes (lane l: the c[d]^2 of
// d = l mod 8, summed in order by fmas).
struct RowStats {
  float m = 0.0f;
  alignas(32) float lane[8] = {};
};

// encode_block_rows' f16 row [dim] by F16C: the row rounded to f16 and back,
// minus the mean, into c; with o (fused), the integer projection's scaling
// as well (scale_rows' values) into o [Dp] and, for a whole row, its flag
// into *fit; with stats (and no o), the row's largest |c| and square-sum
// lanes (proj8_scale_rows' values) for a whole row. Returns where the plain conversions go on: dim, or the first
// chunk holding a NaN, or the last D % 8 values. next_rows: how many floats
// on from row the caller's next block of this head usually starts.
int centre_row_f16_avx2(const HeadParams& p, const float* row, int64_t next_rows, float* c, int16_t* o, uint8_t* fit,
                        RowStats* stats) {
  const int dim = p.dim;
  const float* mean = p.mean.data();
  // Start the next block's lines' fetch now (a prefetch never faults; the
  // address is formed as an integer, since it may lie past the caller's array).
  const uintptr_t next = reinterpret_cast<uintptr_t>(row) + uintptr_t(next_rows) * sizeof(float);
  for (int e = 0; e < dim; e += 16)
    _mm_prefetch(reinterpret_cast<const char*>(next + uintptr_t(e) * sizeof(float)), _MM_HINT_T0);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 vs = _mm256_set1_ps(p.derived().proj_scale);
  __m256 vm = _mm256_setzero_ps(), acc = _mm256_setzero_ps();
  int d = 0;
  for (; d + 8 <= dim; d += 8) {
    const __m256 v = _mm256_loadu_ps(row + d);
    // NaN chunks take the scalar conversions (raw_convert's rule: the
    // core's routines define the NaN bits).
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) break;
    const __m256 r = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256 cv = _mm256_sub_ps(r, _mm256_loadu_ps(mean + d));
    _mm256_storeu_ps(c + d, cv);
    if (o) {
      scale_chunk(cv, vs, abs_mask, vm, acc, o + d);
    } else if (stats) {
      vm = _mm256_max_ps(vm, _mm256_and_ps(cv, abs_mask));
      acc = _mm256_fmadd_ps(cv, cv, acc);
    }
  }
  if (stats && d == dim) {
    stats->m = hmax(vm);
    _mm256_store_ps(stats->lane, acc);
  }
  if (o && d == dim) {
    alignas(32) float lane[8];
    _mm256_store_ps(lane, acc);
    *fit = uint8_t(finish_scaled_row(p, hmax(vm), lane, o));
  }
  return d;
}
KVCODEC_AVX2_END
#endif

namespace {

// encode_block_rows' codes [n, kept] into codes (resized).
void block_rows_codes(const HeadParams& p, const float* x, int64_t row_stride, int64_t n, DType raw,
                      std::vector<uint16_t>& codes) {
  if (raw != DType::kF16 && raw != DType::kBF16)
    throw Error(ErrorCode::kInvalidArgument, std::string("kvtc encode_block_rows: raw dtype must be f16 or bf16, got ") +
                                                 dtype_name(raw));
  if (n < 0) throw Error(ErrorCode::kInvalidArgument, "kvtc encode_block_rows: n = " + std::to_string(n));
  require_kernels(p, KernelSet::kEncode, "kvtc encode_block_rows");
  BlockScratch& s = scratch();
  const int dim = p.dim;
  const int kept = p.n_kept();
  codes.resize(size_t(n) * size_t(kept));
  if (n > 0 && kept > 0) {
    // centred[t] = round_raw(x[t]) - mean: the rows as the raw tail would
    // hold them (f32 -> raw -> f32), then centred as quantize_block does
    // (one float subtraction per element), in one pass over L1.
    row_buffer(s.centred, size_t(n) * size_t(dim));
    const float* mean = p.mean.data();
#ifdef KVCODEC_KVTC_GEMM
    // The integer projection's scaling fused in as well (scale_rows' values,
    // row by row): the rows are in registers here already.
    const bool simd_f16 = raw == DType::kF16 && simd_avx2();
    // With the 8-bit projection, its scaling instead (from the row's
    // largest |c| and square sum, gathered here; scaled from c in L1).
    const bool fuse8 = simd_f16 && proj_int_ready(p) && proj8_ready(p);
    const bool fuse = simd_f16 && proj_int_ready(p) && !fuse8;
    const size_t Dp = (size_t(dim) + 1) / 2 * 2, Dp4 = proj8_row_len(size_t(dim));
    if (fuse) {
      s.scaled.resize(size_t(n) * Dp);
      s.fits.resize(size_t(n));
    }
    if (fuse8) s.scaled8.resize(size_t(n) * Dp4), s.factor8.resize(size_t(n)), s.fits8.resize(size_t(n));
#endif
    for (int64_t t = 0; t < n; ++t) {
      const float* row = x + t * row_stride;
      float* c = s.centred.data() + size_t(t) * size_t(dim);
      int d = 0;
#ifdef KVCODEC_KVTC_GEMM
      if (simd_f16) {
        int16_t* o = fuse ? s.scaled.data() + size_t(t) * Dp : nullptr;
        RowStats stats;
        d = centre_row_f16_avx2(p, row, n * row_stride, c, o, fuse ? s.fits.data() + t : nullptr,
                                fuse8 ? &stats : nullptr);
        if (fuse && d == dim) continue;
        if (fuse8 && d == dim) {
          const float ss = lane_square_sum(stats.lane);
          s.fits8[size_t(t)] = uint8_t(proj8_scale_row(p, c, stats.m, ss, s.scaled8.data() + size_t(t) * Dp4,
                                                       s.factor8[size_t(t)], true));
          continue;
        }
        // A NaN chunk or D % 8 != 0: the plain conversions below, then
        // scale_rows on the finished row.
      }
#endif
      if (d < dim) {
        uint16_t h[8];
        float f[8];
        for (; d < dim; d += 8) {
          const size_t m = size_t(std::min(8, dim - d));
          f32_to_raw(row + d, h, raw, m);
          raw_to_f32(h, raw, f, m);
          for (size_t j = 0; j < m; ++j) c[size_t(d) + j] = f[j] - mean[size_t(d) + j];
        }
      }
#ifdef KVCODEC_KVTC_GEMM
      if (fuse) scale_rows(p, c, 1, s.scaled.data() + size_t(t) * Dp, s.fits.data() + t);
      if (fuse8)
        proj8_scale_rows(p, c, 1, s.scaled8.data() + size_t(t) * Dp4, s.factor8.data() + t, s.fits8.data() + t, true);
#endif
    }
#ifdef KVCODEC_KVTC_GEMM
    quantize_centred(p, s.centred.data(), n, codes.data(), QuantPath::kAuto,
                     fuse ? Prescaled::kInt16 : fuse8 ? Prescaled::kInt8 : Prescaled::kNo);
#else
    quantize_centred(p, s.centred.data(), n, codes.data(), QuantPath::kAuto);
#endif
  }
}

}  // namespace

std::vector<uint8_t> encode_block_rows(const HeadParams& p, const float* x, int64_t row_stride, int64_t n,
                                       DType raw) {
  BlockScratch& s = scratch();
  block_rows_codes(p, x, row_stride, n, raw, s.codes);
  return entropy_encode_codes(p, s.codes.data(), n);
}

std::pair<std::vector<uint8_t>, std::vector<uint8_t>> encode_block_rows_pair(const HeadParams& p, const float* x_a,
                                                                             const float* x_b, int64_t row_stride,
                                                                             int64_t n, DType raw) {
  BlockScratch& s = scratch();
  block_rows_codes(p, x_a, row_stride, n, raw, s.codes);
  block_rows_codes(p, x_b, row_stride, n, raw, s.codes2);
  return entropy_encode_codes_pair(p, s.codes.data(), n, p, s.codes2.data(), n);
}

namespace {

// The rANS decode tables of p (built on the fly for hand-assembled parameters).
const std::vector<const entropy::RansDecodeTable*>& rans_decode_tables(const HeadParams& p,
                                                                       std::vector<entropy::RansDecodeTable>& built,
                                                                       std::vector<const entropy::RansDecodeTable*>& tables) {
  tables.clear();
  built.clear();
  if (p.derived().rans_decode.size() != p.rans_tables.size())
    for (const auto& t : p.rans_tables) built.emplace_back(t);
  for (const auto& t : built.empty() ? p.derived().rans_decode : built) tables.push_back(&t);
  return tables;
}

// After entropy decoding: range check where needed, then reconstruction.
void finish_block(const HeadParams& p, const uint16_t* codes, int64_t n, float* out) {
  // A decoder may hand back a code past a component's levels on corrupt input
  // only if its table allowed it; reject so reconstruction stays in range.
  // (any_code_past_levels: one flag over the block, not a branch per code.)
  // (coder_bounds_codes: rANS and Huffman only return symbols of their
  // tables' alphabets.)
  if (!coder_bounds_codes(p) && any_code_past_levels(p, codes, n)) throw Error(ErrorCode::kFormat, "kvtc block: code out of range");
  dequantize_block(p, codes, n, out);
}

}  // namespace

void decode_block(const HeadParams& p, const uint8_t* data, size_t size, int64_t n, float* out) {
  require_kernels(p, KernelSet::kDecode, "kvtc decode_block");
  const int kept = p.n_kept();
  BlockScratch& s = scratch();
  s.codes.resize(size_t(n) * size_t(kept));
  uint16_t* codes = s.codes.data();
  entropy_decode_codes(p, data, size, n, codes);
  finish_block(p, codes, n, out);
}

void decode_blocks(const BlockDecode* blocks, size_t count, int64_t n) {
  if (count > kMaxBlocksTogether)
    throw Error(ErrorCode::kInvalidArgument, "kvtc decode_blocks: " + std::to_string(count) + " blocks, at most " +
                                                 std::to_string(kMaxBlocksTogether));
  bool all_rans = true;
  for (size_t j = 0; j < count; ++j) {
    require_kernels(*blocks[j].params, KernelSet::kDecode, "kvtc decode_blocks");
    all_rans &= blocks[j].params->coder == CoderChoice::kRans;
  }
  if (!all_rans) {
    for (size_t j = 0; j < count; ++j) decode_block(*blocks[j].params, blocks[j].data, blocks[j].size, n, blocks[j].out);
    return;
  }
  struct Scratch {
    std::vector<uint16_t> codes;
    std::vector<const entropy::RansDecodeTable*> tables;
    std::vector<entropy::RansDecodeTable> built;
  };
  thread_local Scratch scratch[kMaxBlocksTogether];
  entropy::RansDecodeJob jobs[kMaxBlocksTogether];
  for (size_t j = 0; j < count; ++j) {
    const HeadParams& p = *blocks[j].params;
    Scratch& s = scratch[j];
    s.codes.resize(size_t(n) * size_t(p.n_kept()));
    entropy::RansDecodeJob& job = jobs[j];
    job.data = blocks[j].data, job.size = blocks[j].size, job.n_rows = size_t(n), job.n_cols = size_t(p.n_kept());
    job.tables = &rans_decode_tables(p, s.built, s.tables), job.out = s.codes.data();
    if (s.built.empty()) job.groups = &p.derived().rans_groups;
  }
  entropy::rans_decode_streams(jobs, count);
  for (size_t j = 0; j < count; ++j) finish_block(*blocks[j].params, scratch[j].codes.data(), n, blocks[j].out);
}

void decode_block_pair(const HeadParams& pa, const uint8_t* data_a, size_t size_a, float* out_a,
                       const HeadParams& pb, const uint8_t* data_b, size_t size_b, float* out_b, int64_t n) {
  const BlockDecode blocks[2] = {{&pa, data_a, size_a, out_a}, {&pb, data_b, size_b, out_b}};
  decode_blocks(blocks, 2, n);
}

// --- side information --------------------------------------------------------
//
// Layout (little-endian): u16 dim, u8 coder, u8 basis_bits, u16 K,
// K x u16 kept index, D x f16 mean, basis (K x D f16, or K x (f16 scale +
// D x i8)), K x (f32 step, u16 levels, u16 zero, u8 flags: bit 0 midrise,
// bit 1 centroid reconstruction, then 3 x f16 centroid offsets when bit 1
// is set), then the coder's tables as one length-prefixed bit-packed blob.
// Lattice quantizers (flags 0 or 1) are stored as before centroids existed.

void HeadParams::serialize(ByteWriter& out) const {
  out.u16(uint16_t(dim));
  out.u8(uint8_t(coder));
  out.u8(uint8_t(basis_bits));
  out.u16(uint16_t(kept.size()));
  for (uint16_t k : kept) out.u16(k);
  for (float m : mean) out.u16(f32_to_f16(m));
  const int K = n_kept();
  for (int k = 0; k < K; ++k) {
    const float* row = &basis[size_t(k) * size_t(dim)];
    if (basis_bits == 16) {
      for (int d = 0; d < dim; ++d) out.u16(f32_to_f16(row[d]));
    } else {
      // The stored rows are exactly scale * int8 (7 + 11 mantissa bits fit a float).
      const float scale = row_scale[size_t(k)];
      out.u16(f32_to_f16(scale));
      for (int d = 0; d < dim; ++d)
        out.u8(uint8_t(int8_t(scale == 0.0f ? 0.0f : std::nearbyint(row[d] / scale))));
    }
  }
  for (const ComponentQuantizer& q : quant) {
    out.f32(q.step);
    out.u16(q.levels);
    out.u16(q.zero);
    const bool centroid = q.has_centroid();
    out.u8(uint8_t((q.half_offset ? 1 : 0) | (centroid ? 2 : 0)));
    if (centroid)
      for (float c : q.centroid) out.u16(f32_to_f16(c));
  }
  entropy::BitWriter tables;
  if (coder == CoderChoice::kRans)
    for (const auto& t : rans_tables) t.serialize(tables);
  if (coder == CoderChoice::kHuffman)
    for (const auto& t : huffman_tables) t.serialize(tables);
  const std::vector<uint8_t> blob = tables.bytes();
  out.u32(uint32_t(blob.size()));
  out.bytes(blob.data(), blob.size());
}

size_t HeadParams::serialized_size() const {
  ByteWriter w;
  serialize(w);
  return w.size();
}

namespace {

// n little-endian f16 words of `in` as floats, converted in bulk (the basis
// is most of a head's bytes, and a cache holding its parameters as bytes
// parses them on every call): the same values as f16_to_f32 word by word.
void read_f16s(ByteReader& in, float* out, size_t n) {
  const std::span<const uint8_t> bytes = in.bytes(2 * n);
  thread_local std::vector<uint16_t> words;
  words.resize(n);
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(words.data(), bytes.data(), 2 * n);
  } else {
    for (size_t i = 0; i < n; ++i) words[i] = uint16_t(bytes[2 * i] | bytes[2 * i + 1] << 8);
  }
  raw_to_f32(words.data(), DType::kF16, out, n);
}

// HeadParams::deserialize's parse and checks into p: a fresh object, or
// one parsed before (HeadOpener), every field of which is set again with
// its vectors keeping their capacity (the frequency tables' included).
// Kernels not built; p.kernels is left as it was.
void parse_params(ByteReader& in, int expected_dim, HeadParams& p) {
  p.kept.clear(), p.row_scale.clear(), p.quant.clear(), p.fixed_widths.clear(), p.bits.clear();
  p.eigenvalues.clear(), p.huffman_tables.clear();
  p.dim = in.u16();
  if (p.dim != expected_dim)
    throw Error(ErrorCode::kFormat, "kvtc head params: dim " + std::to_string(p.dim) + ", expected " +
                                        std::to_string(expected_dim));
  const uint8_t coder = in.u8();
  if (coder > uint8_t(CoderChoice::kFixed)) throw Error(ErrorCode::kFormat, "kvtc head params: bad coder id");
  p.coder = CoderChoice(coder);
  p.basis_bits = in.u8();
  if (p.basis_bits != 16 && p.basis_bits != 8) throw Error(ErrorCode::kFormat, "kvtc head params: bad basis_bits");
  const int K = in.u16();
  if (K > p.dim) throw Error(ErrorCode::kFormat, "kvtc head params: more kept components than dim");
  p.kept.reserve(size_t(K));  // K <= dim < 2^16: sized once, not grown (a cache parses these per call)
  for (int k = 0; k < K; ++k) {
    const uint16_t idx = in.u16();
    if (idx >= p.dim || (k > 0 && idx <= p.kept.back()))
      throw Error(ErrorCode::kFormat, "kvtc head params: kept component indices not ascending in range");
    p.kept.push_back(idx);
  }
  // The mean, basis and quantizers must be there before anything is sized by
  // K x dim (a few bytes claiming dim = K = 65535 must not allocate 16 GB).
  const size_t basis_row_bytes = p.basis_bits == 16 ? 2 * size_t(p.dim) : 2 + size_t(p.dim);
  const size_t need = 2 * size_t(p.dim) + size_t(K) * (basis_row_bytes + 9) + 4;
  if (in.remaining() < need)
    throw Error(ErrorCode::kFormat, "kvtc head params: " + std::to_string(K) + " components of dim " +
                                        std::to_string(p.dim) + " need " + std::to_string(need) + " bytes, " +
                                        std::to_string(in.remaining()) + " remain");
  p.mean.resize(size_t(p.dim));
  read_f16s(in, p.mean.data(), p.mean.size());
  p.basis.resize(size_t(K) * size_t(p.dim));
  if (p.basis_bits == 16) read_f16s(in, p.basis.data(), p.basis.size());
  for (int k = 0; k < K && p.basis_bits == 8; ++k) {
    float* row = &p.basis[size_t(k) * size_t(p.dim)];
    const float scale = f16_to_f32(in.u16());
    if (!std::isfinite(scale)) throw Error(ErrorCode::kFormat, "kvtc head params: non-finite basis scale");
    p.row_scale.push_back(scale);
    // The row's bytes in one read (a byte at a time was a quarter of a
    // head's opening, which a cache does per call).
    const uint8_t* q = in.bytes(size_t(p.dim)).data();
    for (int d = 0; d < p.dim; ++d) row[d] = float(int8_t(q[d])) * scale;
  }
  p.quant.reserve(size_t(K)), p.fixed_widths.reserve(size_t(K)), p.bits.reserve(size_t(K));
  for (int k = 0; k < K; ++k) {
    ComponentQuantizer q;
    q.step = in.f32();
    q.levels = in.u16();
    q.zero = in.u16();
    const uint8_t flags = in.u8();
    if (!(std::isfinite(q.step) && q.step > 0.0f) || q.levels < 2 || q.levels > (1u << kMaxComponentBits) || q.zero >= q.levels || flags > 3)
      throw Error(ErrorCode::kFormat, "kvtc head params: bad quantizer of component " + std::to_string(k));
    q.half_offset = (flags & 1) != 0;
    if (flags & 2) {
      for (float& c : q.centroid) c = f16_to_f32(in.u16());
      for (float c : q.centroid)
        if (!(std::fabs(c) <= 0.5f))
          throw Error(ErrorCode::kFormat, "kvtc head params: centroid offset of component " + std::to_string(k) +
                                              " outside [-1/2, 1/2] steps");
      // One encoding per quantizer: offsets all 0 are the lattice (flag clear).
      if (!q.has_centroid())
        throw Error(ErrorCode::kFormat, "kvtc head params: component " + std::to_string(k) +
                                            " flags centroid offsets that are all 0");
    }
    p.quant.push_back(q);
    p.fixed_widths.push_back(uint8_t(ceil_log2(q.levels)));
    p.bits.push_back(ceil_log2(q.levels));
  }
  const uint32_t blob_size = in.u32();
  const uint8_t* blob = in.bytes(blob_size).data();
  entropy::BitReader tables(blob, blob_size);
  // Sized once (the tables kept from a previous parse are parsed into).
  p.rans_tables.resize(p.coder == CoderChoice::kRans ? size_t(K) : 0);
  if (p.coder == CoderChoice::kHuffman) p.huffman_tables.reserve(size_t(K));
  if (p.coder == CoderChoice::kRans)
    for (int k = 0; k < K; ++k)
      entropy::FrequencyTable::deserialize_into(tables, p.quant[size_t(k)].levels, p.rans_tables[size_t(k)]);
  if (p.coder == CoderChoice::kHuffman)
    for (int k = 0; k < K; ++k) p.huffman_tables.push_back(entropy::HuffmanTable::deserialize(tables, p.quant[size_t(k)].levels));
  for (int k = 0; k < K; ++k) {
    const uint32_t alphabet = p.coder == CoderChoice::kRans      ? p.rans_tables[size_t(k)].alphabet_size
                              : p.coder == CoderChoice::kHuffman ? p.huffman_tables[size_t(k)].alphabet_size
                                                                 : p.quant[size_t(k)].levels;
    if (alphabet != p.quant[size_t(k)].levels)
      throw Error(ErrorCode::kFormat, "kvtc head params: table of component " + std::to_string(k) +
                                          " does not match its quantizer");
  }
}

}  // namespace

HeadParams HeadParams::deserialize(ByteReader& in, int expected_dim, KernelSet kernels) {
  HeadParams p;
  parse_params(in, expected_dim, p);
  p.build_kernels(kernels);
  return p;
}

const HeadParams& HeadOpener::open(ByteReader& in, int expected_dim, KernelSet kernels) {
  params_.kernels.reset();  // not a valid head until the end
  // Kernels some copy of an earlier result still shares are left to it.
  if (!kernels_ || kernels_.use_count() > 1) kernels_ = std::make_shared<HeadKernels>();
  parse_params(in, expected_dim, params_);
  build_kernels<false>(params_, kernels, *kernels_);
  params_.kernels = kernels_;
  return params_;
}

}  // namespace kvcodec::kvtc

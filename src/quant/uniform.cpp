#include "quant/uniform.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numbers>
#include <string>

#include "kvcodec/error.hpp"

namespace kvcodec::quant {
namespace {

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, what);
}

std::string fstr(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// Why a quantizer is unusable, or "" when it is fine.
std::string fault(const UniformQuantizer& q) {
  if (!std::isfinite(q.lo) || !std::isfinite(q.hi)) {
    return "quantizer range [" + fstr(q.lo) + ", " + fstr(q.hi) + "] is not finite";
  }
  if (q.lo > q.hi) return "quantizer range has lo = " + fstr(q.lo) + " > hi = " + fstr(q.hi);
  if (q.levels < 1 || q.levels > kMaxLevels) {
    return "quantizer levels = " + std::to_string(q.levels) + ", must be in [1, " +
           std::to_string(kMaxLevels) + "]";
  }
  if (q.levels > 1) {
    const float width = q.hi - q.lo;
    if (!(width > 0.0f) || !std::isfinite(width) || !std::isfinite(q.scale()) ||
        !std::isfinite(q.step()) || !(q.step() > 0.0f)) {
      return "quantizer with " + std::to_string(q.levels) + " levels over [" + fstr(q.lo) + ", " +
             fstr(q.hi) + "] has no usable step";
    }
  }
  return {};
}

}  // namespace

void validate(const UniformQuantizer& q) {
  const std::string f = fault(q);
  if (!f.empty()) invalid(f);
}

UniformQuantizer make_range_quantizer(float lo, float hi, int bits) {
  if (!std::isfinite(lo) || !std::isfinite(hi) || lo > hi) {
    invalid("make_range_quantizer: range [" + fstr(lo) + ", " + fstr(hi) + "] must be finite with lo <= hi");
  }
  if (bits < 0 || bits > kMaxBits) {
    invalid("make_range_quantizer: bits = " + std::to_string(bits) + ", must be in [0, " +
            std::to_string(kMaxBits) + "]");
  }
  UniformQuantizer q;
  if (bits == 0) {
    const float c = std::clamp(0.0f, lo, hi);
    q.lo = q.hi = c;
    q.levels = 1;
    return q;
  }
  q.lo = lo;
  q.hi = hi;
  q.levels = 1u << bits;
  if (!fault(q).empty()) {
    // Empty (or denormal-narrow) range: a constant component; one level at
    // its centre loses nothing that 2^bits levels could keep.
    q.levels = 1;
    if (!std::isfinite(hi - lo)) invalid("make_range_quantizer: range width overflows float");
  }
  return q;
}

UniformQuantizer make_step_quantizer(float step, float lo, float hi, float centre) {
  if (!std::isfinite(step) || !(step > 0.0f)) {
    invalid("make_step_quantizer: step = " + fstr(step) + ", must be finite and > 0");
  }
  if (!std::isfinite(lo) || !std::isfinite(hi) || lo > hi || !std::isfinite(centre)) {
    invalid("make_step_quantizer: range [" + fstr(lo) + ", " + fstr(hi) + "] and centre " + fstr(centre) +
            " must be finite with lo <= hi");
  }
  // In double: (hi - centre) / step can be huge for a tiny step; check the
  // count before anything is sized by it.
  const double kmin = std::round((static_cast<double>(lo) - centre) / step);
  const double kmax = std::round((static_cast<double>(hi) - centre) / step);
  const double count = kmax - kmin + 1.0;
  if (!(count <= kMaxLevels)) {
    invalid("make_step_quantizer: step " + fstr(step) + " over [" + fstr(lo) + ", " + fstr(hi) +
            "] needs " + fstr(count) + " levels, more than " + std::to_string(kMaxLevels));
  }
  UniformQuantizer q;
  q.levels = static_cast<uint32_t>(count);
  if (q.levels == 1) {
    q.lo = q.hi = static_cast<float>(centre + kmin * static_cast<double>(step));
    return q;
  }
  q.lo = static_cast<float>(centre + (kmin - 0.5) * static_cast<double>(step));
  q.hi = static_cast<float>(centre + (kmax + 0.5) * static_cast<double>(step));
  validate(q);
  return q;
}

namespace {
// Gaussian partial moments over [a, b] (infinite ends allowed):
// m0 = P(a < X < b), m1 = E[X; a<X<b], m2 = E[X^2; a<X<b].
double pdf(double x) { return std::isinf(x) ? 0.0 : std::exp(-0.5 * x * x) / std::sqrt(2.0 * std::numbers::pi); }
double cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }
double x_pdf(double x) { return std::isinf(x) ? 0.0 : x * pdf(x); }
}  // namespace

double gaussian_uniform_mse(int bits, double step) {
  if (bits < 1 || bits > kMaxBits || !(step > 0.0) || !std::isfinite(step)) {
    invalid("gaussian_uniform_mse: bits = " + std::to_string(bits) + " (must be 1..12), step = " +
            fstr(step) + " (must be finite and > 0)");
  }
  const int levels = 1 << bits;
  const double inf = std::numeric_limits<double>::infinity();
  double mse = 0.0;
  for (int k = 0; k < levels; ++k) {
    const double c = (k - 0.5 * (levels - 1)) * step;  // cell centre
    const double a = k == 0 ? -inf : c - 0.5 * step;
    const double b = k == levels - 1 ? inf : c + 0.5 * step;
    const double m0 = cdf(b) - cdf(a);
    const double m1 = pdf(a) - pdf(b);
    const double m2 = m0 - (x_pdf(b) - x_pdf(a));
    mse += m2 - 2.0 * c * m1 + c * c * m0;
  }
  return mse;
}

double gaussian_optimal_step(int bits) {
  if (bits < 1 || bits > kMaxBits) {
    invalid("gaussian_optimal_step: bits = " + std::to_string(bits) + ", must be in [1, 12]");
  }
  // The MSE is unimodal in the step: granular error grows, overload shrinks.
  double a = 1e-4, b = 4.0;
  const double r = 0.5 * (std::sqrt(5.0) - 1.0);
  double x1 = b - r * (b - a), x2 = a + r * (b - a);
  double f1 = gaussian_uniform_mse(bits, x1), f2 = gaussian_uniform_mse(bits, x2);
  for (int it = 0; it < 200 && b - a > 1e-12; ++it) {
    if (f1 < f2) {
      b = x2; x2 = x1; f2 = f1;
      x1 = b - r * (b - a); f1 = gaussian_uniform_mse(bits, x1);
    } else {
      a = x1; x1 = x2; f1 = f2;
      x2 = a + r * (b - a); f2 = gaussian_uniform_mse(bits, x2);
    }
  }
  return 0.5 * (a + b);
}

UniformQuantizer make_gaussian_quantizer(float sigma, int bits, float centre) {
  if (!std::isfinite(sigma) || sigma < 0.0f || !std::isfinite(centre)) {
    invalid("make_gaussian_quantizer: sigma = " + fstr(sigma) + ", centre = " + fstr(centre) +
            "; sigma must be finite and >= 0, centre finite");
  }
  if (bits < 0 || bits > kMaxBits) {
    invalid("make_gaussian_quantizer: bits = " + std::to_string(bits) + ", must be in [0, 12]");
  }
  if (bits == 0 || sigma == 0.0f) {
    UniformQuantizer q;
    q.lo = q.hi = centre;
    return q;
  }
  const double half = std::ldexp(gaussian_optimal_step(bits), bits - 1) * sigma;
  return make_range_quantizer(static_cast<float>(centre - half), static_cast<float>(centre + half), bits);
}

void quantize_block_reference(const UniformQuantizer* q, int cols, const float* x, int64_t n,
                              uint16_t* codes) {
  for (int64_t i = 0; i < n; ++i) {
    for (int c = 0; c < cols; ++c) codes[i * cols + c] = q[c].quantize(x[i * cols + c]);
  }
}

void dequantize_block_reference(const UniformQuantizer* q, int cols, const uint16_t* codes, int64_t n,
                                float* x) {
  for (int64_t i = 0; i < n; ++i) {
    for (int c = 0; c < cols; ++c) x[i * cols + c] = q[c].dequantize(codes[i * cols + c]);
  }
}

namespace {
// Per-column constants, hoisted out of the token loop. A one-level column
// uses scale 0 (every code is 0) and lo = its reconstruction point with
// step 0, which equals UniformQuantizer::dequantize's midpoint.
struct Columns {
  std::vector<float> lo, scale, step, max_code, recon_lo;
  explicit Columns(const UniformQuantizer* q, int cols)
      : lo(cols), scale(cols), step(cols), max_code(cols), recon_lo(cols) {
    for (int c = 0; c < cols; ++c) {
      lo[c] = q[c].lo;
      scale[c] = q[c].scale();
      step[c] = q[c].step();
      max_code[c] = q[c].max_code();
      recon_lo[c] = q[c].levels > 1 ? q[c].lo : q[c].lo + 0.5f * (q[c].hi - q[c].lo);
    }
  }
};
}  // namespace

void quantize_block(const UniformQuantizer* q, int cols, const float* x, int64_t n, uint16_t* codes) {
  if (n <= 0 || cols <= 0) return;
  const Columns k(q, cols);
  const float* lo = k.lo.data();
  const float* scale = k.scale.data();
  const float* max_code = k.max_code.data();
  for (int64_t i = 0; i < n; ++i) {
    const float* xr = x + i * cols;
    uint16_t* cr = codes + i * cols;
    for (int c = 0; c < cols; ++c) cr[c] = quantize_index(xr[c], lo[c], scale[c], max_code[c]);
  }
}

void dequantize_block(const UniformQuantizer* q, int cols, const uint16_t* codes, int64_t n, float* x) {
  if (n <= 0 || cols <= 0) return;
  const Columns k(q, cols);
  const float* lo = k.recon_lo.data();
  const float* step = k.step.data();
  const float* max_code = k.max_code.data();
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t* cr = codes + i * cols;
    float* xr = x + i * cols;
    for (int c = 0; c < cols; ++c) xr[c] = dequantize_value(cr[c], lo[c], step[c], max_code[c]);
  }
}

void append_quantizer(std::vector<uint8_t>& out, const UniformQuantizer& q) {
  validate(q);
  uint8_t buf[kSerializedQuantizerBytes];
  uint32_t lo_bits, hi_bits;
  std::memcpy(&lo_bits, &q.lo, 4);
  std::memcpy(&hi_bits, &q.hi, 4);
  for (int i = 0; i < 4; ++i) {
    buf[i] = static_cast<uint8_t>(lo_bits >> (8 * i));
    buf[4 + i] = static_cast<uint8_t>(hi_bits >> (8 * i));
  }
  buf[8] = static_cast<uint8_t>(q.levels);
  buf[9] = static_cast<uint8_t>(q.levels >> 8);
  out.insert(out.end(), buf, buf + kSerializedQuantizerBytes);
}

UniformQuantizer read_quantizer(const uint8_t* data, size_t size, size_t& offset) {
  if (offset > size || size - offset < kSerializedQuantizerBytes || data == nullptr) {
    throw Error(ErrorCode::kFormat, "quantizer at offset " + std::to_string(offset) + ": truncated (" +
                                        std::to_string(offset <= size ? size - offset : 0) +
                                        " bytes left, need " +
                                        std::to_string(kSerializedQuantizerBytes) + ")");
  }
  const uint8_t* p = data + offset;
  uint32_t lo_bits = 0, hi_bits = 0;
  for (int i = 0; i < 4; ++i) {
    lo_bits |= static_cast<uint32_t>(p[i]) << (8 * i);
    hi_bits |= static_cast<uint32_t>(p[4 + i]) << (8 * i);
  }
  UniformQuantizer q;
  std::memcpy(&q.lo, &lo_bits, 4);
  std::memcpy(&q.hi, &hi_bits, 4);
  q.levels = static_cast<uint32_t>(p[8]) | (static_cast<uint32_t>(p[9]) << 8);
  const std::string f = fault(q);
  if (!f.empty()) throw Error(ErrorCode::kFormat, "quantizer at offset " + std::to_string(offset) + ": " + f);
  offset += kSerializedQuantizerBytes;
  return q;
}

}  // namespace kvcodec::quant

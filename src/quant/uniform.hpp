// kvcodec::quant: uniform scalar quantizers with frozen ranges (DESIGN 4).
//
// A quantizer splits [lo, hi] into `levels` equal cells of width
// step = (hi - lo) / levels and reconstructs each code at its cell CENTRE:
//   quantize(x)   = clamp(floor((x - lo) * levels / (hi - lo)), 0, levels-1)
//   dequantize(q) = lo + (q + 0.5) * step
// Why centres rather than endpoints: for bell-shaped data with [lo, hi] from
// the fit data's extremes, the endpoint grid spends two levels on the rare
// tails and has the larger step (hi-lo)/(levels-1); centres give the smaller
// step (hi-lo)/levels, so lower granular MSE (step^2/12) at the same bits,
// the same worst-case error step/2 inside the range, and at 1 bit the two
// levels sit at +-range/4 rather than on the extremes.
//
// levels == 1 (bits = 0, or an empty range) has no information: every value
// maps to code 0, reconstructed at (lo + hi) / 2. make_range_quantizer with
// bits = 0 sets lo = hi = clamp(0, lo, hi), so a dropped (centred) component
// reconstructs at its mean, 0.
//
// Values outside [lo, hi] clamp to the end codes; NaN maps to code 0. The
// arithmetic is plain float (ISO C++ build: no FMA contraction), written once
// (quantize_index / dequantize_value below) so every path gives the same bits.
//
// Serialised form (append_quantizer/read_quantizer, 10 bytes, little endian):
// lo f32, hi f32, levels u16.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvcodec::quant {

constexpr uint32_t kMaxLevels = 4096;  // codes fit 12 bits
constexpr int kMaxBits = 12;
constexpr size_t kSerializedQuantizerBytes = 10;

// Shared arithmetic (see header comment). scale = levels / (hi - lo) as float,
// 0 when levels <= 1; max_code = levels - 1 as float.
inline uint16_t quantize_index(float x, float lo, float scale, float max_code) {
  float t = (x - lo) * scale;
  t = t > 0.0f ? t : 0.0f;  // also maps NaN to 0
  t = t < max_code ? t : max_code;
  return static_cast<uint16_t>(static_cast<int>(t));
}
inline float dequantize_value(uint16_t q, float lo, float step, float max_code) {
  float fq = static_cast<float>(q);
  fq = fq < max_code ? fq : max_code;
  return lo + (fq + 0.5f) * step;
}

struct UniformQuantizer {
  float lo = 0.0f;
  float hi = 0.0f;
  uint32_t levels = 1;  // >= 1, <= kMaxLevels

  float step() const { return levels > 1 ? (hi - lo) / static_cast<float>(levels) : 0.0f; }
  float scale() const { return levels > 1 ? static_cast<float>(levels) / (hi - lo) : 0.0f; }
  float max_code() const { return static_cast<float>(levels - 1); }
  uint16_t quantize(float x) const { return quantize_index(x, lo, scale(), max_code()); }
  // Codes >= levels clamp to levels - 1.
  float dequantize(uint16_t q) const {
    return levels > 1 ? dequantize_value(q, lo, step(), max_code()) : lo + 0.5f * (hi - lo);
  }
};

// 2^bits levels spanning [lo, hi] (bits in [0, 12]; lo <= hi, finite). An
// empty range or bits = 0 gives one level (see above). Throws
// Error(kInvalidArgument) otherwise.
UniformQuantizer make_range_quantizer(float lo, float hi, int bits);

// A grid of pitch `step` through `centre` (usually 0, the mean of a centred
// component) covering [lo, hi]: grid points centre + k*step for k from
// round((lo-centre)/step) to round((hi-centre)/step), so every x in [lo, hi]
// is within step/2 of a point. The quantizer's own step() equals `step` up
// to float rounding of its lo/hi. Throws Error(kInvalidArgument) for a
// non-positive or non-finite step, lo > hi, non-finite bounds, or more than
// kMaxLevels grid points (the message gives the count).
UniformQuantizer make_step_quantizer(float step, float lo, float hi, float centre = 0.0f);

// The step (in units of the standard deviation) of the MSE-optimal
// 2^bits-level uniform quantizer with cell-centre reconstruction for a
// Gaussian, found by golden-section search on the exact MSE (Gaussian
// partial moments, clamped tails included). bits in [1, 12]; e.g. about 1.596
// at 1 bit, 0.996 at 2, 0.586 at 3, 0.335 at 4. Deterministic.
double gaussian_optimal_step(int bits);
// Its MSE for a unit-variance Gaussian (e.g. ~0.363 at 1 bit, ~0.1188 at 2).
double gaussian_uniform_mse(int bits, double step);
// make_range_quantizer over centre +- 2^(bits-1) * gaussian_optimal_step(bits)
// * sigma (bits = 0: one level at centre): the range a Gaussian-like
// component should get rather than its sample extremes, which at low widths
// waste levels on the tails. sigma must be finite and >= 0.
UniformQuantizer make_gaussian_quantizer(float sigma, int bits, float centre = 0.0f);

// Throws Error(kInvalidArgument) naming the fault unless q is usable:
// finite lo <= hi, 1 <= levels <= kMaxLevels, hi > lo and a finite scale
// when levels > 1.
void validate(const UniformQuantizer& q);

// Bulk over a block x [n, cols] row-major with one quantizer per column
// (q[cols]); codes [n, cols]. The fast versions hoist the per-column
// constants and run a branch-free, auto-vectorisable inner loop; they are
// bit-identical to the references (plain loops over quantize()/dequantize()).
void quantize_block(const UniformQuantizer* q, int cols, const float* x, int64_t n, uint16_t* codes);
void quantize_block_reference(const UniformQuantizer* q, int cols, const float* x, int64_t n,
                              uint16_t* codes);
void dequantize_block(const UniformQuantizer* q, int cols, const uint16_t* codes, int64_t n, float* x);
void dequantize_block_reference(const UniformQuantizer* q, int cols, const uint16_t* codes, int64_t n,
                                float* x);

// Appends the 10-byte form. q must be valid.
void append_quantizer(std::vector<uint8_t>& out, const UniformQuantizer& q);
// Reads one quantizer at data[offset], advances offset. Throws Error(kFormat)
// for truncated input or an invalid quantizer (message names the offset).
UniformQuantizer read_quantizer(const uint8_t* data, size_t size, size_t& offset);

}  // namespace kvcodec::quant

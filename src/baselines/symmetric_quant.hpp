// Symmetric per-token group quantizers, in the style of llama.cpp's q8_0 and
// q4_0 (DESIGN 6): one token row of n values in groups of g consecutive
// values, each group with one f16 scale d and codes of `bits` bits.
//   8 bits: d = max|x| / 127, q = round(x / d) in [-127, 127], x_hat = q * d.
//   4 bits: d = m / -8 where m is the value of largest magnitude (sign kept),
//           q = clamp(round(x / d) + 8, 0, 15), x_hat = (q - 8) * d; the
//           extreme value lands exactly on code 0.
// The scale saturates at the largest finite f16 (65504) instead of Inf, so
// a bf16 value beyond ~127 * 65504 is clipped, never turned into NaN.
// Layout of a row: n / g f16 scales, then the codes bit-packed (LSB first).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvcodec::baselines {

size_t sym_row_bytes(int64_t n, int64_t g, int bits);
void sym_encode_row(const float* x, int64_t n, int64_t g, int bits, std::vector<uint8_t>& out);
void sym_decode_row(const uint8_t* blob, size_t size, int64_t n, int64_t g, int bits, float* x);

}  // namespace kvcodec::baselines

// Scalar group quantizers shared by the latent (PALU) and KIVI caches.
//
// Asymmetric min/max quantization of one group of n values taken with a
// stride: code = clamp(round((x - min) / scale), 0, 2^bits - 1), x_hat =
// min + code * scale, with min and scale stored as f16. Both are computed from
// the f16-rounded parameters so the encoder and the decoder agree bit for bit.
// Parameters saturate at +-65504 (the f16 range) instead of overflowing to Inf,
// so a bf16 outlier costs accuracy, never a NaN.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "palu/bitpack.hpp"

namespace kvcodec::detail {

struct AsymParams {
  uint16_t min_f16 = 0;
  uint16_t scale_f16 = 0;
};

// Rounds to the nearest code in [0, max_code]; NaN maps to 0 (never UB).
int clamp_code(float v, int max_code);

// f32 -> f16 bits, saturating at the largest finite f16 instead of Inf.
uint16_t f16_saturate(float v);

// Chooses min/scale for x[0], x[stride], ..., x[(n-1)*stride].
AsymParams asym_fit(const float* x, int64_t n, int64_t stride, int bits);
// Appends the n codes of x under p.
void asym_encode(const AsymParams& p, const float* x, int64_t n, int64_t stride, int bits, BitWriter& out);
// Reads n codes and writes min + code * scale to out[i * stride].
void asym_decode(const AsymParams& p, int64_t n, int bits, BitReader& in, float* out, int64_t stride);

}  // namespace kvcodec::detail

namespace kvcodec::detail {

// A token group x [n_tokens, rows, channels] (token-major): per (row, channel)
// an f16 min and scale over the n_tokens, then the codes of every (row,
// channel) at bits[channel]. Used for PALU latents and KIVI keys (per-channel).
size_t channel_group_bytes(int64_t rows, int64_t channels, int64_t n_tokens, const uint8_t* bits);
void encode_channel_group(const float* x, int64_t rows, int64_t channels, int64_t n_tokens,
                          const uint8_t* bits, std::vector<uint8_t>& out);
void decode_channel_group(const uint8_t* blob, size_t size, int64_t rows, int64_t channels,
                          int64_t n_tokens, const uint8_t* bits, float* x);

// One token row x [n] in groups of g consecutive values: per group an f16 min
// and scale, then all codes. Used for KIVI values (per-token). n % g == 0.
size_t row_group_bytes(int64_t n, int64_t g, int bits);
void encode_row_groups(const float* x, int64_t n, int64_t g, int bits, std::vector<uint8_t>& out);
void decode_row_groups(const uint8_t* blob, size_t size, int64_t n, int64_t g, int bits, float* x);

}  // namespace kvcodec::detail

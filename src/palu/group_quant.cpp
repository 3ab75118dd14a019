#include "palu/group_quant.hpp"

#include <cmath>

#include "kvcodec/tensor.hpp"

namespace kvcodec::detail {

int clamp_code(float v, int max_code) {
  // Written so that NaN fails the first test: a float -> int cast of NaN is UB.
  if (!(v > 0.0f)) return 0;
  if (v >= float(max_code)) return max_code;
  return int(std::floor(v + 0.5f));
}

uint16_t f16_saturate(float v) {
  constexpr float kMax = 65504.0f;
  if (v > kMax) v = kMax;
  if (v < -kMax) v = -kMax;
  return f32_to_f16(v);
}

AsymParams asym_fit(const float* x, int64_t n, int64_t stride, int bits) {
  float lo = INFINITY, hi = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i * stride];
    if (v < lo) lo = v;
    if (v > hi) hi = v;
  }
  if (!(lo <= hi)) lo = hi = 0.0f;  // empty or all NaN
  AsymParams p;
  p.min_f16 = f16_saturate(lo);
  const float mn = f16_to_f32(p.min_f16);
  const int max_code = (1 << bits) - 1;
  float scale = (hi - mn) / float(max_code);
  // Rounding the scale down could leave hi one step short of its code; round
  // up in that case so the top of the range stays reachable.
  p.scale_f16 = f16_saturate(scale);
  if (f16_to_f32(p.scale_f16) * float(max_code) + mn < hi && p.scale_f16 < 0x7bffu) ++p.scale_f16;
  if (!(scale > 0.0f)) p.scale_f16 = 0;
  return p;
}

void asym_encode(const AsymParams& p, const float* x, int64_t n, int64_t stride, int bits, BitWriter& out) {
  const float mn = f16_to_f32(p.min_f16);
  const float sc = f16_to_f32(p.scale_f16);
  const int max_code = (1 << bits) - 1;
  const float inv = sc > 0.0f ? 1.0f / sc : 0.0f;
  for (int64_t i = 0; i < n; ++i) out.put(uint32_t(clamp_code((x[i * stride] - mn) * inv, max_code)), bits);
}

void asym_decode(const AsymParams& p, int64_t n, int bits, BitReader& in, float* out, int64_t stride) {
  const float mn = f16_to_f32(p.min_f16);
  const float sc = f16_to_f32(p.scale_f16);
  for (int64_t i = 0; i < n; ++i) out[i * stride] = mn + float(in.get(bits)) * sc;
}

static void put_params(const AsymParams& q, std::vector<uint8_t>& out) {
  out.push_back(uint8_t(q.min_f16));
  out.push_back(uint8_t(q.min_f16 >> 8));
  out.push_back(uint8_t(q.scale_f16));
  out.push_back(uint8_t(q.scale_f16 >> 8));
}

static AsymParams get_params(const uint8_t* q) {
  return AsymParams{uint16_t(q[0] | (q[1] << 8)), uint16_t(q[2] | (q[3] << 8))};
}

size_t channel_group_bytes(int64_t rows, int64_t channels, int64_t n_tokens, const uint8_t* bits) {
  size_t code_bits = 0;
  for (int64_t c = 0; c < channels; ++c) code_bits += bits[c];
  return size_t(rows * channels) * 4 + (size_t(rows) * code_bits * size_t(n_tokens) + 7) / 8;
}

void encode_channel_group(const float* x, int64_t rows, int64_t channels, int64_t n_tokens,
                          const uint8_t* bits, std::vector<uint8_t>& out) {
  const int64_t stride = rows * channels;  // between tokens of one channel
  std::vector<AsymParams> params(static_cast<size_t>(rows * channels));
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t c = 0; c < channels; ++c) {
      auto& q = params[size_t(row * channels + c)];
      q = asym_fit(x + row * channels + c, n_tokens, stride, bits[c]);
      put_params(q, out);
    }
  BitWriter w(out);
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t c = 0; c < channels; ++c)
      asym_encode(params[size_t(row * channels + c)], x + row * channels + c, n_tokens, stride, bits[c], w);
  w.flush();
}

void decode_channel_group(const uint8_t* blob, size_t size, int64_t rows, int64_t channels,
                          int64_t n_tokens, const uint8_t* bits, float* x) {
  const size_t head = size_t(rows * channels) * 4;
  if (size < head) throw Error(ErrorCode::kFormat, "quantized token group truncated");
  const int64_t stride = rows * channels;
  BitReader r(blob + head, size - head);
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t c = 0; c < channels; ++c)
      asym_decode(get_params(blob + size_t(row * channels + c) * 4), n_tokens, bits[c], r,
                  x + row * channels + c, stride);
}

size_t row_group_bytes(int64_t n, int64_t g, int bits) {
  return size_t(n / g) * 4 + packed_bytes(size_t(n), bits);
}

void encode_row_groups(const float* x, int64_t n, int64_t g, int bits, std::vector<uint8_t>& out) {
  std::vector<AsymParams> params(static_cast<size_t>(n / g));
  for (int64_t k = 0; k < n / g; ++k) {
    params[size_t(k)] = asym_fit(x + k * g, g, 1, bits);
    put_params(params[size_t(k)], out);
  }
  BitWriter w(out);
  for (int64_t k = 0; k < n / g; ++k) asym_encode(params[size_t(k)], x + k * g, g, 1, bits, w);
  w.flush();
}

void decode_row_groups(const uint8_t* blob, size_t size, int64_t n, int64_t g, int bits, float* x) {
  const size_t head = size_t(n / g) * 4;
  if (size < head) throw Error(ErrorCode::kFormat, "quantized row truncated");
  BitReader r(blob + head, size - head);
  for (int64_t k = 0; k < n / g; ++k) asym_decode(get_params(blob + size_t(k) * 4), g, bits, r, x + k * g, 1);
}

}  // namespace kvcodec::detail

#include "baselines/symmetric_quant.hpp"

#include <cmath>

#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"
#include "palu/bitpack.hpp"
#include "palu/group_quant.hpp"

namespace kvcodec::baselines {

size_t sym_row_bytes(int64_t n, int64_t g, int bits) {
  return size_t(n / g) * 2 + detail::packed_bytes(size_t(n), bits);
}

void sym_encode_row(const float* x, int64_t n, int64_t g, int bits, std::vector<uint8_t>& out) {
  if (bits != 8 && bits != 4) throw Error(ErrorCode::kInternal, "symmetric quantizer takes 4 or 8 bits");
  const int64_t groups = n / g;
  std::vector<float> scale(static_cast<size_t>(groups));
  for (int64_t k = 0; k < groups; ++k) {
    const float* v = x + k * g;
    float d = 0.0f;
    if (bits == 8) {
      float amax = 0.0f;
      for (int64_t i = 0; i < g; ++i) amax = std::fmax(amax, std::fabs(v[i]));
      d = amax / 127.0f;
    } else {
      float m = 0.0f, amax = 0.0f;
      for (int64_t i = 0; i < g; ++i)
        if (std::fabs(v[i]) > amax) {
          amax = std::fabs(v[i]);
          m = v[i];
        }
      d = m / -8.0f;
    }
    const uint16_t d16 = detail::f16_saturate(d);
    out.push_back(uint8_t(d16));
    out.push_back(uint8_t(d16 >> 8));
    scale[size_t(k)] = f16_to_f32(d16);  // encode with the scale the decoder sees
  }
  detail::BitWriter w(out);
  for (int64_t k = 0; k < groups; ++k) {
    const float d = scale[size_t(k)];
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    for (int64_t i = 0; i < g; ++i) {
      const float t = x[k * g + i] * inv;
      // Offset codes into [0, 2^bits): +127 / +8 keeps the arithmetic unsigned.
      const int code = bits == 8 ? detail::clamp_code(t + 127.0f, 254) : detail::clamp_code(t + 8.0f, 15);
      w.put(uint32_t(code), bits);
    }
  }
  w.flush();
}

void sym_decode_row(const uint8_t* blob, size_t size, int64_t n, int64_t g, int bits, float* x) {
  const int64_t groups = n / g;
  const size_t head = size_t(groups) * 2;
  if (size < head) throw Error(ErrorCode::kFormat, "quantized row truncated");
  detail::BitReader r(blob + head, size - head);
  const int offset = bits == 8 ? 127 : 8;
  for (int64_t k = 0; k < groups; ++k) {
    const float d = f16_to_f32(uint16_t(blob[2 * k] | (blob[2 * k + 1] << 8)));
    for (int64_t i = 0; i < g; ++i) x[k * g + i] = float(int(r.get(bits)) - offset) * d;
  }
}

}  // namespace kvcodec::baselines

#include "kvcodec/tensor.hpp"

#include <cstring>

#include "kvcodec/error.hpp"

namespace kvcodec {

size_t dtype_size(DType dtype) noexcept { return dtype == DType::kF32 ? 4 : 2; }

const char* dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  if (name == "f32" || name == "F32" || name == "float32") return DType::kF32;
  if (name == "f16" || name == "F16" || name == "float16") return DType::kF16;
  if (name == "bf16" || name == "BF16" || name == "bfloat16") return DType::kBF16;
  throw Error(ErrorCode::kInvalidArgument, "unknown dtype '" + name + "' (expected f32, f16 or bf16)");
}

static inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float f16_to_f32(uint16_t h) noexcept {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // Inf / NaN
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // Subnormal: value = man * 2^-24, exact in f32.
    const float v = float(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t f32_to_f16(float f) noexcept {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // Inf or NaN; keep NaN quiet and non-zero
    if (abs == 0x7f800000u) return sign | 0x7c00u;
    return sign | 0x7e00u | uint16_t((abs >> 13) & 0x3ffu);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: overflow to Inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): value / 2^-24 rounded to nearest even.
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t exp = abs >> 23;
    const uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - int(exp);  // 113 - exp + 13
    uint32_t result = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (result & 1u))) ++result;
    return sign | uint16_t(result);
  }
  // Normal: rebias exponent, round mantissa 23 -> 10 bits to nearest even.
  uint32_t rebased = abs - (112u << 23);
  const uint32_t rem = rebased & 0x1fffu;
  uint32_t result = rebased >> 13;
  if (rem > 0x1000u || (rem == 0x1000u && (result & 1u))) ++result;  // carry may bump exponent: correct
  return sign | uint16_t(result);
}

float bf16_to_f32(uint16_t b) noexcept { return bits_float(uint32_t(b) << 16); }

uint16_t f32_to_bf16(float f) noexcept {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // NaN stays NaN
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return uint16_t((u + rounding) >> 16);
}

void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n) {
  if (src_dtype == dst_dtype) {
    std::memmove(dst, src, n * dtype_size(src_dtype));
    return;
  }
  const auto* s16 = static_cast<const uint16_t*>(src);
  const auto* s32 = static_cast<const float*>(src);
  auto* d16 = static_cast<uint16_t*>(dst);
  auto* d32 = static_cast<float*>(dst);
  auto load = [&](size_t i) -> float {
    switch (src_dtype) {
      case DType::kF32: return s32[i];
      case DType::kF16: return f16_to_f32(s16[i]);
      case DType::kBF16: return bf16_to_f32(s16[i]);
    }
    return 0.0f;
  };
  switch (dst_dtype) {
    case DType::kF32:
      for (size_t i = 0; i < n; ++i) d32[i] = load(i);
      break;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) d16[i] = f32_to_f16(load(i));
      break;
    case DType::kBF16:
      // f16 -> bf16 goes through f32 exactly (every f16 is an f32); no overflow detour.
      for (size_t i = 0; i < n; ++i) d16[i] = f32_to_bf16(load(i));
      break;
  }
}

std::string shape_string(const Shape4& s) {
  return "[" + std::to_string(s[0]) + ", " + std::to_string(s[1]) + ", " + std::to_string(s[2]) +
         ", " + std::to_string(s[3]) + "]";
}

Shape4 contiguous_strides(const Shape4& s) {
  return {s[1] * s[2] * s[3], s[2] * s[3], s[3], 1};
}

TensorView TensorView::contiguous(const void* data, DType dtype, const Shape4& shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.shape = shape;
  v.strides = contiguous_strides(shape);
  return v;
}

bool TensorView::is_contiguous() const {
  const Shape4 c = contiguous_strides(shape);
  for (int i = 0; i < 4; ++i)
    if (shape[i] > 1 && strides[i] != c[i]) return false;
  return true;
}

float TensorView::at(int64_t b, int64_t h, int64_t s, int64_t d) const {
  const int64_t i = b * strides[0] + h * strides[1] + s * strides[2] + d * strides[3];
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(data)[i];
    case DType::kF16: return f16_to_f32(static_cast<const uint16_t*>(data)[i]);
    case DType::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(data)[i]);
  }
  return 0.0f;
}

TensorView TensorView::slice_tokens(int64_t begin, int64_t count) const {
  if (begin < 0 || count < 0 || begin + count > shape[2])
    throw Error(ErrorCode::kInvalidArgument, "slice_tokens(" + std::to_string(begin) + ", " +
                                                 std::to_string(count) + ") out of range for " +
                                                 shape_string(shape));
  TensorView v = *this;
  v.data = static_cast<const uint8_t*>(data) + begin * strides[2] * int64_t(dtype_size(dtype));
  v.shape[2] = count;
  return v;
}

Tensor::Tensor(DType dtype, const Shape4& shape) : dtype_(dtype), shape_(shape) {
  for (int64_t d : shape)
    if (d < 0) throw Error(ErrorCode::kInvalidArgument, "negative dimension in " + shape_string(shape));
  bytes_.assign(size_t(kvcodec::numel(shape)) * dtype_size(dtype), 0);
}

Tensor Tensor::from_view(const TensorView& view, DType dtype) {
  Tensor t(dtype, view.shape);
  copy_to_contiguous(view, t.data(), dtype);
  return t;
}

void copy_to_contiguous(const TensorView& src, void* dst, DType dst_dtype) {
  const Shape4& s = src.shape;
  if (numel(s) == 0) return;
  const size_t in_size = dtype_size(src.dtype);
  const size_t out_size = dtype_size(dst_dtype);
  auto* out = static_cast<uint8_t*>(dst);
  const auto* in = static_cast<const uint8_t*>(src.data);
  if (src.is_contiguous()) {
    convert(in, src.dtype, out, dst_dtype, size_t(numel(s)));
    return;
  }
  // Rows along D are contiguous when strides[3] == 1: convert row by row.
  size_t row = 0;
  for (int64_t b = 0; b < s[0]; ++b)
    for (int64_t h = 0; h < s[1]; ++h)
      for (int64_t t = 0; t < s[2]; ++t, ++row) {
        const int64_t base = b * src.strides[0] + h * src.strides[1] + t * src.strides[2];
        uint8_t* out_row = out + row * size_t(s[3]) * out_size;
        if (src.strides[3] == 1) {
          convert(in + base * int64_t(in_size), src.dtype, out_row, dst_dtype, size_t(s[3]));
        } else {
          for (int64_t d = 0; d < s[3]; ++d) {
            const float v = src.at(b, h, t, d);
            convert(&v, DType::kF32, out_row + size_t(d) * out_size, dst_dtype, 1);
          }
        }
      }
}

}  // namespace kvcodec

// kvcodec: dtypes and tensors of shape [B, H, S, D].
//
// KV tensors are 4-D: batch, heads, sequence (tokens), head dimension. A
// TensorView points at memory it does not own, with explicit strides in
// elements, so a cache can expose a block of its history without copying.
// A Tensor owns contiguous memory. Conversions between f32, f16 and bf16 are
// exact where representable and round to nearest even otherwise; NaN and Inf
// are preserved.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvcodec {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

size_t dtype_size(DType dtype) noexcept;
const char* dtype_name(DType dtype) noexcept;  // "f32", "f16", "bf16"
DType parse_dtype(const std::string& name);    // throws Error(kInvalidArgument)

// Scalar conversions (bit patterns of the 16-bit formats as uint16_t).
float f16_to_f32(uint16_t bits) noexcept;
uint16_t f32_to_f16(float value) noexcept;  // round to nearest even, overflow -> Inf
float bf16_to_f32(uint16_t bits) noexcept;
uint16_t f32_to_bf16(float value) noexcept;  // round to nearest even, NaN stays NaN

// Bulk conversions of n contiguous elements.
void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n);

using Shape4 = std::array<int64_t, 4>;  // [B, H, S, D]

inline int64_t numel(const Shape4& shape) { return shape[0] * shape[1] * shape[2] * shape[3]; }
std::string shape_string(const Shape4& shape);  // "[1, 2, 2048, 64]"
Shape4 contiguous_strides(const Shape4& shape);

// A non-owning view. Strides are in elements, not bytes.
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  Shape4 shape{0, 0, 0, 0};
  Shape4 strides{0, 0, 0, 0};

  static TensorView contiguous(const void* data, DType dtype, const Shape4& shape);

  int64_t batch() const { return shape[0]; }
  int64_t heads() const { return shape[1]; }
  int64_t tokens() const { return shape[2]; }
  int64_t head_dim() const { return shape[3]; }
  bool is_contiguous() const;
  // Element (b, h, s, d) as f32, whatever the dtype.
  float at(int64_t b, int64_t h, int64_t s, int64_t d) const;
  // Tokens [begin, begin + count) along S; shares memory.
  TensorView slice_tokens(int64_t begin, int64_t count) const;
};

// An owning, contiguous tensor.
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, const Shape4& shape);  // zero-filled

  static Tensor from_view(const TensorView& view, DType dtype);  // copy + convert
  static Tensor from_view(const TensorView& view) { return from_view(view, view.dtype); }

  DType dtype() const { return dtype_; }
  const Shape4& shape() const { return shape_; }
  int64_t numel() const { return kvcodec::numel(shape_); }
  size_t nbytes() const { return bytes_.size(); }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  template <typename T> T* data_as() { return reinterpret_cast<T*>(bytes_.data()); }
  template <typename T> const T* data_as() const { return reinterpret_cast<const T*>(bytes_.data()); }
  TensorView view() const { return TensorView::contiguous(bytes_.data(), dtype_, shape_); }
  Tensor to(DType dtype) const { return from_view(view(), dtype); }

 private:
  DType dtype_ = DType::kF32;
  Shape4 shape_{0, 0, 0, 0};
  std::vector<uint8_t> bytes_;
};

// Copies a view (any strides) into dst ([B,H,S,D] contiguous, dst_dtype).
void copy_to_contiguous(const TensorView& src, void* dst, DType dst_dtype);

}  // namespace kvcodec

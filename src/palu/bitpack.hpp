// Fixed-width bit packing of small codes (1..16 bits), LSB first.
//
// Quantized caches store codes bit-packed, never as dequantized floats
// (DESIGN 5, 6). Writer and reader are the plain scalar reference; the
// reader is bounds-checked so a truncated blob raises kvcodec::Error instead
// of reading past the end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvcodec/error.hpp"

namespace kvcodec::detail {

class BitWriter {
 public:
  explicit BitWriter(std::vector<uint8_t>& out) : out_(out) {}
  ~BitWriter() { flush(); }
  BitWriter(const BitWriter&) = delete;
  BitWriter& operator=(const BitWriter&) = delete;

  // Appends the low `bits` bits of value.
  void put(uint32_t value, int bits) {
    acc_ |= uint64_t(value & ((1u << bits) - 1u)) << fill_;
    fill_ += bits;
    while (fill_ >= 8) {
      out_.push_back(uint8_t(acc_));
      acc_ >>= 8;
      fill_ -= 8;
    }
  }
  // Pads the last partial byte with zeros.
  void flush() {
    if (fill_ > 0) out_.push_back(uint8_t(acc_));
    acc_ = 0;
    fill_ = 0;
  }

 private:
  std::vector<uint8_t>& out_;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

class BitReader {
 public:
  BitReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  uint32_t get(int bits) {
    while (fill_ < bits) {
      if (pos_ >= size_) throw Error(ErrorCode::kFormat, "bit-packed codes end early (truncated blob)");
      acc_ |= uint64_t(data_[pos_++]) << fill_;
      fill_ += 8;
    }
    const uint32_t v = uint32_t(acc_ & ((1u << bits) - 1u));
    acc_ >>= bits;
    fill_ -= bits;
    return v;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

// Bytes taken by n codes of `bits` bits once flushed.
inline size_t packed_bytes(size_t n_codes, int bits) { return (n_codes * size_t(bits) + 7) / 8; }

}  // namespace kvcodec::detail

// Word-at-a-time LSB-first bit writer/reader used by the Huffman and fixed
// coders' hot loops. Internal to the entropy module.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvcodec/error.hpp"

namespace kvcodec::entropy::detail {

// Writes into a buffer sized by the caller for the worst case (+8 slack bytes).
class FastBitWriter {
 public:
  explicit FastBitWriter(size_t max_bits) : buf_((max_bits + 7) / 8 + 8) {}
  // nbits <= 32; value < 2^nbits.
  inline void put(uint32_t value, unsigned nbits) {
    acc_ |= uint64_t(value) << n_;
    n_ += nbits;
    if (n_ >= 32) {
      const uint32_t lo = uint32_t(acc_);
      std::memcpy(buf_.data() + pos_, &lo, 4);  // little-endian hosts
      pos_ += 4;
      acc_ >>= 32;
      n_ -= 32;
    }
  }
  std::vector<uint8_t> finish() {
    while (n_ > 0) {
      buf_[pos_++] = uint8_t(acc_);
      acc_ >>= 8;
      n_ = n_ > 8 ? n_ - 8 : 0;
    }
    buf_.resize(pos_);
    return std::move(buf_);
  }

 private:
  std::vector<uint8_t> buf_;
  size_t pos_ = 0;
  uint64_t acc_ = 0;
  unsigned n_ = 0;
};

// Reads past the end as zeros but remembers it, so callers can check
// consumed() <= size * 8 cheaply at the points where it matters.
class FastBitReader {
 public:
  FastBitReader(const uint8_t* data, size_t size) : p_(data), end_(data + size), total_bits_(size * 8) {}
  // Ensures at least 57 bits are buffered (zeros past the end).
  inline void refill() {
    if (end_ - p_ >= 8) {
      uint64_t w;
      std::memcpy(&w, p_, 8);
      buf_ |= w << avail_;
      p_ += (63 - avail_) >> 3;
      avail_ |= 56;
    } else {
      while (avail_ <= 56) {
        if (p_ < end_) buf_ |= uint64_t(*p_++) << avail_;
        else ++virtual_bytes_;
        avail_ += 8;
      }
    }
  }
  inline uint64_t peek() const { return buf_; }
  inline void consume(unsigned n) {
    buf_ >>= n;
    avail_ -= n;
  }
  inline unsigned avail() const { return avail_; }
  // Bits consumed so far, counting any read past the end.
  size_t consumed() const {
    return size_t(p_ - (end_ - total_bits_ / 8)) * 8 + virtual_bytes_ * 8 - avail_;
  }
  size_t total_bits() const { return total_bits_; }
  // The bits buffered but unconsumed that are real stream bits.
  uint64_t remaining_real_value() const { return buf_; }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
  size_t total_bits_;
  uint64_t buf_ = 0;
  unsigned avail_ = 0;
  size_t virtual_bytes_ = 0;
};

}  // namespace kvcodec::entropy::detail

// Bit I/O, LSB-first (see entropy.hpp).
#include "entropy/entropy.hpp"

#include <bit>
#include <string>

namespace kvcodec::entropy {

void BitWriter::put(uint32_t value, unsigned nbits) {
  if (nbits > 32) throw Error(ErrorCode::kInvalidArgument, "BitWriter::put: nbits = " + std::to_string(nbits) + ", at most 32");
  if (nbits < 32 && (value >> nbits) != 0)
    throw Error(ErrorCode::kInvalidArgument,
                "BitWriter::put: value " + std::to_string(value) + " does not fit in " + std::to_string(nbits) + " bits");
  acc_ |= uint64_t(value) << pending_;
  pending_ += nbits;
  bits_ += nbits;
  while (pending_ >= 8) {
    buf_.push_back(uint8_t(acc_));
    acc_ >>= 8;
    pending_ -= 8;
  }
}

void BitWriter::put_gamma(uint64_t v) {
  if (v == 0) throw Error(ErrorCode::kInvalidArgument, "BitWriter::put_gamma: value 0 has no gamma code");
  const unsigned n = unsigned(std::bit_width(v)) - 1;
  // Zeros, then the leading one, then the n low bits.
  for (unsigned z = n; z > 0;) {
    const unsigned k = z > 32 ? 32 : z;
    put(0, k);
    z -= k;
  }
  put(1, 1);
  const uint64_t low = v & ((uint64_t(1) << n) - 1);
  if (n > 32) {
    put(uint32_t(low & 0xffffffffu), 32);
    put(uint32_t(low >> 32), n - 32);
  } else {
    put(uint32_t(low), n);
  }
}

std::vector<uint8_t> BitWriter::bytes() const {
  std::vector<uint8_t> out = buf_;
  if (pending_ > 0) out.push_back(uint8_t(acc_));
  return out;
}

uint32_t BitReader::get_reference(unsigned nbits) {
  if (nbits > 32) throw Error(ErrorCode::kInvalidArgument, "BitReader::get: nbits = " + std::to_string(nbits) + ", at most 32");
  if (nbits > bits_left())
    throw Error(ErrorCode::kFormat, "bit stream truncated: need " + std::to_string(nbits) + " bits at bit offset " +
                                        std::to_string(pos_) + " of " + std::to_string(size_ * 8));
  uint64_t v = 0;
  unsigned got = 0;
  while (got < nbits) {
    const size_t byte = pos_ >> 3;
    const unsigned off = unsigned(pos_ & 7);
    const unsigned take = std::min(8 - off, nbits - got);
    const uint64_t bits = (uint64_t(data_[byte]) >> off) & ((1u << take) - 1);
    v |= bits << got;
    got += take;
    pos_ += take;
  }
  return uint32_t(v);
}

uint64_t BitReader::get_gamma_reference(unsigned max_zeros) {
  if (max_zeros > 63) max_zeros = 63;
  unsigned zeros = 0;
  while (!get_reference(1)) {
    if (++zeros > max_zeros)
      throw Error(ErrorCode::kFormat, "gamma code longer than " + std::to_string(max_zeros) + " leading zeros at bit offset " +
                                          std::to_string(pos_));
  }
  uint64_t low = 0;
  if (zeros > 32) {
    low = get_reference(32);
    low |= uint64_t(get_reference(zeros - 32)) << 32;
  } else {
    low = get_reference(zeros);
  }
  return (uint64_t(1) << zeros) | low;
}

}  // namespace kvcodec::entropy

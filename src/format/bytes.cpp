#include <bit>
#include <cstring>

#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"

namespace kvcodec {

// Float arrays are copied as-is; the format is little-endian.
static_assert(std::endian::native == std::endian::little, "kvcodec assumes a little-endian host");

// ---------------------------------------------------------------- ByteWriter

void ByteWriter::f32(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u32(u);
}

void ByteWriter::f64(double v) {
  uint64_t u;
  std::memcpy(&u, &v, 8);
  u64(u);
}

void ByteWriter::varint(uint64_t v) {
  while (v >= 0x80) {
    buf_.push_back(uint8_t(v | 0x80));
    v >>= 7;
  }
  buf_.push_back(uint8_t(v));
}

void ByteWriter::svarint(int64_t v) {
  // Zigzag: small magnitudes of either sign stay short.
  varint((uint64_t(v) << 1) ^ uint64_t(v >> 63));
}

void ByteWriter::bytes(const void* data, size_t n) {
  if (n == 0) return;
  const size_t at = buf_.size();
  buf_.resize(at + n);
  std::memcpy(buf_.data() + at, data, n);
}

void ByteWriter::str(const std::string& s) {
  varint(s.size());
  bytes(s.data(), s.size());
}

void ByteWriter::f32s(const float* v, size_t n) {
  buf_.reserve(buf_.size() + 4 * n);
  for (size_t i = 0; i < n; ++i) f32(v[i]);
}

void ByteWriter::u16s(const uint16_t* v, size_t n) {
  buf_.reserve(buf_.size() + 2 * n);
  for (size_t i = 0; i < n; ++i) u16(v[i]);
}

void ByteWriter::f16s_from_f32(const float* v, size_t n) {
  buf_.reserve(buf_.size() + 2 * n);
  for (size_t i = 0; i < n; ++i) u16(f32_to_f16(v[i]));
}

// ---------------------------------------------------------------- ByteReader

void ByteReader::fail(const std::string& what) const {
  throw Error(ErrorCode::kFormat, context_ + ": " + what + " at offset " + std::to_string(pos_));
}

void ByteReader::need(size_t n, const char* what) {
  if (n > size_ - pos_) {
    fail(std::string("truncated ") + what + " (need " + std::to_string(n) + " bytes, " +
         std::to_string(size_ - pos_) + " left)");
  }
}

uint64_t ByteReader::get_le(int n) {
  need(size_t(n), "integer");
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | data_[pos_ + size_t(i)];
  pos_ += size_t(n);
  return v;
}

uint8_t ByteReader::u8() {
  need(1, "byte");
  return data_[pos_++];
}

float ByteReader::f32() {
  const uint32_t u = u32();
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

double ByteReader::f64() {
  const uint64_t u = u64();
  double v;
  std::memcpy(&v, &u, 8);
  return v;
}

bool ByteReader::boolean() {
  const uint8_t b = u8();
  if (b > 1) {
    --pos_;
    fail("boolean byte " + std::to_string(b) + " is neither 0 nor 1");
  }
  return b == 1;
}

uint64_t ByteReader::varint() {
  const size_t start = pos_;
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (pos_ >= size_) {
      pos_ = start;
      fail("truncated varint");
    }
    const uint8_t b = data_[pos_++];
    // The 10th byte may only carry the top bit of a 64-bit value.
    if (shift == 63 && (b & 0xfe) != 0) {
      pos_ = start;
      fail("varint overflows 64 bits");
    }
    v |= uint64_t(b & 0x7f) << shift;
    if ((b & 0x80) == 0) return v;
  }
  pos_ = start;
  fail("varint longer than 10 bytes");
}

int64_t ByteReader::svarint() {
  const uint64_t z = varint();
  return int64_t(z >> 1) ^ -int64_t(z & 1);
}

uint64_t ByteReader::count(uint64_t max, const char* what) {
  const size_t start = pos_;
  const uint64_t v = varint();
  if (v > max) {
    pos_ = start;
    fail(std::string(what) + " = " + std::to_string(v) + " exceeds the limit " + std::to_string(max));
  }
  return v;
}

std::span<const uint8_t> ByteReader::bytes(size_t n) {
  need(n, "byte array");
  std::span<const uint8_t> out(data_ + pos_, n);
  pos_ += n;
  return out;
}

std::string ByteReader::str(size_t max_len) {
  const uint64_t n = count(max_len, "string length");
  const auto b = bytes(size_t(n));
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

std::vector<float> ByteReader::f32s(size_t n) {
  // Check before allocating: n comes from untrusted bytes.
  if (n > remaining() / 4) fail("truncated f32 array (" + std::to_string(n) + " elements, " + std::to_string(remaining()) + " bytes left)");
  std::vector<float> out(n);
  if (n) std::memcpy(out.data(), data_ + pos_, 4 * n);  // host is little-endian (checked in tests)
  pos_ += 4 * n;
  return out;
}

std::vector<uint16_t> ByteReader::u16s(size_t n) {
  if (n > remaining() / 2) fail("truncated u16 array (" + std::to_string(n) + " elements, " + std::to_string(remaining()) + " bytes left)");
  std::vector<uint16_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = uint16_t(data_[pos_ + 2 * i] | (data_[pos_ + 2 * i + 1] << 8));
  pos_ += 2 * n;
  return out;
}

std::vector<float> ByteReader::f16s_to_f32(size_t n) {
  if (n > remaining() / 2) fail("truncated f16 array (" + std::to_string(n) + " elements, " + std::to_string(remaining()) + " bytes left)");
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = f16_to_f32(uint16_t(data_[pos_ + 2 * i] | (data_[pos_ + 2 * i + 1] << 8)));
  }
  pos_ += 2 * n;
  return out;
}

std::vector<float> ByteReader::f32_vec(size_t max_count) {
  const uint64_t n = count(max_count, "f32 array length");
  return f32s(size_t(n));
}

std::vector<uint8_t> ByteReader::u8_vec(size_t max_count) {
  const uint64_t n = count(max_count, "byte array length");
  const auto b = bytes(size_t(n));
  return std::vector<uint8_t>(b.begin(), b.end());
}

void ByteReader::expect_end() const {
  if (pos_ != size_) fail(std::to_string(size_ - pos_) + " unexpected trailing bytes");
}

}  // namespace kvcodec

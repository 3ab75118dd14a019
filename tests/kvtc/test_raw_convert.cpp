// The kvtc caches' raw conversions against the core's scalar convert():
// bit-identical on every f16/bf16 pattern and on f32 inputs covering every
// rounding case (ties, subnormals, overflow, NaN payloads), at lengths that
// exercise both the SIMD chunks and the scalar tail.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"
#include "kvtc/raw_convert.hpp"

using namespace kvcodec;

namespace {

std::vector<uint32_t> f32_bits(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * 4);
  return out;
}

}  // namespace

TEST(RawConvert, EveryRawPatternToF32MatchesCore) {
  std::vector<uint16_t> all(65536 + 5);  // +5: a scalar tail after the SIMD chunks
  for (size_t i = 0; i < all.size(); ++i) all[i] = uint16_t(i * 40503u);  // odd multiplier: a permutation
  for (size_t i = 0; i < 65536; ++i) all[i] = uint16_t(i);
  for (DType raw : {DType::kF16, DType::kBF16}) {
    std::vector<float> fast(all.size()), ref(all.size());
    kvtc::raw_to_f32(all.data(), raw, fast.data(), all.size());
    convert(all.data(), raw, ref.data(), DType::kF32, all.size());
    EXPECT_EQ(f32_bits(fast), f32_bits(ref)) << dtype_name(raw);
  }
}

TEST(RawConvert, F32ToRawMatchesCoreOnEveryRoundingCase) {
  std::vector<float> v;
  auto push_bits = [&](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    v.push_back(f);
  };
  // Every f16/bf16 value, and the midpoints and their neighbours around each
  // (ties to even, carries into the exponent, subnormal boundaries).
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(uint16_t(h));
    uint32_t u;
    std::memcpy(&u, &f, 4);
    for (int32_t d : {-1, 0, 1, 0x1000 - 1, 0x1000, 0x1000 + 1}) push_bits(u + uint32_t(d));
    for (int32_t d : {0, 0x8000 - 1, 0x8000, 0x8000 + 1}) push_bits((h << 16) + uint32_t(d));
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) push_bits(rng());
  for (float f : {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 1e30f, -1e30f, 5.96e-8f, 2.98e-8f, 2.99e-8f}) v.push_back(f);
  push_bits(0x7f800000u), push_bits(0xff800000u), push_bits(0x7fc00000u), push_bits(0x7f800001u), push_bits(0xffa00001u);
  v.push_back(1.0f);  // odd length: a scalar tail
  for (DType raw : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> fast(v.size()), ref(v.size());
    kvtc::f32_to_raw(v.data(), fast.data(), raw, v.size());
    convert(v.data(), DType::kF32, ref.data(), raw, v.size());
    size_t bad = 0;
    for (size_t i = 0; i < v.size(); ++i) bad += fast[i] != ref[i];
    EXPECT_EQ(bad, 0u) << dtype_name(raw) << " (simd: " << kvtc::raw_convert_has_simd() << ")";
    // Both ways at once (the calibrated cache's rows from an append): the
    // core's f32 of its raw value, NaN payloads included.
    std::vector<float> through(v.size()), back(v.size());
    kvtc::round_through_raw(v.data(), raw, through.data(), v.size());
    convert(ref.data(), raw, back.data(), DType::kF32, v.size());
    EXPECT_EQ(f32_bits(through), f32_bits(back)) << dtype_name(raw);
  }
}

TEST(RawConvert, RejectsF32AsRawStorage) {
  float f = 1.0f;
  uint16_t h = 0;
  EXPECT_THROW(kvtc::f32_to_raw(&f, &h, DType::kF32, 1), Error);
  EXPECT_THROW(kvtc::raw_to_f32(&h, DType::kF32, &f, 1), Error);
  EXPECT_THROW(kvtc::round_through_raw(&f, DType::kF32, &f, 1), Error);
}

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"

using namespace kvcodec;

static uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Every f16 value survives f16 -> f32 -> f16 bit for bit (NaN payload kept quiet).
TEST(Dtype, F16RoundTripsEveryBitPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(uint16_t(h));
    const uint16_t back = f32_to_f16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(back))) << h;
    } else {
      EXPECT_EQ(back, h) << h;
    }
  }
}

TEST(Dtype, Bf16RoundTripsEveryBitPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_f32(uint16_t(h));
    const uint16_t back = f32_to_bf16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(back))) << h;
    }
    else EXPECT_EQ(back, h) << h;
  }
}

// Rounding to nearest even, checked against a double-precision reference on
// every f32 halfway point and its neighbours over the f16 range.
TEST(Dtype, F16RoundsToNearestEven) {
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    const double lo = f16_to_f32(uint16_t(h));
    const double hi = f16_to_f32(uint16_t(h + 1));
    const float mid = float((lo + hi) / 2);  // exact in f32
    const uint16_t expect_mid = (h & 1u) ? uint16_t(h + 1) : uint16_t(h);
    EXPECT_EQ(f32_to_f16(mid), expect_mid) << h;
    EXPECT_EQ(f32_to_f16(from_bits(bits(mid) - 1)), h) << h;
    EXPECT_EQ(f32_to_f16(from_bits(bits(mid) + 1)), uint16_t(h + 1)) << h;
  }
}

TEST(Dtype, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(f32_to_f16(inf), 0x7c00);
  EXPECT_EQ(f32_to_f16(-inf), 0xfc00);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // rounds past the largest f16
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  EXPECT_EQ(f32_to_bf16(inf), 0x7f80);
  // Large values that overflow f16 survive bf16 (no f16 detour).
  const float big = 1.0e30f;
  uint16_t out;
  convert(&big, DType::kF32, &out, DType::kBF16, 1);
  EXPECT_NEAR(bf16_to_f32(out), big, big * 0.01);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
}

TEST(Tensor, StridedCopyAndSlice) {
  Tensor t(DType::kF32, {1, 2, 5, 3});
  float* p = t.data_as<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = float(i);
  TensorView v = t.view().slice_tokens(1, 3);
  EXPECT_FALSE(v.is_contiguous());
  Tensor c = Tensor::from_view(v, DType::kBF16);
  EXPECT_EQ(c.shape(), (Shape4{1, 2, 3, 3}));
  EXPECT_EQ(c.view().at(0, 1, 2, 1), v.at(0, 1, 2, 1));
  EXPECT_EQ(v.at(0, 1, 0, 0), 18.0f);  // head 1, token 1
  EXPECT_THROW(t.view().slice_tokens(4, 2), Error);
}

// Symmetric q8_0 / q4_0-style row quantizers against their definitions.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "baselines/symmetric_quant.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"

using namespace kvcodec;

static float scale_of(const std::vector<uint8_t>& blob, int group) {
  return f16_to_f32(uint16_t(blob[2 * group] | (blob[2 * group + 1] << 8)));
}

TEST(Symmetric, Q8ErrorWithinHalfStep) {
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0.0f, 2.0f);
  std::vector<float> x(128);
  for (auto& v : x) v = n(rng);
  std::vector<uint8_t> blob;
  baselines::sym_encode_row(x.data(), 128, 32, 8, blob);
  ASSERT_EQ(blob.size(), baselines::sym_row_bytes(128, 32, 8));
  EXPECT_EQ(blob.size(), 4u * 2 + 128);
  std::vector<float> y(128);
  baselines::sym_decode_row(blob.data(), blob.size(), 128, 32, 8, y.data());
  for (int i = 0; i < 128; ++i) {
    const float d = scale_of(blob, i / 32);
    EXPECT_LE(std::fabs(x[i] - y[i]), 0.5f * d * 1.01f) << i;
  }
}

TEST(Symmetric, Q4ExtremeExactAndErrorBounded) {
  std::mt19937 rng(2);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(64);
  for (auto& v : x) v = n(rng);
  x[5] = -7.0f;  // the largest magnitude in group 0, negative
  std::vector<uint8_t> blob;
  baselines::sym_encode_row(x.data(), 64, 32, 4, blob);
  EXPECT_EQ(blob.size(), 2u * 2 + 32);
  std::vector<float> y(64);
  baselines::sym_decode_row(blob.data(), blob.size(), 64, 32, 4, y.data());
  EXPECT_NEAR(y[5], -7.0f, 7.0f * 1e-3f);  // code 0 -> -8 * d = m (up to f16 rounding of d)
  for (int i = 0; i < 64; ++i) EXPECT_LE(std::fabs(x[i] - y[i]), std::fabs(scale_of(blob, i / 32)) * 1.01f) << i;
}

TEST(Symmetric, ZeroAndHugeValuesStayFinite) {
  std::vector<float> x(32, 0.0f);
  std::vector<uint8_t> blob;
  baselines::sym_encode_row(x.data(), 32, 32, 8, blob);
  std::vector<float> y(32, 1.0f);
  baselines::sym_decode_row(blob.data(), blob.size(), 32, 32, 8, y.data());
  for (float v : y) EXPECT_EQ(v, 0.0f);
  x[0] = 3e38f;  // scale saturates at the f16 maximum
  x[1] = NAN;
  for (int bits : {4, 8}) {
    blob.clear();
    baselines::sym_encode_row(x.data(), 32, 32, bits, blob);
    baselines::sym_decode_row(blob.data(), blob.size(), 32, 32, bits, y.data());
    for (float v : y) EXPECT_TRUE(std::isfinite(v));
  }
  EXPECT_THROW(baselines::sym_decode_row(blob.data(), 1, 32, 32, 4, y.data()), Error);
}

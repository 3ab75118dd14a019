#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvcodec/error.hpp"
#include "quant/uniform.hpp"

using kvcodec::Error;
using kvcodec::ErrorCode;
using namespace kvcodec::quant;

namespace {

TEST(Uniform, RoundTripWithinHalfStepAndClamps) {
  std::mt19937 rng(1);
  for (int bits = 1; bits <= 8; ++bits) {
    const float lo = -3.25f, hi = 5.5f;
    auto q = make_range_quantizer(lo, hi, bits);
    ASSERT_EQ(q.levels, 1u << bits);
    const float step = q.step();
    EXPECT_NEAR(step, (hi - lo) / q.levels, 1e-6f);
    std::uniform_real_distribution<float> u(lo, hi);
    for (int i = 0; i < 2000; ++i) {
      const float x = u(rng);
      const uint16_t c = q.quantize(x);
      ASSERT_LT(c, q.levels);
      ASSERT_LE(std::abs(q.dequantize(c) - x), 0.5f * step * (1 + 1e-5f) + 1e-6f) << bits << " " << x;
    }
    // Endpoints and outside values clamp to the end codes.
    EXPECT_EQ(q.quantize(lo), 0);
    EXPECT_EQ(q.quantize(hi), q.levels - 1);
    EXPECT_EQ(q.quantize(-1e30f), 0);
    EXPECT_EQ(q.quantize(1e30f), q.levels - 1);
    EXPECT_EQ(q.quantize(std::numeric_limits<float>::infinity()), q.levels - 1);
    EXPECT_EQ(q.quantize(-std::numeric_limits<float>::infinity()), 0);
    EXPECT_EQ(q.quantize(std::numeric_limits<float>::quiet_NaN()), 0);
    // Reconstruction points are cell centres.
    EXPECT_NEAR(q.dequantize(0), lo + 0.5f * step, 1e-5f);
    EXPECT_NEAR(q.dequantize(q.levels - 1), hi - 0.5f * step, 1e-5f);
    EXPECT_EQ(q.dequantize(60000), q.dequantize(q.levels - 1));  // bad code clamps
    // Monotone: quantize non-decreasing in x, dequantize increasing in code.
    uint16_t prev = 0;
    for (float x = lo - 1; x <= hi + 1; x += 0.001f) {
      const uint16_t c = q.quantize(x);
      ASSERT_GE(c, prev);
      prev = c;
    }
    for (uint32_t c = 1; c < q.levels; ++c) ASSERT_GT(q.dequantize(c), q.dequantize(c - 1));
  }
}

TEST(Uniform, ZeroBitsAndEmptyRange) {
  auto q = make_range_quantizer(-2.0f, 3.0f, 0);
  EXPECT_EQ(q.levels, 1u);
  EXPECT_EQ(q.quantize(2.5f), 0);
  EXPECT_EQ(q.dequantize(0), 0.0f);  // the mean of a centred component
  auto shifted = make_range_quantizer(1.0f, 3.0f, 0);
  EXPECT_EQ(shifted.dequantize(0), 1.0f);  // 0 clamped into the range
  auto flat = make_range_quantizer(0.75f, 0.75f, 4);
  EXPECT_EQ(flat.levels, 1u);
  EXPECT_EQ(flat.dequantize(flat.quantize(0.75f)), 0.75f);
  EXPECT_EQ(flat.quantize(std::numeric_limits<float>::infinity()), 0);
}

TEST(Uniform, MseOfCentresBeatsEndpointsOnGaussian) {
  // The documented choice: with [lo, hi] = the sample extremes, centre
  // reconstruction has lower MSE than an endpoint grid at the same bits.
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(20000);
  for (auto& v : x) v = g(rng);
  const float lo = *std::min_element(x.begin(), x.end()), hi = *std::max_element(x.begin(), x.end());
  for (int bits = 1; bits <= 6; ++bits) {
    auto q = make_range_quantizer(lo, hi, bits);
    const int L = 1 << bits;
    const float ep_step = (hi - lo) / (L - 1);
    double mse_c = 0, mse_e = 0;
    for (float v : x) {
      mse_c += std::pow(q.dequantize(q.quantize(v)) - v, 2);
      mse_e += std::pow(lo + std::round((v - lo) / ep_step) * ep_step - v, 2);
    }
    EXPECT_LT(mse_c, mse_e) << bits;
  }
}

TEST(Uniform, StepQuantizerGrid) {
  auto q = make_step_quantizer(0.5f, -1.3f, 2.1f, 0.0f);
  // Grid points -1.5 .. 2.0 (k = -3 .. 4): 8 levels, one of them exactly 0.
  EXPECT_EQ(q.levels, 8u);
  EXPECT_NEAR(q.step(), 0.5f, 1e-6f);
  EXPECT_NEAR(q.dequantize(q.quantize(0.1f)), 0.0f, 1e-6f);
  EXPECT_NEAR(q.dequantize(0), -1.5f, 1e-6f);
  EXPECT_NEAR(q.dequantize(7), 2.0f, 1e-6f);
  for (float x = -1.3f; x <= 2.1f; x += 0.01f) {
    ASSERT_LE(std::abs(q.dequantize(q.quantize(x)) - x), 0.25f + 1e-5f) << x;
  }
  // A non-zero centre.
  auto c = make_step_quantizer(1.0f, 0.0f, 4.0f, 0.25f);
  EXPECT_NEAR(c.dequantize(c.quantize(2.3f)), 2.25f, 1e-6f);
  // A range narrower than one step: a single level at the nearest grid point.
  auto one = make_step_quantizer(10.0f, -1.0f, 1.0f, 0.0f);
  EXPECT_EQ(one.levels, 1u);
  EXPECT_EQ(one.dequantize(one.quantize(0.7f)), 0.0f);
  // Level cap.
  EXPECT_NO_THROW(make_step_quantizer(1.0f, -2047.0f, 2048.0f));
  try {
    make_step_quantizer(1e-6f, -1.0f, 1.0f);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("4096"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make_step_quantizer(0.0f, -1.0f, 1.0f), Error);
  EXPECT_THROW(make_step_quantizer(std::nanf(""), -1.0f, 1.0f), Error);
  EXPECT_THROW(make_step_quantizer(1.0f, 1.0f, -1.0f), Error);
  EXPECT_THROW(make_step_quantizer(1.0f, -1.0f, std::numeric_limits<float>::infinity()), Error);
}

TEST(Uniform, RangeErrors) {
  EXPECT_THROW(make_range_quantizer(1.0f, 0.0f, 2), Error);
  EXPECT_THROW(make_range_quantizer(0.0f, 1.0f, -1), Error);
  EXPECT_THROW(make_range_quantizer(0.0f, 1.0f, 13), Error);
  EXPECT_THROW(make_range_quantizer(std::nanf(""), 1.0f, 2), Error);
  EXPECT_THROW(make_range_quantizer(-3e38f, 3e38f, 2), Error);  // width overflows
  EXPECT_EQ(make_range_quantizer(0.0f, 1.0f, 12).levels, 4096u);
}

TEST(Uniform, BlockFastMatchesReferenceExactly) {
  std::mt19937 rng(11);
  const int cols = 37;
  const int64_t n = 203;
  std::vector<UniformQuantizer> q;
  for (int c = 0; c < cols; ++c) {
    const float s = std::pow(10.0f, float(c % 7) - 3);
    if (c % 5 == 4) {
      q.push_back(make_step_quantizer(s * 0.1f, -s, s * 2));
    } else {
      q.push_back(make_range_quantizer(-s, s * 1.5f, c % 9));  // bits 0..8
    }
  }
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(n * cols);
  for (int64_t i = 0; i < n; ++i)
    for (int c = 0; c < cols; ++c) x[i * cols + c] = g(rng) * std::pow(10.0f, float(c % 7) - 3) * 1.5f;
  x[5] = std::numeric_limits<float>::quiet_NaN();
  x[6] = std::numeric_limits<float>::infinity();
  x[7] = -std::numeric_limits<float>::infinity();
  std::vector<uint16_t> cf(n * cols), cr(n * cols);
  quantize_block(q.data(), cols, x.data(), n, cf.data());
  quantize_block_reference(q.data(), cols, x.data(), n, cr.data());
  ASSERT_EQ(cf, cr);
  // Reproducible: a second run gives the same bits.
  std::vector<uint16_t> again(n * cols);
  quantize_block(q.data(), cols, x.data(), n, again.data());
  EXPECT_EQ(again, cf);
  // Include out-of-range codes in the dequantizer input.
  cr[3] = 65535;
  cf[3] = 65535;
  std::vector<float> yf(n * cols), yr(n * cols);
  dequantize_block(q.data(), cols, cf.data(), n, yf.data());
  dequantize_block_reference(q.data(), cols, cr.data(), n, yr.data());
  for (size_t i = 0; i < yf.size(); ++i) ASSERT_EQ(yf[i], yr[i]) << i;
}

TEST(Uniform, SerialisationRoundTripAndMalformed) {
  std::vector<uint8_t> bytes;
  const auto a = make_range_quantizer(-1.5f, 2.25f, 6);
  const auto b = make_step_quantizer(0.125f, -3.0f, 3.0f);
  const auto z = make_range_quantizer(-1.0f, 1.0f, 0);
  append_quantizer(bytes, a);
  append_quantizer(bytes, b);
  append_quantizer(bytes, z);
  ASSERT_EQ(bytes.size(), 3 * kSerializedQuantizerBytes);
  size_t off = 0;
  for (const auto& want : {a, b, z}) {
    const auto got = read_quantizer(bytes.data(), bytes.size(), off);
    EXPECT_EQ(got.lo, want.lo);
    EXPECT_EQ(got.hi, want.hi);
    EXPECT_EQ(got.levels, want.levels);
  }
  EXPECT_EQ(off, bytes.size());
  auto expect_format = [](std::vector<uint8_t> v, size_t offset) {
    try {
      read_quantizer(v.data(), v.size(), offset);
      FAIL() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kFormat) << e.what();
    }
  };
  expect_format(std::vector<uint8_t>(bytes.begin(), bytes.begin() + 9), 0);  // truncated
  expect_format(bytes, bytes.size() + 5);                                   // offset past end
  auto bad = bytes;
  bad[8] = 0;
  bad[9] = 0;  // levels 0
  expect_format(bad, 0);
  bad = bytes;
  bad[9] = 0x20;  // levels > 4096
  expect_format(bad, 0);
  bad = bytes;
  std::memcpy(bad.data(), bytes.data() + 4, 4);
  std::memcpy(bad.data() + 4, bytes.data(), 4);  // lo > hi
  expect_format(bad, 0);
  bad = bytes;
  const float nan = std::nanf("");
  std::memcpy(bad.data(), &nan, 4);
  expect_format(bad, 0);
  // Fuzz-ish: every 10-byte window of random bytes either parses to a valid
  // quantizer or throws kFormat; valid ones quantize without trouble.
  std::mt19937 rng(5);
  for (int t = 0; t < 5000; ++t) {
    std::vector<uint8_t> r(10);
    for (auto& x : r) x = static_cast<uint8_t>(rng());
    if (t % 2) r[9] &= 0x0F;
    size_t o = 0;
    try {
      auto q = read_quantizer(r.data(), r.size(), o);
      ASSERT_LT(q.quantize(0.0f), std::max<uint32_t>(q.levels, 1));
      (void)q.dequantize(0);
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), ErrorCode::kFormat);
    }
  }
  UniformQuantizer broken;
  broken.levels = 0;
  EXPECT_THROW(append_quantizer(bytes, broken), Error);
}

}  // namespace

namespace {

TEST(Uniform, GaussianOptimalStepMatchesMaxTable) {
  // Max (1960), optimum uniform quantizers for a unit Gaussian.
  const double step[] = {1.596, 0.9957, 0.5860, 0.3352};
  const double mse[] = {0.3634, 0.1188, 0.03744, 0.01154};
  for (int b = 1; b <= 4; ++b) {
    const double s = gaussian_optimal_step(b);
    EXPECT_NEAR(s, step[b - 1], 2e-3) << b;
    EXPECT_NEAR(gaussian_uniform_mse(b, s), mse[b - 1], 2e-3 * mse[b - 1] + 1e-5) << b;
    // A minimum: nearby steps are worse.
    EXPECT_LT(gaussian_uniform_mse(b, s), gaussian_uniform_mse(b, s * 1.05));
    EXPECT_LT(gaussian_uniform_mse(b, s), gaussian_uniform_mse(b, s * 0.95));
  }
  // Steps shrink with bits; at 8 bits the MSE is close to step^2/12.
  for (int b = 2; b <= 8; ++b) EXPECT_LT(gaussian_optimal_step(b), gaussian_optimal_step(b - 1));
  const double s8 = gaussian_optimal_step(8);
  EXPECT_NEAR(gaussian_uniform_mse(8, s8), s8 * s8 / 12, 0.2 * s8 * s8 / 12);
  // The quantizer built from it beats the sample-extremes range on Gaussian data.
  std::mt19937 rng(8);
  std::normal_distribution<float> g(0.0f, 2.0f);
  std::vector<float> x(20000);
  for (auto& v : x) v = g(rng);
  const float lo = *std::min_element(x.begin(), x.end()), hi = *std::max_element(x.begin(), x.end());
  for (int b = 1; b <= 4; ++b) {
    const auto qg = make_gaussian_quantizer(2.0f, b);
    const auto qr = make_range_quantizer(lo, hi, b);
    double eg = 0, er = 0;
    for (float v : x) {
      eg += std::pow(qg.dequantize(qg.quantize(v)) - v, 2);
      er += std::pow(qr.dequantize(qr.quantize(v)) - v, 2);
    }
    EXPECT_LT(eg, er) << b;
    EXPECT_NEAR(eg / x.size() / 4.0, mse[b - 1], 0.05 * mse[b - 1]) << b;
  }
  EXPECT_EQ(make_gaussian_quantizer(2.0f, 0, 0.5f).dequantize(0), 0.5f);
  EXPECT_THROW(make_gaussian_quantizer(-1.0f, 2), Error);
  EXPECT_THROW(gaussian_optimal_step(0), Error);
}

}  // namespace

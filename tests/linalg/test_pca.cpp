#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvcodec/error.hpp"
#include "linalg/pca.hpp"

using kvcodec::Error;
using kvcodec::ErrorCode;
using namespace kvcodec::linalg;

namespace {

// n tokens of a dim-dimensional Gaussian with a known covariance: a random
// orthogonal-ish mixing of independent components of std scales[j], plus an
// offset. Row-major [n, dim].
std::vector<float> make_data(int64_t n, int dim, uint32_t seed, float offset = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> mix(static_cast<size_t>(dim) * dim);
  for (auto& m : mix) m = g(rng);
  std::vector<float> x(static_cast<size_t>(n) * dim);
  std::vector<float> z(dim);
  for (int64_t i = 0; i < n; ++i) {
    for (int j = 0; j < dim; ++j) z[j] = g(rng) * std::pow(0.7f, static_cast<float>(j));
    for (int d = 0; d < dim; ++d) {
      float acc = offset * static_cast<float>(d % 3);
      for (int j = 0; j < dim; ++j) acc += mix[static_cast<size_t>(d) * dim + j] * z[j];
      x[i * dim + d] = acc;
    }
  }
  return x;
}

TEST(Pca, AxesAreOrthonormalSortedAndSignFixed) {
  const int dim = 16;
  const int64_t n = 500;
  auto x = make_data(n, dim, 1, 3.0f);
  PcaBasis b = fit_pca(x.data(), n, dim);
  ASSERT_EQ(b.dim, dim);
  ASSERT_EQ(b.mean.size(), static_cast<size_t>(dim));
  ASSERT_EQ(b.components.size(), static_cast<size_t>(dim * dim));
  for (int k = 0; k + 1 < dim; ++k) EXPECT_GE(b.eigenvalues[k], b.eigenvalues[k + 1]);
  for (double e : b.eigenvalues) EXPECT_GE(e, 0.0);
  for (int a = 0; a < dim; ++a) {
    for (int c = 0; c < dim; ++c) {
      double dot = 0;
      for (int d = 0; d < dim; ++d) dot += double(b.components[a * dim + d]) * b.components[c * dim + d];
      EXPECT_NEAR(dot, a == c ? 1.0 : 0.0, 1e-5) << a << "," << c;
    }
    int arg = 0;
    for (int d = 1; d < dim; ++d)
      if (std::abs(b.components[a * dim + d]) > std::abs(b.components[a * dim + arg])) arg = d;
    EXPECT_GT(b.components[a * dim + arg], 0.0f);
  }
  // Mean of the data and eigenvalues = variance of the projected coefficients.
  std::vector<float> coeffs(n * dim);
  project(b, x.data(), n, dim, coeffs.data());
  for (int k = 0; k < dim; ++k) {
    double s = 0, s2 = 0;
    for (int64_t i = 0; i < n; ++i) {
      s += coeffs[i * dim + k];
      s2 += double(coeffs[i * dim + k]) * coeffs[i * dim + k];
    }
    EXPECT_NEAR(s / n, 0.0, 1e-4 * std::sqrt(b.eigenvalues[0]));
    EXPECT_NEAR(s2 / n, b.eigenvalues[k], 1e-4 * b.eigenvalues[0] + 1e-3 * b.eigenvalues[k]);
  }
}

TEST(Pca, KnownDiagonalCovariance) {
  // Independent axes with variances 9, 4, 1 along permuted coordinates; the
  // basis must find them (up to the sign convention, which makes them +e_i).
  const int64_t n = 4;
  // Points chosen so the population variances are exact: coordinate 2 takes
  // +-3, coordinate 0 +-2, coordinate 1 +-1, uncorrelated.
  std::vector<float> x = {2, 1, 3,  -2, -1, 3,  2, -1, -3,  -2, 1, -3};
  for (auto& v : x) v += 0.0f;
  PcaBasis b = fit_pca(x.data(), n, 3);
  EXPECT_DOUBLE_EQ(b.eigenvalues[0], 9.0);
  EXPECT_DOUBLE_EQ(b.eigenvalues[1], 4.0);
  EXPECT_NEAR(b.eigenvalues[2], 1.0, 1e-12);
  const std::vector<float> expect = {0, 0, 1, 1, 0, 0, 0, 1, 0};
  for (int i = 0; i < 9; ++i) EXPECT_NEAR(b.components[i], expect[i], 1e-6) << i;
}

TEST(Pca, DeterministicAndRankDeficient) {
  const int dim = 32;
  auto x = make_data(8, dim, 7);  // n < dim
  PcaBasis a = fit_pca(x.data(), 8, dim);
  PcaBasis b = fit_pca(x.data(), 8, dim);
  EXPECT_EQ(a.components, b.components);
  EXPECT_EQ(a.eigenvalues, b.eigenvalues);
  EXPECT_EQ(a.mean, b.mean);
  // At most n-1 nonzero variances after centring.
  for (int k = 7; k < dim; ++k) EXPECT_LT(a.eigenvalues[k], 1e-9 * a.eigenvalues[0]);
  for (double e : a.eigenvalues) EXPECT_GE(e, 0.0);
  // Keeping the first n-1 axes reconstructs the fit data.
  std::vector<float> c(8 * 7), y(8 * dim);
  project(a, x.data(), 8, 7, c.data());
  reconstruct(a, c.data(), 8, 7, y.data());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 1e-4) << i;
  // A single token: zero covariance, mean = the token.
  PcaBasis one = fit_pca(x.data(), 1, dim);
  for (int d = 0; d < dim; ++d) EXPECT_EQ(one.mean[d], x[d]);
  for (double e : one.eigenvalues) EXPECT_EQ(e, 0.0);
}

TEST(Pca, BatchedEqualsLoop) {
  const int dim = 24;
  const int64_t n = 100, batch = 5;
  std::vector<float> x;
  for (int b = 0; b < batch; ++b) {
    auto part = make_data(n, dim, 100 + b, float(b));
    x.insert(x.end(), part.begin(), part.end());
  }
  // The default team, one thread (no team), and explicit teams of 2 and 3.
  for (int threads : {0, 1, 2, 3}) {
    auto all = fit_pca_batched(x.data(), batch, n, dim, threads);
    ASSERT_EQ(all.size(), static_cast<size_t>(batch));
    for (int b = 0; b < batch; ++b) {
      PcaBasis one = fit_pca(x.data() + b * n * dim, n, dim);
      EXPECT_EQ(all[b].dim, one.dim);
      EXPECT_EQ(all[b].mean, one.mean) << b << " threads " << threads;
      EXPECT_EQ(all[b].components, one.components) << b << " threads " << threads;
      EXPECT_EQ(all[b].eigenvalues, one.eigenvalues) << b << " threads " << threads;
    }
    EXPECT_TRUE(fit_pca_batched(x.data(), 0, n, dim, threads).empty());
  }
  EXPECT_THROW(fit_pca_batched(x.data(), batch, n, dim, -1), Error);
}

TEST(Pca, FastPathsMatchReference) {
  const int dim = 64;
  const int64_t n = 300;  // not a multiple of the row block
  auto x = make_data(n, dim, 3, 5.0f);
  PcaBasis b = fit_pca(x.data(), n, dim);
  for (int n_keep : {0, 1, 17, 64}) {
    std::vector<float> fast(n * n_keep + 1), ref(n * n_keep + 1);
    project(b, x.data(), n, n_keep, fast.data());
    project_reference(b, x.data(), n, n_keep, ref.data());
    double scale = std::sqrt(b.eigenvalues[0]);
    for (int64_t i = 0; i < n * n_keep; ++i) ASSERT_NEAR(fast[i], ref[i], 2e-5 * scale) << i;
    std::vector<float> yf(n * dim), yr(n * dim);
    reconstruct(b, ref.data(), n, n_keep, yf.data());
    reconstruct_reference(b, ref.data(), n, n_keep, yr.data());
    for (int64_t i = 0; i < n * dim; ++i) ASSERT_NEAR(yf[i], yr[i], 2e-5 * (scale + 10)) << i;
    if (n_keep == dim) {
      for (int64_t i = 0; i < n * dim; ++i) ASSERT_NEAR(yf[i], x[i], 1e-4 * (scale + 10)) << i;
    }
  }
}

TEST(Pca, Errors) {
  std::vector<float> x(12, 1.0f);
  EXPECT_THROW(fit_pca(x.data(), 0, 3), Error);
  EXPECT_THROW(fit_pca(x.data(), 4, 0), Error);
  EXPECT_THROW(fit_pca(nullptr, 4, 3), Error);
  x[5] = std::numeric_limits<float>::quiet_NaN();
  try {
    fit_pca(x.data(), 4, 3);
    FAIL() << "NaN accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("non-finite"), std::string::npos);
  }
  EXPECT_THROW(fit_pca_batched(x.data(), 1, 4, 3), Error);
  x[5] = 1.0f;
  PcaBasis b = fit_pca(x.data(), 4, 3);
  std::vector<float> out(12);
  EXPECT_THROW(project(b, x.data(), 4, 4, out.data()), Error);
  EXPECT_THROW(project(b, x.data(), 4, -1, out.data()), Error);
  PcaBasis broken = b;
  broken.mean.pop_back();
  EXPECT_THROW(reconstruct(broken, x.data(), 4, 3, out.data()), Error);
}

TEST(WaterFilling, AnalyticCases) {
  // Equal variances: D = m * theta, rate = m/2 log2(lambda/theta).
  std::vector<double> eq(4, 4.0);
  EXPECT_NEAR(reverse_water_filling_bits(eq, 4.0), 4 * 0.5 * std::log2(4.0), 1e-12);
  EXPECT_NEAR(reverse_water_filling_mse(eq, 4.0), 4.0, 1e-12);
  // {16, 4, 1} with D = 3: theta = 1 exactly at the boundary (1 + 1 + 1):
  // rate = 0.5 log2 16 + 0.5 log2 4 = 3.
  std::vector<double> l = {4.0, 16.0, 1.0};
  EXPECT_NEAR(reverse_water_filling_bits(l, 3.0), 3.0, 1e-12);
  EXPECT_NEAR(reverse_water_filling_mse(l, 3.0), 3.0, 1e-12);
  // D = 1 + 2*2 = 5 -> theta = 2, the smallest is fully dropped:
  // rate = 0.5 log2 8 + 0.5 log2 2 = 2.
  EXPECT_NEAR(reverse_water_filling_bits(l, 5.0), 2.0, 1e-12);
  EXPECT_NEAR(reverse_water_filling_mse(l, 2.0), 5.0, 1e-12);
  // D = 1 + 4 + 8 = 13 -> theta = 8: only the largest survives with 0.5 bit.
  EXPECT_NEAR(reverse_water_filling_bits(l, 13.0), 0.5, 1e-12);
  EXPECT_NEAR(reverse_water_filling_mse(l, 0.5), 13.0, 1e-12);
  // Edges.
  EXPECT_EQ(reverse_water_filling_bits(l, 21.0), 0.0);
  EXPECT_EQ(reverse_water_filling_bits(l, 100.0), 0.0);
  EXPECT_EQ(reverse_water_filling_mse(l, 0.0), 21.0);
  EXPECT_TRUE(std::isinf(reverse_water_filling_bits(l, 0.0)));
  EXPECT_EQ(reverse_water_filling_bits({0.0, 0.0}, 0.0), 0.0);
  EXPECT_EQ(reverse_water_filling_mse({0.0, 2.0}, 10.0), 2.0 * std::exp2(-20.0));
  // High rate: 6.02 dB per bit per component.
  EXPECT_NEAR(reverse_water_filling_mse(l, 30.0) / reverse_water_filling_mse(l, 33.0), 4.0, 1e-9);
  EXPECT_THROW(reverse_water_filling_bits({1.0, -1.0}, 1.0), Error);
  EXPECT_THROW(reverse_water_filling_bits({1.0}, -1.0), Error);
  EXPECT_THROW(reverse_water_filling_mse({1.0}, std::nan("")), Error);
}

TEST(WaterFilling, InverseRoundTrip) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(-6, 6);
  for (int t = 0; t < 50; ++t) {
    std::vector<double> l(1 + t % 9);
    for (auto& v : l) v = std::pow(10.0, u(rng));
    for (double bits : {0.1, 1.0, 3.7, 20.0}) {
      double d = reverse_water_filling_mse(l, bits);
      EXPECT_NEAR(reverse_water_filling_bits(l, d), bits, 1e-9 * (1 + bits));
    }
  }
}

}  // namespace

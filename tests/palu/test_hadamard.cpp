// Walsh-Hadamard rotations and PALU's calibrated projection (palu/hadamard.hpp,
// palu::calibrated_projection): the fast transform against the plain matrix,
// the block cover of the bit classes, and the folded basis against U H.
#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "kvcodec/error.hpp"
#include "palu/hadamard.hpp"
#include "palu/projection.hpp"

using namespace kvcodec;

TEST(Hadamard, FastTransformMatchesPlainMatrix) {
  std::mt19937 rng(5);
  std::normal_distribution<double> g;
  for (int n = 1; n <= 256; n *= 2) {
    std::vector<double> x(static_cast<size_t>(n)), ref(static_cast<size_t>(n));
    for (auto& v : x) v = g(rng);
    palu::fwht_reference(x.data(), n, ref.data());
    std::vector<double> fast = x;
    palu::fwht(fast.data(), n);
    for (int i = 0; i < n; ++i) EXPECT_NEAR(fast[size_t(i)], ref[size_t(i)], 1e-12) << "n=" << n << " i=" << i;
    // Orthonormal and its own inverse: applying it twice gives x back.
    palu::fwht(fast.data(), n);
    for (int i = 0; i < n; ++i) EXPECT_NEAR(fast[size_t(i)], x[size_t(i)], 1e-12);
  }
}

TEST(Hadamard, RefusesSizesThatAreNotPowersOfTwo) {
  std::vector<double> x(12);
  EXPECT_THROW(palu::fwht(x.data(), 12), Error);
  EXPECT_THROW(palu::fwht(x.data(), 0), Error);
  EXPECT_THROW(palu::fwht_reference(x.data(), 3, x.data()), Error);
}

TEST(Hadamard, BlocksCoverEachBitClassLargestFirst) {
  EXPECT_EQ(palu::hadamard_blocks(12, 48), (std::vector<int>{8, 4, 32, 4}));
  EXPECT_EQ(palu::hadamard_blocks(16, 64), (std::vector<int>{16, 32, 16}));
  EXPECT_EQ(palu::hadamard_blocks(1, 1), (std::vector<int>{1}));
  for (int r = 1; r <= 70; ++r)
    for (int hi = 1; hi <= r; hi += 7) {
      const auto b = palu::hadamard_blocks(hi, r);
      EXPECT_EQ(std::accumulate(b.begin(), b.end(), 0), r);
      int first = 0;
      bool crosses = false;
      for (int s : b) {
        crosses |= first < hi && first + s > hi;  // no block mixes the two widths
        first += s;
      }
      EXPECT_FALSE(crosses) << "r=" << r << " hi=" << hi;
    }
}

// Samples [n, dim] of a rank-`rank` model with decaying scales plus noise.
static std::vector<float> low_rank_samples(int n, int dim, int rank, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  std::vector<float> a(size_t(rank) * dim), x(size_t(n) * dim);
  for (auto& v : a) v = g(rng);
  for (int t = 0; t < n; ++t)
    for (int r = 0; r < rank; ++r) {
      const float z = g(rng) / float(1 + r);
      for (int d = 0; d < dim; ++d) x[size_t(t) * dim + d] += z * a[size_t(r) * dim + d] + 0.01f * g(rng) / rank;
    }
  return x;
}

TEST(CalibratedProjection, FoldedHadamardIsUTimesBlockHadamard) {
  const int dim = 24, n = 500;
  const auto x = low_rank_samples(n, dim, 10, 3);
  const palu::Eigenbasis e = palu::gram_eigenbasis(x.data(), n, dim);
  palu::FitOptions opt;
  opt.rank = 12;
  opt.hi_fraction = 0.25;  // 3 hi channels: blocks 2 + 1, then 8 + 1
  opt.hi_bit = 6;
  opt.lo_bit = 3;
  const palu::Projection plain = palu::calibrated_projection(e, opt);
  opt.hadamard = true;
  const palu::Projection rot = palu::calibrated_projection(e, opt);
  ASSERT_EQ(rot.rank, 12);
  EXPECT_EQ(rot.bits, (std::vector<uint8_t>{6, 6, 6, 3, 3, 3, 3, 3, 3, 3, 3, 3}));
  EXPECT_EQ(plain.bits, rot.bits);
  // Reference: U [dim, 12] times the block-diagonal Hadamard built from the
  // plain matrix, column by column (H e_j), rounded to f16 as stored.
  const std::vector<int> blocks = palu::hadamard_blocks(3, 12);
  std::vector<double> h(144, 0.0);
  int first = 0;
  for (int b : blocks) {
    for (int j = 0; j < b; ++j) {
      std::vector<double> unit(static_cast<size_t>(b), 0.0), col(static_cast<size_t>(b));
      unit[size_t(j)] = 1.0;
      palu::fwht_reference(unit.data(), b, col.data());
      for (int i = 0; i < b; ++i) h[size_t(first + i) * 12 + first + j] = col[size_t(i)];
    }
    first += b;
  }
  for (int i = 0; i < dim; ++i)
    for (int j = 0; j < 12; ++j) {
      double ref = 0.0;
      for (int k = 0; k < 12; ++k) ref += e.vectors[size_t(i) * dim + k] * h[size_t(k) * 12 + j];
      EXPECT_NEAR(rot.basis[size_t(i) * 12 + j], ref, 1e-3) << i << "," << j;
    }
  // Same subspace: both reconstruct a sample alike.
  std::vector<float> z(12), y1(dim), y2(dim);
  plain.project(x.data(), z.data());
  plain.reconstruct(z.data(), y1.data());
  rot.project(x.data(), z.data());
  rot.reconstruct(z.data(), y2.data());
  for (int d = 0; d < dim; ++d) EXPECT_NEAR(y1[size_t(d)], y2[size_t(d)], 2e-2);
  // A block's channels share its energy equally.
  EXPECT_NEAR(rot.channel_energy[3], rot.channel_energy[10], 1e-12);
  EXPECT_NEAR(rot.channel_energy[3], (e.lambda[3] + e.lambda[4] + e.lambda[5] + e.lambda[6] + e.lambda[7] +
                                      e.lambda[8] + e.lambda[9] + e.lambda[10]) / 8, 1e-12);
}

TEST(CalibratedProjection, RankByEnergyOnTheStoredEigenvalues) {
  const int dim = 16, n = 400;
  const auto x = low_rank_samples(n, dim, 4, 8);
  const palu::Eigenbasis e = palu::gram_eigenbasis(x.data(), n, dim);
  for (int k = 1; k < dim; ++k) EXPECT_GE(e.lambda[size_t(k) - 1], e.lambda[size_t(k)]);
  palu::FitOptions opt;
  opt.energy_threshold = 0.999;
  const int r = palu::calibrated_projection(e, opt).rank;
  EXPECT_GE(r, 4);
  EXPECT_LE(r, 6);
  EXPECT_EQ(palu::choose_rank(e.lambda, opt), r);
  opt.rank = 40;  // clamped to dim
  EXPECT_EQ(palu::calibrated_projection(e, opt).rank, dim);
}

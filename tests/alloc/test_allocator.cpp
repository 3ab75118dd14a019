#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "alloc/allocator.hpp"
#include "kvcodec/error.hpp"

using kvcodec::Error;
using kvcodec::ErrorCode;
using namespace kvcodec::alloc;

namespace {

const std::vector<std::vector<int>> kChoiceSets = {
    {0, 1, 2, 3, 4, 6, 8}, {0, 2, 4, 8}, {0, 1}, {0, 3, 5}, {5, 0, 3} /* unsorted */};

std::vector<double> random_variances(std::mt19937& rng, int n, bool ties) {
  std::uniform_real_distribution<double> exp10(-12.0, 12.0);
  std::uniform_int_distribution<int> small(0, 3);
  std::vector<double> v(n);
  for (auto& x : v) {
    // Ties: a few distinct values (including 0 and powers of beta apart,
    // which make genuine equal distortions across different widths).
    x = ties ? std::vector<double>{0.0, 1.0, 3.5, 12.25}[small(rng)] : std::pow(10.0, exp10(rng));
  }
  return v;
}

TEST(AllocDp, EqualsBruteForceOnManyRandomCases) {
  std::mt19937 rng(2024);
  int cases = 0;
  for (const auto& choices : kChoiceSets) {
    for (int n = 1; n <= 6; ++n) {
      // Keep |choices|^n small enough for a fast brute force.
      if (std::pow(double(choices.size()), n) > 5000) continue;
      for (int trial = 0; trial < 8; ++trial) {
        const bool ties = trial % 2 == 1;
        const auto v = random_variances(rng, n, ties);
        for (int budget = 0; budget <= 3 * n; ++budget) {
          const double beta = trial % 3 == 0 ? 3.5 : 2.0;
          const auto dp = allocate_bits_dp(v, budget, choices, beta);
          const auto bf = allocate_bits_brute_force(v, budget, choices, beta);
          ASSERT_EQ(dp.bits, bf.bits) << "n=" << n << " budget=" << budget << " trial=" << trial;
          ASSERT_EQ(dp.distortion, bf.distortion);
          ASSERT_EQ(dp.total_bits, bf.total_bits);
          ASSERT_LE(dp.total_bits, budget);
          ++cases;
        }
      }
    }
  }
  EXPECT_GT(cases, 1000);
}

TEST(AllocDp, TieBreakingIsTheDocumentedKey) {
  // Two equal variances, budget 1, choices {0,1}: either component can take
  // the bit; the larger-bits-first rule gives it to component 0.
  auto r = allocate_bits_dp({1.0, 1.0}, 1, {0, 1});
  EXPECT_EQ(r.bits, (std::vector<int>{1, 0}));
  // Zero variance: any width gives distortion 0, so fewer bits wins.
  r = allocate_bits_dp({0.0, 0.0}, 16, {0, 1, 2, 3, 4, 6, 8});
  EXPECT_EQ(r.bits, (std::vector<int>{0, 0}));
  EXPECT_EQ(r.distortion, 0.0);
  // Budget 4 with beta 2 and variances {4, 1}: {2,2} gives 1 + 0.25; {3,1}
  // gives 0.5 + 0.5 = 1; {4,0} gives 0.25 + 1. Optimum {3,1} (exactly 1.0).
  r = allocate_bits_dp({4.0, 1.0}, 4, {0, 1, 2, 3, 4}, 2.0);
  EXPECT_EQ(r.bits, (std::vector<int>{3, 1}));
  EXPECT_EQ(r.distortion, 1.0);
  // Genuine tie in distortion at equal bits: variances {2, 1}, beta 2,
  // budget 1: {1,0} gives 1 + 1 = 2, {0,1} gives 2 + 0.5 = 2.5 -> {1,0};
  // variances {1, 2}: {1,0} gives 0.5+2, {0,1} gives 1+1 -> {0,1}.
  EXPECT_EQ(allocate_bits_dp({1.0, 2.0}, 1, {0, 1}, 2.0).bits, (std::vector<int>{0, 1}));
}

TEST(AllocDp, TinyAndHugeVariancesAreNotLost) {
  // A double sum 1e12 + 1e-12 loses the tiny term; the exact sum must still
  // prefer giving a spare bit to the tiny component over wasting it.
  std::vector<double> v = {1e12, 1e-12};
  auto r = allocate_bits_dp(v, 9, {0, 1, 8});
  // Best: 8 bits to the huge one, 1 bit to the tiny one (reduces distortion
  // by a tiny but real amount), rather than leaving a bit unused.
  EXPECT_EQ(r.bits, (std::vector<int>{8, 1}));
  EXPECT_EQ(allocate_bits_brute_force(v, 9, {0, 1, 8}).bits, r.bits);
}

TEST(AllocDp, MonotoneInBudgetAndLargeProblems) {
  std::mt19937 rng(9);
  std::vector<double> v(128);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::exp(-0.05 * double(i)) * (1.0 + 0.1 * (rng() % 7));
  double prev = std::numeric_limits<double>::infinity();
  for (int budget = 0; budget <= 8 * 128; budget += 96) {
    auto r = allocate_bits_dp(v, budget);
    EXPECT_LE(r.distortion, prev) << budget;
    EXPECT_LE(r.total_bits, budget);
    prev = r.distortion;
  }
  // Full budget: every component gets 8 bits.
  auto full = allocate_bits_dp(v, 8 * 128);
  for (int b : full.bits) EXPECT_EQ(b, 8);
  // Default 4*D budget for a calibrated layer of H*D = 256 components.
  std::vector<double> big(256);
  for (size_t i = 0; i < big.size(); ++i) big[i] = std::exp(-0.01 * double(i));
  auto r = allocate_bits_dp(big, 4 * 256);
  EXPECT_LE(r.total_bits, 4 * 256);
  // Higher-variance components never get fewer bits than lower ones here.
  for (size_t i = 1; i < r.bits.size(); ++i) EXPECT_GE(r.bits[i - 1], r.bits[i]) << i;
}

TEST(AllocDp, Errors) {
  auto expect_invalid = [](auto fn, const char* needle) {
    try {
      fn();
      FAIL() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_invalid([] { allocate_bits_dp({}, 4); }, "empty");
  expect_invalid([] { allocate_bits_dp({1.0, -1.0}, 4); }, "variances[1]");
  expect_invalid([] { allocate_bits_dp({std::nan("")}, 4); }, "variances[0]");
  expect_invalid([] { allocate_bits_dp({1.0}, -1); }, "budget_bits");
  expect_invalid([] { allocate_bits_dp({1.0}, 4, {}); }, "empty");
  expect_invalid([] { allocate_bits_dp({1.0}, 4, {1, 2}); }, "contain 0");
  expect_invalid([] { allocate_bits_dp({1.0}, 4, {0, -2}); }, "-2");
  expect_invalid([] { allocate_bits_dp({1.0}, 4, {0, 2, 2}); }, "twice");
  expect_invalid([] { allocate_bits_dp({1.0}, 4, {0, 2}, 0.0); }, "beta");
  expect_invalid([] { allocate_bits_brute_force(std::vector<double>(40, 1.0), 4); }, "too many");
  expect_invalid([] { allocate_bits_dp(std::vector<double>(8192, 1.0), 1 << 15); }, "2^27");
  // Refused before anything is sized by it.
  expect_invalid([] { allocate_bits_dp(std::vector<double>(1 << 22, 1.0), 1 << 30); }, "2^27");
}

TEST(AllocMeasured, EqualsBruteForceAndRespectsBudget) {
  std::mt19937 rng(77);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const std::vector<int> choices = {0, 2, 4, 8};
  for (int trial = 0; trial < 150; ++trial) {
    const int n = 1 + trial % 5;
    std::vector<std::vector<double>> rate(n), dist(n);
    for (int i = 0; i < n; ++i) {
      const double var = std::pow(10.0, 8 * u(rng) - 4);
      for (int b : choices) {
        // Measured rates below the nominal width (entropy coding), with
        // rounding noise; ties on every 3rd trial.
        const double r = b == 0 ? 0.0 : (trial % 3 == 0 ? b * 0.5 : b * (0.4 + 0.5 * u(rng)));
        rate[i].push_back(r);
        dist[i].push_back(trial % 3 == 0 ? std::ldexp(1.0, -b) : var * std::pow(3.5, -b) * (0.8 + 0.4 * u(rng)));
      }
    }
    const double budget = u(rng) * 4.0 * n;
    const auto dp = allocate_bits_measured(rate, dist, choices, budget);
    const auto bf = allocate_bits_measured_brute_force(rate, dist, choices, budget);
    ASSERT_EQ(dp.bits, bf.bits) << trial;
    ASSERT_LE(dp.rate, budget + 1e-12);
    ASSERT_EQ(dp.distortion, bf.distortion);
  }
}

TEST(AllocMeasured, MatchesModelDpWhenRatesAreNominal) {
  std::vector<double> v = {5.0, 3.0, 1.0, 0.2, 0.01};
  const std::vector<int> choices = {0, 1, 2, 3, 4, 6, 8};
  std::vector<std::vector<double>> rate, dist;
  for (double x : v) {
    rate.emplace_back();
    dist.emplace_back();
    for (int b : choices) {
      rate.back().push_back(b);
      dist.back().push_back(b == 0 ? x : x * std::pow(3.5, -b));
    }
  }
  for (int budget = 0; budget <= 40; budget += 3) {
    EXPECT_EQ(allocate_bits_measured(rate, dist, choices, budget).bits,
              allocate_bits_dp(v, budget, choices).bits)
        << budget;
  }
}

// One table for the largest budget answers every smaller one exactly as a
// DP for that budget alone: bits, rate and distortion, ties included.
TEST(AllocMeasured, OneTableGivesEveryBudgetsAllocation) {
  std::mt19937 rng(91);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const std::vector<int> choices = {0, 1, 2, 3, 4, 6, 8};
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 3 + 7 * trial;
    std::vector<std::vector<double>> rate(n), dist(n);
    for (int i = 0; i < n; ++i) {
      const double var = std::pow(10.0, 6 * u(rng) - 3);
      for (int b : choices) {
        // Ties on every 4th trial (nominal rates, power-of-two distortions).
        const bool tie = trial % 4 == 0;
        rate[i].push_back(b == 0 ? (tie ? 0.0 : 0.01 * u(rng)) : (tie ? b : b * (0.4 + 0.6 * u(rng))));
        dist[i].push_back(tie ? std::ldexp(1.0, -b) : var * std::pow(3.5, -b) * (0.8 + 0.4 * u(rng)));
      }
    }
    const double max_budget = (0.5 + 3.0 * u(rng)) * n;
    const MeasuredAllocator table(rate, dist, choices, max_budget);
    for (int k = 0; k <= 12; ++k) {
      const double budget = max_budget * k / 12.0;
      AllocationResult alone;
      try {
        alone = allocate_bits_measured(rate, dist, choices, budget);
      } catch (const Error&) {
        EXPECT_THROW(table.at(budget), Error) << trial << " " << k;  // below the cheapest, both ways
        continue;
      }
      const AllocationResult walked = table.at(budget);
      ASSERT_EQ(walked.bits, alone.bits) << trial << " " << k;
      EXPECT_EQ(walked.rate, alone.rate);
      EXPECT_EQ(walked.distortion, alone.distortion);
    }
    // Past the table's budget or not a budget: refused, naming the limit.
    EXPECT_THROW(table.at(max_budget * 1.01 + 0.1), Error);
    EXPECT_THROW(table.at(std::nan("")), Error);
    EXPECT_THROW(table.at(-1.0), Error);
  }
}

TEST(AllocMeasured, Errors) {
  std::vector<std::vector<double>> rate = {{0.0, 1.0}}, dist = {{1.0, 0.5}};
  EXPECT_THROW(allocate_bits_measured({}, {}, {0, 1}, 1.0), Error);
  EXPECT_THROW(allocate_bits_measured(rate, {}, {0, 1}, 1.0), Error);
  EXPECT_THROW(allocate_bits_measured(rate, dist, {0, 1, 2}, 1.0), Error);
  EXPECT_THROW(allocate_bits_measured(rate, dist, {0, 1}, -1.0), Error);
  EXPECT_THROW(allocate_bits_measured({{0.0, -1.0}}, dist, {0, 1}, 1.0), Error);
  EXPECT_THROW(allocate_bits_measured(rate, {{1.0, std::nan("")}}, {0, 1}, 1.0), Error);
  // Budget below the cheapest allocation (choice 0 itself costs 0.5 bit).
  EXPECT_THROW(allocate_bits_measured({{0.5, 1.0}}, dist, {0, 1}, 0.25), Error);
  EXPECT_THROW(allocate_bits_measured(rate, dist, {0, 1}, 1.0, 0), Error);
}

TEST(EqualStep, MeetsBudgetAndFollowsWaterFilling) {
  std::vector<double> v = {16.0, 4.0, 1.0, 0.25, 1e-6, 0.0};
  for (double budget : {0.0, 0.5, 2.0, 6.0, 20.0}) {
    auto a = allocate_equal_step(v, budget);
    EXPECT_LE(a.predicted_bits, budget + 1e-9);
    EXPECT_GE(a.predicted_bits, budget * (1 - 1e-6) - 1e-9) << budget;  // tight
    ASSERT_EQ(a.keep.size(), v.size());
    EXPECT_FALSE(a.keep[5]);
    // Kept set is a prefix (variances descend).
    for (size_t i = 1; i < v.size(); ++i) EXPECT_TRUE(a.keep[i - 1] || !a.keep[i]);
  }
  // Analytic: two kept components: rate = h1 + h2 - 2 log2 step.
  auto a = allocate_equal_step({16.0, 4.0}, 10.0);
  const double expect = std::exp2((gaussian_entropy_bits(16.0) + gaussian_entropy_bits(4.0) - 10.0) / 2);
  EXPECT_NEAR(a.step, expect, 1e-9 * expect);
  EXPECT_NEAR(a.predicted_mse, 2 * expect * expect / 12, 1e-8);
  // A measured-rate callback: rate = max(0, 3 - log2 step) per component.
  auto m = allocate_equal_step({1.0, 1.0}, 4.0, [](int, double s) { return std::max(0.0, 3.0 - std::log2(s)); });
  EXPECT_NEAR(m.step, 2.0, 1e-9);
  // Deterministic.
  EXPECT_EQ(allocate_equal_step(v, 6.0).step, allocate_equal_step(v, 6.0).step);
  EXPECT_THROW(allocate_equal_step({}, 1.0), Error);
  EXPECT_THROW(allocate_equal_step({1.0}, -1.0), Error);
  EXPECT_THROW(allocate_equal_step({1.0}, 1.0, [](int, double) { return -1.0; }), Error);
}

}  // namespace

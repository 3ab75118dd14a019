// step_rounding_error: the AVX2 loop against the plain one (same bits), and
// both against a direct sum in long double.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/cpu_features.hpp"
#include "kvtc/step_error.hpp"

using namespace kvcodec;
using kvcodec::kvtc::step_rounding_error;

namespace {

long double direct_sum(const std::vector<float>& c, double step) {
  long double sum = 0.0L;
  for (const float f : c) {
    const double v = f;
    const long double r = v - step * std::floor(v * (1.0 / step) + 0.5);
    sum += r * r;
  }
  return sum;
}

}  // namespace

TEST(StepError, AvxAndPlainLoopsGiveTheSameBitsAndTheDirectSum) {
  if (!simd_avx2()) GTEST_SKIP() << "no AVX2 on this CPU: only the plain loop runs";
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 3.0f);
  // Lengths around the 8-wide groups, a fit's size, values on the rounding
  // ties (k + 0.5 steps) and zeros.
  for (const int64_t count : {0, 1, 7, 8, 9, 15, 16, 17, 63, 1000, 256 * 128 + 5}) {
    std::vector<float> c(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) c[size_t(i)] = i % 11 == 3 ? 0.25f * float(i % 9) - 1.0f : g(rng);
    if (count > 9) c[9] = 0.0f;
    for (const double step : {0.5, 0.0371, 1.0 / 3.0, 7.25}) {
      const double plain = step_rounding_error(c.data(), count, step, /*simd=*/false);
      const double simd = step_rounding_error(c.data(), count, step, /*simd=*/true);
      EXPECT_EQ(plain, simd) << "count " << count << " step " << step;
      const long double direct = direct_sum(c, step);
      EXPECT_NEAR(double(direct), plain, 1e-12 * double(direct) + 1e-300) << "count " << count << " step " << step;
      // Each term is at most (step / 2)^2.
      EXPECT_LE(plain, double(count) * step * step / 4.0 * (1.0 + 1e-12));
    }
  }
}

TEST(StepError, ACoarserStepNeverLosesLessOnAFitsCoefficients) {
  // The bisection relies on the error growing with the step on average; on a
  // spread of coefficients it does so step by step at these ratios.
  std::mt19937 rng(11);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> c(4096);
  for (float& v : c) v = g(rng);
  double last = 0.0;
  for (double step = 1e-3; step < 1.0; step *= 1.5) {
    const double err = step_rounding_error(c.data(), int64_t(c.size()), step, /*simd=*/true);
    EXPECT_GT(err, last) << step;
    last = err;
  }
}

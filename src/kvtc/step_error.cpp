#include "kvtc/step_error.hpp"

#include <cmath>

#include "core/cpu_features.hpp"

#ifdef KVCODEC_HAVE_AVX2_PATHS
#include <immintrin.h>
#endif

namespace kvcodec::kvtc {

namespace {

// The terms from i on into lane[i % 8] (all of c, or the AVX2 loop's tail).
void step_error_plain(const float* c, int64_t count, int64_t i, double step, double inv, double* lane) {
  for (; i < count; ++i) {
    const double v = c[i];
    const double r = v - step * std::floor(v * inv + 0.5);
    const double sq = r * r;
    lane[i % 8] += sq;
  }
}

#ifdef KVCODEC_HAVE_AVX2_PATHS
KVCODEC_AVX2_BEGIN
// Whole groups of 8: lanes 0-3 in lo, 4-7 in hi; returns where it stopped.
int64_t step_error_avx2(const float* c, int64_t count, double step, double inv, double* lane) {
  const __m256d vstep = _mm256_set1_pd(step), vinv = _mm256_set1_pd(inv), half = _mm256_set1_pd(0.5);
  __m256d lo = _mm256_loadu_pd(lane), hi = _mm256_loadu_pd(lane + 4);
  const auto term = [&](__m256d v) {
    const __m256d q = _mm256_floor_pd(_mm256_add_pd(_mm256_mul_pd(v, vinv), half));
    const __m256d r = _mm256_sub_pd(v, _mm256_mul_pd(vstep, q));
    return _mm256_mul_pd(r, r);
  };
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 x = _mm256_loadu_ps(c + i);
    lo = _mm256_add_pd(lo, term(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
    hi = _mm256_add_pd(hi, term(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))));
  }
  _mm256_storeu_pd(lane, lo);
  _mm256_storeu_pd(lane + 4, hi);
  return i;
}
KVCODEC_AVX2_END
#endif

}  // namespace

double step_rounding_error(const float* c, int64_t count, double step, bool simd) {
  const double inv = 1.0 / step;
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
#ifdef KVCODEC_HAVE_AVX2_PATHS
  if (simd && simd_avx2()) i = step_error_avx2(c, count, step, inv, lane);
#else
  (void)simd;
#endif
  step_error_plain(c, count, i, step, inv, lane);
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

}  // namespace kvcodec::kvtc

// RoPE removal and re-application for calibrated KVTC (keys are coded with
// RoPE removed): the plain rotation and the shared cos/sin table.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>

#include "core/cpu_features.hpp"
#ifdef KVCODEC_HAVE_AVX2_PATHS
#include <immintrin.h>
#endif

#include "cache/kvtc_calibrated.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec {

std::vector<double> rope_inv_freq(int head_dim, double theta) {
  std::vector<double> f(static_cast<size_t>(head_dim / 2));
  for (int i = 0; i < head_dim / 2; ++i) f[size_t(i)] = std::pow(theta, -2.0 * i / head_dim);
  return f;
}

void rope_rotate_tokens(float* x, int64_t n, int n_heads, int head_dim, int64_t first_position,
                        const std::vector<double>& inv_freq, bool inverse) {
  const int half = head_dim / 2;
  std::vector<double> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
  for (int64_t t = 0; t < n; ++t) {
    const double pos = double(first_position + t);
    for (int i = 0; i < half; ++i) {
      // The model rounds cos/sin to f32 before rotating (llama.cpp, HF); do
      // the same so the removal is the exact inverse of what it applied.
      const double a = pos * inv_freq[size_t(i)];
      c[size_t(i)] = double(float(std::cos(a)));
      s[size_t(i)] = double(float(std::sin(a))) * (inverse ? -1.0 : 1.0);
    }
    for (int h = 0; h < n_heads; ++h) {
      float* v = x + (t * n_heads + h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const double a = v[i], b = v[i + half];
        v[i] = float(a * c[size_t(i)] - b * s[size_t(i)]);
        v[i + half] = float(b * c[size_t(i)] + a * s[size_t(i)]);
      }
    }
  }
}

void rope_advance_rows(float* x, int64_t n, int head_dim, int64_t positions, double theta) {
  // Every row turns by the same angles: rows as "heads" of one token, in
  // chunks whose row count an int holds.
  const std::vector<double> inv_freq = rope_inv_freq(head_dim, theta);
  constexpr int64_t kChunk = int64_t(1) << 20;
  for (int64_t at = 0; at < n; at += kChunk)
    rope_rotate_tokens(x + at * head_dim, 1, int(std::min(kChunk, n - at)), head_dim, positions, inv_freq, false);
}

std::shared_ptr<const RopeTable> RopeTable::get(int head_dim, double theta, int64_t positions) {
  // One table per (head_dim, theta) for the process, shared by every cache of
  // every layer and sequence. When a longer one is needed it is rebuilt at
  // the next power of two (>= 4096 positions) and replaces the registry's
  // entry; caches holding the old one keep it alive until they move on.
  static std::mutex mutex;
  static std::map<std::pair<int, double>, std::shared_ptr<const RopeTable>> tables;
  if (head_dim < 2 || head_dim % 2 != 0 || positions < 0 || positions > (int64_t(1) << 30))
    throw Error(ErrorCode::kInvalidArgument, "RoPE table: head_dim " + std::to_string(head_dim) + ", positions " +
                                                 std::to_string(positions));
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = tables[{head_dim, theta}];
  if (slot && slot->positions() >= positions) return slot;
  int64_t n = 4096;
  while (n < positions) n *= 2;
  auto t = std::make_shared<RopeTable>();
  t->half_ = head_dim / 2;
  t->positions_ = n;
  t->cos_.resize(size_t(n * t->half_));
  t->sin_.resize(size_t(n * t->half_));
  const std::vector<double> inv_freq = rope_inv_freq(head_dim, theta);
  for (int64_t pos = 0; pos < n; ++pos)
    for (int i = 0; i < t->half_; ++i) {
      // Same f32 rounding of cos/sin as the model (and rope_rotate_tokens).
      const double a = double(pos) * inv_freq[size_t(i)];
      t->cos_[size_t(pos * t->half_ + i)] = float(std::cos(a));
      t->sin_[size_t(pos * t->half_ + i)] = float(std::sin(a));
    }
  slot = t;
  return slot;
}

namespace {

#ifdef KVCODEC_HAVE_AVX2_PATHS
KVCODEC_AVX2_BEGIN
// rotate()'s pair loop for i < half rounded down to 4, four pairs per step:
// the same double products, differences and sums (no contraction:
// -ffp-contract=off, and no fma here), so the same bits.
int rotate_pairs_avx2(float* v, const float* c, const float* s, int half, double sign) {
  const __m256d sg = _mm256_set1_pd(sign);
  int i = 0;
  for (; i + 4 <= half; i += 4) {
    const __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(v + i)), b = _mm256_cvtps_pd(_mm_loadu_ps(v + i + half));
    const __m256d ci = _mm256_cvtps_pd(_mm_loadu_ps(c + i));
    const __m256d si = _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(s + i)), sg);
    _mm_storeu_ps(v + i, _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_mul_pd(a, ci), _mm256_mul_pd(b, si))));
    _mm_storeu_ps(v + i + half, _mm256_cvtpd_ps(_mm256_add_pd(_mm256_mul_pd(b, ci), _mm256_mul_pd(a, si))));
  }
  return i;
}
KVCODEC_AVX2_END
#endif

}  // namespace

void RopeTable::rotate(float* x, int64_t n, int64_t token_stride, int n_heads, int64_t first_position,
                       bool inverse) const {
  if (first_position < 0 || first_position + n > positions_)
    throw Error(ErrorCode::kInternal, "RoPE table covers " + std::to_string(positions_) + " positions, asked for " +
                                          std::to_string(first_position) + "+" + std::to_string(n));
  const int half = half_, head_dim = 2 * half_;
  const double sign = inverse ? -1.0 : 1.0;
  const bool simd = simd_avx2();
  for (int64_t t = 0; t < n; ++t) {
    const float* c = cos_.data() + (first_position + t) * half;
    const float* s = sin_.data() + (first_position + t) * half;
    for (int h = 0; h < n_heads; ++h) {
      float* v = x + t * token_stride + int64_t(h) * head_dim;
      // Same double arithmetic as rope_rotate_tokens, so both give the same bits.
      int i = 0;
#ifdef KVCODEC_HAVE_AVX2_PATHS
      if (simd) i = rotate_pairs_avx2(v, c, s, half, sign);
#endif
      for (; i < half; ++i) {
        const double a = v[i], b = v[i + half];
        const double ci = c[i], si = double(s[i]) * sign;
        v[i] = float(a * ci - b * si);
        v[i + half] = float(b * ci + a * si);
      }
    }
  }
}

void rope_rotate_token(float* x, int n_heads, int head_dim, int64_t position, double theta, bool inverse) {
  rope_rotate_tokens(x, 1, n_heads, head_dim, position, rope_inv_freq(head_dim, theta), inverse);
}

}  // namespace kvcodec

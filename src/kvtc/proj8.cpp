#include "kvtc/proj8.hpp"

#include "kvtc/int8_tiles.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/cpu_features.hpp"

#ifdef KVCODEC_HAVE_AVX2_PATHS
#include <immintrin.h>
#define KVCODEC_PROJ8_SIMD 1
#endif

namespace kvcodec::kvtc {

namespace {

using int8_tiles::round_even;
using int8_tiles::round_up8;

// The gates' weight: the added noise stays within (1/4)^2 of a step's.
constexpr double kGateFraction = 0.25;

void clear(HeadKernels& out) {
  std::vector<int8_t>().swap(out.proj8_w);
  std::vector<int32_t>().swap(out.proj8_bias);
  std::vector<float>().swap(out.proj8_qscale);
  out.proj8_gate_m = out.proj8_gate_ss = 0.0f;
}

}  // namespace

namespace {

// Row k's weights (into dst, row k's first byte in proj8_w's layout) and
// its terms: |b|^2, |W8 / unit - b|^2, unit and sum_d W8. Four interleaved
// sums in a fixed order (lane d mod 4, then a fixed tree), in the plain
// loops and the AVX2 ones alike (a lane per sum, mul then add: no FMA), so
// the gates, and with them which rows take this projection, are the same
// on every CPU (Codec.KernelsEqualTheirReference).
struct RowTerms {
  double n[4] = {0, 0, 0, 0}, e[4] = {0, 0, 0, 0};
  int32_t sum = 0;
  double unit = 1.0;
  double norm2() const { return (n[0] + n[1]) + (n[2] + n[3]); }
  double err2() const { return (e[0] + e[1]) + (e[2] + e[3]); }
};

// The largest |b| (by its bits: finite floats order as their bits do) and
// the unit 127 / max (1 for an all-zero row: weights 0, codes of 0).
double row_unit(const float* b, size_t D) {
  uint32_t mag = 0;
  for (size_t d = 0; d < D; ++d) mag = std::max(mag, std::bit_cast<uint32_t>(b[d]) & 0x7fffffffu);
  const double bmax = double(std::bit_cast<float>(mag));
  return bmax > 0.0 ? 127.0 / bmax : 1.0;
}

// The plain loops from d on (all of a row, or an AVX2 pass's last D % 4).
void row_terms_plain(const float* b, size_t D, size_t d, int8_t* dst, RowTerms& r) {
  const double back = 1.0 / r.unit;
  for (; d < D; ++d) {
    const double v = b[d];
    const double q = round_even(v * r.unit);  // |q| <= 127
    const double err = q * back - v;
    r.n[d % 4] += v * v;
    r.e[d % 4] += err * err;
    r.sum += int32_t(q);
    dst[(d / 4) * 32 + d % 4] = int8_t(q);
  }
}

#ifdef KVCODEC_PROJ8_SIMD
KVCODEC_AVX2_BEGIN
// row_terms_plain's whole groups of 4, a lane per d mod 4; returns where it stopped.
size_t row_terms_avx2(const float* b, size_t D, int8_t* dst, RowTerms& r) {
  const __m256d unit = _mm256_set1_pd(r.unit), back = _mm256_set1_pd(1.0 / r.unit);
  const __m256d shift = _mm256_set1_pd(0x1.8p52);
  __m256d n = _mm256_loadu_pd(r.n), e = _mm256_loadu_pd(r.e);
  __m128i sum = _mm_setzero_si128();
  size_t d = 0;
  for (; d + 4 <= D; d += 4) {
    const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(b + d));
    const __m256d q = _mm256_sub_pd(_mm256_add_pd(_mm256_mul_pd(v, unit), shift), shift);
    const __m256d err = _mm256_sub_pd(_mm256_mul_pd(q, back), v);
    n = _mm256_add_pd(n, _mm256_mul_pd(v, v));
    e = _mm256_add_pd(e, _mm256_mul_pd(err, err));
    const __m128i qi = _mm256_cvttpd_epi32(q);
    sum = _mm_add_epi32(sum, qi);
    const __m128i bytes = _mm_packs_epi16(_mm_packs_epi32(qi, qi), _mm_setzero_si128());
    const int32_t quad = _mm_cvtsi128_si32(bytes);
    std::memcpy(dst + (d / 4) * 32, &quad, sizeof quad);
  }
  _mm256_storeu_pd(r.n, n), _mm256_storeu_pd(r.e, e);
  alignas(16) int32_t s[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(s), sum);
  r.sum += (s[0] + s[1]) + (s[2] + s[3]);
  return d;
}
KVCODEC_AVX2_END
#endif

bool build_proj8_impl(const HeadParams& p, HeadKernels& out, bool simd) {
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim);
  // proj_int checked the basis (finite), the steps (finite, > 0) and the shapes.
  if (!out.proj_int || K == 0 || D == 0 || D > 65536) return false;
  const size_t K8 = round_up8(K), dp4 = proj8_row_len(D) / 4;
  out.proj8_w.assign(K8 / 8 * dp4 * 32, 0);
  out.proj8_bias.assign(K8, 0);
  out.proj8_qscale.assign(K8, 0.0f);
  double gate_m = 0.0, gate_ss = 0.0;
  for (size_t k = 0; k < K; ++k) {
    const float* b = p.basis.data() + k * D;
    int8_t* dst = out.proj8_w.data() + proj8_w_index(k, 0, dp4);
    RowTerms r;
    r.unit = row_unit(b, D);
    size_t d = 0;
#ifdef KVCODEC_PROJ8_SIMD
    if (simd) d = row_terms_avx2(b, D, dst, r);
#endif
    row_terms_plain(b, D, d, dst, r);
    const double step = p.quant[k].step, quarter = kGateFraction * step;
    out.proj8_bias[k] = -128 * r.sum;
    out.proj8_qscale[k] = float(1.0 / (r.unit * step));
    if (!std::isnormal(out.proj8_qscale[k])) return false;
    gate_m = std::max(gate_m, r.norm2() / ((127.0 * quarter) * (127.0 * quarter)));
    gate_ss = std::max(gate_ss, r.err2() / (double(D) * quarter * quarter));
  }
  out.proj8_gate_m = float(gate_m), out.proj8_gate_ss = float(gate_ss);
  return std::isfinite(out.proj8_gate_m) && std::isfinite(out.proj8_gate_ss);
}

}  // namespace

bool build_proj8(const HeadParams& p, HeadKernels& out, bool plain) {
#ifdef KVCODEC_PROJ8_SIMD
  const bool simd = !plain && simd_avx2();
#else
  const bool simd = false;
  (void)plain;
#endif
  const bool built = build_proj8_impl(p, out, simd);
  if (!built) clear(out);
  return built;
}

bool proj8_ready(const HeadParams& p) {
  const HeadKernels& k = p.derived();
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim), K8 = round_up8(K);
  return k.proj8 && p.quant.size() == K && k.proj8_bias.size() == K8 && k.proj8_qscale.size() == K8 &&
         k.proj8_w.size() == K8 / 8 * (proj8_row_len(D) / 4) * 32;
}

namespace {

// One row's largest |c| and square sum (scaled_row_fits' lane order and
// tree), plain.
void row_stats_plain(const float* row, size_t D, size_t d, float& m, float* lane) {
  for (; d < D; ++d) {
    m = std::max(m, std::fabs(row[d]));
    lane[d % 8] = std::fma(row[d], row[d], lane[d % 8]);
  }
}

#ifdef KVCODEC_PROJ8_SIMD
KVCODEC_AVX2_BEGIN
// The whole chunks of 8 of a row: m and the lanes as row_stats_plain
// (lane l sums d = l mod 8 in order by fmas); returns where it stopped.
size_t row_stats_avx2(const float* row, size_t D, float& m, float* lane) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vm = _mm256_setzero_ps(), acc = _mm256_setzero_ps();
  size_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 v = _mm256_loadu_ps(row + d);
    vm = _mm256_max_ps(vm, _mm256_and_ps(v, abs_mask));
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  _mm256_storeu_ps(lane, acc);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  m = _mm_cvtss_f32(h);
  return d;
}

// x[d] = nearbyint(row[d] * s) for the whole chunks of 8; returns where it
// stopped. 32 at a time by three packs and one lane fix (the packs work
// within 128-bit lanes): 4 shuffles per 32 values where 8 at a time took 12.
size_t scale_row_avx2(const float* row, size_t D, float s, uint8_t* x) {
  const __m256 vs = _mm256_set1_ps(s);
  const auto scaled = [&](size_t d) { return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + d), vs)); };
  const __m256i lane_fix = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i sign = _mm256_set1_epi8(char(0x80));  // x + 128 as u8
  size_t d = 0;
  for (; d + 32 <= D; d += 32) {
    const __m256i ab = _mm256_packs_epi32(scaled(d), scaled(d + 8));
    const __m256i cd = _mm256_packs_epi32(scaled(d + 16), scaled(d + 24));
    const __m256i bytes = _mm256_xor_si256(_mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), lane_fix), sign);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + d), bytes);
  }
  for (; d + 8 <= D; d += 8) {
    const __m256i xi = scaled(d);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(xi), _mm256_extracti128_si256(xi, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(x + d), _mm_xor_si128(_mm_packs_epi16(w, w), _mm256_castsi256_si128(sign)));
  }
  return d;
}
KVCODEC_AVX2_END
#endif

}  // namespace

bool proj8_scale_row(const HeadParams& p, const float* c, float m, float ss, uint8_t* x, float& factor, bool simd) {
  const size_t D = size_t(p.dim), Dp4 = proj8_row_len(D);
#ifndef KVCODEC_PROJ8_SIMD
  simd = false;
#endif
  if (!proj8_row_fits(m, ss, p.derived().proj8_gate_m, p.derived().proj8_gate_ss)) {
    std::fill(x, x + Dp4, uint8_t(128));
    factor = 0.0f;
    return false;
  }
  std::fill(x + D, x + Dp4, uint8_t(128));
  // |c[d] * s| <= 127 up to one rounding: nearbyint gives [-127, 127].
  const float s = proj8_row_scale(m);
  factor = proj8_row_factor(m);
  size_t d = 0;
#ifdef KVCODEC_PROJ8_SIMD
  if (simd) d = scale_row_avx2(c, D, s, x);
#endif
  for (; d < D; ++d) x[d] = uint8_t(int32_t(std::nearbyint(c[d] * s)) + 128);
  return true;
}

void proj8_scale_rows(const HeadParams& p, const float* c, int64_t n, uint8_t* x, float* factor, uint8_t* fits,
                      bool simd) {
  const size_t D = size_t(p.dim), Dp4 = proj8_row_len(D);
#ifndef KVCODEC_PROJ8_SIMD
  simd = false;
#endif
  for (int64_t t = 0; t < n; ++t) {
    const float* row = c + size_t(t) * D;
    float m = 0.0f;
    alignas(32) float lane[8] = {};
    size_t d = 0;
#ifdef KVCODEC_PROJ8_SIMD
    if (simd) d = row_stats_avx2(row, D, m, lane);
#endif
    row_stats_plain(row, D, d, m, lane);
    fits[t] = uint8_t(proj8_scale_row(p, row, m, lane_square_sum(lane), x + size_t(t) * Dp4, factor[t], simd));
  }
}

namespace {

#ifdef KVCODEC_PROJ8_SIMD
KVCODEC_AVX2_BEGIN
// The tiles' store (int8_tiles): proj8_code on the 8 sums of row i from
// component k0, with per component its bias (the VNNI tiles' +128 offset
// taken back; null for the AVX2 tiles), qscale, offset and largest code,
// padded to K8, and per row its factor.
struct StoreCodes {
  const int32_t* bias = nullptr;
  const float* qscale = nullptr;
  const float* offset = nullptr;
  const float* max_code = nullptr;
  const float* factor = nullptr;
  uint16_t* codes = nullptr;
  size_t K = 0;
  const uint32_t* row_of = nullptr;  // the codes' row of each scaled row (null: the same)

  void operator()(size_t i, size_t k0, __m256i acc) const {
    if (k0 >= K) return;
    if (bias) acc = _mm256_add_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + k0)));
    const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(factor[i]));
    __m256 y = _mm256_fmadd_ps(a, _mm256_loadu_ps(qscale + k0), _mm256_loadu_ps(offset + k0));
    y = _mm256_min_ps(_mm256_loadu_ps(max_code + k0), y);
    const __m256i i32 = _mm256_cvttps_epi32(y);
    const __m128i u16 = _mm_packus_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    uint16_t* out = codes + (row_of ? row_of[i] : i) * K + k0;
    if (k0 + 8 <= K) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), u16);
    } else {
      alignas(16) uint16_t tmp[8];  // the row's last, partial group
      _mm_store_si128(reinterpret_cast<__m128i*>(tmp), u16);
      std::memcpy(out, tmp, (K - k0) * sizeof(uint16_t));
    }
  }
};
KVCODEC_AVX2_END
#endif

}  // namespace

void proj8_codes(const HeadParams& p, const uint8_t* x, const float* factor, int64_t n, uint16_t* codes,
                 const uint32_t* row_of, bool plain) {
  const HeadKernels& kern = p.derived();
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim), Dp4 = proj8_row_len(D), dp4 = Dp4 / 4;
  const size_t K8 = round_up8(K), rows = size_t(n);
  thread_local std::vector<float> offset, max_code;
  offset.assign(K8, 0.0f), max_code.assign(K8, 0.0f);
  for (size_t k = 0; k < K; ++k) {
    offset[k] = code_offset(p.quant[k]);
    max_code[k] = float(p.quant[k].levels - 1);
  }
#ifdef KVCODEC_PROJ8_SIMD
  if (!plain && simd_avx2()) {
    // The VNNI tiles multiply x + 128 and take 128 sum_d W8 back (the bias);
    // the AVX2 ones multiply x. Panels up to K8, the blocks proj8_w holds
    // (pad columns are zero weights; the store drops codes from K on).
    const bool vnni = simd_vnni();
    const StoreCodes store{vnni ? kern.proj8_bias.data() : nullptr, kern.proj8_qscale.data(), offset.data(),
                           max_code.data(), factor, codes, K, row_of};
    if (vnni)
      int8_tiles::vnni_products(x, Dp4, kern.proj8_w.data(), dp4 * 32, dp4, rows, K8, store);
    else
      int8_tiles::avx2_products(x, Dp4, kern.proj8_w.data(), dp4 * 32, dp4, rows, K8, store);
    return;
  }
#endif
  (void)plain;
  for (size_t t = 0; t < rows; ++t)
    for (size_t k = 0; k < K; ++k) {
      int32_t acc = 0;
      for (size_t d = 0; d < D; ++d)
        acc += (int32_t(x[t * Dp4 + d]) - 128) * int32_t(kern.proj8_w[proj8_w_index(k, d, dp4)]);
      codes[(row_of ? row_of[t] : t) * K + k] = proj8_code(acc, factor[t], kern.proj8_qscale[k], offset[k], max_code[k]);
    }
}

}  // namespace kvcodec::kvtc

#include "kvtc/recon8.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/cpu_features.hpp"

#ifdef KVCODEC_HAVE_AVX2_PATHS
#include <immintrin.h>
#define KVCODEC_RECON8_SIMD 1
#endif

namespace kvcodec::kvtc {

namespace {

size_t round_up8(size_t v) { return (v + 7) / 8 * 8; }

// round-to-nearest-even of |v| < 2^51 without a libm call: the same double in every build.
inline double round_even(double v) {
  constexpr double kShift = 0x1.8p52;
  return (v + kShift) - kShift;
}

void clear(HeadKernels& out) {
  std::vector<int8_t>().swap(out.recon8_w);
  std::vector<int32_t>().swap(out.recon8_bias2);
  std::vector<float>().swap(out.recon8_scale);
}

// Every operation per element (products of two floats, exact in double;
// maxima; integer sums), so a vectorised build gives the plain one's bits.
inline bool build_impl(const HeadParams& p, HeadKernels& out) {
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim);
  if (!out.recon_int || !out.recon_lut.empty() || K == 0 || K > 16384 || out.recon_zero2.size() != K) return false;
  for (const ComponentQuantizer& q : p.quant)
    if (q.levels > 256) return false;
  const size_t D8 = round_up8(D), kq = recon8_row_len(K) / 4;
  thread_local std::vector<double> unit;
  unit.assign(D, 0.0);
  for (size_t k = 0; k < K; ++k) {
    const double step = p.quant[k].step;
    const float* b = p.basis.data() + k * D;
    for (size_t d = 0; d < D; ++d) unit[d] = std::max(unit[d], std::fabs(step * double(b[d])));
  }
  for (size_t d = 0; d < D; ++d) unit[d] = unit[d] > 0.0 ? 127.0 / unit[d] : 1.0;
  out.recon8_w.assign(D8 / 8 * kq * 32, 0);
  out.recon8_bias2.assign(D8, 0);
  out.recon8_scale.assign(D8, 0.0f);
  for (size_t k = 0; k < K; ++k) {
    const double step = p.quant[k].step;
    const float* b = p.basis.data() + k * D;
    const int32_t zero2 = out.recon_zero2[k];
    int8_t* w = out.recon8_w.data() + recon8_w_index(k, 0, kq);
    for (size_t d = 0; d < D; ++d) {
      const double q = round_even(step * double(b[d]) * unit[d]);  // |q| <= 127
      w[(d / 8) * kq * 32 + (d % 8) * 4] = int8_t(q);
      out.recon8_bias2[d] += zero2 * int32_t(q);
    }
  }
  for (size_t d = 0; d < D; ++d) out.recon8_scale[d] = float(0.5 / unit[d]);
  return true;
}

#ifdef KVCODEC_RECON8_SIMD
// The same build compiled for AVX2 (every call inlined): a cache opening
// its heads per call builds these for every head it decodes.
KVCODEC_TARGET_AVX2 __attribute__((flatten)) bool build_avx2(const HeadParams& p, HeadKernels& out) {
  return build_impl(p, out);
}
#endif

}  // namespace

bool build_recon8(const HeadParams& p, HeadKernels& out, bool plain) {
  bool built = false;
#ifdef KVCODEC_RECON8_SIMD
  if (!plain && simd_avx2())
    built = build_avx2(p, out);
  else
#endif
    built = build_impl(p, out);
  (void)plain;
  if (!built) clear(out);
  return built;
}

bool recon8_ready(const HeadParams& p) {
  const HeadKernels& k = p.derived();
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim), D8 = round_up8(D);
  return k.recon8 && p.mean.size() == D && k.recon8_bias2.size() == D8 && k.recon8_scale.size() == D8 &&
         k.recon8_w.size() == D8 / 8 * (recon8_row_len(K) / 4) * 32;
}

namespace {

// The values' epilogue: x[d] = fma(float(2 (acc + lift[d]) - bias2[d]),
// scale[d], mean[d]) for 8 columns of row i from column d0 (lift: what the
// AVX2 tiles' shifted codes left out, 128 sum_k W8[k][d]; null for VNNI).
struct Epilogue {
  const int32_t* bias2 = nullptr;
  const float* scale = nullptr;
  const float* mean = nullptr;  // [D8], padded
  const int32_t* lift = nullptr;
  float* out = nullptr;
  size_t D = 0;
};

#ifdef KVCODEC_RECON8_SIMD
KVCODEC_AVX2_BEGIN
inline void store_values8(const Epilogue& e, size_t i, size_t d0, __m256i acc) {
  if (d0 >= e.D) return;
  if (e.lift) acc = _mm256_add_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(e.lift + d0)));
  const __m256i a2 = _mm256_sub_epi32(_mm256_add_epi32(acc, acc),
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(e.bias2 + d0)));
  const __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a2), _mm256_loadu_ps(e.scale + d0), _mm256_loadu_ps(e.mean + d0));
  float* o = e.out + i * e.D + d0;
  if (d0 + 8 <= e.D) {
    _mm256_storeu_ps(o, y);
  } else {
    alignas(32) float tmp[8];  // the row's last, partial group
    _mm256_store_ps(tmp, y);
    std::memcpy(o, tmp, (e.D - d0) * sizeof(float));
  }
}

// R rows x NV blocks of 8 columns by vpmaddubsw on the codes less 128 (s8:
// |a| <= 128 times |W8| <= 127, pairs below 2^15) with their sign moved
// onto the weights, then vpmaddwd into int32.
template <int R, int NV>
inline void avx2_tile(const uint8_t* X, size_t ldx, const int8_t* W, size_t block_stride, size_t kq,
                      const Epilogue& e, size_t row, size_t col) {
  __m256i acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1), sign = _mm256_set1_epi8(char(0x80));
  for (size_t j = 0; j < kq; ++j) {
    __m256i w[NV];
    for (int v = 0; v < NV; ++v)
      w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + size_t(v) * block_stride + j * 32));
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, X + size_t(r) * ldx + 4 * j, sizeof quad);
      const __m256i a = _mm256_xor_si256(_mm256_set1_epi32(quad), sign);  // code - 128
      const __m256i abs_a = _mm256_abs_epi8(a);
      for (int v = 0; v < NV; ++v) {
        const __m256i pairs = _mm256_maddubs_epi16(abs_a, _mm256_sign_epi8(w[v], a));
        acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store_values8(e, row + size_t(r), col + 8 * size_t(v), acc[r][v]);
}

template <int NV>
void avx2_panel(const uint8_t* x, size_t ldx, const int8_t* W, size_t block_stride, size_t kq, size_t n,
                const Epilogue& e, size_t col) {
  size_t i = 0;
  for (; i + 4 <= n; i += 4) avx2_tile<4, NV>(x + i * ldx, ldx, W, block_stride, kq, e, i, col);
  for (; i < n; ++i) avx2_tile<1, NV>(x + i * ldx, ldx, W, block_stride, kq, e, i, col);
}
KVCODEC_AVX2_END

KVCODEC_VNNI_BEGIN
// R rows x NV blocks of 8 columns by vpdpbusd on the codes (u8) and W8.
template <int R, int NV>
inline void vnni_tile(const uint8_t* X, size_t ldx, const int8_t* W, size_t block_stride, size_t kq,
                      const Epilogue& e, size_t row, size_t col) {
  __m256i acc[R][NV];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_si256();
#pragma GCC unroll 1
  for (size_t j = 0; j < kq; ++j) {
    __m256i w[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + size_t(v) * block_stride + j * 32));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, X + size_t(r) * ldx + 4 * j, sizeof quad);
      const __m256i a = _mm256_set1_epi32(quad);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc[r][v]) : "v"(a), "v"(w[v]));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store_values8(e, row + size_t(r), col + 8 * size_t(v), acc[r][v]);
}

template <int NV>
void vnni_panel(const uint8_t* x, size_t ldx, const int8_t* W, size_t block_stride, size_t kq, size_t n,
                const Epilogue& e, size_t col) {
  size_t i = 0;
  for (; i + 4 <= n; i += 4) vnni_tile<4, NV>(x + i * ldx, ldx, W, block_stride, kq, e, i, col);
  if (i + 2 <= n) {
    vnni_tile<2, NV>(x + i * ldx, ldx, W, block_stride, kq, e, i, col);
    i += 2;
  }
  for (; i < n; ++i) vnni_tile<1, NV>(x + i * ldx, ldx, W, block_stride, kq, e, i, col);
}
KVCODEC_VNNI_END
#endif

}  // namespace

void recon8_values(const HeadParams& p, const uint16_t* codes, int64_t n, float* out, std::vector<uint8_t>& bytes,
                   bool plain) {
  const HeadKernels& kern = p.derived();
  const size_t K = size_t(p.n_kept()), D = size_t(p.dim), Kp4 = recon8_row_len(K), kq = Kp4 / 4;
  const size_t D8 = round_up8(D), rows = size_t(n);
#ifdef KVCODEC_RECON8_SIMD
  if (!plain && simd_avx2()) {
    bytes.resize(rows * Kp4);
    for (size_t t = 0; t < rows; ++t) {
      const uint16_t* c = codes + t * K;
      uint8_t* b = bytes.data() + t * Kp4;
      for (size_t k = 0; k < K; ++k) b[k] = uint8_t(c[k]);  // < 256: recon8's heads
      std::fill(b + K, b + Kp4, uint8_t(0));
    }
    thread_local std::vector<float> mean;
    thread_local std::vector<int32_t> lift;
    mean.assign(D8, 0.0f);
    std::copy(p.mean.begin(), p.mean.end(), mean.begin());
    Epilogue e{kern.recon8_bias2.data(), kern.recon8_scale.data(), mean.data(), nullptr, out, D};
    const int8_t* w = kern.recon8_w.data();
    const size_t block_stride = kq * 32;
    const auto at = [&](size_t c) { return w + (c / 8) * block_stride; };
    size_t col = 0;
    if (simd_vnni()) {
      for (; col + 32 <= D8; col += 32) vnni_panel<4>(bytes.data(), Kp4, at(col), block_stride, kq, rows, e, col);
      if (col + 16 <= D8) vnni_panel<2>(bytes.data(), Kp4, at(col), block_stride, kq, rows, e, col), col += 16;
      if (col < D8) vnni_panel<1>(bytes.data(), Kp4, at(col), block_stride, kq, rows, e, col);
      return;
    }
    // 128 sum_k W8[k][d]: the part the shifted codes (code - 128) leave out.
    lift.assign(D8, 0);
    for (size_t k = 0; k < K; ++k)
      for (size_t d = 0; d < D; ++d) lift[d] += 128 * int32_t(kern.recon8_w[recon8_w_index(k, d, kq)]);
    e.lift = lift.data();
    for (; col + 16 <= D8; col += 16) avx2_panel<2>(bytes.data(), Kp4, at(col), block_stride, kq, rows, e, col);
    if (col < D8) avx2_panel<1>(bytes.data(), Kp4, at(col), block_stride, kq, rows, e, col);
    return;
  }
#endif
  (void)plain, (void)D8, (void)bytes;
  for (size_t t = 0; t < rows; ++t)
    for (size_t d = 0; d < D; ++d) {
      int32_t acc = 0;
      for (size_t k = 0; k < K; ++k)  // the codes as the tiles' bytes hold them
        acc += int32_t(uint8_t(codes[t * K + k])) * int32_t(kern.recon8_w[recon8_w_index(k, d, kq)]);
      out[t * D + d] = std::fma(float(2 * acc - kern.recon8_bias2[d]), kern.recon8_scale[d], p.mean[d]);
    }
}

}  // namespace kvcodec::kvtc

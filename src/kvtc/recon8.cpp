#include "kvtc/recon8.hpp"

#include "kvtc/int8_tiles.hpp"

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

using int8_tiles::round_even;
using int8_tiles::round_up8;

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

#ifdef KVCODEC_RECON8_SIMD
KVCODEC_AVX2_BEGIN
// The tiles' store (int8_tiles): x[d] = fma(float(2 (acc + lift[d]) -
// bias2[d]), scale[d], mean[d]) for the 8 columns of row i from column d0
// (lift: what the AVX2 tiles' codes less 128 leave out, 128 sum_k
// W8[k][d]; null for the VNNI tiles, which multiply the codes).
struct StoreValues {
  const int32_t* bias2 = nullptr;
  const float* scale = nullptr;
  const float* mean = nullptr;  // [D8], padded
  const int32_t* lift = nullptr;
  float* out = nullptr;
  size_t D = 0;

  void operator()(size_t i, size_t d0, __m256i acc) const {
    if (d0 >= D) return;
    if (lift) acc = _mm256_add_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lift + d0)));
    const __m256i a2 = _mm256_sub_epi32(_mm256_add_epi32(acc, acc),
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias2 + d0)));
    const __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a2), _mm256_loadu_ps(scale + d0), _mm256_loadu_ps(mean + d0));
    float* o = out + i * D + d0;
    if (d0 + 8 <= D) {
      _mm256_storeu_ps(o, y);
    } else {
      alignas(32) float tmp[8];  // the row's last, partial group
      _mm256_store_ps(tmp, y);
      std::memcpy(o, tmp, (D - d0) * sizeof(float));
    }
  }
};
KVCODEC_AVX2_END
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
    StoreValues store{kern.recon8_bias2.data(), kern.recon8_scale.data(), mean.data(), nullptr, out, D};
    const int8_t* w = kern.recon8_w.data();
    if (simd_vnni()) {
      int8_tiles::vnni_products(bytes.data(), Kp4, w, kq * 32, kq, rows, D8, store);
      return;
    }
    // 128 sum_k W8[k][d]: the part the codes less 128 leave out.
    lift.assign(D8, 0);
    for (size_t k = 0; k < K; ++k)
      for (size_t d = 0; d < D; ++d) lift[d] += 128 * int32_t(kern.recon8_w[recon8_w_index(k, d, kq)]);
    store.lift = lift.data();
    int8_tiles::avx2_products(bytes.data(), Kp4, w, kq * 32, kq, rows, D8, store);
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

#include "kvtc/raw_convert.hpp"

#include <cstring>

#include "core/cpu_features.hpp"
#include "kvcodec/error.hpp"

#ifdef KVCODEC_HAVE_AVX2_PATHS
#include <immintrin.h>
#define KVCODEC_RAW_SIMD 1
#endif

namespace kvcodec::kvtc {

namespace {

[[noreturn]] void bad_raw(DType raw) {
  throw Error(ErrorCode::kInvalidArgument, std::string("kvtc raw storage must be f16 or bf16, got ") + dtype_name(raw));
}

// Same arithmetic as core f32_to_bf16 (round to nearest even, NaN kept quiet),
// inline so the loop vectorises.
inline uint16_t bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#ifdef KVCODEC_RAW_SIMD
KVCODEC_AVX2_BEGIN
// The whole chunks of 8 of raw_to_f32's f16 loop by F16C; returns how many
// values it converted.
size_t f16_to_f32_avx2(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  // vcvtph2ps is exact for every finite f16 (subnormals included); only a
  // signalling NaN could differ (the core keeps its payload as is), so a
  // chunk holding any NaN goes through the scalar routine.
  const __m128i exp_mask = _mm_set1_epi16(0x7c00);
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i abs = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
    // abs > 0x7c00 (signed compare is fine: abs <= 0x7fff) means NaN.
    if (_mm_movemask_epi8(_mm_cmpgt_epi16(abs, exp_mask))) {
      for (size_t j = i; j < i + 8; ++j) dst[j] = f16_to_f32(src[j]);
      continue;
    }
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  return i;
}

// The same for f32_to_raw's f16 loop.
size_t f32_to_f16_avx2(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  // vcvtps2ph with round-to-nearest-even gives the core's bits for finite
  // inputs (overflow to Inf, subnormals, ties to even); NaN chunks go scalar.
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
      for (size_t j = i; j < i + 8; ++j) dst[j] = f32_to_f16(src[j]);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  return i;
}

// The same for round_through_raw's f16 loop: both conversions in registers.
size_t round_through_f16_avx2(const float* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
      for (size_t j = i; j < i + 8; ++j) dst[j] = f16_to_f32(f32_to_f16(src[j]));
      continue;
    }
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  }
  return i;
}
KVCODEC_AVX2_END
#endif

}  // namespace

bool raw_convert_has_simd() { return simd_avx2(); }

void raw_to_f32(const uint16_t* src, DType raw, float* dst, size_t n) {
  if (raw == DType::kBF16) {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t u = uint32_t(src[i]) << 16;
      std::memcpy(dst + i, &u, 4);
    }
    return;
  }
  if (raw != DType::kF16) bad_raw(raw);
  size_t i = 0;
#ifdef KVCODEC_RAW_SIMD
  if (simd_avx2()) i = f16_to_f32_avx2(src, dst, n);
#endif
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

void f32_to_raw(const float* src, uint16_t* dst, DType raw, size_t n) {
  if (raw == DType::kBF16) {
    for (size_t i = 0; i < n; ++i) dst[i] = bf16_round(src[i]);
    return;
  }
  if (raw != DType::kF16) bad_raw(raw);
  size_t i = 0;
#ifdef KVCODEC_RAW_SIMD
  if (simd_avx2()) i = f32_to_f16_avx2(src, dst, n);
#endif
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

void round_through_raw(const float* src, DType raw, float* dst, size_t n) {
  if (raw == DType::kBF16) {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t u = uint32_t(bf16_round(src[i])) << 16;
      std::memcpy(dst + i, &u, 4);
    }
    return;
  }
  if (raw != DType::kF16) bad_raw(raw);
  size_t i = 0;
#ifdef KVCODEC_RAW_SIMD
  if (simd_avx2()) i = round_through_f16_avx2(src, dst, n);
#endif
  for (; i < n; ++i) dst[i] = f16_to_f32(f32_to_f16(src[i]));
}

}  // namespace kvcodec::kvtc

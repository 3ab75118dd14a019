// The 8-bit kernels' shared pieces (proj8.cpp, recon8.cpp): the tiles of an
// exact int32 product of u8 rows (values + 128, or codes) by int8 weights in
// blocks of 8 output columns x 4 inner indices, and two exact helpers. Each
// kernel supplies its epilogue as a store(row, column, acc) functor whose
// operator() is compiled for AVX2.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/cpu_features.hpp"

#ifdef KVCODEC_HAVE_AVX2_PATHS
#include <immintrin.h>
#endif

namespace kvcodec::kvtc::int8_tiles {

inline size_t round_up8(size_t v) { return (v + 7) / 8 * 8; }

// round-to-nearest-even of |v| < 2^51 without a libm call (the baseline
// build has no SSE4.1 round): the same double in every build.
inline double round_even(double v) {
  constexpr double kShift = 0x1.8p52;
  return (v + kShift) - kShift;
}

#ifdef KVCODEC_HAVE_AVX2_PATHS
KVCODEC_AVX2_BEGIN
// R rows x NV blocks of 8 columns by vpmaddubsw on the rows less 128 (s8,
// |a| <= 128) with their sign moved onto the weights (|W| <= 127: pairs of
// products below 2^15, no saturation), then vpmaddwd into int32. The sums
// are those of the rows less 128 (the VNNI tiles' less the store's offset).
template <int R, int NV, class Store>
inline void avx2_tile(const uint8_t* X, size_t ldx, const int8_t* W, size_t block_stride, size_t steps,
                      const Store& store, size_t row, size_t col) {
  __m256i acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1), sign = _mm256_set1_epi8(char(0x80));
  for (size_t j = 0; j < steps; ++j) {
    __m256i w[NV];
    for (int v = 0; v < NV; ++v)
      w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + size_t(v) * block_stride + j * 32));
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, X + size_t(r) * ldx + 4 * j, sizeof quad);
      const __m256i a = _mm256_xor_si256(_mm256_set1_epi32(quad), sign);  // the row's bytes less 128
      const __m256i abs_a = _mm256_abs_epi8(a);
      for (int v = 0; v < NV; ++v) {
        const __m256i pairs = _mm256_maddubs_epi16(abs_a, _mm256_sign_epi8(w[v], a));
        acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(row + size_t(r), col + 8 * size_t(v), acc[r][v]);
}

// The n rows x `cols` columns (a multiple of 8, the blocks W holds) by the
// AVX2 tiles: 16 columns at a time, then 8.
template <class Store>
void avx2_products(const uint8_t* x, size_t ldx, const int8_t* W, size_t block_stride, size_t steps, size_t n,
                   size_t cols, const Store& store) {
  const auto panel = [&](auto nv, size_t col) {
    constexpr int NV = decltype(nv)::value;
    const int8_t* w = W + (col / 8) * block_stride;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) avx2_tile<4, NV>(x + i * ldx, ldx, w, block_stride, steps, store, i, col);
    for (; i < n; ++i) avx2_tile<1, NV>(x + i * ldx, ldx, w, block_stride, steps, store, i, col);
  };
  size_t col = 0;
  for (; col + 16 <= cols; col += 16) panel(std::integral_constant<int, 2>{}, col);
  if (col < cols) panel(std::integral_constant<int, 1>{}, col);
}
KVCODEC_AVX2_END

KVCODEC_VNNI_BEGIN
// R rows x NV blocks of 8 columns by vpdpbusd (u8 x s8, 4 products into
// each int32 lane: 32 per instruction) on the u8 rows as they are, each
// row's 4 bytes broadcast from memory (a load, no shuffle port).
// vnni_products runs it for a panel's last 8 columns only (NV = 1); the
// rest goes through vnni_tile_zmm below.
template <int R, int NV, class Store>
inline void vnni_tile(const uint8_t* X, size_t ldx, const int8_t* W, size_t block_stride, size_t steps,
                      const Store& store, size_t row, size_t col) {
  __m256i acc[R][NV];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_si256();
#pragma GCC unroll 1
  for (size_t j = 0; j < steps; ++j) {
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
    for (int v = 0; v < NV; ++v) store(row + size_t(r), col + 8 * size_t(v), acc[r][v]);
}

// vnni_tile on 512-bit registers: NZ vectors of 16 columns (two of W's
// 8-column blocks side by side), each row's 4 bytes broadcast to all 16
// lanes. vpdpbusd on zmm does twice a ymm's products in ~1.3x its time on
// the CPUs measured (docs/kvtc.md "The 8-bit kernels"). The store takes each
// accumulator's halves as the 8-column blocks the ymm tile gives: the same
// exact int32 sums.
template <int R, int NZ, class Store>
inline void vnni_tile_zmm(const uint8_t* X, size_t ldx, const int8_t* W, size_t block_stride, size_t steps,
                          const Store& store, size_t row, size_t col) {
  __m512i acc[R][NZ];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int z = 0; z < NZ; ++z) acc[r][z] = _mm512_setzero_si512();
#pragma GCC unroll 1
  for (size_t j = 0; j < steps; ++j) {
    __m512i w[NZ];
#pragma GCC unroll 4
    for (int z = 0; z < NZ; ++z) {
      // The two blocks' 32 bytes as one zmm. In asm: GCC 12's insert and
      // cast intrinsics pass an "undefined" operand that -Wmaybe-uninitialized
      // reports at every use.
      const int8_t* lo = W + size_t(2 * z) * block_stride + j * 32;
      __asm__("vmovdqu8 %1, %t0\n\tvinserti64x4 $1, %2, %0, %0"
              : "=v"(w[z])
              : "m"(*reinterpret_cast<const int8_t(*)[32]>(lo)),
                "m"(*reinterpret_cast<const int8_t(*)[32]>(lo + block_stride)));
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, X + size_t(r) * ldx + 4 * j, sizeof quad);
      const __m512i a = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
      for (int z = 0; z < NZ; ++z) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc[r][z]) : "v"(a), "v"(w[z]));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int z = 0; z < NZ; ++z) {
      // The halves in asm too (GCC 12's cast is an extract with an
      // "undefined" operand): the low one is the same register, read as ymm.
      __m256i lo, hi;
      __asm__("vmovdqa64 %t1, %0" : "=v"(lo) : "v"(acc[r][z]));
      __asm__("vextracti64x4 $1, %1, %0" : "=v"(hi) : "v"(acc[r][z]));
      store(row + size_t(r), col + 16 * size_t(z), lo);
      store(row + size_t(r), col + 16 * size_t(z) + 8, hi);
    }
}

// The n rows x `cols` columns (a multiple of 8) by the VNNI tiles: 64
// columns at a time on zmm, then 32, then 16, then 8 on ymm; rows 4, then
// 2, then 1 at a time.
template <class Store>
void vnni_products(const uint8_t* x, size_t ldx, const int8_t* W, size_t block_stride, size_t steps, size_t n,
                   size_t cols, const Store& store) {
  const auto panel = [&](auto nz, size_t col) {
    constexpr int NZ = decltype(nz)::value;
    const int8_t* w = W + (col / 8) * block_stride;
    size_t i = 0;
    if constexpr (NZ == 0) {  // one block of 8 columns
      for (; i + 4 <= n; i += 4) vnni_tile<4, 1>(x + i * ldx, ldx, w, block_stride, steps, store, i, col);
      for (; i < n; ++i) vnni_tile<1, 1>(x + i * ldx, ldx, w, block_stride, steps, store, i, col);
    } else {
      for (; i + 4 <= n; i += 4) vnni_tile_zmm<4, NZ>(x + i * ldx, ldx, w, block_stride, steps, store, i, col);
      if (i + 2 <= n) {
        vnni_tile_zmm<2, NZ>(x + i * ldx, ldx, w, block_stride, steps, store, i, col);
        i += 2;
      }
      for (; i < n; ++i) vnni_tile_zmm<1, NZ>(x + i * ldx, ldx, w, block_stride, steps, store, i, col);
    }
  };
  size_t col = 0;
  for (; col + 64 <= cols; col += 64) panel(std::integral_constant<int, 4>{}, col);
  if (col + 32 <= cols) panel(std::integral_constant<int, 2>{}, col), col += 32;
  if (col + 16 <= cols) panel(std::integral_constant<int, 1>{}, col), col += 16;
  if (col < cols) panel(std::integral_constant<int, 0>{}, col);
}
KVCODEC_VNNI_END
#endif

}  // namespace kvcodec::kvtc::int8_tiles

// The 8-bit projection of kvtc's encoder (HeadKernels::proj8): its tables,
// the rows' scaling and the codes, by VNNI tiles, AVX2 tiles or plain loops
// that give the same codes. codec.cpp's quantize_block chooses it; the rows
// it refuses go on to the 16-bit projection there.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvtc/codec.hpp"

namespace kvcodec::kvtc {

// Dp4: D rounded up to 4 (a scaled row's length, the pad 0).
inline size_t proj8_row_len(size_t D) { return (D + 3) / 4 * 4; }

// out's proj8 tables from p (needs out.proj_int and its checks of p);
// false, with them cleared, where D or the basis does not allow them.
// plain: the plain loops (build_reference); the AVX2 build gives the same.
bool build_proj8(const HeadParams& p, HeadKernels& out, bool plain);

// Whether p's 8-bit tables match its shapes (parameters edited after the
// kernels were built take the other paths).
bool proj8_ready(const HeadParams& p);

// The centred rows c [n, D] as x + 128 [n, Dp4] (u8: the VNNI operand,
// loaded by broadcasts; x = nearbyint(c * proj8_row_scale(m)), |x| <= 127)
// with their factors [n] and whether each takes the 8-bit projection
// (fits [n]; a refused row's x is 0, as the pad). simd: the AVX2 loops
// (same values).
void proj8_scale_rows(const HeadParams& p, const float* c, int64_t n, uint8_t* x, float* factor, uint8_t* fits,
                      bool simd);

// One centred row c [D] with its largest |c| m and square sum ss (the
// lanes' tree, as proj8_scale_rows computes them) into x + 128 [Dp4] and
// its factor; whether it takes the 8-bit projection (else x is 0).
bool proj8_scale_row(const HeadParams& p, const float* c, float m, float ss, uint8_t* x, float& factor, bool simd);

// The codes of n scaled rows x + 128 [n, Dp4] with their factors [n], row
// i's into codes' row row_of[i] ([?, K]; row_of null: row i): the VNNI
// tiles where simd_vnni(), the AVX2 ones where simd_avx2(), the plain loops
// otherwise or with plain.
void proj8_codes(const HeadParams& p, const uint8_t* x, const float* factor, int64_t n, uint16_t* codes,
                 const uint32_t* row_of = nullptr, bool plain = false);

}  // namespace kvcodec::kvtc

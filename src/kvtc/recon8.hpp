// The 8-bit reconstruction of kvtc's decoder (HeadKernels::recon8): its
// tables and the rows' values, by VNNI tiles, AVX2 tiles or plain loops that
// give the same bits. codec.cpp's dequantize_block chooses it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvtc/codec.hpp"

namespace kvcodec::kvtc {

// Kp4: K rounded up to 4 (a row of codes as bytes, the pad 0).
inline size_t recon8_row_len(size_t K) { return (K + 3) / 4 * 4; }

// out's recon8 tables from p (needs out.recon_int and its checks of p);
// false, with them cleared, where the head does not allow them (centroids,
// a level count past 256, K past 16384). plain: the plain loops
// (build_reference); the AVX2 build gives the same.
bool build_recon8(const HeadParams& p, HeadKernels& out, bool plain);

// Whether p's 8-bit reconstruction tables match its shapes.
bool recon8_ready(const HeadParams& p);

// out [n, D] from codes [n, K] (every code below its level count: the
// decoders' checks), bytes as scratch: the VNNI tiles where simd_vnni(), the
// AVX2 ones where simd_avx2(), the plain loops otherwise or with plain.
void recon8_values(const HeadParams& p, const uint16_t* codes, int64_t n, float* out, std::vector<uint8_t>& bytes,
                   bool plain = false);

}  // namespace kvcodec::kvtc

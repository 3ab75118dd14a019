// Shared by the kvtc-gpu kernels (kvtc_gpu.cu): launch shapes, the device
// copy of the tables, bf16 / RoPE helpers and the token store.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "gpu/cuda/cuda_check.cuh"
#include "gpu/kvtc_variant.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/gpu.hpp"

namespace kvcodec::gpu {
namespace {

constexpr int kT = KvtcGpuCodec::kBlockTokens;  // tokens per stream
constexpr int kTile = 2 * kT;                    // tokens per projection CTA

// Tokens of the block of up to len tokens starting at t0 of a head's
// `tokens` (a ragged last block holds fewer).
__host__ __device__ __forceinline__ int block_tokens(int64_t tokens, int64_t t0, int len) {
  return tokens - t0 < len ? int(tokens - t0) : len;
}
constexpr int kProjThreads = 256;
constexpr int kRansWarps = 4;
// Decoder guide buckets per component: 2^min(scale, ceil(log2(levels)) + 2,
// kGuideMaxBits), i.e. >= 4 buckets per symbol where the scale allows, so
// the scan after the look-up is usually empty.
constexpr uint32_t kGuideMaxBits = 10;
constexpr int kTilePad = kTile + 4;  // row stride of transposed tiles (16-byte aligned rows)

struct DeviceTables {
  int n_heads, dim, k_pad;
  const int32_t* kept;
  const float* mean;
  const float* basis;
  const float* basis_t;
  const float* basis_frag;   // basis rounded to TF32, in mma B-fragment order (tensor-core reconstruction)
  const float* inv_step;
  const float* code_offset;
  const float* max_code;
  const float* step;
  const float* recon_offset;
  // [NH, k_pad] {cum offset in the head's table, guide offset in the head's
  // guide, sym_base, scale_bits | guide shift << 8}
  const uint4* comp;
  const uint4* sym_enc;       // per symbol {rcp, bias, x_max = freq << (31 - scale), shift | cmpl_freq << 8} (encoder)
  // Decoder, per head, per component, levels + 1 entries: cum[0..levels];
  // with `direct`, spans {cum[s] | freq[s] << 16} (the last entry unused).
  const uint32_t* cum;
  // Every component's guide is its whole slot table (shift 0: guide[slot] is
  // the slot's symbol, kvtc-gpu/4's tables of at most 10 bits) and cum holds
  // spans: a decode step is two look-ups, no scan (kvtc_decode.cuh).
  int direct;
  const uint32_t* head_base;  // [NH + 1] start of each head's entries in cum
  // Decoder guide, per head per component 2^gbits entries (CodeT: u8, or u16
  // with wide codes): guide[j] = the symbol of slot j << shift (shift = scale
  // - gbits), the first candidate for any slot of that bucket.
  const void* guide;
  const uint32_t* guide_base;  // [NH + 1] start of each head's guide (multiples of 16 entries)
  // Calibrated transforms (kvtc_variant.hpp; identity for plain heads).
  const float* scale;          // [NH, D]
  const float* inv_scale;      // [NH, D]
  const uint8_t* rope;         // [NH]
  const float* rope_cos;       // [positions, rope_dim / 2]
  const float* rope_sin;
  const float4* rope_cs;       // [rope_dim / 4, positions + kT] {cos f, cos f + 1, sin f, sin f + 1}, f = 2 i
  int64_t rope_cs_stride;      // positions + kT: each row ends with kT zero entries
  int rope_dim;
  // The integer projection (kvtc_project_int.cuh; heads with proj_int).
  const uint8_t* proj_int;     // [NH]
  const uint4* proj_frag;      // [NH, k_pad / 8, D / 32, 32 lanes] {high bytes b0, b1, low bytes b0, b1}
  const float* proj_qscale;    // [NH, k_pad]
  const float* proj_scale;     // [NH]
  const float* proj_max_abs;   // [NH]
  const float* proj_max_sq;    // [NH]
  // The 8-bit projection (heads with proj8): the rows its gate takes.
  const uint8_t* proj8;        // [NH]
  const uint2* proj8_frag;     // [NH, k_pad / 8, D / 32, 32 lanes] {b0, b1} of W8 (int8)
  const float* proj8_qscale;   // [NH, k_pad]
  const float* proj8_gate_m;   // [NH]
  const float* proj8_gate_ss;  // [NH]
  // The integer reconstruction (kvtc_recon_int.cuh; heads with recon_int).
  const uint8_t* recon_int;    // [NH] 0 none, 1 integer, 2 integer with finite outputs (integer_reconstruction_kinds)
  const uint4* recon_frag;     // [NH, ceil(k_pad / 32), D / 8, 32 lanes] {high bytes b0, b1, low bytes b0, b1}
  const int32_t* recon_z;      // [NH, D]
  const float* recon_scale;    // [NH, D]
  // Per call: each head's rows are seq tokens apart; the coded ones start at
  // row tok0, the sinks before them stay raw. Row r is at position pos0 + r
  // (pos0 = the sequence's first position: 0 for a whole prefix, a block's
  // first token for a block coded on its own).
  int64_t seq, tok0, pos0 = 0;
};

// A shared-memory pointer's 32-bit address in the shared window (what
// ld.shared / cp.async take).
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ float bf16_to_f32_dev(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

__device__ __forceinline__ uint16_t f32_to_bf16_dev(float v) {
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

__device__ __forceinline__ void load_bf16x8(const uint16_t* p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    v[2 * e] = bf16_to_f32_dev(uint16_t(w[e] & 0xffffu));
    v[2 * e + 1] = bf16_to_f32_dev(uint16_t(w[e] >> 16));
  }
}

// Two values as bf16 (lo in the low half) by one hardware round-to-
// nearest-even conversion (cvt.rn.bf16x2.f32, a third of the integer
// rounding's instructions): the same bits as f32_to_bf16_dev except for
// NaN, which becomes the canonical NaN.
__device__ __forceinline__ uint32_t cvt_bf16x2(float lo, float hi) {
  uint32_t w;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  return w;
}

// cvt_bf16x2 with a NaN taking f32_to_bf16_dev's quiet NaN (the
// reference's) instead of the canonical one.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t w = cvt_bf16x2(lo, hi);
  if (lo != lo || hi != hi) w = uint32_t(f32_to_bf16_dev(lo)) | uint32_t(f32_to_bf16_dev(hi)) << 16;
  return w;
}

__device__ __forceinline__ uint4 pack_bf16x8(const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) w[e] = pack_bf16x2(v[2 * e], v[2 * e + 1]);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// A token's dims come in pair groups q < D/16: 8 dims [lo, lo+8) of the
// first half of a RoPE sub-head and their partners [lo+half, lo+half+8).
__device__ __forceinline__ int pair_group_lo(const DeviceTables& tb, int q) {
  const int per = tb.rope_dim / 16;
  return (q / per) * tb.rope_dim + (q % per) * 8;
}

// RoPE on one pair (kvtc_variant.hpp: the op order).
__device__ __forceinline__ void rope_one(float& a, float& b, float c, float s, bool remove) {
  const float a0 = a, b0 = b;
  if (remove) {
    a = __fmaf_rn(a0, c, __fmul_rn(b0, s));
    b = __fmaf_rn(b0, c, -__fmul_rn(a0, s));
  } else {
    a = __fmaf_rn(a0, c, -__fmul_rn(b0, s));
    b = __fmaf_rn(b0, c, __fmul_rn(a0, s));
  }
}

// 8 floats from 16-byte aligned shared (load) or read-only global (ldg) memory.
__device__ __forceinline__ void load_f32x8(const float* p, float (&v)[8]) {
  const float4 x = *reinterpret_cast<const float4*>(p), y = *reinterpret_cast<const float4*>(p + 4);
  v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
}
// The same from shared memory, the upper 16 bytes loaded first when `upper_first`
// (store_tokens: spreads a quarter warp's loads over all 32 banks).
__device__ __forceinline__ void load_f32x8_ordered(const float* p, bool upper_first, float (&v)[8]) {
  const float4 x = *reinterpret_cast<const float4*>(p + (upper_first ? 4 : 0));
  const float4 y = *reinterpret_cast<const float4*>(p + (upper_first ? 0 : 4));
  const float4 a = upper_first ? y : x, b = upper_first ? x : y;
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void ldg_f32x8(const float* p, float (&v)[8]) {
  const float4 x = __ldg(reinterpret_cast<const float4*>(p)), y = __ldg(reinterpret_cast<const float4*>(p + 4));
  v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
}

// RoPE on 8 pairs at `position`, frequencies i0..i0+7 (i0 a multiple of 8:
// the table rows are rope_dim / 2 floats, a multiple of 16, so the 8 cos and
// 8 sin are two 16-byte loads each; scalar loads cost the decode's store
// phase 3x the L1 wavefronts).
__device__ __forceinline__ void rope_pairs(const DeviceTables& tb, int64_t position, int i0, bool remove,
                                           float (&a)[8], float (&b)[8]) {
  const int half = tb.rope_dim / 2;
  float c[8], sn[8];
  ldg_f32x8(tb.rope_cos + size_t(position) * half + i0, c);
  ldg_f32x8(tb.rope_sin + size_t(position) * half + i0, sn);
#pragma unroll
  for (int e = 0; e < 8; ++e) rope_one(a[e], b[e], c[e], sn[e], remove);
}

// acc[i][j] += a[i] * b[j] (fp32 fma, the variant's order) for the 8 values
// a (shared memory) and b (read-only global memory): one step of the 8x8
// register tiles of the exact projection and reconstruction.
__device__ __forceinline__ void fma_tile_8x8(float (&acc)[8][8], const float* a, const float* b) {
  float av[8], bv[8];
  load_f32x8(a, av);
  ldg_f32x8(b, bv);
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = __fmaf_rn(av[i], bv[j], acc[i][j]);
}

// Stores n tokens of head h from fp32 staging os[t * pad + d] (the products,
// before the mean; pad = D + 4 or D + 8) as bf16: + mean, * inv_scale, RoPE
// re-applied on keys of the calibrated format at position pos0 + tok0 +
// t_first + t, 16-byte stores. Tokens with skip(t) are left untouched. Item v is one
// pair group q of token t, ordered so that the 8 lanes of each quarter warp
// (whose 16-byte shared loads are served together) take pair groups q..q+3
// of two consecutive tokens: 8 distinct 4-bank groups, no conflict (one
// token's q and q + 4 hit the same banks). With pad = D + 8 (rows 8 banks
// apart) odd tokens load the upper half of their 8 floats first for that.
// A thread's pair group and token parity are the same in every round (the
// CTA's threads are a multiple of 2 QP), so its dims and RoPE frequencies are
// found once, before the loop over its tokens (they were re-derived per
// item, with a division by rope_dim).
template <int D, typename Skip>
__device__ __forceinline__ void store_tokens(const DeviceTables& tb, int h, const float* os, int pad, int n,
                                             int64_t t_first, uint16_t* __restrict__ yh, Skip skip) {
  constexpr int QP = D / 16;  // pair groups per token
  static_assert(kProjThreads % (2 * QP) == 0, "a thread keeps its pair group");
  const bool rope = tb.rope[h] != 0;
  const int half = tb.rope_dim / 2;
  const int r = int(threadIdx.x) % (2 * QP);
  const int parity = (r / 4) & 1, q = r % 4 + 4 * (r / 8);
  const int lo = pair_group_lo(tb, q), hi = lo + half, freq0 = lo % tb.rope_dim;
  const bool upper_first = pad % 32 == 8 && parity;
  const float* mean = tb.mean + size_t(h) * D;
  const float* isc = tb.inv_scale + size_t(h) * D;
  const int64_t pos = tb.pos0 + tb.tok0 + t_first;
  for (int t = 2 * (int(threadIdx.x) / (2 * QP)) + parity; t < n; t += 2 * (int(blockDim.x) / (2 * QP))) {
    if (skip(t)) continue;
    float a[8], b[8];
    load_f32x8_ordered(os + t * pad + lo, upper_first, a);
    load_f32x8_ordered(os + t * pad + hi, upper_first, b);
    // Loaded per token, not held: 32 more live registers spill here.
    float ml[8], mh[8], sl[8], sh[8];
    ldg_f32x8(mean + lo, ml);
    ldg_f32x8(mean + hi, mh);
    ldg_f32x8(isc + lo, sl);
    ldg_f32x8(isc + hi, sh);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      a[e] = __fmul_rn(__fadd_rn(a[e], ml[e]), sl[e]);
      b[e] = __fmul_rn(__fadd_rn(b[e], mh[e]), sh[e]);
    }
    if (rope) rope_pairs(tb, pos + t, freq0, /*remove=*/false, a, b);
    __stcs(reinterpret_cast<uint4*>(yh + size_t(t) * D + lo), pack_bf16x8(a));
    __stcs(reinterpret_cast<uint4*>(yh + size_t(t) * D + hi), pack_bf16x8(b));
  }
}

// c = a . b + c over one m16n8k32 tile, A signed / unsigned bytes (AU), B
// likewise (BU); with kAccumulate false, c = a . b (a zero C operand: a
// tile's first k-step needs no cleared accumulators). One asm template: C's
// operand text and the accumulators' constraint are its only parameters.
template <bool AU, bool BU, bool kAccumulate = true>
__device__ __forceinline__ void imma(uint32_t (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#define KVCODEC_IMMA(TA, TB, C, OUT, ...)                                                                   \
  asm("mma.sync.aligned.m16n8k32.row.col.s32." TA "." TB ".s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " C \
      ";"                                                                                                   \
      : OUT(c[0]), OUT(c[1]), OUT(c[2]), OUT(c[3])                                                          \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1)__VA_ARGS__)
#define KVCODEC_IMMA_ACC(TA, TB) KVCODEC_IMMA(TA, TB, "{%0,%1,%2,%3}", "+r")
#define KVCODEC_IMMA_ZERO(TA, TB) KVCODEC_IMMA(TA, TB, "{%10,%10,%10,%10}", "=r", , "r"(0u))
#define KVCODEC_IMMA_KINDS(M)                  \
  if constexpr (!AU && !BU) M("s8", "s8");     \
  else if constexpr (!AU && BU) M("s8", "u8"); \
  else if constexpr (AU && !BU) M("u8", "s8"); \
  else M("u8", "u8")
  if constexpr (kAccumulate) {
    KVCODEC_IMMA_KINDS(KVCODEC_IMMA_ACC);
  } else {
    KVCODEC_IMMA_KINDS(KVCODEC_IMMA_ZERO);
  }
#undef KVCODEC_IMMA_KINDS
#undef KVCODEC_IMMA_ZERO
#undef KVCODEC_IMMA_ACC
#undef KVCODEC_IMMA
}

// The float projection's code of coefficient acc of component q: the
// reference's floor(fma) and clamp (fmax first: a NaN lands on code 0).
template <typename CodeT>
__device__ __forceinline__ CodeT float_code(const DeviceTables& tb, float acc, size_t q) {
  const float v = floorf(__fmaf_rn(acc, tb.inv_step[q], tb.code_offset[q]));
  return CodeT(fminf(fmaxf(v, 0.0f), tb.max_code[q]));
}

// Code slot of token t, component k in a tile's staging (component-major per stream).
__device__ __forceinline__ int code_slot(int t, int k, int KP) { return (t / kT) * (kT * KP) + k * kT + (t % kT); }

// A tile's streams are consecutive code slots of kT * KP codes each (a
// multiple of 16 bytes): both copied out as 16-byte words.
template <typename CodeT>
__device__ __forceinline__ void store_code_slots(const CodeT* cs, int n, int KP, CodeT* __restrict__ dst_codes) {
  const int n_streams = n > kT ? 2 : 1;
  const int words = int((size_t(n_streams) * kT * KP * sizeof(CodeT)) / 16);
  uint4* dst = reinterpret_cast<uint4*>(dst_codes);
  const uint4* src = reinterpret_cast<const uint4*>(cs);
  for (int v = threadIdx.x; v < words; v += blockDim.x) dst[v] = src[v];
}

// Thread g of a tiled [128 tokens, 8*C columns] product: warp g/32 covers
// token groups 8*(w%2)..+7 and column groups 4*(w/2)..+3, lane l takes token
// group l%8 and column group l/8 of those.
__device__ __forceinline__ void warp_tile(int g, int& tg, int& cg) {
  const int w = g / 32, l = g % 32;
  tg = (w % 2) * 8 + (l % 8);
  cg = (w / 2) * 4 + (l / 8);
}

}  // namespace
}  // namespace kvcodec::gpu

// The integer projections of the kvtc-gpu encoder (kvtc_variant.hpp,
// "8-bit" and "integer"): the CPU codec's, their products exact on the
// tensor cores.
//
// Why integers: an fp32 projection is 2 FLOP per (token, dim, component) on
// the CUDA cores (project_kernel: 30% of the H200's fp32 peak, most of the
// encode's time), and tensor cores cannot reproduce an fp32 order bit for
// bit. Integer products can. The 8-bit projection (calibrated heads, the
// rows its gate takes: every row of the shared KV dump) is one s8 x s8
// mma.sync m16n8k32 per tile of 16 tokens x 8 components x 32 dims. The
// 16-bit one splits v = 256 hi + lo (hi the signed high byte, lo the
// unsigned low byte) for both operands,
//   x . w = 2^16 (xh . wh) + 2^8 (xh . wl + xl . wh) + xl . wl,
// four s8/u8 MMAs per tile, each sum exact in int32 (|partial| < 2^23 for
// D <= 128), combined modulo 2^32: the exact sum, since a fitting row keeps
// it below 2^31. So the codes are the CPU codec's, whatever the order.
//
// project_int_kernel: CTA of 256 threads per (head, tile of 128 tokens = two
// streams), as project_kernel.
//   0. The tile's bf16 rows into shared memory [128][D + 8] (16-byte
//      loads; rows 4 banks apart: conflict-free accesses below).
//   1. Four threads per token, thread e holding the dim pairs (2e, 2e + 1)
//      + 8j (the CPU's square-sum lanes 2e and 2e + 1, each summed in its
//      order; a RoPE pair (i, i + rope_dim/2) lies in one thread since
//      rope_dim/2 is a multiple of 8): RoPE removed -> * scale - mean -> the
//      gates -> written over the row's bf16 in place: int8 x8 (the 8-bit
//      gate took it; its factor m / 127 beside) or else int16 x. A row that
//      fits neither (rare: longer than the quantizers' cells reach, or not
//      finite) gets the float projection's codes right there, its values
//      shuffled within the 4 threads in the reference's order d = 0..D-1.
//   2. Warp w: tokens [16w, 16w + 16) x every component group, the 8-bit
//      pass where the warp has 8-bit rows, the 16-bit pass where it has
//      16-bit ones; the x fragments for all of D stay in registers, the
//      weights come pre-split in fragment order (proj8_frag / proj_frag).
//      Codes staged component-major as project_kernel.
#pragma once

#include "gpu/cuda/kvtc_device.cuh"

namespace kvcodec::gpu {
namespace {

constexpr int kXiPad = 8;  // int16 pad of a scaled row

// Thread e's dim pairs (2e + 8j, 2e + 1 + 8j), j < D/8, of one token
// (xrow: the token's bf16 pairs in shared memory) into c[0][j], c[1][j]:
// RoPE removed at `position` (H8 = rope_dim / 16: groups j and j + H8 of
// each sub-head of 2 H8 groups pair up), then * scale - mean (scale_mean:
// the head's {scale, mean} per dim pair), the reference's ops.
template <int D, int H8>
__device__ __forceinline__ void centre_token(const DeviceTables& tb, const uint32_t* xrow, const float4* scale_mean,
                                             int64_t position, bool rope, int e, float (&c)[2][D / 8]) {
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const uint32_t w = xrow[e + 4 * j];
    c[0][j] = __uint_as_float(w << 16);
    c[1][j] = __uint_as_float(w & 0xffff0000u);
  }
  if constexpr (16 * H8 <= D) {
    if (rope) {
      const float2* cs = reinterpret_cast<const float2*>(tb.rope_cos + size_t(position) * (8 * H8));
      const float2* sn = reinterpret_cast<const float2*>(tb.rope_sin + size_t(position) * (8 * H8));
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        if (j % (2 * H8) < H8) {
          const float2 co = __ldg(cs + e + 4 * (j % (2 * H8))), si = __ldg(sn + e + 4 * (j % (2 * H8)));
          rope_one(c[0][j], c[0][j + H8], co.x, si.x, /*remove=*/true);
          rope_one(c[1][j], c[1][j + H8], co.y, si.y, /*remove=*/true);
        }
    }
  }
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const float4 sm = scale_mean[e + 4 * j];  // {scale 2e', scale 2e'+1, mean 2e', mean 2e'+1}
    c[0][j] = __fsub_rn(__fmul_rn(c[0][j], sm.x), sm.z);
    c[1][j] = __fsub_rn(__fmul_rn(c[1][j], sm.y), sm.w);
  }
}

// 4 CTAs per SM (64 registers; at D = 128 ptxas spills 44 bytes): with the
// 8-bit pass's 16 A registers in place of the 16-bit pass's 32 the kernel
// is still latency-bound between its phases, and one more CTA per SM took
// the projection from 1.182 to 1.051 ms (H100, the calibrated bench batch,
// session 39).
template <int D, typename CodeT>
__global__ void __launch_bounds__(kProjThreads, 4) project_int_kernel(DeviceTables tb, const uint16_t* __restrict__ x,
                                                                   int64_t tokens, int64_t nb, int64_t tiles_per_head,
                                                                   int head0, CodeT* __restrict__ codes) {
  constexpr int XS = D + kXiPad;
  extern __shared__ __align__(16) unsigned char smem[];
  // The tile's bf16 rows, then in place their int16 scaled values.
  int16_t* xi = reinterpret_cast<int16_t*>(smem);                       // [kTile][XS]
  float4* scale_mean = reinterpret_cast<float4*>(xi + kTile * XS);       // [D / 2]
  float* factor8 = reinterpret_cast<float*>(scale_mean + D / 2);        // [kTile] m / 127 of 8-bit rows
  CodeT* cs = reinterpret_cast<CodeT*>(factor8 + kTile);                // [2][kT * KP]
  const int h = head0 + int(blockIdx.x / tiles_per_head);
  const int K = tb.kept[h];
  const int KP = tb.k_pad;
  if (K == 0 || !tb.proj_int[h]) return;  // project_kernel codes these heads
  uint8_t* fit = reinterpret_cast<uint8_t*>(cs + 2 * kT * KP);  // [kTile]
  const int64_t tile = blockIdx.x % tiles_per_head;
  const int64_t t0 = tile * kTile;
  const int n = block_tokens(tokens, t0, kTile);
  const bool rope = tb.rope[h] != 0;
  const uint16_t* xh = x + (size_t(h) * size_t(tb.seq) + size_t(tb.tok0 + t0)) * D;
  const int lane = threadIdx.x % 32, e = lane % 4, base = lane - e;
  const float ps = tb.proj_scale[h];
  const bool eight_bit = tb.proj8[h] != 0;
  const float gate_m = tb.proj8_gate_m[h], gate_ss = tb.proj8_gate_ss[h];

  // 0. The tile (n contiguous rows) into shared memory, 16 bytes a load;
  // rows past n zero.
  for (int v = threadIdx.x; v < kTile * (D / 8); v += kProjThreads) {
    const int t = v / (D / 8), c8 = v % (D / 8);
    const uint4 w = t < n ? __ldg(reinterpret_cast<const uint4*>(xh + size_t(t) * D) + c8) : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(xi + t * XS + c8 * 8) = w;
  }
  for (int i = threadIdx.x; i < D / 2; i += kProjThreads) {
    const float* sc = tb.scale + size_t(h) * D + 2 * i;
    const float* mn = tb.mean + size_t(h) * D + 2 * i;
    scale_mean[i] = make_float4(sc[0], sc[1], mn[0], mn[1]);
  }
  __syncthreads();

  // 1. Four threads per token, thread e holding the dim pairs (2e, 2e + 1)
  // + 8j: the CPU's square-sum lanes 2e and 2e + 1, each summed in its
  // order. Centre, check and scale the rows in place.
  for (int t = threadIdx.x / 4; t < kTile; t += kProjThreads / 4) {
    uint32_t* row = reinterpret_cast<uint32_t*>(xi + t * XS);
    float c[2][D / 8];
    const int64_t position = tb.pos0 + tb.tok0 + t0 + t;
    switch (tb.rope_dim) {
      case 32: centre_token<D, 2>(tb, row, scale_mean, position, rope && t < n, e, c); break;
      case 64: centre_token<D, 4>(tb, row, scale_mean, position, rope && t < n, e, c); break;
      default: centre_token<D, 8>(tb, row, scale_mean, position, rope && t < n, e, c); break;
    }
    float m = 0.0f, sq0 = 0.0f, sq1 = 0.0f;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      m = fmaxf(m, fmaxf(fabsf(c[0][j]), fabsf(c[1][j])));
      sq0 = __fmaf_rn(c[0][j], c[0][j], sq0);
      sq1 = __fmaf_rn(c[1][j], c[1][j], sq1);
    }
    float l[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      l[2 * i] = __shfl_sync(0xffffffffu, sq0, base + i);
      l[2 * i + 1] = __shfl_sync(0xffffffffu, sq1, base + i);
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const float ss = __fadd_rn(__fadd_rn(__fadd_rn(l[0], l[4]), __fadd_rn(l[1], l[5])),
                               __fadd_rn(__fadd_rn(l[2], l[6]), __fadd_rn(l[3], l[7])));
    // rint(c * s) as the low bits of c * s + 1.5 * 2^23 (round to nearest
    // even, exact while |c * s| < 2^22; a taken row's are <= 127 or 32767):
    // two full-rate adds and one byte permute per pair, where
    // __float2int_rn is a quarter-rate conversion per value.
    constexpr float kRound = 12582912.0f;
    // The 8-bit projection's gate (proj8_row_fits, op by op).
    const bool eight = eight_bit && fabsf(ss) < INFINITY &&
                       __fadd_rn(__fmul_rn(__fmul_rn(m, m), gate_m), __fmul_rn(ss, gate_ss)) <= 1.0f;
    bool fits = true;
    if (eight) {
      // x8 = rint(c * 127 / m) as int8 in the row's first D bytes (dims
      // 2e + 8j, 2e + 1 + 8j: one 16-bit store per pair).
      const float s8 = m > 0.0f ? __fdiv_rn(127.0f, m) : 0.0f;
      uint16_t* row8 = reinterpret_cast<uint16_t*>(row);
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const uint32_t lo = __float_as_uint(__fadd_rn(__fmul_rn(c[0][j], s8), kRound));
        const uint32_t hi = __float_as_uint(__fadd_rn(__fmul_rn(c[1][j], s8), kRound));
        row8[e + 4 * j] = uint16_t(__byte_perm(lo, hi, 0x0040));
      }
      if (e == 0) {
        factor8[t] = __fdiv_rn(m, 127.0f);
        fit[t] = 2;
      }
    } else {
      fits = fabsf(ss) < INFINITY && __fmul_rn(m, ps) <= tb.proj_max_abs[h] &&
             __fmul_rn(ss, __fmul_rn(ps, ps)) <= tb.proj_max_sq[h];
      if (e == 0) fit[t] = fits ? 1 : 0;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const uint32_t lo = __float_as_uint(__fadd_rn(__fmul_rn(c[0][j], ps), kRound));
        const uint32_t hi = __float_as_uint(__fadd_rn(__fmul_rn(c[1][j], ps), kRound));
        row[e + 4 * j] = fits ? __byte_perm(lo, hi, 0x5410) : 0u;
      }
    }
    if (__any_sync(0xffffffffu, t < n && !fits)) {
      // The float projection (the reference's order) for the rows that do
      // not fit; every lane steps (the shuffles), lane e takes k = e mod 4.
      for (int k0 = 0; k0 < K; k0 += 4) {
        const int k = k0 + e;  // < KP; rows past K are zero
        const float* b = tb.basis + (size_t(h) * KP + k) * D;
        float acc = 0.0f;
#pragma unroll
        for (int d = 0; d < D; ++d)
          acc = __fmaf_rn(__shfl_sync(0xffffffffu, c[d % 2][d / 8], base + (d % 8) / 2), __ldg(b + d), acc);
        if (t < n && !fits && k < K) {
          cs[code_slot(t, k, KP)] = float_code<CodeT>(tb, acc, size_t(h) * KP + k);
        }
      }
    }
  }
  __syncthreads();

  // 2. Products on the tensor cores, codes into the staging: the 8-bit
  // pass for the warp's rows the gate took, the 16-bit one for the others
  // (each only where the warp has such rows).
  const int m0 = (threadIdx.x / 32) * 16;
  const int g = lane / 4, q4 = lane % 4;
  // The thread's two tokens (rows g and g + 8 of the warp's 16) are the
  // same in every group: their paths and code slots are found once, and
  // each group's two components' quantizers come in one 8-byte load each.
  const int ta = m0 + g, tb8 = ta + 8;
  const int path[2] = {ta < n ? fit[ta] : 0, tb8 < n ? fit[tb8] : 0};  // 2: 8-bit, 1: 16-bit, 0: done
  const int slot[2] = {code_slot(ta, 0, KP), code_slot(tb8, 0, KP)};
  const float* off = tb.code_offset + size_t(h) * KP;
  const float* mx = tb.max_code + size_t(h) * KP;
  const int groups = (K + 7) / 8;
  if (m0 < n && __any_sync(0xffffffffu, path[0] == 2 || path[1] == 2)) {
    uint32_t a[D / 32][4];
#pragma unroll
    for (int ks = 0; ks < D / 32; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = m0 + g + (r & 1) * 8, col = ks * 32 + (r >> 1) * 16 + q4 * 4;
        a[ks][r] = *reinterpret_cast<const uint32_t*>(reinterpret_cast<const uint8_t*>(xi + row * XS) + col);
      }
    const uint2* wf = tb.proj8_frag + size_t(h) * (KP / 8) * (D / 32) * 32 + lane;
    const float* qs = tb.proj8_qscale + size_t(h) * KP;
    const float factor[2] = {factor8[ta], factor8[tb8]};
    for (int ng = 0; ng < groups; ++ng) {
      // Two accumulators (independent chains of D/64 steps), added: exact.
      const uint2* w = wf + size_t(ng) * (D / 32) * 32;
      uint32_t c0[4], c1[4];
#pragma unroll
      for (int ks = 0; ks < D / 32; ++ks) {
        const uint2 b = __ldg(w + ks * 32);
        if (ks == 0) imma<false, false, false>(c0, a[ks], b.x, b.y);
        else if (ks == 1) imma<false, false, false>(c1, a[ks], b.x, b.y);
        else if (ks % 2 == 0) imma<false, false>(c0, a[ks], b.x, b.y);
        else imma<false, false>(c1, a[ks], b.x, b.y);
      }
      const int k0 = ng * 8 + q4 * 2;
      if (k0 >= K) continue;
      const float2 q2 = __ldg(reinterpret_cast<const float2*>(qs + k0));
      const float2 o2 = __ldg(reinterpret_cast<const float2*>(off + k0));
      const float2 x2 = __ldg(reinterpret_cast<const float2*>(mx + k0));
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = r >> 1, k = k0 + (r & 1);
        if (path[i] != 2 || k >= K) continue;
        // proj8_code: fma(float(acc) * factor, qscale, offset), min, truncation.
        const int32_t acc = int32_t(c0[r] + c1[r]);
        const float y = __fmaf_rn(__fmul_rn(float(acc), factor[i]), r & 1 ? q2.y : q2.x, r & 1 ? o2.y : o2.x);
        const float top = r & 1 ? x2.y : x2.x, v = top < y ? top : y;
        cs[slot[i] + k * kT] = v >= 0.0f ? CodeT(__float2int_rz(v)) : CodeT(0);
      }
    }
  }
  if (m0 < n && __any_sync(0xffffffffu, path[0] == 1 || path[1] == 1)) {
    uint32_t ah[D / 32][4], al[D / 32][4];
#pragma unroll
    for (int ks = 0; ks < D / 32; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = m0 + g + (r & 1) * 8, col = ks * 32 + (r >> 1) * 16 + q4 * 4;
        const uint2 w = *reinterpret_cast<const uint2*>(xi + row * XS + col);
        al[ks][r] = __byte_perm(w.x, w.y, 0x6420);  // low bytes of the four int16
        ah[ks][r] = __byte_perm(w.x, w.y, 0x7531);  // high bytes
      }
    const uint4* wf = tb.proj_frag + size_t(h) * (KP / 8) * (D / 32) * 32 + lane;
    const float* qs = tb.proj_qscale + size_t(h) * KP;
    const bool ok[2] = {path[0] == 1, path[1] == 1};
    for (int ng = 0; ng < groups; ++ng) {
      // Four accumulators (independent chains of D/32 steps: the m16n8k32
      // latency, not its throughput, bounds a chain).
      const uint4* w = wf + size_t(ng) * (D / 32) * 32;
      uint32_t hh[4] = {}, hl[4] = {}, lh[4] = {}, ll[4] = {};
#pragma unroll
      for (int ks = 0; ks < D / 32; ++ks) {
        const uint4 b = __ldg(w + ks * 32);  // {high b0, b1, low b0, b1}
        imma<false, false>(hh, ah[ks], b.x, b.y);
        imma<false, true>(hl, ah[ks], b.z, b.w);
        imma<true, false>(lh, al[ks], b.x, b.y);
        imma<true, true>(ll, al[ks], b.z, b.w);
      }
      const int k0 = ng * 8 + q4 * 2;  // even: its pair (k0, k0 + 1) is 8-byte aligned
      if (k0 >= K) continue;
      const float2 q2 = __ldg(reinterpret_cast<const float2*>(qs + k0));
      const float2 o2 = __ldg(reinterpret_cast<const float2*>(off + k0));
      const float2 x2 = __ldg(reinterpret_cast<const float2*>(mx + k0));
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = r >> 1, k = k0 + (r & 1);  // token row g + 8 i, component k
        if (!ok[i] || k >= K) continue;
        const int32_t acc = int32_t((hh[r] << 16) + ((hl[r] + lh[r]) << 8) + ll[r]);
        const float y = fminf(r & 1 ? x2.y : x2.x, __fmaf_rn(float(acc), r & 1 ? q2.y : q2.x, r & 1 ? o2.y : o2.x));
        cs[slot[i] + k * kT] = y >= 0.0f ? CodeT(__float2int_rz(y)) : CodeT(0);
      }
    }
  }
  __syncthreads();
  store_code_slots(cs, n, KP, codes + size_t(int64_t(h) * nb + tile * 2) * kT * KP);
}

// Dynamic shared memory of project_int_kernel.
inline size_t project_int_smem(int dim, int k_pad, size_t code_bytes) {
  return size_t(kTile) * size_t(dim + kXiPad) * 2 + size_t(dim) / 2 * 16 + size_t(kTile) * 4 +
         2 * size_t(kT) * size_t(k_pad) * code_bytes + size_t(kTile);
}

}  // namespace
}  // namespace kvcodec::gpu

// The integer reconstruction of the kvtc-gpu decoder
// (set_reconstruction(kInteger); kvtc_variant.hpp, FlatKvtcTables::recon_int):
// the CPU codec's default dequantize_block, its products exact on the
// tensor cores, so GPU and CPU give the same floats before the weights and
// RoPE (which both then apply in the same fp32 ops).
//
// Why integers: the CPU codec reconstructs x[d] = fmaf(float(acc[d]),
// recon_scale[d], mean[d]) with acc[d] = sum_k (2 code_k - zero2_k) W[k][d]
// exact in int32 (W: int16 weights). Written as 2 sum_k code_k W[k][d] -
// Z[d] (Z[d] = sum_k zero2_k W[k][d], a per-column constant), the u8 codes
// are an MMA operand as they are, with no dequantisation instruction at all
// (the TF32 path spends most of its time turning codes into floats), and
// with W = 256 hi + lo (hi the signed high byte, lo the unsigned low byte)
// the sum is two u8 x s8 / u8 x u8 mma.sync m16n8k32 per tile of 16 tokens
// x 8 dims x 32 components, each exact in int32 (|partial| < 2^22 for
// K <= 128), combined modulo 2^32: the exact sum, since the CPU codec's
// tables keep it below 2^31. Half the MMAs of TF32 (k = 32, not 8).
//
// reconstruct_int_kernel: one stream (64 tokens) per CTA of 256 threads.
//   1. Stage: component k's 64 codes (a row of the stream's code slots)
//      into shared row k (kIntCodeStride bytes), each 32-token half's bytes
//      reordered (two 4 x 4 byte transposes) so that 32-bit word g holds
//      tokens g, g + 8, g + 16, g + 24: one word is then a thread's tokens
//      of both 16-token tiles of its half. Rows K .. 32 ceil(K / 32) are 0.
//   2. Warp w: tokens [32 (w % 2), + 32) x dims [(w / 2) D / 4, + D / 4).
//      Per 32 components a thread loads 8 words (4 components x 2 halves
//      of the k-step) and one 4 x 4 byte transpose per 4 words gives its A
//      registers of both tiles, for every k-step (KS <= 4, a template
//      parameter) before any product, so the codes' memory is free after.
//   3. Per 8-dim tile: B from recon_frag (one 16-byte load per k-step,
//      {high b0, b1, low b0, b1}), the hi and lo sums over all k-steps,
//      acc = 2 (256 hi + lo) - Z, x = fmaf(float(acc), recon_scale, mean)
//      into the fp32 staging [kT][D + 8] (reusing the codes' memory); then
//      store_tokens (* inv_scale, RoPE, bf16) with the mean already added.
//      One tile's accumulators live at a time (16 registers, not 64), so
//      4 CTAs fit an SM (2 before: 1.24 -> 1.00 ms with 3, 0.87 with 4
//      at D = 128, the calibrated bench batch, H100).
// A head without the integer tables (recon_int 0) takes the TF32 path in
// the same CTA (tc_reconstruct_stream), u16 codes the TF32 kernel.
#pragma once

#include <type_traits>

#include "gpu/cuda/kvtc_decode.cuh"
#include "gpu/cuda/kvtc_device.cuh"

namespace kvcodec::gpu {
namespace {

// o[j] = byte j of w0, w1, w2, w3 (byte i of o[j] from w_i): a 4 x 4 byte
// transpose in 8 byte permutes.
__device__ __forceinline__ void transpose_bytes_4x4(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3,
                                                    uint32_t (&o)[4]) {
  const uint32_t t0 = __byte_perm(w0, w1, 0x5140), t1 = __byte_perm(w0, w1, 0x7362);
  const uint32_t t2 = __byte_perm(w2, w3, 0x5140), t3 = __byte_perm(w2, w3, 0x7362);
  o[0] = __byte_perm(t0, t2, 0x5410);
  o[1] = __byte_perm(t0, t2, 0x7632);
  o[2] = __byte_perm(t1, t3, 0x5410);
  o[3] = __byte_perm(t1, t3, 0x7632);
}

// 1. A stream's codes (global, [K][kT]) into the staged rows of smem, each
// half's tokens reordered; rows K .. 32 KS are 0.
template <int KS>
__device__ __forceinline__ void stage_int_codes(int K, const uint8_t* cs, unsigned char* smem) {
  for (int j = threadIdx.x; j < KS * 64; j += blockDim.x) {
    const int k = j / 2, half = j % 2;
    uint32_t w[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (k < K) {
      const uint4* src = reinterpret_cast<const uint4*>(cs + size_t(k) * kT + half * 32);
      const uint4 a = __ldcs(src), b = __ldcs(src + 1);  // read once: do not keep in L2
      w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
    }
    uint32_t lo[4], hi[4];
    transpose_bytes_4x4(w[0], w[2], w[4], w[6], lo);  // words g = 0..3: tokens g + 8 i
    transpose_bytes_4x4(w[1], w[3], w[5], w[7], hi);  // words g = 4..7
    uint2* dst = reinterpret_cast<uint2*>(smem + k * kIntCodeStride + half * 32);
    dst[0] = make_uint2(lo[0], lo[1]);
    dst[1] = make_uint2(lo[2], lo[3]);
    dst[2] = make_uint2(hi[0], hi[1]);
    dst[3] = make_uint2(hi[2], hi[3]);
  }
  __syncthreads();
}

// 2-3. KS = ceil(K / 32) k-steps (a template parameter: the A fragments of
// all of them sit in registers). One stream's reconstruction from its staged codes (codes) by the
// CTA's 8 warps, the fp32 output staged in os_mem (may be codes: the codes
// are in registers before it is written).
template <int D, int KS>
__device__ __forceinline__ void int_reconstruct_staged(const DeviceTables& tb, int h, const unsigned char* codes,
                                                       unsigned char* os_mem, int n, int64_t t0,
                                                       uint16_t* __restrict__ y) {
  constexpr int WN = 4;           // warps along the dims
  constexpr int NT = D / 8 / WN;  // 8-dim tiles per warp
  constexpr int kOutPad = D + 8;  // as tc_reconstruct_stream: conflict-free 64-bit stores
  const int KSP = (tb.k_pad + 31) / 32;

  // 2. A fragments of every k-step into registers (KS <= D / 32: at most 32
  // registers), then the codes' memory becomes the output staging.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int wm = warp % 2, wn = warp / 2;
  uint32_t a[KS][2][4];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
#pragma unroll
    for (int c2 = 0; c2 < 2; ++c2) {
      // A of tile mt, register r = hr + 2 c2: row g + 8 hr (token 16 mt + g +
      // 8 hr of the half), components ks 32 + 16 c2 + 4 q + i in byte i.
      const unsigned char* r = codes + wm * 32 + 4 * g + (ks * 32 + c2 * 16 + 4 * q) * kIntCodeStride;
      uint32_t o[4];
      transpose_bytes_4x4(*reinterpret_cast<const uint32_t*>(r), *reinterpret_cast<const uint32_t*>(r + kIntCodeStride),
                          *reinterpret_cast<const uint32_t*>(r + 2 * kIntCodeStride),
                          *reinterpret_cast<const uint32_t*>(r + 3 * kIntCodeStride), o);
      a[ks][0][2 * c2] = o[0];      // token g
      a[ks][0][2 * c2 + 1] = o[1];  // token g + 8
      a[ks][1][2 * c2] = o[2];      // token g + 16
      a[ks][1][2 * c2 + 1] = o[3];  // token g + 24
    }
  __syncthreads();

  // 3. Per 8-dim tile: the hi and lo byte sums over every k-step (the
  // first with a zero C operand), then acc = 2 (256 hi + lo) - Z modulo 2^32
  // and the CPU codec's x = fmaf(float(acc), recon_scale, mean) into the
  // fp32 staging [kT][D + 8]. One tile's 16 accumulators live at a time (all
  // tiles' 64 held the kernel to 2 CTAs per SM).
  float* os = reinterpret_cast<float*>(os_mem);
  const size_t hd = size_t(h) * D;
  const uint4* bsrc = tb.recon_frag + (size_t(h) * KSP * (D / 8) + size_t(wn) * NT) * 32 + lane;
#pragma unroll 1
  for (int t = 0; t < NT; ++t) {
    uint32_t ch[2][4], cl[2][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const uint4 b = __ldg(bsrc + (ks * (D / 8) + t) * 32);
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        if (ks == 0) {
          imma<true, false, false>(ch[m], a[ks][m], b.x, b.y);
          imma<true, true, false>(cl[m], a[ks][m], b.z, b.w);
        } else {
          imma<true, false>(ch[m], a[ks][m], b.x, b.y);
          imma<true, true>(cl[m], a[ks][m], b.z, b.w);
        }
      }
    }
    const int d = wn * (D / WN) + t * 8 + 2 * q;
    const int2 z = __ldg(reinterpret_cast<const int2*>(tb.recon_z + hd + d));
    const float2 sc = __ldg(reinterpret_cast<const float2*>(tb.recon_scale + hd + d));
    const float2 mu = __ldg(reinterpret_cast<const float2*>(tb.mean + hd + d));
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int row = wm * 32 + m * 16 + g + 8 * hr;
        const uint32_t acc0 = (ch[m][2 * hr] << 9) + (cl[m][2 * hr] << 1) - uint32_t(z.x);
        const uint32_t acc1 = (ch[m][2 * hr + 1] << 9) + (cl[m][2 * hr + 1] << 1) - uint32_t(z.y);
        *reinterpret_cast<float2*>(os + row * kOutPad + d) = make_float2(
            __fmaf_rn(__int2float_rn(int32_t(acc0)), sc.x, mu.x), __fmaf_rn(__int2float_rn(int32_t(acc1)), sc.y, mu.y));
      }
  }
  __syncthreads();
  uint16_t* yh = y + (size_t(h) * size_t(tb.seq) + size_t(tb.tok0 + t0)) * D;
  store_tokens<D, /*kMeanAdded=*/true>(tb, h, os, kOutPad, n, t0, yh, [](int) { return false; });
}

// f(std::integral_constant<int, KS>{}) for the K components' k-steps KS =
// ceil(K / 32): K <= k_pad <= D, so at most D / 32 (a zero-K head codes
// nothing: one k-step of zero codes gives its -Z, as none would).
template <int D, typename F>
__device__ __forceinline__ void with_k_steps(int K, F&& f) {
  const int ks = (K + 31) / 32;
  if (ks <= 1) {
    f(std::integral_constant<int, 1>{});
  } else if (ks == 2) {
    f(std::integral_constant<int, 2>{});
  } else if constexpr (D >= 128) {
    if (ks == 3)
      f(std::integral_constant<int, 3>{});
    else
      f(std::integral_constant<int, 4>{});
  }
}

// One stream per CTA, 4 CTAs per SM (64 registers). At D = 128 that spills
// 40 bytes (the A registers of 4 k-steps) and is still faster than 3 CTAs
// with none: the kernel is latency-bound, shared-memory round trips between
// its phases (0.973 -> 0.865 ms on the calibrated bench batch, H100,
// session 38). With all 64 accumulators of a thread live it ran 2 CTAs per
// SM (0.51 warps issued per scheduler per cycle, ncu, H100).
template <int D>
__global__ void __launch_bounds__(kProjThreads, 4) reconstruct_int_kernel(DeviceTables tb, const uint8_t* __restrict__ codes,
                                                                       const uint8_t* __restrict__ bad, int64_t tokens,
                                                                       int64_t nb, int head0, uint16_t* __restrict__ y) {
  extern __shared__ __align__(16) unsigned char smem[];
  const CtaStream s = cta_stream(tokens, nb, head0);
  if (bad[s.stream]) return;  // tokens of a malformed stream are left untouched
  const uint8_t* cs = codes + size_t(s.stream) * kT * tb.k_pad;
  if (!tb.recon_int[s.h]) {  // uniform over the CTA
    tc_reconstruct_stream<D, uint8_t>(tb, s.h, cs, s.n, s.t0, y, reinterpret_cast<float*>(smem));
    return;
  }
  const int K = tb.kept[s.h];
  with_k_steps<D>(K, [&](auto ks) {
    stage_int_codes<decltype(ks)::value>(K, cs, smem);
    int_reconstruct_staged<D, decltype(ks)::value>(tb, s.h, smem, smem, s.n, s.t0, y);
  });
}

// The fused integer decode (set_fused_decode(true) with kInteger, every
// head on the integer tables and u8 codes): a CTA takes kFusedStreams
// consecutive streams of one head. Each warp rANS-decodes its stream
// straight into the staged rows of its slot of shared memory (no global
// round trip of the codes, no staging pass); then the CTA's 8 warps
// reconstruct the streams one after the other as reconstruct_int_kernel
// does, into a separate fp32 staging. Rows K .. 32 KS of a slot are not
// cleared: the weights of those rows are 0 (recon_w), so whatever bytes
// sit there add exactly nothing to the int32 sums. Tokens past n of a
// ragged stream are computed from stale bytes and not stored.
// Shared memory: tables | kFusedStreams code slots | fp32 staging.
template <int D>
__global__ void __launch_bounds__(kProjThreads, 2) decode_int_fused_kernel(
    DeviceTables tb, const uint8_t* __restrict__ in, uint64_t in_size, const uint64_t* __restrict__ offsets,
    int64_t tokens, int64_t nb, int head0, int64_t groups_per_head, int tables_in_smem, uint32_t table_bytes,
    uint32_t slot_bytes, uint8_t* __restrict__ bad, int* __restrict__ err, uint16_t* __restrict__ y) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int ok[kFusedStreams];
  const int h = head0 + int(blockIdx.x / groups_per_head);
  const int w = threadIdx.x / 32;
  const int64_t blk0 = (blockIdx.x % groups_per_head) * kFusedStreams;
  const uint32_t* cum;
  const uint8_t* guide;
  head_tables(tb, h, tables_in_smem, reinterpret_cast<uint32_t*>(smem), cum, guide);
  unsigned char* slots = smem + table_bytes;
  unsigned char* os_mem = slots + size_t(kFusedStreams) * slot_bytes;
  const int64_t blk = blk0 + w;
  if (blk < nb) {
    const int64_t stream = int64_t(h) * nb + blk, t0 = blk * kT;
    const int n = tokens - t0 < kT ? int(tokens - t0) : kT;
    uint8_t* cs = slots + size_t(w) * slot_bytes;
    const uint64_t start = offsets[stream], end = offsets[stream + 1];
    const bool any = rans_decode_any_stream<uint8_t, false, true>(tb, h, cum, guide, in, in_size, start, end, n, cs);
    if (threadIdx.x % 32 == 0) {
      flag_stream(stream, any, bad, err);
      ok[w] = any ? 0 : 1;
    }
  } else if (threadIdx.x % 32 == 0) {
    ok[w] = 0;
  }
  __syncthreads();
  const int K = tb.kept[h];
  for (int i = 0; i < kFusedStreams; ++i) {
    if (!ok[i]) continue;  // uniform over the CTA; a malformed stream's tokens are left untouched
    const int64_t t0 = (blk0 + i) * kT;
    const int n = tokens - t0 < kT ? int(tokens - t0) : kT;
    const unsigned char* cs = slots + size_t(i) * slot_bytes;
    with_k_steps<D>(K, [&](auto ks) { int_reconstruct_staged<D, decltype(ks)::value>(tb, h, cs, os_mem, n, t0, y); });
    __syncthreads();  // the staging is free for the next stream
  }
}

// Shared memory of decode_int_fused_kernel past the tables: kFusedStreams
// code slots of int_slot_bytes, then the fp32 staging.
size_t int_slot_bytes(int k_pad) { return size_t((k_pad + 31) / 32 * 32) * kIntCodeStride; }
size_t int_fused_smem(size_t table_bytes, int k_pad, int dim) {
  return table_bytes + kFusedStreams * int_slot_bytes(k_pad) + size_t(kT) * size_t(dim + 8) * 4;
}

// Shared memory of reconstruct_int_kernel: the staged codes, then (reused)
// the fp32 output; at least tc_reconstruct_stream's for the heads without
// the integer tables.
size_t int_smem_bytes(int k_pad, int dim) {
  return std::max(size_t((k_pad + 31) / 32 * 32) * kIntCodeStride, tc_smem_bytes(k_pad, dim));
}

}  // namespace
}  // namespace kvcodec::gpu

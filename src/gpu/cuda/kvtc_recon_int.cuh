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
// The kernels, 8 warps, a CTA per kIntStreams consecutive streams of one
// head (the split path) or per kFusedStreams (the fused one):
//   - Codes come as "code words" (kvtc_decode.cuh: word (j, t) holds
//     components 4j .. 4j + 3 of token t), so a thread's A register is one
//     32-bit shared load, with no byte transposes: the rANS decode writes
//     them (to global memory, or straight into shared memory when fused);
//     the split kernel copies a stream's rows into shared memory with
//     cp.async, the next stream's while this one's products run.
//   - Warp w owns one RoPE pair of 8-dim tiles (dims [8 a, + 8) and their
//     partners half a sub-head up) and D / 32 of the stream's 16-token
//     m-tiles; the B fragments of its tiles for every k-step sit in its
//     registers for all the CTA's streams (the head's weights: 32 KB at
//     D = 128, which the previous layout, 2 x 4 warps per stream, read
//     twice per stream through L1).
//   - Per m-tile: the hi and lo byte sums over every k-step, then in
//     registers acc = 2 (256 hi + lo) - Z modulo 2^32, x = fmaf(float(acc),
//     recon_scale, mean) (the CPU codec's), * inv_scale, RoPE with both
//     dims of each pair in the thread's registers (cos and sin from
//     DeviceTables::rope_cs, one 16-byte load per token row), bf16 into a
//     [kT][D + 8] staging; the CTA then writes whole rows, 16 bytes a
//     thread. The previous kernel staged fp32 products and re-read them for
//     the weights and RoPE (store_tokens): about twice the shared-memory
//     wavefronts and instructions per output.
// A head without the integer tables (recon_int 0) takes the TF32 path in
// the same CTA (tc_reconstruct_stream), u16 codes the TF32 kernel.
#pragma once

#include <type_traits>

#include "gpu/cuda/kvtc_decode.cuh"
#include "gpu/cuda/kvtc_device.cuh"

namespace kvcodec::gpu {
namespace {
constexpr int kIntStreams = 16;  // consecutive streams of one head per CTA of reconstruct_int_kernel (8: 2% slower, H100)

// Bytes of one stream's staged code words: ceil(k_pad / 32) k-steps of 8
// rows of kT words (rows past ceil(K / 4) are never written: their weights
// are 0, so whatever sits there adds nothing to the int32 sums).
__host__ __device__ inline size_t int_slot_bytes(int k_pad) { return size_t((k_pad + 31) / 32) * 8 * kT * 4; }
// The bf16 output staging [kT][D + 8] (rows 4 banks apart: a warp's 32-bit
// stores, rows g and columns 2 q of a tile, hit 32 distinct banks).
__host__ __device__ inline size_t int_out_bytes(int dim) { return size_t(kT) * size_t(dim + 8) * 2; }

// One 16-byte cp.async (L2 only: the codes are read once).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem_dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// A warp's share of a head's reconstruction, loaded once per CTA: its RoPE
// pair of 8-dim tiles (tile a, dims [8 a, + 8), and a + rope_dim / 16), the
// B fragments of both for every k-step, and this lane's column constants.
// 8 warps = D / 16 pairs x 128 / D token groups of D / 32 m-tiles.
template <int D, int KS>
struct IntReconWarp {
  static constexpr int kPairs = D / 16, kMTiles = D / 32;
  uint4 b[2][KS];  // {high b0, b1, low b0, b1} (recon_frag)
  int2 nz[2];      // -Z of this lane's two columns per tile (negated once here, not per product)
  float2 sc[2], mu[2], isc[2];
  int col0;    // this lane's first column in tile a (in tile a + rope_dim / 16: + rope_dim / 2)
  int cs_row;  // its RoPE frequencies' row of rope_cs: (col0 % rope_dim) / 2

  // This lane's first column in tile a of this warp's pair (its partner:
  // tile a + rope_dim / 16).
  static __device__ __forceinline__ int first_col(const DeviceTables& tb) {
    const int p = int(threadIdx.x) / 32 % kPairs, per = tb.rope_dim / 16;  // pairs per RoPE sub-head
    return ((p / per) * (tb.rope_dim / 8) + p % per) * 8 + 2 * (int(threadIdx.x) % 4);
  }
  static __device__ __forceinline__ int first_m_tile() { return int(threadIdx.x) / 32 / kPairs * kMTiles; }

  __device__ __forceinline__ void load(const DeviceTables& tb, int h) {
    const int lane = int(threadIdx.x) % 32;
    const int ksp = (tb.k_pad + 31) / 32;
    const uint4* frag = tb.recon_frag + size_t(h) * ksp * (D / 8) * 32 + lane;
    col0 = first_col(tb);
    cs_row = tb.rope[h] ? (col0 % tb.rope_dim) / 2 : 0;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = col0 + i * (tb.rope_dim / 2), tile = c / 8;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) b[i][ks] = __ldg(frag + (ks * (D / 8) + tile) * 32);
      const size_t hc = size_t(h) * D + c;
      const int2 z = __ldg(reinterpret_cast<const int2*>(tb.recon_z + hc));
      nz[i] = make_int2(int(0u - uint32_t(z.x)), int(0u - uint32_t(z.y)));
      sc[i] = __ldg(reinterpret_cast<const float2*>(tb.recon_scale + hc));
      mu[i] = __ldg(reinterpret_cast<const float2*>(tb.mean + hc));
      isc[i] = __ldg(reinterpret_cast<const float2*>(tb.inv_scale + hc));
    }
  }
};

// The CPU codec's x = fmaf(float(acc), recon_scale, mean) with acc = 2 (256
// hi + lo) - Z modulo 2^32, then * inv_scale (kvtc_variant.hpp's order).
__device__ __forceinline__ float int_output(uint32_t hi, uint32_t lo, int nz, float sc, float mu, float isc) {
  const uint32_t acc = (hi << 9) + (lo << 1) + uint32_t(nz);
  return __fmul_rn(__fmaf_rn(__int2float_rn(int32_t(acc)), sc, mu), isc);
}

// Two outputs to bf16 (round to nearest even). kFinite: the head's outputs
// are finite by construction (recon_int == 2: the host bounded its tables,
// kvtc_gpu.cu), so the conversion alone equals f32_to_bf16_rne; otherwise
// a NaN takes the CPU's quiet-NaN rule (pack_bf16x2's branch: 4
// instructions a pair, 16 of the ~150 per m-tile, ncu).
template <bool kFinite>
__device__ __forceinline__ uint32_t int_pack(float lo, float hi) {
  if constexpr (kFinite)
    return cvt_bf16x2(lo, hi);
  else
    return pack_bf16x2(lo, hi);
}

// This warp's cos and sin for m-tile mi of a stream whose first token sits
// at position pos: {cos f, cos f + 1, sin f, sin f + 1} of tokens 16 m + g
// and + 8 (rows past the stream's tokens read the zero pad at the end of
// rope_cs's rows).
template <int D, int KS>
__device__ __forceinline__ void load_rope_rows(const DeviceTables& tb, const IntReconWarp<D, KS>& wv, int64_t pos,
                                               int mi, float4 (&rc)[2]) {
  const int g = int(threadIdx.x) % 32 / 4, m = IntReconWarp<D, KS>::first_m_tile() + mi;
  const float4* cs = tb.rope_cs + size_t(wv.cs_row) * size_t(tb.rope_cs_stride) + size_t(pos) + g + m * 16;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) rc[hr] = __ldg(cs + 8 * hr);
}

// One stream's products by the CTA's 8 warps: its code words (shared,
// kSwizzledWords) -> bf16 rows in out ([kT][D + 8], shared); rows past
// the stream's tokens (a ragged last stream) hold garbage, never stored
// (their RoPE reads the zero pad at the end of rope_cs's rows). pos: the
// position of the stream's first token (RoPE on keys, kRope). rc_first:
// null (the fused kernel: each m-tile's cos and sin are requested just
// before its products), or the first m-tile's, which the caller requested
// before its barrier (the split kernel: the barrier's wait hides their
// latency), and each later m-tile's are then requested one m-tile ahead
// (H100: reconstruction 0.649 -> 0.639 ms; in the fused kernel the early
// first request made ptxas spill 24 bytes, so it keeps the plain order).
// The m-tiles are unrolled, so their code-word addresses fold into
// immediates. No barrier inside: the caller syncs before and after.
template <int D, int KS, bool kRope, bool kFinite>
__device__ __forceinline__ void int_reconstruct_words(const DeviceTables& tb, const IntReconWarp<D, KS>& wv,
                                                      const uint32_t* words, uint16_t* out, int64_t pos,
                                                      const float4* rc_first) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, q = lane % 4;
  using W = IntReconWarp<D, KS>;
  float4 rc_next[2];
#pragma unroll
  for (int mi = 0; mi < W::kMTiles; ++mi) {
    const int m = W::first_m_tile() + mi;
    // This m-tile's cos and sin, requested before its products, which then
    // hide their latency (loaded after them, the RoPE multiplies waiting on
    // these loads were the kernel's largest stall, ncu, H100).
    float4 rc[2];
    if constexpr (kRope) {
      if (!rc_first) {
        load_rope_rows(tb, wv, pos, mi, rc);
      } else {
        rc[0] = mi == 0 ? rc_first[0] : rc_next[0];
        rc[1] = mi == 0 ? rc_first[1] : rc_next[1];
        if (mi + 1 < W::kMTiles) load_rope_rows(tb, wv, pos, mi + 1, rc_next);
      }
    }
    uint32_t ch[2][4], cl[2][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      // A register r: token 16 m + g + 8 (r % 2), components 32 ks + 16 (r / 2) + 4 q + i in byte i.
      uint32_t a[4];
#pragma unroll
      for (int r = 0; r < 4; ++r)
        a[r] = words[code_word_index<kSwizzledWords>(ks * 8 + (r / 2) * 4 + q, m * 16 + g + 8 * (r % 2))];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (ks == 0) {
          imma<true, false, false>(ch[i], a, wv.b[i][ks].x, wv.b[i][ks].y);
          imma<true, true, false>(cl[i], a, wv.b[i][ks].z, wv.b[i][ks].w);
        } else {
          imma<true, false>(ch[i], a, wv.b[i][ks].x, wv.b[i][ks].y);
          imma<true, true>(cl[i], a, wv.b[i][ks].z, wv.b[i][ks].w);
        }
      }
    }
    // C register e of a tile: token 16 m + g + 8 (e / 2), column col + e % 2.
    float v[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        v[i][e] = e % 2 ? int_output(ch[i][e], cl[i][e], wv.nz[i].y, wv.sc[i].y, wv.mu[i].y, wv.isc[i].y)
                        : int_output(ch[i][e], cl[i][e], wv.nz[i].x, wv.sc[i].x, wv.mu[i].x, wv.isc[i].x);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int t = m * 16 + g + 8 * hr;
      if constexpr (kRope) {
        rope_one(v[0][2 * hr], v[1][2 * hr], rc[hr].x, rc[hr].z, /*remove=*/false);
        rope_one(v[0][2 * hr + 1], v[1][2 * hr + 1], rc[hr].y, rc[hr].w, /*remove=*/false);
      }
      uint16_t* at = out + t * (D + 8) + wv.col0;
      *reinterpret_cast<uint32_t*>(at) = int_pack<kFinite>(v[0][2 * hr], v[0][2 * hr + 1]);
      *reinterpret_cast<uint32_t*>(at + tb.rope_dim / 2) = int_pack<kFinite>(v[1][2 * hr], v[1][2 * hr + 1]);
    }
  }
}

// The staged rows [0, n) of out to the head's tokens t0 .. (16-byte
// stores). Thread i always takes chunk i % (D / 8) of rows i / (D / 8) +
// a multiple of kRows: no division per store; a full stream unrolled.
template <int D>
__device__ __forceinline__ void store_int_rows(const DeviceTables& tb, int h, const uint16_t* out, int n, int64_t t0,
                                               uint16_t* __restrict__ y) {
  constexpr int kChunks = D / 8, kRows = kProjThreads / kChunks;
  static_assert(kT % kRows == 0, "whole passes over a full stream");
  const int k = int(threadIdx.x) % kChunks, r0 = int(threadIdx.x) / kChunks;
  uint16_t* yh = y + (size_t(h) * size_t(tb.seq) + size_t(tb.tok0 + t0) + size_t(r0)) * D + k * 8;
  const uint16_t* src = out + r0 * (D + 8) + k * 8;
  if (n == kT) {
#pragma unroll
    for (int i = 0; i < kT / kRows; ++i)
      __stcs(reinterpret_cast<uint4*>(yh + size_t(i) * kRows * D),
             *reinterpret_cast<const uint4*>(src + i * kRows * (D + 8)));
  } else {
    for (int i = 0; r0 + i * kRows < n; ++i)
      __stcs(reinterpret_cast<uint4*>(yh + size_t(i) * kRows * D),
             *reinterpret_cast<const uint4*>(src + i * kRows * (D + 8)));
  }
}

// f(kRope, kFinite) as compile-time constants for head h (a value head
// issues no RoPE instruction at all: predicated off they still cost issue
// slots).
template <typename F>
__device__ __forceinline__ void with_head_kind(const DeviceTables& tb, int h, F&& f) {
  const bool rope = tb.rope[h] != 0, finite = tb.recon_int[h] == 2;
  if (rope) {
    if (finite)
      f(std::true_type{}, std::true_type{});
    else
      f(std::true_type{}, std::false_type{});
  } else {
    if (finite)
      f(std::false_type{}, std::true_type{});
    else
      f(std::false_type{}, std::false_type{});
  }
}

// f(std::integral_constant<int, KS>{}) for the K components' k-steps KS =
// ceil(K / 32): K <= k_pad <= D, so at most D / 32 (a zero-K head codes
// nothing: one k-step of zero weights gives its -Z, as none would).
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

// A stream's code words (global, kCodeWords: rows j < ceil(K / 4) of kT
// words) into a shared slot (kSwizzledWords), 16 bytes per cp.async: a
// 4-token group stays contiguous under the swizzle (it flips token bits 3
// and 4 only).
__device__ __forceinline__ void stage_code_words(int K, const uint8_t* cs, uint32_t* slot) {
  const unsigned chunks = unsigned(K + 3) / 4 * (kT / 4);
  for (unsigned c = threadIdx.x; c < chunks; c += kProjThreads) {
    const int j = int(c / (kT / 4)), t = int(4 * (c % (kT / 4)));
    cp_async16(slot + code_word_index<kSwizzledWords>(j, t), cs + (size_t(j) * kT + t) * 4);
  }
  cp_async_commit();  // every thread commits a group, empty or not
}

// Split path: kIntStreams consecutive streams of one head per CTA of 256
// threads, 2 CTAs per SM: with 128 registers the m-tiles unroll without
// spilling (the B fragments take up to 32; at 3 CTAs per SM, 80 registers,
// the rolled loop ran 0.76 ms on the calibrated bench, H100, this one 0.67).
// Shared memory: two code slots (stream i + 1's copy runs during stream
// i's products) | two bf16 output stagings (stream i - 1's stores run
// beside stream i's products); or, for a head without the integer tables,
// tc_reconstruct_stream's.
template <int D>
__global__ void __launch_bounds__(kProjThreads, 2) reconstruct_int_kernel(DeviceTables tb, const uint8_t* __restrict__ codes,
                                                                       const uint8_t* __restrict__ bad, int64_t tokens,
                                                                       int64_t nb, int head0, int64_t groups_per_head,
                                                                       uint16_t* __restrict__ y) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int h = head0 + int(blockIdx.x / groups_per_head);
  const int64_t blk0 = (blockIdx.x % groups_per_head) * kIntStreams;
  const int count = int(nb - blk0 < kIntStreams ? nb - blk0 : kIntStreams);
  // (Written out, not block_tokens: that changes this kernel's PTX, and the change is untested on a GPU.)
  const auto stream_n = [&](int i) { return tokens - (blk0 + i) * kT < kT ? int(tokens - (blk0 + i) * kT) : kT; };
  const auto stream_codes = [&](int i) { return codes + size_t(int64_t(h) * nb + blk0 + i) * kT * tb.k_pad; };
  if (!tb.recon_int[h]) {  // uniform over the CTA
    for (int i = 0; i < count; ++i) {
      if (bad[int64_t(h) * nb + blk0 + i]) continue;  // tokens of a malformed stream are left untouched
      tc_reconstruct_stream<D, uint8_t>(tb, h, stream_codes(i), stream_n(i), (blk0 + i) * kT, y,
                                        reinterpret_cast<float*>(smem));
      __syncthreads();  // the staging is free for the next stream
    }
    return;
  }
  const int K = tb.kept[h];
  const size_t slot_bytes = int_slot_bytes(tb.k_pad), out_bytes = int_out_bytes(D);
  const auto out = [&](int i) { return reinterpret_cast<uint16_t*>(smem + 2 * slot_bytes + (i % 2) * out_bytes); };
  // Bit i: stream i decoded (a malformed stream's tokens are left
  // untouched): every flag in one load per lane, not a load per stream
  // (H100: reconstruction 0.639 -> 0.626 ms).
  static_assert(kIntStreams <= 32, "a lane per stream");
  const int lane = int(threadIdx.x) % 32;
  const uint32_t ok_mask = __ballot_sync(~0u, lane < count && !bad[int64_t(h) * nb + blk0 + lane]);
  with_k_steps<D>(K, [&](auto ks) {
    IntReconWarp<D, decltype(ks)::value> wv;
    wv.load(tb, h);
    const auto slot = [&](int i) { return reinterpret_cast<uint32_t*>(smem + (i % 2) * slot_bytes); };
    stage_code_words(K, stream_codes(0), slot(0));
    // One barrier per stream: stream i's products go to staging i % 2 while
    // stream i - 1's rows are stored from the other, and stream i + 1's
    // codes are copied (issued past the barrier, where every warp is done
    // with stream i - 1's slot). A second barrier per stream (products,
    // sync, store, sync) stalled the warps for 7% of the samples (ncu).
    with_head_kind(tb, h, [&](auto rope, auto finite) {
      bool prev_ok = false;
      for (int i = 0; i < count; ++i) {
        const int64_t pos = tb.pos0 + tb.tok0 + (blk0 + i) * kT;
        const bool ok = (ok_mask >> i) & 1u;
        float4 rc_first[2];
        if constexpr (decltype(rope)::value) load_rope_rows(tb, wv, pos, 0, rc_first);
        cp_async_wait<0>();  // stream i's copy (this thread's)
        __syncthreads();     // everyone's: stream i's codes; stream i - 1's products; slot i + 1 free
        if (i + 1 < count) stage_code_words(K, stream_codes(i + 1), slot(i + 1));
        if (prev_ok) store_int_rows<D>(tb, h, out(i - 1), stream_n(i - 1), (blk0 + i - 1) * kT, y);
        if (ok)
          int_reconstruct_words<D, decltype(ks)::value, decltype(rope)::value, decltype(finite)::value>(
              tb, wv, slot(i), out(i), pos, rc_first);
        prev_ok = ok;
      }
      __syncthreads();
      if (prev_ok) store_int_rows<D>(tb, h, out(count - 1), stream_n(count - 1), (blk0 + count - 1) * kT, y);
    });
  });
}

// The fused integer decode (set_fused_decode(true) with kInteger, every
// head on the integer tables and u8 codes): a CTA takes kFusedStreams
// consecutive streams of one head. Each warp rANS-decodes its stream
// straight into its slot of shared memory as code words (no global round
// trip of the codes, no copy); then the CTA's 8 warps reconstruct the
// streams one after the other as reconstruct_int_kernel does.
// Shared memory: tables | kFusedStreams code slots | bf16 output staging.
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
  uint16_t* out = reinterpret_cast<uint16_t*>(slots + size_t(kFusedStreams) * slot_bytes);
  const int64_t blk = blk0 + w;
  if (blk < nb) {
    const int64_t stream = int64_t(h) * nb + blk, t0 = blk * kT;
    const int n = block_tokens(tokens, t0, kT);
    uint8_t* cs = slots + size_t(w) * slot_bytes;
    const uint64_t start = offsets[stream], end = offsets[stream + 1];
    const bool any = with_direct_tables(tb, [&](auto direct) {
      return rans_decode_any_stream<uint8_t, false, kSwizzledWords, decltype(direct)::value>(tb, h, cum, guide, in,
                                                                                            in_size, start, end, n, cs);
    });
    if (threadIdx.x % 32 == 0) {
      flag_stream(stream, any, bad, err);
      ok[w] = any ? 0 : 1;
    }
  } else if (threadIdx.x % 32 == 0) {
    ok[w] = 0;
  }
  __syncthreads();
  with_k_steps<D>(tb.kept[h], [&](auto ks) {
    IntReconWarp<D, decltype(ks)::value> wv;
    wv.load(tb, h);
    with_head_kind(tb, h, [&](auto rope, auto finite) {
      for (int i = 0; i < kFusedStreams; ++i) {
        if (!ok[i]) continue;  // uniform over the CTA; a malformed stream's tokens are left untouched
        const int64_t t0 = (blk0 + i) * kT;
        const int n = block_tokens(tokens, t0, kT);
        int_reconstruct_words<D, decltype(ks)::value, decltype(rope)::value, decltype(finite)::value>(
            tb, wv, reinterpret_cast<const uint32_t*>(slots + size_t(i) * slot_bytes), out, tb.pos0 + tb.tok0 + t0,
            nullptr);
        __syncthreads();
        store_int_rows<D>(tb, h, out, n, t0, y);
        __syncthreads();  // the staging is free for the next stream
      }
    });
  });
}

// Shared memory of decode_int_fused_kernel past the tables.
size_t int_fused_smem(size_t table_bytes, int k_pad, int dim) {
  return table_bytes + kFusedStreams * int_slot_bytes(k_pad) + int_out_bytes(dim);
}

// Shared memory of reconstruct_int_kernel: two code slots and two output
// stagings, at least tc_reconstruct_stream's for the heads without the
// integer tables.
size_t int_smem_bytes(int k_pad, int dim) {
  return std::max(2 * int_slot_bytes(k_pad) + 2 * int_out_bytes(dim), tc_smem_bytes(k_pad, dim));
}
}  // namespace
}  // namespace kvcodec::gpu

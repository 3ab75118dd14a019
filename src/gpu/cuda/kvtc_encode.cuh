// Encode kernels of kvtc-gpu (design: the header of kvtc_gpu.cu).
#pragma once

#include "gpu/cuda/kvtc_device.cuh"

namespace kvcodec::gpu {
namespace {

// ---------------------------------------------------------------- encode ---

template <int D, typename CodeT>
__global__ void __launch_bounds__(kProjThreads, 2) project_kernel(DeviceTables tb, const uint16_t* __restrict__ x,
                                                               int64_t tokens, int64_t nb, int64_t tiles_per_head,
                                                               int head0, CodeT* __restrict__ codes) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* xs = reinterpret_cast<float*>(smem);                 // [D][kTilePad], xs[d][t]
  CodeT* cs = reinterpret_cast<CodeT*>(xs + D * kTilePad);    // [2][kT * KP] per stream, token-major
  const int h = head0 + int(blockIdx.x / tiles_per_head);
  const int64_t tile = blockIdx.x % tiles_per_head;
  const int64_t t0 = tile * kTile;
  const int n = block_tokens(tokens, t0, kTile);
  const int K = tb.kept[h];
  const int KP = tb.k_pad;
  if (K == 0 || tb.proj_int[h]) return;  // project_int_kernel codes the latter
  const float* mean = tb.mean + size_t(h) * D;
  const float* scl = tb.scale + size_t(h) * D;
  const bool rope = tb.rope[h] != 0;
  const int half = tb.rope_dim / 2;
  const uint16_t* xh = x + (size_t(h) * size_t(tb.seq) + size_t(tb.tok0 + t0)) * D;
  // Load: thread v takes one pair group (8 dims and their RoPE partners) of
  // one token; consecutive threads consecutive tokens, so the transposed
  // shared stores do not conflict. xs = (x, RoPE removed) * scale - mean.
  for (int v = threadIdx.x; v < kTile * (D / 16); v += kProjThreads) {
    const int t = v % kTile, lo = pair_group_lo(tb, v / kTile), hi = lo + half;
    float a[8], b[8];
    if (t < n) {
      load_bf16x8(xh + size_t(t) * D + lo, a);
      load_bf16x8(xh + size_t(t) * D + hi, b);
      if (rope) rope_pairs(tb, tb.pos0 + tb.tok0 + t0 + t, lo % tb.rope_dim, /*remove=*/true, a, b);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        a[e] = __fsub_rn(__fmul_rn(a[e], scl[lo + e]), mean[lo + e]);
        b[e] = __fsub_rn(__fmul_rn(b[e], scl[hi + e]), mean[hi + e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) a[e] = b[e] = 0.0f;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      xs[(lo + e) * kTilePad + t] = a[e];
      xs[(hi + e) * kTilePad + t] = b[e];
    }
  }
  __syncthreads();

  const float* bt = tb.basis_t + size_t(h) * D * KP;
  const int kgroups = (K + 7) / 8;
  for (int g = threadIdx.x; g < (kTile / 8) * kgroups; g += kProjThreads) {
    // A warp covers 16 token groups x 2 component groups (measured: 10%
    // faster here than the 8 x 4 warp tile of reconstruct_kernel).
    const int tg = g % (kTile / 8), kg = g / (kTile / 8);
    if (tg * 8 >= n) continue;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < D; ++d) fma_tile_8x8(acc, xs + d * kTilePad + tg * 8, bt + size_t(d) * KP + kg * 8);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int k = kg * 8 + j;
      if (k >= K) continue;
      const size_t q = size_t(h) * KP + k;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int t = tg * 8 + i;
        if (t < n) cs[code_slot(t, k, KP)] = float_code<CodeT>(tb, acc[i][j], q);
      }
    }
  }
  __syncthreads();
  store_code_slots(cs, n, KP, codes + size_t(int64_t(h) * nb + tile * 2) * kT * KP);
}

// One lane's word of a step at p (2-byte aligned: the slot ends 16-byte
// aligned and the states and words are even-sized) if o: a predicated
// store, no branch (the compiler branched around plain conditional stores).
__device__ __forceinline__ void store_step_word(uint8_t* p, bool o, uint32_t v) {
  asm volatile("{\n .reg .pred a;\n setp.ne.b32 a, %1, 0;\n @a st.global.u16 [%0], %2;\n}" ::"l"(p), "r"(int(o)),
               "r"(v));
}

// A code, zero-extended into 32 bits by the load itself: the compiler put
// a mask right after a plain load, so every step waited on its codes'
// load however early it was issued (47% of the stall samples, ncu, H100).
template <typename CodeT>
__device__ __forceinline__ uint32_t ldg_code(const CodeT* p) {
  uint32_t v;
  if constexpr (sizeof(CodeT) == 1)
    asm volatile("ld.global.nc.u8 %0, [%1];" : "=r"(v) : "l"(p));
  else
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// One warp codes one stream (n tokens, codes cs [K][kT]) backwards into
// slot [0, cap): its bytes end at cap; returns where they start. kFull: n ==
// kT (no lane is idle). Steps in reverse: components K-1..0, each its passes
// over the tokens (at most two: kT = 64), pass 1 first.
//
// Each step is branch-free: a lane emits 0 or 1 word (o), whose place in
// the step's run comes from one ballot, and stores it under a predicate;
// the shift drops the same bits. The table entry carries x_max = freq <<
// (31 - scale) itself. Loads run ahead of their use: a
// component's codes two components ahead, its table entries (which need
// the codes) one ahead, so no step waits on a load (the chain code ->
// entry was 34% of the stall samples with the codes one component ahead,
// ncu, H100).
template <typename CodeT, bool kFull>
__device__ __forceinline__ uint32_t rans_encode_stream(const DeviceTables& tb, int h, const CodeT* __restrict__ cs,
                                                       int n, int K, uint8_t* __restrict__ slot, uint32_t cap) {
  static_assert(kT == 64, "two passes of 32 lanes per component");
  const int lane = threadIdx.x % 32;
  const unsigned lt_mask = (1u << lane) - 1u;
  const bool live0 = kFull || lane < n, live1 = kFull || 32 + lane < n;
  const bool two_passes = kFull || n > 32;
  // An idle lane's entry: never emits (x_max above any state) and leaves
  // the state as it is (q = 0, bias 0).
  const uint4 idle = make_uint4(0, 0, ~0u, 0);
  const uint4* comp = tb.comp + size_t(h) * tb.k_pad;
  const CodeT* col = cs + lane;
  uint32_t st = kVariantRansLow;
  uint8_t* p = slot + cap;  // where the bytes coded so far start
  const auto step = [&](const uint4& e) {
    const bool o = st >= e.z;
    const unsigned b = __ballot_sync(0xffffffffu, o);
    p -= 2 * __popc(b);
    store_step_word(p + 2 * __popc(b & lt_mask), o, st);
    st >>= o ? 16u : 0u;
    // x / f and x % f through the reciprocal: q = floor(x / f) for x < 2^31.
    const uint32_t q = __umulhi(st, e.x) >> (e.w & 0xffu);
    st = st + e.y + q * (e.w >> 8);
  };
  const auto codes_of = [&](int k, uint32_t& c0, uint32_t& c1) {
    c0 = live0 ? ldg_code(col + k * kT) : 0u;
    c1 = live1 && two_passes ? ldg_code(col + k * kT + 32) : 0u;
  };
  const auto entries_of = [&](uint32_t sym_base, uint32_t c0, uint32_t c1, uint4& e0, uint4& e1) {
    e0 = live0 ? __ldg(tb.sym_enc + sym_base + c0) : idle;
    e1 = live1 && two_passes ? __ldg(tb.sym_enc + sym_base + c1) : idle;
  };
  // Registers by distance: component k's entries, k - 1's codes and
  // symbol base, k - 2's codes.
  uint32_t a0, a1, b0 = 0, b1 = 0;
  codes_of(K - 1, a0, a1);
  if (K > 1) codes_of(K - 2, b0, b1);
  uint32_t base_b = K > 1 ? __ldg(comp + K - 2).z : 0u;
  uint4 e0, e1;
  entries_of(__ldg(comp + K - 1).z, a0, a1, e0, e1);
#pragma unroll 2
  for (int k = K - 1; k >= 0; --k) {
    uint32_t c0 = 0, c1 = 0, base_c = 0;
    if (k > 1) {
      codes_of(k - 2, c0, c1);
      base_c = __ldg(comp + k - 2).z;
    }
    uint4 f0 = idle, f1 = idle;
    if (k > 0) entries_of(base_b, b0, b1, f0, f1);
    if (two_passes) step(e1);
    step(e0);
    e0 = f0, e1 = f1, b0 = c0, b1 = c1, base_b = base_c;
  }
  p -= kStateBytes;
#pragma unroll
  for (int i = 0; i < 4; ++i) p[4 * lane + i] = uint8_t(st >> (8 * i));
  return uint32_t(p - slot);
}

template <typename CodeT>
__global__ void __launch_bounds__(32 * kRansWarps) rans_encode_kernel(DeviceTables tb, const CodeT* __restrict__ codes,
                                                                      int64_t tokens, int64_t nb, int64_t stream0,
                                                                      int64_t ns, uint8_t* __restrict__ scratch,
                                                                      uint64_t cap,
                                                                      uint64_t* __restrict__ sizes) {
  const int64_t stream = stream0 + int64_t(blockIdx.x) * kRansWarps + threadIdx.x / 32;
  if (stream >= ns) return;
  const int h = int(stream / nb);
  const int64_t t0 = (stream % nb) * kT;
  const int n = block_tokens(tokens, t0, kT);
  const int K = tb.kept[h];
  uint32_t start = uint32_t(cap);
  if (K > 0) {
    const CodeT* cs = codes + size_t(stream) * kT * tb.k_pad;
    uint8_t* slot = scratch + size_t(stream) * cap;
    start = n == kT ? rans_encode_stream<CodeT, true>(tb, h, cs, n, K, slot, uint32_t(cap))
                    : rans_encode_stream<CodeT, false>(tb, h, cs, n, K, slot, uint32_t(cap));
  }
  if (threadIdx.x % 32 == 0) sizes[stream] = cap - start;
}

// One warp per stream copies its bytes from the end of its scratch slot to
// out + offsets[stream] (the sizes' inclusive sum up to stream - 1): dst's
// bytes up to its first 4-byte boundary one by one, then whole aligned
// words of dst, each from the two aligned source words that hold its bytes
// (a funnel shift; a word reaching past the source's end lies inside the
// slot, which ends 16-byte aligned), then the last bytes. The streams'
// offsets are byte granular, so 15 of 16 streams land off src's alignment;
// those were copied a byte per lane (the pack was 0.19 ms of a 2.1 ms
// encode, the calibrated bench batch, H200).
__global__ void pack_kernel(const uint8_t* __restrict__ scratch, uint64_t cap, const uint64_t* __restrict__ sizes,
                            const uint64_t* __restrict__ offsets, uint8_t* __restrict__ out, int64_t ns) {
  const int64_t stream = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (stream >= ns) return;
  const int lane = threadIdx.x % 32;
  const uint64_t size = sizes[stream];
  const uint8_t* src = scratch + size_t(stream) * cap + cap - size;
  uint8_t* dst = out + offsets[stream];
  const uint64_t to_word = (4 - (reinterpret_cast<uintptr_t>(dst) & 3)) & 3, head = to_word < size ? to_word : size;
  if (uint64_t(lane) < head) dst[lane] = src[lane];
  const uint64_t words = (size - head) / 4;
  const uintptr_t s = reinterpret_cast<uintptr_t>(src + head);
  const uint32_t* sw = reinterpret_cast<const uint32_t*>(s & ~uintptr_t(3));
  const uint32_t shift = uint32_t(s & 3) * 8;
  uint32_t* dw = reinterpret_cast<uint32_t*>(dst + head);
  for (uint64_t i = lane; i < words; i += 32)
    dw[i] = shift == 0 ? sw[i] : __funnelshift_r(sw[i], sw[i + 1], shift);
  for (uint64_t b = head + 4 * words + lane; b < size; b += 32) dst[b] = src[b];
}

}  // namespace
}  // namespace kvcodec::gpu

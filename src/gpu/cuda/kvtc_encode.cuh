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
  const int n = tokens - t0 < kTile ? int(tokens - t0) : kTile;
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

template <typename CodeT>
__global__ void __launch_bounds__(32 * kRansWarps) rans_encode_kernel(DeviceTables tb, const CodeT* __restrict__ codes,
                                                                      int64_t tokens, int64_t nb, int64_t stream0,
                                                                      int64_t ns, uint8_t* __restrict__ scratch,
                                                                      uint64_t cap,
                                                                      uint64_t* __restrict__ sizes) {
  const int64_t stream = stream0 + int64_t(blockIdx.x) * kRansWarps + threadIdx.x / 32;
  if (stream >= ns) return;
  const int lane = threadIdx.x % 32;
  const int h = int(stream / nb);
  const int64_t t0 = (stream % nb) * kT;
  const int n = tokens - t0 < kT ? int(tokens - t0) : kT;
  const int K = tb.kept[h];
  const int KP = tb.k_pad;
  if (K == 0) {
    if (lane == 0) sizes[stream] = 0;
    return;
  }
  const CodeT* cs = codes + size_t(stream) * kT * KP;
  const unsigned lt_mask = (1u << lane) - 1u;
  uint8_t* slot_end = scratch + size_t(stream) * cap + cap;
  uint8_t* p = slot_end;
  uint32_t st = kVariantRansLow;
  // Steps in reverse: components K-1..0, each its passes over the tokens
  // (at most two: kT = 64), pass 1 first. Component k - 1's table entries
  // are loaded while component k codes: they do not depend on the state,
  // and the chain code -> entry was each step's latency (one step at a
  // time, with a division by the pass count to find its component).
  static_assert(kT == 64, "two passes of 32 lanes per component");
  const bool live0 = lane < n, live1 = 32 + lane < n;
  const uint4* comp = tb.comp + size_t(h) * KP;
  const uint4 idle = make_uint4(0, 0, 1, 0);
  const auto entries = [&](int k, uint4& e0, uint4& e1, uint32_t& scale) {
    const uint4 c = __ldg(comp + k);  // the same for every lane
    scale = c.w & 0xffu;              // bits 8+: the decoder's guide shift
    e0 = live0 ? __ldg(tb.sym_enc + c.z + uint32_t(cs[k * kT + lane])) : idle;
    e1 = live1 ? __ldg(tb.sym_enc + c.z + uint32_t(cs[k * kT + 32 + lane])) : idle;
  };
  const auto step = [&](const uint4& e, bool live, uint32_t scale) {
    int ne = 0;
    if (live) {
      const uint32_t x_max = (1u << (31 - scale)) * e.z;
      ne = st >= x_max ? ((st >> 8) >= x_max ? 2 : 1) : 0;
    }
    const unsigned b1 = __ballot_sync(0xffffffffu, ne >= 1), b2 = __ballot_sync(0xffffffffu, ne >= 2);
    const int total = __popc(b1) + __popc(b2);
    const int pre = __popc(b1 & lt_mask) + __popc(b2 & lt_mask);
    uint8_t* base = p - total + pre;
    if (ne == 1) {
      base[0] = uint8_t(st);
      st >>= 8;
    } else if (ne == 2) {
      base[0] = uint8_t(st >> 8);  // decoder reads the last emitted (higher) byte first
      base[1] = uint8_t(st);
      st >>= 16;
    }
    p -= total;
    if (live) {
      // x / f and x % f through the reciprocal: q = floor(x / f) for x < 2^31.
      const uint32_t q = __umulhi(st, e.x) >> (e.w & 0xffu);
      st = st + e.y + q * (e.w >> 8);
    }
  };
  const bool two_passes = n > 32;
  uint4 e0, e1;
  uint32_t scale;
  entries(K - 1, e0, e1, scale);
  for (int k = K - 1; k >= 0; --k) {
    uint4 next0 = idle, next1 = idle;
    uint32_t next_scale = 0;
    if (k > 0) entries(k - 1, next0, next1, next_scale);
    if (two_passes) step(e1, live1, scale);
    step(e0, live0, scale);
    e0 = next0, e1 = next1, scale = next_scale;
  }
  p -= kStateBytes;
  p[4 * lane] = uint8_t(st);
  p[4 * lane + 1] = uint8_t(st >> 8);
  p[4 * lane + 2] = uint8_t(st >> 16);
  p[4 * lane + 3] = uint8_t(st >> 24);
  if (lane == 0) sizes[stream] = uint64_t(slot_end - p);
}

__global__ void pack_kernel(const uint8_t* __restrict__ scratch, uint64_t cap, const uint64_t* __restrict__ sizes,
                            const uint64_t* __restrict__ offsets, uint8_t* __restrict__ out, int64_t ns) {
  // One warp per stream.
  const int64_t stream = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (stream >= ns) return;
  const int lane = threadIdx.x % 32;
  const uint64_t size = sizes[stream];
  const uint8_t* src = scratch + size_t(stream) * cap + cap - size;
  uint8_t* dst = out + offsets[stream];  // offsets[stream] = inclusive sum up to stream - 1
  // src ends 16-aligned; when dst has the same alignment mod 16, copy words.
  const uint64_t head = (16 - (reinterpret_cast<uintptr_t>(src) & 15)) & 15;
  if (((reinterpret_cast<uintptr_t>(src) ^ reinterpret_cast<uintptr_t>(dst)) & 15) == 0 && size > head) {
    if (uint64_t(lane) < head) dst[lane] = src[lane];
    const uint4* s4 = reinterpret_cast<const uint4*>(src + head);
    uint4* d4 = reinterpret_cast<uint4*>(dst + head);
    for (uint64_t w = lane; w < (size - head) / 16; w += 32) d4[w] = s4[w];
  } else {
    for (uint64_t b = lane; b < size; b += 32) dst[b] = src[b];
  }
}

}  // namespace
}  // namespace kvcodec::gpu

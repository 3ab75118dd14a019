// CUDA kernels of the kvtc-gpu/2 variant (contract: src/gpu/kvtc_variant.hpp).
//
// Projection and entropy coding are separate kernels, so that each runs at
// its own best shape (the fused v1 kept 3 of 4 warps idle during rANS, whose
// table look-ups are latency-bound), and consecutive head ranges are
// pipelined on two streams (set_pipeline_chunks):
//
// encode
//   project_kernel  CTA of 256 threads (2 per SM) per (head, tile of 128
//                   tokens = two streams): x [128, D] bf16 -> shared
//                   (transposed, fp32, mean removed); each thread an 8x8
//                   tile of [128, K] with its accumulators in registers, d
//                   ascending (the reference's order); codes staged in shared
//                   component-major [K][64] per stream, then stored with
//                   16-byte writes into the stream's code slot (u8 when every
//                   alphabet has <= 256 symbols, else u16).
//   rans_encode_kernel  one warp per stream: 32 lanes, steps in reverse; at
//                   each step every lane codes the same component (one table),
//                   reciprocal multiply instead of division (exact for states
//                   < 2^31), one 16-byte table entry per symbol; bytes written
//                   backwards into the stream's scratch slot.
//   scan of the sizes (cub), one wait for the total, pack_kernel copies the
//   slots to the output (16-byte words where the alignment allows).
// decode
//   rans_decode_kernel  one warp per stream, 4 streams of one head per CTA,
//                   the head's cum tables and decoder guide in shared memory;
//                   symbol by a guide look-up (>= 4 buckets per symbol) and a
//                   short scan up cum (no 2^scale-entry slot tables: their 32
//                   scattered look-ups per step bound v2.0 by L1 throughput;
//                   the binary search that followed cost 2.49 vs 1.58 ms);
//                   codes to the code slots; a malformed stream sets a
//                   per-stream flag.
//   reconstruct_kernel  CTA of 256 threads per (head, 128 tokens): codes ->
//                   dequantized [K, 128] in shared; 8x8 register tiles, k
//                   ascending; bf16 stored 16 bytes at a time. Tokens of a
//                   flagged stream are left untouched.
//   reconstruct_tc_kernel  (set_reconstruction(kTf32TensorCores)) the same
//                   product on tensor cores: one stream per CTA, mma.sync
//                   m16n8k8 TF32 with both operands in fragment order (the
//                   basis pre-swizzled on the host); within a stated bound of
//                   the exact path, not bit-exact (comment at the kernel).
#include <cuda_runtime.h>
#include <mma.h>

#include <cub/device/device_scan.cuh>
#include <cstring>
#include <string>
#include <tuple>

#include "gpu/kvtc_variant.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/gpu.hpp"

namespace kvcodec::gpu {
namespace {

constexpr int kT = KvtcGpuCodec::kBlockTokens;  // tokens per stream
constexpr int kTile = 2 * kT;                    // tokens per projection CTA
constexpr int kProjThreads = 256;
constexpr int kRansWarps = 4;
// Decoder guide buckets per component: 2^min(scale, ceil(log2(levels)) + 2,
// kGuideMaxBits), i.e. >= 4 buckets per symbol where the scale allows, so
// the scan after the look-up is usually empty.
constexpr uint32_t kGuideMaxBits = 10;
constexpr int kTilePad = kTile + 4;  // row stride of transposed tiles (16-byte aligned rows)

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::kInternal, std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

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
  const uint4* sym_enc;       // per symbol {rcp, bias, freq, shift | cmpl_freq << 8} (encoder)
  const uint32_t* cum;        // per head, per component: cum[0..levels] (levels + 1 entries; decoder)
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
  int rope_dim;
  // Per call: each head's rows are seq tokens apart; the coded ones start at
  // row tok0 (= their position), the sinks before them stay raw.
  int64_t seq, tok0;
};

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

__device__ __forceinline__ uint4 pack_bf16x8(const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) w[e] = uint32_t(f32_to_bf16_dev(v[2 * e])) | uint32_t(f32_to_bf16_dev(v[2 * e + 1])) << 16;
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

// RoPE on 8 pairs at `position`, frequencies i0..i0+7.
__device__ __forceinline__ void rope_pairs(const DeviceTables& tb, int64_t position, int i0, bool remove,
                                           float (&a)[8], float (&b)[8]) {
  const int half = tb.rope_dim / 2;
  const float* c = tb.rope_cos + size_t(position) * half + i0;
  const float* sn = tb.rope_sin + size_t(position) * half + i0;
#pragma unroll
  for (int e = 0; e < 8; ++e) rope_one(a[e], b[e], __ldg(c + e), __ldg(sn + e), remove);
}

// 8 floats from 16-byte aligned shared (load) or read-only global (ldg) memory.
__device__ __forceinline__ void load_f32x8(const float* p, float (&v)[8]) {
  const float4 x = *reinterpret_cast<const float4*>(p), y = *reinterpret_cast<const float4*>(p + 4);
  v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
}
__device__ __forceinline__ void ldg_f32x8(const float* p, float (&v)[8]) {
  const float4 x = __ldg(reinterpret_cast<const float4*>(p)), y = __ldg(reinterpret_cast<const float4*>(p + 4));
  v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
}

// Stores n tokens of head h from fp32 staging os[t * pad + d] (the products,
// before the mean) as bf16: + mean, * inv_scale, RoPE re-applied on keys of
// the calibrated format at position tok0 + t_first + t, 16-byte stores.
// Tokens with skip(t) are left untouched.
template <int D, typename Skip>
__device__ __forceinline__ void store_tokens(const DeviceTables& tb, int h, const float* os, int pad, int n,
                                             int64_t t_first, uint16_t* __restrict__ yh, Skip skip) {
  const float* mean = tb.mean + size_t(h) * D;
  const float* isc = tb.inv_scale + size_t(h) * D;
  const bool rope = tb.rope[h] != 0;
  const int half = tb.rope_dim / 2;
  for (int v = threadIdx.x; v < n * (D / 16); v += blockDim.x) {
    const int t = v / (D / 16), lo = pair_group_lo(tb, v % (D / 16)), hi = lo + half;
    if (skip(t)) continue;
    float a[8], b[8];
    load_f32x8(os + t * pad + lo, a);
    load_f32x8(os + t * pad + hi, b);
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
    if (rope) rope_pairs(tb, tb.tok0 + t_first + t, lo % tb.rope_dim, /*remove=*/false, a, b);
    __stcs(reinterpret_cast<uint4*>(yh + size_t(t) * D + lo), pack_bf16x8(a));
    __stcs(reinterpret_cast<uint4*>(yh + size_t(t) * D + hi), pack_bf16x8(b));
  }
}

// Thread g of a tiled [128 tokens, 8*C columns] product: warp g/32 covers
// token groups 8*(w%2)..+7 and column groups 4*(w/2)..+3, lane l takes token
// group l%8 and column group l/8 of those.
__device__ __forceinline__ void warp_tile(int g, int& tg, int& cg) {
  const int w = g / 32, l = g % 32;
  tg = (w % 2) * 8 + (l % 8);
  cg = (w / 2) * 4 + (l / 8);
}

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
  if (K == 0) return;
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
      if (rope) rope_pairs(tb, tb.tok0 + t0 + t, lo % tb.rope_dim, /*remove=*/true, a, b);
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
    for (int d = 0; d < D; ++d) {
      const float4 xa = *reinterpret_cast<const float4*>(xs + d * kTilePad + tg * 8);
      const float4 xb = *reinterpret_cast<const float4*>(xs + d * kTilePad + tg * 8 + 4);
      const float4 ba = __ldg(reinterpret_cast<const float4*>(bt + size_t(d) * KP + kg * 8));
      const float4 bb = __ldg(reinterpret_cast<const float4*>(bt + size_t(d) * KP + kg * 8 + 4));
      const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
      const float bv[8] = {ba.x, ba.y, ba.z, ba.w, bb.x, bb.y, bb.z, bb.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = __fmaf_rn(xv[i], bv[j], acc[i][j]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int k = kg * 8 + j;
      if (k >= K) continue;
      const size_t q = size_t(h) * KP + k;
      const float inv = tb.inv_step[q], off = tb.code_offset[q], mx = tb.max_code[q];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int t = tg * 8 + i;
        if (t < n) {
          const float v = floorf(__fmaf_rn(acc[i][j], inv, off));
          cs[(t / kT) * (kT * KP) + k * kT + (t % kT)] = CodeT(fminf(fmaxf(v, 0.0f), mx));
        }
      }
    }
  }
  __syncthreads();
  // The tile's streams are consecutive code slots of kT * KP codes each (a
  // multiple of 16 bytes): copy both as 16-byte words.
  const int64_t stream0 = int64_t(h) * nb + tile * 2;
  const int n_streams = n > kT ? 2 : 1;
  const int words = int((size_t(n_streams) * kT * KP * sizeof(CodeT)) / 16);
  uint4* dst = reinterpret_cast<uint4*>(codes + size_t(stream0) * kT * KP);
  const uint4* src = reinterpret_cast<const uint4*>(cs);
  for (int v = threadIdx.x; v < words; v += kProjThreads) dst[v] = src[v];
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
  const int passes = (n + 31) / 32;  // steps per component
  const int steps = K * passes;
  const uint4* comp = tb.comp + size_t(h) * KP;
  for (int s = steps - 1; s >= 0; --s) {
    const int k = s / passes;
    const int t = (s - k * passes) * 32 + lane;
    int ne = 0;
    uint4 e = make_uint4(0, 0, 1, 0);
    const uint4 c = __ldg(comp + k);  // the same for every lane
    const uint32_t scale = c.w & 0xffu;  // bits 8+: the decoder's guide shift
    if (t < n) {
      e = __ldg(tb.sym_enc + c.z + uint32_t(cs[k * kT + t]));
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
    if (t < n) {
      // x / f and x % f through the reciprocal: q = floor(x / f) for x < 2^31.
      const uint32_t q = __umulhi(st, e.x) >> (e.w & 0xffu);
      st = st + e.y + q * (e.w >> 8);
    }
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

// ---------------------------------------------------------------- decode ---

// One warp decodes one stream (n tokens) of head h into cs ([K][kT] codes,
// component-major; global or shared memory) with the head's cum tables and
// guide at cum / guide. Returns whether the stream is malformed (the same
// on every lane).
template <typename CodeT>
__device__ __forceinline__ bool rans_decode_stream(const DeviceTables& tb, int h, const uint32_t* cum,
                                                   const CodeT* guide, const uint8_t* __restrict__ in,
                                                   uint64_t in_size, uint64_t start, uint64_t end, int n,
                                                   CodeT* cs) {
  const int lane = threadIdx.x % 32;
  const int K = tb.kept[h];
  const unsigned lt_mask = (1u << lane) - 1u;
  int fail = 0;
  if (!(start <= end && end <= in_size)) {
    fail = 1;
  } else if (K == 0) {
    fail = end != start;
  } else if (end - start < kStateBytes) {
    fail = 1;
  } else {
    const uint8_t* data = in + start;
    const uint64_t size = end - start;
    uint32_t st = uint32_t(data[4 * lane]) | uint32_t(data[4 * lane + 1]) << 8 | uint32_t(data[4 * lane + 2]) << 16 |
                  uint32_t(data[4 * lane + 3]) << 24;
    const int passes = (n + 31) / 32;
    // A valid stream has at most 2 bytes per symbol after the states, so the
    // size fits 32 bits from here on; every failure below is warp-uniform.
    fail = __any_sync(0xffffffffu, st < kVariantRansLow) || size > kStateBytes + 2ull * uint64_t(n) * uint64_t(K);
    const uint32_t size32 = uint32_t(size);
    uint32_t pos = kStateBytes;
    const uint4* comp = tb.comp + size_t(h) * tb.k_pad;
    int k = 0, pass = 0;
    for (int s = 0; s < K * passes && !fail; ++s) {
      const int t = pass * 32 + lane;
      const uint4 c = __ldg(comp + k);  // the same for every lane
      int ne = 0;
      if (t < n) {
        const uint32_t scale = c.w & 0xffu;
        const uint32_t slot = st & ((1u << scale) - 1u);
        const uint32_t* ck = cum + c.x;
        uint32_t base = guide[c.y + (slot >> (c.w >> 8))];
        uint32_t lo = ck[base], hi = ck[base + 1];
        while (hi <= slot) lo = hi, hi = ck[++base + 1];  // ends: cum[levels] = 2^scale > slot
        st = (hi - lo) * (st >> scale) + slot - lo;
        ne = st >= kVariantRansLow ? 0 : ((st << 8) >= kVariantRansLow ? 1 : 2);
        cs[k * kT + t] = CodeT(base);
      }
      const unsigned b1 = __ballot_sync(0xffffffffu, ne >= 1), b2 = __ballot_sync(0xffffffffu, ne >= 2);
      const uint32_t pre = pos + __popc(b1 & lt_mask) + __popc(b2 & lt_mask);
      pos += __popc(b1) + __popc(b2);
      if (pos > size32) {
        fail = 1;  // truncated (every lane sees it)
      } else if (ne >= 1) {
        st = st << 8 | data[pre];
        if (ne == 2) st = st << 8 | data[pre + 1];
      }
      if (++pass == passes) pass = 0, ++k;
    }
    if (!fail && (pos != size32 || st != kVariantRansLow)) fail = 1;
  }
  return __any_sync(0xffffffffu, fail);
}

// The head's cum tables and guide into shared memory (ssm; 16-byte aligned
// in global memory, copied as words), or left in global memory.
template <typename CodeT>
__device__ __forceinline__ void head_tables(const DeviceTables& tb, int h, int tables_in_smem, uint32_t* ssm,
                                            const uint32_t*& cum, const CodeT*& guide) {
  const uint32_t hb = tb.head_base[h], he = tb.head_base[h + 1];
  cum = tb.cum + hb;
  const uint32_t gb = tb.guide_base[h];
  guide = static_cast<const CodeT*>(tb.guide) + gb;
  if (tables_in_smem) {
    const uint32_t cw = he - hb, gw = (tb.guide_base[h + 1] - gb) * uint32_t(sizeof(CodeT)) / 4;
    const uint32_t* gsrc = reinterpret_cast<const uint32_t*>(guide);
    for (uint32_t i = threadIdx.x; i < cw; i += blockDim.x) ssm[i] = cum[i];
    for (uint32_t i = threadIdx.x; i < gw; i += blockDim.x) ssm[cw + i] = gsrc[i];
    __syncthreads();
    cum = ssm;
    guide = reinterpret_cast<const CodeT*>(ssm + cw);
  }
}

__device__ __forceinline__ void flag_stream(int64_t stream, bool any, uint8_t* bad, int* err) {
  bad[stream] = any ? 1 : 0;
  if (any) {
    atomicExch(err, 1);
    atomicMin(err + 1, stream < 0x7fffffff ? int(stream) : 0x7fffffff);
  }
}

// A CTA decodes kRansWarps consecutive blocks of one head, one per warp, with
// the head's guide and cumulative-frequency tables in shared memory (or read
// from global memory when they do not fit). The symbol of a slot is found by
// a direct look-up: the guide gives the symbol of the slot's bucket start (the
// top gbits bits of the slot), then a linear scan over cum moves up past the
// bucket's symbol boundaries (usually none: >= 4 buckets per symbol). This
// replaced a binary search of ceil(log2(levels)) dependent shared loads per
// symbol; the result is the same symbol (the one s with cum[s] <= slot <
// cum[s+1]), so bytes and codes are unchanged.
template <typename CodeT>
__global__ void __launch_bounds__(32 * kRansWarps) rans_decode_kernel(DeviceTables tb, const uint8_t* __restrict__ in,
                                                                      uint64_t in_size,
                                                                      const uint64_t* __restrict__ offsets,
                                                                      int64_t tokens, int64_t nb, int head0,
                                                                      int64_t groups_per_head, int tables_in_smem,
                                                                      CodeT* __restrict__ codes,
                                                                      uint8_t* __restrict__ bad, int* __restrict__ err) {
  extern __shared__ __align__(16) uint32_t ssm[];
  const int h = head0 + int(blockIdx.x / groups_per_head);
  const int64_t blk = (blockIdx.x % groups_per_head) * kRansWarps + threadIdx.x / 32;
  const uint32_t* cum;
  const CodeT* guide;
  head_tables(tb, h, tables_in_smem, ssm, cum, guide);
  if (blk >= nb) return;
  const int64_t stream = int64_t(h) * nb + blk;
  const int64_t t0 = blk * kT;
  const int n = tokens - t0 < kT ? int(tokens - t0) : kT;
  const bool any = rans_decode_stream(tb, h, cum, guide, in, in_size, offsets[stream], offsets[stream + 1], n,
                                      codes + size_t(stream) * kT * tb.k_pad);
  if (threadIdx.x % 32 == 0) flag_stream(stream, any, bad, err);
}

template <int D, typename CodeT>
__global__ void __launch_bounds__(kProjThreads, 2) reconstruct_kernel(DeviceTables tb, const CodeT* __restrict__ codes,
                                                                   const uint8_t* __restrict__ bad, int64_t tokens,
                                                                   int64_t nb, int64_t tiles_per_head, int head0,
                                                                   uint16_t* __restrict__ y) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* vs = reinterpret_cast<float*>(smem);  // [KP][kTilePad], vs[k][t] dequantized coefficients
  const int h = head0 + int(blockIdx.x / tiles_per_head);
  const int64_t tile = blockIdx.x % tiles_per_head;
  const int64_t t0 = tile * kTile;
  const int n = tokens - t0 < kTile ? int(tokens - t0) : kTile;
  const int K = tb.kept[h];
  const int KP = tb.k_pad;
  const int64_t stream0 = int64_t(h) * nb + tile * 2;
  const bool bad0 = bad[stream0] != 0, bad1 = n > kT && bad[stream0 + 1] != 0;
  if (bad0 && (n <= kT || bad1)) return;
  const CodeT* cs = codes + size_t(stream0) * kT * KP;
  // Both streams' codes: slot s holds [K][kT] (component-major), tokens
  // s*kT + j; entries past the stream's n tokens are not read back.
  const int slots = n > kT ? 2 : 1;
  for (int v = threadIdx.x; v < slots * K * kT; v += kProjThreads) {
    const int sidx = v / (K * kT), r = v - sidx * K * kT;
    const int k = r / kT, t = sidx * kT + r % kT;
    const size_t q = size_t(h) * KP + k;
    const float code = float(cs[size_t(sidx) * kT * KP + r]);
    vs[k * kTilePad + t] = __fmul_rn(__fsub_rn(code, tb.recon_offset[q]), tb.step[q]);
  }
  __syncthreads();
  const float* bs = tb.basis + size_t(h) * KP * D;
  // One 8x8 tile per thread ((kTile / 8) * (D / 8) <= kProjThreads tiles):
  // 8 token groups x 4 dim groups per warp: 256 + 128 distinct bytes per k
  // instead of 64 + 512 (measured 2% faster than 16 x 2 here).
  static_assert((kTile / 8) * (D / 8) <= kProjThreads, "one tile per thread");
  const int g = threadIdx.x;
  int tg, dg;
  warp_tile(g, tg, dg);
  const bool active = g < (kTile / 8) * (D / 8) && tg * 8 < n;
  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
  if (active) {
#pragma unroll 4
    for (int k = 0; k < K; ++k) {
      const float4 va = *reinterpret_cast<const float4*>(vs + k * kTilePad + tg * 8);
      const float4 vb = *reinterpret_cast<const float4*>(vs + k * kTilePad + tg * 8 + 4);
      const float4 ba = __ldg(reinterpret_cast<const float4*>(bs + size_t(k) * D + dg * 8));
      const float4 bb = __ldg(reinterpret_cast<const float4*>(bs + size_t(k) * D + dg * 8 + 4));
      const float vv[8] = {va.x, va.y, va.z, va.w, vb.x, vb.y, vb.z, vb.w};
      const float bv[8] = {ba.x, ba.y, ba.z, ba.w, bb.x, bb.y, bb.z, bb.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = __fmaf_rn(vv[i], bv[j], acc[i][j]);
    }
  }
  uint16_t* yh = y + (size_t(h) * size_t(tb.seq) + size_t(tb.tok0 + t0)) * D;
  if (!tb.rope[h]) {
    // No RoPE: straight from the registers (the staging below cost 0.8 ms
    // of 3.5 on the kvtc-gpu/2 dump batch); the same ops as store_tokens.
    if (!active || (tg * 8 < kT ? bad0 : bad1)) return;
    const float* mean = tb.mean + size_t(h) * D;
    const float* isc = tb.inv_scale + size_t(h) * D;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (tg * 8 + i >= n) break;
      float r[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) r[j] = __fmul_rn(__fadd_rn(acc[i][j], mean[dg * 8 + j]), isc[dg * 8 + j]);
      *reinterpret_cast<uint4*>(yh + size_t(tg * 8 + i) * D + dg * 8) = pack_bf16x8(r);
    }
    return;
  }
  // RoPE: the products go through shared memory (vs reused, [kTile][D + 4])
  // so the store can pair each dim with its RoPE partner.
  constexpr int kOutPad = D + 4;
  __syncthreads();
  float* os = vs;
  if (active)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      *reinterpret_cast<float4*>(os + (tg * 8 + i) * kOutPad + dg * 8) =
          make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      *reinterpret_cast<float4*>(os + (tg * 8 + i) * kOutPad + dg * 8 + 4) =
          make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
    }
  __syncthreads();
  store_tokens<D>(tb, h, os, kOutPad, n, t0, yh, [&](int t) { return t < kT ? bad0 : bad1; });
}

// Tensor-core reconstruction (Reconstruction::kTf32TensorCores): the
// product [64 tokens, K] x [K, D] of one stream on tensor cores
// (mma.sync m16n8k8, TF32 operands, fp32 accumulation). Operands are rounded
// to TF32 (10-bit mantissa; the coefficients when staged, the basis once on
// the host), so y differs from the exact path by at most ~2^-10 * sum_k
// |v_k b_kd| before the bf16 rounding (bound tested in tests/gpu).
// Both operands sit in fragment order: the basis in global memory (host
// side, basis_frag: per (head, k-step of 8, 32 dims) each lane's 8 B
// registers contiguous, one 32-byte load per lane), the coefficients in
// shared memory (per (k-step, 16 tokens) each lane's 4 A registers, one
// conflict-free 16-byte load). The WMMA version (load_matrix_sync, scalar
// loads) was bound by load instructions: 1.96 ms for the dump batch.
// 8 warps of (D/64)*16 tokens x 32 dims per stream, 64 registers.
__device__ __forceinline__ void mma_tf32(float (&c)[4], const float4& a, float b0, float b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(__float_as_uint(a.x)), "r"(__float_as_uint(a.y)), "r"(__float_as_uint(a.z)), "r"(__float_as_uint(a.w)),
        "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

__device__ __forceinline__ float to_tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return __uint_as_float(r);
}

// Position of coefficient (token t < 64, component k) in the staged A
// operand: per (k-step ks, 16-token tile mt) 32 lanes x 4 registers, lane
// (t%8)*4 + k%4, register (t%16)/8 + 2*((k%8)/4) (the m16n8k8 A layout).
__device__ __forceinline__ int a_frag_index(int t, int k) {
  const int ks = k >> 3, kk = k & 7, mt = t >> 4, tt = t & 15;
  return (((ks * 4 + mt) * 32) + (tt & 7) * 4 + (kk & 3)) * 4 + (tt >> 3) + 2 * (kk >> 2);
}

// One stream's TF32 reconstruction by the CTA's 8 warps: codes cs ([K][kT],
// global memory) -> bf16 rows of tokens t0.. of head h. smem:
// tc_smem_bytes(k_pad, D), reused between the phases.
template <int D, typename CodeT>
__device__ __forceinline__ void tc_reconstruct_stream(const DeviceTables& tb, int h, const CodeT* cs, int n,
                                                      int64_t t0, uint16_t* __restrict__ y, float* smem) {
  constexpr int NG = D / 32;       // 32-dim column groups
  constexpr int WM = 8 / NG;       // warps along tokens
  constexpr int MT = kT / 16 / WM; // 16-token tiles per warp
  constexpr int kOutPad = D + 4;   // row stride of the fp32 output staging
  float* vs = smem;  // [K8 / 8][4][32 lanes][4]: A in fragment order
  const int K = tb.kept[h];
  const int K8 = (K + 7) / 8 * 8;
  const int KP = tb.k_pad;
  // Dequantize (the exact path's fp32 ops), round to TF32; rows K..K8-1 are
  // zero so the last k-step adds nothing. Token columns past n hold finite
  // stale codes; their rows are not stored. Thread j takes 16 tokens of one
  // k: its codes in 16-byte loads, all of a thread's loads issued before any
  // is used (one memory latency per CTA instead of one per element: an
  // element-wise loop took 4.19 ms here, 2.14 ms so).
  constexpr int kVec = 16 * int(sizeof(CodeT)) / 16;  // uint4 per 16 codes
  constexpr int kPer = 2;                               // groups of 16 per thread per round
  const int n_groups = K8 * (kT / 16);
  for (int j0 = 0; j0 < n_groups; j0 += kPer * kProjThreads) {
    uint4 raw[kPer][kVec];
    float off[kPer], stp[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int j = j0 + u * kProjThreads + int(threadIdx.x);
      const int k = j / (kT / 16), tq = (j % (kT / 16)) * 16;
      off[u] = 0.0f;
      stp[u] = 0.0f;
      if (j < n_groups && k < K) {
        const size_t q = size_t(h) * KP + k;
        off[u] = tb.recon_offset[q];
        stp[u] = tb.step[q];
        const uint4* src = reinterpret_cast<const uint4*>(cs + size_t(k) * kT + tq);
#pragma unroll
        for (int e = 0; e < kVec; ++e) raw[u][e] = __ldcs(src + e);  // read once: do not keep in L2
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) raw[u][e] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int j = j0 + u * kProjThreads + int(threadIdx.x);
      if (j >= n_groups) continue;
      const int k = j / (kT / 16), tq = (j % (kT / 16)) * 16;
      uint32_t w[4 * kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        w[4 * e] = raw[u][e].x;
        w[4 * e + 1] = raw[u][e].y;
        w[4 * e + 2] = raw[u][e].z;
        w[4 * e + 3] = raw[u][e].w;
      }
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        // Code e of the 16 (little-endian within the words).
        constexpr int per_word = 4 / int(sizeof(CodeT));
        const uint32_t code = (w[e / per_word] >> (8 * int(sizeof(CodeT)) * (e % per_word))) &
                              (sizeof(CodeT) == 1 ? 0xffu : 0xffffu);
        vs[a_frag_index(tq + e, k)] = k < K ? to_tf32(__fmul_rn(__fsub_rn(float(code), off[u]), stp[u])) : 0.0f;
      }
    }
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp % WM, ng = warp / WM;
  float acc[MT][4][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][i][e] = 0.0f;
  const float4* bsrc = reinterpret_cast<const float4*>(tb.basis_frag) + (size_t(h) * (KP / 8) * NG + ng) * 64 + lane * 2;
  const float4* asrc = reinterpret_cast<const float4*>(vs) + wm * MT * 32 + lane;
#pragma unroll 2
  for (int ks = 0; ks < K8 / 8; ++ks) {
    const float4 b01 = __ldg(bsrc + size_t(ks) * NG * 64), b23 = __ldg(bsrc + size_t(ks) * NG * 64 + 1);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const float4 a = asrc[(ks * 4 + m) * 32];
      mma_tf32(acc[m][0], a, b01.x, b01.y);
      mma_tf32(acc[m][1], a, b01.z, b01.w);
      mma_tf32(acc[m][2], a, b23.x, b23.y);
      mma_tf32(acc[m][3], a, b23.z, b23.w);
    }
  }
  __syncthreads();  // vs is reused as the output staging
  float* os = smem;  // [kT][kOutPad]
  {
    const int g = lane / 4, tq = lane % 4;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = (wm * MT + m) * 16 + g, col = ng * 32 + i * 8 + 2 * tq;
        *reinterpret_cast<float2*>(os + row * kOutPad + col) = make_float2(acc[m][i][0], acc[m][i][1]);
        *reinterpret_cast<float2*>(os + (row + 8) * kOutPad + col) = make_float2(acc[m][i][2], acc[m][i][3]);
      }
  }
  __syncthreads();
  uint16_t* yh = y + (size_t(h) * size_t(tb.seq) + size_t(tb.tok0 + t0)) * D;
  store_tokens<D>(tb, h, os, kOutPad, n, t0, yh, [](int) { return false; });
}

// One stream (64 tokens) per CTA, 4 CTAs per SM (one CTA's code loads
// overlap another's MMAs).
template <int D, typename CodeT>
__global__ void __launch_bounds__(kProjThreads, 4) reconstruct_tc_kernel(DeviceTables tb, const CodeT* __restrict__ codes,
                                                                      const uint8_t* __restrict__ bad, int64_t tokens,
                                                                      int64_t nb, int head0, uint16_t* __restrict__ y) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int h = head0 + int(blockIdx.x / nb);
  const int64_t blk = blockIdx.x % nb;
  const int64_t stream = int64_t(h) * nb + blk;
  if (bad[stream]) return;  // tokens of a malformed stream are left untouched
  const int64_t t0 = blk * kT;
  const int n = tokens - t0 < kT ? int(tokens - t0) : kT;
  tc_reconstruct_stream<D, CodeT>(tb, h, codes + size_t(stream) * kT * tb.k_pad, n, t0, y,
                                         reinterpret_cast<float*>(smem));
}

// The fused TF32 decode (set_fused_decode(true) with kTf32TensorCores): every
// warp of a CTA takes one stream of the CTA's head (kFusedStreams per CTA),
// rANS-decodes it into its own slot of shared memory and reconstructs it
// from there on tensor cores, on its own (no CTA barrier after the tables):
// the codes never reach global memory, and at any moment some warps of an
// SM run the latency-bound rANS steps while others run MMAs. Per 32-dim
// pass and 16-token tile a warp holds 16 dims of a RoPE sub-head's first
// half and their 16 partners, so RoPE is applied in registers. The products
// are the two-kernel path's (same operands, k-steps in the same order), so
// both give the same bits (tested).
constexpr int kFusedStreams = kProjThreads / 32;

template <int D, typename CodeT>
__device__ __forceinline__ void warp_tc_reconstruct(const DeviceTables& tb, int h, const CodeT* cs, int n,
                                                    int64_t t0, uint16_t* __restrict__ y) {
  constexpr int NG = D / 32;
  const int lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  const int K = tb.kept[h], K8 = (K + 7) / 8 * 8, KP = tb.k_pad;
  const int RD = tb.rope_dim, half = RD / 2;
  const bool rope = tb.rope[h] != 0;
  const float* mean = tb.mean + size_t(h) * D;
  const float* isc = tb.inv_scale + size_t(h) * D;
  const float* off = tb.recon_offset + size_t(h) * KP;
  const float* stp = tb.step + size_t(h) * KP;
  const float4* frag = reinterpret_cast<const float4*>(tb.basis_frag) + size_t(h) * (KP / 8) * NG * 64 + lane * 2;
  uint16_t* yh = y + (size_t(h) * size_t(tb.seq) + size_t(tb.tok0 + t0)) * D;
  for (int p = 0; p < D / 32; ++p) {
    const int lo = (p / (RD / 32)) * RD + (p % (RD / 32)) * 16, hi = lo + half;
    // This lane's B registers of tiles [lo, lo+16) and [hi, hi+16): one
    // float4 of its 8 registers in the 32-dim group of each.
    const float4* blo = frag + (lo / 32) * 64 + (lo % 32) / 16;
    const float4* bhi = frag + (hi / 32) * 64 + (hi % 32) / 16;
    // One 16-token tile at a time: 16 accumulators, so 3 CTAs of 8 warps
    // fit an SM (the rANS steps are latency-bound and want warps).
    for (int m = 0; m < 4; ++m) {
      const int r0 = m * 16 + g, r1 = r0 + 8;
      float acc[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
#pragma unroll 2
      for (int ks = 0; ks < K8 / 8; ++ks) {
        const float4 bl = __ldg(blo + size_t(ks) * NG * 64), bh = __ldg(bhi + size_t(ks) * NG * 64);
        const int k0 = ks * 8 + tq, k1 = k0 + 4;
        // The two-kernel path's dequantization (0 past K; the code slots
        // exist up to k_pad >= K8).
        const CodeT* c0 = cs + k0 * kT;
        const CodeT* c1 = cs + k1 * kT;
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (k0 < K) {
          const float o0 = __ldg(off + k0), s0 = __ldg(stp + k0);
          a.x = to_tf32(__fmul_rn(__fsub_rn(float(c0[r0]), o0), s0));
          a.y = to_tf32(__fmul_rn(__fsub_rn(float(c0[r1]), o0), s0));
        }
        if (k1 < K) {
          const float o1 = __ldg(off + k1), s1 = __ldg(stp + k1);
          a.z = to_tf32(__fmul_rn(__fsub_rn(float(c1[r0]), o1), s1));
          a.w = to_tf32(__fmul_rn(__fsub_rn(float(c1[r1]), o1), s1));
        }
        mma_tf32(acc[0], a, bl.x, bl.y);
        mma_tf32(acc[1], a, bl.z, bl.w);
        mma_tf32(acc[2], a, bh.x, bh.y);
        mma_tf32(acc[3], a, bh.z, bh.w);
      }
      // C of tile i: (row g, cols 2tq, 2tq+1) in regs 0, 1 and row g + 8 in
      // regs 2, 3. Tile i (lo side) pairs with tile i + 2 (hi side).
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int row = hr ? r1 : r0;
        if (row >= n) continue;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int dl = lo + j * 8 + 2 * tq, dh = dl + half;
          float va[2], vb[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            va[e] = __fmul_rn(__fadd_rn(acc[j][2 * hr + e], __ldg(mean + dl + e)), __ldg(isc + dl + e));
            vb[e] = __fmul_rn(__fadd_rn(acc[j + 2][2 * hr + e], __ldg(mean + dh + e)), __ldg(isc + dh + e));
          }
          if (rope) {
            const int64_t pos = tb.tok0 + t0 + row;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const size_t r = size_t(pos) * half + size_t((dl + e) % RD);
              rope_one(va[e], vb[e], __ldg(tb.rope_cos + r), __ldg(tb.rope_sin + r), /*remove=*/false);
            }
          }
          const uint32_t wl = uint32_t(f32_to_bf16_dev(va[0])) | uint32_t(f32_to_bf16_dev(va[1])) << 16;
          const uint32_t wh = uint32_t(f32_to_bf16_dev(vb[0])) | uint32_t(f32_to_bf16_dev(vb[1])) << 16;
          __stcs(reinterpret_cast<unsigned int*>(yh + size_t(row) * D + dl), wl);
          __stcs(reinterpret_cast<unsigned int*>(yh + size_t(row) * D + dh), wh);
        }
      }
    }
  }
}

template <int D, typename CodeT>
__global__ void __launch_bounds__(kProjThreads, 3) decode_fused_kernel(DeviceTables tb, const uint8_t* __restrict__ in,
                                                                    uint64_t in_size,
                                                                    const uint64_t* __restrict__ offsets,
                                                                    int64_t tokens, int64_t nb, int head0,
                                                                    int64_t groups_per_head, int tables_in_smem,
                                                                    size_t table_bytes, uint8_t* __restrict__ bad,
                                                                    int* __restrict__ err, uint16_t* __restrict__ y) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int h = head0 + int(blockIdx.x / groups_per_head);
  const int w = threadIdx.x / 32;
  const int64_t blk = (blockIdx.x % groups_per_head) * kFusedStreams + w;
  const uint32_t* cum;
  const CodeT* guide;
  head_tables(tb, h, tables_in_smem, reinterpret_cast<uint32_t*>(smem), cum, guide);
  if (blk >= nb) return;
  CodeT* cs = reinterpret_cast<CodeT*>(smem + table_bytes) + size_t(w) * kT * tb.k_pad;  // this warp's slot
  const int64_t stream = int64_t(h) * nb + blk;
  const int64_t t0 = blk * kT;
  const int n = tokens - t0 < kT ? int(tokens - t0) : kT;
  const bool any = rans_decode_stream(tb, h, cum, guide, in, in_size, offsets[stream], offsets[stream + 1], n, cs);
  if (threadIdx.x % 32 == 0) flag_stream(stream, any, bad, err);
  if (any) return;  // warp-uniform: tokens of a malformed stream are left untouched
  __syncwarp();
  warp_tc_reconstruct<D, CodeT>(tb, h, cs, n, t0, y);
}

// Shared memory of reconstruct_tc_kernel: the coefficients (k_pad x kT, in
// fragment order), then (reused) the fp32 output [kT][D + 4].
size_t tc_smem_bytes(int k_pad, int dim) {
  return std::max(size_t(k_pad) * kT, size_t(kT) * size_t(dim + 4)) * 4;
}

// Shared memory of reconstruct_kernel: the coefficients [k_pad][kTilePad],
// then (reused) the fp32 products [kTile][dim + 4].
size_t rec_smem_bytes(int k_pad, int dim) {
  return std::max(size_t(k_pad) * kTilePad, size_t(kTile) * size_t(dim + 4)) * 4;
}

template <typename T>
T* upload(const std::vector<T>& v, std::vector<void*>& owned) {
  void* p = nullptr;
  const size_t bytes = std::max<size_t>(sizeof(T), v.size() * sizeof(T));
  check_cuda(cudaMalloc(&p, bytes), "cudaMalloc (tables)");
  owned.push_back(p);
  if (!v.empty()) check_cuda(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return static_cast<T*>(p);
}

// Reciprocal of a frequency so that floor(x / f) = umulhi(x, rcp) >> shift
// for every x < 2^31 (f = 1: rcp = 2^32 - 1, shift 0 gives x - 1, and the
// bias absorbs the difference).
uint4 encoder_entry(uint32_t freq, uint32_t cum, uint32_t scale) {
  const uint32_t m = 1u << scale;
  uint4 e;
  if (freq < 2) {
    e.x = ~0u;
    e.y = cum + m - 1;
    e.w = 0;
  } else {
    uint32_t shift = 0;
    while (freq > (1u << shift)) ++shift;
    e.x = uint32_t(((uint64_t(1) << (shift + 31)) + freq - 1) / freq);
    e.y = cum;
    e.w = shift - 1;
  }
  e.z = freq;
  e.w |= (m - freq) << 8;
  return e;
}

}  // namespace

bool cuda_compiled() noexcept { return true; }

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

struct KvtcGpuCodec::Impl {
  FlatKvtcTables flat;
  DeviceTables dev{};
  std::vector<void*> owned;
  int64_t max_tokens = 0;
  bool wide_codes = false;  // some alphabet has > 256 symbols: u16 code slots
  Reconstruction recon = Reconstruction::kExactFp32;
  size_t cum_smem = 0;      // bytes of shared memory per decode CTA for guide + cum tables (0: global)
  uint64_t cap = 0;         // scratch bytes per stream: states + at most 2 bytes per symbol
  uint8_t* scratch = nullptr;
  void* codes = nullptr;    // [n_streams, kT * k_pad] code slots
  uint8_t* bad = nullptr;   // [n_streams] decode flags
  uint64_t* sizes = nullptr;
  uint64_t* scan_out = nullptr;  // [n_streams + 1]
  void* cub_temp = nullptr;
  size_t cub_temp_bytes = 0;
  int* err = nullptr;    // device [2]: flag, first bad stream
  uint64_t* total_host = nullptr;  // pinned
  bool timing = false;
  cudaEvent_t ev[4] = {nullptr, nullptr, nullptr, nullptr};
  int ev_used = 0;

  ~Impl() {
    for (void* p : owned) cudaFree(p);
    if (total_host) cudaFreeHost(total_host);
    for (cudaEvent_t e : ev)
      if (e) cudaEventDestroy(e);
    for (cudaEvent_t e : fork) cudaEventDestroy(e);
    if (side) cudaStreamDestroy(side);
  }
  void mark(int i, cudaStream_t s) {
    if (timing) {
      check_cuda(cudaEventRecord(ev[i], s), "event");
      ev_used = i + 1;
    }
  }
  // Pipelining: the heads are cut into `chunks` ranges; stage 1 of range
  // c + 1 (projection, or rANS decode) runs on the caller's stream while
  // stage 2 of range c (rANS encode, or reconstruction) runs on `side`, so
  // the FFMA-bound and the integer/latency-bound kernels share the SMs.
  int chunks = 1;  // measured: pipelining costs 4-5% since v2 (docs/gpu.md)
  cudaStream_t side = nullptr;
  std::vector<cudaEvent_t> fork;  // [chunks + 1]

  void ensure_side() {
    if (!side) check_cuda(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreate");
    while (fork.size() < size_t(chunks) + 1) {
      cudaEvent_t e;
      check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      fork.push_back(e);
    }
  }
  // Head ranges [c * NH / C, (c + 1) * NH / C); one range when timing phases.
  int n_chunks() const { return timing ? 1 : std::max(1, std::min(chunks, flat.n_heads)); }
  int chunk_head(int c, int C) const { return int(int64_t(c) * flat.n_heads / C); }

  template <typename CodeT>
  void launch_project(const uint16_t* x, int64_t tokens, int h0, int h1, cudaStream_t s) {
    const int64_t nb = n_blocks(tokens, kT), tiles = (nb + 1) / 2;
    const unsigned grid = unsigned(int64_t(h1 - h0) * tiles);
    const size_t smem = size_t(flat.dim) * kTilePad * 4 + 2 * size_t(kT) * flat.k_pad * sizeof(CodeT);
    CodeT* c = static_cast<CodeT*>(codes);
    if (flat.dim == 64)
      project_kernel<64, CodeT><<<grid, kProjThreads, smem, s>>>(dev, x, tokens, nb, tiles, h0, c);
    else
      project_kernel<128, CodeT><<<grid, kProjThreads, smem, s>>>(dev, x, tokens, nb, tiles, h0, c);
    check_cuda(cudaGetLastError(), "project_kernel launch");
  }
  template <typename CodeT>
  void launch_rans_encode(int64_t tokens, int h0, int h1, cudaStream_t s) {
    const int64_t nb = n_blocks(tokens, kT), s0 = int64_t(h0) * nb, s1 = int64_t(h1) * nb;
    rans_encode_kernel<CodeT><<<unsigned((s1 - s0 + kRansWarps - 1) / kRansWarps), 32 * kRansWarps, 0, s>>>(
        dev, static_cast<const CodeT*>(codes), tokens, nb, s0, s1, scratch, cap, sizes);
    check_cuda(cudaGetLastError(), "rans_encode_kernel launch");
  }
  template <typename CodeT>
  void launch_rans_decode(const uint8_t* in, uint64_t in_size, const uint64_t* offsets, int64_t tokens, int h0,
                          int h1, cudaStream_t s) {
    const int64_t nb = n_blocks(tokens, kT), groups = (nb + kRansWarps - 1) / kRansWarps;
    rans_decode_kernel<CodeT><<<unsigned(int64_t(h1 - h0) * groups), 32 * kRansWarps, cum_smem, s>>>(
        dev, in, in_size, offsets, tokens, nb, h0, groups, cum_smem > 0 ? 1 : 0, static_cast<CodeT*>(codes), bad, err);
    check_cuda(cudaGetLastError(), "rans_decode_kernel launch");
  }
  template <typename CodeT>
  void launch_reconstruct(int64_t tokens, int h0, int h1, uint16_t* y, cudaStream_t s) {
    const int64_t nb = n_blocks(tokens, kT), tiles = (nb + 1) / 2;
    const unsigned grid = unsigned(int64_t(h1 - h0) * tiles);
    const CodeT* c = static_cast<const CodeT*>(codes);
    if (recon == Reconstruction::kTf32TensorCores) {
      const size_t tsmem = tc_smem_bytes(flat.k_pad, flat.dim);
      const unsigned sgrid = unsigned(int64_t(h1 - h0) * nb);  // one stream per CTA
      if (flat.dim == 64)
        reconstruct_tc_kernel<64, CodeT><<<sgrid, kProjThreads, tsmem, s>>>(dev, c, bad, tokens, nb, h0, y);
      else
        reconstruct_tc_kernel<128, CodeT><<<sgrid, kProjThreads, tsmem, s>>>(dev, c, bad, tokens, nb, h0, y);
      check_cuda(cudaGetLastError(), "reconstruct_tc_kernel launch");
      return;
    }
    const size_t smem = rec_smem_bytes(flat.k_pad, flat.dim);
    if (flat.dim == 64)
      reconstruct_kernel<64, CodeT><<<grid, kProjThreads, smem, s>>>(dev, c, bad, tokens, nb, tiles, h0, y);
    else
      reconstruct_kernel<128, CodeT><<<grid, kProjThreads, smem, s>>>(dev, c, bad, tokens, nb, tiles, h0, y);
    check_cuda(cudaGetLastError(), "reconstruct_kernel launch");
  }
  // Shared memory of decode_fused_kernel: the head's tables, each warp's codes.
  size_t fused_table_bytes() const { return (cum_smem + 15) / 16 * 16; }
  size_t fused_smem(size_t code_bytes) const {
    return fused_table_bytes() + kFusedStreams * size_t(kT) * size_t(flat.k_pad) * code_bytes;
  }
  template <typename CodeT>
  void launch_fused_decode(const uint8_t* in, uint64_t in_size, const uint64_t* offsets, int64_t tokens, int h0,
                           int h1, uint16_t* y, cudaStream_t s) {
    const int64_t nb = n_blocks(tokens, kT), groups = (nb + kFusedStreams - 1) / kFusedStreams;
    const unsigned grid = unsigned(int64_t(h1 - h0) * groups);
    const size_t smem = fused_smem(sizeof(CodeT));
    const int in_smem = cum_smem > 0 ? 1 : 0;
    if (flat.dim == 64)
      decode_fused_kernel<64, CodeT><<<grid, kProjThreads, smem, s>>>(dev, in, in_size, offsets, tokens, nb, h0, groups,
                                                                     in_smem, fused_table_bytes(), bad, err, y);
    else
      decode_fused_kernel<128, CodeT><<<grid, kProjThreads, smem, s>>>(dev, in, in_size, offsets, tokens, nb, h0,
                                                                      groups, in_smem, fused_table_bytes(), bad, err, y);
    check_cuda(cudaGetLastError(), "decode_fused_kernel launch");
  }

  // Runs stage1(h0, h1, stream) for every range on `stream` and stage2 of the
  // same range on the side stream once stage 1 is done; `stream` then waits
  // for the side stream. One range: both on `stream`, with phase events.
  template <typename F1, typename F2>
  void pipeline(cudaStream_t stream, F1&& stage1, F2&& stage2) {
    const int C = n_chunks();
    if (C == 1) {
      mark(0, stream);
      stage1(0, flat.n_heads, stream);
      mark(1, stream);
      stage2(0, flat.n_heads, stream);
      mark(2, stream);
      return;
    }
    ensure_side();
    for (int c = 0; c < C; ++c) {
      const int h0 = chunk_head(c, C), h1 = chunk_head(c + 1, C);
      stage1(h0, h1, stream);
      check_cuda(cudaEventRecord(fork[size_t(c)], stream), "event");
      check_cuda(cudaStreamWaitEvent(side, fork[size_t(c)], 0), "wait");
      stage2(h0, h1, side);
    }
    check_cuda(cudaEventRecord(fork[size_t(C)], side), "event");
    check_cuda(cudaStreamWaitEvent(stream, fork[size_t(C)], 0), "wait");
  }

  template <typename CodeT>
  void encode_front(const uint16_t* x, int64_t tokens, cudaStream_t stream) {
    pipeline(
        stream, [&](int h0, int h1, cudaStream_t s) { launch_project<CodeT>(x, tokens, h0, h1, s); },
        [&](int h0, int h1, cudaStream_t s) { launch_rans_encode<CodeT>(tokens, h0, h1, s); });
  }
  template <typename CodeT>
  void decode_all(const uint8_t* in, uint64_t in_size, const uint64_t* offsets, int64_t tokens, uint16_t* y,
                  cudaStream_t stream) {
    if (recon == Reconstruction::kTf32TensorCores && fused) {
      // Fused: one kernel per head range (phase timing: one phase).
      pipeline(
          stream,
          [&](int h0, int h1, cudaStream_t s) { launch_fused_decode<CodeT>(in, in_size, offsets, tokens, h0, h1, y, s); },
          [&](int, int, cudaStream_t) {});
      return;
    }
    pipeline(
        stream,
        [&](int h0, int h1, cudaStream_t s) { launch_rans_decode<CodeT>(in, in_size, offsets, tokens, h0, h1, s); },
        [&](int h0, int h1, cudaStream_t s) { launch_reconstruct<CodeT>(tokens, h0, h1, y, s); });
  }
  bool fused = false;  // set_fused_decode: the one-kernel TF32 decode (measured slower; docs/gpu.md)

  void init(FlatKvtcTables tables, int64_t max_tokens);
};

KvtcGpuCodec::KvtcGpuCodec(const std::vector<const kvtc::HeadParams*>& heads, int64_t max_tokens)
    : impl_(std::make_unique<Impl>()) {
  if (device_count() == 0) throw Error(ErrorCode::kUnsupported, "kvtc-gpu: no CUDA device");
  if (max_tokens <= 0) throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: max_tokens must be positive");
  impl_->init(flatten_heads(heads), max_tokens);
}

KvtcGpuCodec::KvtcGpuCodec(const KvtcCalibration& cal, const CalibratedLayout& layout)
    : impl_(std::make_unique<Impl>()) {
  if (device_count() == 0) throw Error(ErrorCode::kUnsupported, "kvtc-gpu: no CUDA device");
  if (layout.max_tokens <= 0) throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: max_tokens must be positive");
  impl_->init(flatten_calibration(cal, layout.layers, layout.batch, layout.max_tokens, layout.sinks, layout.window),
              layout.max_tokens);
}

void KvtcGpuCodec::Impl::init(FlatKvtcTables tables, int64_t max_tokens_) {
  Impl& m = *this;
  m.flat = std::move(tables);
  const FlatKvtcTables& f = m.flat;
  m.dev.scale = upload(f.scale, m.owned);
  m.dev.inv_scale = upload(f.inv_scale, m.owned);
  m.dev.rope = upload(f.rope, m.owned);
  m.dev.rope_cos = upload(f.rope_cos, m.owned);
  m.dev.rope_sin = upload(f.rope_sin, m.owned);
  m.dev.rope_dim = f.rope_dim;
  const int64_t max_tokens = max_tokens_;
  m.dev.n_heads = f.n_heads;
  m.dev.dim = f.dim;
  m.dev.k_pad = f.k_pad;
  m.dev.kept = upload(f.kept, m.owned);
  m.dev.mean = upload(f.mean, m.owned);
  m.dev.basis = upload(f.basis, m.owned);
  m.dev.basis_t = upload(f.basis_t, m.owned);
  {
    // B operand of the tensor-core reconstruction: the basis rounded to
    // nearest TF32 (ties away, as cvt.rna.tf32.f32), laid out per (head,
    // k-step of 8, group of 32 dims) as 32 lanes x 8 registers: lane l holds
    // for its four 8-dim tiles i the m16n8k8 B registers (k = 8ks + l%4 + 4r,
    // n = 32g + 8i + l/4), r = 0, 1, at index 2i + r.
    const int D = f.dim, KP = f.k_pad;
    std::vector<float> frag(f.basis.size());
    for (int h = 0; h < f.n_heads; ++h)
      for (int ks = 0; ks < KP / 8; ++ks)
        for (int g = 0; g < D / 32; ++g)
          for (int l = 0; l < 32; ++l)
            for (int j = 0; j < 8; ++j) {
              const int i = j / 2, r = j % 2;
              const int k = ks * 8 + l % 4 + 4 * r, d = g * 32 + i * 8 + l / 4;
              uint32_t u;
              std::memcpy(&u, &f.basis[(size_t(h) * KP + size_t(k)) * D + size_t(d)], 4);
              if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
              std::memcpy(&frag[((((size_t(h) * (KP / 8) + size_t(ks)) * (D / 32) + size_t(g)) * 32 + size_t(l)) * 8) +
                                size_t(j)],
                          &u, 4);
            }
    m.dev.basis_frag = upload(frag, m.owned);
  }
  m.dev.inv_step = upload(f.inv_step, m.owned);
  m.dev.code_offset = upload(f.code_offset, m.owned);
  m.dev.max_code = upload(f.max_code, m.owned);
  m.dev.step = upload(f.step, m.owned);
  m.dev.recon_offset = upload(f.recon_offset, m.owned);
  // Packed look-up tables: one load per component, one per symbol (encoder);
  // per head the components' cum[0..levels] one after the other (decoder).
  std::vector<uint4> comp(f.scale_bits.size());
  std::vector<uint4> sym_enc(std::max<size_t>(1, f.sym_freq.size()));
  std::vector<uint32_t> cum, head_base;
  std::vector<uint16_t> guide;
  std::vector<uint32_t> guide_base;
  uint64_t max_head = 0, max_guide = 0;
  for (int h = 0; h < f.n_heads; ++h) {
    head_base.push_back(uint32_t(cum.size()));
    guide_base.push_back(uint32_t(guide.size()));
    for (int k = 0; k < f.kept[size_t(h)]; ++k) {
      const size_t q = f.idx(h, k);
      const uint32_t levels = uint32_t(f.max_code[q]) + 1;
      m.wide_codes = m.wide_codes || levels > 256;
      const uint32_t scale = f.scale_bits[q];
      uint32_t lg = 0;
      while ((1u << lg) < levels) ++lg;
      const uint32_t gbits = std::min(std::min(scale, lg + 2), kGuideMaxBits), shift = scale - gbits;
      comp[q] = make_uint4(uint32_t(cum.size()) - head_base.back(), uint32_t(guide.size()) - guide_base.back(),
                           f.sym_base[q], scale | shift << 8);
      for (uint32_t s = 0; s < levels; ++s) {
        const size_t i = f.sym_base[q] + s;
        sym_enc[i] = encoder_entry(f.sym_freq[i], f.sym_cum[i], f.scale_bits[q]);
        cum.push_back(f.sym_cum[i]);
      }
      // guide[j]: the last symbol s with cum[s] <= j << shift (the symbol of
      // the bucket's first slot; the decoder scans up from it).
      uint32_t sym = 0;
      for (uint32_t j = 0; j < (1u << gbits); ++j) {
        const uint32_t x = j << shift;
        while (sym + 1 < levels && f.sym_cum[f.sym_base[q] + sym + 1] <= x) ++sym;
        guide.push_back(uint16_t(sym));
      }
      cum.push_back(1u << f.scale_bits[q]);
      if (cum.size() >= (uint64_t(1) << 32) - 1)
        throw Error(ErrorCode::kUnsupported, "kvtc-gpu: the heads' frequency tables exceed 2^32 entries");
    }
    while (guide.size() % 16) guide.push_back(0);  // 16-byte aligned heads
    if (guide.size() >= (uint64_t(1) << 32) - 16)
      throw Error(ErrorCode::kUnsupported, "kvtc-gpu: the heads' decoder guides exceed 2^32 entries");
    max_head = std::max<uint64_t>(max_head, cum.size() - head_base.back());
    max_guide = std::max<uint64_t>(max_guide, guide.size() - guide_base.back());
  }
  head_base.push_back(uint32_t(cum.size()));
  guide_base.push_back(uint32_t(guide.size()));
  m.dev.comp = upload(comp, m.owned);
  m.dev.sym_enc = upload(sym_enc, m.owned);
  m.dev.cum = upload(cum, m.owned);
  m.dev.head_base = upload(head_base, m.owned);
  m.dev.guide_base = upload(guide_base, m.owned);
  const size_t guide_bytes = size_t(max_guide) * (m.wide_codes ? 2 : 1);
  if (guide.empty()) guide.assign(16, 0);
  if (m.wide_codes) {
    m.dev.guide = upload(guide, m.owned);
  } else {
    m.dev.guide = upload(std::vector<uint8_t>(guide.begin(), guide.end()), m.owned);
  }
  // Tables of up to 48 KiB per head (guide + cum) sit in shared memory (small
  // tables keep many decode CTAs per SM); larger ones are read through the L1.
  const size_t smem = guide_bytes + size_t(max_head) * 4;  // at most the max of the sums
  m.cum_smem = smem <= 48 * 1024 ? smem : 0;
  m.max_tokens = max_tokens;
  m.cap = (kStateBytes + 2ull * kT * uint64_t(f.k_pad) + 15) / 16 * 16;
  // Code slots for a whole number of projection tiles (two streams each).
  const int64_t ns = int64_t(f.n_heads) * ((n_blocks(max_tokens, kT) + 1) / 2 * 2);
  const size_t code_bytes = m.wide_codes ? 2 : 1;
  auto alloc = [&](size_t bytes, const char* what) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, std::max<size_t>(bytes, 16)), what);
    m.owned.push_back(p);
    return p;
  };
  m.scratch = static_cast<uint8_t*>(alloc(size_t(ns) * m.cap, "cudaMalloc (scratch)"));
  m.codes = alloc(size_t(ns) * kT * size_t(f.k_pad) * code_bytes, "cudaMalloc (code slots)");
  m.bad = static_cast<uint8_t*>(alloc(size_t(ns), "cudaMalloc (flags)"));
  m.sizes = static_cast<uint64_t*>(alloc(size_t(ns) * 8, "cudaMalloc (sizes)"));
  m.scan_out = static_cast<uint64_t*>(alloc(size_t(ns + 1) * 8, "cudaMalloc (offsets)"));
  check_cuda(cub::DeviceScan::InclusiveSum(nullptr, m.cub_temp_bytes, m.sizes, m.scan_out + 1, int(ns)), "cub size");
  m.cub_temp = alloc(m.cub_temp_bytes, "cudaMalloc (scan)");
  m.err = static_cast<int*>(alloc(8, "cudaMalloc (errors)"));
  void* p = nullptr;
  check_cuda(cudaMallocHost(&p, 8), "cudaMallocHost");
  m.total_host = static_cast<uint64_t*>(p);
  const int proj_smem = int(size_t(f.dim) * kTilePad * 4 + 2 * size_t(kT) * f.k_pad * code_bytes);
  const int rec_smem = int(rec_smem_bytes(f.k_pad, f.dim));
  const int tc_smem = int(tc_smem_bytes(f.k_pad, f.dim));
  const int fused8 = int(m.fused_smem(1)), fused16 = int(m.fused_smem(2));
  auto attr = [](const void* fn, int bytes) {
    check_cuda(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), "smem attribute");
  };
  if (f.dim == 64) {
    attr(reinterpret_cast<const void*>(project_kernel<64, uint8_t>), proj_smem);
    attr(reinterpret_cast<const void*>(project_kernel<64, uint16_t>), proj_smem);
    attr(reinterpret_cast<const void*>(reconstruct_kernel<64, uint8_t>), rec_smem);
    attr(reinterpret_cast<const void*>(reconstruct_kernel<64, uint16_t>), rec_smem);
    attr(reinterpret_cast<const void*>(reconstruct_tc_kernel<64, uint8_t>), tc_smem);
    attr(reinterpret_cast<const void*>(reconstruct_tc_kernel<64, uint16_t>), tc_smem);
    attr(reinterpret_cast<const void*>(decode_fused_kernel<64, uint8_t>), fused8);
    attr(reinterpret_cast<const void*>(decode_fused_kernel<64, uint16_t>), fused16);
  } else {
    attr(reinterpret_cast<const void*>(project_kernel<128, uint8_t>), proj_smem);
    attr(reinterpret_cast<const void*>(project_kernel<128, uint16_t>), proj_smem);
    attr(reinterpret_cast<const void*>(reconstruct_kernel<128, uint8_t>), rec_smem);
    attr(reinterpret_cast<const void*>(reconstruct_kernel<128, uint16_t>), rec_smem);
    attr(reinterpret_cast<const void*>(reconstruct_tc_kernel<128, uint8_t>), tc_smem);
    attr(reinterpret_cast<const void*>(reconstruct_tc_kernel<128, uint16_t>), tc_smem);
    attr(reinterpret_cast<const void*>(decode_fused_kernel<128, uint8_t>), fused8);
    attr(reinterpret_cast<const void*>(decode_fused_kernel<128, uint16_t>), fused16);
  }
}

KvtcGpuCodec::~KvtcGpuCodec() = default;

int KvtcGpuCodec::n_heads() const { return impl_->flat.n_heads; }
int KvtcGpuCodec::head_dim() const { return impl_->flat.dim; }
int64_t KvtcGpuCodec::n_streams(int64_t tokens) const {
  return int64_t(impl_->flat.n_heads) * n_blocks(coded_tokens(impl_->flat, tokens), kT);
}
uint64_t KvtcGpuCodec::max_encoded_bytes(int64_t tokens) const {
  return raw_offset(uint64_t(n_streams(tokens)) * impl_->cap) + raw_bytes(impl_->flat, tokens);
}
int KvtcGpuCodec::sinks() const { return impl_->flat.sinks; }
int KvtcGpuCodec::window() const { return impl_->flat.window; }

void KvtcGpuCodec::set_fused_decode(bool on) { impl_->fused = on; }

void KvtcGpuCodec::set_phase_timing(bool on) {
  Impl& m = *impl_;
  if (on && !m.ev[0])
    for (cudaEvent_t& e : m.ev) check_cuda(cudaEventCreate(&e), "cudaEventCreate");
  m.timing = on;
  m.ev_used = 0;
}

void KvtcGpuCodec::set_pipeline_chunks(int chunks) {
  if (chunks < 1 || chunks > 1024)
    throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: pipeline chunks = " + std::to_string(chunks) + " (allowed 1..1024)");
  impl_->chunks = chunks;
}

void KvtcGpuCodec::set_reconstruction(Reconstruction r) {
  if (r != Reconstruction::kExactFp32 && r != Reconstruction::kTf32TensorCores)
    throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: unknown reconstruction mode " + std::to_string(int(r)));
  impl_->recon = r;
}

std::vector<double> KvtcGpuCodec::last_phase_ms() const {
  const Impl& m = *impl_;
  std::vector<double> out;
  if (!m.timing) return out;
  for (int i = 1; i < m.ev_used; ++i) {
    check_cuda(cudaEventSynchronize(m.ev[i]), "event sync");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, m.ev[i - 1], m.ev[i]), "event time");
    out.push_back(double(ms));
  }
  return out;
}

namespace {
void check_tokens(int64_t tokens, int64_t max_tokens) {
  if (tokens <= 0 || tokens > max_tokens)
    throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: tokens = " + std::to_string(tokens) + " outside [1, " +
                                                 std::to_string(max_tokens) + "] (max_tokens of the codec)");
}
void check_aligned(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
    throw Error(ErrorCode::kInvalidArgument, std::string("kvtc-gpu: ") + what + " is not 16-byte aligned");
}
}  // namespace


namespace {

// The raw tokens of every head ([NH, seq, D] rows [0, sink_end) and
// [tail_begin, seq)) to or from the packed raw region [NH][raw][D]
// (kvtc_variant.hpp), two strided copies; to_packed says the direction.
void copy_raw(const FlatKvtcTables& f, int64_t seq, uint16_t* kv, uint8_t* packed, bool to_packed,
              cudaStream_t stream) {
  const int64_t coded = coded_tokens(f, seq), sink_end = std::min<int64_t>(seq, f.sinks);
  const int64_t tail_begin = sink_end + coded, raw = seq - coded;
  const size_t row = size_t(f.dim) * 2, pitch_kv = size_t(seq) * row, pitch_raw = size_t(raw) * row;
  for (const auto& [a, e, off] : {std::tuple{int64_t(0), sink_end, size_t(0)},
                                 std::tuple{tail_begin, seq, size_t(sink_end) * row}}) {
    if (e == a) continue;
    uint8_t* kv_p = reinterpret_cast<uint8_t*>(kv) + size_t(a) * row;
    uint8_t* raw_p = packed + off;
    const size_t width = size_t(e - a) * row;
    check_cuda(to_packed ? cudaMemcpy2DAsync(raw_p, pitch_raw, kv_p, pitch_kv, width, size_t(f.n_heads),
                                             cudaMemcpyDefault, stream)
                         : cudaMemcpy2DAsync(kv_p, pitch_kv, raw_p, pitch_raw, width, size_t(f.n_heads),
                                             cudaMemcpyDefault, stream),
               "raw tokens copy");
  }
}

}  // namespace

uint64_t KvtcGpuCodec::encode(const uint16_t* x, int64_t tokens, uint8_t* out, uint64_t capacity, uint64_t* offsets,
                              void* stream_ptr) {
  Impl& m = *impl_;
  check_tokens(tokens, m.max_tokens);
  check_aligned(x, "input x");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t coded = coded_tokens(m.flat, tokens);
  const int64_t ns = n_streams(tokens);
  m.dev.seq = tokens;
  m.dev.tok0 = std::min<int64_t>(tokens, m.flat.sinks);
  uint64_t total = 0;
  if (ns > 0) {
    if (m.wide_codes)
      m.encode_front<uint16_t>(x, coded, stream);
    else
      m.encode_front<uint8_t>(x, coded, stream);
    check_cuda(cudaMemsetAsync(m.scan_out, 0, 8, stream), "memset");
    size_t tb = m.cub_temp_bytes;
    check_cuda(cub::DeviceScan::InclusiveSum(m.cub_temp, tb, m.sizes, m.scan_out + 1, int(ns), stream), "scan");
    check_cuda(cudaMemcpyAsync(m.total_host, m.scan_out + ns, 8, cudaMemcpyDeviceToHost, stream), "total");
    check_cuda(cudaStreamSynchronize(stream), "encode (sizes)");
    total = *m.total_host;
  } else {
    check_cuda(cudaMemsetAsync(m.scan_out, 0, 8, stream), "memset");
  }
  const uint64_t raw = raw_bytes(m.flat, tokens);
  const uint64_t end = raw > 0 ? raw_offset(total) + raw : total;
  if (end > capacity)
    throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu encode: output needs " + std::to_string(end) +
                                                 " bytes, capacity is " + std::to_string(capacity));
  if (ns > 0) {
    pack_kernel<<<unsigned((ns + 7) / 8), 256, 0, stream>>>(m.scratch, m.cap, m.sizes, m.scan_out, out, ns);
    check_cuda(cudaGetLastError(), "pack_kernel launch");
  }
  if (raw > 0) {
    if (raw_offset(total) > total) check_cuda(cudaMemsetAsync(out + total, 0, raw_offset(total) - total, stream), "pad");
    copy_raw(m.flat, tokens, const_cast<uint16_t*>(x), out + raw_offset(total), /*to_packed=*/true, stream);
  }
  check_cuda(cudaMemcpyAsync(offsets, m.scan_out, size_t(ns + 1) * 8, cudaMemcpyDefault, stream), "offsets");
  m.mark(3, stream);
  return end;
}

void KvtcGpuCodec::decode(const uint8_t* in, uint64_t in_size, const uint64_t* offsets, int64_t tokens, uint16_t* y,
                          void* stream_ptr) {
  Impl& m = *impl_;
  check_tokens(tokens, m.max_tokens);
  check_aligned(y, "output y");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const uint64_t raw = raw_bytes(m.flat, tokens);
  if (in_size < raw || (raw > 0 && (in_size - raw) % 16 != 0))
    throw Error(ErrorCode::kFormat, "kvtc-gpu decode: " + std::to_string(in_size) + " bytes cannot hold the " +
                                        std::to_string(raw) + " bytes of raw sinks and window (16-byte aligned)");
  const uint64_t streams_size = in_size - raw;  // the streams end at or before the raw tokens
  const int init[2] = {0, 0x7fffffff};
  check_cuda(cudaMemcpyAsync(m.err, init, 8, cudaMemcpyHostToDevice, stream), "reset errors");
  m.dev.seq = tokens;
  m.dev.tok0 = std::min<int64_t>(tokens, m.flat.sinks);
  const int64_t coded = coded_tokens(m.flat, tokens);
  if (coded > 0) {
    if (m.wide_codes)
      m.decode_all<uint16_t>(in, streams_size, offsets, coded, y, stream);
    else
      m.decode_all<uint8_t>(in, streams_size, offsets, coded, y, stream);
  }
  if (raw > 0) copy_raw(m.flat, tokens, y, const_cast<uint8_t*>(in) + streams_size, /*to_packed=*/false, stream);
}

void KvtcGpuCodec::check_errors(void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  int h[2] = {0, 0};
  check_cuda(cudaMemcpyAsync(h, impl_->err, 8, cudaMemcpyDeviceToHost, stream), "read errors");
  check_cuda(cudaStreamSynchronize(stream), "decode");
  if (h[0]) throw Error(ErrorCode::kFormat, "kvtc-gpu decode: stream " + std::to_string(h[1]) + " is malformed");
}

}  // namespace kvcodec::gpu

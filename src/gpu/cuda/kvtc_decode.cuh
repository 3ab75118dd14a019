// Decode kernels of kvtc-gpu (design: the header of kvtc_gpu.cu).
#pragma once

#include <algorithm>
#include <type_traits>

#include "gpu/cuda/kvtc_device.cuh"

namespace kvcodec::gpu {
namespace {

// ---------------------------------------------------------------- decode ---

// Bytes of shared memory per decode warp for its stream (kStaged): the
// stream's bytes are read there with 16-byte loads all in flight at once,
// so the byte fetches of the decode loop are shared loads with 32-bit
// addresses instead of global loads with 64-bit ones. A stream larger than
// this (the calibrated dump's average 1.6 KB) is read from global memory.
// With 8 streams (warps) per CTA, H100, the calibrated bench batch: rANS
// decode 0.82 -> 0.75 ms; 4096 bytes with 4 warps per CTA (7 CTAs per SM
// by shared memory) was slower than no stage (0.89 vs 0.83 ms).
constexpr uint32_t kRansStageBytes = 2560;
// Streams (warps) per decode CTA: 16 since kvtc-gpu/4, whose slot tables
// (up to ~30 KB per head on the shipped calibration) would leave 8-warp CTAs
// at 4 per SM by shared memory.
constexpr int kRansDecodeWarps = 16;

// Where the integer reconstruction (kvtc_recon_int.cuh) wants its codes:
// "code words", word (j, t) = components 4j .. 4j + 3 of token t (byte i
// = component 4j + i), the m16n8k32 A operand's register as it is, rows
// j < ceil(K / 4) of kT words. kCodeWords: in global memory, row-major
// (word j * kT + t: a warp's 32 tokens are one 128-byte store).
// kSwizzledWords: in shared memory, each row's tokens permuted within
// their 32-token half (code_word_index), so that the A loads of a warp
// (rows j + q, tokens g + const) and the rANS stores (one row, 32 tokens)
// both hit 32 distinct banks.
enum CodeLayout { kCodeBytes = 0, kCodeWords = 1, kSwizzledWords = 2 };

// Shared-memory loads at 32-bit shared-window addresses (smem_addr): a
// per-component base plus the index is one add per look-up (generic
// pointers left the compiler adding the table's offset and the shared base
// per step).
__device__ __forceinline__ uint32_t lds_u8(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ uint32_t lds_u16(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ uint32_t lds_u32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ uint4 lds_u128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
template <int kLayout>
__device__ __forceinline__ int code_word_index(int j, int t) {
  if constexpr (kLayout == kSwizzledWords) return j * kT + (t ^ (8 * ((j + (t >> 5)) & 3)));
  return j * kT + t;
}

// One warp decodes one stream (n tokens) of head h into cs ([K][kT] codes,
// component-major; global or shared memory) with the head's cum tables and
// guide at cum / guide. With kStaged, stage is the warp's kRansStageBytes
// of shared memory and the stream fits it (size + 32 <= kRansStageBytes: whole 16-byte words).
// kFull: n == kT (every lane of every pass decodes: no per-step predicate).
// kLayout: kCodeBytes, cs is [K][kT] codes (component-major); else cs is
// code words (u8 codes only; kCodeWords in global memory, kSwizzledWords
// in shared memory), each lane's 4 codes of a row stored as one word.
// kDirect: the tables are DeviceTables::direct's (guide = the slot table,
// cum = spans). Returns whether the stream is malformed (the same on every lane).
template <typename CodeT, bool kStaged = false, bool kFull = false, int kLayout = kCodeBytes, bool kDirect = false,
          bool kSharedTables = false>
__device__ __forceinline__ bool rans_decode_stream(const DeviceTables& tb, int h, const uint32_t* cum,
                                                   const CodeT* guide, const uint8_t* __restrict__ in,
                                                   uint64_t in_size, uint64_t start, uint64_t end, int n,
                                                   CodeT* cs, uint8_t* stage = nullptr,
                                                   const uint4* desc = nullptr) {
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
    const uint64_t size = end - start;
    const uint8_t* data = in + start;
    if constexpr (kStaged) {
      // The aligned 16-byte words holding the stream's bytes (the first and
      // last may hold a neighbour's), each one load; a word reaching outside
      // the input buffer (its first or last) is read byte by byte, inside.
      const uintptr_t a = reinterpret_cast<uintptr_t>(data), a0 = a & ~uintptr_t(15);
      const uintptr_t lo = reinterpret_cast<uintptr_t>(in), hi = lo + in_size;
      const uint32_t words = uint32_t((a - a0 + size + 15) / 16);
      const uint4* src = reinterpret_cast<const uint4*>(a0);
      for (uint32_t i = lane; i < words; i += 32) {
        const uintptr_t wa = a0 + 16 * uintptr_t(i);
        if (wa >= lo && wa + 16 <= hi) {
          reinterpret_cast<uint4*>(stage)[i] = __ldg(src + i);
        } else {
          for (int b = 0; b < 16; ++b)
            stage[16 * i + b] = wa + b >= lo && wa + b < hi ? __ldg(reinterpret_cast<const uint8_t*>(wa + b)) : 0;
        }
      }
      __syncwarp();
      data = stage + (a - a0);
    }
    uint32_t st = uint32_t(data[4 * lane]) | uint32_t(data[4 * lane + 1]) << 8 | uint32_t(data[4 * lane + 2]) << 16 |
                  uint32_t(data[4 * lane + 3]) << 24;
    const int passes = kFull ? kT / 32 : (n + 31) / 32;
    // A valid stream has at most 2 bytes per symbol after the states, so the
    // size fits 32 bits from here on; every failure below is warp-uniform.
    // An odd size is malformed too (a stream is its states and 16-bit
    // words), and refusing it keeps every word's place even.
    fail = __any_sync(0xffffffffu, st < kVariantRansLow || st >= kVariantRansHigh) ||
           size > kStateBytes + 2ull * uint64_t(n) * uint64_t(K) || (size & 1);
    const uint32_t size32 = uint32_t(size), lastw = size32 / 2 - 1;
    uint32_t posw = kStateBytes / 2;
    const uint32_t data_s = kStaged ? smem_addr(data) : 0;
    // Component-outer loops (one table entry per component, not per step)
    // and no truncation branch per step: reads are clamped to the stream's
    // last byte and a stream that ran past its end ends with pos > size,
    // which the final check reports (pos only grows).
    static_assert(kLayout == kCodeBytes || sizeof(CodeT) == 1, "code words hold 8-bit codes");
    uint32_t* words = reinterpret_cast<uint32_t*>(cs);
    uint32_t word[kT / 32] = {};  // code words: each pass's codes of the row so far
    // The rest of a decode step once the symbol (base) and the next state
    // are known: the code out, then the renormalisation. out: component k's
    // slot of token lane (kCodeBytes).
    const auto finish_step = [&](int pass, bool active, uint32_t base, uint32_t next, CodeT* out) {
      if (active) st = next;
      if constexpr (kLayout == kCodeBytes) {
        if (active) out[pass * 32] = CodeT(base);
      } else {
        // Code words: the code (< 256) in at the top byte, the earlier
        // ones shifted down a byte (one funnel shift; after 4 components
        // component 4j + i sits in byte i). Lanes past n: a slot no one reads.
        word[pass] = __funnelshift_r(word[pass], base, 8);
      }
      // One word while st < 2^15 (since kvtc-gpu/3): one ballot and its
      // prefix count place it, read at a clamped place (size >= 128).
      // Places count 16-bit words (posw: the next unread word).
      const bool one = active && st < kVariantRansLow;
      const unsigned b = __ballot_sync(0xffffffffu, one);
      const uint32_t at = min(posw + __popc(b & lt_mask), lastw);
      posw += __popc(b);
      if constexpr (kStaged) {
        // One 16-bit shared load (a staged stream sits at an even
        // address), kept by a select.
        const uint32_t w = lds_u16(data_s + 2 * at);
        st = one ? st << 16 | w : st;
      } else if (one) {
        st = st << 16 | uint32_t(data[2 * at]) | uint32_t(data[2 * at + 1]) << 8;
      }
    };
    // Row j's code words out (its m components' codes shifted down to bytes
    // 0 .. m - 1), and the words cleared for the next row.
    const auto store_words = [&](int j, int m) {
      if constexpr (kLayout != kCodeBytes) {
        const uint32_t down = 8 * uint32_t(4 - m);
#pragma unroll
        for (int pass = 0; pass < kT / 32; ++pass) {
          if (pass < passes) words[code_word_index<kLayout>(j, pass * 32 + lane)] = word[pass] >> down;
          word[pass] = 0;
        }
      }
    };
    if constexpr (kDirect && kSharedTables) {
      // Tables and descriptors in shared memory (rans_decode_kernel): per
      // component one 16-byte look-up of {slot table, spans, mask, scale}
      // at 32-bit shared addresses, a row of 4 components unrolled with its
      // code words stored once. Per component this drops the global entry's
      // 64-bit pointer, the mask's shifts, the table addresses and the
      // per-component predicated stores (ncu, H100: 33 of a component's
      // ~75 instructions were such).
      static_assert(sizeof(CodeT) == 1, "u8 slot tables");
      const uint32_t desc_s = smem_addr(desc);
      const int rows = (K + 3) / 4;
      for (int j = 0; j < rows && !fail; ++j) {
        const int m = min(4, K - 4 * j);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (i > 0 && i >= m) break;  // uniform: a short last row
          const uint4 d = lds_u128(desc_s + 16 * uint32_t(4 * j + i));
          CodeT* out = cs + lane + (4 * j + i) * kT;
#pragma unroll
          for (int pass = 0; pass < kT / 32; ++pass) {
            if (pass >= passes) break;
            const bool active = kFull || pass * 32 + lane < n;
            const uint32_t slot = st & d.z;
            // The slot's symbol, then its span {cum | freq << 16}.
            const uint32_t base = lds_u8(d.x + slot), span = lds_u32(d.y + 4 * base);
            finish_step(pass, active, base, (span >> 16) * (st >> d.w) + slot - (span & 0xffffu), out);
          }
        }
        store_words(j, m);
      }
    } else {
      const uint4* comp = tb.comp + size_t(h) * tb.k_pad;
      // The next component's entry is loaded a component ahead, off the
      // state's dependency chain. Component k's slot of token lane (+32 per
      // pass), kept as a running pointer.
      CodeT* out = cs + lane;
      uint4 c_next = __ldg(comp);
      const uint4* comp_next = comp + 1;  // a running pointer: no 64-bit index arithmetic per component
      for (int k = 0; k < K && !fail; ++k, out += kT) {
        const uint4 c = c_next;  // the same for every lane
        if (k + 1 < K) c_next = __ldg(comp_next++);
        const uint32_t scale = c.w & 0xffu, mask = (1u << scale) - 1u, gshift = c.w >> 8;
        const uint32_t* ck = cum + c.x;
        const CodeT* gk = guide + c.y;
#pragma unroll
        for (int pass = 0; pass < kT / 32; ++pass) {
          if (pass >= passes) break;
          // Lanes past n (a ragged last stream) look their unchanged state up
          // too (in range: slot < 2^scale) and keep it: predicated, no branch.
          const bool active = kFull || pass * 32 + lane < n;
          const uint32_t slot = st & mask;
          uint32_t base, next;
          if constexpr (kDirect) {
            // The slot's symbol, then its span {cum | freq << 16}: two look-ups.
            base = gk[slot];
            const uint32_t span = ck[base];
            next = (span >> 16) * (st >> scale) + slot - (span & 0xffffu);
          } else {
            base = gk[slot >> gshift];
            // The bucket's first symbol, then one step up without a branch
            // (with 32 lanes some lane's bucket holds a boundary below its
            // slot at most warp steps; after this step the loop below still
            // runs at 40% of them, ncu, H100). cum[base + 2] may be one word
            // past the component's table (the next table's or the guide's
            // first, or the pad word after the last head) and is then not
            // taken, as hi = cum[levels] > slot.
            uint32_t lo = ck[base], hi = ck[base + 1];
            const uint32_t hi2 = ck[base + 2];
            const bool up = hi <= slot;
            base += up ? 1u : 0u;
            lo = up ? hi : lo;
            hi = up ? hi2 : hi;
            while (hi <= slot) lo = hi, hi = ck[++base + 1];  // rare; ends: cum[levels] = 2^scale > slot
            next = (hi - lo) * (st >> scale) + slot - lo;
          }
          finish_step(pass, active, base, next, out);
        }
        if ((k & 3) == 3 || k + 1 == K) store_words(k >> 2, (k & 3) + 1);  // the row's last component
      }
    }
    if (!fail && (2 * posw != size32 || st != kVariantRansLow)) fail = 1;
  }
  return __any_sync(0xffffffffu, fail);
}

// rans_decode_stream with kFull picked from n (a full stream drops the
// per-step lane predicate).
template <typename CodeT, bool kStaged, int kLayout = kCodeBytes, bool kDirect = false, bool kSharedTables = false>
__device__ __forceinline__ bool rans_decode_any_stream(const DeviceTables& tb, int h, const uint32_t* cum,
                                                       const CodeT* guide, const uint8_t* __restrict__ in,
                                                       uint64_t in_size, uint64_t start, uint64_t end, int n,
                                                       CodeT* cs, uint8_t* stage = nullptr,
                                                       const uint4* desc = nullptr) {
  return n == kT ? rans_decode_stream<CodeT, kStaged, true, kLayout, kDirect, kSharedTables>(
                       tb, h, cum, guide, in, in_size, start, end, n, cs, stage, desc)
                 : rans_decode_stream<CodeT, kStaged, false, kLayout, kDirect, kSharedTables>(
                       tb, h, cum, guide, in, in_size, start, end, n, cs, stage, desc);
}

// f(std::bool_constant<tb.direct>{}): the decode step's form as a
// compile-time constant (uniform over the launch).
template <typename F>
__device__ __forceinline__ auto with_direct_tables(const DeviceTables& tb, F&& f) {
  return tb.direct ? f(std::true_type{}) : f(std::false_type{});
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

// A CTA decodes kRansDecodeWarps consecutive blocks of one head, one per warp, with
// the head's guide and cumulative-frequency tables in shared memory (or read
// from global memory when they do not fit). The symbol of a slot is found by
// a direct look-up: the guide gives the symbol of the slot's bucket start (the
// top gbits bits of the slot), then a linear scan over cum moves up past the
// bucket's symbol boundaries (usually none: >= 4 buckets per symbol). This
// replaced a binary search of ceil(log2(levels)) dependent shared loads per
// symbol; the result is the same symbol (the one s with cum[s] <= slot <
// cum[s+1]), so bytes and codes are unchanged. Where the tables sit is a
// template parameter: with it known, the look-ups compile to shared loads
// with 32-bit addresses (LDS), not generic 64-bit ones.
template <typename CodeT, bool kTablesInSmem>
__global__ void __launch_bounds__(32 * kRansDecodeWarps) rans_decode_kernel(DeviceTables tb, const uint8_t* __restrict__ in,
                                                                      uint64_t in_size,
                                                                      const uint64_t* __restrict__ offsets,
                                                                      int64_t tokens, int64_t nb, int head0,
                                                                      int64_t groups_per_head,
                                                                      uint32_t stage_offset, int code_words,
                                                                      CodeT* __restrict__ codes,
                                                                      uint8_t* __restrict__ bad, int* __restrict__ err) {
  extern __shared__ __align__(16) uint32_t ssm[];
  const int h = head0 + int(blockIdx.x / groups_per_head);
  const int64_t blk = (blockIdx.x % groups_per_head) * kRansDecodeWarps + threadIdx.x / 32;
  const uint32_t* cum;
  const CodeT* guide;
  head_tables(tb, h, kTablesInSmem ? 1 : 0, ssm, cum, guide);
  // With the tables in shared memory and whole (direct): each component's
  // descriptor {slot table, spans (shared addresses), mask, scale} past the
  // warps' stages, so a decode step's component needs one shared look-up.
  uint4* desc = reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(ssm) + stage_offset +
                                         size_t(kRansDecodeWarps) * kRansStageBytes);
  if constexpr (kTablesInSmem && sizeof(CodeT) == 1) {
    if (tb.direct) {  // uniform over the launch
      const uint4* comp = tb.comp + size_t(h) * tb.k_pad;
      for (int k = int(threadIdx.x); k < tb.kept[h]; k += int(blockDim.x)) {
        const uint4 c = __ldg(comp + k);
        const uint32_t scale = c.w & 0xffu;
        desc[k] = make_uint4(smem_addr(guide + c.y), smem_addr(cum + c.x), (1u << scale) - 1u, scale);
      }
      __syncthreads();
    }
  }
  if (blk >= nb) return;
  const int64_t stream = int64_t(h) * nb + blk;
  const int64_t t0 = blk * kT;
  const int n = block_tokens(tokens, t0, kT);
  const uint64_t start = offsets[stream], end = offsets[stream + 1];
  CodeT* cs = codes + size_t(stream) * kT * tb.k_pad;
  bool any;
  // code_words: the integer reconstruction's heads get their codes as code
  // words (kvtc_recon_int.cuh); the others, as [K][kT] codes.
  const auto decode = [&](auto layout) {
    constexpr int L = decltype(layout)::value;
    return with_direct_tables(tb, [&](auto direct) {
      constexpr bool kDirect = decltype(direct)::value;
      // Staged where the stream starts at an even address (every stream of a
      // payload at an even address: their sizes are even), so that the
      // renormalisation words are single 16-bit loads.
      if (kRansStageBytes > 0 && start <= end && end - start + 32 <= kRansStageBytes &&
          ((reinterpret_cast<uintptr_t>(in) + start) & 1) == 0) {
        uint8_t* stage = reinterpret_cast<uint8_t*>(ssm) + stage_offset + (threadIdx.x / 32) * kRansStageBytes;
        return rans_decode_any_stream<CodeT, true, L, kDirect, kTablesInSmem && sizeof(CodeT) == 1>(
            tb, h, cum, guide, in, in_size, start, end, n, cs, stage, desc);
      }
      return rans_decode_stream<CodeT, false, false, L, kDirect>(tb, h, cum, guide, in, in_size, start, end, n, cs);
    });
  };
  if constexpr (sizeof(CodeT) == 1) {
    any = code_words && tb.recon_int[h] ? decode(std::integral_constant<int, kCodeWords>{})
                                        : decode(std::integral_constant<int, kCodeBytes>{});
  } else {
    any = decode(std::integral_constant<int, kCodeBytes>{});
  }
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
  const int n = block_tokens(tokens, t0, kTile);
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
    for (int k = 0; k < K; ++k) fma_tile_8x8(acc, vs + k * kTilePad + tg * 8, bs + size_t(k) * D + dg * 8);
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
// registers in two halves of 4, each half of the warp's lanes contiguous:
// two 512-byte warp loads), the coefficients in
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
  // Row stride of the fp32 output staging: rows 8 banks apart, so each
  // half warp's 64-bit accumulator stores (rows g, columns 2 (l % 4)) hit 32
  // distinct banks (D + 4 made them collide two ways).
  constexpr int kOutPad = D + 8;
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
      // The warp's 32 lanes hold 8 k x 4 tiles (lane = 4 (k % 8) + tile);
      // at step e a lane stores token tq + (e ^ sw) of its 16, sw = {0, 1,
      // 8, 9}[tile], so the 4 lanes of one k differ in t % 2 and t % 16 / 8
      // (a_frag_index's bank is 16 (t % 2) + 4 (k % 4) + 2 (k % 8 / 4) +
      // t % 16 / 8): 32 distinct banks per store (in plain e order the 4
      // tiles of a k hit one bank).
      constexpr int per_word = 4 / int(sizeof(CodeT));
      constexpr uint32_t code_mask = sizeof(CodeT) == 1 ? 0xffu : 0xffffu;
      const int tile = tq / 16, sw = (tile & 1) | (tile & 2) << 2;
      // a_frag_index(tq + tt, k) = base + f(tt), f(tt) = 16 (tt % 8) + tt / 8
      // and base on other bits, so for tt = e ^ sw it is (base | f(sw)) ^
      // f(e): one XOR with a constant per code.
      const int fixed = a_frag_index(tq, k) | ((sw & 1) * 16 + (sw >> 3));
      // The 16 codes permuted once so that slot e holds code e ^ sw: the 8s
      // bit of the index swaps the halves of w, its 1s bit neighbouring codes
      // within each word (one byte permute with a per-lane selector).
      constexpr int W = 4 * kVec;  // words of 16 codes
      const uint32_t swap_sel = (sw & 1) ? (sizeof(CodeT) == 1 ? 0x2301u : 0x1032u) : 0x3210u;
      uint32_t v[W];
#pragma unroll
      for (int i = 0; i < W; ++i) v[i] = __byte_perm((sw & 8) ? w[i ^ (W / 2)] : w[i], 0u, swap_sel);
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const uint32_t code = (v[e / per_word] >> (8 * int(sizeof(CodeT)) * (e % per_word))) & code_mask;
        vs[fixed ^ (16 * (e % 8) + e / 8)] = k < K ? to_tf32(__fmul_rn(__fsub_rn(float(code), off[u]), stp[u])) : 0.0f;
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
  const float4* bsrc = reinterpret_cast<const float4*>(tb.basis_frag) + (size_t(h) * (KP / 8) * NG + ng) * 64 + lane;
  const float4* asrc = reinterpret_cast<const float4*>(vs) + wm * MT * 32 + lane;
#pragma unroll 2
  for (int ks = 0; ks < K8 / 8; ++ks) {
    const float4 b01 = __ldg(bsrc + size_t(ks) * NG * 64), b23 = __ldg(bsrc + size_t(ks) * NG * 64 + 32);
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

// The stream of a CTA of the one-stream-per-CTA kernels (grid: nb streams
// of each head from head0): its head, index, first token and token count.
struct CtaStream {
  int h;
  int64_t stream, t0;
  int n;
};
__device__ __forceinline__ CtaStream cta_stream(int64_t tokens, int64_t nb, int head0) {
  const int h = head0 + int(blockIdx.x / nb);
  const int64_t blk = blockIdx.x % nb, t0 = blk * kT;
  return {h, int64_t(h) * nb + blk, t0, block_tokens(tokens, t0, kT)};
}

// One stream (64 tokens) per CTA, 4 CTAs per SM (one CTA's code loads
// overlap another's MMAs).
template <int D, typename CodeT>
__global__ void __launch_bounds__(kProjThreads, 4) reconstruct_tc_kernel(DeviceTables tb, const CodeT* __restrict__ codes,
                                                                      const uint8_t* __restrict__ bad, int64_t tokens,
                                                                      int64_t nb, int head0, uint16_t* __restrict__ y) {
  extern __shared__ __align__(16) unsigned char smem[];
  const CtaStream s = cta_stream(tokens, nb, head0);
  if (bad[s.stream]) return;  // tokens of a malformed stream are left untouched
  tc_reconstruct_stream<D, CodeT>(tb, s.h, codes + size_t(s.stream) * kT * tb.k_pad, s.n, s.t0, y,
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
  const float4* frag = reinterpret_cast<const float4*>(tb.basis_frag) + size_t(h) * (KP / 8) * NG * 64 + lane;
  uint16_t* yh = y + (size_t(h) * size_t(tb.seq) + size_t(tb.tok0 + t0)) * D;
  for (int p = 0; p < D / 32; ++p) {
    const int lo = (p / (RD / 32)) * RD + (p % (RD / 32)) * 16, hi = lo + half;
    // This lane's B registers of tiles [lo, lo+16) and [hi, hi+16): one
    // float4 of its 8 registers in the 32-dim group of each.
    const float4* blo = frag + (lo / 32) * 64 + (lo % 32) / 16 * 32;
    const float4* bhi = frag + (hi / 32) * 64 + (hi % 32) / 16 * 32;
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
            const int64_t pos = tb.pos0 + tb.tok0 + t0 + row;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const size_t r = size_t(pos) * half + size_t((dl + e) % RD);
              rope_one(va[e], vb[e], __ldg(tb.rope_cos + r), __ldg(tb.rope_sin + r), /*remove=*/false);
            }
          }
          const uint32_t wl = pack_bf16x2(va[0], va[1]), wh = pack_bf16x2(vb[0], vb[1]);
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
  const int n = block_tokens(tokens, t0, kT);
  const bool any = with_direct_tables(tb, [&](auto direct) {
    return rans_decode_stream<CodeT, false, false, kCodeBytes, decltype(direct)::value>(
        tb, h, cum, guide, in, in_size, offsets[stream], offsets[stream + 1], n, cs);
  });
  if (threadIdx.x % 32 == 0) flag_stream(stream, any, bad, err);
  if (any) return;  // warp-uniform: tokens of a malformed stream are left untouched
  __syncwarp();
  warp_tc_reconstruct<D, CodeT>(tb, h, cs, n, t0, y);
}

// Shared memory of reconstruct_tc_kernel: the coefficients (k_pad x kT, in
// fragment order), then (reused) the fp32 output [kT][D + 8].
size_t tc_smem_bytes(int k_pad, int dim) {
  return std::max(size_t(k_pad) * kT, size_t(kT) * size_t(dim + 8)) * 4;
}

// Shared memory of reconstruct_kernel: the coefficients [k_pad][kTilePad],
// then (reused) the fp32 products [kTile][dim + 4].
size_t rec_smem_bytes(int k_pad, int dim) {
  return std::max(size_t(k_pad) * kTilePad, size_t(kTile) * size_t(dim + 4)) * 4;
}

}  // namespace
}  // namespace kvcodec::gpu

// CUDA kernels of the kvtc-gpu/4 variant (contract: src/gpu/kvtc_variant.hpp).
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
//   project_int_kernel  the same tiles for heads with the integer
//                   projection (kvtc_project_int.cuh: the CPU codec's 8-bit
//                   products for the rows the gate takes on calibrated heads,
//                   its int16 ones otherwise, exact on the tensor cores);
//                   project_kernel then codes only the heads without it.
//   rans_encode_kernel  one warp per stream: 32 lanes, steps in reverse; at
//                   each step every lane codes the same component (one table),
//                   reciprocal multiply instead of division (exact for states
//                   < 2^31), one 16-byte table entry per symbol, branch-free
//                   steps (predicated byte stores); bytes written backwards
//                   into the stream's scratch slot.
//   scan of the sizes (cub); a wait for the total only where out may be too
//   small; pack_kernel copies the slots to the output (aligned 4-byte words
//   of the output, each a funnel shift of two source words).
// decode
//   rans_decode_kernel  one warp per stream, 16 streams of one head per CTA,
//                   the head's cum tables and decoder guide in shared memory,
//                   each stream's bytes copied there first (<= 2.5 KB);
//                   symbol by one look-up in the component's slot table
//                   (kvtc-gpu/4 tables have at most 10 bits for 8-bit
//                   codes: 256-1024 bytes, in shared memory), then its span
//                   {cum, freq}; tables wider than 10 bits keep a guide of
//                   >= 4 buckets per symbol and a short scan up cum (v2.0's
//                   4096-entry slot tables in global memory were bound by L1
//                   throughput; a binary search cost 2.49 vs 1.58 ms);
//                   with the tables in shared memory and whole, each
//                   component's descriptor {slot table, spans, mask,
//                   scale} sits there too (one 16-byte look-up per
//                   component, rows of 4 components unrolled);
//                   codes to the code slots ([K][64] per stream, or for
//                   the integer reconstruction's heads "code words", a
//                   token's 4 components in one 32-bit word); a malformed
//                   stream sets a per-stream flag.
//   reconstruct_kernel  CTA of 256 threads per (head, 128 tokens): codes ->
//                   dequantized [K, 128] in shared; 8x8 register tiles, k
//                   ascending; bf16 stored 16 bytes at a time. Tokens of a
//                   flagged stream are left untouched.
//   reconstruct_tc_kernel  (set_reconstruction(kTf32TensorCores)) the same
//                   product on tensor cores: one stream per CTA, mma.sync
//                   m16n8k8 TF32 with both operands in fragment order (the
//                   basis pre-swizzled on the host); within a stated bound of
//                   the exact path, not bit-exact (comment at the kernel).
//   reconstruct_int_kernel  (set_reconstruction(kInteger), u8 codes) the CPU
//                   codec's integer reconstruction (kvtc_recon_int.cuh): the
//                   codes are the A operand of u8 x s8 / u8 x u8 mma.sync
//                   m16n8k32 as they are, exact int32 sums; equal to the CPU
//                   codec's outputs. 16 streams of one head per CTA, each
//                   warp's B fragments (one RoPE pair of 8-dim tiles) held
//                   in registers across them, the weights and RoPE applied
//                   in registers. Heads without its tables: the TF32
//                   product in the same CTA.
//   decode_int_fused_kernel  (kInteger with set_fused_decode(true), every
//                   head on the integer tables, u8 codes) one kernel: each
//                   warp rANS-decodes a stream into shared memory, then the
//                   CTA reconstructs its 8 streams from there (measured
//                   slower than the two kernels: docs/gpu.md).
#include <algorithm>
#include <cmath>
#include <cuda_runtime.h>
#include <mma.h>

#include <cub/device/device_scan.cuh>
#include <cstring>
#include <string>
#include <tuple>

#include "gpu/kvtc_variant.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/gpu.hpp"

#include "gpu/cuda/kvtc_decode.cuh"
#include "gpu/cuda/kvtc_encode.cuh"
#include "gpu/cuda/kvtc_project_int.cuh"
#include "gpu/cuda/kvtc_recon_int.cuh"

namespace kvcodec::gpu {
namespace {

// The device error record {flag, first bad stream} with nothing reported.
constexpr int kNoErrors[2] = {0, 0x7fffffff};

template <typename T>
T* upload(const std::vector<T>& v, std::vector<void*>& owned) {
  void* p = nullptr;
  const size_t bytes = std::max<size_t>(sizeof(T), v.size() * sizeof(T));
  check_cuda(cudaMalloc(&p, bytes), "cudaMalloc (tables)");
  owned.push_back(p);
  if (!v.empty()) check_cuda(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return static_cast<T*>(p);
}

// Lane l's m16n8k32 B fragment of a byte matrix (byte(inner, col)) at
// k-step `step` (inner indices 32 step ..) and 8-column tile `tile`:
// column 8 tile + l / 4, inner 4 (l % 4) + i of b0 and 16 + 4 (l % 4) + i of
// b1 in byte i.
template <typename B>
uint2 b_fragment(const B& byte, int step, int tile, int l) {
  uint32_t r[2] = {0, 0};
  const int col = tile * 8 + l / 4;
  for (int half = 0; half < 2; ++half)
    for (int i = 0; i < 4; ++i) r[half] |= uint32_t(uint8_t(byte(step * 32 + half * 16 + (l % 4) * 4 + i, col))) << (8 * i);
  return make_uint2(r[0], r[1]);
}

// The same of an int16 matrix (w(inner, col), 0 past its end), each value
// split into its high (signed) and low (unsigned) byte: {high b0, b1, low
// b0, b1}, one 16-byte load per lane.
template <typename W>
uint4 split_b_fragment(const W& w, int step, int tile, int l) {
  const uint2 hi = b_fragment([&](int i, int c) { return uint16_t(w(i, c)) >> 8; }, step, tile, l);
  const uint2 lo = b_fragment([&](int i, int c) { return uint16_t(w(i, c)) & 0xffu; }, step, tile, l);
  return make_uint4(hi.x, hi.y, lo.x, lo.y);
}

// DeviceTables::recon_int per head: 0 none, 1 the integer reconstruction,
// 2 the same with outputs finite by construction, so its kernels round to
// bf16 with no NaN check (kvtc_recon_int.cuh, int_pack). With |acc| <=
// 2^31, |x| <= (2^31 |recon_scale| + |mean|) (1 + 2^-24), and after the
// weights and a RoPE rotation (|cos|, |sin| <= 1) at most about twice that
// times |inv_scale|: far below FLT_MAX (2^128) when both stay under 2^120
// and every table entry is finite.
std::vector<uint8_t> integer_reconstruction_kinds(const FlatKvtcTables& f) {
  std::vector<uint8_t> kinds(f.recon_int);
  const size_t D = size_t(f.dim);
  for (size_t h = 0; h < kinds.size(); ++h) {
    if (!kinds[h]) continue;
    bool finite = true;
    for (size_t d = 0; d < D && finite; ++d) {
      const double sc = f.recon_scale[h * D + d], mu = f.mean[h * D + d], isc = f.inv_scale[h * D + d];
      const double x = 2147483648.0 * std::fabs(sc) + std::fabs(mu);
      finite = std::isfinite(sc) && std::isfinite(mu) && std::isfinite(isc) && x < 0x1p120 &&
               x * std::fabs(isc) < 0x1p120;
    }
    if (finite) kinds[h] = 2;
  }
  return kinds;
}

// The same cos and sin as rope_cos / rope_sin, laid out for the integer
// reconstruction (DeviceTables::rope_cs): [rope_dim / 4, positions + kT]
// {cos f, cos f + 1, sin f, sin f + 1}, f = 2 i, so a warp's loads for
// 8 consecutive tokens and 4 frequency pairs are 4 contiguous 128-byte
// lines. Each row ends with kT zero entries: a ragged last stream's rows
// past its tokens (never stored) read them, with no clamp per load.
int64_t rope_cs_stride(const FlatKvtcTables& f) { return f.rope_positions + kT; }
std::vector<float4> rope_pairs_by_frequency(const FlatKvtcTables& f) {
  std::vector<float4> cs;
  if (f.rope_cos.empty()) return cs;
  const int64_t P = f.rope_positions, stride = rope_cs_stride(f);
  const int half = f.rope_dim / 2;
  cs.assign(size_t(half / 2) * size_t(stride), make_float4(0.f, 0.f, 0.f, 0.f));
  for (int i = 0; i < half / 2; ++i)
    for (int64_t p = 0; p < P; ++p) {
      const size_t r = size_t(p) * half + 2 * i;
      cs[size_t(i) * stride + p] = make_float4(f.rope_cos[r], f.rope_cos[r + 1], f.rope_sin[r], f.rope_sin[r + 1]);
    }
  return cs;
}

// The integer reconstruction's weights W[k][d] (inner k, column d) as B
// fragments, [NH, ceil(k_pad / 32), D / 8, 32 lanes] (DeviceTables::recon_frag).
std::vector<uint4> recon_fragments(const FlatKvtcTables& f) {
  const int D = f.dim, KP = f.k_pad, KSP = (KP + 31) / 32;
  std::vector<uint4> frag(size_t(f.n_heads) * size_t(KSP) * size_t(D / 8) * 32);
  for (int h = 0; h < f.n_heads; ++h) {
    const auto w = [&](int k, int d) {
      return k < KP ? f.recon_w[(size_t(h) * size_t(KP) + size_t(k)) * size_t(D) + size_t(d)] : int16_t(0);
    };
    for (int ks = 0; ks < KSP; ++ks)
      for (int nt = 0; nt < D / 8; ++nt)
        for (int l = 0; l < 32; ++l)
          frag[((size_t(h) * size_t(KSP) + size_t(ks)) * size_t(D / 8) + size_t(nt)) * 32 + size_t(l)] =
              split_b_fragment(w, ks, nt, l);
  }
  return frag;
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
  e.z = (kVariantRansLow >> scale << 16) * freq;  // x_max (= freq << (31 - scale)): a state >= it emits a word first
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
  // Which projection kernels have heads to code (FlatKvtcTables::proj_int).
  bool any_int_projection = false, any_float_projection = false;
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
    // Each kernel codes its heads and returns at once for the others.
    if (any_float_projection) {
      if (flat.dim == 64)
        project_kernel<64, CodeT><<<grid, kProjThreads, smem, s>>>(dev, x, tokens, nb, tiles, h0, c);
      else
        project_kernel<128, CodeT><<<grid, kProjThreads, smem, s>>>(dev, x, tokens, nb, tiles, h0, c);
      check_cuda(cudaGetLastError(), "project_kernel launch");
    }
    if (any_int_projection) {
      const size_t ismem = project_int_smem(flat.dim, flat.k_pad, sizeof(CodeT));
      if (flat.dim == 64)
        project_int_kernel<64, CodeT><<<grid, kProjThreads, ismem, s>>>(dev, x, tokens, nb, tiles, h0, c);
      else
        project_int_kernel<128, CodeT><<<grid, kProjThreads, ismem, s>>>(dev, x, tokens, nb, tiles, h0, c);
      check_cuda(cudaGetLastError(), "project_int_kernel launch");
    }
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
    const int64_t nb = n_blocks(tokens, kT), groups = (nb + kRansDecodeWarps - 1) / kRansDecodeWarps;
    const unsigned grid = unsigned(int64_t(h1 - h0) * groups);
    CodeT* c = static_cast<CodeT*>(codes);
    const uint32_t stage_offset = uint32_t(fused_table_bytes());
    const size_t smem = rans_decode_smem();
    // The integer reconstruction reads its heads' codes as code words.
    const int words = sizeof(CodeT) == 1 && recon == Reconstruction::kInteger ? 1 : 0;
    if (cum_smem > 0)
      rans_decode_kernel<CodeT, true><<<grid, 32 * kRansDecodeWarps, smem, s>>>(dev, in, in_size, offsets, tokens, nb, h0,
                                                                        groups, stage_offset, words, c, bad, err);
    else
      rans_decode_kernel<CodeT, false><<<grid, 32 * kRansDecodeWarps, smem, s>>>(dev, in, in_size, offsets, tokens, nb, h0,
                                                                         groups, stage_offset, words, c, bad, err);
    check_cuda(cudaGetLastError(), "rans_decode_kernel launch");
  }
  template <typename CodeT>
  void launch_reconstruct(int64_t tokens, int h0, int h1, uint16_t* y, cudaStream_t s) {
    const int64_t nb = n_blocks(tokens, kT), tiles = (nb + 1) / 2;
    const unsigned grid = unsigned(int64_t(h1 - h0) * tiles);
    const CodeT* c = static_cast<const CodeT*>(codes);
    if constexpr (sizeof(CodeT) == 1) {
      if (recon == Reconstruction::kInteger) {
        const size_t ismem = int_smem_bytes(flat.k_pad, flat.dim);
        const int64_t groups = (nb + kIntStreams - 1) / kIntStreams;  // kIntStreams streams per CTA
        const unsigned igrid = unsigned(int64_t(h1 - h0) * groups);
        if (flat.dim == 64)
          reconstruct_int_kernel<64><<<igrid, kProjThreads, ismem, s>>>(dev, c, bad, tokens, nb, h0, groups, y);
        else
          reconstruct_int_kernel<128><<<igrid, kProjThreads, ismem, s>>>(dev, c, bad, tokens, nb, h0, groups, y);
        check_cuda(cudaGetLastError(), "reconstruct_int_kernel launch");
        return;
      }
    }
    if (recon == Reconstruction::kTf32TensorCores || recon == Reconstruction::kInteger) {
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
  // Shared memory of rans_decode_kernel: the head's tables, each warp's
  // stream stage, then the components' descriptors (16 bytes each).
  size_t rans_decode_smem() const {
    return fused_table_bytes() + size_t(kRansDecodeWarps) * kRansStageBytes + 16 * size_t(flat.k_pad);
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

  // The fused integer decode (decode_int_fused_kernel): only where every
  // head has the integer tables and the codes are u8 (all_recon_int).
  size_t int_fused_smem_bytes() const { return int_fused_smem(fused_table_bytes(), flat.k_pad, flat.dim); }
  void launch_int_fused_decode(const uint8_t* in, uint64_t in_size, const uint64_t* offsets, int64_t tokens, int h0,
                               int h1, uint16_t* y, cudaStream_t s) {
    const int64_t nb = n_blocks(tokens, kT), groups = (nb + kFusedStreams - 1) / kFusedStreams;
    const unsigned grid = unsigned(int64_t(h1 - h0) * groups);
    const size_t smem = int_fused_smem_bytes();
    const int in_smem = cum_smem > 0 ? 1 : 0;
    const uint32_t tb = uint32_t(fused_table_bytes()), sb = uint32_t(int_slot_bytes(flat.k_pad));
    if (flat.dim == 64)
      decode_int_fused_kernel<64><<<grid, kProjThreads, smem, s>>>(dev, in, in_size, offsets, tokens, nb, h0, groups,
                                                                  in_smem, tb, sb, bad, err, y);
    else
      decode_int_fused_kernel<128><<<grid, kProjThreads, smem, s>>>(dev, in, in_size, offsets, tokens, nb, h0, groups,
                                                                   in_smem, tb, sb, bad, err, y);
    check_cuda(cudaGetLastError(), "decode_int_fused_kernel launch");
  }
  bool all_recon_int = false;  // every head has the integer reconstruction tables

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
    if constexpr (sizeof(CodeT) == 1) {
      if (recon == Reconstruction::kInteger && fused && all_recon_int) {
        pipeline(
            stream,
            [&](int h0, int h1, cudaStream_t s) { launch_int_fused_decode(in, in_size, offsets, tokens, h0, h1, y, s); },
            [&](int, int, cudaStream_t) {});
        return;
      }
    }
    pipeline(
        stream,
        [&](int h0, int h1, cudaStream_t s) { launch_rans_decode<CodeT>(in, in_size, offsets, tokens, h0, h1, s); },
        [&](int h0, int h1, cudaStream_t s) { launch_reconstruct<CodeT>(tokens, h0, h1, y, s); });
  }
  bool fused = false;  // set_fused_decode: the one-kernel TF32 / integer decode (docs/gpu.md)

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
  m.dev.rope_cs = upload(rope_pairs_by_frequency(f), m.owned);
  m.dev.rope_cs_stride = rope_cs_stride(f);
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
    // k-step of 8, group of 32 dims) as 2 halves x 32 lanes x 4 registers:
    // lane l's 8 registers are, for its four 8-dim tiles i, the m16n8k8 B
    // registers (k = 8ks + l%4 + 4r, n = 32g + 8i + l/4), r = 0, 1, register
    // j = 2i + r in half j / 4 at j % 4. A warp's 16-byte load of one half
    // is 512 contiguous bytes (lane-contiguous 32-byte pairs made each load
    // use half of every sector).
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
              const size_t group = (size_t(h) * (KP / 8) + size_t(ks)) * (D / 32) + size_t(g);
              std::memcpy(&frag[((group * 2 + size_t(j / 4)) * 32 + size_t(l)) * 4 + size_t(j % 4)], &u, 4);
            }
    m.dev.basis_frag = upload(frag, m.owned);
  }
  {
    // The integer projections' weights W[k][d] and W8[k][d] (inner d,
    // column k) as B fragments, [NH, k_pad / 8, D / 32, 32 lanes]
    // (DeviceTables::proj_frag: {high b0, b1, low b0, b1}; proj8_frag: {b0, b1}).
    const int D = f.dim, KP = f.k_pad;
    std::vector<uint4> frag(size_t(f.n_heads) * size_t(KP / 8) * size_t(D / 32) * 32);
    std::vector<uint2> frag8(frag.size());
    for (int h = 0; h < f.n_heads; ++h) {
      const auto at = [&](int d, int k) { return (size_t(h) * size_t(KP) + size_t(k)) * size_t(D) + size_t(d); };
      const auto w = [&](int d, int k) { return f.proj_w[at(d, k)]; };
      const auto w8 = [&](int d, int k) { return f.proj8_w[at(d, k)]; };
      for (int ng = 0; ng < KP / 8; ++ng)
        for (int ks = 0; ks < D / 32; ++ks)
          for (int l = 0; l < 32; ++l) {
            const size_t i = ((size_t(h) * (KP / 8) + size_t(ng)) * (D / 32) + size_t(ks)) * 32 + size_t(l);
            frag[i] = split_b_fragment(w, ks, ng, l);
            frag8[i] = b_fragment(w8, ks, ng, l);
          }
    }
    m.dev.proj_frag = upload(frag, m.owned);
    m.dev.proj_int = upload(f.proj_int, m.owned);
    m.dev.proj_qscale = upload(f.proj_qscale, m.owned);
    m.dev.proj_scale = upload(f.proj_scale, m.owned);
    m.dev.proj_max_abs = upload(f.proj_max_abs, m.owned);
    m.dev.proj_max_sq = upload(f.proj_max_sq, m.owned);
    m.dev.proj8_frag = upload(frag8, m.owned);
    m.dev.proj8 = upload(f.proj8, m.owned);
    m.dev.proj8_qscale = upload(f.proj8_qscale, m.owned);
    m.dev.proj8_gate_m = upload(f.proj8_gate_m, m.owned);
    m.dev.proj8_gate_ss = upload(f.proj8_gate_ss, m.owned);
    for (int h = 0; h < f.n_heads; ++h) {
      if (f.kept[size_t(h)] == 0) continue;
      (f.proj_int[size_t(h)] ? m.any_int_projection : m.any_float_projection) = true;
    }
  }
  // The integer reconstruction's tables (kvtc_recon_int.cuh).
  m.dev.recon_frag = upload(recon_fragments(f), m.owned);
  m.dev.recon_int = upload(integer_reconstruction_kinds(f), m.owned);
  m.all_recon_int = std::all_of(f.recon_int.begin(), f.recon_int.end(), [](uint8_t r) { return r != 0; });
  m.dev.recon_z = upload(f.recon_z, m.owned);
  m.dev.recon_scale = upload(f.recon_scale, m.owned);
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
  // Tables of up to kGuideMaxBits bits (every 8-bit alphabet's in
  // kvtc-gpu/4) get their whole slot table; wider ones a guide of 2^(lg + 2)
  // buckets (>= 4 per symbol), scanned up from. With every table whole
  // (`direct`), the decoder's entries are spans {cum[s] | freq[s] << 16}
  // (levels of them, then an unused pad), not cum[0..levels].
  bool direct = true;
  for (int h = 0; h < f.n_heads; ++h)
    for (int k = 0; k < f.kept[size_t(h)]; ++k) direct = direct && f.scale_bits[f.idx(h, k)] <= kGuideMaxBits;
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
      const uint32_t gbits = scale <= kGuideMaxBits ? scale : std::min(lg + 2, kGuideMaxBits), shift = scale - gbits;
      comp[q] = make_uint4(uint32_t(cum.size()) - head_base.back(), uint32_t(guide.size()) - guide_base.back(),
                           f.sym_base[q], scale | shift << 8);
      for (uint32_t s = 0; s < levels; ++s) {
        const size_t i = f.sym_base[q] + s;
        sym_enc[i] = encoder_entry(f.sym_freq[i], f.sym_cum[i], f.scale_bits[q]);
        cum.push_back(direct ? f.sym_cum[i] | f.sym_freq[i] << 16 : f.sym_cum[i]);
      }
      // guide[j]: the last symbol s with cum[s] <= j << shift (the symbol of
      // the bucket's first slot; the decoder scans up from it).
      uint32_t sym = 0;
      for (uint32_t j = 0; j < (1u << gbits); ++j) {
        const uint32_t x = j << shift;
        while (sym + 1 < levels && f.sym_cum[f.sym_base[q] + sym + 1] <= x) ++sym;
        guide.push_back(uint16_t(sym));
      }
      cum.push_back(direct ? 0 : 1u << f.scale_bits[q]);
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
  cum.push_back(0);  // the decoder reads cum[base + 2] unconditionally (kvtc_decode.cuh)
  m.dev.direct = direct ? 1 : 0;
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
  check_cuda(cudaMemcpy(m.err, kNoErrors, 8, cudaMemcpyHostToDevice), "reset errors");
  void* p = nullptr;
  check_cuda(cudaMallocHost(&p, 8), "cudaMallocHost");
  m.total_host = static_cast<uint64_t*>(p);
  const int proj_smem = int(size_t(f.dim) * kTilePad * 4 + 2 * size_t(kT) * f.k_pad * code_bytes);
  const int int8_smem = int(project_int_smem(f.dim, f.k_pad, 1)), int16_smem = int(project_int_smem(f.dim, f.k_pad, 2));
  const int rec_smem = int(rec_smem_bytes(f.k_pad, f.dim));
  const int tc_smem = int(tc_smem_bytes(f.k_pad, f.dim));
  const int ri_smem = int(int_smem_bytes(f.k_pad, f.dim));
  const int fused8 = int(m.fused_smem(1)), fused16 = int(m.fused_smem(2));
  const auto attr = raise_dynamic_smem_limit;
  const int rd_smem = int(m.rans_decode_smem());
  attr(reinterpret_cast<const void*>(rans_decode_kernel<uint8_t, true>), rd_smem);
  attr(reinterpret_cast<const void*>(rans_decode_kernel<uint8_t, false>), rd_smem);
  attr(reinterpret_cast<const void*>(rans_decode_kernel<uint16_t, true>), rd_smem);
  attr(reinterpret_cast<const void*>(rans_decode_kernel<uint16_t, false>), rd_smem);
  if (f.dim == 64) {
    attr(reinterpret_cast<const void*>(project_kernel<64, uint8_t>), proj_smem);
    attr(reinterpret_cast<const void*>(project_kernel<64, uint16_t>), proj_smem);
    attr(reinterpret_cast<const void*>(project_int_kernel<64, uint8_t>), int8_smem);
    attr(reinterpret_cast<const void*>(project_int_kernel<64, uint16_t>), int16_smem);
    attr(reinterpret_cast<const void*>(reconstruct_kernel<64, uint8_t>), rec_smem);
    attr(reinterpret_cast<const void*>(reconstruct_kernel<64, uint16_t>), rec_smem);
    attr(reinterpret_cast<const void*>(reconstruct_tc_kernel<64, uint8_t>), tc_smem);
    attr(reinterpret_cast<const void*>(reconstruct_tc_kernel<64, uint16_t>), tc_smem);
    attr(reinterpret_cast<const void*>(reconstruct_int_kernel<64>), ri_smem);
    attr(reinterpret_cast<const void*>(decode_int_fused_kernel<64>), int(m.int_fused_smem_bytes()));
    attr(reinterpret_cast<const void*>(decode_fused_kernel<64, uint8_t>), fused8);
    attr(reinterpret_cast<const void*>(decode_fused_kernel<64, uint16_t>), fused16);
  } else {
    attr(reinterpret_cast<const void*>(project_kernel<128, uint8_t>), proj_smem);
    attr(reinterpret_cast<const void*>(project_kernel<128, uint16_t>), proj_smem);
    attr(reinterpret_cast<const void*>(project_int_kernel<128, uint8_t>), int8_smem);
    attr(reinterpret_cast<const void*>(project_int_kernel<128, uint16_t>), int16_smem);
    attr(reinterpret_cast<const void*>(reconstruct_kernel<128, uint8_t>), rec_smem);
    attr(reinterpret_cast<const void*>(reconstruct_kernel<128, uint16_t>), rec_smem);
    attr(reinterpret_cast<const void*>(reconstruct_tc_kernel<128, uint8_t>), tc_smem);
    attr(reinterpret_cast<const void*>(reconstruct_tc_kernel<128, uint16_t>), tc_smem);
    attr(reinterpret_cast<const void*>(reconstruct_int_kernel<128>), ri_smem);
    attr(reinterpret_cast<const void*>(decode_int_fused_kernel<128>), int(m.int_fused_smem_bytes()));
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
  if (r != Reconstruction::kExactFp32 && r != Reconstruction::kTf32TensorCores && r != Reconstruction::kInteger)
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
// Tokens at positions [first, first + tokens): RoPE heads read the tables'
// rows there (a plain head's tables have no rows and no RoPE: first must be 0).
void check_positions(const FlatKvtcTables& f, int64_t first, int64_t tokens) {
  const bool any_rope = std::any_of(f.rope.begin(), f.rope.end(), [](uint8_t r) { return r != 0; });
  const int64_t limit = any_rope ? f.rope_positions : tokens;
  if (first < 0 || first > limit - tokens)
    throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: positions [" + std::to_string(first) + ", " +
                                                 std::to_string(first + tokens) + ") outside the codec's [0, " +
                                                 std::to_string(limit) + ")");
}

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

// The raw tokens into the packed region right after the streams, whose
// end (*streams_end) is known on the device only; zeroes the pad before
// it. One 16-byte word per thread; out is 16-byte aligned.
__global__ void raw_after_streams_kernel(const uint16_t* __restrict__ x, uint8_t* __restrict__ out,
                                         const uint64_t* __restrict__ streams_end, int64_t seq, int64_t sink_end,
                                         int64_t tail_begin, int64_t raw, int row_words, int64_t words) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t total = *streams_end, off = (total + 15) / 16 * 16;  // raw_offset
  if (uint64_t(i) < off - total) out[total + uint64_t(i)] = 0;
  if (i >= words) return;
  const int64_t w = i % row_words, r = (i / row_words) % raw, h = i / (int64_t(row_words) * raw);
  const int64_t t = r < sink_end ? r : tail_begin + (r - sink_end);
  const uint4* src = reinterpret_cast<const uint4*>(x + size_t(h * seq + t) * size_t(row_words) * 8) + w;
  reinterpret_cast<uint4*>(out + off)[i] = __ldcs(src);
}

// copy_raw's encode direction with the packed region at raw_offset of the
// device's streams_end (KvtcGpuCodec::encode without a host round trip).
void copy_raw_after_streams(const FlatKvtcTables& f, int64_t seq, const uint16_t* x, uint8_t* out,
                            const uint64_t* streams_end, cudaStream_t stream) {
  const int64_t coded = coded_tokens(f, seq), sink_end = std::min<int64_t>(seq, f.sinks);
  const int64_t raw = seq - coded, row_words = f.dim / 8, words = int64_t(f.n_heads) * raw * row_words;
  raw_after_streams_kernel<<<unsigned((std::max<int64_t>(words, 16) + 255) / 256), 256, 0, stream>>>(
      x, out, streams_end, seq, sink_end, sink_end + coded, raw, int(row_words), words);
  check_cuda(cudaGetLastError(), "raw_after_streams_kernel launch");
}

}  // namespace

uint64_t KvtcGpuCodec::encode(const uint16_t* x, int64_t tokens, uint8_t* out, uint64_t capacity, uint64_t* offsets,
                              void* stream_ptr, int64_t first_position) {
  Impl& m = *impl_;
  check_tokens(tokens, m.max_tokens);
  check_positions(m.flat, first_position, tokens);
  m.dev.pos0 = first_position;
  check_aligned(x, "input x");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t coded = coded_tokens(m.flat, tokens);
  const int64_t ns = n_streams(tokens);
  const uint64_t raw = raw_bytes(m.flat, tokens);
  m.dev.seq = tokens;
  m.dev.tok0 = std::min<int64_t>(tokens, m.flat.sinks);
  // With room for the largest payload (and an aligned out for the raw
  // tokens' 16-byte copies) nothing waits for the streams' total on the
  // host until the end: the pack and the raw copy read it on the device.
  // Otherwise the total comes first, for the capacity check (the host's
  // round trip between the scan and the pack: 0.03 ms of a 2.1 ms encode,
  // the calibrated bench batch, H200).
  const bool room = capacity >= max_encoded_bytes(tokens) && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  uint64_t total = 0;
  check_cuda(cudaMemsetAsync(m.scan_out, 0, 8, stream), "memset");
  if (ns > 0) {
    if (m.wide_codes)
      m.encode_front<uint16_t>(x, coded, stream);
    else
      m.encode_front<uint8_t>(x, coded, stream);
    size_t tb = m.cub_temp_bytes;
    check_cuda(cub::DeviceScan::InclusiveSum(m.cub_temp, tb, m.sizes, m.scan_out + 1, int(ns), stream), "scan");
    if (!room) {
      check_cuda(cudaMemcpyAsync(m.total_host, m.scan_out + ns, 8, cudaMemcpyDeviceToHost, stream), "total");
      check_cuda(cudaStreamSynchronize(stream), "encode (sizes)");
      total = *m.total_host;
    }
  }
  if (!room) {
    const uint64_t end = raw > 0 ? raw_offset(total) + raw : total;
    if (end > capacity)
      throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu encode: output needs " + std::to_string(end) +
                                                   " bytes, capacity is " + std::to_string(capacity));
  }
  if (ns > 0) {
    pack_kernel<<<unsigned((ns + 7) / 8), 256, 0, stream>>>(m.scratch, m.cap, m.sizes, m.scan_out, out, ns);
    check_cuda(cudaGetLastError(), "pack_kernel launch");
  }
  if (raw > 0) {
    if (room) {
      copy_raw_after_streams(m.flat, tokens, x, out, m.scan_out + ns, stream);
    } else {
      if (raw_offset(total) > total)
        check_cuda(cudaMemsetAsync(out + total, 0, raw_offset(total) - total, stream), "pad");
      copy_raw(m.flat, tokens, const_cast<uint16_t*>(x), out + raw_offset(total), /*to_packed=*/true, stream);
    }
  }
  check_cuda(cudaMemcpyAsync(offsets, m.scan_out, size_t(ns + 1) * 8, cudaMemcpyDefault, stream), "offsets");
  m.mark(3, stream);
  if (room && ns > 0) {
    check_cuda(cudaMemcpyAsync(m.total_host, m.scan_out + ns, 8, cudaMemcpyDeviceToHost, stream), "total");
    check_cuda(cudaStreamSynchronize(stream), "encode (total)");
    total = *m.total_host;
  }
  return raw > 0 ? raw_offset(total) + raw : total;
}

void KvtcGpuCodec::decode(const uint8_t* in, uint64_t in_size, const uint64_t* offsets, int64_t tokens, uint16_t* y,
                          void* stream_ptr, int64_t first_position) {
  Impl& m = *impl_;
  check_tokens(tokens, m.max_tokens);
  check_positions(m.flat, first_position, tokens);
  m.dev.pos0 = first_position;
  check_aligned(y, "output y");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const uint64_t raw = raw_bytes(m.flat, tokens);
  if (in_size < raw || (raw > 0 && (in_size - raw) % 16 != 0))
    throw Error(ErrorCode::kFormat, "kvtc-gpu decode: " + std::to_string(in_size) + " bytes cannot hold the " +
                                        std::to_string(raw) + " bytes of raw sinks and window (16-byte aligned)");
  const uint64_t streams_size = in_size - raw;  // the streams end at or before the raw tokens
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
  if (!h[0]) return;
  // The flags are sticky across decodes (a codec shared by several layers
  // of one restore loses none) until reported here.
  check_cuda(cudaMemcpy(impl_->err, kNoErrors, 8, cudaMemcpyHostToDevice), "reset errors");
  throw Error(ErrorCode::kFormat, "kvtc-gpu decode: stream " + std::to_string(h[1]) + " is malformed");
}

}  // namespace kvcodec::gpu

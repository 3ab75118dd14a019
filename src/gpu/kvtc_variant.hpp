// The GPU variant of the KVTC payload ("kvtc-gpu/2") and its plain CPU
// reference, compiled in every build so the CPU can read and write what the
// GPU kernels produce (and CI tests the format without a GPU).
//
// Why a variant: the CPU codec's rANS stream has 8 interleaved lanes, so a
// block decodes on at most 8 threads. Here one stream is one (head, block of
// T tokens) and has 32 lanes, one per thread of a warp, and the projection
// runs in a fixed fp32 order so codes are bit-identical on CPU and GPU.
//
// Input/output KV is bf16, laid out [NH, S, D] (NH = layers x batch x kv
// heads flattened, each head's tokens contiguous). Stream i = h * n_blocks + b
// covers tokens [b*T, min(S, (b+1)*T)) of head h.
//
// Arithmetic (identical on both sides, no contraction):
//   xc[d]   = bf16_to_f32(x[t][d]) - mean[d]
//   c[t][k] = acc over d = 0..D-1 of acc = fmaf(xc[d], basis[k][d], acc), acc0 = 0
//   code    = clamp(floorf(fmaf(c, inv_step[k], code_offset[k])), 0, levels-1)
//   v[k]    = (float(code) - recon_offset[k]) * step[k]
//   y[t][d] = bf16_rne(acc + mean[d]), acc over k = 0..K-1 of fmaf(v[k], basis[k][d], acc)
//
// Stream bytes (empty when K == 0): 32 lane states (u32 little-endian, lane 0
// first; the encoder's final states = the decoder's initial ones), then the
// renormalisation bytes in the order the decoder reads them. Symbols are
// component-major: with P = ceil(n / 32) passes, decode step s = k*P + p
// codes component k of tokens p*32 + j on lane j (lanes with p*32 + j >= n
// idle), so at every step all lanes use one component's table (kvtc-gpu/2;
// /1 was token-major, lane = (t*K + k) % 32, and made the 32 lanes gather
// from 32 different tables). Each lane j decodes x -> f*(x >> scale) + (x &
// mask) - cum, then reads bytes while x < 2^23 (x = x << 8 | byte); step s's
// bytes are lane 0's, then lane 1's, ... (a warp finds its offsets with a
// prefix count). A valid stream is consumed exactly and ends with every lane
// back at 2^23.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvcodec::kvtc {
struct HeadParams;
}

namespace kvcodec::gpu {

inline constexpr int kWarpLanes = 32;
inline constexpr uint32_t kVariantRansLow = 1u << 23;
inline constexpr size_t kStateBytes = 4 * kWarpLanes;

// Every head's frozen parameters as flat arrays: what the GPU uploads and the
// CPU reference reads, so both use the very same numbers.
struct FlatKvtcTables {
  int n_heads = 0;
  int dim = 0;
  int k_pad = 0;                     // max kept over heads, rounded up to 8 (>= 8)
  std::vector<int32_t> kept;         // [NH]
  std::vector<float> mean;           // [NH, D]
  std::vector<float> basis;          // [NH, k_pad, D], rows >= kept are 0
  std::vector<float> basis_t;        // [NH, D, k_pad] (the same, transposed for the encoder)
  std::vector<float> inv_step;       // [NH, k_pad] 1.0f / step
  std::vector<float> code_offset;    // [NH, k_pad]
  std::vector<float> max_code;       // [NH, k_pad] levels - 1
  std::vector<float> step;           // [NH, k_pad]
  std::vector<float> recon_offset;   // [NH, k_pad]
  std::vector<uint32_t> scale_bits;  // [NH, k_pad]
  std::vector<uint32_t> sym_base;    // [NH, k_pad] index of symbol 0 in sym_freq / sym_cum
  std::vector<uint32_t> sym_freq;    // per table, per symbol
  std::vector<uint32_t> sym_cum;
  std::vector<uint64_t> slot_base;   // [NH, k_pad] index of slot 0 in slot_symbol
  std::vector<uint16_t> slot_symbol; // per table, [1 << scale_bits]

  size_t idx(int h, int k) const { return size_t(h) * size_t(k_pad) + size_t(k); }
};

// Flattens fitted heads (all of one head_dim in {64, 128}, coder rANS, alphabet
// == levels). Throws Error(kUnsupported / kInvalidArgument) naming the head.
FlatKvtcTables flatten_heads(const std::vector<const kvtc::HeadParams*>& heads);

// Round to nearest even (NaN stays NaN), as the GPU does.
uint16_t f32_to_bf16_rne(float v);
float bf16_bits_to_f32(uint16_t b);

// One head h: x [n, D] bf16 -> codes [n, K]; codes -> y [n, D] bf16.
void quantize_reference(const FlatKvtcTables& t, int h, const uint16_t* x, int64_t n, uint16_t* codes);
void dequantize_reference(const FlatKvtcTables& t, int h, const uint16_t* codes, int64_t n, uint16_t* y);

// One stream: codes [n, K] <-> bytes. Decode throws Error(kFormat) on
// truncated, trailing or inconsistent bytes.
std::vector<uint8_t> rans_warp_encode(const FlatKvtcTables& t, int h, const uint16_t* codes, int64_t n);
void rans_warp_decode(const FlatKvtcTables& t, int h, const uint8_t* data, size_t size, int64_t n, uint16_t* codes);

// A whole batch, x [NH, S, D] bf16 with blocks of block_tokens: offsets has
// n_streams + 1 entries (offsets[0] = 0), stream i is payload[offsets[i],
// offsets[i+1]).
struct EncodedBatch {
  std::vector<uint64_t> offsets;
  std::vector<uint8_t> payload;
};
int64_t n_blocks(int64_t tokens, int block_tokens);
EncodedBatch encode_batch_reference(const FlatKvtcTables& t, const uint16_t* x, int64_t tokens, int block_tokens);
void decode_batch_reference(const FlatKvtcTables& t, const uint8_t* payload, size_t payload_size,
                            const uint64_t* offsets, int64_t tokens, int block_tokens, uint16_t* y);

// The accuracy contract of the TF32 tensor-core reconstruction
// (include/kvcodec/gpu.hpp), checked output by output: with v_k the
// dequantized coefficients of the reference quantizer's codes of x,
// |y_tc - y_exact| <= 2^-9 * sum_k |v_k b_kd| (TF32 operands: 2^-11 relative
// each, fp32 accumulation) + one bf16 ulp (both results are rounded to
// bf16). x, y_tc, y_exact: [heads, tokens, D] bf16 bits of the first `heads`
// heads. Returns the number of violations (a NaN fails); *n_diff receives
// how many outputs differ at all.
size_t tf32_bound_violations(const FlatKvtcTables& t, int heads, const uint16_t* x, int64_t tokens,
                             const uint16_t* y_tc, const uint16_t* y_exact, size_t* n_diff);

}  // namespace kvcodec::gpu

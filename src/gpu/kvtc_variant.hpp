// The GPU variant of the KVTC payload ("kvtc-gpu/4") and its plain CPU
// reference, compiled in every build so the CPU can read and write what the
// GPU kernels produce (and CI tests the format without a GPU).
//
// Why a variant: the CPU codec's rANS stream has 8 interleaved lanes, so a
// block decodes on at most 8 threads. Here one stream is one (head, block of
// T tokens) and has 32 lanes, one per thread of a warp. The projection is
// the CPU codec's integer one (exact int32 sums of int16 products, so any
// order gives the same codes: CPU and GPU, and the CPU codec's own), with a
// fixed fp32 order where a head or a row cannot take it.
//
// Input/output KV is bf16, laid out [NH, S, D] (NH = layers x batch x kv
// heads flattened, each head's tokens contiguous). Stream i = h * n_blocks + b
// covers tokens [b*T, min(S, (b+1)*T)) of head h.
//
// Arithmetic (identical on both sides, no contraction):
//   xr      = x[t] as f32 (bf16_to_f32), RoPE removed when rope[h] (below)
//   xc[d]   = xr[d] * scale[d] - mean[d]          (scale = 1: plain heads)
//   code    = the 8-bit projection's code when the head has one (proj8[h])
//             and its gate takes the row, else the integer projection's
//             when the head has one (proj_int[h]) and the row fits it,
//             else the float one:
//   8-bit (calibrated heads: the CPU calibrated cache's default projection,
//   kvtc.int8, HeadKernels::proj8, the same tables and arithmetic):
//     takes   = |ss| < inf && (m * m) * proj8_gate_m + ss * proj8_gate_ss <= 1
//               (m, ss as below)
//     x8[d]   = int8 rintf(xc[d] * (127 / m)) (0 for a zero row)
//     acc[k]  = sum over d of x8[d] * proj8_w[k][d] (exact int32)
//     code    = y = fmaf(float(acc) * (m / 127), proj8_qscale[k], code_offset[k]);
//               min(levels-1, y) truncated, 0 when negative
//   integer (the CPU codec's default projection, HeadKernels::proj_int, the
//   same tables and arithmetic, so the same codes as kvtc::quantize_block
//   on the rows xr * scale):
//     fits    = |ss| < inf && m * ps <= proj_max_abs && ss * (ps * ps) <= proj_max_sq,
//               m = max |xc[d]|, ss = ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)),
//               l_e = fmaf chain of xc[d]^2 over d = e, e + 8, ... (ps = proj_scale[h])
//     xi[d]   = int16 rintf(xc[d] * ps) (round to nearest even)
//     acc[k]  = sum over d of xi[d] * proj_w[k][d] (exact int32)
//     code    = y = fmaf(float(acc), proj_qscale[k], code_offset[k]);
//               min(levels-1, y) truncated, 0 when negative
//   float (a head without the integer tables, or a row that does not fit):
//     c[t][k] = acc over d = 0..D-1 of acc = fmaf(xc[d], basis[k][d], acc), acc0 = 0
//     code    = clamp(floorf(fmaf(c, inv_step[k], code_offset[k])), 0, levels-1)
//   v[k]    = (float(code) - recon_offset[k]) * step[k]
//   yw[d]   = (acc + mean[d]) * inv_scale[d], acc over k = 0..K-1 of fmaf(v[k], basis[k][d], acc)
//   y[t][d] = bf16_rne(yw[d]), RoPE re-applied first when rope[h]
// RoPE (calibrated format, keys): the token vector is n_sub sub-heads of
// rope_dim values; pair (i, i + rope_dim/2) of each sub-head at position p
// (c = rope_cos[p][i], s = rope_sin[p][i], f32 as the model rounds them):
//   removal  a' = fmaf(a, c, b*s),    b' = fmaf(b, c, -(a*s))
//   apply    a' = fmaf(a, c, -(b*s)), b' = fmaf(b, c, a*s)
//
// The calibrated format (flatten_calibration): one "head" per (layer,
// tensor, batch row) with dim = n_kv_heads * head_dim (heads concatenated,
// [S, H, D] token-major, as a paged cache holds them), the layer's
// calibrated basis, weights as scale / inv_scale, RoPE on keys. Per head,
// tokens [sinks, S - window) are coded (position = token index) and the
// sinks and the window are kept raw: the batch payload is the streams, then
// (16-byte aligned) the raw tokens [NH][sinks + window][dim] bf16.
//
// Stream bytes (empty when K == 0): 32 lane states (u32 little-endian, lane 0
// first; the encoder's final states = the decoder's initial ones), then the
// renormalisation words (u16 little-endian) in the order the decoder reads
// them. Symbols are component-major: with P = ceil(n / 32) passes, decode
// step s = k*P + p codes component k of tokens p*32 + j on lane j (lanes
// with p*32 + j >= n idle), so at every step all lanes use one component's
// table (/1 was token-major, lane = (t*K + k) % 32, and made the 32 lanes
// gather from 32 different tables). Each lane j decodes x -> f*(x >> scale)
// + (x & mask) - cum, then reads one word if x < 2^15 (x = x << 16 | word);
// step s's words are lane 0's, then lane 1's, ... (a warp finds its
// offsets with one ballot and a prefix count). A valid stream is consumed
// exactly and ends with every lane back at 2^15.
// kvtc-gpu/4 differs from /3 in the tables only: /3 coded with the
// calibration's (12 bits on the shipped ones), /4 rebuilds them at
// stream_scale_bits (below), at most 10 bits for 8-bit codes, so the GPU
// decoder's slot tables are small enough for shared memory. A /3 payload is
// not a /4 one (no version byte: re-encode it). /3 differed from /2 in the
// renormalisation only: /2 kept states in [2^23, 2^31) and read 0-2 bytes
// per step, which cost the GPU decoder two ballots and four prefix counts
// per step; the 16-bit words also made the streams about 1% smaller.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvcodec {
struct KvtcCalibration;
}
namespace kvcodec::kvtc {
struct HeadParams;
}

namespace kvcodec::gpu {

inline constexpr int kWarpLanes = 32;
// Lane states live in [kVariantRansLow, kVariantRansHigh) = [2^15, 2^31)
// and renormalise 16 bits at a time; a table's slot takes at most
// kVariantMaxScaleBits bits (the calibration's 16-bit tables are rebuilt at
// 15 for the streams).
inline constexpr uint32_t kVariantRansLow = 1u << 15;
inline constexpr uint32_t kVariantRansHigh = 1u << 31;
inline constexpr uint32_t kVariantMaxScaleBits = 15;
// kvtc-gpu/4: a component's table is coded at
// stream_scale_bits(levels, table bits) = min(table bits, max(8, ceil(log2
// levels) + 2), 15) bits of precision, rebuilt from the calibration's
// frequencies where that has more (12 bits on the shipped calibrations). At
// most 10 bits for 8-bit codes, so the GPU decoder finds a slot's symbol
// with one look-up in a 2^bits table (/3 kept 12 bits and scanned a coarser
// guide: about 11 more instructions per step, half of them the up-step
// from the guide's symbol). Cost on the shipped calibration's own
// frequencies: +0.64% bits (8 bits alone: +0.65%, 9: +0.23%, 10: +0.07%).
inline constexpr uint32_t kVariantMinScaleBits = 8;
uint32_t stream_scale_bits(uint32_t levels, uint32_t table_bits);
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
  // Calibrated transforms (identity for plain heads: scale 1, no RoPE).
  std::vector<float> scale;          // [NH, D] applied before centring
  std::vector<float> inv_scale;      // [NH, D] 1 / scale, applied after reconstruction
  std::vector<uint8_t> rope;         // [NH] 1: RoPE removed on encode, re-applied on decode
  int rope_dim = 0;                  // sub-head size of the RoPE pairs (a multiple of 32 dividing dim)
  int64_t rope_positions = 0;        // rows of rope_cos / rope_sin
  std::vector<float> rope_cos, rope_sin;  // [rope_positions, rope_dim / 2]
  int sinks = 0, window = 0;         // raw tokens at each head's start / end (calibrated format)
  // The integer projection (HeadKernels::proj_int of each head's parameters;
  // heads without it keep proj_int 0 and take the float projection).
  std::vector<uint8_t> proj_int;     // [NH]
  std::vector<int16_t> proj_w;       // [NH, k_pad, D] W[k][d], rows >= kept are 0
  std::vector<float> proj_qscale;    // [NH, k_pad]
  std::vector<float> proj_scale, proj_max_abs, proj_max_sq;  // [NH]
  // The 8-bit projection (HeadKernels::proj8; calibrated heads only, as the
  // CPU calibrated cache runs it; others keep proj8 0): rows its gate takes.
  std::vector<uint8_t> proj8;        // [NH]
  std::vector<int8_t> proj8_w;       // [NH, k_pad, D] W8[k][d], rows >= kept are 0
  std::vector<float> proj8_qscale;   // [NH, k_pad]
  std::vector<float> proj8_gate_m, proj8_gate_ss;  // [NH]
  // The integer reconstruction (HeadKernels::recon_int, the CPU codec's
  // default dequantize_block; heads without it keep recon_int 0):
  //   acc[d]  = sum over k of int16(2 code[k] - recon_zero2[k]) * recon_w[k][d] (exact int32)
  //   x[d]    = fmaf(float(acc[d]), recon_scale[d], mean[d])
  //   yw[d]   = x[d] * inv_scale[d], then RoPE re-applied as above
  // recon_z[d] = sum over k of recon_zero2[k] * recon_w[k][d] (mod 2^32):
  // the kernel's acc = 2 sum_k code[k] W[k][d] - recon_z[d], the same sum.
  std::vector<uint8_t> recon_int;    // [NH]
  std::vector<int16_t> recon_w;      // [NH, k_pad, D] W[k][d], rows >= kept are 0
  std::vector<int16_t> recon_zero2;  // [NH, k_pad]
  std::vector<int32_t> recon_z;      // [NH, D]
  std::vector<float> recon_scale;    // [NH, D]

  size_t idx(int h, int k) const { return size_t(h) * size_t(k_pad) + size_t(k); }
};

// Flattens fitted heads (all of one head_dim in {64, 128}, coder rANS, alphabet
// == levels). Throws Error(kUnsupported / kInvalidArgument) naming the head.
// eight_bit: the heads take the 8-bit projection too (flatten_calibration).
FlatKvtcTables flatten_heads(const std::vector<const kvtc::HeadParams*>& heads, bool eight_bit = false);

// The calibrated format: heads [layer][key, value][batch row] in that order
// (NH = layers.size() * 2 * batch), each the layer's calibrated parameters,
// RoPE tables for max_positions positions. Throws Error(kUnsupported) when
// n_kv_heads * head_dim is not 64 or 128, or head_dim is not a multiple of 32.
FlatKvtcTables flatten_calibration(const KvtcCalibration& cal, const std::vector<int>& layers, int batch,
                                   int64_t max_positions, int sinks, int window);
// Coded tokens per head of a sequence of `seq` tokens (0 when the sinks and
// the window cover it).
int64_t coded_tokens(const FlatKvtcTables& t, int64_t seq);

// Round to nearest even (NaN stays NaN), as the GPU does.
uint16_t f32_to_bf16_rne(float v);
float bf16_bits_to_f32(uint16_t b);

// One head h: the rows the projection centres, xr * scale [n, D] (RoPE
// removed at position0 + i): what kvtc::quantize_block takes for the same
// codes (tested).
void weighted_rows_reference(const FlatKvtcTables& t, int h, const uint16_t* x, int64_t n, float* out,
                             int64_t position0 = 0);
// One head h: x [n, D] bf16 -> codes [n, K]; codes -> y [n, D] bf16; token
// i at position position0 + i (used by RoPE heads only).
void quantize_reference(const FlatKvtcTables& t, int h, const uint16_t* x, int64_t n, uint16_t* codes,
                        int64_t position0 = 0);
void dequantize_reference(const FlatKvtcTables& t, int h, const uint16_t* codes, int64_t n, uint16_t* y,
                          int64_t position0 = 0);
// The f32 reconstruction before the bf16 rounding (yw above, RoPE applied).
void reconstruct_f32_reference(const FlatKvtcTables& t, int h, const uint16_t* codes, int64_t n, float* y,
                               int64_t position0);

// The integer reconstruction of head h (recon_int[h], see FlatKvtcTables):
// before the weights and RoPE it is kvtc::dequantize_block's result for the
// same codes, bit for bit (tested). Throws Error(kInvalidArgument) for a
// head without it.
void reconstruct_int_f32_reference(const FlatKvtcTables& t, int h, const uint16_t* codes, int64_t n, float* y,
                                   int64_t position0);
void dequantize_int_reference(const FlatKvtcTables& t, int h, const uint16_t* codes, int64_t n, uint16_t* y,
                              int64_t position0 = 0);

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
// tokens = the sequence length S of every head; with t.sinks / t.window the
// coded streams cover tokens [sinks, S - window) and the raw ones follow.
// first_position: the position of the first token (RoPE heads), as
// KvtcGpuCodec::encode / decode take it.
EncodedBatch encode_batch_reference(const FlatKvtcTables& t, const uint16_t* x, int64_t tokens, int block_tokens,
                                    int64_t first_position = 0);
// integer_reconstruction: heads with recon_int take the integer
// reconstruction (what KvtcGpuCodec's kInteger decode computes), the others
// the float one.
void decode_batch_reference(const FlatKvtcTables& t, const uint8_t* payload, size_t payload_size,
                            const uint64_t* offsets, int64_t tokens, int block_tokens, uint16_t* y,
                            int64_t first_position = 0, bool integer_reconstruction = false);
// Where the raw tokens start in a batch payload whose streams end at
// streams_end, and how many bytes they take.
inline uint64_t raw_offset(uint64_t streams_end) { return (streams_end + 15) / 16 * 16; }
uint64_t raw_bytes(const FlatKvtcTables& t, int64_t tokens);

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

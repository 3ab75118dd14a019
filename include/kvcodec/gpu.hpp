// kvcodec GPU codec: KVTC encode/decode of a batch of KV blocks resident on
// an NVIDIA GPU, in the "kvtc-gpu/4" variant of the payload (see
// docs/gpu.md; the CPU reads and writes it too, src/gpu/kvtc_variant.hpp).
//
// Built with -DKVCODEC_CUDA=ON; otherwise cuda_compiled() is false,
// device_count() is 0 and constructing a codec throws Error(kUnsupported).
// No CUDA types here: a stream is passed as void* (a cudaStream_t, nullptr =
// the default stream).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace kvcodec {
struct KvtcCalibration;
}
namespace kvcodec::kvtc {
struct HeadParams;
}
namespace kvcodec::palu {
struct Projection;
}

namespace kvcodec::gpu {

bool cuda_compiled() noexcept;
int device_count() noexcept;  // 0 when not compiled or no usable device

// Codes KV laid out [NH, S, D] bf16 (NH heads, e.g. layers x batch x kv heads
// flattened, each with its own fitted parameters; D in {64, 128}) as one
// independent rANS stream per (head, block of 64 tokens), stream index
// h * ceil(S / 64) + b.
//
// Calibrated format (the second constructor; docs/gpu.md): a "head" is one
// (layer, key or value, batch row), in that order, whose rows are the
// layer's KV token-major, [S, n_kv_heads, head_dim] (the heads of a token
// concatenated, D = n_kv_heads * head_dim), coded with the layer's
// calibrated basis; keys get RoPE (position = token index) removed before
// the projection and re-applied in the decode kernel; the first `sinks` and
// the last `window` tokens of each head are kept raw (after the streams in
// the payload), the rest coded in streams of 64 tokens.
struct CalibratedLayout {
  std::vector<int> layers;  // calibration layers, in head order
  int batch = 1;
  int64_t max_tokens = 0;   // longest sequence S (RoPE table and scratch)
  int sinks = 4;
  int window = 128;
};

class KvtcGpuCodec {
 public:
  // Uploads the heads' frozen parameters (rANS coder) and sizes the scratch
  // for up to max_tokens tokens per head.
  KvtcGpuCodec(const std::vector<const kvtc::HeadParams*>& heads, int64_t max_tokens);
  // The calibrated format; throws Error(kUnsupported) unless n_kv_heads *
  // head_dim is 64 or 128 (the kernels' D) and head_dim a multiple of 32.
  KvtcGpuCodec(const KvtcCalibration& cal, const CalibratedLayout& layout);
  ~KvtcGpuCodec();
  KvtcGpuCodec(const KvtcGpuCodec&) = delete;
  KvtcGpuCodec& operator=(const KvtcGpuCodec&) = delete;

  static constexpr int kBlockTokens = 64;
  int n_heads() const;
  int head_dim() const;
  int sinks() const;   // raw tokens at each head's start (0 for the plain format)
  int window() const;  // raw tokens at each head's end
  // Streams of a sequence of `tokens` tokens (its coded part).
  int64_t n_streams(int64_t tokens) const;
  uint64_t max_encoded_bytes(int64_t tokens) const;

  // x: device pointer (16-byte aligned) to [NH, tokens, D] bf16. out (capacity
  // bytes) and offsets ([n_streams + 1], u64) may be device or pinned-host
  // memory. Returns the payload size. Waits on the stream once (to learn the
  // total before packing the streams); throws Error(kInvalidArgument) when
  // capacity is too small. The payload is the streams, then (calibrated
  // format, 16-byte aligned) the raw sinks and window [NH][raw][D] bf16.
  // first_position: the position of x's first token (RoPE of the calibrated
  // format; first_position + tokens <= max_tokens), 0 for a whole sequence.
  uint64_t encode(const uint16_t* x, int64_t tokens, uint8_t* out, uint64_t capacity, uint64_t* offsets,
                  void* stream = nullptr, int64_t first_position = 0);

  // Inverse of encode, asynchronous on the stream: in (in_size bytes) and
  // offsets as encode wrote them, y: device [NH, tokens, D] bf16 (16-byte
  // aligned). Malformed streams are flagged on the device: check_errors()
  // waits for the stream and throws Error(kFormat) naming the first bad one
  // of the decodes since the last check_errors() (the flags are sticky).
  void decode(const uint8_t* in, uint64_t in_size, const uint64_t* offsets, int64_t tokens, uint16_t* y,
              void* stream = nullptr, int64_t first_position = 0);
  void check_errors(void* stream = nullptr);

  // Per-phase timing for benchmarks (CUDA events between the launches; off
  // by default). last_phase_ms() waits for the last call's events and gives
  // encode: {projection, rANS, scan + pack}, decode: {rANS, reconstruction}.
  // Phase timing runs the phases one after the other (no pipelining).
  void set_phase_timing(bool on);
  // The heads are cut into `chunks` ranges (default 1, at most the head
  // count) whose second stage (rANS encode, reconstruction) overlaps the
  // first stage (projection, rANS decode) of the next range on an internal
  // stream; the caller's stream waits for both. 1 = strictly in order.
  // Same bytes and outputs either way.
  void set_pipeline_chunks(int chunks);
  std::vector<double> last_phase_ms() const;

  // How decode turns codes back into bf16. kExactFp32 (default): the
  // variant's specified fp32 FMA order, bit-identical to the CPU reference.
  // kTf32TensorCores: the same product on tensor cores with TF32 operands
  // and fp32 accumulation; codes and streams are unchanged, each output is
  // within 2^-9 * sum_k |v_k * basis[k][d]| of the exact fp32 value before
  // the bf16 rounding (v_k the dequantized coefficients; tested).
  // set_fused_decode(true) makes the kTf32TensorCores decode ONE kernel:
  // each warp rANS-decodes a stream into shared memory and reconstructs it
  // from there, so the codes never reach global memory. Same outputs as the
  // default two-kernel path, bit for bit (tested); measured slower on the
  // H200 (docs/gpu.md), hence off by default. In the
  // calibrated format the bound holds before the weights and RoPE, which
  // carry it through: x 1/scale[d], then |cos| e_a + |sin| e_b for each
  // rotated pair (src/gpu/kvtc_variant.hpp, tf32_bound_violations).
  // kInteger: the CPU codec's integer reconstruction (kvtc::dequantize_block
  // by default), its int32 sums exact on the tensor cores: before the
  // weights and RoPE every output equals the CPU codec's for the same codes
  // (tested; gpu::reconstruct_int_f32_reference). Heads without the
  // integer tables, and batches with 16-bit codes, take the TF32 path.
  // With set_fused_decode(true), where every head has the integer tables
  // and the codes are 8-bit, the kInteger decode is ONE kernel too (rANS
  // into shared memory, reconstructed from there; same outputs, bit for
  // bit, tested); measured slower than the two kernels (docs/gpu.md).
  enum class Reconstruction { kExactFp32 = 0, kTf32TensorCores = 1, kInteger = 2 };
  void set_reconstruction(Reconstruction r);
  void set_fused_decode(bool on);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Compressed KV offload tier (issue 20 item 3; docs/gpu.md): a sequence's KV
// leaves GPU memory layer by layer as the calibrated format's payload in
// pinned host memory, and comes back by host-to-device copies of those
// compressed bytes overlapped with the GPU decode: later layers are copied
// on an internal copy stream into device staging buffers while earlier ones
// decode (set_decode_lanes).
//
// A model layer's KV on the device is one buffer [2, B, S, D] bf16 (keys
// [B, S, D], then values [B, S, D]; 16-byte aligned), D = the calibration's
// n_kv_heads * head_dim: KvtcGpuCodec's calibrated layout with one
// calibration layer and `batch` = B rows. Model layer l is coded with
// calibration layer calibration_layers[l] (layers may share one).
class OffloadedKv;

class KvOffloadTier {
 public:
  // Throws Error(kInvalidArgument) for an empty layer list, a layer the
  // calibration lacks, batch < 1 or max_tokens < 1; Error(kUnsupported)
  // without CUDA or for a D the kernels cannot code.
  KvOffloadTier(const KvtcCalibration& cal, const std::vector<int>& calibration_layers, int batch,
                int64_t max_tokens, int sinks = 4, int window = 8);
  ~KvOffloadTier();
  KvOffloadTier(const KvOffloadTier&) = delete;
  KvOffloadTier& operator=(const KvOffloadTier&) = delete;

  int n_layers() const;
  // bf16 bytes of one layer's buffer [2, B, tokens, D].
  uint64_t layer_bytes(int64_t tokens) const;

  // Codes every layer (device buffers, one per model layer, each holding
  // `tokens` tokens) into pinned host memory. Runs on the stream and waits
  // for it: the handle is complete on return.
  OffloadedKv offload(const std::vector<const uint16_t*>& layers, int64_t tokens, void* stream = nullptr);
  // Decodes the handle into the layers' device buffers, asynchronously on
  // the stream (the caller's work before it on the stream comes first; the
  // handle and the buffers must live until the stream reaches this point).
  // Throws Error(kInvalidArgument) for a handle of another shape or a wrong
  // buffer count. Malformed streams: check_errors() (as KvtcGpuCodec's:
  // waits for the stream, throws Error(kFormat) naming the calibration
  // layer and stream of the first one).
  void restore(const OffloadedKv& kv, const std::vector<uint16_t*>& layers, void* stream = nullptr);
  void check_errors(void* stream = nullptr);
  // Restore's reconstruction (KvtcGpuCodec::Reconstruction; kExactFp32 by
  // default: bit-identical to the CPU reference decode of the host bytes).
  void set_reconstruction(KvtcGpuCodec::Reconstruction r);
  // Restore decodes on `lanes` internal streams (1..8, default 4; layers
  // sharing a calibration layer stay on one), so short layers, each too
  // small a launch to fill the GPU, decode side by side. Same outputs.
  void set_decode_lanes(int lanes);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The host handle: per layer one pinned block, the stream offsets
// ([n_streams + 1] u64) then, 256-byte aligned, the payload, exactly as
// KvtcGpuCodec::encode wrote them. host_bytes() counts every pinned byte.
class OffloadedKv {
 public:
  OffloadedKv();
  ~OffloadedKv();
  OffloadedKv(OffloadedKv&&) noexcept;
  OffloadedKv& operator=(OffloadedKv&&) noexcept;

  int64_t tokens() const;
  int n_layers() const;
  uint64_t host_bytes() const;
  const uint8_t* payload(int layer) const;
  uint64_t payload_size(int layer) const;
  const uint64_t* offsets(int layer) const;
  int64_t n_offsets(int layer) const;

  struct Layers;

 private:
  friend class KvOffloadTier;
  std::unique_ptr<Layers> layers_;
};

// PALU latents of one head group on the GPU, byte-exact with the CPU cache
// (src/palu): latents z = U^T x (products and sums in the CPU's order), f16
// rounding (saturating), then per token group of group_size tokens exactly
// the bytes of palu::encode_latent_group (per (row, channel) f16 min and
// scale, then the codes bit-packed at each channel's width). Decode inverts
// it: palu::decode_latent_group then x_hat = U z, rounded to bf16.
//
// x and y are [rows, tokens, dim] bf16 on the device (dim = the projection's
// dim: a head in shared mode, the group's heads concatenated in joint mode);
// tokens a multiple of group_size; group_size a multiple of 32 (<= 1024);
// rank <= 256. The packed groups are [tokens / group_size, group_bytes()].
class PaluGpuCodec {
 public:
  PaluGpuCodec(const palu::Projection& p, int rows, int group_size, int64_t max_tokens);
  ~PaluGpuCodec();
  PaluGpuCodec(const PaluGpuCodec&) = delete;
  PaluGpuCodec& operator=(const PaluGpuCodec&) = delete;

  uint64_t group_bytes() const;  // == palu::latent_group_bytes(p, rows, group_size)
  // Asynchronous on the stream; throws Error(kInvalidArgument) for a token
  // count that is not a positive multiple of group_size or exceeds max_tokens.
  void encode(const uint16_t* x, int64_t tokens, uint8_t* out, void* stream = nullptr);
  void decode(const uint8_t* in, int64_t tokens, uint16_t* y, void* stream = nullptr);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcodec::gpu

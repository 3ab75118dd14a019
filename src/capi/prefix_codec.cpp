// The C API's whole-prefix codec (kvcodec.h, "whole-prefix codec"): the
// calibrated kvtc-gpu/4 format of src/gpu, on the host through the CPU
// reference (src/gpu/kvtc_variant.hpp) or on a CUDA device through
// gpu::KvtcGpuCodec. Both take the same arguments and write the same bytes
// (tests/gpu: the GPU against the reference; tests/capi: this wrapper
// against the reference; tests/python/test_prefix.py on the GPU machine).
#include <cstring>
#include <memory>
#include <optional>

#include "cache/kvtc_calibrated.hpp"
#include "capi/calibration_handle.hpp"
#include "capi/cuda_device.hpp"
#include "capi/guard.hpp"
#include "gpu/kvtc_variant.hpp"
#include "kvcodec/gpu.hpp"

using kvcodec::Error;
using kvcodec::ErrorCode;
using kvcodec::capi::guarded;
using kvcodec::capi::require;

struct kvcodec_prefix_codec {
  std::shared_ptr<const kvcodec::KvtcCalibration> calibration;  // kept alive for the codec's tables
  int64_t max_tokens = 0;
  int32_t device = KVCODEC_PREFIX_CPU;
  // CPU: the flat tables the reference reads; CUDA: the codec holding its
  // own device copy of the same tables.
  std::optional<kvcodec::gpu::FlatKvtcTables> host;
  std::unique_ptr<kvcodec::gpu::KvtcGpuCodec> cuda;
  bool integer_reconstruction = false;  // the CPU reference's mode (KVCODEC_RECON_INTEGER)

  int64_t n_streams(int64_t tokens) const {
    if (cuda) return cuda->n_streams(tokens);
    return int64_t(host->n_heads) *
           kvcodec::gpu::n_blocks(kvcodec::gpu::coded_tokens(*host, tokens), kvcodec::gpu::KvtcGpuCodec::kBlockTokens);
  }
  uint64_t max_payload(int64_t tokens) const {
    if (cuda) return cuda->max_encoded_bytes(tokens);
    // The GPU's bound (kvtc_gpu.cu): each stream's scratch slot holds its
    // states and at most 2 bytes per symbol, 16-byte aligned; then the raw
    // tokens.
    const uint64_t cap = (kvcodec::gpu::kStateBytes +
                          2ull * kvcodec::gpu::KvtcGpuCodec::kBlockTokens * uint64_t(host->k_pad) + 15) / 16 * 16;
    return kvcodec::gpu::raw_offset(uint64_t(n_streams(tokens)) * cap) + kvcodec::gpu::raw_bytes(*host, tokens);
  }
};

namespace {

void check_tokens(const kvcodec_prefix_codec* c, int64_t tokens) {
  if (tokens < 1 || tokens > c->max_tokens)
    throw Error(ErrorCode::kInvalidArgument, "tokens " + std::to_string(tokens) + " outside [1, max_tokens = " +
                                                 std::to_string(c->max_tokens) + "]");
}

void check_positions(const kvcodec_prefix_codec* c, int64_t first, int64_t tokens) {
  check_tokens(c, tokens);
  if (first < 0 || first > c->max_tokens - tokens)
    throw Error(ErrorCode::kInvalidArgument, "positions [" + std::to_string(first) + ", " +
                                                 std::to_string(first + tokens) + ") outside [0, max_tokens = " +
                                                 std::to_string(c->max_tokens) + ")");
}

void check_stream(const kvcodec_prefix_codec* c, const void* cuda_stream) {
  if (!c->cuda && cuda_stream)
    throw Error(ErrorCode::kInvalidArgument, "cuda_stream given to a codec on the CPU (KVCODEC_PREFIX_CPU)");
}

// The GPU kernels move KV in 16-byte vectors.
void check_device_kv(const void* kv) {
  if (reinterpret_cast<uintptr_t>(kv) % 16 != 0)
    throw Error(ErrorCode::kInvalidArgument, "kv is not 16-byte aligned");
}

}  // namespace

extern "C" {

KVCODEC_API int kvcodec_cuda_device_count(int* compiled) {
  if (compiled) *compiled = kvcodec::gpu::cuda_compiled() ? 1 : 0;
  return kvcodec::gpu::device_count();
}

KVCODEC_API kvcodec_status kvcodec_prefix_codec_create(const kvcodec_calibration* calibration, int32_t layer,
                                                       int32_t batch, int64_t max_tokens, int32_t sinks,
                                                       int32_t window, int32_t device, kvcodec_prefix_codec** out) {
  return guarded("kvcodec_prefix_codec_create", [&] {
    require(out, "out");
    *out = nullptr;
    require(calibration, "calibration");
    if (device != KVCODEC_PREFIX_CPU && device != KVCODEC_PREFIX_CUDA)
      throw Error(ErrorCode::kInvalidArgument, "device " + std::to_string(device) +
                                                   " is not KVCODEC_PREFIX_CPU (0) or KVCODEC_PREFIX_CUDA (1)");
    if (batch < 1) throw Error(ErrorCode::kInvalidArgument, "batch " + std::to_string(batch) + " must be >= 1");
    if (max_tokens < 1) throw Error(ErrorCode::kInvalidArgument, "max_tokens must be >= 1");
    auto c = std::make_unique<kvcodec_prefix_codec>();
    c->calibration = kvcodec::capi::calibration_params(calibration);
    c->max_tokens = max_tokens;
    c->device = device;
    // The flat tables check the layout for both devices (layer, widths,
    // max_tokens <= 2^24, sinks and window >= 0) and give the CPU its tables.
    c->host = kvcodec::gpu::flatten_calibration(*c->calibration, {layer}, batch, max_tokens, sinks, window);
    if (device == KVCODEC_PREFIX_CUDA) {
      kvcodec::capi::require_cuda_device("KVCODEC_PREFIX_CUDA", "KVCODEC_PREFIX_CPU");
      kvcodec::gpu::CalibratedLayout layout;
      layout.layers = {layer};
      layout.batch = batch;
      layout.max_tokens = max_tokens;
      layout.sinks = sinks;
      layout.window = window;
      c->cuda = std::make_unique<kvcodec::gpu::KvtcGpuCodec>(*c->calibration, layout);
      c->host.reset();  // the device holds its copy of the tables
    }
    *out = c.release();
  });
}

KVCODEC_API void kvcodec_prefix_codec_free(kvcodec_prefix_codec* codec) { delete codec; }

KVCODEC_API kvcodec_status kvcodec_prefix_codec_set_reconstruction(kvcodec_prefix_codec* codec, int32_t mode) {
  return guarded("kvcodec_prefix_codec_set_reconstruction", [&] {
    require(codec, "codec");
    if (mode != KVCODEC_RECON_EXACT && mode != KVCODEC_RECON_TF32 && mode != KVCODEC_RECON_INTEGER)
      throw Error(ErrorCode::kInvalidArgument, "mode " + std::to_string(mode) +
                                                   " is not KVCODEC_RECON_EXACT (0), KVCODEC_RECON_TF32 (1) or "
                                                   "KVCODEC_RECON_INTEGER (2)");
    if (!codec->cuda) {
      if (mode == KVCODEC_RECON_TF32)
        throw Error(ErrorCode::kUnsupported, "KVCODEC_RECON_TF32 on the CPU: the CPU reference reconstructs exactly");
      codec->integer_reconstruction = mode == KVCODEC_RECON_INTEGER;
      return;
    }
    using Recon = kvcodec::gpu::KvtcGpuCodec::Reconstruction;
    codec->cuda->set_reconstruction(mode == KVCODEC_RECON_TF32      ? Recon::kTf32TensorCores
                                    : mode == KVCODEC_RECON_INTEGER ? Recon::kInteger
                                                                    : Recon::kExactFp32);
  });
}

KVCODEC_API kvcodec_status kvcodec_prefix_codec_bounds(const kvcodec_prefix_codec* codec, int64_t tokens,
                                                       uint64_t* max_payload_bytes, int64_t* n_offsets) {
  return guarded("kvcodec_prefix_codec_bounds", [&] {
    require(codec, "codec");
    check_tokens(codec, tokens);
    if (max_payload_bytes) *max_payload_bytes = codec->max_payload(tokens);
    if (n_offsets) *n_offsets = codec->n_streams(tokens) + 1;
  });
}

KVCODEC_API kvcodec_status kvcodec_prefix_encode(kvcodec_prefix_codec* codec, const void* kv, int64_t tokens,
                                                 int64_t first_position, void* payload, uint64_t capacity,
                                                 uint64_t* offsets, void* cuda_stream, uint64_t* written) {
  return guarded("kvcodec_prefix_encode", [&] {
    require(codec, "codec");
    require(kv, "kv");
    require(payload, "payload");
    require(offsets, "offsets");
    check_positions(codec, first_position, tokens);
    check_stream(codec, cuda_stream);
    if (written) *written = 0;
    const auto* x = static_cast<const uint16_t*>(kv);
    if (codec->cuda) {
      check_device_kv(kv);
      const uint64_t n = codec->cuda->encode(x, tokens, static_cast<uint8_t*>(payload), capacity, offsets, cuda_stream,
                                             first_position);
      if (written) *written = n;
      return;
    }
    const kvcodec::gpu::EncodedBatch e = kvcodec::gpu::encode_batch_reference(
        *codec->host, x, tokens, kvcodec::gpu::KvtcGpuCodec::kBlockTokens, first_position);
    if (e.payload.size() > capacity)
      throw kvcodec::capi::CapiError(KVCODEC_ERROR_BUFFER_TOO_SMALL,
                                     "the payload needs " + std::to_string(e.payload.size()) + " bytes, capacity is " +
                                         std::to_string(capacity) + " (kvcodec_prefix_codec_bounds gives the bound)");
    std::memcpy(payload, e.payload.data(), e.payload.size());
    std::memcpy(offsets, e.offsets.data(), e.offsets.size() * sizeof(uint64_t));
    if (written) *written = e.payload.size();
  });
}

KVCODEC_API kvcodec_status kvcodec_prefix_decode(kvcodec_prefix_codec* codec, const void* payload,
                                                 uint64_t payload_size, const uint64_t* offsets, int64_t tokens,
                                                 int64_t first_position, void* kv, void* cuda_stream) {
  return guarded("kvcodec_prefix_decode", [&] {
    require(codec, "codec");
    require(payload, "payload");
    require(offsets, "offsets");
    require(kv, "kv");
    check_positions(codec, first_position, tokens);
    check_stream(codec, cuda_stream);
    auto* y = static_cast<uint16_t*>(kv);
    if (codec->cuda) {
      check_device_kv(kv);
      codec->cuda->decode(static_cast<const uint8_t*>(payload), payload_size, offsets, tokens, y, cuda_stream,
                          first_position);
      return;
    }
    kvcodec::gpu::decode_batch_reference(*codec->host, static_cast<const uint8_t*>(payload), payload_size, offsets,
                                         tokens, kvcodec::gpu::KvtcGpuCodec::kBlockTokens, y, first_position,
                                         codec->integer_reconstruction);
  });
}

KVCODEC_API kvcodec_status kvcodec_prefix_check(kvcodec_prefix_codec* codec, void* cuda_stream) {
  return guarded("kvcodec_prefix_check", [&] {
    require(codec, "codec");
    check_stream(codec, cuda_stream);
    if (codec->cuda) codec->cuda->check_errors(cuda_stream);
  });
}

}  // extern "C"

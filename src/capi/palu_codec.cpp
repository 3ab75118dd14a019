// The C API's PALU latent codec (kvcodec.h, "PALU latent codec"): one head
// group of a palu cache, coded with the projection that cache fitted, on
// the host through the CPU reference (src/gpu/palu_reference.hpp: the
// cache's own functions) or on a CUDA device through gpu::PaluGpuCodec.
// Both write the cache's token-group bytes (tests/capi/test_capi_palu.cpp:
// the CPU path against the cache's saved bytes; tests/gpu: the kernels
// against the reference; tests/python/test_palu_codec.py on the GPU machine).
#include <cstring>
#include <memory>
#include <string>

#include "cache/streams.hpp"
#include "capi/cache_handle.hpp"
#include "capi/cuda_device.hpp"
#include "capi/guard.hpp"
#include "gpu/palu_reference.hpp"
#include "kvcodec/gpu.hpp"
#include "palu/projection.hpp"

using kvcodec::Error;
using kvcodec::ErrorCode;
using kvcodec::capi::guarded;
using kvcodec::capi::require;

struct kvcodec_palu_codec {
  kvcodec::cache_impl::PaluGroupLayout group;  // its projection is what the CPU path codes with
  kvcodec_palu_layout layout{};
  std::unique_ptr<kvcodec::gpu::PaluGpuCodec> cuda;  // set on KVCODEC_DEVICE_CUDA

  uint64_t packed_bytes(int64_t tokens) const { return uint64_t(tokens / layout.group_size) * layout.group_bytes; }
};

namespace {

// The fitted groups of one part of a palu cache, or an error naming why
// there are none.
std::vector<kvcodec::cache_impl::PaluGroupLayout> fitted_groups(const kvcodec_cache* cache, bool keys) {
  require(cache, "cache");
  if (cache->method != "palu")
    throw Error(ErrorCode::kInvalidArgument, "cache is of method '" + cache->method + "', not 'palu'");
  auto groups = kvcodec::cache_impl::palu_groups(*cache->cache, keys);
  if (groups.empty())
    throw Error(ErrorCode::kInvalidArgument,
                "the palu cache has not fitted its projections yet (" + std::to_string(cache->cache->offset()) +
                    " tokens held; it fits once its appends bring min_fit_tokens, a calibrated cache at its first "
                    "append)");
  return groups;
}

// What both devices take, so a program that runs on one runs on the other:
// the GPU kernels' limits (src/gpu/cuda/palu_gpu.cu) and a grid of < 2^31
// CTAs (one per token group and row).
void check_codable(const kvcodec::cache_impl::PaluGroupLayout& g, int64_t max_tokens) {
  const kvcodec::palu::Projection& p = g.projection;
  if (g.group_size < 32 || g.group_size > 1024 || g.group_size % 32 != 0)
    throw Error(ErrorCode::kUnsupported, "the cache's group_size " + std::to_string(g.group_size) +
                                             " is not a multiple of 32 up to 1024 (the GPU kernels' token groups)");
  if (p.rank > 256)
    throw Error(ErrorCode::kUnsupported, "the group's rank " + std::to_string(p.rank) +
                                             " is over 256 (the GPU kernels' limit)");
  if (max_tokens < g.group_size || max_tokens / g.group_size > ((int64_t(1) << 31) - 1) / g.rows)
    throw Error(ErrorCode::kInvalidArgument, "max_tokens " + std::to_string(max_tokens) +
                                                 " must be at least group_size " + std::to_string(g.group_size) +
                                                 " and give fewer than 2^31 (token group, row) pairs");
}

void check_palu_tokens(const kvcodec_palu_codec* c, int64_t tokens) {
  const int64_t gs = c->layout.group_size;
  if (tokens < gs || tokens % gs != 0 || tokens > c->layout.max_tokens)
    throw Error(ErrorCode::kInvalidArgument, "tokens " + std::to_string(tokens) +
                                                 " is not a positive multiple of group_size " + std::to_string(gs) +
                                                 " up to max_tokens " + std::to_string(c->layout.max_tokens));
}

void check_palu_stream(const kvcodec_palu_codec* c, const void* a, const void* b, const void* cuda_stream) {
  if (!c->cuda && cuda_stream)
    throw Error(ErrorCode::kInvalidArgument, "cuda_stream given to a codec on the CPU (KVCODEC_DEVICE_CPU)");
  // The kernels store the packed groups and read the latents' words 4 bytes at a time.
  if (c->cuda && (reinterpret_cast<uintptr_t>(a) % 4 != 0 || reinterpret_cast<uintptr_t>(b) % 4 != 0))
    throw Error(ErrorCode::kInvalidArgument, "device buffers must be 4-byte aligned");
}

}  // namespace

extern "C" {

KVCODEC_API kvcodec_status kvcodec_palu_head_groups(const kvcodec_cache* cache, int32_t* n_groups) {
  return guarded("kvcodec_palu_head_groups", [&] {
    require(n_groups, "n_groups");
    *n_groups = int32_t(fitted_groups(cache, true).size());
  });
}

KVCODEC_API kvcodec_status kvcodec_palu_codec_create(const kvcodec_cache* cache, int32_t part, int32_t head_group,
                                                     int64_t max_tokens, int32_t device, kvcodec_palu_codec** out) {
  return guarded("kvcodec_palu_codec_create", [&] {
    require(out, "out");
    *out = nullptr;
    if (part != KVCODEC_KEYS && part != KVCODEC_VALUES)
      throw Error(ErrorCode::kInvalidArgument,
                  "part " + std::to_string(part) + " is not KVCODEC_KEYS (0) or KVCODEC_VALUES (1)");
    if (device != KVCODEC_DEVICE_CPU && device != KVCODEC_DEVICE_CUDA)
      throw Error(ErrorCode::kInvalidArgument, "device " + std::to_string(device) +
                                                   " is not KVCODEC_DEVICE_CPU (0) or KVCODEC_DEVICE_CUDA (1)");
    auto groups = fitted_groups(cache, part == KVCODEC_KEYS);
    if (head_group < 0 || size_t(head_group) >= groups.size())
      throw Error(ErrorCode::kInvalidArgument, "head_group " + std::to_string(head_group) + " outside [0, " +
                                                   std::to_string(groups.size()) + ") (the cache's head groups)");
    auto c = std::make_unique<kvcodec_palu_codec>();
    c->group = std::move(groups[size_t(head_group)]);
    const auto& g = c->group;
    if (!g.quantize)
      throw Error(ErrorCode::kUnsupported,
                  "the cache keeps its value latents f16 (quantize_values=false): it stores no token groups");
    check_codable(g, max_tokens);
    kvcodec_palu_layout& l = c->layout;
    l.first_head = g.first_head;
    l.n_heads = g.n_heads;
    l.joint = g.joint ? 1 : 0;
    l.rows = int32_t(g.rows);
    l.dim = g.projection.dim;
    l.rank = g.projection.rank;
    l.group_size = int32_t(g.group_size);
    l.keys_without_rope = g.rope_removed ? 1 : 0;
    l.first_token = g.first_token;
    l.max_tokens = max_tokens;
    l.group_bytes = kvcodec::palu::latent_group_bytes(g.projection, g.rows, g.group_size);
    if (device == KVCODEC_DEVICE_CUDA) {
      kvcodec::capi::require_cuda_device("KVCODEC_DEVICE_CUDA", "KVCODEC_DEVICE_CPU");
      c->cuda = std::make_unique<kvcodec::gpu::PaluGpuCodec>(g.projection, int(g.rows), int(g.group_size),
                                                              max_tokens);
    }
    *out = c.release();
  });
}

KVCODEC_API void kvcodec_palu_codec_free(kvcodec_palu_codec* codec) { delete codec; }

KVCODEC_API kvcodec_status kvcodec_palu_codec_layout(const kvcodec_palu_codec* codec, kvcodec_palu_layout* out) {
  return guarded("kvcodec_palu_codec_layout", [&] {
    require(codec, "codec");
    require(out, "out");
    *out = codec->layout;
  });
}

KVCODEC_API kvcodec_status kvcodec_palu_encode(kvcodec_palu_codec* codec, const void* x, int64_t tokens,
                                               void* packed, uint64_t capacity, void* cuda_stream) {
  return guarded("kvcodec_palu_encode", [&] {
    require(codec, "codec");
    check_palu_tokens(codec, tokens);
    require(x, "x");
    require(packed, "packed");
    check_palu_stream(codec, x, packed, cuda_stream);
    const uint64_t need = codec->packed_bytes(tokens);
    if (capacity < need)
      throw kvcodec::capi::CapiError(KVCODEC_ERROR_BUFFER_TOO_SMALL,
                                     std::to_string(tokens) + " tokens pack into " + std::to_string(need) +
                                         " bytes, capacity is " + std::to_string(capacity));
    const auto* in = static_cast<const uint16_t*>(x);
    if (codec->cuda) {
      codec->cuda->encode(in, tokens, static_cast<uint8_t*>(packed), cuda_stream);
      return;
    }
    const std::vector<uint8_t> bytes = kvcodec::gpu::palu_encode_reference(
        codec->group.projection, in, codec->layout.rows, tokens, codec->layout.group_size);
    std::memcpy(packed, bytes.data(), bytes.size());
  });
}

KVCODEC_API kvcodec_status kvcodec_palu_decode(kvcodec_palu_codec* codec, const void* packed, uint64_t size,
                                               int64_t tokens, void* x, void* cuda_stream) {
  return guarded("kvcodec_palu_decode", [&] {
    require(codec, "codec");
    check_palu_tokens(codec, tokens);
    require(packed, "packed");
    require(x, "x");
    check_palu_stream(codec, packed, x, cuda_stream);
    if (size != codec->packed_bytes(tokens))
      throw Error(ErrorCode::kFormat, std::to_string(size) + " packed bytes for " + std::to_string(tokens) +
                                          " tokens: " + std::to_string(tokens / codec->layout.group_size) +
                                          " token groups of " + std::to_string(codec->layout.group_bytes) +
                                          " bytes are " + std::to_string(codec->packed_bytes(tokens)));
    auto* y = static_cast<uint16_t*>(x);
    if (codec->cuda) {
      codec->cuda->decode(static_cast<const uint8_t*>(packed), tokens, y, cuda_stream);
      return;
    }
    kvcodec::gpu::palu_decode_reference(codec->group.projection, static_cast<const uint8_t*>(packed), size_t(size),
                                        codec->layout.rows, tokens, codec->layout.group_size, y);
  });
}

}  // extern "C"

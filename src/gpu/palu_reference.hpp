// Plain CPU reference of the PALU GPU kernels (src/gpu/cuda/palu_gpu.cu):
// the CPU cache's own functions (palu::Projection::project / reconstruct,
// f16 saturation of the latents, palu::encode_latent_group /
// decode_latent_group) applied to a head group laid out [rows, tokens, dim]
// bf16, as src/cache/palu_stream.cpp applies them token by token. The GPU
// must produce exactly these bytes and these bf16 reconstructions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvcodec::palu {
struct Projection;
}

namespace kvcodec::gpu {

// x [rows, tokens, dim] bf16 -> tokens / group_size packed token groups of
// palu::latent_group_bytes(p, rows, group_size) bytes each, concatenated.
std::vector<uint8_t> palu_encode_reference(const palu::Projection& p, const uint16_t* x, int rows, int64_t tokens,
                                           int group_size);
// Inverse: y [rows, tokens, dim] bf16 (round to nearest even of the CPU's float).
void palu_decode_reference(const palu::Projection& p, const uint8_t* blob, size_t size, int rows, int64_t tokens,
                           int group_size, uint16_t* y);

}  // namespace kvcodec::gpu

// The offload tier's host handle (kvcodec/gpu.hpp: OffloadedKv): per model
// layer one pinned block, [n_offsets] u64 stream offsets then, at
// payload_at (256-byte aligned), the layer's calibrated-format payload.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvcodec/gpu.hpp"

namespace kvcodec::gpu {

struct OffloadedKv::Layers {
  struct Block {
    std::shared_ptr<uint8_t> mem;  // pinned; the deleter frees it (cudaFreeHost)
    uint64_t bytes = 0;            // of mem
    uint64_t payload_at = 0, payload_size = 0;
    int64_t n_offsets = 0;
  };
  int64_t tokens = 0;
  std::vector<Block> blocks;

  // Throws Error(kInvalidArgument) for a layer outside [0, blocks.size()).
  const Block& at(int layer) const;
};

// Where a layer's payload starts in its block: after the offsets, 256-byte
// aligned (so the device staging copy keeps the payload's alignment).
inline uint64_t offload_payload_at(int64_t n_offsets) { return (uint64_t(n_offsets) * 8 + 255) / 256 * 256; }

}  // namespace kvcodec::gpu

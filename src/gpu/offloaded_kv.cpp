// OffloadedKv's accessors: plain host code, built with or without CUDA.
#include "gpu/offloaded_kv.hpp"

#include <string>

#include "kvcodec/error.hpp"

namespace kvcodec::gpu {

const OffloadedKv::Layers::Block& OffloadedKv::Layers::at(int layer) const {
  if (layer < 0 || size_t(layer) >= blocks.size())
    throw Error(ErrorCode::kInvalidArgument, "offloaded KV: layer " + std::to_string(layer) + " outside [0, " +
                                                 std::to_string(blocks.size()) + ")");
  return blocks[size_t(layer)];
}

OffloadedKv::OffloadedKv() : layers_(std::make_unique<Layers>()) {}
OffloadedKv::~OffloadedKv() = default;
OffloadedKv::OffloadedKv(OffloadedKv&&) noexcept = default;
OffloadedKv& OffloadedKv::operator=(OffloadedKv&&) noexcept = default;

int64_t OffloadedKv::tokens() const { return layers_ ? layers_->tokens : 0; }
int OffloadedKv::n_layers() const { return layers_ ? int(layers_->blocks.size()) : 0; }

uint64_t OffloadedKv::host_bytes() const {
  uint64_t n = 0;
  if (layers_)
    for (const auto& b : layers_->blocks) n += b.bytes;
  return n;
}

namespace {
const OffloadedKv::Layers& held(const std::unique_ptr<OffloadedKv::Layers>& l) {
  if (!l) throw Error(ErrorCode::kInvalidArgument, "offloaded KV: the handle was moved from");
  return *l;
}
}  // namespace

const uint8_t* OffloadedKv::payload(int layer) const {
  const auto& b = held(layers_).at(layer);
  return b.mem.get() + b.payload_at;
}
uint64_t OffloadedKv::payload_size(int layer) const { return held(layers_).at(layer).payload_size; }
const uint64_t* OffloadedKv::offsets(int layer) const {
  return reinterpret_cast<const uint64_t*>(held(layers_).at(layer).mem.get());
}
int64_t OffloadedKv::n_offsets(int layer) const { return held(layers_).at(layer).n_offsets; }

}  // namespace kvcodec::gpu

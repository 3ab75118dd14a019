// Whole KV dumps through the caches: what `kvcodec compress`, `decompress`
// and `inspect` do (DESIGN 9).
//
// A KV dump is a safetensors file with layers.{i}.key / layers.{i}.value
// [B, H_kv, T, D] (f32, f16 or bf16; keys post-RoPE). A compressed dump is a
// container of kind `dump`:
//
//   meta     format=kvcodec-dump, method, settings (JSON object of the
//            method's fields), n_layers, shape "[B, H, T, D]", dtype (the
//            dump's, restored by default on decompression)
//   sections layer.<i> = the bytes of layer i's cache save() (itself a
//            container of kind `cache`, checksummed), i = 0 .. n_layers-1
//
// Everything the caches store is in the file; its size against the f16 size
// of the dump is the ratio `compress` reports.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/safetensors.hpp"

namespace kvcodec::dump {

// The per-layer tensors of a KV dump, as views into the mapped file.
struct KvDump {
  SafetensorsFile file;                   // keeps the views' mapping alive
  std::vector<TensorView> keys, values;   // [B, H, T, D] each, layer order
  Shape4 shape{};                         // common to every tensor
  DType dtype = DType::kF32;              // of layer 0's key (all must agree)

  int n_layers() const { return int(keys.size()); }
  uint64_t f16_bytes() const;             // what f16 K and V of every layer take
};

// Reads and validates: layers numbered from 0 without gaps, key and value of
// each layer present, one shape and one dtype for all. Errors name the file
// and the tensor.
KvDump read_kv_dump(const std::string& path);

struct CompressOptions {
  std::string method = "kvtc";
  Settings settings;     // the method's fields (no "<method>." prefix)
  double rope_theta = 10000.0;
  int threads = 1;       // layers compressed in parallel
  // Called after each layer (from the calling thread's loop; may be empty).
  std::function<void(int layers_done, int n_layers)> progress;
};

// Every layer through a cache of `method`, saved into one dump container.
std::vector<uint8_t> compress_dump(const KvDump& dump, const CompressOptions& options);

// A compressed dump opened for reading: its layer caches restored exactly.
struct CompressedDump {
  std::string method;
  Shape4 shape{};
  DType dtype = DType::kF32;
  std::vector<std::unique_ptr<KVCache>> layers;

  CacheStats stats() const;  // summed over layers
};

// Checks kind, format, metadata and that every layer's cache holds the
// promised tokens with the promised shape and method (Error(kFormat) naming
// what disagrees).
CompressedDump open_compressed_dump(const ContainerReader& container);

// Reconstructs every layer as layers.{i}.key / layers.{i}.value in `dtype`.
SafetensorsWriter decompress_dump(const CompressedDump& dump, DType dtype);

}  // namespace kvcodec::dump

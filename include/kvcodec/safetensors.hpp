// kvcodec: safetensors reading and writing.
//
// A safetensors file is: u64 little-endian header length N, N bytes of JSON
// ({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {k: v}}),
// then the data section; offsets are relative to the start of the data
// section. Readers map the file read-only and validate every header field
// before handing out a pointer, so a malformed or hostile file gives a
// kvcodec::Error (kFormat, naming the file and the tensor) and never an
// out-of-bounds read or a huge allocation.
//
// KV tensors come back as TensorView [B, H, S, D] pointing into the mapping:
// the view is valid while any copy of the SafetensorsFile (or the
// SafetensorsModel holding it) is alive. Copies share the mapping.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvcodec/tensor.hpp"

namespace kvcodec {

// Bytes per element of a safetensors dtype string ("F32", "BF16", "I64", "BOOL",
// "F8_E4M3", ...); 0 for an unknown dtype.
size_t safetensors_dtype_size(const std::string& dtype) noexcept;

class SafetensorsFile {
 public:
  struct TensorInfo {
    std::string name;
    std::string dtype;           // as written in the file: "F32", "F16", "BF16", "I64", ...
    std::vector<int64_t> shape;  // any rank, every dim >= 0
    uint64_t offset = 0;         // bytes from the start of the data section
    uint64_t size = 0;           // bytes (== product(shape) * itemsize)
  };

  // Largest JSON header accepted: real checkpoints use a few hundred KB.
  static constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

  SafetensorsFile() = default;  // empty: no tensors

  // Maps `path` read-only and validates the header. Throws kIo (cannot open)
  // or kFormat (malformed; the message names the file and the tensor).
  static SafetensorsFile open(const std::string& path);
  // Same validation over bytes held in memory (the fuzzer's entry point);
  // `label` names the source in error messages.
  static SafetensorsFile from_bytes(std::vector<uint8_t> bytes, const std::string& label = "<memory>");

  const std::string& path() const;  // path or label
  // Tensor names, sorted (byte order).
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  size_t size() const;  // number of tensors
  // Throws kNotFound naming the tensor and the file.
  const TensorInfo& info(const std::string& name) const;
  // Start of the tensor's bytes (may be nullptr for an empty tensor).
  const uint8_t* raw(const std::string& name) const;
  // F32/F16/BF16 tensors of rank <= 4 as [B, H, S, D], lower ranks padded with
  // leading 1s ([S, D] -> [1, 1, S, D]). Zero copy. Throws kUnsupported for
  // other dtypes, rank > 4, or data not aligned to the element size.
  TensorView view4(const std::string& name) const;
  // Any float dtype (F64/F32/F16/BF16), any rank, converted to f32, row-major.
  std::vector<float> read_f32(const std::string& name) const;
  // An owning copy of view4(name) converted to `dtype` (outlives the file).
  Tensor tensor(const std::string& name, DType dtype) const;
  // "__metadata__" (string -> string).
  const std::map<std::string, std::string>& metadata() const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// A checkpoint folder: DIR/model.safetensors, or DIR/model.safetensors.index.json
// whose "weight_map" sends each tensor name to a shard file in DIR. Also accepts
// the path of a .safetensors file or of an index .json directly.
class SafetensorsModel {
 public:
  SafetensorsModel() = default;
  // Opens every shard up front, so a missing shard or a tensor the index
  // promises but its shard lacks is reported here (kNotFound / kFormat).
  static SafetensorsModel open(const std::string& path);

  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  const SafetensorsFile::TensorInfo& info(const std::string& name) const;
  const uint8_t* raw(const std::string& name) const;
  TensorView view4(const std::string& name) const;
  std::vector<float> read_f32(const std::string& name) const;
  Tensor tensor(const std::string& name, DType dtype) const;
  // The shard that holds `name` (throws kNotFound).
  const SafetensorsFile& file_of(const std::string& name) const;
  // Index "metadata" (values as JSON text when not strings) or the single file's __metadata__.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  size_t shard_count() const { return shards_.size(); }

 private:
  std::string label_;
  std::vector<SafetensorsFile> shards_;
  std::map<std::string, size_t> where_;  // tensor name -> shard index
  std::map<std::string, std::string> metadata_;
};

// Builds a safetensors file. Tensors are laid out in the order added, each
// aligned to 8 bytes (so views of any dtype are aligned); the header is
// padded with spaces to a multiple of 8.
class SafetensorsWriter {
 public:
  // Copies the view (any strides) as a contiguous 4-D tensor of its dtype.
  void add(const std::string& name, const TensorView& view);
  // Raw bytes of any known dtype; bytes.size() must equal product(shape) * itemsize.
  void add(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
           std::vector<uint8_t> bytes);
  void add_metadata(const std::string& key, const std::string& value);
  size_t size() const { return tensors_.size(); }

  std::vector<uint8_t> to_bytes() const;
  // Atomic: writes a temporary file in the same folder, fsyncs, renames over path.
  void write(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kvcodec

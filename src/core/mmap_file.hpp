// kvcodec internal: read-only file mapping and atomic file writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvcodec {

// A whole file mapped read-only (PROT_READ, MAP_PRIVATE). Move-only; unmaps on
// destruction. An empty file maps to data() == nullptr, size() == 0.
class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::string& path);  // throws Error(kIo) naming the path
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void release() noexcept;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Size of a regular file in bytes; throws Error(kIo) naming the path.
uint64_t file_size(const std::string& path);

// Reads a whole file; throws kIo, or kFormat when it is larger than max_bytes
// (checked before allocating, so a huge file cannot exhaust memory).
std::vector<uint8_t> read_file_bytes(const std::string& path, uint64_t max_bytes);

// Writes bytes to `path` atomically: a temporary file in the same folder,
// fsync, rename over the target, fsync of the folder. Readers see the old
// file or the new one, never a torn one. Throws Error(kIo) naming the path.
void write_file_atomic(const std::string& path, const void* data, size_t size);

}  // namespace kvcodec

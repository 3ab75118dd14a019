// kvcodec: the container format (DESIGN 7) and byte serialisation helpers.
//
// One versioned, checksummed format for a saved cache, a compressed KV dump,
// a calibration file and a server prefix-store entry. docs/format.md gives the
// byte layout. In short, all integers little-endian:
//
//   header   : magic "KVCODEC\0" (8) | u16 version | u16 flags | u32 kind
//              | u32 meta_count | meta_count x { u16 klen, key, u32 vlen, value }
//   sections : section_count x { u8 nlen, name (1..64 printable ASCII),
//                                u64 length, u64 XXH3-64(payload), payload }
//   trailer  : "KVCE" | u32 section_count | u64 XXH3-64(every byte before the trailer)
//
// Readers check structure (every length against what is left), each section's
// checksum (kChecksum, naming the section) and the trailer hash (so truncation
// and any flipped byte anywhere are detected). Limits bound what a hostile
// file can make the reader allocate.
//
// ByteWriter / ByteReader serialise a codec's state into a section payload:
// little-endian integers and floats, LEB128 varints, strings, arrays. The
// reader is bounds-checked and throws Error(kFormat) naming its context and
// the offset; array reads check the count against the bytes left before
// allocating.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace kvcodec {

enum class ContainerKind : uint32_t { kCache = 1, kDump = 2, kCalibration = 3, kPrefix = 4 };
const char* container_kind_name(ContainerKind kind) noexcept;  // "cache", "dump", ...

inline constexpr uint16_t kContainerVersion = 1;
inline constexpr size_t kContainerMaxSectionName = 64;

// Bytes the container adds around the section payloads, exactly: header and
// metadata, per-section framing, trailer. For every container,
// finish().size() == container_overhead(meta, names) + sum of payload sizes,
// so a cache can check telemetry == saved size - overhead.
size_t container_overhead(const std::map<std::string, std::string>& meta,
                          const std::vector<std::string>& section_names);
inline constexpr size_t kContainerHeaderBytes = 8 + 2 + 2 + 4 + 4;  // before the metadata entries
inline constexpr size_t kContainerTrailerBytes = 16;
inline size_t container_section_overhead(const std::string& name) { return 1 + name.size() + 8 + 8; }

class ContainerWriter {
 public:
  explicit ContainerWriter(ContainerKind kind) : kind_(kind) {}
  // Metadata: string -> string (method, config JSON, model shape...). Overwrites.
  void set_meta(const std::string& key, const std::string& value);
  // Sections keep the order added. Name: 1..64 printable ASCII, unique
  // (throws Error(kInvalidArgument) otherwise).
  void add_section(const std::string& name, std::vector<uint8_t> bytes);
  bool has_section(const std::string& name) const;

  std::vector<uint8_t> finish() const;
  // Atomic: temporary file in the same folder + fsync + rename.
  void write_file(const std::string& path) const;
  // container_overhead() of what was added so far.
  size_t overhead() const;
  size_t payload_bytes() const;  // sum of section payload sizes

 private:
  ContainerKind kind_;
  std::map<std::string, std::string> meta_;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> sections_;
};

struct ContainerLimits {
  size_t max_sections = 4096;
  size_t max_meta_bytes = 1u << 20;          // all metadata keys + values
  uint64_t max_total_bytes = 16ull << 30;    // whole container (file size checked before reading)
  // false skips the XXH3 checks (section and trailer) but none of the
  // structural checks: for fuzzing the parser past the checksums and for
  // inspecting a damaged file. Never for loading state.
  bool verify_checksums = true;
};

class ContainerReader {
 public:
  // Views the caller's bytes (no copy): they must outlive the reader and its spans.
  // `label` names the source in error messages.
  static ContainerReader parse(const uint8_t* data, size_t size, ContainerLimits limits = {},
                               const std::string& label = "<memory>");
  static ContainerReader parse(std::span<const uint8_t> bytes, ContainerLimits limits = {},
                               const std::string& label = "<memory>") {
    return parse(bytes.data(), bytes.size(), limits, label);
  }
  // Reads the whole file and owns the bytes (copies of the reader share them).
  static ContainerReader read_file(const std::string& path, ContainerLimits limits = {});

  ContainerKind kind() const { return kind_; }
  // Throws Error(kFormat) naming both kinds when the container is of another kind.
  void expect_kind(ContainerKind expected) const;
  uint16_t version() const { return version_; }
  const std::map<std::string, std::string>& meta() const { return meta_; }
  // Throws Error(kNotFound) naming the key.
  const std::string& meta_or_throw(const std::string& key) const;
  bool has(const std::string& name) const;
  // Throws Error(kNotFound) naming the section.
  std::span<const uint8_t> section(const std::string& name) const;
  std::vector<std::string> section_names() const;  // in file order
  size_t total_bytes() const { return size_; }
  size_t overhead() const;  // total_bytes() - sum of payloads
  const std::string& label() const { return label_; }

 private:
  struct Section {
    std::string name;
    size_t offset;
    size_t length;
  };
  std::string label_;
  std::shared_ptr<const std::vector<uint8_t>> owned_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  ContainerKind kind_ = ContainerKind::kCache;
  uint16_t version_ = 0;
  std::map<std::string, std::string> meta_;
  std::vector<Section> sections_;
};

// Little-endian serialisation into a growing buffer.
class ByteWriter {
 public:
  void u8(uint8_t v) { buf_.push_back(v); }
  void u16(uint16_t v) { put_le(v, 2); }
  void u32(uint32_t v) { put_le(v, 4); }
  void u64(uint64_t v) { put_le(v, 8); }
  void i32(int32_t v) { put_le(uint32_t(v), 4); }
  void i64(int64_t v) { put_le(uint64_t(v), 8); }
  void f32(float v);
  void f64(double v);
  void boolean(bool v) { u8(v ? 1 : 0); }
  void varint(uint64_t v);   // LEB128, 1..10 bytes
  void svarint(int64_t v);   // zigzag + LEB128
  void bytes(const void* data, size_t n);
  void bytes(std::span<const uint8_t> b) { bytes(b.data(), b.size()); }
  void str(const std::string& s);  // varint length + bytes
  // Arrays without a length (the caller writes one, or knows it).
  void f32s(const float* v, size_t n);
  void u16s(const uint16_t* v, size_t n);  // e.g. f16 / bf16 bit patterns
  void f16s_from_f32(const float* v, size_t n);  // converts (round to nearest even)
  // Arrays with a varint length prefix.
  void f32_vec(const std::vector<float>& v) { varint(v.size()); f32s(v.data(), v.size()); }
  void u8_vec(const std::vector<uint8_t>& v) { varint(v.size()); bytes(v.data(), v.size()); }

  size_t size() const { return buf_.size(); }
  const std::vector<uint8_t>& data() const { return buf_; }
  std::vector<uint8_t> take() { return std::move(buf_); }

 private:
  void put_le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) buf_.push_back(uint8_t(v >> (8 * i)));
  }
  std::vector<uint8_t> buf_;
};

// Bounds-checked reader over bytes it does not own. Every failure throws
// Error(kFormat) "<context>: <what> at offset N".
class ByteReader {
 public:
  explicit ByteReader(std::span<const uint8_t> bytes, std::string context = "bytes")
      : data_(bytes.data()), size_(bytes.size()), context_(std::move(context)) {}
  ByteReader(const uint8_t* data, size_t size, std::string context = "bytes")
      : data_(data), size_(size), context_(std::move(context)) {}

  uint8_t u8();
  uint16_t u16() { return uint16_t(get_le(2)); }
  uint32_t u32() { return uint32_t(get_le(4)); }
  uint64_t u64() { return get_le(8); }
  int32_t i32() { return int32_t(uint32_t(get_le(4))); }
  int64_t i64() { return int64_t(get_le(8)); }
  float f32();
  double f64();
  bool boolean();  // 0 or 1, anything else is an error
  uint64_t varint();
  int64_t svarint();
  // A varint that must be <= max (names `what` in the error): counts, sizes.
  uint64_t count(uint64_t max, const char* what);
  std::span<const uint8_t> bytes(size_t n);  // a view, no copy
  std::string str(size_t max_len = 1u << 20);
  std::vector<float> f32s(size_t n);
  std::vector<uint16_t> u16s(size_t n);
  std::vector<float> f16s_to_f32(size_t n);
  std::vector<float> f32_vec(size_t max_count);
  std::vector<uint8_t> u8_vec(size_t max_count);

  size_t offset() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }
  bool at_end() const { return pos_ == size_; }
  // Throws unless every byte was consumed (trailing garbage is corruption).
  void expect_end() const;
  [[noreturn]] void fail(const std::string& what) const;

 private:
  void need(size_t n, const char* what);
  uint64_t get_le(int n);
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  std::string context_;
};

}  // namespace kvcodec

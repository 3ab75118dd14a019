#include "kvcodec/container.hpp"

#include <xxhash.h>

#include <cstring>
#include <set>

#include "core/mmap_file.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec {

namespace {

constexpr uint8_t kMagic[8] = {'K', 'V', 'C', 'O', 'D', 'E', 'C', 0};
constexpr uint8_t kTrailerMagic[4] = {'K', 'V', 'C', 'E'};
constexpr size_t kMaxMetaKey = 0xffff;

bool valid_section_name(const std::string& name) {
  if (name.empty() || name.size() > kContainerMaxSectionName) return false;
  for (const char c : name) {
    if (c < 0x21 || c > 0x7e) return false;  // printable ASCII, no spaces
  }
  return true;
}

void put_le(std::vector<uint8_t>& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(uint8_t(v >> (8 * i)));
}

uint64_t get_le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

const char* container_kind_name(ContainerKind kind) noexcept {
  switch (kind) {
    case ContainerKind::kCache: return "cache";
    case ContainerKind::kDump: return "dump";
    case ContainerKind::kCalibration: return "calibration";
    case ContainerKind::kPrefix: return "prefix";
  }
  return "unknown";
}

size_t container_overhead(const std::map<std::string, std::string>& meta,
                          const std::vector<std::string>& section_names) {
  size_t n = kContainerHeaderBytes + kContainerTrailerBytes;
  for (const auto& [k, v] : meta) n += 2 + k.size() + 4 + v.size();
  for (const std::string& s : section_names) n += container_section_overhead(s);
  return n;
}

// ---------------------------------------------------------------- writer

void ContainerWriter::set_meta(const std::string& key, const std::string& value) {
  if (key.empty() || key.size() > kMaxMetaKey) {
    throw Error(ErrorCode::kInvalidArgument, "container meta key '" + key.substr(0, 80) +
                                                 "' must be 1.." + std::to_string(kMaxMetaKey) + " bytes");
  }
  if (value.size() > 0xffffffffu) {
    throw Error(ErrorCode::kInvalidArgument, "container meta value of '" + key + "' is too long");
  }
  meta_[key] = value;
}

void ContainerWriter::add_section(const std::string& name, std::vector<uint8_t> bytes) {
  if (!valid_section_name(name)) {
    throw Error(ErrorCode::kInvalidArgument, "container section name '" + name.substr(0, 80) +
                                                 "' must be 1..64 printable ASCII characters without spaces");
  }
  if (has_section(name)) {
    throw Error(ErrorCode::kInvalidArgument, "container section '" + name + "' added twice");
  }
  sections_.emplace_back(name, std::move(bytes));
}

bool ContainerWriter::has_section(const std::string& name) const {
  for (const auto& s : sections_) {
    if (s.first == name) return true;
  }
  return false;
}

size_t ContainerWriter::payload_bytes() const {
  size_t n = 0;
  for (const auto& s : sections_) n += s.second.size();
  return n;
}

size_t ContainerWriter::overhead() const {
  std::vector<std::string> names;
  for (const auto& s : sections_) names.push_back(s.first);
  return container_overhead(meta_, names);
}

std::vector<uint8_t> ContainerWriter::finish() const {
  std::vector<uint8_t> out;
  out.reserve(overhead() + payload_bytes());
  out.insert(out.end(), kMagic, kMagic + 8);
  put_le(out, kContainerVersion, 2);
  put_le(out, 0, 2);  // flags: none defined in version 1
  put_le(out, uint32_t(kind_), 4);
  put_le(out, meta_.size(), 4);
  for (const auto& [k, v] : meta_) {
    put_le(out, k.size(), 2);
    out.insert(out.end(), k.begin(), k.end());
    put_le(out, v.size(), 4);
    out.insert(out.end(), v.begin(), v.end());
  }
  for (const auto& [name, payload] : sections_) {
    out.push_back(uint8_t(name.size()));
    out.insert(out.end(), name.begin(), name.end());
    put_le(out, payload.size(), 8);
    put_le(out, XXH3_64bits(payload.data(), payload.size()), 8);
    out.insert(out.end(), payload.begin(), payload.end());
  }
  const uint64_t body_hash = XXH3_64bits(out.data(), out.size());
  out.insert(out.end(), kTrailerMagic, kTrailerMagic + 4);
  put_le(out, sections_.size(), 4);
  put_le(out, body_hash, 8);
  return out;
}

void ContainerWriter::write_file(const std::string& path) const {
  const std::vector<uint8_t> bytes = finish();
  write_file_atomic(path, bytes.data(), bytes.size());
}

// Fuzz executables (fuzz/CMakeLists.txt compiles this file once more for
// them with FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION, as zstd and oss-fuzz
// do) verify no checksum, so the fuzzer's mutations reach the parsers behind
// the container instead of stopping at a hash. Every other build verifies.
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
constexpr bool kChecksumsVerifiable = false;
#else
constexpr bool kChecksumsVerifiable = true;
#endif

// ---------------------------------------------------------------- reader

ContainerReader ContainerReader::parse(const uint8_t* data, size_t size, ContainerLimits limits,
                                       const std::string& label) {
  auto fail = [&](ErrorCode code, const std::string& what) -> void {
    throw Error(code, "container '" + label + "': " + what);
  };
  ContainerReader r;
  r.label_ = label;
  r.data_ = data;
  r.size_ = size;
  if (size > limits.max_total_bytes) {
    fail(ErrorCode::kFormat, std::to_string(size) + " bytes exceeds the limit of " +
                                 std::to_string(limits.max_total_bytes));
  }
  if (size < kContainerHeaderBytes + kContainerTrailerBytes) {
    fail(ErrorCode::kFormat, "only " + std::to_string(size) + " bytes, shorter than an empty container (" +
                                 std::to_string(kContainerHeaderBytes + kContainerTrailerBytes) + ")");
  }
  if (std::memcmp(data, kMagic, 8) != 0) fail(ErrorCode::kFormat, "bad magic: not a kvcodec container");
  // The version is checked before any checksum, so a newer file says so plainly.
  r.version_ = uint16_t(get_le(data + 8, 2));
  if (r.version_ == 0 || r.version_ > kContainerVersion) {
    fail(ErrorCode::kUnsupported, "format version " + std::to_string(r.version_) +
                                      " is not supported by this reader (which reads version " +
                                      std::to_string(kContainerVersion) + ")");
  }
  const uint16_t flags = uint16_t(get_le(data + 10, 2));
  if (flags != 0) fail(ErrorCode::kFormat, "unknown header flags value " + std::to_string(flags) + " (version 1 defines none)");
  const uint32_t kind = uint32_t(get_le(data + 12, 4));
  if (kind < 1 || kind > 4) fail(ErrorCode::kFormat, "unknown container kind " + std::to_string(kind));
  r.kind_ = ContainerKind(kind);

  // Everything between the header and the trailer is walked with explicit
  // bounds: `end` is where the trailer starts.
  const size_t end = size - kContainerTrailerBytes;
  size_t pos = 16;
  auto need = [&](size_t n, const std::string& what) {
    if (n > end - pos) {
      fail(ErrorCode::kFormat, "truncated " + what + " at offset " + std::to_string(pos) + " (need " +
                                   std::to_string(n) + " bytes, " + std::to_string(end - pos) + " left)");
    }
  };
  need(4, "metadata count");
  const uint32_t meta_count = uint32_t(get_le(data + pos, 4));
  pos += 4;
  size_t meta_bytes = 0;
  for (uint32_t i = 0; i < meta_count; ++i) {
    need(2, "metadata key length");
    const size_t klen = size_t(get_le(data + pos, 2));
    pos += 2;
    if (klen == 0) fail(ErrorCode::kFormat, "empty metadata key at offset " + std::to_string(pos - 2));
    need(klen, "metadata key");
    std::string key(reinterpret_cast<const char*>(data + pos), klen);
    pos += klen;
    need(4, "metadata value length of '" + key + "'");
    const size_t vlen = size_t(get_le(data + pos, 4));
    pos += 4;
    need(vlen, "metadata value of '" + key + "'");
    meta_bytes += klen + vlen;
    if (meta_bytes > limits.max_meta_bytes) {
      fail(ErrorCode::kFormat, "metadata exceeds the limit of " + std::to_string(limits.max_meta_bytes) + " bytes");
    }
    std::string value(reinterpret_cast<const char*>(data + pos), vlen);
    pos += vlen;
    if (!r.meta_.emplace(key, std::move(value)).second) {
      fail(ErrorCode::kFormat, "duplicate metadata key '" + key + "'");
    }
  }

  std::set<std::string> seen;
  while (pos < end) {
    if (r.sections_.size() >= limits.max_sections) {
      fail(ErrorCode::kFormat, "more than " + std::to_string(limits.max_sections) + " sections");
    }
    const size_t nlen = data[pos];
    ++pos;
    if (nlen == 0 || nlen > kContainerMaxSectionName) {
      fail(ErrorCode::kFormat, "section name length " + std::to_string(nlen) + " at offset " +
                                   std::to_string(pos - 1) + " is outside 1..64");
    }
    need(nlen, "section name");
    std::string name(reinterpret_cast<const char*>(data + pos), nlen);
    pos += nlen;
    if (!valid_section_name(name)) fail(ErrorCode::kFormat, "section name is not printable ASCII");
    need(16, "header of section '" + name + "'");
    const uint64_t length = get_le(data + pos, 8);
    const uint64_t hash = get_le(data + pos + 8, 8);
    pos += 16;
    if (length > end - pos) {
      fail(ErrorCode::kFormat, "section '" + name + "' claims " + std::to_string(length) + " bytes but only " +
                                   std::to_string(end - pos) + " remain before the trailer");
    }
    if (!seen.insert(name).second) fail(ErrorCode::kFormat, "duplicate section '" + name + "'");
    if (kChecksumsVerifiable && limits.verify_checksums && XXH3_64bits(data + pos, size_t(length)) != hash) {
      fail(ErrorCode::kChecksum, "checksum mismatch in section '" + name + "'");
    }
    r.sections_.push_back(Section{std::move(name), pos, size_t(length)});
    pos += size_t(length);
  }

  const uint8_t* trailer = data + end;
  if (std::memcmp(trailer, kTrailerMagic, 4) != 0) {
    fail(ErrorCode::kFormat, "bad trailer magic (truncated or corrupted container)");
  }
  const uint32_t count = uint32_t(get_le(trailer + 4, 4));
  if (count != r.sections_.size()) {
    fail(ErrorCode::kFormat, "trailer says " + std::to_string(count) + " sections but " +
                                 std::to_string(r.sections_.size()) + " were found (truncated or corrupted)");
  }
  if (kChecksumsVerifiable && limits.verify_checksums && XXH3_64bits(data, end) != get_le(trailer + 8, 8)) {
    fail(ErrorCode::kChecksum, "checksum mismatch over header, metadata and section framing");
  }
  return r;
}

ContainerReader ContainerReader::read_file(const std::string& path, ContainerLimits limits) {
  auto bytes = std::make_shared<std::vector<uint8_t>>(read_file_bytes(path, limits.max_total_bytes));
  ContainerReader r = parse(bytes->data(), bytes->size(), limits, path);
  r.owned_ = std::move(bytes);
  return r;
}

void ContainerReader::expect_kind(ContainerKind expected) const {
  if (kind_ != expected) {
    throw Error(ErrorCode::kFormat, "container '" + label_ + "' is a " + container_kind_name(kind_) +
                                        " container, expected a " + container_kind_name(expected) + " container");
  }
}

const std::string& ContainerReader::meta_or_throw(const std::string& key) const {
  const auto it = meta_.find(key);
  if (it == meta_.end()) {
    throw Error(ErrorCode::kNotFound, "container '" + label_ + "' has no metadata key '" + key + "'");
  }
  return it->second;
}

bool ContainerReader::has(const std::string& name) const {
  for (const Section& s : sections_) {
    if (s.name == name) return true;
  }
  return false;
}

std::span<const uint8_t> ContainerReader::section(const std::string& name) const {
  for (const Section& s : sections_) {
    if (s.name == name) return {data_ + s.offset, s.length};
  }
  throw Error(ErrorCode::kNotFound, "container '" + label_ + "' has no section '" + name + "'");
}

std::vector<std::string> ContainerReader::section_names() const {
  std::vector<std::string> out;
  out.reserve(sections_.size());
  for (const Section& s : sections_) out.push_back(s.name);
  return out;
}

size_t ContainerReader::overhead() const {
  size_t payload = 0;
  for (const Section& s : sections_) payload += s.length;
  return size_ - payload;
}

}  // namespace kvcodec

#include "kvcodec/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <variant>

#include "core/mmap_file.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec {

using json = nlohmann::json;

size_t safetensors_dtype_size(const std::string& d) noexcept {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

namespace {

// What a validated header says.
struct ParsedHeader {
  std::string label;
  const uint8_t* data_section = nullptr;  // start of the data section
  uint64_t data_size = 0;
  std::map<std::string, SafetensorsFile::TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};

}  // namespace

struct SafetensorsFile::Impl : ParsedHeader {
  // Exactly one of these holds the bytes: a mapping (open) or a buffer (from_bytes).
  MappedFile mapping;
  std::vector<uint8_t> buffer;
};

namespace {

[[noreturn]] void format_error(const std::string& file, const std::string& what) {
  throw Error(ErrorCode::kFormat, "safetensors '" + file + "': " + what);
}

[[noreturn]] void tensor_error(const std::string& file, const std::string& tensor,
                               const std::string& what) {
  throw Error(ErrorCode::kFormat, "safetensors '" + file + "', tensor '" + tensor + "': " + what);
}

uint64_t load_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Reads a JSON integer that must be >= 0 (rejects floats, negatives, other types).
bool json_to_u64(const json& j, uint64_t* out) {
  if (j.is_number_unsigned()) {
    *out = j.get<uint64_t>();
    return true;
  }
  if (j.is_number_integer()) {
    const int64_t v = j.get<int64_t>();
    if (v < 0) return false;
    *out = uint64_t(v);
    return true;
  }
  return false;
}

// Parses and validates the header; fills impl->tensors / metadata / data_section.
void parse_header(ParsedHeader* impl, const uint8_t* bytes, uint64_t n) {
  const std::string& f = impl->label;
  if (n < 8) format_error(f, "file is " + std::to_string(n) + " bytes, too short for the 8-byte header length");
  const uint64_t header_len = load_u64_le(bytes);
  if (header_len > n - 8) {
    format_error(f, "header length " + std::to_string(header_len) + " runs past the end of the file (" +
                        std::to_string(n) + " bytes)");
  }
  if (header_len > SafetensorsFile::kMaxHeaderBytes) {
    format_error(f, "header length " + std::to_string(header_len) + " exceeds the limit of " +
                        std::to_string(SafetensorsFile::kMaxHeaderBytes) + " bytes");
  }
  const char* text = reinterpret_cast<const char*>(bytes + 8);
  // nlohmann keeps the last of duplicate keys silently; a tensor defined
  // twice is ambiguous, so the callback spots top-level duplicates.
  std::set<std::string> keys;
  std::string duplicate;
  const json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && parsed.is_string() && duplicate.empty()) {
      if (!keys.insert(parsed.get<std::string>()).second) duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json header = json::parse(text, text + header_len, on_event, /*allow_exceptions=*/false);
  if (header.is_discarded()) format_error(f, "header is not valid JSON");
  if (!duplicate.empty()) tensor_error(f, duplicate, "defined twice in the header");
  if (!header.is_object()) format_error(f, "header JSON is not an object");

  impl->data_section = bytes + 8 + header_len;
  impl->data_size = n - 8 - header_len;

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) format_error(f, "__metadata__ is not an object");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) format_error(f, "__metadata__ value of '" + m.key() + "' is not a string");
        impl->metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) tensor_error(f, name, "entry is not an object");
    const auto dt = entry.find("dtype");
    const auto sh = entry.find("shape");
    const auto off = entry.find("data_offsets");
    if (dt == entry.end() || !dt->is_string()) tensor_error(f, name, "missing or non-string 'dtype'");
    if (sh == entry.end() || !sh->is_array()) tensor_error(f, name, "missing or non-array 'shape'");
    if (off == entry.end() || !off->is_array() || off->size() != 2) {
      tensor_error(f, name, "'data_offsets' must be an array [begin, end]");
    }
    SafetensorsFile::TensorInfo info;
    info.name = name;
    info.dtype = dt->get<std::string>();
    const size_t itemsize = safetensors_dtype_size(info.dtype);
    if (itemsize == 0) tensor_error(f, name, "unknown dtype '" + info.dtype + "'");
    if (sh->size() > 64) tensor_error(f, name, "rank " + std::to_string(sh->size()) + " is absurd (limit 64)");
    uint64_t count = 1;
    for (const json& d : *sh) {
      if (d.is_number_integer() && !d.is_number_unsigned() && d.get<int64_t>() < 0) {
        tensor_error(f, name, "negative dimension " + std::to_string(d.get<int64_t>()) + " in shape");
      }
      uint64_t dim = 0;
      if (!json_to_u64(d, &dim)) tensor_error(f, name, "shape dimension is not a non-negative integer");
      if (dim > uint64_t(INT64_MAX)) tensor_error(f, name, "shape dimension " + std::to_string(dim) + " overflows int64");
      if (__builtin_mul_overflow(count, dim, &count)) tensor_error(f, name, "shape element count overflows 64 bits");
      info.shape.push_back(int64_t(dim));
    }
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(count, uint64_t(itemsize), &nbytes)) {
      tensor_error(f, name, "shape byte size overflows 64 bits");
    }
    uint64_t begin = 0, end = 0;
    if (!json_to_u64((*off)[0], &begin) || !json_to_u64((*off)[1], &end)) {
      tensor_error(f, name, "data_offsets are not non-negative integers");
    }
    if (begin > end) {
      tensor_error(f, name, "data_offsets begin " + std::to_string(begin) + " > end " + std::to_string(end));
    }
    if (end > impl->data_size) {
      tensor_error(f, name, "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                                ") out of range of the data section (" + std::to_string(impl->data_size) +
                                " bytes)");
    }
    if (end - begin != nbytes) {
      tensor_error(f, name, "shape/size mismatch: shape holds " + std::to_string(nbytes) +
                                " bytes of " + info.dtype + " but data_offsets span " +
                                std::to_string(end - begin));
    }
    info.offset = begin;
    info.size = nbytes;
    impl->tensors.emplace(name, std::move(info));
  }

  // No two tensors may share bytes (empty tensors occupy nothing).
  std::vector<const SafetensorsFile::TensorInfo*> by_offset;
  for (const auto& [name, info] : impl->tensors) {
    if (info.size > 0) by_offset.push_back(&info);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return a->offset != b->offset ? a->offset < b->offset : a->name < b->name;
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const auto* prev = by_offset[i - 1];
    const auto* cur = by_offset[i];
    if (cur->offset < prev->offset + prev->size) {
      tensor_error(f, cur->name, "overlapping tensors: bytes [" + std::to_string(cur->offset) + ", " +
                                     std::to_string(cur->offset + cur->size) + ") overlap tensor '" +
                                     prev->name + "' at [" + std::to_string(prev->offset) + ", " +
                                     std::to_string(prev->offset + prev->size) + ")");
    }
  }
}

bool kv_dtype(const std::string& d, DType* out) {
  if (d == "F32") *out = DType::kF32;
  else if (d == "F16") *out = DType::kF16;
  else if (d == "BF16") *out = DType::kBF16;
  else return false;
  return true;
}

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  auto impl = std::make_shared<Impl>();
  impl->label = path;
  impl->mapping = MappedFile(path);
  parse_header(impl.get(), impl->mapping.data(), impl->mapping.size());
  SafetensorsFile out;
  out.impl_ = std::move(impl);
  return out;
}

SafetensorsFile SafetensorsFile::from_bytes(std::vector<uint8_t> bytes, const std::string& label) {
  auto impl = std::make_shared<Impl>();
  impl->label = label;
  impl->buffer = std::move(bytes);
  parse_header(impl.get(), impl->buffer.data(), impl->buffer.size());
  SafetensorsFile out;
  out.impl_ = std::move(impl);
  return out;
}

static const std::string kEmptyLabel = "<empty>";
static const std::map<std::string, std::string> kEmptyMeta;

const std::string& SafetensorsFile::path() const { return impl_ ? impl_->label : kEmptyLabel; }

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  if (!impl_) return out;
  out.reserve(impl_->tensors.size());
  for (const auto& kv : impl_->tensors) out.push_back(kv.first);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const {
  return impl_ && impl_->tensors.count(name) != 0;
}

size_t SafetensorsFile::size() const { return impl_ ? impl_->tensors.size() : 0; }

const SafetensorsFile::TensorInfo& SafetensorsFile::info(const std::string& name) const {
  if (impl_) {
    const auto it = impl_->tensors.find(name);
    if (it != impl_->tensors.end()) return it->second;
  }
  throw Error(ErrorCode::kNotFound, "safetensors '" + path() + "': no tensor named '" + name + "'");
}

const uint8_t* SafetensorsFile::raw(const std::string& name) const {
  const TensorInfo& ti = info(name);
  if (ti.size == 0) return nullptr;
  return impl_->data_section + ti.offset;
}

TensorView SafetensorsFile::view4(const std::string& name) const {
  const TensorInfo& ti = info(name);
  DType dtype;
  if (!kv_dtype(ti.dtype, &dtype)) {
    throw Error(ErrorCode::kUnsupported, "safetensors '" + path() + "', tensor '" + name + "': dtype " +
                                             ti.dtype + " cannot be read as KV (expected F32, F16 or BF16)");
  }
  if (ti.shape.size() > 4) {
    throw Error(ErrorCode::kUnsupported, "safetensors '" + path() + "', tensor '" + name + "': rank " +
                                             std::to_string(ti.shape.size()) +
                                             " cannot be viewed as [B, H, S, D] (rank <= 4)");
  }
  Shape4 shape{1, 1, 1, 1};
  const size_t pad = 4 - ti.shape.size();
  for (size_t i = 0; i < ti.shape.size(); ++i) shape[pad + i] = ti.shape[i];
  const uint8_t* p = raw(name);
  if (p != nullptr && reinterpret_cast<uintptr_t>(p) % dtype_size(dtype) != 0) {
    throw Error(ErrorCode::kUnsupported, "safetensors '" + path() + "', tensor '" + name +
                                             "': data not aligned to its element size; use read_f32");
  }
  return TensorView::contiguous(p, dtype, shape);
}

std::vector<float> SafetensorsFile::read_f32(const std::string& name) const {
  const TensorInfo& ti = info(name);
  const uint8_t* p = raw(name);
  const size_t itemsize = safetensors_dtype_size(ti.dtype);
  const size_t n = size_t(ti.size / itemsize);
  std::vector<float> out(n);
  // memcpy per element: the data need not be aligned.
  if (ti.dtype == "F32") {
    if (n) std::memcpy(out.data(), p, n * 4);
  } else if (ti.dtype == "F64") {
    for (size_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, p + 8 * i, 8);
      out[i] = float(d);
    }
  } else if (ti.dtype == "F16" || ti.dtype == "BF16") {
    const bool half = ti.dtype == "F16";
    for (size_t i = 0; i < n; ++i) {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      out[i] = half ? f16_to_f32(b) : bf16_to_f32(b);
    }
  } else {
    throw Error(ErrorCode::kUnsupported, "safetensors '" + path() + "', tensor '" + name + "': dtype " +
                                             ti.dtype + " is not a float type (F64, F32, F16, BF16)");
  }
  return out;
}

Tensor SafetensorsFile::tensor(const std::string& name, DType dtype) const {
  return Tensor::from_view(view4(name), dtype);
}

const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  return impl_ ? impl_->metadata : kEmptyMeta;
}

// ---------------------------------------------------------------- model (shards)

namespace {

bool is_regular_file(const std::string& p) {
  try {
    file_size(p);
    return true;
  } catch (const Error&) {
    return false;
  }
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string dir_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

}  // namespace

SafetensorsModel SafetensorsModel::open(const std::string& path) {
  SafetensorsModel m;
  std::string index_path, single_path;
  if (ends_with(path, ".json") && is_regular_file(path)) {
    index_path = path;
  } else if (ends_with(path, ".safetensors") && is_regular_file(path)) {
    single_path = path;
  } else if (is_regular_file(path + "/model.safetensors.index.json")) {
    index_path = path + "/model.safetensors.index.json";
  } else if (is_regular_file(path + "/model.safetensors")) {
    single_path = path + "/model.safetensors";
  } else {
    throw Error(ErrorCode::kNotFound, "no checkpoint at '" + path +
                                          "': expected model.safetensors or model.safetensors.index.json");
  }

  if (!single_path.empty()) {
    m.label_ = single_path;
    m.shards_.push_back(SafetensorsFile::open(single_path));
    for (const std::string& n : m.shards_[0].names()) m.where_[n] = 0;
    m.metadata_ = m.shards_[0].metadata();
    return m;
  }

  m.label_ = index_path;
  const std::vector<uint8_t> text = read_file_bytes(index_path, 64ull << 20);
  json index = json::parse(text.begin(), text.end(), nullptr, false);
  if (index.is_discarded() || !index.is_object()) {
    throw Error(ErrorCode::kFormat, "index '" + index_path + "' is not a JSON object");
  }
  const auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object()) {
    throw Error(ErrorCode::kFormat, "index '" + index_path + "' has no 'weight_map' object");
  }
  const auto meta = index.find("metadata");
  if (meta != index.end() && meta->is_object()) {
    for (auto it = meta->begin(); it != meta->end(); ++it) {
      m.metadata_[it.key()] = it.value().is_string() ? it.value().get<std::string>() : it.value().dump();
    }
  }
  const std::string dir = dir_of(index_path);
  std::map<std::string, size_t> shard_index;  // shard file -> position in shards_
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string()) {
      throw Error(ErrorCode::kFormat, "index '" + index_path + "': weight_map entry '" + it.key() +
                                          "' is not a file name");
    }
    const std::string shard = it.value().get<std::string>();
    // Shards live beside the index; a path elsewhere is refused, not followed.
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
      throw Error(ErrorCode::kFormat, "index '" + index_path + "': tensor '" + it.key() +
                                          "' maps to invalid shard name '" + shard + "'");
    }
    auto found = shard_index.find(shard);
    if (found == shard_index.end()) {
      const std::string shard_path = dir + "/" + shard;
      if (!is_regular_file(shard_path)) {
        throw Error(ErrorCode::kNotFound, "index '" + index_path + "': shard '" + shard +
                                              "' (for tensor '" + it.key() + "') is missing");
      }
      m.shards_.push_back(SafetensorsFile::open(shard_path));
      found = shard_index.emplace(shard, m.shards_.size() - 1).first;
    }
    if (!m.shards_[found->second].contains(it.key())) {
      throw Error(ErrorCode::kFormat, "index '" + index_path + "': tensor '" + it.key() +
                                          "' is mapped to shard '" + shard + "' which does not hold it");
    }
    m.where_[it.key()] = found->second;
  }
  return m;
}

std::vector<std::string> SafetensorsModel::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& kv : where_) out.push_back(kv.first);
  return out;
}

bool SafetensorsModel::contains(const std::string& name) const { return where_.count(name) != 0; }

const SafetensorsFile& SafetensorsModel::file_of(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) {
    throw Error(ErrorCode::kNotFound, "checkpoint '" + (label_.empty() ? std::string("<empty>") : label_) +
                                          "': no tensor named '" + name + "'");
  }
  return shards_[it->second];
}

const SafetensorsFile::TensorInfo& SafetensorsModel::info(const std::string& name) const {
  return file_of(name).info(name);
}
const uint8_t* SafetensorsModel::raw(const std::string& name) const { return file_of(name).raw(name); }
TensorView SafetensorsModel::view4(const std::string& name) const { return file_of(name).view4(name); }
std::vector<float> SafetensorsModel::read_f32(const std::string& name) const {
  return file_of(name).read_f32(name);
}

Tensor SafetensorsModel::tensor(const std::string& name, DType dtype) const {
  return file_of(name).tensor(name, dtype);
}

// ---------------------------------------------------------------- writer

void SafetensorsWriter::add(const std::string& name, const TensorView& view) {
  for (int i = 0; i < 4; ++i) {
    if (view.shape[i] < 0) {
      throw Error(ErrorCode::kInvalidArgument, "safetensors writer: tensor '" + name + "' has negative shape " +
                                                   shape_string(view.shape));
    }
  }
  const std::string dtype = view.dtype == DType::kF32 ? "F32" : view.dtype == DType::kF16 ? "F16" : "BF16";
  std::vector<uint8_t> bytes(size_t(numel(view.shape)) * dtype_size(view.dtype));
  if (!bytes.empty()) copy_to_contiguous(view, bytes.data(), view.dtype);
  add(name, dtype, {view.shape[0], view.shape[1], view.shape[2], view.shape[3]}, std::move(bytes));
}

void SafetensorsWriter::add(const std::string& name, const std::string& dtype,
                            const std::vector<int64_t>& shape, std::vector<uint8_t> bytes) {
  const std::string where = "safetensors writer: tensor '" + name + "'";
  if (name.empty() || name == "__metadata__") {
    throw Error(ErrorCode::kInvalidArgument, "safetensors writer: invalid tensor name '" + name + "'");
  }
  for (const Entry& e : tensors_) {
    if (e.name == name) throw Error(ErrorCode::kInvalidArgument, where + " added twice");
  }
  const size_t itemsize = safetensors_dtype_size(dtype);
  if (itemsize == 0) throw Error(ErrorCode::kInvalidArgument, where + ": unknown dtype '" + dtype + "'");
  uint64_t count = 1;
  for (int64_t d : shape) {
    if (d < 0) throw Error(ErrorCode::kInvalidArgument, where + ": negative dimension " + std::to_string(d));
    if (__builtin_mul_overflow(count, uint64_t(d), &count)) {
      throw Error(ErrorCode::kInvalidArgument, where + ": element count overflows");
    }
  }
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(count, uint64_t(itemsize), &nbytes) || nbytes != bytes.size()) {
    throw Error(ErrorCode::kInvalidArgument, where + ": " + std::to_string(bytes.size()) +
                                                 " bytes given but the shape needs " +
                                                 std::to_string(count) + " x " + std::to_string(itemsize));
  }
  tensors_.push_back(Entry{name, dtype, shape, std::move(bytes)});
}

void SafetensorsWriter::add_metadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

std::vector<uint8_t> SafetensorsWriter::to_bytes() const {
  json header = json::object();
  if (!metadata_.empty()) {
    json meta = json::object();
    for (const auto& [k, v] : metadata_) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  uint64_t offset = 0;
  std::vector<uint64_t> offsets;
  for (const Entry& e : tensors_) {
    offset = (offset + 7) & ~uint64_t(7);  // 8-byte alignment for every dtype
    offsets.push_back(offset);
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.bytes.size()}}};
    offset += e.bytes.size();
  }
  std::string text = header.dump();
  // Padding the header keeps the data section (and so every tensor) 8-byte aligned.
  while (text.size() % 8 != 0) text.push_back(' ');
  std::vector<uint8_t> out(8 + text.size() + offset, 0);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = uint8_t(n >> (8 * i));
  std::memcpy(out.data() + 8, text.data(), text.size());
  uint8_t* data = out.data() + 8 + text.size();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (!tensors_[i].bytes.empty()) std::memcpy(data + offsets[i], tensors_[i].bytes.data(), tensors_[i].bytes.size());
  }
  return out;
}

void SafetensorsWriter::write(const std::string& path) const {
  const std::vector<uint8_t> bytes = to_bytes();
  write_file_atomic(path, bytes.data(), bytes.size());
}

}  // namespace kvcodec

// The parts of the cache contract shared by every method.
#include <algorithm>
#include <cstring>

#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec {

double CacheStats::compression_ratio() const {
  const uint64_t compressed = compressed_bytes();
  return compressed == 0 ? 0.0 : double(fp16_bytes()) / double(compressed);
}

double CacheStats::resident_ratio() const {
  return resident_bytes == 0 ? 0.0 : double(fp16_bytes()) / double(resident_bytes);
}

uint64_t CacheStats::shared_bytes() const {
  uint64_t n = 0;
  for (const auto& [id, bytes] : shared) n += bytes;
  return n;
}

CacheStats& CacheStats::operator+=(const CacheStats& other) {
  if (method.empty()) method = other.method;
  tokens += other.tokens;
  compressed_key_bytes += other.compressed_key_bytes;
  compressed_value_bytes += other.compressed_value_bytes;
  fp16_key_bytes += other.fp16_key_bytes;
  fp16_value_bytes += other.fp16_value_bytes;
  resident_bytes += other.resident_bytes;
  coded_symbols += other.coded_symbols;
  // One object seen through several caches: once, at its largest report
  // (a table that grew between the two stats() calls).
  for (const auto& [id, bytes] : other.shared) shared[id] = std::max(shared[id], bytes);
  for (const auto& [name, value] : other.extras) extras[name] += value;
  return *this;
}

KVPair KVCache::fetch(DType dtype) const {
  const CacheConfig& cfg = config();
  int64_t batch = 0;
  // The batch size is only known from the blocks; collect them first.
  std::vector<std::pair<Tensor, Tensor>> blocks;
  for_each_block([&](int64_t, const TensorView& k, const TensorView& v) {
    batch = k.shape[0];
    blocks.emplace_back(Tensor::from_view(k, dtype), Tensor::from_view(v, dtype));
  });
  const int64_t total = offset();
  KVPair out{Tensor(dtype, {batch, cfg.n_kv_heads, total, cfg.head_dim}),
             Tensor(dtype, {batch, cfg.n_kv_heads, total, cfg.head_dim})};
  const size_t elem = dtype_size(dtype);
  int64_t token = 0;
  for (const auto& [k, v] : blocks) {
    const int64_t n = k.shape()[2];
    const size_t row = size_t(cfg.head_dim) * elem;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < cfg.n_kv_heads; ++h) {
        const size_t dst = size_t(((b * cfg.n_kv_heads + h) * total + token)) * row;
        const size_t src = size_t((b * cfg.n_kv_heads + h) * n) * row;
        std::memcpy(static_cast<uint8_t*>(out.keys.data()) + dst,
                    static_cast<const uint8_t*>(k.data()) + src, size_t(n) * row);
        std::memcpy(static_cast<uint8_t*>(out.values.data()) + dst,
                    static_cast<const uint8_t*>(v.data()) + src, size_t(n) * row);
      }
    token += n;
  }
  if (token != total)
    throw Error(ErrorCode::kInternal, "cache visited " + std::to_string(token) + " tokens but holds " +
                                          std::to_string(total));
  return out;
}

KVPair KVCache::update_and_fetch(const TensorView& keys, const TensorView& values) {
  append(keys, values);
  return fetch(keys.dtype);
}

namespace {

// One "--set" assignment <method>.<field>=<value>, split; a config error
// naming it otherwise. The method ends at the first '.'.
struct SetAssignment {
  std::string method, field, value;
};
SetAssignment parse_set(const std::string& a) {
  const size_t eq = a.find('=');
  const size_t dot = a.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq || dot == 0 || dot + 1 == eq)
    throw_config_error("--set", a, "expected <method>.<field>=<value>, e.g. kvtc.bit_budget=256");
  return {a.substr(0, dot), a.substr(dot + 1, eq - dot - 1), a.substr(eq + 1)};
}

}  // namespace

Settings settings_for_method(const std::vector<std::string>& assignments, const std::string& method) {
  Settings out;
  for (const std::string& a : assignments) {
    SetAssignment s = parse_set(a);
    if (s.method == method) out[s.field] = std::move(s.value);
  }
  return out;
}

void check_set_methods(const std::vector<std::string>& assignments, const std::vector<std::string>& methods) {
  for (const std::string& a : assignments) parse_set(a);  // the form of every assignment first
  for (const std::string& a : assignments) {
    const std::string method = parse_set(a).method;
    if (std::find(methods.begin(), methods.end(), method) != methods.end()) continue;
    std::string listed;
    for (const std::string& m : methods) listed += (listed.empty() ? "" : ", ") + m;
    throw_config_error("--set", a,
                       "a setting of a method being run (" + listed + "); '" + method +
                           "' is not one (labels of <method>:<label> cannot contain '.')");
  }
}

}  // namespace kvcodec

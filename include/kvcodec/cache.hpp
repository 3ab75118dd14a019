// kvcodec: the streaming per-layer KV cache contract (DESIGN 3).
//
// One cache object per transformer layer. Keys and values arrive as
// [B, H_kv, S, D] (keys post-RoPE, as engines hold them); the cache stores
// them compressed and gives the history back, whole or block by block.
//
// Every method (kvtc, palu, fp16, int8, int4, kivi2) implements KVCache and is
// made by make_cache() from a method name and key=value settings, the same
// strings the CLI's --set takes (without the "<method>." prefix).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvcodec/tensor.hpp"

namespace kvcodec {

// What the model tells a cache about the layer it serves.
struct CacheConfig {
  int layer = 0;             // index of the transformer layer
  int n_layers = 1;          // layers in the model (for calibrated parameters)
  int n_kv_heads = 0;        // H_kv
  int head_dim = 0;          // D
  double rope_theta = 10000.0;
};

// Method settings: field -> value text, e.g. {"bit_budget", "256"}.
using Settings = std::map<std::string, std::string>;

// Byte telemetry, K and V separately. Everything stored is counted, as it is
// serialised: payload, tables, basis, scales, raw tail.
//
// Beside it, memory as held: resident_bytes is what the process holds for
// this cache alone (payloads, raw tail, parameters, decoder and encoder
// tables, scratch kept between calls; vectors by capacity, not size), and
// `shared` what it uses but shares with other caches (a calibration's
// parameters and tables, the RoPE table), keyed by the shared object's
// identity so that summing caches counts each object once.
struct CacheStats {
  std::string method;
  int64_t tokens = 0;                  // tokens held
  uint64_t compressed_key_bytes = 0;
  uint64_t compressed_value_bytes = 0;
  uint64_t fp16_key_bytes = 0;         // what f16 would cost for the tokens held
  uint64_t fp16_value_bytes = 0;
  uint64_t resident_bytes = 0;         // held for this cache alone
  std::map<std::string, uint64_t> shared;  // identity -> bytes held once for all its users
  // Symbols entropy-coded since the cache was made or loaded (work done, not
  // state: trim does not roll it back, load starts it at 0).
  uint64_t coded_symbols = 0;
  // Method extras, named "key.<name>" / "value.<name>" (per-head values as
  // "key.n_survived.<h>"), or plain "<name>" when they belong to neither.
  std::map<std::string, double> extras;

  uint64_t compressed_bytes() const { return compressed_key_bytes + compressed_value_bytes; }
  uint64_t fp16_bytes() const { return fp16_key_bytes + fp16_value_bytes; }
  uint64_t shared_bytes() const;       // sum of `shared`
  // (fp16 K+V) / (compressed K+V); 0 when nothing is stored.
  double compression_ratio() const;
  // (fp16 K+V) / resident_bytes (shared bytes apart); 0 when nothing is held.
  double resident_ratio() const;
  // Sums counters and extras of several caches (one per layer); a shared
  // object (same identity) counts once.
  CacheStats& operator+=(const CacheStats& other);
};

struct KVPair {
  Tensor keys;    // [B, H_kv, S_total, D]
  Tensor values;  // [B, H_kv, S_total, D]
};

class KVCache {
 public:
  virtual ~KVCache() = default;

  virtual std::string method() const = 0;
  virtual const CacheConfig& config() const = 0;

  // Appends S tokens. keys and values: [B, H_kv, S, D], same shape and dtype,
  // any strides. B, H_kv and D must match what the cache holds.
  virtual void append(const TensorView& keys, const TensorView& values) = 0;

  // Visits the reconstructed history in order, as f32 blocks [B, H_kv, n, D]
  // starting at token first_token. Views are valid during the call only.
  using BlockVisitor =
      std::function<void(int64_t first_token, const TensorView& keys, const TensorView& values)>;
  virtual void for_each_block(const BlockVisitor& visit) const = 0;

  // The whole reconstructed history [B, H_kv, S_total, D] in dtype.
  virtual KVPair fetch(DType dtype) const;

  // append() then fetch() in the input's dtype (bf16 in gives bf16 out).
  KVPair update_and_fetch(const TensorView& keys, const TensorView& values);

  virtual int64_t offset() const = 0;  // tokens stored
  int64_t size() const { return offset(); }

  // Drops the n newest tokens, rolls every byte counter back, returns how
  // many were dropped (at most offset()).
  virtual bool is_trimmable() const = 0;
  virtual int64_t trim(int64_t n) = 0;

  // The full compressed state through the container format; load() restores
  // it exactly (bit-identical reconstructions and counters).
  virtual std::vector<uint8_t> save() const = 0;
  virtual void load(const uint8_t* data, size_t size) = 0;

  virtual CacheStats stats() const = 0;
};

// --- factory ---------------------------------------------------------------

struct FieldInfo {
  std::string name;
  std::string default_value;  // as text; "" when derived (e.g. from head_dim)
  std::string description;
};

struct MethodInfo {
  std::string name;
  std::string description;
  std::vector<FieldInfo> fields;
};

// Every method the factory knows, with its fields and defaults.
std::vector<MethodInfo> list_methods();

// Makes a cache; throws Error(kConfig) naming field, value and allowed range
// for a bad or unknown setting, Error(kInvalidArgument) for an unknown method.
std::unique_ptr<KVCache> make_cache(const std::string& method, const CacheConfig& config,
                                    const Settings& settings = {});

// Makes the right cache for bytes written by KVCache::save() and loads them.
std::unique_ptr<KVCache> load_cache(const uint8_t* data, size_t size);

// Splits "--set" strings of the form "<method>.<field>=<value>" and returns
// the fields for method (others are ignored). Throws Error(kConfig) for text
// that is not of that form.
Settings settings_for_method(const std::vector<std::string>& assignments, const std::string& method);

// Throws Error(kConfig) naming the first "--set" whose method is not one of
// `methods` (as given, "<method>:<label>" included), so a typo in a method
// or label is an error, not a setting silently ignored.
void check_set_methods(const std::vector<std::string>& assignments, const std::vector<std::string>& methods);

}  // namespace kvcodec

// Concurrency of KVCache methods (placed after the code, so editing it
// moves no line of the declarations): the const methods (method, config,
// for_each_block, fetch, offset, is_trimmable, save, stats) may run on
// several threads at once on one cache; they write no shared state (read-path scratch is per call).
// append, update_and_fetch, trim and load modify the cache: while one runs,
// no other call on the same cache may run. Distinct caches are independent
// (calibrations shared between them are immutable). The server keeps each
// request's caches on its model thread; ThreadSanitizer runs the server and
// cache tests (scripts/test.sh).

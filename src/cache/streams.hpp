// Internal building blocks of the streaming caches (DESIGN 3, 5, 6).
//
// A cache holds two TokenStreams, one for keys and one for values. A stream
// sees tokens in token-major order: x [n, R, D] with R = B * H_kv rows (row =
// b * H_kv + h), already rounded to the cache's storage dtype and widened to
// f32, so every method works from exactly the values a raw tail would hold.
// It decodes ranges of tokens into [R, n, D] = [B, H_kv, n, D] f32.
//
// The byte counters are the stream's serialised size: stored_bytes() ==
// the number of bytes save() appends, always (tested).
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cache/saved_meta.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"
#include "cache/palu_calibration.hpp"
#include "palu/projection.hpp"

namespace kvcodec::cache_impl {

// Streams save through kvcodec::ByteWriter and load through kvcodec::ByteReader
// (kvcodec/container.hpp), the one serializer: integers little-endian, the
// 16-bit token arrays as their host-order bytes (docs/format.md).

// Token-major raw storage [t, R, D] in a 16-bit or f32 dtype: pre-fit tokens,
// raw windows and partial groups. Counted at its exact size.
class RawTokenStore {
 public:
  void reset(int64_t rows, int64_t dim, DType dtype);
  int64_t tokens() const { return tokens_; }
  size_t token_bytes() const { return size_t(rows_ * dim_) * dtype_size(dtype_); }
  size_t bytes() const { return data_.size(); }
  size_t held() const { return data_.capacity(); }  // bytes allocated
  void push_back(const float* x, int64_t n);  // x [n, R, D]
  void push_front(const float* x, int64_t n);
  void pop_front(int64_t n);
  void truncate(int64_t n_tokens);            // keep the first n_tokens
  void read(int64_t first, int64_t n, float* out) const;  // out [n, R, D]
  void serialize(ByteWriter& w) const { w.bytes(data_.data(), data_.size()); }
  void deserialize(ByteReader& r, int64_t tokens);

 private:
  int64_t rows_ = 0, dim_ = 0, tokens_ = 0;
  DType dtype_ = DType::kF16;
  std::vector<uint8_t> data_;
};

struct StreamShape {
  int64_t batch = 0, heads = 0, dim = 0;
  DType storage = DType::kF16;
  int64_t rows() const { return batch * heads; }
};

class TokenStream {
 public:
  virtual ~TokenStream() = default;
  // A new stream of the same method and options, holding nothing: load()
  // fills one and swaps it in only once everything read is valid.
  virtual std::unique_ptr<TokenStream> empty_twin() const = 0;
  // Sets the shape and clears all state.
  virtual void start(const StreamShape& shape) = 0;
  virtual void append(const float* x, int64_t n) = 0;                    // x [n, R, D]
  virtual void decode(int64_t first, int64_t n, float* out) const = 0;   // out [R, n, D]
  virtual void trim_to(int64_t total) = 0;                                // keep the first total tokens
  virtual int64_t tokens() const = 0;
  virtual uint64_t stored_bytes() const = 0;
  // What the stream holds in memory (capacities, parameters, tables kept
  // between calls), for CacheStats::resident_bytes.
  virtual uint64_t held_bytes() const = 0;
  virtual void save(ByteWriter& w) const = 0;
  virtual void load(ByteReader& r, int64_t tokens) = 0;  // after start(); reads everything
  virtual void add_extras(const std::string& /*prefix*/, std::map<std::string, double>& /*extras*/) const {}
  // What it uses but shares with other caches (CacheStats::shared).
  virtual void add_shared(std::map<std::string, uint64_t>& /*shared*/) const {}
};

// Copies token-major rows x [n, R, D] for tokens [0, n) into out [R, total_n, D]
// at token position at.
void scatter_tokens(const float* x, int64_t n, int64_t rows, int64_t dim, float* out, int64_t total_n, int64_t at);

std::unique_ptr<TokenStream> make_raw_stream();
std::unique_ptr<TokenStream> make_symmetric_stream(int bits, int64_t group_size);
std::unique_ptr<TokenStream> make_kivi_key_stream(int64_t group_size, int64_t residual, int bits);
std::unique_ptr<TokenStream> make_kivi_value_stream(int64_t group_size, int64_t residual, int bits);

struct PaluOptions {
  bool joint = false;
  int n_head_groups = 4;
  palu::FitOptions fit;
  int64_t group_size = 32;
  bool quantize = true;
  int64_t min_fit_tokens = 128;
  // Calibrated mode (palu.calibration=FILE): the projections come from this
  // shared calibration (layer `layer`, keys or values), chosen by `fit`, the
  // first `sinks` tokens stay raw, and keys are projected with RoPE removed
  // (rope_theta) and get it back when decoded. joint / n_head_groups are the
  // calibration's.
  std::shared_ptr<const PaluCalibration> calibration;
  std::string calibration_path;
  int layer = 0;
  bool is_key = false;
  int64_t sinks = 0;
  double rope_theta = 10000.0;
};
std::unique_ptr<TokenStream> make_palu_stream(const PaluOptions& opt);

// A fitted PALU head group as its stream codes it, so that code outside the
// cache (the C API's palu codec, gpu::PaluGpuCodec) writes the very token
// groups the stream stores: latents of x [rows, tokens, dim] (shared: row b *
// n_heads + h is head first_head + h of batch row b, dim = D; joint: row b,
// the group's heads concatenated, dim = n_heads * D).
struct PaluGroupLayout {
  int first_head = 0, n_heads = 0;
  bool joint = false;
  int64_t rows = 0;
  int64_t group_size = 0;
  bool quantize = true;         // false: the latents stay f16, no token groups
  int64_t first_token = 0;      // the cache token of latent 0 (calibrated: after the raw sinks)
  bool rope_removed = false;    // calibrated keys: projected with RoPE removed
  palu::Projection projection;  // a copy: the stream's is replaced at load
};
// The head groups of a "palu" cache's keys (keys = true) or values, in head
// order; empty for another method, or before the projections are fitted.
std::vector<PaluGroupLayout> palu_groups(const KVCache& cache, bool keys);
// The key or value stream of a cache made by make_stream_cache; nullptr for
// any other cache.
const TokenStream* stream_of(const KVCache& cache, bool keys);

// The cache every method in this folder is: two streams behind KVCache.
std::unique_ptr<KVCache> make_stream_cache(const std::string& method, const CacheConfig& config,
                                           const Settings& settings, std::unique_ptr<TokenStream> keys,
                                           std::unique_ptr<TokenStream> values);

}  // namespace kvcodec::cache_impl

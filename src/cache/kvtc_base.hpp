// What both kvtc modes share (local: kvtc_cache.cpp, calibrated:
// kvtc_calibrated.cpp): the KVCache identity and settings, the token layout
// [sinks raw][coded blocks][raw tail] (DESIGN 3) and trim() over it, the
// saved framing (save()) and the stats every mode reports (stats()). A mode
// supplies how its blocks are coded and where its tokens are kept.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cache/kvtc_cache.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/tensor.hpp"

namespace kvcodec::cache_impl {

class KvtcCacheBase : public KVCache {
 public:
  std::string method() const override { return "kvtc"; }
  const CacheConfig& config() const override { return config_; }
  int64_t offset() const override { return offset_; }
  bool is_trimmable() const override { return true; }
  // Drops the newest min(n, offset) tokens, newest first: from the raw tail
  // while it holds tokens past the sinks; when it holds none and a block is
  // left, the newest block is first decoded back into the tail (its
  // reconstruction, then stored raw and counted as such); the sinks go only
  // once no block is left (they sit before the blocks).
  int64_t trim(int64_t n) final;
  // The saved meta (method, settings, config.*, the mode's layout version),
  // then the mode's sections (write_sections).
  std::vector<uint8_t> save() const final;
  // Method, tokens, f16 sizes, coded symbols and per tensor the byte split of
  // tensor_bytes(); then the mode's extras and held bytes (add_mode_stats).
  CacheStats stats() const final;

 protected:
  KvtcCacheBase(const CacheConfig& config, const Settings& settings, const KvtcSettings& options, std::string who,
                int layout_version)
      : config_(config), settings_(settings), options_(options), who_(std::move(who)),
        layout_version_(layout_version) {}

  // One tensor's (K or V) stored bytes: compressed = all five; the codec's
  // own ("kvtc_bytes") = side + payload.
  struct TensorBytes {
    uint64_t side = 0;         // per-sequence parameters
    uint64_t payload = 0;      // coded blocks
    uint64_t pre_entropy = 0;  // the blocks' codes at their fixed widths
    uint64_t refine = 0;       // refinement codes
    uint64_t raw = 0;          // sinks and raw tail
  };
  virtual TensorBytes tensor_bytes(bool is_key) const = 0;
  virtual void add_mode_stats(CacheStats& st) const = 0;
  virtual void write_sections(ContainerWriter& w) const = 0;

  virtual int64_t encoded_tokens() const = 0;
  int64_t raw_tokens() const { return offset_ - encoded_tokens(); }
  int64_t sink_tokens() const { return std::min<int64_t>(options_.sinks, offset_); }
  // trim()'s two steps: drop `count` raw tokens from the end of the tail
  // (and the offset); move the newest block's reconstruction to the tail.
  virtual void cut_raw(int64_t count) = 0;
  virtual void uncode_newest_block() = 0;
  // Back to empty (trim() to 0 tokens).
  virtual void reset() = 0;
  // Batch row b, head h of src [B, H, S, D] (tokens [first, first + n)) into
  // raw_dtype_ rows at dst, dst_stride elements apart: f32 rows through the
  // SIMD conversion, rows already in raw_dtype_ copied, anything else (a
  // strided last dimension) through copy_to_contiguous. Bits as convert().
  void head_rows_to_raw(const TensorView& src, int64_t b, int64_t h, int64_t first, int64_t n, uint16_t* dst,
                        size_t dst_stride) const;
  CacheConfig config_;
  Settings settings_;
  KvtcSettings options_;
  std::string who_;  // names this mode in errors
  int layout_version_;  // of the mode's sections (docs/format.md)
  int64_t batch_ = 0;
  DType raw_dtype_ = DType::kF16;
  int64_t offset_ = 0;
  uint64_t coded_symbols_ = 0;  // CacheStats::coded_symbols (work, not state: not saved)
};

}  // namespace kvcodec::cache_impl

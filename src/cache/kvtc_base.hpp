// What both kvtc modes share (local: kvtc_cache.cpp, calibrated:
// kvtc_calibrated.cpp): the KVCache identity and settings, the token layout
// [sinks raw][coded blocks][raw tail] (DESIGN 3) and trim() over it. A mode
// supplies how its blocks are coded and where its tokens are kept.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

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

 protected:
  KvtcCacheBase(const CacheConfig& config, const Settings& settings, const KvtcSettings& options, std::string who)
      : config_(config), settings_(settings), options_(options), who_(std::move(who)) {}

  virtual int64_t encoded_tokens() const = 0;
  int64_t raw_tokens() const { return offset_ - encoded_tokens(); }
  int64_t sink_tokens() const { return std::min<int64_t>(options_.sinks, offset_); }
  // trim()'s two steps: drop `count` raw tokens from the end of the tail
  // (and the offset); move the newest block's reconstruction to the tail.
  virtual void cut_raw(int64_t count) = 0;
  virtual void uncode_newest_block() = 0;
  // Back to empty (trim() to 0 tokens).
  virtual void reset() = 0;
  // The saved meta both modes write first: method, settings, config.*.
  void write_saved_meta(ContainerWriter& w) const;

  CacheConfig config_;
  Settings settings_;
  KvtcSettings options_;
  std::string who_;  // names this mode in errors
  int64_t batch_ = 0;
  DType raw_dtype_ = DType::kF16;
  int64_t offset_ = 0;
};

}  // namespace kvcodec::cache_impl

// A plain f32 KVCache for the model tests, so they depend on no codec. It
// stores [B=1, H_kv, S, D] per head as appended and hands the history back in
// blocks of `block` tokens (to exercise the block-wise attention path).
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec::model::testing {

class RawF32Cache : public KVCache {
 public:
  RawF32Cache(const CacheConfig& config, int64_t block) : config_(config), block_(block) {
    k_.resize(size_t(config.n_kv_heads));
    v_.resize(size_t(config.n_kv_heads));
  }
  std::string method() const override { return "raw_f32"; }
  const CacheConfig& config() const override { return config_; }
  void append(const TensorView& keys, const TensorView& values) override {
    if (keys.shape[0] != 1 || keys.heads() != config_.n_kv_heads || keys.head_dim() != config_.head_dim ||
        values.shape != keys.shape)
      throw Error(ErrorCode::kShapeMismatch, "raw cache: bad shape " + shape_string(keys.shape));
    for (int64_t h = 0; h < keys.heads(); ++h)
      for (int64_t s = 0; s < keys.tokens(); ++s)
        for (int64_t d = 0; d < keys.head_dim(); ++d) {
          k_[size_t(h)].push_back(keys.at(0, h, s, d));
          v_[size_t(h)].push_back(values.at(0, h, s, d));
        }
    tokens_ += keys.tokens();
  }
  void for_each_block(const BlockVisitor& visit) const override {
    const int64_t D = config_.head_dim, H = config_.n_kv_heads;
    std::vector<float> kb, vb;
    for (int64_t first = 0; first < tokens_; first += block_) {
      const int64_t n = std::min(block_, tokens_ - first);
      kb.assign(size_t(H * n * D), 0.0f);
      vb.assign(size_t(H * n * D), 0.0f);
      for (int64_t h = 0; h < H; ++h) {
        std::copy_n(k_[size_t(h)].data() + first * D, n * D, kb.data() + h * n * D);
        std::copy_n(v_[size_t(h)].data() + first * D, n * D, vb.data() + h * n * D);
      }
      visit(first, TensorView::contiguous(kb.data(), DType::kF32, {1, H, n, D}),
            TensorView::contiguous(vb.data(), DType::kF32, {1, H, n, D}));
    }
  }
  int64_t offset() const override { return tokens_; }
  bool is_trimmable() const override { return false; }
  int64_t trim(int64_t) override { throw Error(ErrorCode::kUnsupported, "raw cache: no trim"); }
  std::vector<uint8_t> save() const override { throw Error(ErrorCode::kUnsupported, "raw cache: no save"); }
  void load(const uint8_t*, size_t) override { throw Error(ErrorCode::kUnsupported, "raw cache: no load"); }
  CacheStats stats() const override {
    CacheStats s;
    s.method = method();
    s.tokens = tokens_;
    const uint64_t elems = uint64_t(tokens_) * uint64_t(config_.n_kv_heads * config_.head_dim);
    s.compressed_key_bytes = s.compressed_value_bytes = elems * 4;
    s.fp16_key_bytes = s.fp16_value_bytes = elems * 2;
    return s;
  }

 private:
  CacheConfig config_;
  int64_t block_;
  int64_t tokens_ = 0;
  std::vector<std::vector<float>> k_, v_;  // per head, [S, D]
};

inline auto raw_factory(int64_t block) {
  return [block](const CacheConfig& c) -> std::unique_ptr<KVCache> { return std::make_unique<RawF32Cache>(c, block); };
}

}  // namespace kvcodec::model::testing

// The KVCache every method of src/cache is: shape checks, the input gather,
// block reads, trim, telemetry and save/load through the container.
//
// Saved layout (container kind "cache"):
//   meta: method, layout (version of the key/value sections, 1; absent in
//         older files, which read as 1), settings ("k=v;..." sorted), config.layer, config.n_layers,
//         config.n_kv_heads, config.head_dim, config.rope_theta, shape.batch,
//         tokens, dtype (storage dtype of raw tokens)
//   sections: "key" and "value", each exactly the stream's stored bytes.
// So stats().compressed_bytes() == save().size() - container_overhead(meta,
// {"key", "value"}): the meta (the cache's configuration) is the only thing
// not counted as compressed data.
//
// Storage dtype: a 16-bit input keeps its dtype (bf16 stays bf16: storing it
// as f16 would overflow above 65504), f32 input is stored as f16. It is fixed
// by the first append; every append is rounded to it before any method sees
// it, so all methods and all chunkings work from the same values.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <tuple>

#include "cache/append_checks.hpp"
#include "cache/saved_meta.hpp"
#include "cache/settings.hpp"
#include "cache/streams.hpp"
#include "kvcodec/container.hpp"

namespace kvcodec::cache_impl {
namespace {

constexpr int64_t kBlockTokens = 256;
constexpr int64_t kMaxTokens = int64_t(1) << 40;


class StreamCache final : public KVCache {
 public:
  StreamCache(std::string method, const CacheConfig& cfg, const Settings& settings, std::unique_ptr<TokenStream> k,
              std::unique_ptr<TokenStream> v)
      : method_(std::move(method)), cfg_(cfg), settings_(settings), keys_(std::move(k)), values_(std::move(v)) {}

  std::string method() const override { return method_; }
  const CacheConfig& config() const override { return cfg_; }
  const TokenStream& stream(bool keys) const { return keys ? *keys_ : *values_; }

  void append(const TensorView& keys, const TensorView& values) override {
    cache_impl::check_append(keys, values, cfg_, shaped_ ? batch_ : 0, method_ + " cache");
    const Shape4& s = keys.shape;
    if (!shaped_) {
      batch_ = s[0];
      storage_ = cache_impl::raw_dtype_for(keys.dtype);
      start_streams();
    }
    if (s[2] == 0) return;
    std::vector<float> buf;
    gather(keys, buf);
    keys_->append(buf.data(), s[2]);
    gather(values, buf);
    values_->append(buf.data(), s[2]);
    tokens_ += s[2];
  }

  void for_each_block(const BlockVisitor& visit) const override {
    if (!shaped_) return;
    const int64_t R = batch_ * cfg_.n_kv_heads, D = cfg_.head_dim;
    std::vector<float> k, v;
    for (int64_t first = 0; first < tokens_; first += kBlockTokens) {
      const int64_t n = std::min(kBlockTokens, tokens_ - first);
      k.resize(size_t(R * n * D));
      v.resize(size_t(R * n * D));
      keys_->decode(first, n, k.data());
      values_->decode(first, n, v.data());
      const Shape4 shape{batch_, cfg_.n_kv_heads, n, D};
      visit(first, TensorView::contiguous(k.data(), DType::kF32, shape),
            TensorView::contiguous(v.data(), DType::kF32, shape));
    }
  }

  int64_t offset() const override { return tokens_; }
  bool is_trimmable() const override { return true; }

  int64_t trim(int64_t n) override {
    if (n < 0) throw Error(ErrorCode::kInvalidArgument, method_ + " cache: trim(" + std::to_string(n) + ") is negative");
    const int64_t m = std::min(n, tokens_);
    if (m == 0) return 0;
    tokens_ -= m;
    keys_->trim_to(tokens_);
    values_->trim_to(tokens_);
    return m;
  }

  std::vector<uint8_t> save() const override {
    ContainerWriter w(ContainerKind::kCache);
    for (const auto& [k, v] : meta()) w.set_meta(k, v);
    w.add_section("key", stream_bytes(*keys_));
    w.add_section("value", stream_bytes(*values_));
    return w.finish();
  }

  // Strong guarantee: everything is read into new streams and checked; the
  // cache changes only when all of it is valid.
  void load(const uint8_t* data, size_t size) override;

  CacheStats stats() const override {
    CacheStats st;
    st.method = method_;
    st.tokens = tokens_;
    const uint64_t f16 = uint64_t(tokens_) * uint64_t(batch_ * cfg_.n_kv_heads * cfg_.head_dim) * 2;
    st.fp16_key_bytes = st.fp16_value_bytes = f16;
    if (shaped_) {
      st.compressed_key_bytes = keys_->stored_bytes();
      st.compressed_value_bytes = values_->stored_bytes();
      st.resident_bytes = keys_->held_bytes() + values_->held_bytes();
      keys_->add_extras("key.", st.extras);
      values_->add_extras("value.", st.extras);
      keys_->add_shared(st.shared);
      values_->add_shared(st.shared);
    }
    st.resident_bytes += sizeof(*this);
    return st;
  }

 private:
  std::map<std::string, std::string> meta() const {
    return {{"method", method_},
            {cache_impl::kLayoutKey, std::to_string(kLayoutVersion)},
            {"settings", encode_settings(settings_)},
            {"config.layer", std::to_string(cfg_.layer)},
            {"config.n_layers", std::to_string(cfg_.n_layers)},
            {"config.n_kv_heads", std::to_string(cfg_.n_kv_heads)},
            {"config.head_dim", std::to_string(cfg_.head_dim)},
            {"config.rope_theta", double_text(cfg_.rope_theta)},
            {"shape.batch", std::to_string(shaped_ ? batch_ : 0)},
            {"tokens", std::to_string(tokens_)},
            {"dtype", dtype_name(storage_)}};
  }

  std::vector<uint8_t> stream_bytes(const TokenStream& s) const {
    if (!shaped_) return {};
    ByteWriter w;
    s.save(w);
    std::vector<uint8_t> out = w.take();
    if (out.size() != s.stored_bytes())
      throw Error(ErrorCode::kInternal, method_ + " cache: stream wrote " + std::to_string(out.size()) +
                                            " bytes but counts " + std::to_string(s.stored_bytes()));
    return out;
  }

  void start_streams() {
    const StreamShape shape{batch_, cfg_.n_kv_heads, cfg_.head_dim, storage_};
    keys_->start(shape);
    values_->start(shape);
    shaped_ = true;
    tokens_ = 0;
  }

  static constexpr int kLayoutVersion = 1;  // meta "layout" of the key/value sections

  // [B, H, S, D] any strides/dtype -> token-major [S, B*H, D] f32, rounded
  // through the storage dtype.
  void gather(const TensorView& x, std::vector<float>& out) const {
    const int64_t B = x.shape[0], H = x.shape[1], S = x.shape[2], D = x.shape[3];
    out.resize(size_t(S * B * H * D));
    for (int64_t s = 0; s < S; ++s)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
          float* dst = out.data() + ((s * B + b) * H + h) * D;
          if (x.strides[3] == 1 || D == 1) {
            const int64_t off = b * x.strides[0] + h * x.strides[1] + s * x.strides[2];
            convert(static_cast<const uint8_t*>(x.data) + off * int64_t(dtype_size(x.dtype)), x.dtype, dst,
                    DType::kF32, size_t(D));
          } else {
            for (int64_t d = 0; d < D; ++d) dst[d] = x.at(b, h, s, d);
          }
        }
    if (x.dtype != storage_) {
      std::vector<uint16_t> tmp(out.size());
      convert(out.data(), DType::kF32, tmp.data(), storage_, out.size());
      convert(tmp.data(), storage_, out.data(), DType::kF32, out.size());
    }
  }

  std::string method_;
  CacheConfig cfg_;
  Settings settings_;
  std::unique_ptr<TokenStream> keys_, values_;
  bool shaped_ = false;
  int64_t batch_ = 0, tokens_ = 0;
  DType storage_ = DType::kF16;
};

void StreamCache::load(const uint8_t* data, size_t size) {
  const ContainerReader c = ContainerReader::parse(data, size, {}, method_ + " cache");
  c.expect_kind(ContainerKind::kCache);
  const std::string& m = c.meta_or_throw("method");
  if (m != method_)
    throw Error(ErrorCode::kFormat, "saved cache is of method '" + m + "', this cache is '" + method_ + "'");
  read_layout_version(c, kLayoutVersion, method_ + " cache load");
  const auto mine = meta();
  for (const char* key : {"settings", "config.layer", "config.n_layers", "config.n_kv_heads", "config.head_dim",
                          "config.rope_theta"}) {
    const std::string& v = c.meta_or_throw(key);
    if (v != mine.at(key))
      throw Error(ErrorCode::kFormat, std::string("saved cache has ") + key + " = '" + v + "', this cache has '" +
                                          mine.at(key) + "' (use load_cache to make a matching cache)");
  }
  const int64_t batch = meta_int(c, "shape.batch", 0, kMaxBatch);
  const int64_t tokens = meta_int(c, "tokens", 0, kMaxTokens);
  const std::string& dt = c.meta_or_throw("dtype");
  if (dt != "f16" && dt != "bf16") throw Error(ErrorCode::kFormat, "saved cache dtype '" + dt + "' is not f16 or bf16");
  const auto ks = c.section("key");
  const auto vs = c.section("value");
  if (batch == 0) {
    if (tokens != 0 || !ks.empty() || !vs.empty())
      throw Error(ErrorCode::kFormat, "saved cache without a shape holds data");
    keys_ = keys_->empty_twin();  // as a new cache: no shape until the next append
    values_ = values_->empty_twin();
    shaped_ = false;
    batch_ = tokens_ = 0;
    return;
  }
  const DType storage = dt == "bf16" ? DType::kBF16 : DType::kF16;
  const StreamShape shape{batch, cfg_.n_kv_heads, cfg_.head_dim, storage};
  std::unique_ptr<TokenStream> keys = keys_->empty_twin(), values = values_->empty_twin();
  for (auto [stream, bytes, what] : {std::tuple{keys.get(), ks, "key"}, std::tuple{values.get(), vs, "value"}}) {
    stream->start(shape);
    ByteReader in(bytes.data(), bytes.size(), method_ + " " + what + " section");
    stream->load(in, tokens);
    in.expect_end();
    if (stream->tokens() != tokens)
      throw Error(ErrorCode::kFormat, "saved cache " + std::string(what) + " stream holds " +
                                          std::to_string(stream->tokens()) + " tokens, its meta " +
                                          std::to_string(tokens));
  }
  keys_ = std::move(keys);
  values_ = std::move(values);
  batch_ = batch;
  storage_ = storage;
  tokens_ = tokens;
  shaped_ = true;
}

}  // namespace

std::unique_ptr<KVCache> make_stream_cache(const std::string& method, const CacheConfig& config,
                                           const Settings& settings, std::unique_ptr<TokenStream> keys,
                                           std::unique_ptr<TokenStream> values) {
  return std::make_unique<StreamCache>(method, config, settings, std::move(keys), std::move(values));
}

const TokenStream* stream_of(const KVCache& cache, bool keys) {
  const auto* c = dynamic_cast<const StreamCache*>(&cache);
  return c ? &c->stream(keys) : nullptr;
}

}  // namespace kvcodec::cache_impl

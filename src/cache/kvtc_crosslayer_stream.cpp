#include "cache/kvtc_crosslayer_stream.hpp"

#include <algorithm>
#include <atomic>

#include "cache/kvtc_crosslayer.hpp"
#include "cache/saved_meta.hpp"
#include "kvcodec/error.hpp"
#include "kvtc/codec.hpp"

namespace kvcodec {
namespace {

// One tensor (K or V) of one layer: raw tokens as f16 rows [t][h][d].
struct RawRows {
  std::vector<uint16_t> sinks;    // tokens [0, min(n, sinks))
  std::vector<uint16_t> tail;     // tokens [coded_end, n)
  std::vector<float> decoded;     // decoded scratch: tokens [sinks, coded_end), f32
};

struct LayerState {
  int64_t n = 0;  // tokens appended
  RawRows k, v;
};

struct CodedBlock {
  int64_t first = 0, n = 0;
  std::vector<uint8_t> k, v;  // kvtc payloads of the block's cross-layer vectors
  bool recent = false;        // coded with the recent tier's calibration
};

void f16_rows_to_f32(const uint16_t* src, size_t count, std::vector<float>& out) {
  out.resize(count);
  for (size_t i = 0; i < count; ++i) out[i] = f16_to_f32(src[i]);
}

TensorView token_major_view(const float* data, int64_t n, int H, int D) {
  return TensorView{data, DType::kF32, {1, H, n, D}, {n * H * D, D, int64_t(H) * D, 1}};
}

// The state every layer's cache of one sequence shares.
class CrossLayerStreamGroup {
 public:
  CrossLayerStreamGroup(std::shared_ptr<const KvtcCalibration> cal, const CacheConfig& c,
                        const CrossLayerStreamOptions& o)
      : cal_(std::move(cal)), o_(o), L_(c.n_layers), H_(c.n_kv_heads), D_(c.head_dim), V_(int64_t(H_) * D_),
        inv_freq_(rope_inv_freq(D_, c.rope_theta)), layers_(size_t(L_)), coded_end_(o.sinks) {}

  int n_layers() const { return L_; }
  int64_t tokens(int l) const { return layers_[size_t(l)].n; }

  void append(int l, const TensorView& keys, const TensorView& values) {
    const int64_t S = keys.tokens();
    std::vector<float> kf(size_t(S * V_)), vf(size_t(S * V_));
    to_token_rows(keys, kf.data());
    to_token_rows(values, vf.data());
    LayerState& st = layers_[size_t(l)];
    for (int64_t t = 0; t < S; ++t) {
      const int64_t pos = st.n + t;
      push_raw(pos < o_.sinks ? st.k.sinks : st.k.tail, kf.data() + t * V_);
      push_raw(pos < o_.sinks ? st.v.sinks : st.v.tail, vf.data() + t * V_);
    }
    st.n += S;
    int64_t all = st.n;  // tokens every layer has
    for (const LayerState& s : layers_) all = std::min(all, s.n);
    while (all - o_.window - coded_end_ >= o_.block) {
      code_block();
      // Blocks with `recent` coded tokens behind them leave the recent tier.
      while (o_.recent > 0 && first_recent_ < blocks_.size() &&
             blocks_[first_recent_].first + blocks_[first_recent_].n + o_.recent <= coded_end_)
        recode_to_base(blocks_[first_recent_++]);
    }
  }

  void visit(int l, const KVCache::BlockVisitor& fn) const {
    const LayerState& st = layers_[size_t(l)];
    std::vector<float> kf, vf;
    const int64_t ns = std::min<int64_t>(st.n, o_.sinks);
    if (ns > 0) {
      f16_rows_to_f32(st.k.sinks.data(), size_t(ns * V_), kf);
      f16_rows_to_f32(st.v.sinks.data(), size_t(ns * V_), vf);
      fn(0, token_major_view(kf.data(), ns, H_, D_), token_major_view(vf.data(), ns, H_, D_));
    }
    const int64_t coded = coded_end_ - o_.sinks;
    if (coded > 0 && o_.decoded_scratch) {
      fn(o_.sinks, token_major_view(st.k.decoded.data(), coded, H_, D_),
            token_major_view(st.v.decoded.data(), coded, H_, D_));
    } else if (coded > 0) {
      std::vector<std::vector<float>> kb, vb;
      for (const CodedBlock& b : blocks_) {
        decode(b, kb, vb);
        fn(b.first, token_major_view(kb[size_t(l)].data(), b.n, H_, D_),
           token_major_view(vb[size_t(l)].data(), b.n, H_, D_));
      }
    }
    const int64_t nt = st.n - std::max<int64_t>(coded_end_, o_.sinks);
    if (nt > 0) {
      f16_rows_to_f32(st.k.tail.data(), size_t(nt * V_), kf);
      f16_rows_to_f32(st.v.tail.data(), size_t(nt * V_), vf);
      fn(st.n - nt, token_major_view(kf.data(), nt, H_, D_), token_major_view(vf.data(), nt, H_, D_));
    }
  }

  CacheStats stats(int l) const {
    const LayerState& st = layers_[size_t(l)];
    CacheStats s;
    s.method = "xkvtc";
    s.tokens = st.n;
    s.fp16_key_bytes = s.fp16_value_bytes = uint64_t(st.n * V_) * 2;
    const uint64_t raw_k = 2 * (st.k.sinks.size() + st.k.tail.size());
    const uint64_t raw_v = 2 * (st.v.sinks.size() + st.v.tail.size());
    s.compressed_key_bytes = raw_k;
    s.compressed_value_bytes = raw_v;
    s.resident_bytes = 2 * (st.k.sinks.capacity() + st.k.tail.capacity() + st.v.sinks.capacity() +
                            st.v.tail.capacity()) +
                       4 * (st.k.decoded.capacity() + st.v.decoded.capacity());
    s.extras["key.raw_bytes"] = double(raw_k);
    s.extras["value.raw_bytes"] = double(raw_v);
    s.extras["scratch_bytes"] = 4.0 * double(st.k.decoded.capacity() + st.v.decoded.capacity());
    if (l == 0) {  // the group's coded blocks, once per sequence
      uint64_t pk = 0, pv = 0, held = 0;
      for (const CodedBlock& b : blocks_) {
        pk += cache_impl::varint_size(b.k.size()) + b.k.size();
        pv += cache_impl::varint_size(b.v.size()) + b.v.size();
        held += b.k.capacity() + b.v.capacity();
      }
      s.compressed_key_bytes += pk;
      s.compressed_value_bytes += pv;
      s.resident_bytes += held + blocks_.capacity() * sizeof(CodedBlock);
      s.extras["key.payload_bytes"] = double(pk);
      s.extras["value.payload_bytes"] = double(pv);
      s.extras["coded_tokens"] = double(coded_end_ - o_.sinks);
      s.extras["decoded_token_vectors"] = double(decoded_.load());
      if (o_.recent > 0) {
        s.extras["recent_tokens"] = double(coded_end_ - o_.sinks - recoded_);
        s.extras["recoded_tokens"] = double(recoded_);
      }
    }
    s.shared["xkvtc:" + std::to_string(reinterpret_cast<uintptr_t>(cal_.get()))] = cal_->held_bytes();
    if (o_.recent_calibration)
      s.shared["xkvtc:" + std::to_string(reinterpret_cast<uintptr_t>(o_.recent_calibration.get()))] =
          o_.recent_calibration->held_bytes();
    return s;
  }

 private:
  // keys / values [1, H, S, D] (any dtype and strides) -> f32 rows [S, H * D].
  void to_token_rows(const TensorView& t, float* out) const {
    const Tensor c = Tensor::from_view(t, DType::kF32);
    const float* src = c.data_as<float>();
    const int64_t S = t.tokens();
    for (int h = 0; h < H_; ++h)
      for (int64_t s = 0; s < S; ++s) std::copy_n(src + (h * S + s) * D_, D_, out + s * V_ + int64_t(h) * D_);
  }

  void push_raw(std::vector<uint16_t>& rows, const float* x) const {
    for (int64_t d = 0; d < V_; ++d) rows.push_back(f32_to_f16(x[d]));
  }

  const KvtcCalibration& cal_of(const CodedBlock& b) const { return b.recent ? *o_.recent_calibration : *cal_; }

  // Codes tokens [coded_end_, coded_end_ + block) of every layer (with the
  // recent tier's calibration when there is one) and drops their raw rows.
  void code_block() {
    const int64_t n = o_.block, t0 = coded_end_;
    const bool recent = o_.recent > 0;
    const KvtcCalibration& cal = recent ? *o_.recent_calibration : *cal_;
    CodedBlock b{t0, n, code_tensor(cal, true, t0, n), code_tensor(cal, false, t0, n), recent};
    for (LayerState& st : layers_) {
      st.k.tail.erase(st.k.tail.begin(), st.k.tail.begin() + n * V_);
      st.v.tail.erase(st.v.tail.begin(), st.v.tail.begin() + n * V_);
    }
    if (o_.decoded_scratch) {
      std::vector<std::vector<float>> kf, vf;
      decode(b, kf, vf);
      for (int l = 0; l < L_; ++l) {
        RawRows& k = layers_[size_t(l)].k;
        RawRows& v = layers_[size_t(l)].v;
        k.decoded.insert(k.decoded.end(), kf[size_t(l)].begin(), kf[size_t(l)].end());
        v.decoded.insert(v.decoded.end(), vf[size_t(l)].begin(), vf[size_t(l)].end());
      }
    }
    blocks_.push_back(std::move(b));
    coded_end_ += n;
  }

  std::vector<uint8_t> code_tensor(const KvtcCalibration& cal, bool is_key, int64_t t0, int64_t n) const {
    std::vector<std::vector<float>> rows(static_cast<size_t>(L_));
    std::vector<const float*> ptrs;
    for (int l = 0; l < L_; ++l) {
      const RawRows& r = is_key ? layers_[size_t(l)].k : layers_[size_t(l)].v;
      f16_rows_to_f32(r.tail.data(), size_t(n * V_), rows[size_t(l)]);  // the tail starts at t0
      ptrs.push_back(rows[size_t(l)].data());
    }
    return code_rows(cal, is_key, ptrs.data(), t0, n);
  }

  // layer_rows[l]: layer l's tokens [t0, t0 + n) as f32 [n, H * D].
  std::vector<uint8_t> code_rows(const KvtcCalibration& cal, bool is_key, const float* const* layer_rows, int64_t t0,
                                 int64_t n) const {
    std::vector<float> x(size_t(n * L_ * V_));
    cross_layer_to_codec(layer_rows, L_, H_, D_, n, t0, is_key, inv_freq_,
                         is_key ? cal.key_scale[0] : cal.value_scale[0], x.data());
    return kvtc::encode_block(is_key ? cal.keys[0] : cal.values[0], x.data(), n);
  }

  // Re-codes a recent-tier block with the base calibration from its
  // recent-tier reconstruction (the scratch's rows, or decoded here), and
  // puts the base code's reconstruction in the scratch.
  void recode_to_base(CodedBlock& b) {
    std::vector<std::vector<float>> kf, vf;
    if (o_.decoded_scratch) {
      kf.resize(size_t(L_));
      vf.resize(size_t(L_));
      const size_t at = size_t((b.first - o_.sinks) * V_), count = size_t(b.n * V_);
      for (int l = 0; l < L_; ++l) {
        const RawRows& k = layers_[size_t(l)].k;
        const RawRows& v = layers_[size_t(l)].v;
        kf[size_t(l)].assign(k.decoded.begin() + at, k.decoded.begin() + at + count);
        vf[size_t(l)].assign(v.decoded.begin() + at, v.decoded.begin() + at + count);
      }
    } else {
      decode(b, kf, vf);
    }
    std::vector<const float*> kp, vp;
    for (int l = 0; l < L_; ++l) {
      kp.push_back(kf[size_t(l)].data());
      vp.push_back(vf[size_t(l)].data());
    }
    b.k = code_rows(*cal_, true, kp.data(), b.first, b.n);
    b.v = code_rows(*cal_, false, vp.data(), b.first, b.n);
    b.k.shrink_to_fit();
    b.v.shrink_to_fit();
    b.recent = false;
    recoded_ += b.n;
    if (o_.decoded_scratch) {
      decode(b, kf, vf);
      const size_t at = size_t((b.first - o_.sinks) * V_);
      for (int l = 0; l < L_; ++l) {
        std::copy(kf[size_t(l)].begin(), kf[size_t(l)].end(), layers_[size_t(l)].k.decoded.begin() + at);
        std::copy(vf[size_t(l)].begin(), vf[size_t(l)].end(), layers_[size_t(l)].v.decoded.begin() + at);
      }
    }
  }

  // Block b decoded whole (every layer): rows[l] = layer l's keys / values
  // as f32 [n, H * D]. One call = one block's decode work.
  void decode(const CodedBlock& b, std::vector<std::vector<float>>& k, std::vector<std::vector<float>>& v) const {
    decode_tensor(b, true, k);
    decode_tensor(b, false, v);
    decoded_ += uint64_t(b.n);
  }

  void decode_tensor(const CodedBlock& b, bool is_key, std::vector<std::vector<float>>& rows) const {
    const std::vector<uint8_t>& payload = is_key ? b.k : b.v;
    const KvtcCalibration& cal = cal_of(b);
    std::vector<float> x(size_t(b.n * L_ * V_));
    kvtc::decode_block(is_key ? cal.keys[0] : cal.values[0], payload.data(), payload.size(), b.n, x.data());
    rows.resize(size_t(L_));
    std::vector<float*> ptrs;
    for (auto& r : rows) {
      r.resize(size_t(b.n * V_));
      ptrs.push_back(r.data());
    }
    cross_layer_from_codec(x.data(), L_, H_, D_, b.n, b.first, is_key, inv_freq_,
                           is_key ? cal.key_scale[0] : cal.value_scale[0], ptrs.data());
  }

  std::shared_ptr<const KvtcCalibration> cal_;
  CrossLayerStreamOptions o_;
  int L_, H_, D_;
  int64_t V_;
  std::vector<double> inv_freq_;
  std::vector<LayerState> layers_;
  std::vector<CodedBlock> blocks_;
  int64_t coded_end_;  // tokens [sinks, coded_end_) are coded
  size_t first_recent_ = 0;  // blocks_[first_recent_..] are in the recent tier (all of them without one)
  int64_t recoded_ = 0;      // tokens re-coded from the recent tier to the base calibration
  mutable std::atomic<uint64_t> decoded_{0};  // work: tokens decoded (all layers of each)
};

class CrossLayerStreamCache final : public KVCache {
 public:
  CrossLayerStreamCache(std::shared_ptr<CrossLayerStreamGroup> group, CacheConfig config)
      : group_(std::move(group)), config_(config) {}

  std::string method() const override { return "xkvtc"; }
  const CacheConfig& config() const override { return config_; }

  void append(const TensorView& keys, const TensorView& values) override {
    if (keys.shape != values.shape)
      throw Error(ErrorCode::kShapeMismatch, "xkvtc append: keys " + shape_string(keys.shape) + " and values " +
                                                 shape_string(values.shape) + " differ");
    if (keys.shape[0] != 1)
      throw Error(ErrorCode::kUnsupported,
                  "xkvtc append: batch " + std::to_string(keys.shape[0]) + "; the cross-layer stream holds batch 1");
    if (keys.heads() != config_.n_kv_heads || keys.head_dim() != config_.head_dim)
      throw Error(ErrorCode::kShapeMismatch, "xkvtc append: " + shape_string(keys.shape) + ", the layer holds [1, " +
                                                 std::to_string(config_.n_kv_heads) + ", S, " +
                                                 std::to_string(config_.head_dim) + "]");
    if (keys.tokens() == 0) return;
    group_->append(config_.layer, keys, values);
  }

  void for_each_block(const BlockVisitor& visit) const override { group_->visit(config_.layer, visit); }
  int64_t offset() const override { return group_->tokens(config_.layer); }
  bool is_trimmable() const override { return false; }
  int64_t trim(int64_t n) override {
    if (n <= 0) return 0;
    throw Error(ErrorCode::kUnsupported, "xkvtc: trim is not supported (its coded blocks span every layer)");
  }
  std::vector<uint8_t> save() const override {
    throw Error(ErrorCode::kUnsupported, "xkvtc: save is not supported (its coded blocks span every layer)");
  }
  void load(const uint8_t*, size_t) override {
    throw Error(ErrorCode::kUnsupported, "xkvtc: load is not supported (its coded blocks span every layer)");
  }
  CacheStats stats() const override { return group_->stats(config_.layer); }

 private:
  std::shared_ptr<CrossLayerStreamGroup> group_;
  CacheConfig config_;
};

void check_options(const CrossLayerStreamOptions& o) {
  if (o.sinks < 0 || o.sinks > (1 << 20)) throw_config_error("xkvtc.sinks", std::to_string(o.sinks), "[0, 2^20]");
  if (o.window < 0 || o.window > (1 << 20)) throw_config_error("xkvtc.window", std::to_string(o.window), "[0, 2^20]");
  if (o.block < 1 || o.block > (1 << 16)) throw_config_error("xkvtc.block", std::to_string(o.block), "[1, 65536]");
  if (o.recent < 0 || o.recent > (1 << 20)) throw_config_error("xkvtc.recent", std::to_string(o.recent), "[0, 2^20]");
  if (o.recent > 0 && !o.recent_calibration)
    throw_config_error("xkvtc.recent", std::to_string(o.recent), "0 without xkvtc.recent_calibration");
  if (o.recent == 0 && o.recent_calibration)
    throw_config_error("xkvtc.recent_calibration", "(set)", "unset with xkvtc.recent = 0");
}

}  // namespace

std::vector<std::unique_ptr<KVCache>> make_cross_layer_stream_caches(std::shared_ptr<const KvtcCalibration> cal,
                                                                     const CacheConfig& config,
                                                                     const CrossLayerStreamOptions& options) {
  if (!cal) throw Error(ErrorCode::kInvalidArgument, "xkvtc: no calibration");
  check_cross_layer_calibration(*cal, config.n_layers, config.n_kv_heads, config.head_dim, config.rope_theta,
                                "(xkvtc stream)");
  check_options(options);
  if (options.recent_calibration)
    check_cross_layer_calibration(*options.recent_calibration, config.n_layers, config.n_kv_heads, config.head_dim,
                                  config.rope_theta, "(xkvtc stream, recent tier)");
  auto group = std::make_shared<CrossLayerStreamGroup>(std::move(cal), config, options);
  std::vector<std::unique_ptr<KVCache>> caches;
  for (int l = 0; l < config.n_layers; ++l) {
    CacheConfig c = config;
    c.layer = l;
    caches.push_back(std::make_unique<CrossLayerStreamCache>(group, c));
  }
  return caches;
}

std::function<std::unique_ptr<KVCache>(const CacheConfig&)> cross_layer_stream_factory(
    std::shared_ptr<const KvtcCalibration> cal, const CrossLayerStreamOptions& options) {
  auto pending = std::make_shared<std::vector<std::unique_ptr<KVCache>>>();
  auto next = std::make_shared<int>(0);
  return [cal = std::move(cal), options, pending, next](const CacheConfig& c) -> std::unique_ptr<KVCache> {
    if (c.layer == 0) {
      *pending = make_cross_layer_stream_caches(cal, c, options);
      *next = 0;
    }
    if (c.layer != *next || size_t(c.layer) >= pending->size())
      throw Error(ErrorCode::kInvalidArgument, "xkvtc factory: layer " + std::to_string(c.layer) +
                                                   " asked for; a sequence's caches come in order from layer 0 (next: " +
                                                   std::to_string(*next) + ")");
    ++*next;
    return std::move((*pending)[size_t(c.layer)]);
  };
}

}  // namespace kvcodec

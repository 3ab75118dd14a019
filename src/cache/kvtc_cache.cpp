#include "cache/kvtc_cache.hpp"
#include "cache/append_checks.hpp"
#include "cache/kvtc_base.hpp"
#include "cache/kvtc_calibrated.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>

#include "cache/saved_meta.hpp"
#include "core/held_bytes.hpp"
#include "cache/settings.hpp"
#include "core/first_exception.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"
#include "kvtc/raw_convert.hpp"
#include "linalg/pca.hpp"

namespace kvcodec {

namespace {

using cache_impl::varint_size;

// Meta "layout" of the sections below (docs/format.md); files without the
// key are version 1 (the same bytes).
constexpr int kLayoutVersion = 1;

// The kernel set `half` with the 8-bit projection and reconstruction
// (HeadKernels::proj8, recon8: twice the 16-bit ones' products per
// instruction) where the settings ask for them (int8, the default); the fit
// measures its target with the same (CodecOptions::int8_kernels).
kvtc::KernelSet with_int8(kvtc::KernelSet half, bool int8) {
  return int8 ? half | kvtc::KernelSet::kInt8 : half;
}

// One encoded block of `block` tokens: every (batch, head)'s payload.
struct EncodedBlock {
  std::vector<std::vector<uint8_t>> payload;  // [B*H]
  size_t serialized_size() const {
    size_t n = 0;
    for (const auto& p : payload) n += varint_size(p.size()) + p.size();
    return n;
  }
};

// One tensor's (K or V) compressed state.
struct Stream {
  // Every (batch, head)'s frozen parameters [B*H] once fitted, held as
  // serialised (HeadParams::serialize, the stored bytes): the codec's
  // in-memory form (f32 basis, frequency and coder tables, integer kernels)
  // is 2-3x their size, so it is built from these bytes for one encode or
  // decode call (open_heads) and dropped after it.
  std::vector<std::vector<uint8_t>> params;
  // Per head: kept components and payload bits per token before entropy
  // coding (stats(), coded-symbol counts) without parsing the parameters.
  std::vector<int> n_kept;
  std::vector<uint32_t> code_bits;
  std::vector<EncodedBlock> blocks;
  // Raw tokens, per (batch, head), in the raw dtype: sinks first, then the tail.
  std::vector<std::vector<uint16_t>> raw;  // [B*H][tokens * D]
};

class KvtcCache final : public cache_impl::KvtcCacheBase {
 public:
  KvtcCache(const CacheConfig& config, const Settings& settings)
      : KvtcCacheBase(config, settings, parse_kvtc_settings(settings, config), "kvtc", kLayoutVersion) {}

  void append(const TensorView& keys, const TensorView& values) override;
  void for_each_block(const BlockVisitor& visit) const override;
  void load(const uint8_t* data, size_t size) override;

 private:
  int64_t heads_total() const { return batch_ * config_.n_kv_heads; }
  int64_t encoded_tokens() const override { return int64_t(key_.blocks.size()) * options_.block; }
  void cut_raw(int64_t count) override;
  void uncode_newest_block() override;
  // Blocks the tail holds ready to be coded (window newer tokens after them).
  int64_t ready_blocks() const {
    const int64_t ready = offset_ - options_.sinks - encoded_tokens() - options_.window;
    return ready >= options_.block ? ready / options_.block : 0;
  }
  // The codec's form of both tensors' parameters ([B*H] each), built from the
  // held bytes for the call that needs them (see Stream::params).
  struct OpenHeads {
    std::vector<kvtc::HeadParams> key, value;
    const std::vector<kvtc::HeadParams>& of(const Stream& s, const KvtcCache& c) const {
      return &s == &c.key_ ? key : value;
    }
  };
  OpenHeads open_heads(kvtc::KernelSet kernels) const;
  // Keeps fitted (or loaded) parameters as their serialised bytes.
  static void hold_params(Stream& s, const std::vector<kvtc::HeadParams>& heads);
  OpenHeads fit();
  // The encoders' `open` heads when the call has them (kept, or just
  // fitted); null: each head parsed and built by encoder_head, once per call.
  void encode_ready_blocks(const OpenHeads* open);
  void encode_direct(const OpenHeads* open, const TensorView& keys, const TensorView& values, int64_t n);
  // Head h of s for this call's encoder: open's, or the held bytes opened in
  // this thread's kvtc::HeadOpener (valid until its next head: a head's
  // blocks are coded before the thread takes another).
  const kvtc::HeadParams& encoder_head(const OpenHeads* open, const Stream& s, int64_t h) const;
  // Head h of s parsed from its held bytes into `opener` (valid until its
  // next open) with the `kernels` half built.
  const kvtc::HeadParams& open_held(const Stream& s, int64_t h, kvtc::HeadOpener& opener,
                                    kvtc::KernelSet kernels) const;
  void raw_to_f32(const std::vector<uint16_t>& raw, int64_t first, int64_t count, float* out) const;
  void reset() override;
  TensorBytes tensor_bytes(bool is_key) const override;
  void add_mode_stats(CacheStats& st) const override;
  void write_sections(ContainerWriter& w) const override;
  // Decodes every block once and drops the result: load() refuses a corrupt
  // payload there, not at a later fetch.
  void decode_every_block(const OpenHeads& open) const;
  // Runs body(h) for every (batch, head): an OpenMP team when threads > 1,
  // a plain loop otherwise (a team per 64-token block costs more than the
  // block's decode at one thread).
  // An exception in body is carried out of the team (FirstException).
  template <typename Body>
  void parallel_heads(int64_t heads, const Body& body) const {
    if (options_.threads > 1) {
      FirstException failure;
#pragma omp parallel for num_threads(options_.threads) schedule(static)
      for (int64_t h = 0; h < heads; ++h) failure.capture([&] { body(h); });
      failure.rethrow();
    } else {
      for (int64_t h = 0; h < heads; ++h) body(h);
    }
  }

  bool fitted_ = false;
  Stream key_, value_;
  // Both halves of the heads (KernelSet::kBoth), kept between calls while
  // the cache is fed in pieces smaller than a block: a decode loop codes a
  // block every few appends and fetches every step, and opening them per
  // call cost ~25x a token's append and 1.55x a 1K-token fetch
  // (docs/kvtc.md); counted in resident_bytes. A bulk append drops them.
  // Concurrent fetches (for_each_block is const) share them behind the
  // mutex; a moved-to cache takes the moved-from one's mutex with them.
  struct KeptHeads {
    std::unique_ptr<std::mutex> mutex = std::make_unique<std::mutex>();
    std::shared_ptr<const OpenHeads> heads;
    bool keep = false;  // the last append was smaller than a block
    std::shared_ptr<const OpenHeads> get() const {
      const std::lock_guard<std::mutex> lock(*mutex);
      return heads;
    }
    void set(std::shared_ptr<const OpenHeads> h) {
      const std::lock_guard<std::mutex> lock(*mutex);
      heads = std::move(h);
    }
  };
  mutable KeptHeads kept_;
  // This call's heads: the kept ones, else built with `kernels` (kBoth and
  // kept when the cache keeps them).
  kvtc::KernelSet kernels_for(kvtc::KernelSet half) const { return with_int8(half, options_.codec.int8_kernels); }
  std::shared_ptr<const OpenHeads> heads_for_call(kvtc::KernelSet kernels) const {
    if (auto kept = kept_.get()) return kept;
    auto built = std::make_shared<const OpenHeads>(open_heads(kept_.keep ? kernels_for(kvtc::KernelSet::kBoth) : kernels));
    if (kept_.keep) kept_.set(built);
    return built;
  }
  // Symbols of n_blocks new blocks of every head of s (one code per kept
  // component and token), added to coded_symbols_.
  void count_coded(const Stream& s, int64_t n_blocks) {
    for (int k : s.n_kept) coded_symbols_ += uint64_t(n_blocks) * uint64_t(options_.block) * uint64_t(k);
  }
};

void KvtcCache::reset() {
  offset_ = 0;
  fitted_ = false;
  key_ = Stream{};
  value_ = Stream{};
  kept_.set(nullptr);
}

KvtcCache::OpenHeads KvtcCache::open_heads(kvtc::KernelSet kernels) const {
  OpenHeads open;
  for (const Stream* s : {&key_, &value_}) {
    auto& heads = s == &key_ ? open.key : open.value;
    heads.resize(s->params.size());
    parallel_heads(int64_t(heads.size()), [&](int64_t h) {
      const auto& bytes = s->params[size_t(h)];
      ByteReader in(bytes.data(), bytes.size(), "kvtc head params");
      heads[size_t(h)] = kvtc::HeadParams::deserialize(in, config_.head_dim, kernels);
    });
  }
  return open;
}

const kvtc::HeadParams& KvtcCache::encoder_head(const OpenHeads* open, const Stream& s, int64_t h) const {
  if (open) return open->of(s, *this)[size_t(h)];
  // Per-thread scratch, not held by any cache: its storage grows to the
  // largest head this thread opened and is parsed into again per head,
  // without the allocation and freeing of ~200 vectors a head
  // (HeadParams::deserialize) that were most of a bulk append's opening.
  thread_local kvtc::HeadOpener opener;
  return open_held(s, h, opener, kernels_for(kvtc::KernelSet::kEncode));
}

const kvtc::HeadParams& KvtcCache::open_held(const Stream& s, int64_t h, kvtc::HeadOpener& opener,
                                             kvtc::KernelSet kernels) const {
  const auto& bytes = s.params[size_t(h)];
  ByteReader in(bytes.data(), bytes.size(), "kvtc head params");
  return opener.open(in, config_.head_dim, kernels);
}

void KvtcCache::hold_params(Stream& s, const std::vector<kvtc::HeadParams>& heads) {
  s.params.clear();
  s.n_kept.clear();
  s.code_bits.clear();
  for (const auto& h : heads) {
    ByteWriter w;
    h.serialize(w);
    s.params.push_back(w.take());
    s.params.back().shrink_to_fit();
    s.n_kept.push_back(h.n_kept());
    uint32_t bits = 0;
    for (uint8_t width : h.fixed_widths) bits += width;
    s.code_bits.push_back(bits);
  }
}

void KvtcCache::raw_to_f32(const std::vector<uint16_t>& raw, int64_t first, int64_t count, float* out) const {
  const size_t d = size_t(config_.head_dim);
  kvtc::raw_to_f32(raw.data() + size_t(first) * d, raw_dtype_, out, size_t(count) * d);
}

void KvtcCache::append(const TensorView& keys, const TensorView& values) {
  cache_impl::check_append(keys, values, config_, offset_ == 0 ? 0 : batch_, "kvtc");
  if (offset_ == 0) {
    batch_ = keys.shape[0];
    raw_dtype_ = cache_impl::raw_dtype_for(keys.dtype);
    key_.raw.assign(size_t(heads_total()), {});
    value_.raw.assign(size_t(heads_total()), {});
  }
  const int64_t S = keys.shape[2];
  if (S == 0) return;
  const size_t D = size_t(config_.head_dim);
  // Steady state with the raw tail empty: the blocks this append completes
  // are coded straight from the input rows, through a block-sized raw buffer
  // (the same rounding to the raw dtype, hence the same codes and bytes), not
  // written to the tail, read back and erased. The rest goes to the tail.
  int64_t direct = 0;
  const auto rows_ok = [&](const TensorView& t) {
    return t.dtype == DType::kF32 && (t.strides[3] == 1 || t.shape[3] == 1);
  };
  if (fitted_ && raw_tokens() == sink_tokens() && rows_ok(keys) && rows_ok(values) && S > options_.window)
    direct = (S - options_.window) / options_.block * options_.block;
  // The encoder's heads, built at most once per call and only when a block
  // is coded (kept between calls only while they are small: see kept_); a
  // bulk append opens each head where it codes it (encoder_head).
  kept_.keep = S < options_.block;
  if (!kept_.keep) kept_.set(nullptr);
  std::shared_ptr<const OpenHeads> open;
  const auto need_encoder = [&] {
    if (!open && kept_.keep) open = heads_for_call(kernels_for(kvtc::KernelSet::kEncode));
  };
  if (direct > 0) {
    need_encoder();
    encode_direct(open.get(), keys, values, direct);
  }
  const int64_t S_raw = S - direct;
  for (Stream* stream : {&key_, &value_}) {
    if (S_raw == 0) break;
    const TensorView& src = stream == &key_ ? keys : values;
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t h = 0; h < config_.n_kv_heads; ++h) {
        // Straight into the raw tail, no intermediate row buffer.
        auto& raw = stream->raw[size_t(b * config_.n_kv_heads + h)];
        const size_t at = raw.size();
        raw.resize(at + size_t(S_raw) * D);
        head_rows_to_raw(src, b, h, direct, S_raw, raw.data() + at, size_t(D));
      }
  }
  offset_ += S;
  if (!fitted_ && offset_ - options_.sinks >= options_.min_fit_tokens) {
    open = std::make_shared<const OpenHeads>(fit());  // both halves, as fitted
    if (kept_.keep) kept_.set(open);
  }
  if (fitted_ && ready_blocks() > 0) {
    need_encoder();
    encode_ready_blocks(open.get());
  }
}

KvtcCache::OpenHeads KvtcCache::fit() {
  const int D = config_.head_dim;
  const int64_t heads = heads_total();
  const int64_t first = options_.sinks;          // sinks stay raw and out of the fit
  const int64_t n = offset_ - first;
  OpenHeads open;
  for (Stream* stream : {&key_, &value_}) {
    std::vector<kvtc::HeadParams>& fitted = stream == &key_ ? open.key : open.value;
    std::vector<float> x(size_t(heads) * size_t(n) * size_t(D));
    for (int64_t h = 0; h < heads; ++h) raw_to_f32(stream->raw[size_t(h)], first, n, &x[size_t(h * n) * size_t(D)]);
    const std::vector<linalg::PcaBasis> pcas = linalg::fit_pca_batched(x.data(), heads, n, D, options_.threads);
    fitted.assign(size_t(heads), {});
    FirstException failure;
#pragma omp parallel for num_threads(options_.threads) schedule(dynamic)
    for (int64_t h = 0; h < heads; ++h) failure.capture([&] {
      const float* xh = &x[size_t(h * n) * size_t(D)];
      const auto& pca = pcas[size_t(h)];
      kvtc::CodecOptions codec = options_.codec;
      const double own_target = stream == &key_ ? options_.key_target_rel_mse : options_.value_target_rel_mse;
      if (own_target > 0.0) codec.target_rel_mse = own_target;
      if (options_.target_ratio > 0.0) {
        // The largest budget whose fit-token cost (side + payload) stays under
        // f16 / target_ratio: bisection on the integer budget.
        const double allowed_bytes = double(n) * D * 2.0 / options_.target_ratio;
        int lo = 0, hi = 16 * D;
        while (lo < hi) {
          const int mid = (lo + hi + 1) / 2;
          codec.bit_budget = std::max(mid, 1);
          const auto trial = kvtc::fit_head(xh, n, D, pca.mean, pca.components, pca.eigenvalues, codec);
          const double bytes = double(trial.serialized_size() + kvtc::encode_block(trial, xh, n).size());
          if (bytes <= allowed_bytes) lo = mid; else hi = mid - 1;
        }
        codec.bit_budget = std::max(lo, 1);
      }
      fitted[size_t(h)] = kvtc::fit_head(xh, n, D, pca.mean, pca.components, pca.eigenvalues, codec);
    });
    failure.rethrow();
    hold_params(*stream, fitted);
  }
  fitted_ = true;
  return open;
}

void KvtcCache::encode_direct(const OpenHeads* open, const TensorView& keys, const TensorView& values,
                              int64_t n) {
  const int64_t B = options_.block;
  const int64_t heads = heads_total();
  const int64_t H = config_.n_kv_heads;
  const size_t n_blocks = size_t(n / B);
  for (Stream* stream : {&key_, &value_}) {
    const TensorView& src = stream == &key_ ? keys : values;
    const size_t first = stream->blocks.size();
    stream->blocks.resize(first + n_blocks);
    for (size_t j = 0; j < n_blocks; ++j) stream->blocks[first + j].payload.resize(size_t(heads));
    parallel_heads(heads, [&](int64_t h) {
      const float* base = static_cast<const float*>(src.data) + (h / H) * src.strides[0] + (h % H) * src.strides[1];
      const kvtc::HeadParams& params = encoder_head(open, *stream, h);
      const auto rows = [&](size_t j) { return base + int64_t(j) * B * src.strides[2]; };
      // The rounding to the raw dtype fused into the encoder's centring;
      // blocks two at a time (their rANS streams side by side).
      size_t j = 0;
      for (; j + 2 <= n_blocks; j += 2) {
        auto two = kvtc::encode_block_rows_pair(params, rows(j), rows(j + 1), src.strides[2], B, raw_dtype_);
        stream->blocks[first + j].payload[size_t(h)] = std::move(two.first);
        stream->blocks[first + j + 1].payload[size_t(h)] = std::move(two.second);
      }
      if (j < n_blocks)
        stream->blocks[first + j].payload[size_t(h)] =
            kvtc::encode_block_rows(params, rows(j), src.strides[2], B, raw_dtype_);
    });
    count_coded(*stream, int64_t(n_blocks));
  }
}

void KvtcCache::encode_ready_blocks(const OpenHeads* open) {
  const int D = config_.head_dim;
  const int64_t heads = heads_total();
  const int64_t B = options_.block;
  // Every block that is ready now, encoded in one pass; the raw tail is then
  // cut once (erasing block by block would move the tail once per block:
  // quadratic in the tokens of one append).
  const int64_t n_new = ready_blocks();
  if (n_new == 0) return;
  // The oldest tail tokens: raw index sinks (they sit right after the sinks).
  const int64_t sinks = sink_tokens();
  for (Stream* stream : {&key_, &value_}) {
    const size_t first = stream->blocks.size();
    stream->blocks.resize(first + size_t(n_new));
    for (int64_t j = 0; j < n_new; ++j) stream->blocks[first + size_t(j)].payload.resize(size_t(heads));
    const auto encode_head = [&](int64_t h) {
      std::vector<float> x(size_t(2 * B) * size_t(D));  // two blocks, coded side by side
      auto& raw = stream->raw[size_t(h)];
      const kvtc::HeadParams& params = encoder_head(open, *stream, h);
      int64_t j = 0;
      for (; j + 2 <= n_new; j += 2) {
        raw_to_f32(raw, sinks + j * B, 2 * B, x.data());
        auto two = kvtc::encode_block_pair(params, x.data(), x.data() + size_t(B) * size_t(D), B);
        stream->blocks[first + size_t(j)].payload[size_t(h)] = std::move(two.first);
        stream->blocks[first + size_t(j) + 1].payload[size_t(h)] = std::move(two.second);
      }
      if (j < n_new) {
        raw_to_f32(raw, sinks + j * B, B, x.data());
        stream->blocks[first + size_t(j)].payload[size_t(h)] = kvtc::encode_block(params, x.data(), B);
      }
      raw.erase(raw.begin() + sinks * D, raw.begin() + (sinks + n_new * B) * D);
      shrink_if_oversized(raw, size_t(sinks + B + options_.window) * D);
    };
    parallel_heads(heads, encode_head);
    count_coded(*stream, n_new);
  }
}

namespace {

// The openers a fetch parses its heads into (one per tensor and head):
// per-thread scratch, not held by any cache. A fetch opened its heads with
// HeadParams::deserialize, ~200 heap allocations a head freed at its end;
// reusing the openers' storage moved the defaults' decode from 0.500 to
// 0.510 of zstd's (docs/history/kvtc-speed.md "Fetch openers"; the rest of the opening is
// computation). The storage grows to the largest layer this thread fetched
// (~50 KB a head of 64 at 4.8x) and is parsed into again per fetch. A fetch
// inside a fetch's visitor (another cache's, on the same thread) finds them
// leased and takes openers of its own for the call.
class FetchOpeners {
 public:
  class Lease {
   public:
    Lease() = default;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() {
      if (leased_) pool().busy = false;
    }
    // n openers, valid until this lease ends.
    std::vector<kvtc::HeadOpener>& get(size_t n) {
      Pool& p = pool();
      if (!leased_ && !p.busy) p.busy = leased_ = true;
      std::vector<kvtc::HeadOpener>& v = leased_ ? p.openers : own_;
      if (v.size() < n) v.resize(n);
      return v;
    }

   private:
    bool leased_ = false;
    std::vector<kvtc::HeadOpener> own_;
  };

 private:
  struct Pool {
    std::vector<kvtc::HeadOpener> openers;
    bool busy = false;
  };
  static Pool& pool() {
    thread_local Pool p;
    return p;
  }
};

}  // namespace

void KvtcCache::for_each_block(const BlockVisitor& visit) const {
  if (offset_ == 0) return;
  const int64_t H = config_.n_kv_heads;
  const int64_t D = config_.head_dim;
  const int64_t heads = heads_total();
  auto emit_raw = [&](int64_t raw_first, int64_t count, int64_t first_token) {
    if (count <= 0) return;
    Tensor k(DType::kF32, {batch_, H, count, D}), v(DType::kF32, {batch_, H, count, D});
    for (int64_t h = 0; h < heads; ++h) {
      raw_to_f32(key_.raw[size_t(h)], raw_first, count, k.data_as<float>() + h * count * D);
      raw_to_f32(value_.raw[size_t(h)], raw_first, count, v.data_as<float>() + h * count * D);
    }
    visit(first_token, k.view(), v.view());
  };
  const int64_t sinks = sink_tokens();
  emit_raw(0, sinks, 0);
  const int64_t B = options_.block;
  Tensor k(DType::kF32, {batch_, H, B, D}), v(DType::kF32, {batch_, H, B, D});
  // This call's heads: the kept ones (a decode loop), else each head's
  // held bytes opened into this thread's scratch (FetchOpeners).
  std::shared_ptr<const OpenHeads> kept;
  FetchOpeners::Lease openers;
  std::vector<const kvtc::HeadParams*> key_heads(static_cast<size_t>(heads)), value_heads(key_heads.size());
  if (!key_.blocks.empty()) {
    kept = kept_.keep ? heads_for_call(kernels_for(kvtc::KernelSet::kDecode)) : kept_.get();
    if (kept) {
      for (int64_t h = 0; h < heads; ++h) key_heads[size_t(h)] = &kept->key[size_t(h)];
      for (int64_t h = 0; h < heads; ++h) value_heads[size_t(h)] = &kept->value[size_t(h)];
    } else {
      std::vector<kvtc::HeadOpener>& op = openers.get(size_t(2 * heads));
      parallel_heads(heads, [&](int64_t h) {
        key_heads[size_t(h)] = &open_held(key_, h, op[size_t(2 * h)], kernels_for(kvtc::KernelSet::kDecode));
        value_heads[size_t(h)] = &open_held(value_, h, op[size_t(2 * h + 1)], kernels_for(kvtc::KernelSet::kDecode));
      });
    }
  }
  // Keys and values of two heads per call, their four rANS streams decoded
  // in lockstep (kvtc::decode_blocks); with one head, of two blocks.
  struct Batch {
    kvtc::BlockDecode blocks[kvtc::kMaxBlocksTogether];
    size_t n = 0;
  };
  const auto add_blocks = [&](size_t j, int64_t h, Tensor& kt, Tensor& vt, Batch& out) {
    const auto& kp = key_.blocks[j].payload[size_t(h)];
    const auto& vp = value_.blocks[j].payload[size_t(h)];
    out.blocks[out.n++] = {key_heads[size_t(h)], kp.data(), kp.size(), kt.data_as<float>() + h * B * D};
    out.blocks[out.n++] = {value_heads[size_t(h)], vp.data(), vp.size(), vt.data_as<float>() + h * B * D};
  };
  const size_t n_blocks = key_.blocks.size();
  if (heads >= 2) {
    for (size_t j = 0; j < n_blocks; ++j) {
      parallel_heads((heads + 1) / 2, [&](int64_t pair) {
        Batch batch;
        for (int64_t h = 2 * pair; h < std::min(heads, 2 * pair + 2); ++h) add_blocks(j, h, k, v, batch);
        kvtc::decode_blocks(batch.blocks, batch.n, B);
      });
      visit(sinks + int64_t(j) * B, k.view(), v.view());
    }
  } else if (n_blocks > 0) {
    Tensor k2(DType::kF32, {batch_, H, B, D}), v2(DType::kF32, {batch_, H, B, D});
    for (size_t j = 0; j < n_blocks; j += 2) {
      Batch batch;
      add_blocks(j, 0, k, v, batch);
      if (j + 1 < n_blocks) add_blocks(j + 1, 0, k2, v2, batch);
      kvtc::decode_blocks(batch.blocks, batch.n, B);
      visit(sinks + int64_t(j) * B, k.view(), v.view());
      if (j + 1 < n_blocks) visit(sinks + int64_t(j + 1) * B, k2.view(), v2.view());
    }
  }
  emit_raw(sinks, raw_tokens() - sinks, sinks + encoded_tokens());
}

void KvtcCache::cut_raw(int64_t count) {
  for (Stream* s : {&key_, &value_})
    for (auto& raw : s->raw) raw.resize(raw.size() - size_t(count * config_.head_dim));
  offset_ -= count;
}

void KvtcCache::uncode_newest_block() {
  const int64_t B = options_.block, D = config_.head_dim;
  std::vector<float> x(size_t(B * D));
  std::vector<uint16_t> row(size_t(B * D));
  const OpenHeads open = open_heads(kernels_for(kvtc::KernelSet::kDecode));
  for (Stream* s : {&key_, &value_}) {
    const EncodedBlock& blk = s->blocks.back();
    for (int64_t h = 0; h < heads_total(); ++h) {
      const auto& pl = blk.payload[size_t(h)];
      kvtc::decode_block(open.of(*s, *this)[size_t(h)], pl.data(), pl.size(), B, x.data());
      convert(x.data(), DType::kF32, row.data(), raw_dtype_, row.size());
      auto& raw = s->raw[size_t(h)];
      raw.insert(raw.end(), row.begin(), row.end());
    }
    s->blocks.pop_back();
  }
}

cache_impl::KvtcCacheBase::TensorBytes KvtcCache::tensor_bytes(bool is_key) const {
  const Stream& s = is_key ? key_ : value_;
  TensorBytes b;
  for (const auto& bytes : s.params) b.side += bytes.size();
  for (const auto& blk : s.blocks) {
    b.payload += blk.serialized_size();
    for (size_t h = 0; h < blk.payload.size(); ++h)
      b.pre_entropy += (uint64_t(s.code_bits[h]) * uint64_t(options_.block) + 7) / 8;
  }
  for (const auto& r : s.raw) b.raw += r.size() * 2;
  return b;
}

void KvtcCache::add_mode_stats(CacheStats& st) const {
  for (const Stream* s : {&key_, &value_}) {
    const std::string prefix = s == &key_ ? "key." : "value.";
    // As held: the payload, raw and parameter vectors by capacity (the
    // codec's tables are built per call from the parameters, not held).
    uint64_t blocks_held = uint64_t(s->blocks.capacity()) * sizeof(EncodedBlock);
    for (const auto& blk : s->blocks) blocks_held += held_bytes(blk.payload);
    st.resident_bytes += held_bytes(s->params) + held_bytes(s->n_kept) + held_bytes(s->code_bits) + blocks_held +
                         held_bytes(s->raw);
    for (size_t h = 0; h < s->n_kept.size(); ++h)
      st.extras[prefix + "n_survived." + std::to_string(h)] = double(s->n_kept[h]);
  }
  // The heads kept between calls (a decode loop): parameters and kernels.
  uint64_t kept_held = 0;
  if (const auto kept = kept_.get()) {
    kept_held = sizeof(OpenHeads) + held_bytes(kept->key) + held_bytes(kept->value);
    for (const auto* heads : {&kept->key, &kept->value})
      for (const auto& h : *heads) kept_held += h.params_held_bytes() + h.derived_held_bytes();
  }
  st.resident_bytes += kept_held;  // memory, not state: not in extras (equal for equal caches)
  // The bit budget, where it drives the fit (not under a distortion target,
  // such as the default preset's).
  if (options_.codec.target_rel_mse <= 0.0 && options_.key_target_rel_mse <= 0.0 &&
      options_.value_target_rel_mse <= 0.0)
    st.extras["bit_budget"] = double(options_.codec.bit_budget > 0 ? options_.codec.bit_budget : 4 * config_.head_dim);
  st.resident_bytes += sizeof(*this);
}

// --- persistence -------------------------------------------------------------
//
// Meta: method, layout (1; files without it read as 1), settings, config.*.
// load() compares the saved block/sinks/window with this cache's, checks
// every count against the bytes before sizing anything by it, and decodes
// every block once (a corrupt payload is refused at load, not at fetch).
// Sections: "state" (shape, counters), then for K and V: "<t>.params" (every
// head's HeadParams), "<t>.blocks" (per block, per head: varint length +
// payload), "<t>.raw" (per head, raw tokens as 16-bit words). The byte
// counters are exactly the sizes of the params, blocks and raw sections.

void KvtcCache::write_sections(ContainerWriter& w) const {
  ByteWriter state;
  state.u64(uint64_t(batch_));
  state.u64(uint64_t(offset_));
  state.u8(fitted_ ? 1 : 0);
  state.u8(uint8_t(raw_dtype_));
  state.u64(uint64_t(key_.blocks.size()));
  w.add_section("state", state.take());
  for (const Stream* s : {&key_, &value_}) {
    const std::string prefix = s == &key_ ? "key." : "value.";
    std::vector<uint8_t> params;
    for (const auto& bytes : s->params) params.insert(params.end(), bytes.begin(), bytes.end());
    w.add_section(prefix + "params", std::move(params));
    std::vector<uint8_t> blocks;
    for (const auto& blk : s->blocks) cache_impl::append_block_payloads(blocks, blk.payload);
    w.add_section(prefix + "blocks", std::move(blocks));
    ByteWriter raw;
    for (const auto& r : s->raw)
      for (uint16_t word : r) raw.u16(word);
    w.add_section(prefix + "raw", raw.take());
  }
}

void KvtcCache::load(const uint8_t* data, size_t size) {
  const std::string who = "kvtc (local mode) load";
  const ContainerReader r = ContainerReader::parse(data, size, {}, "saved kvtc cache");
  check_saved_kvtc_meta(r, /*calibrated=*/false, kLayoutVersion,
                        {{"config.n_kv_heads", config_.n_kv_heads}, {"config.head_dim", config_.head_dim}}, config_,
                        options_, who);
  ByteReader state(r.section("state"), "kvtc state");
  const uint64_t batch = state.u64();
  const uint64_t offset = state.u64();
  const uint8_t fitted = state.u8();
  const uint8_t raw_dtype = state.u8();
  const uint64_t n_blocks = state.u64();
  state.expect_end();
  // The raw tail holds 16-bit words only: f16 or bf16, nothing else.
  if (raw_dtype != uint8_t(DType::kF16) && raw_dtype != uint8_t(DType::kBF16))
    throw Error(ErrorCode::kFormat, who + ": raw dtype id " + std::to_string(raw_dtype) + " is not f16 or bf16");
  if (fitted > 1 || (n_blocks > 0 && !fitted) || (fitted && offset == 0) || batch > (uint64_t(1) << 20))
    throw Error(ErrorCode::kFormat, who + ": inconsistent saved state (batch " + std::to_string(batch) +
                                        ", offset " + std::to_string(offset) + ", fitted " +
                                        std::to_string(fitted) + ", blocks " + std::to_string(n_blocks) + ")");
  cache_impl::CodedLayout layout;
  layout.rows = cache_impl::checked_mul(batch, uint64_t(config_.n_kv_heads), "kvtc rows");
  layout.token_words = uint64_t(config_.head_dim);
  layout.block = uint64_t(options_.block);
  layout.sinks = std::min<uint64_t>(uint64_t(options_.sinks), offset);
  layout.offset = offset;
  layout.n_blocks = n_blocks;
  layout.encoded = cache_impl::checked_mul(n_blocks, uint64_t(options_.block), "kvtc coded tokens");
  cache_impl::check_coded_layout(layout, who);
  const int64_t heads = int64_t(layout.rows);
  const int D = config_.head_dim;

  KvtcCache fresh(config_, settings_);
  fresh.batch_ = int64_t(batch);
  fresh.offset_ = int64_t(offset);
  fresh.fitted_ = fitted != 0;
  fresh.raw_dtype_ = DType(raw_dtype);
  OpenHeads open;  // parsed once here: bad parameters are refused now, and every block decoded with them
  for (Stream* s : {&fresh.key_, &fresh.value_}) {
    const std::string prefix = s == &fresh.key_ ? "key." : "value.";
    ByteReader params(r.section(prefix + "params"), "kvtc " + prefix + "params");
    auto& parsed = s == &fresh.key_ ? open.key : open.value;
    // Each head's parameters take bytes, so this loop is bounded by the section.
    if (fresh.fitted_)
      for (int64_t h = 0; h < heads; ++h) parsed.push_back(kvtc::HeadParams::deserialize(params, D, kernels_for(kvtc::KernelSet::kDecode)));
    params.expect_end();
    hold_params(*s, parsed);
    auto blocks = cache_impl::read_block_payloads(r.section(prefix + "blocks"), n_blocks, layout.rows,
                                                  "kvtc " + prefix + "blocks");
    s->blocks.reserve(blocks.size());  // exact: a loaded cache holds no growth slack
    for (auto& payloads : blocks) s->blocks.push_back(EncodedBlock{std::move(payloads)});
    s->raw = cache_impl::read_raw_rows(r.section(prefix + "raw"), layout.rows,
                                       cache_impl::checked_mul(layout.raw_tokens(), layout.token_words, "kvtc raw"),
                                       "kvtc " + prefix + "raw");
  }
  fresh.decode_every_block(open);
  *this = std::move(fresh);
}

void KvtcCache::decode_every_block(const OpenHeads& open) const {
  const int64_t B = options_.block, D = config_.head_dim;
  for (size_t j = 0; j < key_.blocks.size(); ++j)
    parallel_heads(heads_total(), [&](int64_t h) {
      thread_local std::vector<float> k, v;
      k.resize(size_t(B * D));
      v.resize(size_t(B * D));
      const auto& kp = key_.blocks[j].payload[size_t(h)];
      const auto& vp = value_.blocks[j].payload[size_t(h)];
      kvtc::decode_block_pair(open.key[size_t(h)], kp.data(), kp.size(), k.data(), open.value[size_t(h)],
                              vp.data(), vp.size(), v.data(), B);
    });
}

}  // namespace

namespace {
// Local mode's rate-control fields: with none of them set, the default preset.
constexpr const char* kRateControlFields[] = {"allocator",      "bit_budget",         "target_ratio",
                                              "target_rel_mse", "key_target_rel_mse", "value_target_rel_mse"};
}  // namespace

KvtcSettings parse_kvtc_settings(const Settings& settings, const CacheConfig& config, KvtcDefaults defaults) {
  const MethodInfo info = kvtc_method_info();
  const SettingsReader r("kvtc", settings, info.fields);
  const int D = config.head_dim;
  KvtcSettings s;
  s.mode = r.get_choice("mode", r.find("calibration") ? "calibrated" : "local", {"local", "calibrated"});
  if (s.mode == "calibrated") {
    // Calibrated mode (kvtc_calibrated.cpp): the codec parameters come from
    // the calibration file, so the fitting fields would have no effect here.
    const std::string* path = r.find("calibration");
    if (!path || path->empty()) r.fail("calibration", "a calibration file path (required by mode=calibrated)");
    s.calibration = *path;
    for (const char* f : {"bit_budget", "bit_choices", "beta", "allocator", "target_ratio", "min_fit_tokens",
                          "coder", "basis_bits"})
      if (r.find(f)) r.fail(f, "unset in calibrated mode (fixed by the calibration file: pass it to kvcodec calibrate)");
    s.rope_theta = r.get_double("rope_theta", config.rope_theta, 0.0, 1e12, /*lo_open=*/true);
    s.block = int(r.get_int("block", 64, 1, 1 << 16));
    s.sinks = int(r.get_int("sinks", 4, 0, 1 << 20));
    s.window = int(r.get_int("window", 128, 0, 1 << 24));
    s.refine = int(r.get_int("refine", 0, 0, 1 << 24));
    s.whole_blocks = r.get_choice("whole_blocks", "false", {"false", "true"}) == "true";
    s.threads = int(r.get_int("threads", 1, 1, 256));
    s.codec.int8_kernels = r.get_choice("int8", "true", {"true", "false"}) == "true";
    return s;
  }
  if (r.find("rope_theta")) r.fail("rope_theta", "unset (only calibrated mode uses it)");
  if (r.find("refine")) r.fail("refine", "unset (only calibrated mode has refinement codes)");
  if (r.find("whole_blocks")) r.fail("whole_blocks", "unset (only calibrated mode codes blocks from a window)");
  // No rate-control field given: the default preset, the rate allocator at a
  // distortion target with an int8 basis (docs/kvtc.md "Defaults": the best
  // measured ratio within 1% perplexity). Any such field given (or
  // kPerField): the fields' own defaults (dp allocator, 4*D bits, f16
  // basis), as before the preset.
  // A saved cache needs neither to load (each head's parameters carry their
  // widths and basis format); they decide only fits still to come.
  bool rate_field_given = defaults == KvtcDefaults::kPerField;
  for (const char* f : kRateControlFields) rate_field_given = rate_field_given || r.find(f) != nullptr;
  s.codec.bit_budget = int(r.get_int("bit_budget", 4 * D, 1, 16 * D));
  std::vector<int64_t> choices = r.get_int_list("bit_choices", {0, 1, 2, 3, 4, 6, 8}, 0, kvtc::kMaxComponentBits);
  std::vector<int64_t> sorted = choices;
  std::sort(sorted.begin(), sorted.end());
  if (sorted.front() != 0 || std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    r.fail("bit_choices", "distinct widths in [0, " + std::to_string(kvtc::kMaxComponentBits) +
                              "] including 0, e.g. 0,1,2,3,4,6,8");
  s.codec.bit_choices.assign(choices.begin(), choices.end());
  s.codec.beta = r.get_double("beta", 3.5, 1.0, 1e6, /*lo_open=*/true);
  s.codec.allocator = r.get_choice("allocator", rate_field_given ? "dp" : "rate", {"dp", "rate"}) == "dp"
                          ? kvtc::Allocator::kDp
                          : kvtc::Allocator::kRate;
  if (!rate_field_given) s.codec.target_rel_mse = kDefaultTargetRelMse;
  const std::string coder = r.get_choice("coder", "rans", {"rans", "huffman", "fixed", "auto"});
  s.codec.coder = coder == "rans"      ? kvtc::CoderChoice::kRans
                  : coder == "huffman" ? kvtc::CoderChoice::kHuffman
                  : coder == "fixed"   ? kvtc::CoderChoice::kFixed
                                       : kvtc::CoderChoice::kAuto;
  if (r.find("target_rel_mse")) {
    s.codec.target_rel_mse = r.get_double("target_rel_mse", 0.0, 0.0, 1.0, /*lo_open=*/true);
    if (s.codec.allocator != kvtc::Allocator::kRate) r.fail("target_rel_mse", "set only with allocator=rate");
  }
  for (const char* field : {"key_target_rel_mse", "value_target_rel_mse"})
    if (r.find(field)) {
      const double v = r.get_double(field, 0.0, 0.0, 1.0, /*lo_open=*/true);
      if (s.codec.allocator != kvtc::Allocator::kRate) r.fail(field, "set only with allocator=rate");
      (std::string(field) == "key_target_rel_mse" ? s.key_target_rel_mse : s.value_target_rel_mse) = v;
    }
  s.codec.basis_bits = int(r.get_int("basis_bits", rate_field_given ? 16 : 8, 8, 16));
  if (s.codec.basis_bits != 8 && s.codec.basis_bits != 16) r.fail("basis_bits", "8 or 16");
  s.codec.int8_kernels = r.get_choice("int8", "true", {"true", "false"}) == "true";
  const std::string* ratio = r.find("target_ratio");
  s.target_ratio = (ratio && *ratio != "none") ? r.get_double("target_ratio", 0.0, 1.0, 1000.0) : 0.0;
  s.min_fit_tokens = int(r.get_int("min_fit_tokens", 2 * int64_t(D), 1, 1 << 24));
  s.block = int(r.get_int("block", 64, 1, 1 << 16));
  s.sinks = int(r.get_int("sinks", 0, 0, 1 << 20));
  s.window = int(r.get_int("window", 0, 0, 1 << 24));
  s.threads = int(r.get_int("threads", 1, 1, 256));
  return s;
}

MethodInfo kvtc_method_info() {
  // The preset's target as the help prints it (%g: "0.0075").
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", kDefaultTargetRelMse);
  const std::string preset = buf;
  return {"kvtc",
          "KV cache transform coding: PCA per head, DP bit allocation, uniform quantization, rANS",
          {{"mode", "local", "local: basis fitted per (layer, head) at prefill; calibrated: per-layer parameters from a calibration file"},
           {"bit_budget", "", "payload bits per token per head (default 4*head_dim; setting it selects the dp allocator)"},
           {"bit_choices", "0,1,2,3,4,6,8", "widths the DP may give a component, each in [0, 12] (0 drops it)"},
           {"beta", "3.5", "distortion model d(v,b) = v * beta^-b of the dp allocator"},
           {"allocator", "rate",
            "rate (one step for all components, measured entropy) or dp (beta model); with no allocator, "
            "bit_budget, target_ratio or *target_rel_mse set: rate at target_rel_mse=" + preset +
                " with basis_bits=8, else dp"},
           {"target_ratio", "none", "pick the budget whose fit-token cost meets this compression ratio"},
           {"target_rel_mse", preset,
            "allocator=rate: pick the step reaching this ||x-x_hat||^2/||x||^2 on the fit tokens (" + preset +
                " only in the default preset)"},
           {"key_target_rel_mse", "none", "target_rel_mse for keys only (overrides target_rel_mse)"},
           {"value_target_rel_mse", "none", "target_rel_mse for values only (overrides target_rel_mse)"},
           {"min_fit_tokens", "", "tokens (sinks excluded) needed before the fit (default 2*head_dim)"},
           {"block", "64", "tokens per encoded block"},
           {"sinks", "", "first tokens kept raw (counted); default 0 local, 4 calibrated"},
           {"window", "", "newest tokens kept raw (counted); default 0 local, 128 calibrated"},
           {"refine", "0", "calibrated: newest coded tokens that also keep the calibration's refinement code"},
           {"whole_blocks", "false", "calibrated: code a block only when whole (each token coded once, a longer raw tail)"},
           {"coder", "rans", "rans, huffman, fixed or auto (strictly smallest on the fit tokens)"},
           {"basis_bits", "8", "16: f16 basis rows; 8: int8 rows with an f16 scale (default 8 in the preset, 16 otherwise)"},
           {"int8", "true",
            "local: encode and decode with 8-bit integer products (twice the 16-bit ones' per VNNI instruction; "
            "the fit's target measured with them); calibrated: encode with them; false: the 16-bit kernels"},
           {"threads", "1", "OpenMP threads for fit, encode and decode"},
           {"calibration", "", "calibration file from kvcodec calibrate (implies mode=calibrated)"},
           {"rope_theta", "", "RoPE base for calibrated mode (default: the model's)"}}};
}

int check_saved_kvtc_meta(const ContainerReader& r, bool calibrated, int newest,
                          const std::vector<std::pair<const char*, int>>& same, const CacheConfig& config,
                          const KvtcSettings& options, const std::string& who) {
  if (r.kind() != ContainerKind::kCache || r.meta_or_throw("method") != "kvtc")
    throw Error(ErrorCode::kFormat, who + ": not a saved kvtc cache");
  if (r.meta().count("calibration.params_hash") != (calibrated ? 1u : 0u))
    throw Error(ErrorCode::kFormat, who + (calibrated ? ": the saved cache is not a calibrated kvtc cache"
                                                      : ": the saved cache is a calibrated kvtc cache, this one "
                                                        "is local mode"));
  const int version = cache_impl::read_layout_version(r, newest, who);
  for (const auto& [key, value] : same)
    if (r.meta_or_throw(key) != std::to_string(value))
      throw Error(ErrorCode::kShapeMismatch, who + ": saved cache has " + key + " = " + r.meta_or_throw(key) +
                                                 ", this cache " + std::to_string(value));
  const KvtcSettings saved = parse_kvtc_settings(decode_settings(r.meta_or_throw("settings")), config);
  cache_impl::expect_same_token_layout(saved.block, saved.sinks, saved.window, options.block, options.sinks,
                                       options.window, who);
  return version;
}

std::unique_ptr<KVCache> make_kvtc_cache(const CacheConfig& config, const Settings& settings) {
  const KvtcSettings parsed = parse_kvtc_settings(settings, config);
  if (parsed.mode == "calibrated") return make_kvtc_calibrated_cache(config, settings, parsed);
  return std::make_unique<KvtcCache>(config, settings);
}

}  // namespace kvcodec

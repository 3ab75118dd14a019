// The calibrated KVTC cache (DESIGN 4): tokens of one layer coded against a
// calibration's parameters as they leave the raw window; its save and load.
#include "cache/kvtc_calibrated.hpp"

#include <algorithm>
#include <cstdio>
#include <deque>

#include "cache/append_checks.hpp"
#include "cache/append_coder.hpp"
#include "cache/kvtc_base.hpp"
#include "cache/saved_meta.hpp"
#include "cache/settings.hpp"
#include "core/cpu_features.hpp"
#include "core/first_exception.hpp"
#include "core/held_bytes.hpp"
#include "kvtc/block_codes.hpp"
#include "kvtc/raw_convert.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec {

// --- the cache -------------------------------------------------------------------

namespace {

// A shared object's identity in CacheStats::shared (its address).
std::string address_text(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

using cache_impl::append_varint;
using cache_impl::varint_size;

// One block of `block` tokens: one payload per batch row (all heads of the
// layer coded together as one vector per token). Tokens go into the newest
// block as they leave the window: its payloads grow at their end while it
// fills (open) and are coded into the codec's bytes once it is whole
// (cache/append_coder.hpp); only the newest block may be partial.
struct Block {
  int64_t tokens = 0;
  bool open = false;  // still filling (payloads stacked): the partial newest block or group
  std::vector<std::vector<uint8_t>> payload;  // [B]
  size_t serialized_size() const {
    size_t n = 0;
    for (const auto& p : payload) n += varint_size(p.size()) + p.size();
    return n;
  }
};

// Refinement codes (kvtc.refine = N) of a run of consecutive coded tokens:
// the residual after the base code, coded with the calibration's refinement
// parameters. Groups of up to kRefineGroup tokens, never across a base
// block boundary, grown with their block. A group is dropped once all its
// tokens are older than the N newest coded tokens.
struct RefineGroup {
  int64_t first = 0;  // coded-token index (position - sinks) of its first token
  Block codes;
};
constexpr int64_t kRefineGroup = 32;
// Meta "layout" of the saved sections (docs/format.md); files without the
// key are version 1. Version 2: the open payloads (a partial newest block,
// a partial group in it) of rANS parameters are stacked rANS
// (cache/append_coder.hpp); version 1 held kvtc::encode_codes bytes there,
// converted at load.
constexpr int kLayoutVersion = 2;

// Reserves room for `need` elements, growing by an eighth rather than the
// vector's doubling: a cache's vectors are resident_bytes, and a raw tail
// of a few tokens doubled on a one-token append held twice its bytes.
// Amortised O(1) still (geometric growth).
template <typename T>
void grow_by_eighths(std::vector<T>& v, size_t need) {
  if (v.capacity() < need) v.reserve(need + need / 8);
}

// dst[i] += add[i] (refinement) or, with add null, dst[t * V + d] *= w[d]
// (the weights applied on encode, their inverses on decode), then, with
// mean, dst[t * V + d] -= mean[d] (the encoder's centring), for n rows of
// V: one IEEE add, product or difference per step, so the plain loops and
// their AVX2 compilation (the vectoriser under KVCODEC_TARGET_AVX2, picked
// at run time) give the same bits as separate passes. In place: a second
// array here was 4K-aliased with the first (loads stalled on its stores).
__attribute__((always_inline)) inline void update_rows_body(float* __restrict dst, const float* __restrict add,
                                                            const float* __restrict w, const float* __restrict mean,
                                                            int64_t n, int64_t V) {
  if (add) {
    for (int64_t i = 0; i < n * V; ++i) dst[i] += add[i];
    return;
  }
  if (w && mean) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < V; ++d) dst[t * V + d] = dst[t * V + d] * w[d] - mean[d];
  } else if (w) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < V; ++d) dst[t * V + d] *= w[d];
  } else if (mean) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < V; ++d) dst[t * V + d] -= mean[d];
  }
}
#ifdef KVCODEC_HAVE_AVX2_PATHS
KVCODEC_TARGET_AVX2 void update_rows_avx2(float* dst, const float* add, const float* w, const float* mean, int64_t n,
                                          int64_t V) {
  update_rows_body(dst, add, w, mean, n, V);
}
#endif
void update_rows(float* dst, const float* add, const float* w, int64_t n, int64_t V, const float* mean = nullptr) {
#ifdef KVCODEC_HAVE_AVX2_PATHS
  if (simd_avx2()) return update_rows_avx2(dst, add, w, mean, n, V);
#endif
  update_rows_body(dst, add, w, mean, n, V);
}

struct Stream {
  std::vector<Block> blocks;
  std::deque<RefineGroup> refine;  // oldest first, contiguous up to the newest coded token
  // Raw tokens per batch row, token-major [t][h][d] in the raw dtype (keys
  // post-RoPE, as given): sinks first, then the tail.
  std::vector<std::vector<uint16_t>> raw;  // [B][tokens * H * D]
};

class CalibratedKvtcCache final : public cache_impl::KvtcCacheBase {
 public:
  CalibratedKvtcCache(const CacheConfig& config, const Settings& settings, const KvtcSettings& options)
      : KvtcCacheBase(config, settings, options, "kvtc calibrated", kLayoutVersion) {
    calibration_ = KvtcCalibration::load_shared(options_.calibration);
    check_calibration_matches(*calibration_, config_, options_.rope_theta, options_.calibration);
    if (config_.head_dim % 2 != 0)
      throw Error(ErrorCode::kUnsupported, "kvtc calibrated: RoPE needs an even head_dim, got " +
                                               std::to_string(config_.head_dim));
    if (options_.refine > 0 && !calibration_->refined())
      throw Error(ErrorCode::kConfig, "kvtc calibrated: refine=" + std::to_string(options_.refine) + " needs a "
                                      "calibration with refinement parameters (kvcodec calibrate --set "
                                      "kvtc.refine_ratio=R); " + options_.calibration + " has none");
  }

  void append(const TensorView& keys, const TensorView& values) override;
  void for_each_block(const BlockVisitor& visit) const override;
  void load(const uint8_t* data, size_t size) override;

 private:
  int64_t vdim() const { return int64_t(config_.n_kv_heads) * config_.head_dim; }
  const kvtc::HeadParams& params(bool is_key) const {
    return (is_key ? calibration_->keys : calibration_->values)[size_t(config_.layer)];
  }
  // The calibration's weights of this layer (nullptr when unweighted) and
  // their reciprocals, applied to the codec's input and output.
  const float* scale(bool is_key) const {
    return calibration_->weighted() ? (is_key ? calibration_->key_scale : calibration_->value_scale)[size_t(config_.layer)].data()
                                    : nullptr;
  }
  const kvtc::HeadParams& refine_params(bool is_key) const {
    return (is_key ? calibration_->key_refine : calibration_->value_refine)[size_t(config_.layer)];
  }
  // kvtc.int8: the calibration's 8-bit projection (KernelSet::kProj8) for
  // the rows its gate takes, else the 16-bit one (where p has it: without
  // it, neither is built and kAuto is the float projection).
  kvtc::QuantPath projection(const kvtc::HeadParams& p) const {
    return options_.codec.int8_kernels || !p.derived().proj_int ? kvtc::QuantPath::kAuto : kvtc::QuantPath::kInteger;
  }
  void append_refinement(RefineGroup& g, bool is_key, int64_t b, const float* residual, int64_t m, bool closes);
  void drop_aged_refinement();
  int64_t encoded_tokens() const override { return encoded_; }
  void cut_raw(int64_t count) override;
  void uncode_newest_block() override;
  // An append's tokens, read where they are coded straight from the
  // caller's rows rather than through the raw tail: positions
  // [first, first + tokens) of keys / values [B, H, tokens, D].
  struct NewTokens {
    const TensorView& keys;
    const TensorView& values;
    int64_t first;
    int64_t tokens;
  };
  // Codes the tokens that have left the window; `input` (nullptr: all are
  // in the raw tails) holds the newest, which go to the tails only if they
  // stay raw.
  void encode_ready_blocks(const NewTokens* input);
  // Rows x [m, V] (f32, rounded through raw_dtype_: the bits the raw tail
  // gives) of positions [position, position + m) of batch row b: those
  // before the input's from the tail, at its index raw_at; the rest from
  // the input's rows (f32 or raw_dtype_, rows contiguous: append's check).
  void gather_rows(bool is_key, int64_t b, int64_t position, int64_t m, int64_t raw_at, const NewTokens* input,
                   float* x) const;
  // Input tokens [from, to) (positions) of every batch row to the end of
  // the raw tails; the caller has reserved their room (no allocation).
  void input_to_raw(const NewTokens& input, int64_t from, int64_t to);
  // The tokens the next coding step of encode_ready_blocks takes when
  // `coded` tokens are coded and the newest block holds `held` of them
  // (0: a new block); 0 when none is ready.
  int64_t next_step_tokens(int64_t coded, int64_t held) const {
    const int64_t ready = offset_ - options_.sinks - coded - options_.window;
    if (ready <= 0) return 0;
    const int64_t m = options_.whole_blocks ? options_.block - held : std::min(ready, options_.block - held);
    return ready < m ? 0 : m;
  }
  // first_coded: coded-token index of blk's first token (its position - sinks).
  void decode(bool is_key, const Block& blk, int64_t first_coded, int64_t b, float* out) const;
  // decode() of `count` (<= kvtc::kMaxBlocksTogether) consecutive blocks
  // of one tensor and batch row, the first (blocks[0]) at coded-token index
  // first_coded, into out [their tokens, V].
  void decode_run(bool is_key, const Block* blocks, size_t count, int64_t first_coded, int64_t b, float* out) const;
  // What decode() does after the base codes: refinement, weights, RoPE.
  void finish_decode(bool is_key, const Block& blk, int64_t first_coded, int64_t b, float* out) const;
  void cover_positions(int64_t positions) {
    if (!rope_ || rope_->positions() < positions)
      rope_ = RopeTable::get(config_.head_dim, options_.rope_theta, positions);
  }
  void reset() override {
    offset_ = 0;
    encoded_ = 0;
    key_ = Stream{};
    value_ = Stream{};
  }
  TensorBytes tensor_bytes(bool is_key) const override;
  void add_mode_stats(CacheStats& st) const override;
  void write_sections(ContainerWriter& w) const override;

  std::shared_ptr<const KvtcCalibration> calibration_;
  std::shared_ptr<const RopeTable> rope_;  // covers every position held (grown in append / load)
  int64_t encoded_ = 0;  // tokens in blocks (same for keys and values)
  Stream key_, value_;
};

void CalibratedKvtcCache::append(const TensorView& keys, const TensorView& values) {
  cache_impl::check_append(keys, values, config_, offset_ == 0 ? 0 : batch_, "kvtc calibrated");
  if (offset_ == 0) {
    batch_ = keys.shape[0];
    raw_dtype_ = cache_impl::raw_dtype_for(keys.dtype);
    key_.raw.assign(size_t(batch_), {});
    value_.raw.assign(size_t(batch_), {});
  }
  const int64_t S = keys.shape[2];
  if (S == 0) return;
  const NewTokens input{keys, values, offset_, S};
  // The tokens this append codes are read from its rows (rounded to the raw
  // dtype as the tail would hold them: the same codes and bytes), not
  // written to the tail, read back and cut. Only rows that head_rows_to_raw
  // converts without a buffer of its own, so that the tails' write after
  // the coding (also on a throw) cannot fail: its room is reserved here.
  const auto direct_rows = [&](const TensorView& t) {
    return (t.strides[3] == 1 || t.shape[3] == 1) && (t.dtype == DType::kF32 || t.dtype == raw_dtype_);
  };
  const bool direct = direct_rows(keys) && direct_rows(values);
  const int64_t V = vdim();
  for (Stream* stream : {&key_, &value_})
    for (auto& raw : stream->raw) grow_by_eighths(raw, raw.size() + size_t(S * V));
  if (!direct) input_to_raw(input, input.first, input.first + S);
  offset_ += S;
  cover_positions(offset_);
  encode_ready_blocks(direct ? &input : nullptr);
}

void CalibratedKvtcCache::input_to_raw(const NewTokens& input, int64_t from, int64_t to) {
  if (from >= to) return;
  const int64_t H = config_.n_kv_heads, D = config_.head_dim;
  for (Stream* stream : {&key_, &value_}) {
    const TensorView& src = stream == &key_ ? input.keys : input.values;
    for (int64_t b = 0; b < batch_; ++b) {
      auto& raw = stream->raw[size_t(b)];
      const size_t base = raw.size();
      raw.resize(base + size_t((to - from) * H * D));
      // [h][s][d] -> token-major [s][h][d]
      for (int64_t h = 0; h < H; ++h)
        head_rows_to_raw(src, b, h, from - input.first, to - from, raw.data() + base + size_t(h * D), size_t(H * D));
    }
  }
}

void CalibratedKvtcCache::gather_rows(bool is_key, int64_t b, int64_t position, int64_t m, int64_t raw_at,
                                      const NewTokens* input, float* x) const {
  const int64_t V = vdim(), D = config_.head_dim;
  const int64_t from_tail = input ? std::clamp<int64_t>(input->first - position, 0, m) : m;
  const auto& raw = (is_key ? key_ : value_).raw[size_t(b)];
  if (from_tail > 0) kvtc::raw_to_f32(raw.data() + size_t(raw_at * V), raw_dtype_, x, size_t(from_tail * V));
  if (from_tail == m) return;
  // [h][s][d] -> token-major [s][h][d], each row rounded to the raw dtype
  // in registers (f32 input) or widened from it.
  // A bulk append's input is read from memory once (cold): each row asks
  // for its row of the next step (m rows on) into L2 meanwhile, so that it
  // comes in while this step is projected and entropy-coded. Spread over
  // the rows, not in a burst that would stall on the line fill buffers.
  const TensorView& src = is_key ? input->keys : input->values;
  const int64_t esize = int64_t(dtype_size(src.dtype)), row_bytes = src.strides[2] * esize;
  const int64_t first = position + from_tail - input->first;
  const int64_t ahead = std::clamp<int64_t>(src.shape[2] - (first + m - from_tail), 0, m - from_tail);
  for (int64_t h = 0; h < config_.n_kv_heads; ++h) {
    const auto* row = static_cast<const uint8_t*>(src.data) + (b * src.strides[0] + h * src.strides[1]) * esize +
                      first * row_bytes;
    for (int64_t t = from_tail; t < m; ++t, row += row_bytes) {
      float* dst = x + t * V + h * D;
      if (src.dtype == DType::kF32)
        kvtc::round_through_raw(reinterpret_cast<const float*>(row), raw_dtype_, dst, size_t(D));
      else
        kvtc::raw_to_f32(reinterpret_cast<const uint16_t*>(row), raw_dtype_, dst, size_t(D));
      if (t - from_tail < ahead)
        for (int64_t at = 0; at < D * esize; at += 64)
          __builtin_prefetch(row + (m - from_tail) * row_bytes + at, 0, /*L2: prefetcht2*/ 1);
    }
  }
}

void CalibratedKvtcCache::encode_ready_blocks(const NewTokens* input) {
  const int64_t V = vdim();
  const bool refining = options_.refine > 0;
  std::vector<float> x, recon;
  std::vector<uint16_t> fresh;
  // A token leaves the raw tail once `window` newer tokens follow it (and,
  // with whole_blocks, a whole block of such tokens is there), into the
  // newest block: its codes are appended to the block's payload, so no
  // coded token is coded again.
  //
  // The refinement groups that this call would code and then drop (all
  // their tokens older than the `refine` newest coded tokens once the call
  // is done: the whole of a long prefill but its end) are skipped: they are
  // created and aged as before, with no codes. The kept groups are coded
  // exactly as one-token appends code them (CalibratedAppend tests).
  const int64_t open_held =
      !key_.blocks.empty() && key_.blocks.back().tokens < options_.block ? key_.blocks.back().tokens : 0;
  int64_t coded_at_end = encoded_tokens();
  for (int64_t held = open_held, m; (m = next_step_tokens(coded_at_end, held)) > 0;) {
    coded_at_end += m;
    held = held + m == options_.block ? 0 : held + m;
  }
  // Settles the raw tails once after the loop, and on a throw, so that they
  // always match encoded_: the tokens this call coded from them are cut
  // (cutting each step's tokens moved the whole tail per block, quadratic
  // in a long prefill's length), then the input's tokens that stay raw
  // (sinks, and those past the coded ones) are written (room reserved by
  // append: no allocation, so no throw).
  const int64_t sinks_held = input ? std::min<int64_t>(options_.sinks, input->first) : sink_tokens();
  struct Tails {
    CalibratedKvtcCache& cache;
    const NewTokens* input;
    int64_t sinks_held;
    int64_t tail_held;  // raw tokens past the sinks before the call
    int64_t n = 0;      // tokens coded by this call
    bool settled = false;
    void settle() {
      if (settled) return;
      settled = true;
      const int64_t V = cache.vdim(), cut = std::min(n, tail_held);
      for (Stream* stream : {&cache.key_, &cache.value_})
        for (auto& raw : stream->raw)
          raw.erase(raw.begin() + sinks_held * V, raw.begin() + (sinks_held + cut) * V);
      if (!input) return;
      const int64_t sinks = cache.options_.sinks, end = input->first + input->tokens;
      cache.input_to_raw(*input, input->first, std::min(end, sinks));
      cache.input_to_raw(*input, std::max(input->first, sinks + cache.encoded_), end);
    }
    ~Tails() { settle(); }
  } taken{*this, input, sinks_held, int64_t(key_.raw.empty() ? 0 : key_.raw[0].size() / size_t(V)) - sinks_held};
  for (;;) {
    const bool grow = !key_.blocks.empty() && key_.blocks.back().tokens < options_.block;
    const int64_t held = grow ? key_.blocks.back().tokens : 0;
    const int64_t m = next_step_tokens(encoded_tokens(), held);
    if (m == 0) break;
    const int64_t sinks = sink_tokens();
    const int64_t first_position = sinks + encoded_tokens();
    for (Stream* stream : {&key_, &value_}) {
      const bool is_key = stream == &key_;
      const kvtc::HeadParams& p = params(is_key);
      const size_t K = size_t(p.n_kept());
      const bool block_closes = held + m == options_.block;
      // An open payload grows by appends (its vector doubling): room for
      // what the previous one of its kind holds keeps it near its size.
      const auto open_payloads = [&](std::vector<std::vector<uint8_t>>& payload, const Block* previous) {
        payload.resize(size_t(batch_));
        for (int64_t b = 0; previous && b < batch_; ++b)
          payload[size_t(b)].reserve(previous->payload[size_t(b)].size() + 64);
      };
      if (!grow) {
        grow_by_eighths(stream->blocks, stream->blocks.size() + 1);
        stream->blocks.emplace_back();
        open_payloads(stream->blocks.back().payload,
                      block_closes || stream->blocks.size() < 2 ? nullptr : &stream->blocks[stream->blocks.size() - 2]);
      }
      // The refinement groups this step fills: one per kRefineGroup-th token
      // of the block (the first continues the newest group where that one
      // is partial and reaches the newest coded token).
      struct Piece {
        RefineGroup* group;
        int64_t tokens;  // of this step that the group takes
        bool closes;     // the group is whole after them
        bool dropped;    // aged out by the end of this call: not coded
      };
      std::vector<Piece> pieces;
      for (int64_t at = held; refining && at < held + m;) {
        const bool continues = at % kRefineGroup != 0 && !stream->refine.empty() &&
                               stream->refine.back().first + stream->refine.back().codes.tokens == encoded_tokens() + (at - held);
        if (!continues) {
          const Block* previous = stream->refine.empty() ? nullptr : &stream->refine.back().codes;
          stream->refine.emplace_back();  // a deque: references to older groups stay valid
          stream->refine.back().first = encoded_tokens() + (at - held);
          open_payloads(stream->refine.back().codes.payload, previous);
        }
        const int64_t n = std::min(kRefineGroup - at % kRefineGroup, held + m - at);
        const bool closes = (at + n) % kRefineGroup == 0 || block_closes;
        const int64_t group_end = encoded_tokens() + (at - held) + n;  // coded-token index past the piece
        const bool dropped = closes && group_end <= coded_at_end - options_.refine;
        pieces.push_back({&stream->refine.back(), n, closes, dropped});
        at += n;
      }
      const bool any_kept = std::any_of(pieces.begin(), pieces.end(), [](const Piece& q) { return !q.dropped; });
      Block& blk = stream->blocks.back();
      x.resize(size_t(m * V));
      for (int64_t b = 0; b < batch_; ++b) {
        gather_rows(is_key, b, first_position, m, sinks_held + taken.n, input, x.data());
        if (is_key) rope_->rotate(x.data(), m, V, config_.n_kv_heads, first_position, /*inverse=*/true);
        fresh.resize(size_t(m) * K);
        if (refining && any_kept) {
          // x (weighted) is kept for the residual below.
          if (const float* w = scale(is_key)) update_rows(x.data(), nullptr, w, m, V);
          kvtc::quantize_block_path(p, x.data(), m, fresh.data(), projection(p));
        } else {
          // Weighted and centred in one pass, in place.
          update_rows(x.data(), nullptr, scale(is_key), m, V, p.mean.data());
          kvtc::quantize_centred_block(p, x.data(), m, fresh.data(), projection(p));
        }
        coded_symbols_ += cache_impl::grow_block_payload(p, blk.payload[size_t(b)], held, fresh.data(), m, block_closes);
        if (refining && any_kept) {
          // The residual after the base reconstruction the reader will see.
          recon.resize(x.size());
          kvtc::dequantize_block(p, fresh.data(), m, recon.data());
          for (size_t i = 0; i < x.size(); ++i) x[i] -= recon[i];
          int64_t at = 0;
          for (const Piece& piece : pieces) {
            if (!piece.dropped)
              append_refinement(*piece.group, is_key, b, x.data() + at * V, piece.tokens, piece.closes);
            at += piece.tokens;
          }
        }
      }
      // A payload grows by appends, so its vector holds up to twice its
      // bytes; once the block (or group) is whole it is coded again and
      // held at its size (resident_bytes counts capacity).
      const auto settle = [](Block& codes, int64_t added, bool closes) {
        codes.tokens += added;
        codes.open = !closes;
        if (closes)
          for (auto& p : codes.payload) p.shrink_to_fit();
      };
      settle(blk, m, block_closes);
      for (const Piece& piece : pieces) settle(piece.group->codes, piece.tokens, piece.closes);
    }
    encoded_ += m;
    taken.n += m;
    drop_aged_refinement();
  }
  taken.settle();
  // The tail now holds the sinks and the window (and, with whole_blocks, up
  // to a block more): held within an eighth of what it regrows to, not the
  // 2x slack of the loop's shrink (with the shipped settings the raw vectors
  // were 5x their 12 tokens: a third of the cache's resident bytes).
  const size_t regrows = size_t(options_.sinks + options_.window + (options_.whole_blocks ? options_.block : 1)) *
                         size_t(V);
  for (Stream* stream : {&key_, &value_})
    for (auto& raw : stream->raw) {
      const size_t need = std::max(raw.size(), std::min(regrows, raw.size() + size_t(V)));
      if (raw.capacity() > need + need / 8 + size_t(V)) {
        std::vector<uint16_t> exact;
        exact.reserve(need + need / 8);
        exact.assign(raw.begin(), raw.end());
        raw.swap(exact);
      }
    }
}

// Appends m tokens' refinement codes of residual [m, V] to batch row b of
// group g (whose token count the caller advances after every row).
void CalibratedKvtcCache::append_refinement(RefineGroup& g, bool is_key, int64_t b, const float* residual,
                                            int64_t m, bool closes) {
  const kvtc::HeadParams& rp = refine_params(is_key);
  std::vector<uint16_t> codes(size_t(m) * size_t(rp.n_kept()));
  kvtc::quantize_block_path(rp, residual, m, codes.data(), projection(rp));
  coded_symbols_ +=
      cache_impl::grow_block_payload(rp, g.codes.payload[size_t(b)], g.codes.tokens, codes.data(), m, closes);
}

// Drops the refinement groups all of whose tokens are older than the
// `refine` newest coded tokens.
void CalibratedKvtcCache::drop_aged_refinement() {
  for (Stream* s : {&key_, &value_})
    while (!s->refine.empty() && s->refine.front().first + s->refine.front().codes.tokens <=
                                     encoded_tokens() - options_.refine)
      s->refine.pop_front();
}

// Decodes batch row b of a block into out [n, H*D] (keys post-RoPE again),
// refinement codes added where its tokens have them.
void CalibratedKvtcCache::decode(bool is_key, const Block& blk, int64_t first_coded, int64_t b, float* out) const {
  const auto& p = blk.payload[size_t(b)];
  cache_impl::decode_block_payload(params(is_key), p.data(), p.size(), blk.tokens, blk.open, out);
  finish_decode(is_key, blk, first_coded, b, out);
}

void CalibratedKvtcCache::decode_run(bool is_key, const Block* blocks, size_t count, int64_t first_coded, int64_t b,
                                     float* out) const {
  // The leading closed blocks of one length decode together
  // (kvtc::decode_blocks: their rANS streams, of one tensor's parameters
  // and about the same length, stay in lockstep to their ends; keys and
  // values may keep very different numbers of components, so they are not
  // mixed); the rest (the open block, the only one that may be partial)
  // one by one.
  size_t together = 0;
  while (together < count && !blocks[together].open && blocks[together].tokens == blocks[0].tokens) ++together;
  if (together < 2) together = 0;  // one block alone: decode() below
  if (together > 0) {
    const kvtc::HeadParams& p = params(is_key);
    const int64_t n = blocks[0].tokens;
    kvtc::BlockDecode jobs[kvtc::kMaxBlocksTogether];
    for (size_t j = 0; j < together; ++j) {
      const auto& payload = blocks[j].payload[size_t(b)];
      jobs[j] = {&p, payload.data(), payload.size(), out + int64_t(j) * n * vdim()};
    }
    kvtc::decode_blocks(jobs, together, n);
    for (size_t j = 0; j < together; ++j) finish_decode(is_key, blocks[j], first_coded + int64_t(j) * n, b, jobs[j].out);
    first_coded += int64_t(together) * n;
    out += int64_t(together) * n * vdim();
  }
  for (size_t j = together; j < count; ++j) {
    decode(is_key, blocks[j], first_coded, b, out);
    first_coded += blocks[j].tokens;
    out += blocks[j].tokens * vdim();
  }
}

void CalibratedKvtcCache::finish_decode(bool is_key, const Block& blk, int64_t first_coded, int64_t b,
                                        float* out) const {
  const Stream& stream = is_key ? key_ : value_;
  if (!stream.refine.empty() && stream.refine.back().first + stream.refine.back().codes.tokens > first_coded) {
    // Groups lie inside one block: those starting in this block's range.
    // Two closed ones of one length (a whole block's two) decode as one
    // interleaved rANS pair, as blocks do.
    const kvtc::HeadParams& rp = refine_params(is_key);
    std::vector<const RefineGroup*> groups;
    for (const RefineGroup& g : stream.refine)
      if (g.first >= first_coded && g.first < first_coded + blk.tokens) groups.push_back(&g);
    std::vector<float> fine, fine2;
    for (size_t i = 0; i < groups.size(); ++i) {
      const RefineGroup& g = *groups[i];
      const auto& gp = g.codes.payload[size_t(b)];
      fine.resize(size_t(g.codes.tokens * vdim()));
      const RefineGroup* h = i + 1 < groups.size() ? groups[i + 1] : nullptr;
      if (h && !g.codes.open && !h->codes.open && h->codes.tokens == g.codes.tokens) {
        const auto& hp = h->codes.payload[size_t(b)];
        fine2.resize(fine.size());
        kvtc::decode_block_pair(rp, gp.data(), gp.size(), fine.data(), rp, hp.data(), hp.size(), fine2.data(),
                                g.codes.tokens);
        update_rows(out + (h->first - first_coded) * vdim(), fine2.data(), nullptr, h->codes.tokens, vdim());
        ++i;
      } else {
        cache_impl::decode_block_payload(rp, gp.data(), gp.size(), g.codes.tokens, g.codes.open, fine.data());
      }
      update_rows(out + (g.first - first_coded) * vdim(), fine.data(), nullptr, g.codes.tokens, vdim());
    }
  }
  if (const float* w = scale(is_key)) {
    // 1 / scale per call (the same floats a per-cache copy held: 1 KB per
    // layer and sequence, where a block's decode is 64 x V products).
    std::vector<float> inverse(static_cast<size_t>(vdim()));
    for (int64_t d = 0; d < vdim(); ++d) inverse[size_t(d)] = 1.0f / w[d];
    update_rows(out, nullptr, inverse.data(), blk.tokens, vdim());
  }
  if (is_key)
    rope_->rotate(out, blk.tokens, vdim(), config_.n_kv_heads, sink_tokens() + first_coded, /*inverse=*/false);
}

// Blocks are visited as token-major views ([B][n][H][D] memory with strides
// {n*H*D, D, H*D, 1} for [B, H, n, D]): decode_block's output order, so the
// decoded values go straight to the visitor with no scatter. Up to
// kVisitBlocks blocks are decoded per visit (with options_.threads threads),
// which bounds the scratch to 512 tokens per tensor at the default block.
void CalibratedKvtcCache::for_each_block(const BlockVisitor& visit) const {
  if (offset_ == 0) return;
  constexpr int64_t kVisitBlocks = 8;
  const int64_t H = config_.n_kv_heads, D = config_.head_dim, V = vdim();
  auto view = [&](const float* data, int64_t n) {
    TensorView t;
    t.data = data;
    t.dtype = DType::kF32;
    t.shape = {batch_, H, n, D};
    t.strides = {n * V, D, V, 1};
    return t;
  };
  // Scratch of this call (up to kVisitBlocks decoded blocks, token-major),
  // not a member: for_each_block is const and may run on several threads
  // at once (kvcodec/cache.hpp), so it must not write shared state.
  std::vector<float> key_scratch, value_scratch;
  auto scratch = [&](int64_t tokens) {
    const size_t need = size_t(batch_ * tokens * V);
    if (key_scratch.size() < need) key_scratch.resize(need);
    if (value_scratch.size() < need) value_scratch.resize(need);
  };
  auto emit_raw = [&](int64_t raw_first, int64_t count, int64_t first_token) {
    if (count <= 0) return;
    scratch(count);
    for (int64_t b = 0; b < batch_; ++b) {
      kvtc::raw_to_f32(key_.raw[size_t(b)].data() + size_t(raw_first * V), raw_dtype_,
                       key_scratch.data() + b * count * V, size_t(count * V));
      kvtc::raw_to_f32(value_.raw[size_t(b)].data() + size_t(raw_first * V), raw_dtype_,
                       value_scratch.data() + b * count * V, size_t(count * V));
    }
    visit(first_token, view(key_scratch.data(), count), view(value_scratch.data(), count));
  };
  const int64_t sinks = sink_tokens();
  emit_raw(0, sinks, 0);
  const int64_t n = options_.block;
  const int64_t n_blocks = int64_t(key_.blocks.size());
  for (int64_t j0 = 0; j0 < n_blocks; j0 += kVisitBlocks) {
    const int64_t m = std::min(kVisitBlocks, n_blocks - j0);
    // Only the newest block may be partial, so block j of the group starts
    // at token j * n of it.
    const int64_t tokens = (m - 1) * n + key_.blocks[size_t(j0 + m - 1)].tokens;
    scratch(tokens);
    // One task per (run of up to four blocks, batch row, tensor).
    // decode_block throws on bad bytes; an exception must not leave an
    // OpenMP region, so it is carried out.
    constexpr int64_t kRun = int64_t(kvtc::kMaxBlocksTogether);
    const int64_t runs = (m + kRun - 1) / kRun, tasks = runs * batch_ * 2;
    FirstException failure;
#pragma omp parallel for num_threads(options_.threads) schedule(dynamic, 1) if (options_.threads > 1 && tasks > 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const bool is_key = t % 2 == 0;
      const int64_t j = kRun * (t / 2 / batch_), b = t / 2 % batch_;
      const Stream& stream = is_key ? key_ : value_;
      float* out = (is_key ? key_scratch : value_scratch).data() + (b * tokens + j * n) * V;
      failure.capture([&] {
        decode_run(is_key, stream.blocks.data() + (j0 + j), size_t(std::min(kRun, m - j)), (j0 + j) * n, b, out);
      });
    }
    failure.rethrow();
    visit(sinks + j0 * n, view(key_scratch.data(), tokens), view(value_scratch.data(), tokens));
  }
  emit_raw(sinks, raw_tokens() - sinks, sinks + encoded_tokens());
}

void CalibratedKvtcCache::cut_raw(int64_t count) {
  for (Stream* s : {&key_, &value_})
    for (auto& raw : s->raw) raw.resize(raw.size() - size_t(count * vdim()));
  offset_ -= count;
}

void CalibratedKvtcCache::uncode_newest_block() {
  const int64_t V = vdim();
  const int64_t bn = key_.blocks.back().tokens;
  const int64_t first = encoded_tokens() - bn;  // coded-token index
  std::vector<float> x(size_t(bn * V));
  std::vector<uint16_t> row(size_t(bn * V));
  for (Stream* s : {&key_, &value_}) {
    for (int64_t b = 0; b < batch_; ++b) {
      decode(s == &key_, s->blocks.back(), first, b, x.data());
      convert(x.data(), DType::kF32, row.data(), raw_dtype_, row.size());
      auto& raw = s->raw[size_t(b)];
      raw.insert(raw.end(), row.begin(), row.end());
    }
    s->blocks.pop_back();
  }
  encoded_ -= bn;
  // The block's refinement groups went with it (they never cross blocks).
  for (Stream* s : {&key_, &value_})
    while (!s->refine.empty() && s->refine.back().first >= encoded_) s->refine.pop_back();
}

cache_impl::KvtcCacheBase::TensorBytes CalibratedKvtcCache::tensor_bytes(bool is_key) const {
  const Stream& s = is_key ? key_ : value_;
  uint64_t bits_per_token = 0;
  for (uint8_t w : params(is_key).fixed_widths) bits_per_token += w;
  TensorBytes b;  // no per-sequence side information
  for (const auto& blk : s.blocks) {
    b.payload += blk.serialized_size();
    b.pre_entropy += blk.payload.size() * ((bits_per_token * uint64_t(blk.tokens) + 7) / 8);
  }
  for (const auto& g : s.refine)
    b.refine += varint_size(uint64_t(g.first)) + varint_size(uint64_t(g.codes.tokens)) + g.codes.serialized_size();
  for (const auto& r : s.raw) b.raw += r.size() * 2;
  return b;
}

void CalibratedKvtcCache::add_mode_stats(CacheStats& st) const {
  for (const Stream* s : {&key_, &value_}) {
    const bool is_key = s == &key_;
    const std::string prefix = is_key ? "key." : "value.";
    const kvtc::HeadParams& p = params(is_key);
    st.extras[prefix + "refine_bytes"] = double(tensor_bytes(is_key).refine);
    st.extras[prefix + "refined_tokens"] = s->refine.empty() ? 0.0 : double(encoded_ - s->refine.front().first);
    st.extras[prefix + "n_survived.0"] = double(p.n_kept());
    // This layer's share of the shared calibration file: not per sequence,
    // so not in compressed_*_bytes (summed over layers it is the whole file's
    // parameters).
    st.extras[prefix + "calibration_bytes"] = double(p.serialized_size());
    st.resident_bytes += kvcodec::held_bytes(s->raw) + uint64_t(s->blocks.capacity()) * sizeof(Block);
    for (const auto& blk : s->blocks) st.resident_bytes += kvcodec::held_bytes(blk.payload);
    for (const auto& g : s->refine) st.resident_bytes += sizeof(RefineGroup) + kvcodec::held_bytes(g.codes.payload);
  }
  // The calibration and the RoPE table are held once for every cache using
  // them (shared); the cache keeps no scratch between calls.
  st.resident_bytes += sizeof(*this);
  st.shared["kvtc calibration " + options_.calibration + " @" + address_text(calibration_.get())] =
      calibration_->held_bytes();
  if (rope_) st.shared["rope table @" + address_text(rope_.get())] = rope_->held_bytes();
  uint64_t key_bits = 0;
  for (uint8_t w : params(true).fixed_widths) key_bits += w;
  st.extras["bit_budget"] = double(key_bits);  // fixed-width bits per token of the layer's key vector
}

// --- persistence ---------------------------------------------------------------
//
// Sections: "state" (u64 batch, u64 offset, u8 raw dtype, u64 block count,
// u64 tokens of the newest block; files without the last field hold whole
// blocks only), then for K and V
// "<t>.blocks" (per block, per batch row: varint length + payload) and
// "<t>.raw" (per batch row, raw tokens as 16-bit words). The calibration is
// referenced by path in the settings and identified by its parameters' hash,
// checked at load.

std::string params_hash(const KvtcCalibration& c, int layer) {
  ByteWriter w;
  c.keys[size_t(layer)].serialize(w);
  c.values[size_t(layer)].serialize(w);
  if (c.weighted()) {
    w.f32s(c.key_scale[size_t(layer)].data(), c.key_scale[size_t(layer)].size());
    w.f32s(c.value_scale[size_t(layer)].data(), c.value_scale[size_t(layer)].size());
  }
  if (c.refined()) {
    c.key_refine[size_t(layer)].serialize(w);
    c.value_refine[size_t(layer)].serialize(w);
  }
  return hash_hex(w.data().data(), w.size());
}

void CalibratedKvtcCache::write_sections(ContainerWriter& w) const {
  w.set_meta("calibration.params_hash", params_hash(*calibration_, config_.layer));
  ByteWriter state;
  state.u64(uint64_t(batch_));
  state.u64(uint64_t(offset_));
  state.u8(uint8_t(raw_dtype_));
  state.u64(uint64_t(key_.blocks.size()));
  // Tokens of the newest block (< block when partial). Files written before
  // partial blocks existed end the state here (every block full).
  state.u64(uint64_t(key_.blocks.empty() ? 0 : key_.blocks.back().tokens));
  w.add_section("state", state.take());
  for (const Stream* s : {&key_, &value_}) {
    const std::string prefix = s == &key_ ? "key." : "value.";
    std::vector<uint8_t> blocks;
    for (const auto& blk : s->blocks) cache_impl::append_block_payloads(blocks, blk.payload);
    w.add_section(prefix + "blocks", std::move(blocks));
    if (!s->refine.empty()) {
      // Refinement groups: varint count, then per group varint first coded
      // token, varint tokens, per batch row varint length + payload.
      std::vector<uint8_t> refine;
      append_varint(refine, s->refine.size());
      for (const auto& g : s->refine) {
        append_varint(refine, uint64_t(g.first));
        append_varint(refine, uint64_t(g.codes.tokens));
        for (const auto& p : g.codes.payload) {
          append_varint(refine, p.size());
          refine.insert(refine.end(), p.begin(), p.end());
        }
      }
      w.add_section(prefix + "refine", std::move(refine));
    }
    ByteWriter raw;
    for (const auto& r : s->raw) raw.u16s(r.data(), r.size());
    w.add_section(prefix + "raw", raw.take());
  }
}

void CalibratedKvtcCache::load(const uint8_t* data, size_t size) {
  const std::string who = "kvtc calibrated load";
  const ContainerReader r = ContainerReader::parse(data, size, {}, "saved kvtc cache");
  const int layout_version = check_saved_kvtc_meta(
      r, /*calibrated=*/true, kLayoutVersion,
      {{"config.layer", config_.layer}, {"config.n_kv_heads", config_.n_kv_heads}, {"config.head_dim", config_.head_dim}},
      config_, options_, who);
  if (r.meta_or_throw("calibration.params_hash") != params_hash(*calibration_, config_.layer))
    throw Error(ErrorCode::kFormat, "kvtc calibrated: the saved cache was written with other calibration "
                                    "parameters than those of " + options_.calibration);
  ByteReader state(r.section("state"), "kvtc state");
  const uint64_t batch = state.u64();
  const uint64_t offset = state.u64();
  const uint8_t dtype = state.u8();
  const uint64_t n_blocks = state.u64();
  const uint64_t last_tokens = state.at_end() ? (n_blocks ? uint64_t(options_.block) : 0) : state.u64();
  if (!state.at_end()) throw Error(ErrorCode::kFormat, "kvtc calibrated: trailing bytes in state");
  if (dtype != uint8_t(DType::kF16) && dtype != uint8_t(DType::kBF16))
    throw Error(ErrorCode::kFormat, "kvtc calibrated: raw dtype id " + std::to_string(dtype) + " is not f16/bf16");
  const int64_t V = vdim();
  // Bounds before anything is sized by them: every raw token costs 2*V bytes
  // per batch row and every block at least one byte per row.
  const uint64_t block = uint64_t(options_.block);
  if (batch > (uint64_t(1) << 20) || (offset == 0 && batch != 0) || (n_blocks == 0) != (last_tokens == 0) ||
      last_tokens > block)
    throw Error(ErrorCode::kFormat, "kvtc calibrated: inconsistent state (batch " + std::to_string(batch) +
                                        ", offset " + std::to_string(offset) + ", blocks " +
                                        std::to_string(n_blocks) + ", newest block " +
                                        std::to_string(last_tokens) + " tokens, block size " +
                                        std::to_string(block) + ")");
  cache_impl::CodedLayout layout;
  layout.rows = batch;
  layout.token_words = uint64_t(V);
  layout.block = block;
  layout.sinks = std::min<uint64_t>(uint64_t(options_.sinks), offset);
  layout.offset = offset;
  layout.n_blocks = n_blocks;
  layout.encoded = n_blocks ? cache_impl::checked_mul(n_blocks - 1, block, "kvtc coded tokens") + last_tokens : 0;
  cache_impl::check_coded_layout(layout, who);
  const int64_t encoded = int64_t(layout.encoded);
  CalibratedKvtcCache fresh(*this);
  fresh.reset();
  fresh.batch_ = int64_t(batch);
  fresh.offset_ = int64_t(offset);
  fresh.encoded_ = encoded;
  fresh.raw_dtype_ = DType(dtype);
  for (Stream* s : {&fresh.key_, &fresh.value_}) {
    const std::string prefix = s == &fresh.key_ ? "key." : "value.";
    s->raw = cache_impl::read_raw_rows(r.section(prefix + "raw"), batch,
                                       cache_impl::checked_mul(layout.raw_tokens(), layout.token_words, "kvtc raw"),
                                       "kvtc " + prefix + "raw");
    auto payloads = cache_impl::read_block_payloads(r.section(prefix + "blocks"), n_blocks, batch,
                                                    "kvtc " + prefix + "blocks");
    s->blocks.reserve(payloads.size());  // exact: a loaded cache holds no growth slack
    for (uint64_t j = 0; j < n_blocks; ++j)
      s->blocks.push_back(Block{j + 1 == n_blocks ? int64_t(last_tokens) : options_.block, false, std::move(payloads[j])});
    if (r.has(prefix + "refine")) {
      if (!calibration_->refined())
        throw Error(ErrorCode::kFormat, "kvtc calibrated: the saved cache holds refinement codes but " +
                                            options_.calibration + " has no refinement parameters");
      ByteReader in(r.section(prefix + "refine"), "kvtc " + prefix + "refine");
      const uint64_t groups = in.varint();
      if (groups > uint64_t(encoded) || groups * batch > r.section(prefix + "refine").size())
        throw Error(ErrorCode::kFormat, "kvtc calibrated: " + prefix + "refine claims " + std::to_string(groups) +
                                            " groups for " + std::to_string(encoded) + " coded tokens");
      for (uint64_t i = 0; i < groups; ++i) {
        RefineGroup g;
        const uint64_t first = in.varint(), tokens = in.varint();
        // Contiguous up to the newest coded token, each inside one block.
        const uint64_t want_first = s->refine.empty() ? first : uint64_t(s->refine.back().first + s->refine.back().codes.tokens);
        if (tokens < 1 || tokens > uint64_t(kRefineGroup) || first != want_first || first >= uint64_t(encoded) ||
            first + tokens > uint64_t(encoded) ||
            first / block != (first + tokens - 1) / block)
          throw Error(ErrorCode::kFormat, "kvtc calibrated: " + prefix + "refine group " + std::to_string(i) +
                                              " (first " + std::to_string(first) + ", " + std::to_string(tokens) +
                                              " tokens) is out of place for " + std::to_string(encoded) +
                                              " coded tokens in blocks of " + std::to_string(block));
        g.first = int64_t(first);
        g.codes.tokens = int64_t(tokens);
        for (uint64_t b = 0; b < batch; ++b) {
          const uint64_t len = in.varint();
          const auto bytes = in.bytes(size_t(len));
          g.codes.payload.emplace_back(bytes.begin(), bytes.end());
        }
        s->refine.push_back(std::move(g));
      }
      if (!in.at_end()) throw Error(ErrorCode::kFormat, "kvtc calibrated: trailing bytes in " + prefix + "refine");
      if (!s->refine.empty() && s->refine.back().first + s->refine.back().codes.tokens != encoded)
        throw Error(ErrorCode::kFormat, "kvtc calibrated: " + prefix + "refine does not end at the newest coded token");
    }
  }
  // Sized only now: offset is bounded by the bytes that hold its tokens.
  fresh.cover_positions(int64_t(offset));
  // Open (still filling): a partial newest block, and a partial group in
  // it. Layout 1 held the codec's forward bytes for those too: the same
  // codes, stacked now.
  for (Stream* s : {&fresh.key_, &fresh.value_}) {
    const bool is_key = s == &fresh.key_;
    if (s->blocks.empty() || s->blocks.back().tokens == options_.block) continue;
    Block& newest = s->blocks.back();
    newest.open = true;
    const int64_t newest_first = encoded - newest.tokens;
    for (auto& g : s->refine) g.codes.open = g.first >= newest_first && g.codes.tokens < kRefineGroup;
    if (layout_version > 1) continue;
    for (auto& p : newest.payload) p = cache_impl::open_payload_from_layout1(fresh.params(is_key), p, newest.tokens);
    for (auto& g : s->refine)
      if (g.codes.open)
        for (auto& p : g.codes.payload)
          p = cache_impl::open_payload_from_layout1(fresh.refine_params(is_key), p, g.codes.tokens);
  }
  // Every payload must decode: a corrupted block is refused now, not at fetch.
  std::vector<float> x(size_t(options_.block * V));
  for (const Stream* s : {&fresh.key_, &fresh.value_}) {
    for (const auto& blk : s->blocks)
      for (const auto& p : blk.payload)
        cache_impl::decode_block_payload(fresh.params(s == &fresh.key_), p.data(), p.size(), blk.tokens, blk.open,
                                         x.data());
    for (const auto& g : s->refine)
      for (const auto& p : g.codes.payload)
        cache_impl::decode_block_payload(fresh.refine_params(s == &fresh.key_), p.data(), p.size(), g.codes.tokens,
                                         g.codes.open, x.data());
  }
  if (fresh.key_.refine.size() != fresh.value_.refine.size() ||
      (!fresh.key_.refine.empty() && fresh.key_.refine.front().first != fresh.value_.refine.front().first))
    throw Error(ErrorCode::kFormat, "kvtc calibrated: key and value refinement groups differ");
  *this = std::move(fresh);
}

}  // namespace

std::unique_ptr<KVCache> make_kvtc_calibrated_cache(const CacheConfig& config, const Settings& settings,
                                                    const KvtcSettings& options) {
  return std::make_unique<CalibratedKvtcCache>(config, settings, options);
}

}  // namespace kvcodec

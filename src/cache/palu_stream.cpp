// PALU stream (DESIGN 5): low-rank latents per head group, mixed-bit quantized.
//
// Before the fit, tokens are raw (counted). The first append that brings at
// least min_fit_tokens tokens fits one projection per head group from every
// token held (all batches), freezes it, and moves those tokens into latents;
// later tokens are projected on arrival. Latents wait as f16 in a per-group
// tail until group_size tokens are there, then the token group is quantized
// (asymmetric per channel, hi/lo widths) and never touched again.
//
// Layout of a head group's latents, token-major [t, rows, rank]:
//   shared: rows = B * g (one row per batch and head), the projection maps D;
//   joint:  rows = B, the projection maps the g heads concatenated (g * D).
//
// Calibrated mode (PaluOptions::calibration): the projections come from the
// shared calibration at start() (palu::calibrated_projection), so nothing is
// fitted or stored per sequence; the first `sinks` tokens stay raw (counted),
// and keys are projected with RoPE removed and get it back when decoded.
//
// Stored, in order: u8 mode (0: not fitted yet, 1: fitted per sequence, 2:
// calibrated); 0: the raw tokens; 1: per head group its projection (dims,
// widths, f16 basis), its quantized token groups and its f16 tail; 2: the
// raw sinks, then per head group its token groups and tail. The number of
// token groups is latent tokens / group_size (quantize=true) or 0
// (quantize=false: every latent stays f16).
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "cache/streams.hpp"
#include "cache/kvtc_calibrated.hpp"
#include "core/held_bytes.hpp"
#include "palu/group_quant.hpp"

namespace kvcodec::cache_impl {
namespace {

class PaluStream final : public TokenStream {
 public:
  explicit PaluStream(const PaluOptions& opt) : opt_(opt) {}
  std::unique_ptr<TokenStream> empty_twin() const override { return std::make_unique<PaluStream>(opt_); }

  void start(const StreamShape& s) override {
    shape_ = s;
    raw_.reset(s.rows(), s.dim, s.storage);
    fitted_ = false;
    blocks_ = 0;
    tail_tokens_ = 0;
    groups_.clear();
    for (auto [first, count] : palu::split_head_groups(int(s.heads), opt_.n_head_groups)) {
      Group g;
      g.first_head = first;
      g.n_heads = count;
      g.rows = opt_.joint ? s.batch : s.batch * count;
      g.dim = opt_.joint ? int(count * s.dim) : int(s.dim);
      groups_.push_back(std::move(g));
    }
    if (calibrated()) {
      const PaluCalibration& cal = *opt_.calibration;
      for (size_t i = 0; i < groups_.size(); ++i) {
        const palu::Eigenbasis& e = (opt_.is_key ? cal.keys : cal.values).at(size_t(opt_.layer)).at(i);
        palu::FitOptions fo = opt_.fit;
        fo.rank = std::min(fo.rank, e.dim);
        groups_[i].proj = palu::calibrated_projection(e, fo);
        groups_[i].blob_bytes = palu::latent_group_bytes(groups_[i].proj, groups_[i].rows, opt_.group_size);
      }
      fitted_ = true;
    }
  }

  void append(const float* x, int64_t n) override {
    if (!fitted_) {
      raw_.push_back(x, n);
      if (raw_.tokens() >= opt_.min_fit_tokens) fit();
      return;
    }
    int64_t k = 0;
    if (latent_tokens() == 0 && raw_.tokens() < opt_.sinks) {
      k = std::min(n, opt_.sinks - raw_.tokens());
      raw_.push_back(x, k);
    }
    if (k < n) encode_tokens(x + k * shape_.rows() * shape_.dim, n - k);
  }

  // Tokens [0, raw_.tokens()) are raw (all of them until the fit; the sinks
  // once calibrated), the rest latents.
  void decode(int64_t first, int64_t n, float* out) const override {
    const int64_t rows = shape_.rows(), dim = shape_.dim;
    const int64_t n_raw = std::clamp<int64_t>(raw_.tokens() - first, 0, n);
    if (n_raw > 0) {
      std::vector<float> buf(static_cast<size_t>(n_raw * rows * dim));
      raw_.read(first, n_raw, buf.data());
      scatter_tokens(buf.data(), n_raw, rows, dim, out, n, 0);
    }
    if (n_raw < n) decode_latents(first + n_raw - raw_.tokens(), n - n_raw, out, n, n_raw);
  }

  void trim_to(int64_t total) override {
    if (!fitted_ || total <= raw_.tokens()) {
      raw_.truncate(total);
      clear_latents();
      return;
    }
    total -= raw_.tokens();
    // A cut inside a quantized token group returns that group's latents to
    // the f16 tail (their dequantized values), keeping groups aligned to 0.
    std::vector<float> lat;
    while (total < blocks_ * opt_.group_size) {
      --blocks_;
      for (Group& g : groups_) {
        const int64_t lat_tok = g.rows * g.proj.rank;
        lat.resize(size_t(opt_.group_size * lat_tok));
        palu::decode_latent_group(g.proj, g.blobs.data() + size_t(blocks_) * g.blob_bytes, g.blob_bytes, g.rows,
                                  opt_.group_size, lat.data());
        std::vector<uint16_t> head(lat.size());
        for (size_t i = 0; i < lat.size(); ++i) head[i] = detail::f16_saturate(lat[i]);
        g.tail.insert(g.tail.begin(), head.begin(), head.end());
        g.blobs.resize(size_t(blocks_) * g.blob_bytes);
      }
      tail_tokens_ += opt_.group_size;
    }
    const int64_t keep = std::min(tail_tokens_, total - blocks_ * opt_.group_size);
    for (Group& g : groups_) g.tail.resize(size_t(keep * g.rows * g.proj.rank));
    tail_tokens_ = keep;
  }

  int64_t tokens() const override { return raw_.tokens() + latent_tokens(); }

  uint64_t stored_bytes() const override {
    uint64_t n = 1 + raw_.bytes();
    if (!fitted_) return n;
    for (const Group& g : groups_)
      n += (calibrated() ? 0 : g.proj.serialized_size()) + g.blobs.size() + 2 * g.tail.size();
    return n;
  }

  uint64_t held_bytes() const override {
    uint64_t n = sizeof(*this) + raw_.held() + uint64_t(groups_.capacity()) * sizeof(Group);
    for (const Group& g : groups_)
      n += kvcodec::held_bytes(g.blobs) + kvcodec::held_bytes(g.tail) + kvcodec::held_bytes(g.proj.basis_f16) +
           kvcodec::held_bytes(g.proj.bits) + kvcodec::held_bytes(g.proj.basis) + kvcodec::held_bytes(g.proj.basis_t) +
           kvcodec::held_bytes(g.proj.channel_energy);
    return n;
  }

  void save(ByteWriter& w) const override {
    w.u8(calibrated() ? 2 : fitted_ ? 1 : 0);
    raw_.serialize(w);
    if (!fitted_) return;
    for (const Group& g : groups_) {
      if (!calibrated()) g.proj.serialize(w);
      w.bytes(g.blobs.data(), g.blobs.size());
      w.bytes(g.tail.data(), 2 * g.tail.size());
    }
  }

  void load(ByteReader& r, int64_t tokens) override {
    const uint8_t mode = r.u8();
    if (mode > 2) r.fail("PALU mode byte " + std::to_string(mode));
    if ((mode == 2) != calibrated())
      r.fail(mode == 2 ? "saved by a calibrated PALU cache, loaded without palu.calibration"
                       : "saved by a per-sequence PALU cache, loaded with palu.calibration");
    if (mode == 0) {
      raw_.deserialize(r, tokens);
      return;
    }
    const int64_t n_raw = calibrated() ? std::min(tokens, opt_.sinks) : 0;
    raw_.deserialize(r, n_raw);
    fitted_ = true;
    const int64_t latent = tokens - n_raw;
    blocks_ = opt_.quantize ? latent / opt_.group_size : 0;
    tail_tokens_ = latent - blocks_ * opt_.group_size;
    if (calibrated() && opt_.is_key) ensure_rope(tokens);
    for (Group& g : groups_) {
      if (!calibrated()) {
        g.proj = palu::Projection::deserialize(r, g.dim);
        g.blob_bytes = palu::latent_group_bytes(g.proj, g.rows, opt_.group_size);
      }
      const uint64_t nb = checked_mul(uint64_t(blocks_), g.blob_bytes, "PALU token groups");
      const auto p = r.bytes(size_t(nb));
      g.blobs.assign(p.begin(), p.end());
      const uint64_t nt = checked_mul(checked_mul(uint64_t(tail_tokens_), uint64_t(g.rows), "PALU tail"),
                                      uint64_t(g.proj.rank), "PALU tail");
      const auto q = r.bytes(size_t(checked_mul(nt, 2, "PALU tail")));
      g.tail.resize(size_t(nt));
      if (nt > 0) std::memcpy(g.tail.data(), q.data(), size_t(nt) * 2);  // an empty tail may have no storage (memcpy(null) is UB)
    }
  }

  void add_extras(const std::string& prefix, std::map<std::string, double>& e) const override {
    if (!fitted_) return;
    double proj = 0.0, bits = 0.0, channels = 0.0;
    for (size_t i = 0; i < groups_.size(); ++i) {
      const Group& g = groups_[i];
      proj += double(g.proj.serialized_size());
      e[prefix + "rank." + std::to_string(i)] = g.proj.rank;
      bits += (opt_.quantize ? g.proj.average_bits() : 16.0) * g.proj.rank * g.rows;
      channels += g.proj.rank * g.rows;
    }
    e[prefix + "projection_bytes"] = calibrated() ? 0.0 : proj;
    e[prefix + "assigned_avg_bits"] = channels > 0 ? bits / channels : 0.0;
    e[prefix + "raw_bytes"] = double(raw_.bytes());
    // This layer's share of the calibration file: per model, not per
    // sequence, so never in the stored bytes.
    if (calibrated()) e[prefix + "calibration_bytes"] = double(opt_.calibration->layer_bytes(opt_.layer, opt_.is_key));
  }

  std::vector<PaluGroupLayout> layouts() const {
    std::vector<PaluGroupLayout> out;
    if (!fitted_) return out;
    for (const Group& g : groups_) {
      PaluGroupLayout l;
      l.first_head = g.first_head;
      l.n_heads = g.n_heads;
      l.joint = opt_.joint;
      l.rows = g.rows;
      l.group_size = opt_.group_size;
      l.quantize = opt_.quantize;
      l.first_token = calibrated() ? opt_.sinks : 0;
      l.rope_removed = calibrated() && opt_.is_key;
      l.projection = g.proj;
      out.push_back(std::move(l));
    }
    return out;
  }

  void add_shared(std::map<std::string, uint64_t>& shared) const override {
    if (!calibrated()) return;
    char id[32];
    std::snprintf(id, sizeof id, "%p", static_cast<const void*>(opt_.calibration.get()));
    shared["palu calibration " + opt_.calibration_path + " @" + id] = opt_.calibration->held_bytes();
    if (rope_) {
      std::snprintf(id, sizeof id, "%p", static_cast<const void*>(rope_.get()));
      shared["rope table @" + std::string(id)] = rope_->held_bytes();
    }
  }

 private:
  struct Group {
    int first_head = 0, n_heads = 0;
    int64_t rows = 0;
    int dim = 0;
    palu::Projection proj;
    size_t blob_bytes = 0;
    std::vector<uint8_t> blobs;   // quantized token groups, blob_bytes each
    std::vector<uint16_t> tail;   // f16 latents [tail_tokens, rows, rank]
  };

  bool calibrated() const { return opt_.calibration != nullptr; }
  int64_t latent_tokens() const { return fitted_ ? blocks_ * opt_.group_size + tail_tokens_ : 0; }

  void ensure_rope(int64_t positions) {
    if (!rope_ || rope_->positions() < positions) rope_ = RopeTable::get(int(shape_.dim), opt_.rope_theta, positions);
  }

  void clear_latents() {
    blocks_ = tail_tokens_ = 0;
    for (Group& g : groups_) {
      g.blobs.clear();
      g.tail.clear();
    }
  }

  // Latent tokens [first, first + m) into out [R, total_n, D] at token `at`.
  void decode_latents(int64_t first, int64_t m, float* out, int64_t total_n, int64_t at) const {
    const int64_t q_tokens = blocks_ * opt_.group_size;
    std::vector<float> lat;
    for (const Group& g : groups_) {
      const int64_t lat_tok = g.rows * g.proj.rank;
      int64_t t = first;
      const int64_t end = first + m;
      while (t < end && t < q_tokens) {
        const int64_t b = t / opt_.group_size;
        lat.resize(size_t(opt_.group_size * lat_tok));
        palu::decode_latent_group(g.proj, g.blobs.data() + size_t(b) * g.blob_bytes, g.blob_bytes, g.rows,
                                  opt_.group_size, lat.data());
        const int64_t hi = std::min(end, (b + 1) * opt_.group_size);
        for (; t < hi; ++t)
          reconstruct(g, lat.data() + (t - b * opt_.group_size) * lat_tok, out, total_n, at + t - first);
      }
      std::vector<float> z(static_cast<size_t>(lat_tok));
      for (; t < end; ++t) {
        convert(g.tail.data() + size_t(t - q_tokens) * lat_tok, DType::kF16, z.data(), DType::kF32, size_t(lat_tok));
        reconstruct(g, z.data(), out, total_n, at + t - first);
      }
    }
    if (calibrated() && opt_.is_key) {
      // Keys were projected with RoPE removed: turn each row's run back.
      const int64_t D = shape_.dim;
      for (int64_t row = 0; row < shape_.rows(); ++row)
        rope_->rotate(out + (row * total_n + at) * D, m, D, 1, raw_.tokens() + first, /*inverse=*/false);
    }
  }

  // x [n, R, D] -> latents of each head group, appended to the tails.
  void encode_tokens(const float* x, int64_t n) {
    const int64_t H = shape_.heads, D = shape_.dim;
    std::vector<float> unrotated;
    if (calibrated() && opt_.is_key) {
      // Pre-RoPE keys, as the calibration was fitted (palu_calibration.hpp).
      const int64_t first_position = tokens();
      ensure_rope(first_position + n);
      unrotated.assign(x, x + n * shape_.rows() * D);
      rope_->rotate(unrotated.data(), n, shape_.rows() * D, int(shape_.rows()), first_position, /*inverse=*/true);
      x = unrotated.data();
    }
    std::vector<float> z;
    for (int64_t t = 0; t < n; ++t) {
      const float* tok = x + t * shape_.rows() * D;
      for (Group& g : groups_) {
        const int r = g.proj.rank;
        z.resize(size_t(g.rows * r));
        for (int64_t b = 0; b < shape_.batch; ++b) {
          if (opt_.joint) {
            // The group's heads of batch b are adjacent rows: one (g*D) vector.
            g.proj.project(tok + (b * H + g.first_head) * D, z.data() + b * r);
          } else {
            for (int h = 0; h < g.n_heads; ++h)
              g.proj.project(tok + (b * H + g.first_head + h) * D, z.data() + (b * g.n_heads + h) * r);
          }
        }
        // Saturating: a bf16 outlier's latent beyond 65504 is clipped, never Inf.
        for (float v : z) g.tail.push_back(detail::f16_saturate(v));
      }
      ++tail_tokens_;
      if (opt_.quantize && tail_tokens_ == opt_.group_size) flush_group();
    }
  }

  void flush_group() {
    std::vector<float> lat;
    for (Group& g : groups_) {
      lat.resize(g.tail.size());
      convert(g.tail.data(), DType::kF16, lat.data(), DType::kF32, lat.size());
      palu::encode_latent_group(g.proj, lat.data(), g.rows, opt_.group_size, g.blobs);
      g.tail.clear();
    }
    ++blocks_;
    tail_tokens_ = 0;
  }

  void reconstruct(const Group& g, const float* z, float* out, int64_t n, int64_t at) const {
    const int64_t H = shape_.heads, D = shape_.dim;
    const int r = g.proj.rank;
    std::vector<float> x(static_cast<size_t>(g.dim));
    for (int64_t b = 0; b < shape_.batch; ++b) {
      if (opt_.joint) {
        g.proj.reconstruct(z + b * r, x.data());
        for (int h = 0; h < g.n_heads; ++h)
          std::memcpy(out + ((b * H + g.first_head + h) * n + at) * D, x.data() + h * D, size_t(D) * sizeof(float));
      } else {
        for (int h = 0; h < g.n_heads; ++h)
          g.proj.reconstruct(z + (b * g.n_heads + h) * r, out + ((b * H + g.first_head + h) * n + at) * D);
      }
    }
  }

  void fit() {
    const int64_t n = raw_.tokens(), R = shape_.rows(), H = shape_.heads, D = shape_.dim;
    std::vector<float> x(static_cast<size_t>(n * R * D));
    raw_.read(0, n, x.data());
    for (Group& g : groups_) {
      // Samples: shared -> every (token, batch, head) vector of D; joint ->
      // every (token, batch) vector of the group's heads concatenated.
      std::vector<float> samples;
      samples.reserve(size_t(n * shape_.batch * g.n_heads * D));
      for (int64_t t = 0; t < n; ++t)
        for (int64_t b = 0; b < shape_.batch; ++b) {
          const float* p = x.data() + ((t * shape_.batch + b) * H + g.first_head) * D;
          samples.insert(samples.end(), p, p + g.n_heads * D);
        }
      const int64_t n_samples = int64_t(samples.size()) / g.dim;
      palu::FitOptions fo = opt_.fit;
      if (fo.rank > g.dim) fo.rank = g.dim;
      g.proj = palu::fit_projection(samples.data(), n_samples, g.dim, fo);
      g.blob_bytes = palu::latent_group_bytes(g.proj, g.rows, opt_.group_size);
    }
    fitted_ = true;
    raw_.reset(R, D, shape_.storage);
    encode_tokens(x.data(), n);
  }

  PaluOptions opt_;
  StreamShape shape_;
  RawTokenStore raw_;
  bool fitted_ = false;
  int64_t blocks_ = 0, tail_tokens_ = 0;
  std::vector<Group> groups_;
  std::shared_ptr<const RopeTable> rope_;  // calibrated keys: covers every position held
};

}  // namespace

std::unique_ptr<TokenStream> make_palu_stream(const PaluOptions& opt) { return std::make_unique<PaluStream>(opt); }

std::vector<PaluGroupLayout> palu_groups(const KVCache& cache, bool keys) {
  const auto* s = dynamic_cast<const PaluStream*>(stream_of(cache, keys));
  return s ? s->layouts() : std::vector<PaluGroupLayout>{};
}

}  // namespace kvcodec::cache_impl

// Raw storage and the baseline streams: fp16, int8/int4 (q8_0/q4_0 style) and KIVI.
#include "cache/streams.hpp"
#include "core/held_bytes.hpp"

#include <algorithm>
#include <cstring>

#include "baselines/symmetric_quant.hpp"
#include "palu/group_quant.hpp"

namespace kvcodec::cache_impl {

void scatter_tokens(const float* x, int64_t n, int64_t rows, int64_t dim, float* out, int64_t total_n, int64_t at) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(out + (r * total_n + at + t) * dim, x + (t * rows + r) * dim, size_t(dim) * sizeof(float));
}

// --- RawTokenStore -------------------------------------------------------------

void RawTokenStore::reset(int64_t rows, int64_t dim, DType dtype) {
  rows_ = rows;
  dim_ = dim;
  dtype_ = dtype;
  tokens_ = 0;
  decltype(data_)().swap(data_);  // gives the memory back (palu's pre-fit tokens once fitted; = {} would keep it)
}

void RawTokenStore::push_back(const float* x, int64_t n) {
  const size_t old = data_.size();
  data_.resize(old + size_t(n) * token_bytes());
  convert(x, DType::kF32, data_.data() + old, dtype_, size_t(n * rows_ * dim_));
  tokens_ += n;
}

void RawTokenStore::push_front(const float* x, int64_t n) {
  std::vector<uint8_t> head(size_t(n) * token_bytes());
  convert(x, DType::kF32, head.data(), dtype_, size_t(n * rows_ * dim_));
  data_.insert(data_.begin(), head.begin(), head.end());
  tokens_ += n;
}

void RawTokenStore::pop_front(int64_t n) {
  data_.erase(data_.begin(), data_.begin() + ptrdiff_t(size_t(n) * token_bytes()));
  tokens_ -= n;
  // A prefill's raw tokens, once quantized, must not stay allocated.
  shrink_if_oversized(data_, 0);
}

void RawTokenStore::truncate(int64_t n_tokens) {
  if (n_tokens >= tokens_) return;
  data_.resize(size_t(n_tokens) * token_bytes());
  tokens_ = n_tokens;
}

void RawTokenStore::read(int64_t first, int64_t n, float* out) const {
  convert(data_.data() + size_t(first) * token_bytes(), dtype_, out, DType::kF32, size_t(n * rows_ * dim_));
}

void RawTokenStore::deserialize(ByteReader& r, int64_t tokens) {
  const uint64_t n = checked_mul(uint64_t(tokens), token_bytes(), "raw tokens");
  if (n > r.remaining())
    r.fail("raw tokens need " + std::to_string(n) + " bytes, " + std::to_string(r.remaining()) + " remain");
  const auto p = r.bytes(size_t(n));
  data_.assign(p.begin(), p.end());
  tokens_ = tokens;
}

namespace {

// --- fp16: the input's 16-bit values as they are --------------------------------

class RawStream final : public TokenStream {
 public:
  std::unique_ptr<TokenStream> empty_twin() const override { return std::make_unique<RawStream>(); }
  void start(const StreamShape& s) override {
    shape_ = s;
    store_.reset(s.rows(), s.dim, s.storage);
  }
  void append(const float* x, int64_t n) override { store_.push_back(x, n); }
  void decode(int64_t first, int64_t n, float* out) const override {
    std::vector<float> tmp(static_cast<size_t>(n * shape_.rows() * shape_.dim));
    store_.read(first, n, tmp.data());
    scatter_tokens(tmp.data(), n, shape_.rows(), shape_.dim, out, n, 0);
  }
  void trim_to(int64_t total) override { store_.truncate(total); }
  int64_t tokens() const override { return store_.tokens(); }
  uint64_t stored_bytes() const override { return store_.bytes(); }
  uint64_t held_bytes() const override { return sizeof(*this) + store_.held(); }
  void save(ByteWriter& w) const override { store_.serialize(w); }
  void load(ByteReader& r, int64_t tokens) override { store_.deserialize(r, tokens); }

 private:
  StreamShape shape_;
  RawTokenStore store_;
};

// --- int8 / int4: every token quantized on arrival, fixed bytes per token -------

class SymmetricStream final : public TokenStream {
 public:
  SymmetricStream(int bits, int64_t group) : bits_(bits), group_(group) {}
  std::unique_ptr<TokenStream> empty_twin() const override { return std::make_unique<SymmetricStream>(bits_, group_); }
  void start(const StreamShape& s) override {
    shape_ = s;
    row_bytes_ = baselines::sym_row_bytes(s.dim, group_, bits_);
    data_.clear();
    tokens_ = 0;
  }
  void append(const float* x, int64_t n) override {
    // One call's rows in one allocation: a prefill is held at its size, not
    // rounded up to the vector's next doubling; one-token appends still grow
    // geometrically.
    const size_t need = data_.size() + size_t(n * shape_.rows()) * row_bytes_;
    if (need > data_.capacity()) data_.reserve(std::max(need, 2 * data_.capacity()));
    for (int64_t i = 0; i < n * shape_.rows(); ++i)
      baselines::sym_encode_row(x + i * shape_.dim, shape_.dim, group_, bits_, data_);
    tokens_ += n;
  }
  void decode(int64_t first, int64_t n, float* out) const override {
    const int64_t rows = shape_.rows();
    for (int64_t t = 0; t < n; ++t)
      for (int64_t r = 0; r < rows; ++r) {
        const size_t off = (size_t(first + t) * rows + r) * row_bytes_;
        baselines::sym_decode_row(data_.data() + off, row_bytes_, shape_.dim, group_, bits_,
                                  out + (r * n + t) * shape_.dim);
      }
  }
  void trim_to(int64_t total) override {
    if (total >= tokens_) return;
    data_.resize(size_t(total * shape_.rows()) * row_bytes_);
    tokens_ = total;
  }
  int64_t tokens() const override { return tokens_; }
  uint64_t stored_bytes() const override { return data_.size(); }
  uint64_t held_bytes() const override { return sizeof(*this) + data_.capacity(); }
  void save(ByteWriter& w) const override { w.bytes(data_.data(), data_.size()); }
  void load(ByteReader& r, int64_t tokens) override {
    const uint64_t n = checked_mul(checked_mul(uint64_t(tokens), uint64_t(shape_.rows()), "int tokens"), row_bytes_,
                                   "int tokens");
    const auto p = r.bytes(size_t(n));
    data_.assign(p.begin(), p.end());
    tokens_ = tokens;
  }
  void add_extras(const std::string& prefix, std::map<std::string, double>& e) const override {
    e[prefix + "bits_per_element"] = shape_.dim ? double(row_bytes_ * 8) / double(shape_.dim) : 0.0;
  }

 private:
  int bits_;
  int64_t group_;
  StreamShape shape_;
  size_t row_bytes_ = 0;
  std::vector<uint8_t> data_;
  int64_t tokens_ = 0;
};

// --- KIVI: what the key and value streams share ---------------------------------
//
// Tokens [0, quantized) are coded in `coded_` (each stream's own layout),
// tokens [quantized, total) are raw, the newest ones in the residual window.
// Stored: u64 quantized token count, the coded bytes, the raw tail.

template <class Derived>
class KiviStream : public TokenStream {
 public:
  KiviStream(int64_t group, int64_t residual, int bits) : group_(group), residual_(residual), bits_(bits) {}
  std::unique_ptr<TokenStream> empty_twin() const override {
    return std::make_unique<Derived>(group_, residual_, bits_);
  }
  int64_t tokens() const override { return quantized_ + raw_.tokens(); }
  uint64_t stored_bytes() const override { return 8 + coded_.size() + raw_.bytes(); }
  void save(ByteWriter& w) const override {
    w.u64(uint64_t(quantized_));
    w.bytes(coded_.data(), coded_.size());
    raw_.serialize(w);
  }
  void add_extras(const std::string& prefix, std::map<std::string, double>& e) const override {
    e[prefix + "raw_tokens"] = double(raw_.tokens());
  }

 protected:
  // start()'s common part: the shape, nothing held.
  void start_empty(const StreamShape& s) {
    shape_ = s;
    coded_.clear();
    quantized_ = 0;
    raw_.reset(s.rows(), s.dim, s.storage);
  }
  // load()'s common part, once the stream checked the quantized count q it
  // read and sized its coded bytes: those bytes, then the raw tail.
  void load_coded(ByteReader& r, uint64_t q, uint64_t coded_bytes, int64_t tokens) {
    const auto p = r.bytes(size_t(coded_bytes));
    coded_.assign(p.begin(), p.end());
    quantized_ = int64_t(q);
    raw_.deserialize(r, tokens - quantized_);
  }
  uint64_t common_held() const { return coded_.capacity() + raw_.held(); }

  int64_t group_, residual_;
  int bits_;
  StreamShape shape_;
  std::vector<uint8_t> coded_;
  int64_t quantized_ = 0;
  RawTokenStore raw_;
};

// --- KIVI keys: per-channel over token groups, once a group has left the window ---
//
// The coded tokens are in groups of G tokens, each quantized per (row,
// channel) over its G tokens (KIVI's per-channel key quantization: key
// outliers live in fixed channels); a group is quantized when all its G
// tokens are older than the `residual` newest. Coded bytes: the group blobs.

class KiviKeyStream final : public KiviStream<KiviKeyStream> {
 public:
  using KiviStream::KiviStream;
  void start(const StreamShape& s) override {
    start_empty(s);
    widths_.assign(size_t(s.dim), uint8_t(bits_));
    blob_bytes_ = detail::channel_group_bytes(s.rows(), s.dim, group_, widths_.data());
  }
  void append(const float* x, int64_t n) override {
    raw_.push_back(x, n);
    const size_t tok = size_t(shape_.rows() * shape_.dim);
    std::vector<float> buf;
    while (raw_.tokens() - residual_ >= group_) {
      buf.resize(size_t(group_) * tok);
      raw_.read(0, group_, buf.data());
      detail::encode_channel_group(buf.data(), shape_.rows(), shape_.dim, group_, widths_.data(), coded_);
      raw_.pop_front(group_);
      quantized_ += group_;
    }
  }
  void decode(int64_t first, int64_t n, float* out) const override {
    const int64_t rows = shape_.rows(), dim = shape_.dim;
    std::vector<float> buf(static_cast<size_t>(group_ * rows * dim));
    int64_t t = first;
    const int64_t end = first + n;
    while (t < end && t < quantized_) {
      const int64_t g = t / group_;
      decode_channel_group_at(g, buf.data());
      const int64_t lo = t - g * group_, hi = std::min(group_, end - g * group_);
      scatter_tokens(buf.data() + lo * rows * dim, hi - lo, rows, dim, out, n, t - first);
      t = g * group_ + hi;
    }
    if (t < end) {
      buf.resize(size_t((end - t) * rows * dim));
      raw_.read(t - quantized_, end - t, buf.data());
      scatter_tokens(buf.data(), end - t, rows, dim, out, n, t - first);
    }
  }
  void trim_to(int64_t total) override {
    // Cutting into a quantized group: its surviving tokens go back to the raw
    // tail as their dequantized values (what fetch returned for them anyway),
    // so group boundaries stay aligned to token 0.
    const int64_t rows = shape_.rows(), dim = shape_.dim;
    while (total < quantized_) {
      std::vector<float> buf(static_cast<size_t>(group_ * rows * dim));
      const int64_t g = quantized_ / group_ - 1;
      decode_channel_group_at(g, buf.data());
      raw_.push_front(buf.data(), group_);
      coded_.resize(size_t(g) * blob_bytes_);
      quantized_ -= group_;
    }
    raw_.truncate(total - quantized_);
  }
  uint64_t held_bytes() const override { return sizeof(*this) + widths_.capacity() + common_held(); }
  void load(ByteReader& r, int64_t tokens) override {
    const uint64_t q = r.u64();
    if (q > uint64_t(tokens) || q % uint64_t(group_) != 0)
      r.fail("KIVI quantized key count " + std::to_string(q) + " is not a multiple of group_size within " +
             std::to_string(tokens) + " tokens");
    // append() quantizes every full group older than the residual window.
    if (tokens - int64_t(q) >= residual_ + group_)
      r.fail("KIVI keys hold " + std::to_string(tokens - int64_t(q)) + " raw tokens, more than residual + group_size - 1");
    load_coded(r, q, checked_mul(q / uint64_t(group_), blob_bytes_, "KIVI key groups"), tokens);
  }

 private:
  void decode_channel_group_at(int64_t g, float* buf) const {
    detail::decode_channel_group(coded_.data() + size_t(g) * blob_bytes_, blob_bytes_, shape_.rows(), shape_.dim,
                                 group_, widths_.data(), buf);
  }
  std::vector<uint8_t> widths_;
  size_t blob_bytes_ = 0;
};

// --- KIVI values: per-token groups of G channels, once a token left the window ---
//
// Coded bytes: fixed-size quantized token rows.

class KiviValueStream final : public KiviStream<KiviValueStream> {
 public:
  using KiviStream::KiviStream;
  void start(const StreamShape& s) override {
    start_empty(s);
    row_bytes_ = detail::row_group_bytes(s.dim, group_, bits_);
  }
  void append(const float* x, int64_t n) override {
    raw_.push_back(x, n);
    const int64_t excess = raw_.tokens() - residual_;
    if (excess <= 0) return;
    std::vector<float> buf(static_cast<size_t>(excess * shape_.rows() * shape_.dim));
    raw_.read(0, excess, buf.data());
    for (int64_t i = 0; i < excess * shape_.rows(); ++i)
      detail::encode_row_groups(buf.data() + i * shape_.dim, shape_.dim, group_, bits_, coded_);
    raw_.pop_front(excess);
    quantized_ += excess;
  }
  void decode(int64_t first, int64_t n, float* out) const override {
    const int64_t rows = shape_.rows(), dim = shape_.dim;
    const int64_t end = first + n;
    int64_t t = first;
    for (; t < end && t < quantized_; ++t)
      for (int64_t r = 0; r < rows; ++r)
        detail::decode_row_groups(coded_.data() + (size_t(t) * rows + r) * row_bytes_, row_bytes_, dim, group_, bits_,
                                  out + (r * n + t - first) * dim);
    if (t < end) {
      std::vector<float> buf(static_cast<size_t>((end - t) * rows * dim));
      raw_.read(t - quantized_, end - t, buf.data());
      scatter_tokens(buf.data(), end - t, rows, dim, out, n, t - first);
    }
  }
  void trim_to(int64_t total) override {
    // Per-token rows drop exactly; the raw window is not refilled (no original
    // values are left to refill it from).
    if (total < quantized_) {
      raw_.truncate(0);
      coded_.resize(size_t(total * shape_.rows()) * row_bytes_);
      quantized_ = total;
    } else {
      raw_.truncate(total - quantized_);
    }
  }
  uint64_t held_bytes() const override { return sizeof(*this) + common_held(); }
  void load(ByteReader& r, int64_t tokens) override {
    const uint64_t q = r.u64();
    if (q > uint64_t(tokens))
      r.fail("KIVI quantized value count " + std::to_string(q) + " exceeds " + std::to_string(tokens) + " tokens");
    if (uint64_t(tokens) - q > uint64_t(residual_))
      r.fail("KIVI values hold " + std::to_string(uint64_t(tokens) - q) + " raw tokens, more than the residual " +
             std::to_string(residual_));
    load_coded(r, q, checked_mul(checked_mul(q, uint64_t(shape_.rows()), "KIVI values"), row_bytes_, "KIVI values"),
               tokens);
  }

 private:
  size_t row_bytes_ = 0;
};

}  // namespace

std::unique_ptr<TokenStream> make_raw_stream() { return std::make_unique<RawStream>(); }
std::unique_ptr<TokenStream> make_symmetric_stream(int bits, int64_t group_size) {
  return std::make_unique<SymmetricStream>(bits, group_size);
}
std::unique_ptr<TokenStream> make_kivi_key_stream(int64_t group_size, int64_t residual, int bits) {
  return std::make_unique<KiviKeyStream>(group_size, residual, bits);
}
std::unique_ptr<TokenStream> make_kivi_value_stream(int64_t group_size, int64_t residual, int bits) {
  return std::make_unique<KiviValueStream>(group_size, residual, bits);
}

}  // namespace kvcodec::cache_impl

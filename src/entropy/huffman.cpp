// Canonical Huffman: optimal length-limited lengths (package-merge),
// canonical codes emitted bit-reversed so the LSB-first decoder indexes one
// lookup table of 2^min(max_length, 11) entries with the next bits.
#include <algorithm>
#include <bit>
#include <numeric>
#include <string>

#include "entropy/bitstream_fast.hpp"
#include "entropy/entropy.hpp"

namespace kvcodec::entropy {
namespace {

[[noreturn]] void invalid(const std::string& what) { throw Error(ErrorCode::kInvalidArgument, "Huffman: " + what); }
[[noreturn]] void bad_format(const std::string& what) { throw Error(ErrorCode::kFormat, "Huffman: " + what); }

uint16_t reverse_bits(uint32_t code, unsigned len) {
  uint32_t r = 0;
  for (unsigned b = 0; b < len; ++b) r |= ((code >> b) & 1u) << (len - 1 - b);
  return uint16_t(r);
}

std::vector<uint32_t> active_columns(size_t n_cols, const std::vector<const HuffmanTable*>& tables, const char* who) {
  if (tables.size() != n_cols)
    throw Error(ErrorCode::kInvalidArgument, std::string(who) + ": " + std::to_string(tables.size()) + " tables for " +
                                                 std::to_string(n_cols) + " columns");
  std::vector<uint32_t> cols;
  for (size_t c = 0; c < n_cols; ++c) {
    if (!tables[c]) continue;
    const HuffmanTable& t = *tables[c];
    if (t.alphabet_size == 0 || t.max_length > kHuffmanMaxLength || t.lengths.size() != t.alphabet_size ||
        t.codes.size() != t.alphabet_size || t.lut_bits > kHuffmanLutBits || t.lut_bits > t.max_length ||
        t.lut.size() != (size_t(1) << t.lut_bits) || t.sorted.size() != t.alphabet_size)
      throw Error(ErrorCode::kInvalidArgument, std::string(who) + ": table of column " + std::to_string(c) +
                                                   " is not a valid HuffmanTable (build it with huffman_build/from_lengths)");
    cols.push_back(uint32_t(c));
  }
  return cols;
}

}  // namespace

HuffmanTable HuffmanTable::from_lengths(std::vector<uint8_t> lengths) {
  const size_t n = lengths.size();
  if (n == 0 || n > kHuffmanMaxAlphabet)
    invalid("alphabet size " + std::to_string(n) + " not in [1, " + std::to_string(kHuffmanMaxAlphabet) + "]");
  HuffmanTable t;
  t.alphabet_size = uint32_t(n);
  if (n == 1) {
    if (lengths[0] != 0) invalid("a 1-symbol alphabet has code length 0");
    t.lengths = std::move(lengths);
    t.codes = {0};
    t.lut = {0};  // symbol 0, length 0: consumes no bits
    t.sorted = {0};
    return t;
  }
  uint64_t kraft = 0;  // in units of 2^-15
  unsigned max_len = 0;
  for (size_t s = 0; s < n; ++s) {
    const unsigned l = lengths[s];
    if (l < 1 || l > kHuffmanMaxLength)
      invalid("symbol " + std::to_string(s) + " has code length " + std::to_string(l) + ", allowed 1..15");
    kraft += uint64_t(1) << (kHuffmanMaxLength - l);
    max_len = std::max(max_len, l);
  }
  if (kraft != (uint64_t(1) << kHuffmanMaxLength))
    invalid("code lengths are not a complete prefix code (Kraft sum " + std::to_string(kraft) + "/32768)");
  t.max_length = max_len;
  t.lengths = std::move(lengths);
  // Canonical order: by length, then symbol.
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return t.lengths[a] < t.lengths[b]; });
  t.codes.assign(n, 0);
  t.lut_bits = std::min<uint32_t>(max_len, kHuffmanLutBits);
  t.lut.assign(size_t(1) << t.lut_bits, kHuffmanLongCode);
  t.sorted.resize(n);
  uint32_t code = 0;
  unsigned prev_len = t.lengths[order[0]];
  for (size_t i = 0; i < n; ++i) {
    const uint32_t s = order[i];
    const unsigned l = t.lengths[s];
    code <<= (l - prev_len);
    if (l != prev_len || i == 0) {
      t.first_code[l] = code;
      t.offset[l] = uint32_t(i);
    }
    prev_len = l;
    ++t.count[l];
    t.sorted[i] = uint16_t(s);
    const uint16_t rc = reverse_bits(code, l);
    t.codes[s] = rc;
    if (l <= t.lut_bits)
      for (size_t j = rc; j < t.lut.size(); j += size_t(1) << l) t.lut[j] = s | (uint32_t(l) << 16);
    ++code;
  }
  return t;
}

namespace {

// Slow path for codes longer than lut_bits: walk the canonical code one bit
// at a time (bits holds at least max_length upcoming stream bits). A complete
// code always terminates within max_length bits.
inline uint32_t decode_long(const HuffmanTable& t, uint64_t bits) {
  uint32_t code = 0;
  for (unsigned l = 1; l <= t.max_length; ++l) {
    code = (code << 1) | uint32_t((bits >> (l - 1)) & 1);
    const uint32_t k = code - t.first_code[l];
    if (t.count[l] && code >= t.first_code[l] && k < t.count[l]) return t.sorted[t.offset[l] + k] | (uint32_t(l) << 16);
  }
  bad_format("invalid code (table is not a complete prefix code)");
}

}  // namespace

HuffmanTable huffman_build(const std::vector<uint64_t>& counts) {
  const size_t n = counts.size();
  if (n == 0 || n > kHuffmanMaxAlphabet)
    invalid("alphabet size " + std::to_string(n) + " not in [1, " + std::to_string(kHuffmanMaxAlphabet) + "]");
  if (n == 1) return HuffmanTable::from_lengths({0});
  // Weights: counts scaled by 2^k >= 2n plus one, so symbols never seen get a
  // (long) code while barely disturbing the others. Counts are shifted down
  // first if the sum could overflow.
  long double sum = 0;
  for (uint64_t c : counts) sum += (long double)c;
  unsigned shift = 0;
  while (sum / (long double)(uint64_t(1) << shift) > (long double)(uint64_t(1) << 40)) ++shift;
  const unsigned k = unsigned(std::bit_width(n)) + 1;
  std::vector<uint64_t> w(n);
  for (size_t s = 0; s < n; ++s) {
    uint64_t c = counts[s] >> shift;
    if (counts[s] && !c) c = 1;
    w[s] = (c << k) + 1;
  }
  // Package-merge (Larmore-Hirschberg): each level's list merges the leaves
  // with pairs ("packages") of the previous level; the 2n-2 lightest items of
  // the last list give each symbol's length as the number of times it occurs.
  struct Node {
    uint64_t w;
    int32_t a, b;  // leaf: a = symbol, b = -1; package: children node ids
  };
  std::vector<Node> pool;
  pool.reserve(n * (kHuffmanMaxLength + 1) * 2);
  std::vector<uint32_t> leaves(n);
  std::iota(leaves.begin(), leaves.end(), 0u);
  std::stable_sort(leaves.begin(), leaves.end(), [&](uint32_t x, uint32_t y) { return w[x] < w[y]; });
  std::vector<int32_t> leaf_nodes;
  for (uint32_t s : leaves) {
    leaf_nodes.push_back(int32_t(pool.size()));
    pool.push_back(Node{w[s], int32_t(s), -1});
  }
  std::vector<int32_t> list = leaf_nodes;
  for (unsigned level = 1; level < kHuffmanMaxLength; ++level) {
    std::vector<int32_t> packages;
    for (size_t i = 0; i + 1 < list.size(); i += 2) {
      packages.push_back(int32_t(pool.size()));
      pool.push_back(Node{pool[list[i]].w + pool[list[i + 1]].w, list[i], list[i + 1]});
    }
    std::vector<int32_t> merged;
    merged.reserve(leaf_nodes.size() + packages.size());
    size_t i = 0, j = 0;
    while (i < leaf_nodes.size() || j < packages.size()) {
      if (j == packages.size() || (i < leaf_nodes.size() && pool[leaf_nodes[i]].w <= pool[packages[j]].w))
        merged.push_back(leaf_nodes[i++]);
      else
        merged.push_back(packages[j++]);
    }
    list = std::move(merged);
  }
  std::vector<uint8_t> lengths(n, 0);
  std::vector<int32_t> stack;
  for (size_t i = 0; i < 2 * n - 2; ++i) {
    stack.push_back(list[i]);
    while (!stack.empty()) {
      const Node& node = pool[stack.back()];
      stack.pop_back();
      if (node.b < 0) ++lengths[node.a];
      else stack.push_back(node.a), stack.push_back(node.b);
    }
  }
  return HuffmanTable::from_lengths(std::move(lengths));
}

void HuffmanTable::serialize(BitWriter& out) const {
  out.put_gamma(alphabet_size);
  int prev = 0;
  for (uint8_t l : lengths) {
    if (alphabet_size == 1) break;
    const int d = int(l) - prev;
    const uint32_t z = d >= 0 ? uint32_t(2 * d) : uint32_t(-2 * d - 1);  // zigzag
    out.put_gamma(uint64_t(z) + 1);
    prev = l;
  }
}

size_t HuffmanTable::serialized_bits() const {
  BitWriter w;
  serialize(w);
  return w.bit_count();
}

HuffmanTable HuffmanTable::deserialize(BitReader& in, uint32_t max_alphabet) {
  const uint64_t alphabet = in.get_gamma(17);
  const uint64_t limit = std::min<uint64_t>(max_alphabet, kHuffmanMaxAlphabet);
  if (alphabet > limit) bad_format("alphabet size " + std::to_string(alphabet) + " exceeds the limit " + std::to_string(limit));
  if (alphabet == 1) return from_lengths({0});
  std::vector<uint8_t> lengths(alphabet);
  int prev = 0;
  for (uint64_t s = 0; s < alphabet; ++s) {
    const uint64_t z = in.get_gamma(5) - 1;
    const int64_t d = (z & 1) ? -int64_t((z + 1) / 2) : int64_t(z / 2);
    const int64_t l = prev + d;
    if (l < 1 || l > int64_t(kHuffmanMaxLength))
      bad_format("symbol " + std::to_string(s) + " has code length " + std::to_string(l) + ", allowed 1..15");
    lengths[s] = uint8_t(l);
    prev = int(l);
  }
  try {
    return from_lengths(std::move(lengths));
  } catch (const Error& e) {
    bad_format(std::string("table rejected: ") + e.what());
  }
}

uint64_t HuffmanTable::cost_bits(const std::vector<uint64_t>& counts) const {
  if (counts.size() > alphabet_size)
    invalid("cost_bits: " + std::to_string(counts.size()) + " counts for an alphabet of " + std::to_string(alphabet_size));
  uint64_t bits = 0;
  for (size_t s = 0; s < counts.size(); ++s) bits += counts[s] * lengths[s];
  return bits;
}

std::vector<uint8_t> huffman_encode(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                    const std::vector<const HuffmanTable*>& tables) {
  const std::vector<uint32_t> cols = active_columns(n_cols, tables, "huffman_encode");
  if (n_cols && n_rows > (SIZE_MAX / 64) / n_cols) invalid("huffman_encode: too many symbols");
  // Validate first; also gives the exact size.
  size_t bits = 0;
  for (size_t r = 0; r < n_rows; ++r)
    for (uint32_t c : cols) {
      const uint16_t s = symbols[r * n_cols + c];
      if (s >= tables[c]->alphabet_size)
        throw Error(ErrorCode::kInvalidArgument, "huffman_encode: symbol " + std::to_string(s) + " at row " +
                                                     std::to_string(r) + ", column " + std::to_string(c) +
                                                     " is outside the alphabet of size " +
                                                     std::to_string(tables[c]->alphabet_size));
      bits += tables[c]->lengths[s];
    }
  detail::FastBitWriter out(bits);
  for (size_t r = 0; r < n_rows; ++r) {
    const uint16_t* row = symbols + r * n_cols;
    for (uint32_t c : cols) {
      const HuffmanTable& t = *tables[c];
      const uint16_t s = row[c];
      out.put(t.codes[s], t.lengths[s]);
    }
  }
  return out.finish();
}

void huffman_decode(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols,
                    const std::vector<const HuffmanTable*>& tables, uint16_t* out) {
  const std::vector<uint32_t> cols = active_columns(n_cols, tables, "huffman_decode");
  if (n_cols && n_rows > (SIZE_MAX / 64) / n_cols) invalid("huffman_decode: too many symbols");
  if (n_rows != 0 && n_cols != 0) std::fill(out, out + n_rows * n_cols, uint16_t(0));
  if (size > SIZE_MAX / 16) bad_format("stream too large");
  detail::FastBitReader in(data, size);
  for (size_t r = 0; r < n_rows; ++r) {
    uint16_t* row = out + r * n_cols;
    for (uint32_t c : cols) {
      const HuffmanTable& t = *tables[c];
      if (in.avail() < kHuffmanMaxLength) {
        in.refill();
        // Reads past the end come back as zeros; once more bits were
        // consumed than exist the stream is truncated. Checking at each
        // refill bounds the overrun to < 64 bits, so no decode runs on.
        if (in.consumed() > in.total_bits())
          bad_format("stream truncated at row " + std::to_string(r) + ", column " + std::to_string(c));
      }
      uint32_t e = t.lut[in.peek() & ((uint64_t(1) << t.lut_bits) - 1)];
      if (e & kHuffmanLongCode) e = decode_long(t, in.peek());
      row[c] = uint16_t(e);
      in.consume(e >> 16);
    }
  }
  const size_t used = in.consumed();
  if (used > in.total_bits()) bad_format("stream truncated: needs " + std::to_string(used) + " bits, has " + std::to_string(in.total_bits()));
  const size_t rest = in.total_bits() - used;
  if (rest >= 8) bad_format(std::to_string(rest / 8) + " trailing bytes after the last symbol");
  if (rest && (in.remaining_real_value() & ((uint64_t(1) << rest) - 1)) != 0) bad_format("nonzero padding bits");
}

}  // namespace kvcodec::entropy

namespace kvcodec::entropy {

uint64_t HuffmanTable::held_bytes() const {
  return uint64_t(lengths.capacity()) + uint64_t(codes.capacity() + sorted.capacity()) * sizeof(uint16_t) +
         uint64_t(lut.capacity()) * sizeof(uint32_t);
}

}  // namespace kvcodec::entropy

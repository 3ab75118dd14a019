// Fixed-width bit packing and the coder choice.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "entropy/bitstream_fast.hpp"
#include "entropy/entropy.hpp"

namespace kvcodec::entropy {
namespace {

[[noreturn]] void invalid(const std::string& what) { throw Error(ErrorCode::kInvalidArgument, what); }

void check_widths(size_t n_rows, size_t n_cols, const std::vector<uint8_t>& widths, const char* who) {
  if (widths.size() != n_cols)
    invalid(std::string(who) + ": " + std::to_string(widths.size()) + " widths for " + std::to_string(n_cols) + " columns");
  for (size_t c = 0; c < n_cols; ++c)
    if (widths[c] > 16) invalid(std::string(who) + ": width of column " + std::to_string(c) + " = " + std::to_string(widths[c]) + ", allowed 0..16");
  if (n_cols && n_rows > (SIZE_MAX / 64) / n_cols) invalid(std::string(who) + ": too many symbols");
}

}  // namespace

uint64_t fixed_bits(size_t n_rows, const std::vector<uint8_t>& widths) {
  uint64_t per_row = 0;
  for (uint8_t w : widths) per_row += w;
  return per_row * n_rows;
}

std::vector<uint8_t> pack_fixed(const uint16_t* symbols, size_t n_rows, size_t n_cols, const std::vector<uint8_t>& widths) {
  check_widths(n_rows, n_cols, widths, "pack_fixed");
  std::vector<uint32_t> cols;
  for (size_t c = 0; c < n_cols; ++c)
    if (widths[c]) cols.push_back(uint32_t(c));
  detail::FastBitWriter out(fixed_bits(n_rows, widths));
  for (size_t r = 0; r < n_rows; ++r) {
    const uint16_t* row = symbols + r * n_cols;
    for (uint32_t c : cols) {
      const uint32_t s = row[c];
      if (s >> widths[c])
        invalid("pack_fixed: symbol " + std::to_string(s) + " at row " + std::to_string(r) + ", column " +
                std::to_string(c) + " does not fit in " + std::to_string(widths[c]) + " bits");
      out.put(s, widths[c]);
    }
  }
  return out.finish();
}

void unpack_fixed(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols, const std::vector<uint8_t>& widths,
                  uint16_t* out) {
  check_widths(n_rows, n_cols, widths, "unpack_fixed");
  const uint64_t bits = fixed_bits(n_rows, widths);
  const uint64_t want = (bits + 7) / 8;
  if (size != want)
    throw Error(ErrorCode::kFormat, "fixed-width stream: " + std::to_string(size) + " bytes, expected " + std::to_string(want));
  // The size check above makes every read in bounds.
  detail::FastBitReader in(data, size);
  for (size_t r = 0; r < n_rows; ++r) {
    uint16_t* row = out + r * n_cols;
    for (size_t c = 0; c < n_cols; ++c) {
      const unsigned w = widths[c];
      if (in.avail() < 16) in.refill();
      row[c] = uint16_t(in.peek() & ((1u << w) - 1));
      in.consume(w);
    }
  }
  const unsigned rest = unsigned(want * 8 - bits);
  if (rest && (in.remaining_real_value() & ((1u << rest) - 1)) != 0)
    throw Error(ErrorCode::kFormat, "fixed-width stream: nonzero padding bits");
}

// --- coder choice -----------------------------------------------------------------

const char* coder_name(Coder coder) {
  switch (coder) {
    case Coder::kRans: return "rans";
    case Coder::kHuffman: return "huffman";
    case Coder::kFixed: return "fixed";
  }
  return "unknown";
}

Coder parse_coder(const std::string& name) {
  if (name == "rans") return Coder::kRans;
  if (name == "huffman") return Coder::kHuffman;
  if (name == "fixed") return Coder::kFixed;
  invalid("coder = " + name + ": allowed rans, huffman, fixed");
}

const CoderSize& CoderChoice::size_of(Coder c) const {
  switch (c) {
    case Coder::kRans: return rans;
    case Coder::kHuffman: return huffman;
    case Coder::kFixed: break;
  }
  return fixed;
}

namespace {

constexpr uint64_t kUnavailable = std::numeric_limits<uint64_t>::max() / 2;

Coder pick(const CoderChoice& c) {
  // Strictly smaller wins; ties go to the simpler coder (enum order).
  Coder best = Coder::kFixed;
  for (Coder k : {Coder::kHuffman, Coder::kRans})
    if (c.size_of(k).total_bits() < c.size_of(best).total_bits()) best = k;
  return best;
}

std::vector<bool> active_mask(size_t n_cols, const std::vector<const FrequencyTable*>& rans,
                              const std::vector<const HuffmanTable*>& huff, const std::vector<uint8_t>& widths) {
  if ((!rans.empty() && rans.size() != n_cols) || (!huff.empty() && huff.size() != n_cols) ||
      (!widths.empty() && widths.size() != n_cols))
    invalid("choose_coder: tables/widths must be empty or have one entry per column (" + std::to_string(n_cols) + ")");
  std::vector<bool> active(n_cols, false);
  for (size_t c = 0; c < n_cols; ++c)
    active[c] = (!rans.empty() && rans[c]) || (!huff.empty() && huff[c]) || (!widths.empty() && widths[c]);
  return active;
}

}  // namespace

CoderChoice choose_coder(const std::vector<std::vector<uint64_t>>& column_counts,
                         const std::vector<const FrequencyTable*>& rans_tables,
                         const std::vector<const HuffmanTable*>& huffman_tables,
                         const std::vector<uint8_t>& fixed_widths, size_t n_streams) {
  const size_t n_cols = column_counts.size();
  const std::vector<bool> active = active_mask(n_cols, rans_tables, huffman_tables, fixed_widths);
  if (n_streams == 0) n_streams = 1;
  CoderChoice out;
  uint64_t n_coded = 0;
  bool ok_r = !rans_tables.empty(), ok_h = !huffman_tables.empty(), ok_f = !fixed_widths.empty();
  double rans_cost = 0;
  uint64_t huff_bits = 0, fix_bits = 0;
  for (size_t c = 0; c < n_cols; ++c) {
    if (!active[c]) continue;
    const auto& counts = column_counts[c];
    uint64_t col_n = 0, max_sym = 0;
    for (size_t s = 0; s < counts.size(); ++s)
      if (counts[s]) col_n += counts[s], max_sym = s;
    n_coded += col_n;
    if (ok_r && rans_tables[c] && counts.size() <= rans_tables[c]->alphabet_size) {
      rans_cost += rans_tables[c]->cost_bits(counts);
      out.rans.table_bits += rans_tables[c]->serialized_bits();
    } else {
      ok_r = false;
    }
    if (ok_h && huffman_tables[c] && counts.size() <= huffman_tables[c]->alphabet_size) {
      huff_bits += huffman_tables[c]->cost_bits(counts);
      out.huffman.table_bits += huffman_tables[c]->serialized_bits();
    } else {
      ok_h = false;
    }
    if (ok_f && fixed_widths[c] && (col_n == 0 || (max_sym >> fixed_widths[c]) == 0)) fix_bits += col_n * fixed_widths[c];
    else ok_f = false;
  }
  // Streams split the payload evenly; each rounds up to whole bytes and each
  // rANS stream flushes the states of the lanes it used.
  auto per_stream_bytes = [&](double bits) { return uint64_t(std::ceil(bits / double(n_streams) / 8.0)); };
  const uint64_t per_stream_symbols = (n_coded + n_streams - 1) / n_streams;
  const uint64_t lanes = std::min<uint64_t>(kRansLanes, per_stream_symbols);
  out.rans.payload_bits = ok_r ? n_streams * 8 * (per_stream_bytes(rans_cost) + 4 * lanes) : kUnavailable;
  out.huffman.payload_bits = ok_h ? n_streams * 8 * per_stream_bytes(double(huff_bits)) : kUnavailable;
  out.fixed.payload_bits = ok_f ? n_streams * 8 * per_stream_bytes(double(fix_bits)) : kUnavailable;
  if (n_coded == 0) {
    if (ok_r) out.rans.payload_bits = 0;
  }
  out.best = pick(out);
  return out;
}

CoderChoice choose_coder_exact(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                               const std::vector<const FrequencyTable*>& rans_tables,
                               const std::vector<const HuffmanTable*>& huffman_tables,
                               const std::vector<uint8_t>& fixed_widths) {
  const std::vector<bool> active = active_mask(n_cols, rans_tables, huffman_tables, fixed_widths);
  CoderChoice out;
  out.rans.payload_bits = out.huffman.payload_bits = out.fixed.payload_bits = kUnavailable;
  // A coder is available when it has a table/width for every active column
  // and all symbols fit; then it is measured by really encoding.
  auto available = [&](auto&& has) {
    for (size_t c = 0; c < n_cols; ++c)
      if (active[c] && !has(c)) return false;
    return true;
  };
  if (!rans_tables.empty() && available([&](size_t c) { return rans_tables[c] != nullptr; })) {
    try {
      out.rans.payload_bits = 8 * rans_encode(symbols, n_rows, n_cols, rans_tables).size();
      for (size_t c = 0; c < n_cols; ++c)
        if (rans_tables[c]) out.rans.table_bits += rans_tables[c]->serialized_bits();
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidArgument) throw;
    }
  }
  if (!huffman_tables.empty() && available([&](size_t c) { return huffman_tables[c] != nullptr; })) {
    try {
      out.huffman.payload_bits = 8 * huffman_encode(symbols, n_rows, n_cols, huffman_tables).size();
      for (size_t c = 0; c < n_cols; ++c)
        if (huffman_tables[c]) out.huffman.table_bits += huffman_tables[c]->serialized_bits();
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidArgument) throw;
    }
  }
  if (!fixed_widths.empty() && available([&](size_t c) { return fixed_widths[c] != 0; })) {
    try {
      out.fixed.payload_bits = 8 * pack_fixed(symbols, n_rows, n_cols, fixed_widths).size();
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidArgument) throw;
    }
  }
  out.best = pick(out);
  return out;
}

}  // namespace kvcodec::entropy

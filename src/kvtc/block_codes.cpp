#include "kvtc/block_codes.hpp"

#include <string>

#include "kvcodec/error.hpp"

namespace kvcodec::kvtc {

bool any_code_past_levels(const HeadParams& p, const uint16_t* codes, int64_t n) {
  const size_t kept = size_t(p.n_kept());
  thread_local std::vector<uint16_t> levels;
  levels.resize(kept);
  for (size_t k = 0; k < kept; ++k) levels[k] = p.quant[k].levels;
  unsigned bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t* row = codes + size_t(i) * kept;
    for (size_t k = 0; k < kept; ++k) bad |= unsigned(row[k] >= levels[k]);
  }
  return bad != 0;
}

bool coder_bounds_codes(const HeadParams& p) {
  if (p.coder != CoderChoice::kRans && p.coder != CoderChoice::kHuffman) return false;
  const bool rans = p.coder == CoderChoice::kRans;
  if ((rans ? p.rans_tables.size() : p.huffman_tables.size()) != size_t(p.n_kept())) return false;
  for (int k = 0; k < p.n_kept(); ++k) {
    const uint32_t alphabet = rans ? p.rans_tables[size_t(k)].alphabet_size : p.huffman_tables[size_t(k)].alphabet_size;
    if (alphabet > p.quant[size_t(k)].levels) return false;
  }
  return true;
}

std::vector<uint8_t> encode_codes(const HeadParams& p, const uint16_t* codes, int64_t n) {
  const size_t kept = size_t(p.n_kept());
  if (n < 0) throw Error(ErrorCode::kInvalidArgument, "kvtc encode_codes: n = " + std::to_string(n));
  // Where the coder rejects such codes itself (its own error, before any
  // byte is written), this pass over the codes would be its second: 3% of
  // calibrated kvtc's encode.
  if (!coder_bounds_codes(p) && any_code_past_levels(p, codes, n))
    for (int64_t i = 0; i < n; ++i)
      for (size_t k = 0; k < kept; ++k)
        if (codes[size_t(i) * kept + k] >= p.quant[k].levels)
          throw Error(ErrorCode::kInvalidArgument, "kvtc encode_codes: code " +
                                                       std::to_string(codes[size_t(i) * kept + k]) + " of component " +
                                                       std::to_string(k) + " >= its " +
                                                       std::to_string(p.quant[k].levels) + " levels");
  return entropy_encode_codes(p, codes, n);
}

void decode_codes(const HeadParams& p, const uint8_t* data, size_t size, int64_t n, uint16_t* codes) {
  if (n < 0) throw Error(ErrorCode::kInvalidArgument, "kvtc decode_codes: n = " + std::to_string(n));
  entropy_decode_codes(p, data, size, n, codes);
  if (!coder_bounds_codes(p) && any_code_past_levels(p, codes, n)) throw Error(ErrorCode::kFormat, "kvtc block: code out of range");
}

std::vector<uint8_t> entropy_encode_codes(const HeadParams& p, const uint16_t* codes, int64_t n) {
  const size_t kept = size_t(p.n_kept());
  switch (p.coder) {
    case CoderChoice::kRans: {
      // Table pointers in a reused buffer: a block is a few microseconds of work.
      thread_local std::vector<const entropy::RansEncodeTable*> tables;
      tables.clear();
      if (p.derived().rans_encode.size() == p.rans_tables.size()) {
        for (const auto& t : p.derived().rans_encode) tables.push_back(&t);
        return entropy::rans_encode(codes, size_t(n), kept, tables);
      }
      // Parameters assembled by hand without build_decoders(): same bytes, slower.
      std::vector<const entropy::FrequencyTable*> freq;
      for (const auto& t : p.rans_tables) freq.push_back(&t);
      return entropy::rans_encode(codes, size_t(n), kept, freq);
    }
    case CoderChoice::kHuffman: {
      std::vector<const entropy::HuffmanTable*> tables;
      for (const auto& t : p.huffman_tables) tables.push_back(&t);
      return entropy::huffman_encode(codes, size_t(n), kept, tables);
    }
    case CoderChoice::kFixed:
    case CoderChoice::kAuto:
      return entropy::pack_fixed(codes, size_t(n), kept, p.fixed_widths);
  }
  return {};
}

std::pair<std::vector<uint8_t>, std::vector<uint8_t>> entropy_encode_codes_pair(const HeadParams& pa,
                                                                                const uint16_t* codes_a,
                                                                                int64_t n_a, const HeadParams& pb,
                                                                                const uint16_t* codes_b, int64_t n_b) {
  const auto built = [](const HeadParams& p) {
    return p.coder == CoderChoice::kRans && p.derived().rans_encode.size() == p.rans_tables.size();
  };
  if (!built(pa) || !built(pb)) return {entropy_encode_codes(pa, codes_a, n_a), entropy_encode_codes(pb, codes_b, n_b)};
  thread_local std::vector<const entropy::RansEncodeTable*> ta, tb;
  ta.clear(), tb.clear();
  for (const auto& t : pa.derived().rans_encode) ta.push_back(&t);
  for (const auto& t : pb.derived().rans_encode) tb.push_back(&t);
  return entropy::rans_encode_pair({codes_a, size_t(n_a), size_t(pa.n_kept()), &ta},
                                   {codes_b, size_t(n_b), size_t(pb.n_kept()), &tb});
}

void entropy_decode_codes(const HeadParams& p, const uint8_t* data, size_t size, int64_t n, uint16_t* codes) {
  const size_t kept = size_t(p.n_kept());
  switch (p.coder) {
    case CoderChoice::kRans: {
      thread_local std::vector<const entropy::RansDecodeTable*> tables;
      thread_local std::vector<entropy::RansDecodeTable> built;  // only for hand-assembled parameters
      tables.clear();
      built.clear();
      if (p.derived().rans_decode.size() != p.rans_tables.size())
        for (const auto& t : p.rans_tables) built.emplace_back(t);
      for (const auto& t : built.empty() ? p.derived().rans_decode : built) tables.push_back(&t);
      if (built.empty())
        entropy::rans_decode(data, size, size_t(n), kept, tables, codes, p.derived().rans_groups);
      else
        entropy::rans_decode(data, size, size_t(n), kept, tables, codes);
      break;
    }
    case CoderChoice::kHuffman: {
      std::vector<const entropy::HuffmanTable*> tables;
      for (const auto& t : p.huffman_tables) tables.push_back(&t);
      entropy::huffman_decode(data, size, size_t(n), kept, tables, codes);
      break;
    }
    case CoderChoice::kFixed:
    case CoderChoice::kAuto:
      entropy::unpack_fixed(data, size, size_t(n), kept, p.fixed_widths, codes);
      break;
  }
}

}  // namespace kvcodec::kvtc

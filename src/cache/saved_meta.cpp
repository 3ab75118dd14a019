#include "cache/saved_meta.hpp"

namespace kvcodec::cache_impl {

uint64_t checked_mul(uint64_t a, uint64_t b, const std::string& what) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw Error(ErrorCode::kFormat, what + ": size overflows (corrupted shape or token count)");
  return r;
}

void write_layout_version(ContainerWriter& w, int version) { w.set_meta(kLayoutKey, std::to_string(version)); }

int read_layout_version(const ContainerReader& c, int newest, const std::string& who) {
  if (!c.meta().count(kLayoutKey)) return 1;
  const int64_t v = meta_int(c, kLayoutKey, 1, 1 << 30);
  if (v > newest)
    throw Error(ErrorCode::kUnsupported, who + ": saved layout version " + std::to_string(v) +
                                             " is newer than this build reads (1.." + std::to_string(newest) + ")");
  return int(v);
}

void check_coded_layout(const CodedLayout& l, const std::string& who) {
  auto fail = [&](const std::string& what) {
    throw Error(ErrorCode::kFormat, who + ": inconsistent saved state (" + what + "; offset " +
                                        std::to_string(l.offset) + ", rows " + std::to_string(l.rows) +
                                        ", blocks " + std::to_string(l.n_blocks) + ", coded tokens " +
                                        std::to_string(l.encoded) + ")");
  };
  if (l.offset > (uint64_t(1) << 40)) fail("token count above 2^40");
  if (l.rows > (uint64_t(1) << 32)) fail("more than 2^32 rows");
  if (l.offset > 0 && l.rows == 0) fail("tokens without a batch");
  if (l.n_blocks > l.encoded || l.encoded > l.offset) fail("more coded tokens than tokens");
  if (l.n_blocks > 0 && l.raw_tokens() < l.sinks) fail("blocks without their sink tokens");
  if (l.block == 0 || l.block > (uint64_t(1) << 20) || l.encoded > l.n_blocks * l.block)
    fail("blocks hold more than block tokens each");
}

std::vector<std::vector<std::vector<uint8_t>>> read_block_payloads(std::span<const uint8_t> section,
                                                                   uint64_t n_blocks, uint64_t rows,
                                                                   const std::string& what) {
  const uint64_t n = checked_mul(n_blocks, rows, what);
  if (n > section.size())
    throw Error(ErrorCode::kFormat, what + ": " + std::to_string(n_blocks) + " blocks of " + std::to_string(rows) +
                                        " payloads cannot fit in " + std::to_string(section.size()) + " bytes");
  kvcodec::ByteReader in(section, what);
  std::vector<std::vector<std::vector<uint8_t>>> out(static_cast<size_t>(n_blocks));
  for (auto& block : out) {
    block.reserve(size_t(rows));
    for (uint64_t r = 0; r < rows; ++r) {
      const auto bytes = in.bytes(size_t(in.count(in.remaining(), "payload length")));
      block.emplace_back(bytes.begin(), bytes.end());
    }
  }
  if (!in.at_end()) throw Error(ErrorCode::kFormat, what + ": " + std::to_string(in.remaining()) + " trailing bytes");
  return out;
}

void append_block_payloads(std::vector<uint8_t>& out, const std::vector<std::vector<uint8_t>>& payloads) {
  for (const auto& p : payloads) {
    append_varint(out, p.size());
    out.insert(out.end(), p.begin(), p.end());
  }
}

std::vector<std::vector<uint16_t>> read_raw_rows(std::span<const uint8_t> section, uint64_t rows,
                                                 uint64_t words_per_row, const std::string& what) {
  const uint64_t want = checked_mul(checked_mul(rows, words_per_row, what), 2, what);
  if (section.size() != want)
    throw Error(ErrorCode::kFormat, what + " holds " + std::to_string(section.size()) + " bytes, expected " +
                                        std::to_string(want));
  kvcodec::ByteReader in(section, what);
  std::vector<std::vector<uint16_t>> out(static_cast<size_t>(rows));
  for (auto& row : out) row = in.u16s(size_t(words_per_row));
  return out;
}

void expect_same_token_layout(int64_t saved_block, int64_t saved_sinks, int64_t saved_window, int64_t block,
                              int64_t sinks, int64_t window, const std::string& who) {
  const struct {
    const char* name;
    int64_t saved, mine;
  } fields[] = {{"block", saved_block, block}, {"sinks", saved_sinks, sinks}, {"window", saved_window, window}};
  for (const auto& f : fields)
    if (f.saved != f.mine)
      throw Error(ErrorCode::kConfig, who + ": the saved cache has " + f.name + " = " + std::to_string(f.saved) +
                                          ", this cache " + std::to_string(f.mine) +
                                          " (its tokens would come back out of order; load_cache makes a "
                                          "matching cache)");
}

}  // namespace kvcodec::cache_impl

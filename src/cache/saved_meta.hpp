// The one home of what every cache's save()/load() shares: integer
// metadata, the layout version of a method's sections, the LEB128 framing of
// block payloads, and the checks of a saved coded-token layout
// ([sinks raw][coded blocks][raw tail]) made before anything is sized by it.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec::cache_impl {

// meta[key] as an integer in [lo, hi]; Error(kFormat) naming the source, key and value otherwise.
inline int64_t meta_int(const ContainerReader& c, const std::string& key, int64_t lo, int64_t hi) {
  const std::string& v = c.meta_or_throw(key);
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || errno != 0 || end != v.c_str() + v.size() || x < lo || x > hi)
    throw Error(ErrorCode::kFormat, c.label() + ": meta " + key + " = '" + v + "' is not an integer in [" +
                                        std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

// A double as meta text that reads back as the same double (17 digits).
inline std::string double_text(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

inline void append_varint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(uint8_t(v | 0x80));
    v >>= 7;
  }
  out.push_back(uint8_t(v));
}

inline size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// a * b, or Error(kFormat) on overflow (sizes computed from untrusted meta).
uint64_t checked_mul(uint64_t a, uint64_t b, const std::string& what);

// Meta "layout": the version of the method's section layout. Files written
// before the key existed read as version 1 (the same bytes); a newer version
// is refused with Error(kUnsupported) naming both versions.
inline constexpr const char* kLayoutKey = "layout";
void write_layout_version(ContainerWriter& w, int version);
int read_layout_version(const ContainerReader& c, int newest, const std::string& who);

// A saved state of a coded cache, as its counters say: `offset` tokens,
// the first `encoded` of them after the sinks in `n_blocks` blocks, `rows`
// payloads per block, raw tokens of `token_words` 16-bit words per row.
struct CodedLayout {
  uint64_t rows = 0;         // B*H (local kvtc) or B (calibrated kvtc)
  uint64_t token_words = 0;  // D (local) or H*D (calibrated)
  uint64_t block = 0;        // tokens per full block (the cache's setting)
  uint64_t sinks = 0;        // the cache's setting
  uint64_t offset = 0;
  uint64_t n_blocks = 0;
  uint64_t encoded = 0;      // tokens held in blocks
  uint64_t raw_tokens() const { return offset - encoded; }
};
// Error(kFormat) naming `who` unless the counters describe a state the cache
// can hold: offset and rows bounded, encoded <= offset, blocks only after
// every sink token, and no blocks without rows.
void check_coded_layout(const CodedLayout& l, const std::string& who);

// n_blocks x rows payloads, each a varint length and its bytes, filling the
// section exactly. The count is checked against the bytes (each payload
// costs at least its one-byte length) before anything is allocated.
std::vector<std::vector<std::vector<uint8_t>>> read_block_payloads(std::span<const uint8_t> section,
                                                                   uint64_t n_blocks, uint64_t rows,
                                                                   const std::string& what);
void append_block_payloads(std::vector<uint8_t>& out, const std::vector<std::vector<uint8_t>>& payloads);

// rows x words_per_row little-endian 16-bit words, exactly the section's
// size (checked multiplication, so no size wraps around).
std::vector<std::vector<uint16_t>> read_raw_rows(std::span<const uint8_t> section, uint64_t rows,
                                                 uint64_t words_per_row, const std::string& what);

// The settings that place tokens (block, sinks, window): a saved cache made
// with others would return its tokens in the wrong order. Error(kConfig)
// naming the field and both values.
void expect_same_token_layout(int64_t saved_block, int64_t saved_sinks, int64_t saved_window, int64_t block,
                              int64_t sinks, int64_t window, const std::string& who);

}  // namespace kvcodec::cache_impl

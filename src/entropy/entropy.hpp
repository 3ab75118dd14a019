// kvcodec::entropy: entropy coders for quantized transform coefficients.
//
// The KVTC codec quantizes a block of T tokens x C principal components into
// integer symbols laid out token-major: symbols[t * C + c] is component c of
// token t. Component c is coded with its own static model, frozen at fit time,
// so every symbol of every alphabet keeps a nonzero probability and later
// blocks always code. Columns may be skipped (dropped components): they are
// not coded and decode to 0.
//
// Three coders share that multi-column layout:
//   - rANS (default): 32-bit state, byte-wise renormalisation, kRansLanes
//     interleaved lanes (coded symbol i goes to lane i % kRansLanes);
//   - canonical Huffman with code lengths limited to kHuffmanMaxLength bits;
//   - fixed-width bit packing.
// Streams carry no header: the caller knows rows, columns and tables. Every
// decoder treats its input as hostile: it never reads or writes out of
// bounds, never loops unboundedly, and throws Error(kFormat) when the bytes
// are truncated or inconsistent.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kvcodec/error.hpp"

namespace kvcodec::entropy {

// --- bit I/O -----------------------------------------------------------------
//
// Bits are LSB-first: the first bit written is bit 0 of byte 0. A value of n
// bits is written low bit first, so put(v, n) followed by get(n) returns v.

class BitWriter {
 public:
  // Appends the low nbits (0..32) of value; higher bits of value must be 0.
  void put(uint32_t value, unsigned nbits);
  void put_bit(bool bit) { put(bit ? 1u : 0u, 1); }
  // Elias gamma code of v >= 1: floor(log2 v) zeros, a one, then the low
  // floor(log2 v) bits of v. 2*floor(log2 v)+1 bits.
  void put_gamma(uint64_t v);
  size_t bit_count() const { return bits_; }
  // The bytes written so far, the last one zero-padded.
  std::vector<uint8_t> bytes() const;

 private:
  std::vector<uint8_t> buf_;  // complete bytes
  uint64_t acc_ = 0;          // pending bits (< 8 between calls)
  unsigned pending_ = 0;
  size_t bits_ = 0;
};

class BitReader {
 public:
  BitReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  // Reads nbits (0..32); throws Error(kFormat) when that goes past the end.
  // Where 8 bytes are left from the current byte on, one 64-bit load (the
  // frequency-table parse of a kvtc head opening is most of its reads);
  // else, and on a big-endian machine, get_reference.
  uint32_t get(unsigned nbits) {
    const size_t byte = pos_ >> 3;
    if (std::endian::native == std::endian::little && nbits <= 32 && byte + 8 <= size_) {
      uint64_t w;
      std::memcpy(&w, data_ + byte, 8);
      const unsigned off = unsigned(pos_ & 7);
      pos_ += nbits;
      return uint32_t((w >> off) & ((uint64_t(1) << nbits) - 1));
    }
    return get_reference(nbits);
  }
  bool get_bit() { return get(1) != 0; }
  // Reads an Elias gamma code with at most max_zeros leading zeros (<= 63);
  // more zeros is a format error (so corrupt input cannot make it spin).
  // A code of up to 28 zeros within the next 8 bytes is read from one
  // 64-bit load; anything else (longer codes, errors, the stream's last
  // bytes) as get_gamma_reference does.
  uint64_t get_gamma(unsigned max_zeros = 32) {
    const size_t byte = pos_ >> 3;
    if (std::endian::native == std::endian::little && byte + 8 <= size_) {
      uint64_t w;
      std::memcpy(&w, data_ + byte, 8);
      w >>= pos_ & 7;  // >= 57 valid bits
      const unsigned zeros = w ? unsigned(std::countr_zero(w)) : 64;
      if (zeros <= 28 && zeros <= max_zeros) {
        pos_ += 2 * zeros + 1;
        return (uint64_t(1) << zeros) | ((w >> (zeros + 1)) & ((uint64_t(1) << zeros) - 1));
      }
    }
    return get_gamma_reference(max_zeros);
  }
  // The plain readers (bit by bit within each byte) that get and get_gamma
  // equal, value, position and errors; what they run where their fast path
  // does not apply.
  uint32_t get_reference(unsigned nbits);
  uint64_t get_gamma_reference(unsigned max_zeros = 32);
  size_t bits_consumed() const { return pos_; }
  size_t bits_left() const { return size_ * 8 - pos_; }
  // Bytes touched so far (the partial last byte counts).
  size_t bytes_consumed() const { return (pos_ + 7) / 8; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;  // in bits
};

// --- frequency tables (rANS models) -----------------------------------------

inline constexpr uint32_t kMaxScaleBits = 16;
inline constexpr uint32_t kMaxAlphabet = 1u << 16;  // symbols are uint16_t
inline constexpr double kDefaultPrecisionLoss = 0.002;

struct FrequencyTable {
  uint32_t alphabet_size = 0;
  uint32_t scale_bits = 0;      // freq sums to 1 << scale_bits
  std::vector<uint32_t> freq;   // [alphabet_size], every entry >= 1
  std::vector<uint32_t> cum;    // [alphabet_size + 1], cum[s] = sum freq[0..s)

  uint32_t total() const { return 1u << scale_bits; }

  // max(12, ceil(log2 alphabet) + 2) capped at 16: 12 bits keep decode tables
  // in L1 for the small alphabets that dominate; +2 bits above the alphabet
  // leave every symbol room for at least ~4 slots on average so the forced
  // minimum of 1 costs little.
  static uint32_t default_scale_bits(uint32_t alphabet_size);

  // Quantizes counts (one per symbol; alphabet_size = counts.size()) to
  // frequencies summing to exactly 1 << scale_bits, each >= 1, minimising
  // sum counts[s] * -log2(freq[s] / total) (optimal: greedy on the convex
  // per-symbol costs). scale_bits 0 = adaptive: default_scale_bits(), raised
  // (up to 16) while the rate loss against the counts' empirical entropy
  // exceeds 0.5% (e.g. many never-seen symbols). All-zero counts
  // give a near-uniform table. Then, unless precision_loss is 0, all
  // frequencies but the largest are rounded to the fewest significant bits
  // that keep the rate within precision_loss (relative) of that optimum: the
  // serialised table shrinks by about half for a 0.2% rate cost.
  // Throws Error(kInvalidArgument) for an empty or too-large alphabet or a
  // scale that cannot give every symbol a slot.
  static FrequencyTable from_counts(const std::vector<uint64_t>& counts, uint32_t scale_bits = 0,
                                    double precision_loss = kDefaultPrecisionLoss);
  // Builds from explicit frequencies; validates (sum, >= 1, sizes) and throws
  // Error(kInvalidArgument) naming what is wrong.
  static FrequencyTable from_freqs(std::vector<uint32_t> freq, uint32_t scale_bits);

  // Compact form: gamma(alphabet), 4 bits scale, index of the largest
  // frequency (implied by the sum), 4 bits precision p, then the others as
  // floating point: exponent delta-coded from the previous symbol's (zigzag,
  // gamma) and p-1 mantissa bits; gamma-coded runs of 1s (the flat tails).
  // Exact for any table (p is the most significant bits any entry needs).
  void serialize(BitWriter& out) const;
  size_t serialized_bits() const;
  // Validates everything (alphabet <= max_alphabet, scale, each freq >= 1,
  // exact sum); throws Error(kFormat) on bad input.
  static FrequencyTable deserialize(BitReader& in, uint32_t max_alphabet);
  // The same table parsed into `out`, whose vectors keep their capacity (a
  // kvtc cache opening a head per call parses into last call's storage:
  // no allocation once it has grown). On an error `out` holds junk.
  static void deserialize_into(BitReader& in, uint32_t max_alphabet, FrequencyTable& out);

  // sum counts[s] * -log2(freq[s] / total): the ideal payload in bits.
  // counts.size() must be <= alphabet_size (missing symbols count 0).
  double cost_bits(const std::vector<uint64_t>& counts) const;

  uint64_t held_bytes() const;  // heap bytes of freq and cum (capacity)

  bool operator==(const FrequencyTable& o) const {
    return alphabet_size == o.alphabet_size && scale_bits == o.scale_bits && freq == o.freq;
  }
};

// --- rANS ----------------------------------------------------------------------

inline constexpr size_t kRansLanes = 8;            // interleaved states
inline constexpr uint32_t kRansLow = 1u << 23;     // states live in [kRansLow, kRansLow << 8)
inline constexpr uint32_t kRansSearchMax = 33;     // largest alphabet decoded by search (see RansDecodeTable)
// The AVX2 group decoder's compare search covers alphabets up to 65 symbols
// at scales up to 14 bits (see RansGroupTables).
inline constexpr uint32_t kRansGroupMaxAlphabet = 65;
inline constexpr uint32_t kRansGroupMaxScale = 14;

// Which lookup table a RansDecodeTable keeps for the scalar lanes.
enum class RansLookup : uint8_t {
  // None where the AVX2 group decoder covers the alphabet (see
  // RansDecodeTable), kScalar's table otherwise (and in builds without AVX2).
  kAuto,
  // For a column the scalar lanes decode throughout (one in a group the
  // group decoder cannot search, see RansGroupTables::Group::scalar): the
  // search table where it applies, else the slot table.
  kScalar,
};

// slot -> symbol lookup, built once per frozen table and cached by the caller.
// Two bytes per slot plus (freq, cum) per symbol: with one table per
// component (64+ per tensor) the tables must stay small to stay in cache.
struct RansDecodeTable {
  struct Sym {
    uint32_t freq;
    uint32_t cum;
  };
  uint32_t alphabet_size = 0;
  uint32_t scale_bits = 0;
  std::vector<uint16_t> slot_symbol;  // [1 << scale_bits] entries < alphabet_size, or empty (search)
  std::vector<Sym> syms;              // [alphabet_size]
  // Small alphabets (<= kRansSearchMax symbols, scale_bits <= 14): cum[1..]
  // as 16-bit entries padded with 0x7fff to kRansSearchMax - 1 + 1 = 32, and
  // no slot table: the decoder finds a slot's symbol by counting the entries
  // <= slot (two vector compares with AVX2, a plain loop without). A
  // 64-column head then decodes from 2 KB of tables instead of 512 KB, which
  // thrash the L2 cache (every slot is equally likely, so the whole slot
  // table is hot) and would be most of a cache's resident bytes.
  std::vector<uint16_t> search;       // [32] or empty (slot_symbol)
  // Neither table (RansLookup::kAuto in AVX2 builds, alphabets of at most
  // kRansGroupMaxAlphabet symbols at scales <= kRansGroupMaxScale): the
  // group decoder reads its own keys (RansGroupTables) and the scalar
  // lanes, which decode only a stream's last few symbols there, bisect
  // syms' cum. The slot tables (8 KB per component at 12 bits) were most
  // of a local-mode kvtc cache's resident bytes.

  RansDecodeTable() = default;
  explicit RansDecodeTable(const FrequencyTable& table, RansLookup lookup = RansLookup::kAuto);
  uint64_t held_bytes() const;  // heap bytes (capacity)
  // The symbol owning `slot` (< 2^scale_bits), whichever table was built:
  // for decoders outside this module (the cache's stack-order coder).
  // Inline: the stack-order decoder calls it once per symbol.
  uint32_t symbol_of(uint32_t slot) const;
};

inline uint32_t RansDecodeTable::symbol_of(uint32_t slot) const {
  if (!slot_symbol.empty()) return slot_symbol[slot];
  const uint32_t last = alphabet_size - 1;
  if (!search.empty()) {
    uint32_t sym = 0;
    for (const uint16_t c : search) sym += uint32_t(c <= slot);
    return sym < last ? sym : last;
  }
  // The largest s with cum[s] <= slot (cum[0] = 0 <= every slot).
  uint32_t lo = 0;
  for (uint32_t step = std::bit_floor(last ? last : 1u); step != 0; step >>= 1) {
    const uint32_t m = std::min(lo + step, last);
    lo = syms[m].cum <= slot ? m : lo;
  }
  return lo;
}


// RansEncodeTable's reciprocal ceil(2^(31 + l) / f) of a frequency f in
// [2, 2^16], l = ceil(log2 f), by the plain 64-bit integer division (the
// reference) and by a double division: 2^(31 + l) and f are exact doubles,
// the quotient (< 2^32) is rounded by less than 2^-21, and a non-integer
// quotient N / f lies at least 1 / f >= 2^-16 from an integer, so the
// rounded quotient has the same ceiling. The double division pipelines
// where the integer one does not (a kvtc head opening builds one per
// symbol of every table). Test RansFast.ReciprocalEqualsTheIntegerDivision
// (every f).
inline uint32_t rans_rcp_reference(uint32_t f, uint32_t l) {
  return uint32_t(((uint64_t(1) << (31 + l)) + f - 1) / f);
}
inline uint32_t rans_rcp(uint32_t f, uint32_t l) {
  const double q = double(uint64_t(1) << (31 + l)) / double(f);
  const uint64_t t = uint64_t(q);  // floor (q > 0)
  return uint32_t(t + uint64_t(double(t) != q));
}

// Division-free encoder constants of one frozen table, built once and cached
// by the caller. Encoding symbol s from state x (after renormalisation):
// q = floor(x / freq) = (x * rcp) >> (32 + shift), exact for x < 2^31 (every
// state is), then x' = x + bias + q * cmpl_freq, which equals the textbook
// (q << scale) + x % freq + cum. freq == 1 uses rcp = 2^32 - 1 (q = x - 1)
// with the difference folded into bias.
struct RansEncodeTable {
  struct Sym {
    uint32_t x_max;      // renormalise (emit bytes) while x >= x_max
    uint32_t rcp;        // ceil(2^(31 + l) / freq), l = ceil(log2 freq)
    uint32_t bias;       // cum (+ 2^scale - 1 when freq == 1)
    uint16_t cmpl_freq;  // 2^scale - freq
    uint16_t shift;      // l - 1 (0 when freq == 1)
  };
  uint32_t alphabet_size = 0;
  uint32_t scale_bits = 0;
  std::vector<Sym> syms;  // [alphabet_size]
  uint64_t held_bytes() const { return uint64_t(syms.capacity()) * sizeof(Sym); }

  RansEncodeTable() = default;
  // Throws Error(kInvalidArgument) for a table that is not a valid model.
  explicit RansEncodeTable(const FrequencyTable& table) { assign(table); }
  // The same constants rebuilt in place, syms keeping its capacity (a
  // per-thread opening reuses one); the same errors (syms then junk).
  void assign(const FrequencyTable& table);
};

// The AVX2 decoder's per-group model tables of one column sequence (the
// non-skipped columns of a rans_decode table list), built once per frozen set
// of tables (kvtc::HeadParams::build_decoders) instead of on every call.
// Plain values: copies stay valid. Stale if the tables change afterwards:
// rebuild then. Empty (usable == false) where the group decoder does not
// apply (an alphabet > 65 or a scale > 14) or without AVX2.
struct RansGroupTables {
  struct Group {
    alignas(32) int32_t scale[8];
    alignas(32) int32_t mask[8];
    alignas(32) int32_t key0[8];  // freq[0] (cum[0] = 0)
    size_t first = 0;             // offset of the group's row 1 in rows
    uint32_t rows = 0;            // largest alphabet of the group - 1
    bool scalar = false;          // many columns past the search's limits: the group takes the scalar lanes
    // Lanes (bit j: lane j) whose column is past the search's limits, in a
    // vector group: their symbols come from their columns' own decode
    // tables after the search, which ignores them.
    uint8_t scalar_lanes = 0;
    bool apart = false;  // scalar or scalar_lanes: stepped alone, outside the two-stream loop
    // The window search (packed keys only): per lane the wrows + 1 most
    // probable consecutive symbols a .. a + wrows. When every lane's slot
    // lies in its window (key of a <= bound < key of a + wrows + 1), the
    // search over the window's rows alone finds the same key; otherwise
    // the whole search runs. Chosen by build when it saves rows on average.
    alignas(32) int32_t wfloor[8];  // key of symbol a (the search's start)
    alignas(32) int32_t wceil[8];   // key of symbol a + wrows + 1, or 0x7fffffff past the alphabet
    size_t wfirst = 0;              // offset of the window's rows in rows
    uint32_t wrows = 0;
    bool windowed = false;
  };
  // One group per first column position k0 reachable from 0 in steps of 8
  // (n_active / gcd(n_active, 8) of them), in visiting order; group_at
  // [n_active] maps k0 to its index in groups (0 for unreachable k0).
  std::vector<Group> groups;
  std::vector<uint32_t> group_at;
  std::vector<int32_t> rows;  // transposed keys, 8 per row
  size_t n_active = 0;        // non-skipped columns they were built for
  bool packed = false;        // keys cum << 19 | s << 13 | freq (else cum << 16 | freq)
  bool usable = false;
  bool any_scalar = false;    // some group has scalar or scalar_lanes set (reads the columns' own tables)
  // The decode tables these were built (and validated) from: a decode
  // given exactly these pointers skips re-validating them per call.
  std::vector<const RansDecodeTable*> built_from;
  uint64_t held_bytes() const;  // heap bytes (capacity)
};
RansGroupTables rans_group_tables(const std::vector<const RansDecodeTable*>& tables);
// The same tables with the window lengths chosen by plain loops over the
// frequencies (the reference the branch-free search is tested against).
RansGroupTables rans_group_tables_reference(const std::vector<const RansDecodeTable*>& tables);

// Codes the non-skipped columns of symbols[n_rows x n_cols] (token-major).
// tables.size() == n_cols; nullptr skips a column. Output: the final states
// of the lanes that received a symbol (4 bytes each, little-endian, lane 0
// first) then the renormalisation bytes; empty when nothing is coded.
// A symbol >= its table's alphabet throws Error(kInvalidArgument).
std::vector<uint8_t> rans_encode(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                 const std::vector<const FrequencyTable*>& tables);
// Same bytes as rans_encode, through the precomputed constants (no division,
// no separate validation pass): the encoder the KVTC codec runs.
std::vector<uint8_t> rans_encode(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                 const std::vector<const RansEncodeTable*>& tables);
// One stream's input to rans_encode_pair (rans_encode's arguments).
struct RansEncodeInput {
  const uint16_t* symbols;
  size_t n_rows, n_cols;
  const std::vector<const RansEncodeTable*>* tables;
};
// Two independent streams, each the bytes rans_encode gives it: their
// group loops run side by side where the CPU has the 32-register vector
// encoding (one stream's state update is a ~20-cycle chain that its loop
// waits on), else one after the other. Errors as rans_encode's (a's first).
std::pair<std::vector<uint8_t>, std::vector<uint8_t>> rans_encode_pair(const RansEncodeInput& a,
                                                                      const RansEncodeInput& b);
// The same without the AVX2 group encoder (scalar lanes only); same bytes.
std::vector<uint8_t> rans_encode_portable(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                          const std::vector<const RansEncodeTable*>& tables);
// The AVX2 group encoder addressing every lane's table row by pointer (the
// path rans_encode falls back to when the tables lie more than ~2 GiB
// apart, so 32-bit offsets cannot reach them); same bytes. For tests.
std::vector<uint8_t> rans_encode_vector_pointers(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                                 const std::vector<const RansEncodeTable*>& tables);
// The AVX2 group encoder with the form of its state update that this
// build's tuning does not pick (blends and vpmulld for Zen, a shift count
// and vpmuludq otherwise); same bytes. For tests.
std::vector<uint8_t> rans_encode_other_chain(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                             const std::vector<const RansEncodeTable*>& tables);
// Inverse of rans_encode; out has n_rows * n_cols entries, skipped columns get
// 0. Throws Error(kFormat) when the stream is truncated, has trailing bytes or
// ends in states other than the initial ones.
void rans_decode(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols,
                 const std::vector<const RansDecodeTable*>& tables, uint16_t* out);
// The same with the group tables prebuilt (rans_group_tables(tables)).
void rans_decode(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols,
                 const std::vector<const RansDecodeTable*>& tables, uint16_t* out, const RansGroupTables& groups);

// Independent streams decoded together (a block's keys and values, of one
// or two heads): the same results and errors as rans_decode of each in
// order (the first failing stream's error is thrown), faster where the
// vectorised decoder is latency-bound, since the streams' steps overlap
// (four in lockstep where four can step, else two).
struct RansDecodeJob {
  const uint8_t* data = nullptr;
  size_t size = 0;
  size_t n_rows = 0, n_cols = 0;
  const std::vector<const RansDecodeTable*>* tables = nullptr;
  uint16_t* out = nullptr;
  const RansGroupTables* groups = nullptr;  // rans_group_tables(*tables), or null: built per call
};
inline constexpr size_t kRansMaxStreams = 4;
// jobs[0, n), n <= kRansMaxStreams (more: Error(kInvalidArgument)).
void rans_decode_streams(const RansDecodeJob* jobs, size_t n);
void rans_decode_pair(const RansDecodeJob& a, const RansDecodeJob& b);
// rans_decode without the AVX2 group decoder (scalar lanes only): the plain
// path the vectorised one is tested against; same results and errors.
void rans_decode_portable(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols,
                          const std::vector<const RansDecodeTable*>& tables, uint16_t* out);

// Plain single-lane coder: the reference the interleaved one is tested
// against (same symbol order, one state, 4 flush bytes).
std::vector<uint8_t> rans_encode_reference(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                           const std::vector<const FrequencyTable*>& tables);
void rans_decode_reference(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols,
                           const std::vector<const FrequencyTable*>& tables, uint16_t* out);

// --- canonical Huffman -----------------------------------------------------------

inline constexpr unsigned kHuffmanMaxLength = 15;
inline constexpr uint32_t kHuffmanMaxAlphabet = 1u << kHuffmanMaxLength;
inline constexpr unsigned kHuffmanLutBits = 11;
inline constexpr uint32_t kHuffmanLongCode = 0x80000000u;

struct HuffmanTable {
  uint32_t alphabet_size = 0;
  uint32_t max_length = 0;           // longest code (0 for a 1-symbol alphabet)
  std::vector<uint8_t> lengths;      // [alphabet_size], 1..15 (all 0 when alphabet is 1)
  std::vector<uint16_t> codes;       // bit-reversed canonical codes, ready for LSB-first output
  // Decoding: one lookup of the next lut_bits (<= kHuffmanLutBits) bits gives
  // symbol | length << 16, or kHuffmanLongCode for a prefix of a longer code,
  // which is then decoded canonically (first code and count per length).
  // Keeping the table at 2^11 entries keeps 64+ per-component tables in cache.
  uint32_t lut_bits = 0;
  std::vector<uint32_t> lut;         // [1 << lut_bits]
  std::vector<uint16_t> sorted;      // symbols in canonical order
  uint32_t first_code[kHuffmanMaxLength + 2] = {};  // MSB-first canonical code of the first symbol of each length
  uint32_t count[kHuffmanMaxLength + 2] = {};       // symbols of each length
  uint32_t offset[kHuffmanMaxLength + 2] = {};      // index in sorted of the first symbol of each length

  // Complete prefix code from lengths (Kraft sum exactly 1, or a single
  // symbol with length 0); throws Error(kInvalidArgument) otherwise.
  static HuffmanTable from_lengths(std::vector<uint8_t> lengths);

  // Code lengths: gamma(alphabet), then each length as a zigzag delta from
  // the previous one, gamma coded (smooth distributions give ~1 bit each).
  void serialize(BitWriter& out) const;
  size_t serialized_bits() const;
  static HuffmanTable deserialize(BitReader& in, uint32_t max_alphabet);

  // sum counts[s] * lengths[s]; counts.size() <= alphabet_size.
  uint64_t cost_bits(const std::vector<uint64_t>& counts) const;

  uint64_t held_bytes() const;  // heap bytes of lengths, codes, lut, sorted (capacity)

  bool operator==(const HuffmanTable& o) const {
    return alphabet_size == o.alphabet_size && lengths == o.lengths;
  }
};

// Optimal length-limited (package-merge) code lengths for counts; every
// symbol gets a code (zero counts are weighted as a tiny fraction of a count).
HuffmanTable huffman_build(const std::vector<uint64_t>& counts);

std::vector<uint8_t> huffman_encode(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                    const std::vector<const HuffmanTable*>& tables);
// Throws Error(kFormat) on truncated input, trailing bytes or nonzero padding.
void huffman_decode(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols,
                    const std::vector<const HuffmanTable*>& tables, uint16_t* out);

// --- fixed-width packing ------------------------------------------------------------

// Bits of pack_fixed's payload: n_rows * sum(widths) (before rounding to bytes).
uint64_t fixed_bits(size_t n_rows, const std::vector<uint8_t>& widths);
// widths[c] in 0..16 bits (0 = skipped); symbols must fit their width, else
// Error(kInvalidArgument). LSB-first, token-major, last byte zero-padded.
std::vector<uint8_t> pack_fixed(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                const std::vector<uint8_t>& widths);
// size must be exactly ceil(fixed_bits / 8) with zero padding, else Error(kFormat).
void unpack_fixed(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols,
                  const std::vector<uint8_t>& widths, uint16_t* out);

// --- coder choice -----------------------------------------------------------------

enum class Coder : uint8_t { kFixed = 0, kHuffman = 1, kRans = 2 };  // simplest first
const char* coder_name(Coder coder);
Coder parse_coder(const std::string& name);  // "rans" | "huffman" | "fixed"

struct CoderSize {
  uint64_t table_bits = 0;    // tables exactly as serialised (fixed: 0, widths are the allocation)
  uint64_t payload_bits = 0;  // whole bytes of the stream(s), times 8
  uint64_t total_bits() const { return table_bits + payload_bits; }
};

struct CoderChoice {
  CoderSize fixed, huffman, rans;
  Coder best = Coder::kFixed;  // strictly smallest total; ties go to the simpler coder
  const CoderSize& size_of(Coder c) const;
};

// Sizes of coding symbols whose per-column histograms are column_counts
// (size n_cols; columns with a null table / width 0 are skipped and must be
// consistent across the three) as n_streams equal streams (e.g. blocks).
// Fixed and Huffman payloads are exact; the rANS payload is the ideal cost
// plus the lane flush, rounded up to bytes per stream (the real stream is
// within a few bytes of it). Tables count once. A null table for a column
// that a coder needs makes that coder unavailable (size = UINT64_MAX total).
CoderChoice choose_coder(const std::vector<std::vector<uint64_t>>& column_counts,
                         const std::vector<const FrequencyTable*>& rans_tables,
                         const std::vector<const HuffmanTable*>& huffman_tables,
                         const std::vector<uint8_t>& fixed_widths, size_t n_streams = 1);

// Exact variant for one stream: encodes with each coder and measures.
CoderChoice choose_coder_exact(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                               const std::vector<const FrequencyTable*>& rans_tables,
                               const std::vector<const HuffmanTable*>& huffman_tables,
                               const std::vector<uint8_t>& fixed_widths);

}  // namespace kvcodec::entropy

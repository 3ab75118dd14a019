// rANS with 32-bit states and byte-wise renormalisation (after ryg_rans):
// states live in [kRansLow, kRansLow << 8); the encoder runs backwards over
// the symbols writing bytes towards the front of its buffer, the decoder runs
// forwards. Coded symbol i (row-major over the non-skipped columns) belongs
// to lane i % kRansLanes, so the decoder's lanes are independent dependency
// chains the CPU overlaps.
#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/cpu_features.hpp"
#include "entropy/entropy.hpp"

// The AVX2 coders are compiled for AVX2 alone (KVCODEC_AVX2_BEGIN/END) and
// run where simd_avx2(); the scalar lanes give the same bytes and symbols.
#ifdef KVCODEC_HAVE_AVX2_PATHS
#include <immintrin.h>
#define KVCODEC_RANS_AVX2 1
#endif

namespace kvcodec::entropy {
namespace {

[[noreturn]] void bad_stream(const std::string& what) { throw Error(ErrorCode::kFormat, "rANS stream: " + what); }

template <typename T>
std::vector<uint32_t> active_columns(size_t n_cols, const std::vector<const T*>& tables, const char* who) {
  if (tables.size() != n_cols)
    throw Error(ErrorCode::kInvalidArgument, std::string(who) + ": " + std::to_string(tables.size()) + " tables for " +
                                                 std::to_string(n_cols) + " columns");
  std::vector<uint32_t> cols;
  for (size_t c = 0; c < n_cols; ++c)
    if (tables[c]) cols.push_back(uint32_t(c));
  return cols;
}

size_t checked_count(size_t n_rows, size_t n_cols, const char* who) {
  if (n_cols != 0 && n_rows > (SIZE_MAX / 4) / n_cols)
    throw Error(ErrorCode::kInvalidArgument, std::string(who) + ": " + std::to_string(n_rows) + " x " +
                                                 std::to_string(n_cols) + " symbols is too many");
  return n_rows * n_cols;
}

[[noreturn]] void symbol_out_of_range(size_t row, uint32_t col, uint32_t sym, uint32_t alphabet) {
  throw Error(ErrorCode::kInvalidArgument, "entropy encode: symbol " + std::to_string(sym) + " at row " +
                                               std::to_string(row) + ", column " + std::to_string(col) +
                                               " is outside the alphabet of size " + std::to_string(alphabet));
}

inline void put_state(uint8_t* p, uint32_t x) {
  p[0] = uint8_t(x), p[1] = uint8_t(x >> 8), p[2] = uint8_t(x >> 16), p[3] = uint8_t(x >> 24);
}
inline uint32_t get_state(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

// One encode step: renormalise (emit low bytes) so the result stays below
// kRansLow << 8, then x -> (x / f) * M + x % f + cum.
inline uint32_t encode_step(uint32_t x, uint8_t*& p, uint32_t f, uint32_t start, uint32_t scale) {
  const uint32_t x_max = ((kRansLow >> scale) << 8) * f;
  while (x >= x_max) {
    *--p = uint8_t(x);
    x >>= 8;
  }
  return ((x / f) << scale) + (x % f) + start;
}

// Validates symbols up front so encode never writes a partial stream.
void check_symbols(const uint16_t* symbols, size_t n_rows, size_t n_cols, const std::vector<uint32_t>& cols,
                   const std::vector<const FrequencyTable*>& tables) {
  for (size_t r = 0; r < n_rows; ++r)
    for (uint32_t c : cols) {
      const uint16_t s = symbols[r * n_cols + c];
      if (s >= tables[c]->alphabet_size) symbol_out_of_range(r, c, s, tables[c]->alphabet_size);
    }
}

void check_tables(const std::vector<uint32_t>& cols, const std::vector<const FrequencyTable*>& tables) {
  for (uint32_t c : cols) {
    const FrequencyTable& t = *tables[c];
    if (t.scale_bits < 1 || t.scale_bits > kMaxScaleBits || t.freq.size() != t.alphabet_size ||
        t.cum.size() != size_t(t.alphabet_size) + 1 || t.cum.back() != t.total())
      throw Error(ErrorCode::kInvalidArgument, "rans_encode: table of column " + std::to_string(c) +
                                                   " is not a valid FrequencyTable (build it with from_counts/from_freqs)");
  }
}

void check_decode_tables(const std::vector<uint32_t>& cols, const std::vector<const RansDecodeTable*>& tables) {
  for (uint32_t c : cols) {
    const RansDecodeTable& t = *tables[c];
    // Exactly one of the slot table and the search table.
    const bool slots = t.slot_symbol.size() == (size_t(1) << t.scale_bits) && t.search.empty();
    const bool search = t.slot_symbol.empty() && t.search.size() == 32 && t.alphabet_size <= kRansSearchMax;
    const bool bisect = t.slot_symbol.empty() && t.search.empty() && t.alphabet_size <= kRansGroupMaxAlphabet &&
                        t.scale_bits <= kRansGroupMaxScale;
    if (t.scale_bits < 1 || t.scale_bits > kMaxScaleBits || !(slots || search || bisect) ||
        t.syms.size() != t.alphabet_size ||
        t.alphabet_size == 0)
      throw Error(ErrorCode::kInvalidArgument,
                  "rans_decode: decode table of column " + std::to_string(c) + " is not built from a FrequencyTable");
  }
}

// Per-column data the decoder's inner loop needs, contiguous.
struct DecCol {
  const uint16_t* slot_symbol;  // or null: bisect syms
  const RansDecodeTable::Sym* syms;
  const uint16_t* search;  // RansDecodeTable::search, or null: use slot_symbol
  uint32_t scale;
  uint32_t mask;
  uint32_t last;  // alphabet_size - 1
};

DecCol dec_col(const RansDecodeTable& t) {
  return DecCol{t.slot_symbol.empty() ? nullptr : t.slot_symbol.data(), t.syms.data(),
                t.search.empty() ? nullptr : t.search.data(),
                t.scale_bits, (1u << t.scale_bits) - 1, t.alphabet_size - 1};
}

// The symbol owning slot: the slot table, or (small alphabets) the number
// of cumulative frequencies cum[1..] that are <= slot (32 compares the
// compiler vectorises: with AVX2 where the AVX2 decoder inlines it).
inline uint32_t lookup_symbol(const DecCol& c, uint32_t slot) {
  if (c.search) {
    uint32_t sym = 0;
    for (int i = 0; i < 32; ++i) sym += uint32_t(c.search[i] <= slot);
    return sym < c.last ? sym : c.last;  // a table built by the constructor never needs the clamp
  }
  if (__builtin_expect(c.slot_symbol != nullptr, 1)) return c.slot_symbol[slot];
  // Neither table (see RansDecodeTable): the largest s with cum[s] <= slot
  // (cum[0] = 0 <= every slot), by a branchless bisection (the steps sum to
  // >= last; selects, not branches, so the 8 lanes' searches overlap).
  uint32_t lo = 0;
  for (uint32_t step = std::bit_floor(c.last); step != 0; step >>= 1) {
    const uint32_t m = std::min(lo + step, c.last);
    lo = c.syms[m].cum <= slot ? m : lo;
  }
  return lo;
}

// Whether a whole group of kRansLanes symbols is left and can be decoded
// without per-byte checks: 2 bytes per lane at most (see scalar_group).
inline bool group_fits(size_t i, size_t n_coded, const uint8_t* p, const uint8_t* end) {
  return i + kRansLanes <= n_coded && size_t(end - p) >= 2 * kRansLanes;
}

// Past one group: i by kRansLanes symbols, k0 by as many columns of the
// n_active-column cycle.
inline void next_group(size_t& i, size_t& k0, size_t n_active) {
  i += kRansLanes;
  k0 += kRansLanes;
  while (k0 >= n_active) k0 -= n_active;
}

// One group of kRansLanes symbols (columns c[0..7], lane states x) by the
// scalar lanes; reads at most 2 bytes per lane from p (after a decode step
// x >= 2^(23 - scale) >= 2^7), so 2 * kRansLanes bytes left need no check.
inline void scalar_group(const DecCol* c, uint32_t* x, const uint8_t*& p, uint16_t* dst) {
#pragma GCC unroll 8
  for (size_t j = 0; j < kRansLanes; ++j) {
    uint32_t s = x[j];
    const uint32_t slot = s & c[j].mask;
    const uint32_t sym = lookup_symbol(c[j], slot);
    const RansDecodeTable::Sym e = c[j].syms[sym];
    dst[j] = uint16_t(sym);
    s = e.freq * (s >> c[j].scale) + slot - e.cum;
    // Branchless renormalisation. The bytes to pull follow from s alone
    // (s << 8 | b < 2^23 iff s < 2^15), so the shared stream pointer
    // advances by a value computed off the loads: the lanes' only serial
    // dependency is one add per symbol.
    const uint32_t n = uint32_t(s < kRansLow) + uint32_t(s < (kRansLow >> 8));
    const uint32_t v = (uint32_t(p[0]) << 8) | p[1];  // in bounds: >= 2 bytes left per symbol
    s = (s << (8 * n)) | (v >> (16 - 8 * n));         // n = 0: v >> 16 == 0
    p += n;
    x[j] = s;
  }
}

#ifdef KVCODEC_RANS_AVX2
// --- 8-lane AVX2 decoder (same bitstream) --------------------------------------
//
// All 8 lane states sit in one __m256i. With K coded columns the group of 8
// symbols starting at coded index i covers columns k0 .. k0 + 7 of the
// (unrolled) column cycle, k0 = i mod K: at most K distinct groups. For each
// the lanes' models are stored transposed: row s (s >= 1) holds, per lane,
// key = cum[s] << 16 | freq[s] (2^scale << 16 past a column's alphabet, which
// no slot reaches). A lane's symbol is the number of rows with cum[s] <= slot,
// and the largest such key (or cum[0] = 0 with freq[0]) carries both cum and
// freq of that symbol: per row one compare, one and, one max, one subtract.
// Renormalisation reads n_j = 0..2 bytes per lane in lane order: an
// exclusive prefix sum of n gives every lane's offset and one byte shuffle of
// the next 16 stream bytes gathers each lane's two candidate bytes.
constexpr uint32_t kSimdMaxRows = kRansGroupMaxAlphabet - 1;  // alphabets up to 65 symbols per column
constexpr uint32_t kSimdMaxScale = kRansGroupMaxScale;  // slot + 1 <= 2^14: (slot + 1) << 16 stays a positive int32
constexpr uint32_t kPackedMaxScale = 12;    // packed keys: cum in bits 19..30, symbol 13..18, freq 0..12
constexpr uint32_t kPackedMaxRows = 63;

using SimdGroup = RansGroupTables::Group;

// A column the compare search cannot take (alphabet > 65 or scale > 14,
// e.g. the dp allocator's 256-level components): its lane of a vector
// group takes the column's own table after the search (scalar_lanes), and
// a group of many such columns takes the scalar lanes inside the vector
// loop.
inline bool too_big(const DecCol& c) { return c.scale > kSimdMaxScale || c.last > kSimdMaxRows; }

// Up to this many lanes of a group are looked up one by one after its
// vector search (~10 instructions a lane); more, and the whole group takes
// the scalar lanes. A group with one 256-level column among small ones was
// a whole scalar group before: 3% of the groups of the tinycode dump at
// the dp allocator's 256 bits per token, but 9.5% of its decode time. Both
// kinds still leave the two-stream loop (Group::apart).
constexpr int kMaxScalarLanes = 4;

// The lanes of the group at columns c[0..7] whose column is too big, as a
// mask (bit j: lane j).
inline uint32_t too_big_lanes(const DecCol* c) {
  uint32_t m = 0;
  for (size_t j = 0; j < kRansLanes; ++j) m |= uint32_t(too_big(c[j])) << j;
  return m;
}

// Builds the tables of every group start k0 reachable from 0 in steps of 8;
// a group holding more than kMaxScalarLanes columns too big for the compare
// search is marked scalar, one holding fewer gets them as scalar_lanes
// (either sets any_scalar). False when no group is left for the vector
// steps.
// Packed key of symbol s of column c (cum << 19 | s << 13 | freq).
inline int32_t packed_key(const DecCol& c, uint32_t s) {
  return int32_t(c.syms[s].cum << 19 | s << 13 | c.syms[s].freq);
}

// The window search of packed group g (columns c[0..7], see
// RansGroupTables::Group): the window length W minimising the expected cost
// in rows, W + the escape check + P(some lane's slot outside its window) *
// (a mispredicted branch + the whole search), one row being a folded load
// and two vector ops (~0.6 cycles: the loads bound the four-stream loop)
// and a misprediction ~15-20 cycles. Per lane the window is the W + 1
// consecutive symbols of the largest total frequency; the probabilities
// are the table's own. (The costs were 3 and 14 rows when a row took two
// loads; doubled with the cheaper rows: bench_kvtc BM_CacheDecode/0, 12
// alternating runs, median 909 against 898 MB/s.)
constexpr double kWindowCheckRows = 6.0;
constexpr double kEscapeRows = 28.0;

// The start a and mass (sum of freq over a .. a + w, clipped to the
// alphabet) of col's heaviest window of w + 1 symbols, the first of equal
// mass: plain loops, the reference for best_window's fast masses.
uint32_t best_start(const DecCol& col, uint32_t w, uint32_t& mass) {
  uint32_t sum = 0, best = 0, at = 0;
  for (uint32_t s = 0; s <= std::min(w, col.last); ++s) sum += col.syms[s].freq;
  best = sum;
  for (uint32_t a = 1; a + w <= col.last; ++a) {
    sum += col.syms[a + w].freq - col.syms[a - 1].freq;
    if (sum > best) best = sum, at = a;
  }
  mass = best;
  return at;
}

// The window length W minimising the expected cost in rows (see above).
// fast: every lane's best_start mass at once, from the lanes' cumulative
// frequencies transposed, cum[s][j] = lane j's cum[s] up to s = last + 1
// (the total; kept past it): one SSE2 subtract and max per start covers 8
// lanes (a packed column's totals are <= 2^12: int16). A window past a
// lane's alphabet then sums a tail (total - cum[a]), which its window ending
// at the last symbol contains: the maxima are best_start's. Else
// best_start's loops (the reference). ~10x fewer instructions, where a
// cache opening its heads per call builds these tables on every fetch.
uint32_t best_window(const DecCol* c, uint32_t g_rows, bool fast) {
  alignas(16) int16_t cum[kPackedMaxRows + 2][kRansLanes];
  uint32_t top = 0;  // the lanes' largest last symbol
  for (size_t j = 0; j < kRansLanes && fast; ++j) {
    fast = c[j].scale <= kPackedMaxScale && c[j].last <= kPackedMaxRows;  // always, in a packed group
    top = std::max(top, c[j].last);
  }
  for (size_t j = 0; j < kRansLanes && fast; ++j) {
    for (uint32_t s = 0; s <= c[j].last; ++s) cum[s][j] = int16_t(c[j].syms[s].cum);
    for (uint32_t s = c[j].last + 1; s <= top + 1; ++s) cum[s][j] = int16_t(c[j].mask + 1);
  }
  double best_cost = double(g_rows);
  uint32_t best_w = 0;
  for (uint32_t w = 1; double(w) + kWindowCheckRows < best_cost; ++w) {
    alignas(16) int16_t fast_mass[kRansLanes];
    if (fast && w < top) {
      __m128i m = _mm_setzero_si128();
      for (uint32_t a = 0; a + w <= top; ++a)
        m = _mm_max_epi16(m, _mm_sub_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(cum[a + w + 1])),
                                           _mm_load_si128(reinterpret_cast<const __m128i*>(cum[a]))));
      _mm_store_si128(reinterpret_cast<__m128i*>(fast_mass), m);
    } else if (fast) {
      for (size_t j = 0; j < kRansLanes; ++j) fast_mass[j] = cum[top + 1][j];  // w >= every last: the total
    }
    double p_in = 1.0;
    for (size_t j = 0; j < kRansLanes; ++j) {
      uint32_t mass = 0;
      if (fast) {
        mass = uint32_t(fast_mass[j]);
      } else {
        best_start(c[j], w, mass);
      }
      p_in *= double(mass) / double(c[j].mask + 1);
    }
    const double cost = double(w) + kWindowCheckRows + (1.0 - p_in) * (kEscapeRows + double(g_rows));
    if (cost < best_cost) best_cost = cost, best_w = w;
  }
  return best_w;
}

// Group g's window of best_w rows (best_window; 0: none), its rows appended.
void add_window(const DecCol* c, SimdGroup& g, std::vector<int32_t>& rows, uint32_t best_w) {
  g.windowed = false;
  if (best_w == 0) return;
  g.windowed = true;
  g.wrows = best_w;
  g.wfirst = rows.size();
  rows.resize(g.wfirst + size_t(best_w) * kRansLanes);
  int32_t* t = rows.data() + g.wfirst;
  for (size_t j = 0; j < kRansLanes; ++j) {
    uint32_t mass = 0;
    const uint32_t a = best_start(c[j], best_w, mass);
    g.wfloor[j] = packed_key(c[j], a);
    g.wceil[j] = a + best_w + 1 <= c[j].last ? packed_key(c[j], a + best_w + 1) : 0x7fffffff;
    for (uint32_t r = 0; r < best_w; ++r)
      t[r * kRansLanes + j] = a + 1 + r <= c[j].last ? packed_key(c[j], a + 1 + r) : 0x7fffffff;
  }
}

bool build_simd_groups(const DecCol* ext, size_t n_active, std::vector<SimdGroup>& groups,
                       std::vector<uint32_t>& group_at, std::vector<int32_t>& rows, bool& packed, bool& any_scalar,
                       bool windows = false, bool fast_windows = true) {
  // Only the starts k0 reachable from 0 get a group (n_active / gcd(n_active,
  // 8) of them: 8 for 64 columns), in visiting order; group_at maps k0 to it.
  groups.clear();
  group_at.assign(n_active, 0);
  rows.clear();
  // Scales <= 12 and alphabets <= 64 (the common case) take the packed keys
  // cum << 19 | s << 13 | freq: the count of rows below the slot is then
  // carried by the largest key itself (one op less per row). Columns of
  // scalar groups only do not count.
  packed = true;
  for (size_t k = 0; k < n_active; ++k)
    if (!too_big(ext[k])) packed &= ext[k].scale <= kPackedMaxScale && ext[k].last <= kPackedMaxRows;
  // The rows searched: the largest alphabet of the lanes that are not
  // too big, less one.
  const auto search_rows_of = [](const DecCol* c, uint32_t big) {
    uint32_t amax = 1;
    for (size_t j = 0; j < kRansLanes; ++j)
      if (!(big >> j & 1)) amax = std::max(amax, c[j].last + 1);
    return amax - 1;
  };
  any_scalar = false;
  bool any_vector = false;
  // Sized once: the groups' rows and their windows' (the window lengths
  // chosen first), so the tables are neither regrown nor copied by
  // shrink_to_fit (a cache opening its heads per call builds them per call).
  std::vector<uint32_t> window_rows;
  size_t n_rows = 0;
  size_t k0 = 0;
  do {
    const uint32_t big = too_big_lanes(ext + k0), g_rows = search_rows_of(ext + k0, big);
    const bool scalar = std::popcount(big) > kMaxScalarLanes;
    // No window where a lane is looked up apart: its key does not fit the
    // window's bounds.
    const uint32_t w = big == 0 && windows && packed && g_rows >= 6 ? best_window(ext + k0, g_rows, fast_windows) : 0;
    window_rows.push_back(w);
    n_rows += scalar ? 0 : size_t(g_rows + w) * kRansLanes;
    k0 = (k0 + kRansLanes) % n_active;
  } while (k0 != 0);
  groups.reserve(window_rows.size());
  rows.reserve(n_rows);
  do {
    group_at[k0] = uint32_t(groups.size());
    SimdGroup& g = groups.emplace_back();
    const uint32_t big = too_big_lanes(ext + k0);
    g.scalar = std::popcount(big) > kMaxScalarLanes;
    g.apart = big != 0;
    any_scalar |= big != 0;
    if (g.scalar) {
      k0 = (k0 + kRansLanes) % n_active;
      continue;
    }
    g.scalar_lanes = uint8_t(big);
    any_vector = true;
    g.rows = search_rows_of(ext + k0, big);
    g.first = rows.size();
    for (size_t j = 0; j < kRansLanes; ++j) {
      const DecCol& c = ext[k0 + j];
      g.scale[j] = int32_t(c.scale);
      g.mask[j] = int32_t(c.mask);
      g.key0[j] = int32_t(c.syms[0].freq);
    }
    rows.resize(g.first + size_t(g.rows) * kRansLanes);
    int32_t* t = rows.data() + g.first;
    for (size_t j = 0; j < kRansLanes; ++j) {
      const DecCol& c = ext[k0 + j];
      uint32_t s = 1;
      if (big >> j & 1) {  // rows the lane's search ignores: its symbol is looked up after
        for (; s <= g.rows; ++s) t[(s - 1) * kRansLanes + j] = 0x7fffffff;
      } else if (packed) {
        for (; s <= c.last; ++s) t[(s - 1) * kRansLanes + j] = int32_t(c.syms[s].cum << 19 | s << 13 | c.syms[s].freq);
        for (; s <= g.rows; ++s) t[(s - 1) * kRansLanes + j] = 0x7fffffff;  // above every bound
      } else {
        for (; s <= c.last; ++s) t[(s - 1) * kRansLanes + j] = int32_t(c.syms[s].cum << 16 | c.syms[s].freq);
        for (; s <= g.rows; ++s) t[(s - 1) * kRansLanes + j] = int32_t((c.mask + 1) << 16);
      }
    }
    k0 = (k0 + kRansLanes) % n_active;
  } while (k0 != 0);
  for (size_t i = 0; i < groups.size(); ++i) {
    const size_t start = i * kRansLanes % n_active;  // groups are in visiting order
    if (!groups[i].scalar && groups[i].scalar_lanes == 0) add_window(ext + start, groups[i], rows, window_rows[i]);
  }
  return any_vector;
}

KVCODEC_AVX2_BEGIN
// The group decoder's vector constants, read from memory through a pointer
// the compiler cannot see through: as immediates GCC rebuilt most of them in
// every group step (mov, vmovq, vpbroadcast: ~3 instructions each, ~7 per
// stream and group, where the loop is bound by its instruction count);
// loads fold into the instructions that use them.
struct DecodeConsts {
  __m256i key_low = _mm256_set1_epi32(0x7fffe);      // packed bound's low bits
  __m256i sym_mask = _mm256_set1_epi32(63);
  __m256i freq13_mask = _mm256_set1_epi32(0x1fff);
  __m256i freq16_mask = _mm256_set1_epi32(0xffff);
  __m256i ans_low = _mm256_set1_epi32(int32_t(kRansLow));
  __m256i ans_low8 = _mm256_set1_epi32(int32_t(kRansLow >> 8));
  __m256i ctrl_base = _mm256_set1_epi32(int32_t(0x80800001u));
  __m256i sixteen = _mm256_set1_epi32(16);
  __m256i one = _mm256_set1_epi32(1);
  __m256i all_ones = _mm256_set1_epi32(-1);
  // User-provided, so that it is compiled for AVX2 like the region (an
  // implicit one is not).
  DecodeConsts() {}
};
inline const DecodeConsts* decode_consts() {
  static const DecodeConsts c;
  const DecodeConsts* p = &c;
  asm("" : "+r"(p));  // opaque: the fields are loads, not immediates
  return p;
}
inline __m256i ld(const __m256i& v) { return _mm256_load_si256(&v); }

// The rows a packed group's search runs over: its window's when every
// lane's slot lies in its lane's window (one compare pair and a test: the
// branch resolves before the rows are read), else all of them. In-process
// A/B on the tinycode dump at the 1% target (bench_kvtc, keys and values of
// every head through for_each_block, alternating runs): 1.04x the decode
// (inter-quartile 1.02-1.07); neutral at 5%, where alphabets are small.
struct SearchRows {
  const int32_t* t;
  uint32_t n;
  __m256i init;
};
__attribute__((always_inline)) inline SearchRows search_rows(const SimdGroup& g, const int32_t* rows, __m256i bound,
                                                             const DecodeConsts* k) {
  if (g.windowed) {
    const __m256i floor = _mm256_load_si256(reinterpret_cast<const __m256i*>(g.wfloor));
    const __m256i ok = _mm256_andnot_si256(
        _mm256_cmpgt_epi32(floor, bound),
        _mm256_cmpgt_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(g.wceil)), bound));
    if (__builtin_expect(_mm256_testc_si256(ok, ld(k->all_ones)), 1)) return {rows + g.wfirst, g.wrows, floor};
  }
  return {rows + g.first, g.rows, _mm256_load_si256(reinterpret_cast<const __m256i*>(g.key0))};
}

// bound - a search row's keys, lane-wise. The largest key <= bound is
// bound - the smallest of these taken unsigned: a key above the bound gives
// a negative difference, which as unsigned exceeds every non-negative one
// (keys and bounds are non-negative int32). One folded load and two ops
// (this and vpminud) per row: the blend form (key < bound + 1 ? key : acc)
// loaded every row twice, and the loads bound the four-stream loop.
__attribute__((always_inline)) inline __m256i key_gap(__m256i bound, const int32_t* row) {
  return _mm256_sub_epi32(bound, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
}

// The update, renormalisation and output (to out[0, 8)) of one group whose
// symbols are found, on the caller's lane states X and stream pointer p
// (the lockstep loop keeps them in local variables, see run_lockstep_vector).
// q = X >> scale, taken before the search: X itself is then dead during
// it, one vector register less per stream.
__attribute__((always_inline)) inline void finish_group_at(const DecodeConsts* k, __m256i sym, __m256i lo, __m256i freq,
                                                           __m256i slot, __m256i q, __m256i& X, const uint8_t*& p,
                                                           uint16_t* out) {
  // x' = freq * (x >> scale) + slot - cum: the scalar step, lane-wise.
  const __m256i xn = _mm256_sub_epi32(_mm256_add_epi32(_mm256_mullo_epi32(freq, q), slot), lo);
  // Bytes per lane: (x' < 2^23) + (x' < 2^15); x' < 2^31, so signed compares are exact.
  const __m256i n = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_add_epi32(_mm256_cmpgt_epi32(ld(k->ans_low), xn),
                                                                              _mm256_cmpgt_epi32(ld(k->ans_low8), xn)));
  __m256i incl = _mm256_add_epi32(n, _mm256_slli_si256(n, 4));
  incl = _mm256_add_epi32(incl, _mm256_slli_si256(incl, 8));
  const __m256i carry = _mm256_shuffle_epi32(incl, 0xff);  // each half's total in its every lane
  incl = _mm256_add_epi32(incl, _mm256_permute2x128_si256(carry, carry, 0x08));  // low half's total to the high half
  const __m256i excl = _mm256_sub_epi32(incl, n);  // <= 14: lane j's two bytes are p[o], p[o + 1]
  const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  // Per lane the 32-bit word p[o + 1] | p[o] << 8 (bytes 2, 3 zeroed by 0x80).
  const __m256i ctrl = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(excl, 8), excl), ld(k->ctrl_base));
  const __m256i v = _mm256_shuffle_epi8(bytes, ctrl);
  const __m256i bits = _mm256_slli_epi32(n, 3);
  X = _mm256_or_si256(_mm256_sllv_epi32(xn, bits), _mm256_srlv_epi32(v, _mm256_sub_epi32(ld(k->sixteen), bits)));
  p += uint32_t(_mm256_extract_epi32(incl, 7));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(sym, sym), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

// The lanes of a vector group whose columns the search ignores (lanes =
// Group::scalar_lanes, columns c[0..7]): each lane's symbol from its
// column's own table (lookup_symbol, as the scalar lanes find it), blended
// over the search's results. Inline: a call inside the two-stream loop
// would make GCC keep its lane states in memory.
__attribute__((always_inline)) inline void patch_scalar_lanes(uint32_t lanes, const DecCol* c, __m256i slot, __m256i& sym,
                                                              __m256i& lo, __m256i& freq) {
  alignas(32) uint32_t slots[kRansLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(slots), slot);
  const __m256i lane_ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  do {
    const unsigned j = unsigned(std::countr_zero(lanes));
    const uint32_t s = lookup_symbol(c[j], slots[j]);
    const RansDecodeTable::Sym e = c[j].syms[s];
    const __m256i at = _mm256_cmpeq_epi32(lane_ids, _mm256_set1_epi32(int32_t(j)));
    sym = _mm256_blendv_epi8(sym, _mm256_set1_epi32(int32_t(s)), at);
    lo = _mm256_blendv_epi8(lo, _mm256_set1_epi32(int32_t(e.cum)), at);
    freq = _mm256_blendv_epi8(freq, _mm256_set1_epi32(int32_t(e.freq)), at);
    lanes &= lanes - 1;
  } while (lanes != 0);
}

// One stream's group decoder state: step() decodes one group of 8 symbols
// (callable while can_step(): a group reads at most 2 bytes per lane, so 16
// bytes left need no per-byte check). Two streams stepped alternately in one
// loop overlap their dependency chains (a group is one long chain: lookup,
// update, renormalisation, next lookup).
struct SimdStream {
  const SimdGroup* groups = nullptr;
  const uint32_t* group_at = nullptr;  // [n_active]: k0 -> index in groups
  const int32_t* rows = nullptr;
  const DecCol* ext = nullptr;  // the columns, for scalar groups
  size_t n_active = 0, n_coded = 0, i = 0, k0 = 0;
  const uint8_t* p = nullptr;
  const uint8_t* end = nullptr;
  uint16_t* dst = nullptr;
  bool packed = false;
  const DecodeConsts* k = decode_consts();
  __m256i X;

  bool can_step() const { return group_fits(i, n_coded, p, end); }
  // The group that starts at column k0 of the cycle (k0 itself: the next one).
  const SimdGroup& group(size_t at) const { return groups[group_at[at]]; }

  // A group marked scalar: the 8 lanes through scalar_group, out of line
  // and by value, so that no address of the stream escapes the loops that
  // step it (its fields can then live in registers).
  struct ScalarOut {
    __m256i X;
    const uint8_t* p;
  };
  __attribute__((noinline)) static ScalarOut scalar_step(const DecCol* c, __m256i X, const uint8_t* p, uint16_t* dst) {
    alignas(32) uint32_t x[kRansLanes];
    _mm256_store_si256(reinterpret_cast<__m256i*>(x), X);
    scalar_group(c, x, p, dst);
    return {_mm256_load_si256(reinterpret_cast<const __m256i*>(x)), p};
  }
  void step_scalar() {
    const ScalarOut r = scalar_step(ext + k0, X, p, dst + i);
    X = r.X, p = r.p;
    next_group(i, k0, n_active);
  }

  __attribute__((always_inline)) inline void step() {
    const __m256i one = ld(k->one);
    const SimdGroup& g = group(k0);
    if (g.scalar) {
      step_scalar();
      return;
    }
    const __m256i scale = _mm256_load_si256(reinterpret_cast<const __m256i*>(g.scale));
    const __m256i slot = _mm256_and_si256(X, _mm256_load_si256(reinterpret_cast<const __m256i*>(g.mask)));
    __m256i sym, lo, freq;
    if (packed) {
      // key <= bound iff cum[s] <= slot (the low 19 bits of a key stay below
      // 0x7fffe; pads 0x7fffffff exceed every bound); the largest such key
      // by key_gap. Two accumulators.
      const __m256i bound = _mm256_or_si256(_mm256_slli_epi32(slot, 19), ld(k->key_low));
      const SearchRows sr = search_rows(g, rows, bound, k);
      __m256i d_a = _mm256_sub_epi32(bound, sr.init), d_b = d_a;
      const int32_t* t = sr.t;
      const uint32_t n_rows = sr.n;
      uint32_t r = 0;
      for (; r + 2 <= n_rows; r += 2) {
        d_a = _mm256_min_epu32(d_a, key_gap(bound, t + r * kRansLanes));
        d_b = _mm256_min_epu32(d_b, key_gap(bound, t + (r + 1) * kRansLanes));
      }
      if (r < n_rows) d_a = _mm256_min_epu32(d_a, key_gap(bound, t + r * kRansLanes));
      const __m256i key = _mm256_sub_epi32(bound, _mm256_min_epu32(d_a, d_b));
      sym = _mm256_and_si256(_mm256_srli_epi32(key, 13), ld(k->sym_mask));
      lo = _mm256_srli_epi32(key, 19);
      freq = _mm256_and_si256(key, ld(k->freq13_mask));
    } else {
    // key < bound iff cum[s] <= slot (freq < 2^16 sits below the compare).
    const __m256i bound = _mm256_slli_epi32(_mm256_add_epi32(slot, one), 16);
    // Two interleaved accumulator pairs halve the dependency chains.
    __m256i sym_a = _mm256_setzero_si256(), sym_b = sym_a;
    __m256i key_a = _mm256_load_si256(reinterpret_cast<const __m256i*>(g.key0)), key_b = key_a;
    const int32_t* t = rows + g.first;
    uint32_t s = 0;
    for (; s + 2 <= g.rows; s += 2) {
      const __m256i ca = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + s * kRansLanes));
      const __m256i cb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + (s + 1) * kRansLanes));
      const __m256i le_a = _mm256_cmpgt_epi32(bound, ca), le_b = _mm256_cmpgt_epi32(bound, cb);
      sym_a = _mm256_sub_epi32(sym_a, le_a);
      sym_b = _mm256_sub_epi32(sym_b, le_b);
      key_a = _mm256_max_epi32(key_a, _mm256_and_si256(le_a, ca));
      key_b = _mm256_max_epi32(key_b, _mm256_and_si256(le_b, cb));
    }
    if (s < g.rows) {
      const __m256i ca = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + s * kRansLanes));
      const __m256i le_a = _mm256_cmpgt_epi32(bound, ca);
      sym_a = _mm256_sub_epi32(sym_a, le_a);
      key_a = _mm256_max_epi32(key_a, _mm256_and_si256(le_a, ca));
    }
    sym = _mm256_add_epi32(sym_a, sym_b);
    const __m256i key = _mm256_max_epi32(key_a, key_b);
    lo = _mm256_srli_epi32(key, 16);
    freq = _mm256_and_si256(key, ld(k->freq16_mask));
    }
    if (__builtin_expect(g.scalar_lanes != 0, 0)) patch_scalar_lanes(g.scalar_lanes, ext + k0, slot, sym, lo, freq);
    finish_group(sym, lo, freq, slot, _mm256_srlv_epi32(X, scale));
  }

  // Update, renormalisation and output of one group whose symbols are found.
  __attribute__((always_inline)) inline void finish_group(__m256i sym, __m256i lo, __m256i freq, __m256i slot, __m256i q) {
    finish_group_at(k, sym, lo, freq, slot, q, X, p, dst + i);
    next_group(i, k0, n_active);
  }
};

// The groups left when fewer than 16 stream bytes remain (a group's byte
// shuffle reads 16): the same steps on a zero-padded copy of those bytes,
// each kept only if it consumed no more than the bytes really left (then it
// read only real bytes, so it is the scalar lanes' step). A step that would
// run past the end is undone and left to the scalar lanes, which report the
// truncation exactly as before. Without this the last ~5 groups of every
// stream took the scalar lanes (~6% of a block's rANS time).
inline void step_padded_tail(SimdStream& st) {
  const size_t left = size_t(st.end - st.p);
  if (left >= 2 * kRansLanes || st.i + kRansLanes > st.n_coded) return;
  alignas(32) uint8_t pad[4 * kRansLanes] = {};
  std::memcpy(pad, st.p, left);
  SimdStream t = st;
  t.p = pad;
  t.end = pad + sizeof(pad);  // can_step() holds while t.p - pad <= 16
  while (t.i + kRansLanes <= t.n_coded) {
    // What a step changes (not the whole stream: a copy per step showed).
    const size_t i = t.i, k0 = t.k0;
    const uint8_t* const p = t.p;
    const __m256i X = t.X;
    t.step();
    if (size_t(t.p - pad) > left) {
      t.i = i, t.k0 = k0, t.p = p, t.X = X;  // its symbols, written to dst, are rewritten by the scalar lanes
      break;
    }
  }
  const uint8_t* const real = st.p;
  const uint8_t* const end = st.end;
  st = t;
  st.p = real + (t.p - pad);
  st.end = end;
}
KVCODEC_AVX2_END
#endif

}  // namespace

RansDecodeTable::RansDecodeTable(const FrequencyTable& t, RansLookup lookup)
    : alphabet_size(t.alphabet_size), scale_bits(t.scale_bits) {
  if (t.freq.size() != t.alphabet_size || t.alphabet_size == 0 || t.scale_bits < 1 || t.scale_bits > kMaxScaleBits)
    throw Error(ErrorCode::kInvalidArgument, "RansDecodeTable: invalid frequency table");
#ifdef KVCODEC_RANS_AVX2
  // Only where the AVX2 group decoder will run (chosen at run time): a table
  // built so and then read by the scalar lanes still decodes, by bisection.
  const bool by_groups = lookup == RansLookup::kAuto && simd_avx2() && alphabet_size <= kRansGroupMaxAlphabet &&
                         scale_bits <= kRansGroupMaxScale;
#else
  (void)lookup;
  const bool by_groups = false;  // the scalar lanes decode everything
#endif
  // The search table replaces the slot table where it applies: 64 bytes
  // instead of 2^(scale_bits + 1) (8 KB at 12 bits, per component).
  const bool by_search = !by_groups && alphabet_size <= kRansSearchMax && scale_bits <= 14;
  const size_t total = size_t(1) << scale_bits;
  const bool slots = !by_search && !by_groups;
  if (slots) slot_symbol.resize(total);
  syms.resize(alphabet_size);
  size_t slot = 0;
  for (uint32_t s = 0; s < alphabet_size; ++s) {
    const uint32_t f = t.freq[s];
    if (f == 0 || slot + f > total)
      throw Error(ErrorCode::kInvalidArgument, "RansDecodeTable: frequencies do not sum to 2^scale_bits");
    syms[s] = Sym{f, uint32_t(slot)};
    if (slots) std::fill(slot_symbol.begin() + long(slot), slot_symbol.begin() + long(slot + f), uint16_t(s));
    slot += f;
  }
  if (slot != total)
    throw Error(ErrorCode::kInvalidArgument, "RansDecodeTable: frequencies do not sum to 2^scale_bits");
  if (by_search) {
    search.assign(32, 0x7fff);
    for (uint32_t s = 1; s < alphabet_size; ++s) search[s - 1] = uint16_t(syms[s].cum);
  }
}


namespace {

#ifdef KVCODEC_RANS_AVX2
KVCODEC_AVX2_BEGIN
// RansEncodeTable::assign's constants of the symbols below n / 4 * 4, four
// at a time: the values of its scalar loop (the formulas there; the
// reciprocal as rans_rcp, four per double division: bit_width of
// 1 <= f - 1 < 2^24 is the biased exponent of float(f - 1) less 126, and
// 2^(31 + l) the double of biased exponent 1023 + 31 + l; the ceiling,
// < 2^32, converts through the int32 range offset by 2^31). f == 1 lanes
// take their constants by masks. False when some symbol fails the scalar
// loop's checks (which then finds it and throws).
bool encode_syms_avx2(const uint32_t* freq, const uint32_t* cum, size_t n, uint32_t scale_bits,
                      RansEncodeTable::Sym* out) {
  static_assert(sizeof(RansEncodeTable::Sym) == 16 && offsetof(RansEncodeTable::Sym, rcp) == 4 &&
                offsetof(RansEncodeTable::Sym, bias) == 8 && offsetof(RansEncodeTable::Sym, cmpl_freq) == 12 &&
                offsetof(RansEncodeTable::Sym, shift) == 14);
  const uint32_t M = 1u << scale_bits;
  const __m128i vm = _mm_set1_epi32(int32_t(M)), one = _mm_set1_epi32(1);
  const __m128i xmul = _mm_set1_epi32(int32_t((kRansLow >> scale_bits) << 8));
  const __m256d two31 = _mm256_set1_pd(2147483648.0);
  __m128i bad = _mm_setzero_si128();
  for (size_t i = 0; i + 4 <= n; i += 4) {
    const __m128i f = _mm_loadu_si128(reinterpret_cast<const __m128i*>(freq + i));
    const __m128i c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cum + i));
    const __m128i c1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cum + i + 1));
    bad = _mm_or_si128(bad, _mm_cmpeq_epi32(f, _mm_setzero_si128()));
    bad = _mm_or_si128(bad, _mm_xor_si128(_mm_max_epu32(f, vm), vm));  // f > M
    bad = _mm_or_si128(bad, _mm_xor_si128(_mm_add_epi32(c0, f), c1));
    const __m128i is1 = _mm_cmpeq_epi32(f, one);
    const __m128i l = _mm_sub_epi32(_mm_srli_epi32(_mm_castps_si128(_mm_cvtepi32_ps(_mm_sub_epi32(f, one))), 23),
                                    _mm_set1_epi32(126));
    const __m256i nbits = _mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm_add_epi32(l, _mm_set1_epi32(1023 + 31))), 52);
    const __m256d q = _mm256_div_pd(_mm256_castsi256_pd(nbits), _mm256_cvtepi32_pd(f));
    const __m256d c = _mm256_round_pd(q, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
    __m128i rcp = _mm_xor_si128(_mm256_cvttpd_epi32(_mm256_sub_pd(c, two31)), _mm_set1_epi32(int32_t(0x80000000u)));
    rcp = _mm_or_si128(rcp, is1);                                        // 0xffffffff for f == 1
    const __m128i shift = _mm_andnot_si128(is1, _mm_sub_epi32(l, one));  // 0 for f == 1
    const __m128i bias = _mm_add_epi32(c0, _mm_and_si128(is1, _mm_sub_epi32(vm, one)));
    const __m128i x_max = _mm_mullo_epi32(f, xmul);
    const __m128i cs =
        _mm_or_si128(_mm_and_si128(_mm_sub_epi32(vm, f), _mm_set1_epi32(0xffff)), _mm_slli_epi32(shift, 16));
    // Rows (x_max, rcp, bias, cmpl_freq | shift << 16) to one Sym per symbol.
    const __m128i t0 = _mm_unpacklo_epi32(x_max, rcp), t1 = _mm_unpackhi_epi32(x_max, rcp);
    const __m128i t2 = _mm_unpacklo_epi32(bias, cs), t3 = _mm_unpackhi_epi32(bias, cs);
    __m128i* o = reinterpret_cast<__m128i*>(out + i);
    _mm_storeu_si128(o + 0, _mm_unpacklo_epi64(t0, t2));
    _mm_storeu_si128(o + 1, _mm_unpackhi_epi64(t0, t2));
    _mm_storeu_si128(o + 2, _mm_unpacklo_epi64(t1, t3));
    _mm_storeu_si128(o + 3, _mm_unpackhi_epi64(t1, t3));
  }
  return _mm_testz_si128(bad, bad);
}
KVCODEC_AVX2_END
#endif

}  // namespace

void RansEncodeTable::assign(const FrequencyTable& t) {
  alphabet_size = t.alphabet_size, scale_bits = t.scale_bits;
  if (t.alphabet_size == 0 || t.scale_bits < 1 || t.scale_bits > kMaxScaleBits || t.freq.size() != t.alphabet_size ||
      t.cum.size() != size_t(t.alphabet_size) + 1 || t.cum.back() != t.total())
    throw Error(ErrorCode::kInvalidArgument, "RansEncodeTable: invalid frequency table");
  const uint32_t M = t.total();
  syms.resize(alphabet_size);
  // The first alphabet / 4 * 4 symbols four at a time where AVX2 runs (a
  // kvtc head opened per call builds these for every symbol of its tables;
  // a division per symbol was most of it); the rest, every symbol
  // elsewhere, and all of them when a check fails there, by the loop below.
  uint32_t first = 0;
#ifdef KVCODEC_RANS_AVX2
  if (alphabet_size >= 4 && simd_avx2() &&
      encode_syms_avx2(t.freq.data(), t.cum.data(), alphabet_size, scale_bits, syms.data()))
    first = alphabet_size / 4 * 4;
#endif
  for (uint32_t s = first; s < alphabet_size; ++s) {
    const uint32_t f = t.freq[s];
    if (f == 0 || f > M || t.cum[s] + f != t.cum[s + 1])
      throw Error(ErrorCode::kInvalidArgument, "RansEncodeTable: frequencies do not match the cumulative table");
    Sym& e = syms[s];
    // Same bound as encode_step: ((kRansLow >> scale) << 8) * f <= 2^31.
    e.x_max = ((kRansLow >> scale_bits) << 8) * f;
    e.cmpl_freq = uint16_t(M - f);
    if (f == 1) {
      e.rcp = 0xffffffffu;
      e.shift = 0;
      e.bias = t.cum[s] + M - 1;
    } else {
      const uint32_t l = uint32_t(std::bit_width(f - 1));  // ceil(log2 f)
      // ceil(2^(31 + l) / f) < 2^32 for f >= 2; x * rcp's error stays below
      // 2^(31 + l) for x < 2^31, so the quotient is exact.
      e.rcp = rans_rcp(f, l);
      e.shift = uint16_t(l - 1);
      e.bias = t.cum[s];
    }
  }
}

namespace {

// Which group encoder rans_encode_impl runs: kAuto the AVX2 one (table
// offsets, or pointers when the tables lie too far apart), kPointers the
// AVX2 one with pointers (the fallback, for tests), kScalar the scalar
// lanes, kOtherChain kAuto with the state update blend_chain() does not
// pick (for tests).
enum class EncodePath { kAuto, kPointers, kScalar, kOtherChain };

// Which form of the group encoder's state update runs by default (see
// encode_groups_avx2): the blends and vpmulld on AMD's CPUs (Zen, where
// vpmulld is cheap; the form a Zen-tuned build picked), the shift count and
// two vpmuludq otherwise. Both are built everywhere; kOtherChain runs the
// other one, for tests.
bool blend_chain() {
#ifdef KVCODEC_RANS_AVX2
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
#else
  return false;
#endif
}

// Per-column data of the encoder's inner loop.
struct EncCol {
  const RansEncodeTable::Sym* syms;
  uint32_t alphabet;
  uint32_t col;  // index in the caller's row (for error messages)
};

// One division-free encode step of symbol s of column c into state v, writing
// renormalisation bytes below p. Branchless: emits 0, 1 or 2 bytes (v < 2^31
// and x_max >= 2^15). The two bytes below p are always written (the low 16
// bits, high byte first); p then steps back by n, so a byte written but not
// claimed is overwritten by the next emission or by the flushed states.
inline uint32_t encode_fast(uint32_t v, uint8_t*& p, const RansEncodeTable::Sym& e) {
  const uint32_t n = uint32_t(v >= e.x_max) + uint32_t(uint64_t(v) >= (uint64_t(e.x_max) << 8));
  p[-1] = uint8_t(v);
  p[-2] = uint8_t(v >> 8);
  p -= n;
  v >>= 8 * n;
  const uint32_t q = uint32_t((uint64_t(v) * e.rcp) >> 32) >> e.shift;
  return v + e.bias + q * e.cmpl_freq;
}

#ifdef KVCODEC_RANS_AVX2
KVCODEC_AVX2_BEGIN
// --- 8-lane AVX2 encoder (same bytes as encode_fast lane by lane) -------------
//
// A group's 8 lanes emit 0..2 bytes each; in the stream they sit lane 0 first
// (the scalar encoder runs lane 7 down to lane 0, writing downwards). Each
// 128-bit half (4 lanes) is packed by one byte shuffle from a 256-entry table
// indexed by its lanes' "at least 1 byte" and "2 bytes" bits, right-aligned
// so that the two 16-byte stores (high half first) leave their junk below the
// group's bytes, where the next group or the flushed states overwrite it.
struct PackTable {
  alignas(16) uint8_t ctrl[256][16];
  PackTable() {
    for (uint32_t idx = 0; idx < 256; ++idx) {
      uint8_t bytes[16];
      uint32_t t = 0;
      for (uint32_t j = 0; j < 4; ++j) {
        const bool one = (idx >> j) & 1, two = (idx >> (4 + j)) & 1;
        // A lane emitting 2 bytes writes the second byte of its state first
        // (p[-2] = x >> 8, p[-1] = x), one byte: the low byte.
        if (one && two) bytes[t++] = uint8_t(4 * j + 1);
        if (one) bytes[t++] = uint8_t(4 * j);
      }
      for (uint32_t q = 0; q < 16; ++q) ctrl[idx][q] = q >= 16 - t ? bytes[q - (16 - t)] : 0x80;
    }
  }
};

// A group's 8 lanes' encoder constants, transposed from their Sym rows.
struct GroupRows {
  __m256i x_max, rcp, bias, cs;
};

// The rows of the group of symbols sy (columns c). Where they are found,
// kOffsets: the columns' tables as 32-bit byte offsets from one base (offs,
// unrolled like cols), so the 8 row addresses are one vector add of
// 16 * symbol, stored and read back as indices (~2 instructions per lane
// instead of 4: load symbol, shift, add the column's pointer, load; ~20%
// fewer cycles per group). Only when every table lies within 2^31 - 2^21
// bytes of the base; otherwise the lanes' pointers directly.
template <bool kOffsets>
inline GroupRows fetch_group(const EncCol* c, const int32_t* offs, const uint16_t* sy, uintptr_t base) {
  alignas(32) int32_t at[kRansLanes];
  if constexpr (kOffsets) {
    const __m256i s = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sy)));
    const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offs));
    _mm256_store_si256(reinterpret_cast<__m256i*>(at), _mm256_add_epi32(o, _mm256_slli_epi32(s, 4)));
    // Read the offsets back from memory: left to itself GCC extracts them
    // from the register instead (vmovd / vpextrd, 2 uops each, plus a
    // sign extension per lane), about twice the uops of 8 loads
    // (in-process A/B of encode_block: 1.02x at 1% and at 5%).
    asm("" : "+m"(at));
  }
  // The 8 lanes' rows {x_max, rcp, bias, cmpl_freq | shift << 16}, transposed.
  const auto row = [&](size_t j) {
    if constexpr (kOffsets)
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + uintptr_t(intptr_t(at[j]))));
    else
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(c[j].syms + sy[j]));
  };
  const __m256i a0 = _mm256_inserti128_si256(_mm256_castsi128_si256(row(0)), row(4), 1);
  const __m256i a1 = _mm256_inserti128_si256(_mm256_castsi128_si256(row(1)), row(5), 1);
  const __m256i a2 = _mm256_inserti128_si256(_mm256_castsi128_si256(row(2)), row(6), 1);
  const __m256i a3 = _mm256_inserti128_si256(_mm256_castsi128_si256(row(3)), row(7), 1);
  const __m256i t0 = _mm256_unpacklo_epi32(a0, a1), t1 = _mm256_unpacklo_epi32(a2, a3);
  const __m256i t2 = _mm256_unpackhi_epi32(a0, a1), t3 = _mm256_unpackhi_epi32(a2, a3);
  return GroupRows{_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1), _mm256_unpacklo_epi64(t2, t3),
                   _mm256_unpackhi_epi64(t2, t3)};
}

// The groups run software-pipelined: each iteration fetches the rows of
// the group two on (symbol loads, row addresses, 8 row loads, transposes)
// before it encodes the current one. Left to the core, a group's fetch
// (~15 cycles of dependent loads) sat in front of its state update, and
// the vector scheduler holds the ops of only ~1.5 groups, too few to
// overlap it: with the rows at fixed addresses the same loop ran 1.33x
// faster. In-process A/B on the dump head's blocks at the 1% target:
// 1.09x fetching one group ahead, 1.14x two (inter-quartile 1.11-1.18).
//
// One stream's loop as an object (step() encodes one group) so that two
// independent streams can run side by side (encode_group_pair).
template <bool kOffsets, bool kBlend>
struct GroupLoop {
  const EncCol* cols;
  const int32_t* offs;
  const uint16_t* flat;
  size_t n_active, step_cols, k_fetch, i_fetch, i0;
  uintptr_t base;
  uint8_t* p;  // in a register, not through the caller's reference
  __m256i X;
  GroupRows cur, nxt;

  // full > 0: the groups of symbols [0, full), the last from column k0.
  GroupLoop(const EncCol* c, const int32_t* o, const uint16_t* f, size_t n_act, size_t full, size_t k0, uint8_t* out,
            const uint32_t* x)
      : cols(c), offs(o), flat(f), n_active(n_act), step_cols(kRansLanes % n_act), k_fetch(k0), i_fetch(full),
        i0(full - kRansLanes),
        // An integer: the rows of other tables lie outside cols[0]'s array, where
        // pointer arithmetic on it would be undefined.
        base(reinterpret_cast<uintptr_t>(c[0].syms)), p(out),
        X(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))) {
    cur = fetch();
    nxt = i0 > 0 ? fetch() : GroupRows{};
  }
  // The groups from the last (symbol full - 8) down; fetch() steps the
  // column cycle back one group and returns that group's rows.
  __attribute__((always_inline)) inline GroupRows fetch() {
    k_fetch = k_fetch >= step_cols ? k_fetch - step_cols : k_fetch + n_active - step_cols;
    i_fetch -= kRansLanes;
    return fetch_group<kOffsets>(cols + k_fetch, kOffsets ? offs + k_fetch : nullptr, flat + i_fetch, base);
  }
  // Encodes the current group; false once it was the first (symbol 0's).
  __attribute__((always_inline)) inline bool step(const PackTable& pack) {
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i low16 = _mm256_set1_epi32(0xffff);
    const bool more = i0 > 0;
    const GroupRows after = i0 > kRansLanes ? fetch() : GroupRows{};
    // Bytes to emit: (x >= x_max) + (x >= x_max << 8), as signed compares
    // (x < 2^31; x_max - 1 <= 2^31 - 1, the shifted test as x >> 8 >= x_max).
    const __m256i lim = _mm256_sub_epi32(cur.x_max, one);
    const __m256i m1 = _mm256_cmpgt_epi32(X, lim);
    const __m256i m2 = _mm256_cmpgt_epi32(_mm256_srli_epi32(X, 8), lim);
    // Both masks' bits by one movemask: saturating packs (per 128-bit half)
    // turn half h's lanes into bytes [m1 lanes, m2 lanes], so the byte mask
    // holds the low half's table index in bits 0..7 and the high half's in
    // bits 16..23 (the same indices as (b1 & 15) | (b2 & 15) << 4 etc.).
    const __m256i m12 = _mm256_packs_epi32(m1, m2);
    const uint32_t bits = uint32_t(_mm256_movemask_epi8(_mm256_packs_epi16(m12, m12)));
    const uint32_t lo_idx = bits & 0xff, hi_idx = (bits >> 16) & 0xff;
    const __m256i ctrl = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(pack.ctrl[lo_idx]))),
        _mm_load_si128(reinterpret_cast<const __m128i*>(pack.ctrl[hi_idx])), 1);
    const __m256i packed = _mm256_shuffle_epi8(X, ctrl);
    const uint32_t n_hi = uint32_t(__builtin_popcount(hi_idx)), n_lo = uint32_t(__builtin_popcount(lo_idx));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p - 16), _mm256_extracti128_si256(packed, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p - n_hi - 16), _mm256_castsi256_si128(packed));
    p -= n_hi + n_lo;
    // x >>= 8 n, then x + bias + floor(x / freq) * cmpl_freq (quotient by
    // the 32 x 32 -> high 32 multiply, even and odd lanes separately).
    // Two forms of the same integers for the state's loop-carried chain:
    // kBlend, two blends on the masks (m2 implying m1) and vpmulld, for Zen
    // (vpblendvb 1 cycle, vpmulld 3); otherwise a shift count built from
    // the masks and the product as two 32 x 32 -> 64 multiplies (5 cycles;
    // q * cmpl_freq < 2^32), for Intel cores (vpblendvb 2-3 uops, vpmulld
    // 10 cycles). In-process A/B of the two (bench_kvtc
    // BM_EntropyChainAB): 0.93-0.97x the blends on Zen 3, 1.03-1.11x them
    // on the GPU host's Xeon.
    __m256i v;
    if constexpr (kBlend) {
      v = _mm256_blendv_epi8(_mm256_blendv_epi8(X, _mm256_srli_epi32(X, 8), m1), _mm256_srli_epi32(X, 16), m2);
    } else {
      const __m256i eight = _mm256_set1_epi32(8);
      v = _mm256_srlv_epi32(X, _mm256_add_epi32(_mm256_and_si256(m1, eight), _mm256_and_si256(m2, eight)));
    }
    const __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(v, cur.rcp), 32);
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(v, 32), _mm256_srli_epi64(cur.rcp, 32));
    const __m256i hi = _mm256_blend_epi32(even, odd, 0xaa);
    const __m256i q = _mm256_srlv_epi32(hi, _mm256_srli_epi32(cur.cs, 16));
    const __m256i cmpl = _mm256_and_si256(cur.cs, low16);
    __m256i qc;
    if constexpr (kBlend) {
      qc = _mm256_mullo_epi32(q, cmpl);
    } else {
      const __m256i odd_qc = _mm256_mul_epu32(_mm256_srli_epi64(q, 32), _mm256_srli_epi64(cmpl, 32));
      qc = _mm256_blend_epi32(_mm256_mul_epu32(q, cmpl), _mm256_slli_epi64(odd_qc, 32), 0xaa);
    }
    X = _mm256_add_epi32(_mm256_add_epi32(v, cur.bias), qc);
    if (!more) return false;
    i0 -= kRansLanes;
    cur = nxt;
    nxt = after;
    return true;
  }
  void finish(uint8_t*& out, uint32_t* x) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), X);
    out = p;
  }
};

const PackTable& pack_table() {
  static const PackTable pack;
  return pack;
}

template <bool kOffsets, bool kBlend>
void encode_groups_avx2(const EncCol* cols, const int32_t* offs, const uint16_t* flat, size_t n_active, size_t full,
                        size_t k0, uint8_t*& p, uint32_t* x) {
  static_assert(sizeof(RansEncodeTable::Sym) == 16, "Sym is loaded as one 128-bit row");
  if (full == 0) return;
  const PackTable& pack = pack_table();
  GroupLoop<kOffsets, kBlend> g(cols, offs, flat, n_active, full, k0, p, x);
  while (g.step(pack)) {
  }
  g.finish(p, x);
}

// Whether any of the rows [n_rows, n_active] has a symbol above its
// column's last one (rans_encode_impl's check, 16 at a time: a symbol is
// bad when max(symbol, alphabet - 1) != alphabet - 1).
bool any_symbol_above_avx2(const uint16_t* flat, const uint16_t* last, size_t n_rows, size_t n_active) {
  bool bad = false;
  for (size_t r = 0; r < n_rows; ++r) {
    const uint16_t* row = flat + r * n_active;
    size_t k = 0;
    __m256i acc = _mm256_setzero_si256();
    for (; k + 16 <= n_active; k += 16) {
      const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(last + k));
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
      acc = _mm256_or_si256(acc, _mm256_xor_si256(_mm256_max_epu16(v, l), l));
    }
    bad |= !_mm256_testz_si256(acc, acc);
    for (; k < n_active; ++k) bad |= row[k] > last[k];
  }
  return bad;
}
KVCODEC_AVX2_END
#endif

// One stream's encode, in three parts so that two streams can share the
// group loop (rans_encode_pair): prepare (validation, the scalar last
// group), the whole groups, finish (the flushed states). Its scratch is
// reused across calls, without a heap allocation per block.
struct EncodeJob {
  std::vector<EncCol> ext;
  std::vector<uint16_t> compact, last;
  std::vector<uint8_t> buf;
  std::vector<int32_t> offs;
  const uint16_t* flat = nullptr;
  size_t n_active = 0, n_coded = 0, full = 0, k0 = 0;
  uint8_t* end = nullptr;
  uint8_t* p = nullptr;
  bool near = false;  // every table within 32-bit offsets of cols[0]'s
  uint32_t x[kRansLanes];

  const EncCol* cols() const { return ext.data(); }
  // False when nothing is coded (the stream is empty).
  bool prepare(const uint16_t* symbols, size_t n_rows, size_t n_cols,
               const std::vector<const RansEncodeTable*>& tables, EncodePath path);
  // The whole groups [0, full), by the scalar lanes or (vector) the AVX2 loop.
  void groups(EncodePath path, bool vector);
  std::vector<uint8_t> finish();
};

bool EncodeJob::prepare(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                        const std::vector<const RansEncodeTable*>& tables, EncodePath path) {
  if (tables.size() != n_cols)
    throw Error(ErrorCode::kInvalidArgument, "rans_encode: " + std::to_string(tables.size()) + " tables for " +
                                                 std::to_string(n_cols) + " columns");
  checked_count(n_rows, n_cols, "rans_encode");
  ext.clear();
  for (size_t c = 0; c < n_cols; ++c)
    if (const RansEncodeTable* t = tables[c]) {
      if (t->scale_bits < 1 || t->scale_bits > kMaxScaleBits || t->syms.size() != t->alphabet_size || t->alphabet_size == 0)
        throw Error(ErrorCode::kInvalidArgument,
                    "rans_encode: encode table of column " + std::to_string(c) + " is not built from a FrequencyTable");
      ext.push_back(EncCol{t->syms.data(), t->alphabet_size, uint32_t(c)});
    }
  n_active = ext.size();
  n_coded = n_rows * n_active;
  if (n_coded == 0) return false;
  // Columns unrolled (as in the decoder) so a group of kRansLanes symbols
  // starting at column k0 reads ext[k0 .. k0 + kRansLanes) without wrapping.
  for (size_t k = 0; k < kRansLanes; ++k) ext.push_back(ext[k % n_active]);
  // The coded symbols in coding order: the input itself when no column is skipped.
  flat = symbols;
  if (n_active != n_cols) {
    compact.resize(n_coded);
    size_t q = 0;
    for (size_t r = 0; r < n_rows; ++r)
      for (size_t k = 0; k < n_active; ++k) compact[q++] = symbols[r * n_cols + ext[k].col];
    flat = compact.data();
  }
  // Validate first: an error must not leave a half-written stream behind
  // (cheap: one compare per symbol).
  {
    last.resize(n_active);
    for (size_t k = 0; k < n_active; ++k) last[k] = uint16_t(ext[k].alphabet - 1);
    bool bad = false;
#ifdef KVCODEC_RANS_AVX2
    if (simd_avx2())
      bad = any_symbol_above_avx2(flat, last.data(), n_rows, n_active);
    else
#endif
      for (size_t r = 0; r < n_rows; ++r) {
        const uint16_t* row = flat + r * n_active;
        for (size_t k = 0; k < n_active; ++k) bad |= row[k] > last[k];
      }
    if (bad)
      for (size_t i = 0; i < n_coded; ++i) {
        const EncCol& c = ext[i % n_active];
        if (flat[i] >= c.alphabet) symbol_out_of_range(i / n_active, c.col, flat[i], c.alphabet);
      }
  }
  // At most 2 bytes per symbol, plus the flushed states, plus 16 bytes below
  // them for the junk the AVX2 encoder's packed stores leave under a group.
  buf.resize(2 * n_coded + 4 * kRansLanes + 16);
  end = buf.data() + buf.size();
  p = end;
  for (auto& v : x) v = kRansLow;
  // Coded symbol i goes to lane i % kRansLanes; the encoder runs backwards.
  // First the incomplete last group, then whole groups with every lane's
  // state in a register.
  full = n_coded / kRansLanes * kRansLanes;
  for (size_t i = n_coded; i-- > full;) {
    const EncCol& c = ext[i % n_active];
    x[i % kRansLanes] = encode_fast(x[i % kRansLanes], p, c.syms[flat[i]]);
  }
  k0 = full % n_active;  // column of symbol `full`
  // Byte offsets of the tables from cols[0]'s, when they all fit in 32
  // bits with room for 16 * symbol (< 2^20) on top.
  near = path == EncodePath::kAuto || path == EncodePath::kOtherChain;
  if (near) {
    offs.resize(ext.size());
    const auto base = reinterpret_cast<uintptr_t>(ext[0].syms);
    constexpr intptr_t kLimit = (intptr_t(1) << 31) - (intptr_t(1) << 21);
    for (size_t k = 0; k < ext.size() && near; ++k) {
      const intptr_t d = intptr_t(reinterpret_cast<uintptr_t>(ext[k].syms) - base);
      near = d > -kLimit && d < kLimit;
      offs[k] = int32_t(d);
    }
  }
  return true;
}

void EncodeJob::groups(EncodePath path, bool vector) {
#ifdef KVCODEC_RANS_AVX2
  if (vector && full > 0) {
    const auto run = [&](auto blend) {
      if (near)
        encode_groups_avx2<true, decltype(blend)::value>(cols(), offs.data(), flat, n_active, full, k0, p, x);
      else
        encode_groups_avx2<false, decltype(blend)::value>(cols(), nullptr, flat, n_active, full, k0, p, x);
    };
    if ((path == EncodePath::kOtherChain) != blend_chain())
      run(std::true_type{});
    else
      run(std::false_type{});
    return;
  }
#else
  (void)path, (void)vector;
#endif
  const EncCol* const c0 = cols();
  for (size_t i0 = full; i0 > 0;) {
    i0 -= kRansLanes;
    k0 = k0 >= kRansLanes % n_active ? k0 - kRansLanes % n_active : k0 + n_active - kRansLanes % n_active;
    const EncCol* c = c0 + k0;
    const uint16_t* sy = flat + i0;
#pragma GCC unroll 8
    for (size_t j = kRansLanes; j-- > 0;) x[j] = encode_fast(x[j], p, c[j].syms[sy[j]]);
  }
}

std::vector<uint8_t> EncodeJob::finish() {
  const size_t lanes_used = std::min(kRansLanes, n_coded);
  for (size_t l = lanes_used; l-- > 0;) {
    p -= 4;
    put_state(p, x[l]);
  }
  return std::vector<uint8_t>(p, end);
}

bool vector_groups(EncodePath path) {
#ifdef KVCODEC_RANS_AVX2
  return path != EncodePath::kScalar && simd_avx2();
#else
  (void)path;
  return false;
#endif
}

std::vector<uint8_t> rans_encode_impl(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                      const std::vector<const RansEncodeTable*>& tables, EncodePath path) {
  thread_local EncodeJob job;
  if (!job.prepare(symbols, n_rows, n_cols, tables, path)) return {};
  job.groups(path, vector_groups(path));
  return job.finish();
}

#ifdef KVCODEC_RANS_AVX2
KVCODEC_VNNI_BEGIN
// Two streams' whole groups side by side: each group's state update is a
// chain of ~20 cycles (two 5-cycle multiplies among them) that one stream's
// loop waits on; two independent chains overlap. Compiled with the EVEX
// encoding (the VNNI target: 32 vector registers; two loops' states and
// fetched rows did not fit AVX2's 16) and run where simd_vnni() says.
template <bool kOffsets, bool kBlend>
void encode_group_pair(EncodeJob& a, EncodeJob& b) {
  const PackTable& pack = pack_table();
  const auto loop = [](EncodeJob& j) {
    return GroupLoop<kOffsets, kBlend>(j.cols(), kOffsets ? j.offs.data() : nullptr, j.flat, j.n_active, j.full,
                                       j.k0, j.p, j.x);
  };
  GroupLoop<kOffsets, kBlend> ga = loop(a), gb = loop(b);
  bool more_a = true, more_b = true;
  while (more_a && more_b) {
    more_a = ga.step(pack);
    more_b = gb.step(pack);
  }
  while (more_a) more_a = ga.step(pack);
  while (more_b) more_b = gb.step(pack);
  ga.finish(a.p, a.x);
  gb.finish(b.p, b.x);
}
KVCODEC_VNNI_END
#endif

}  // namespace

std::pair<std::vector<uint8_t>, std::vector<uint8_t>> rans_encode_pair(const RansEncodeInput& a,
                                                                      const RansEncodeInput& b) {
  thread_local EncodeJob ja, jb;
  const bool has_a = ja.prepare(a.symbols, a.n_rows, a.n_cols, *a.tables, EncodePath::kAuto);
  const bool has_b = jb.prepare(b.symbols, b.n_rows, b.n_cols, *b.tables, EncodePath::kAuto);
  const bool vector = vector_groups(EncodePath::kAuto);
#ifdef KVCODEC_RANS_AVX2
  if (has_a && has_b && vector && simd_vnni() && ja.full > 0 && jb.full > 0 && ja.near == jb.near) {
    const auto run = [&](auto blend) {
      if (ja.near)
        encode_group_pair<true, decltype(blend)::value>(ja, jb);
      else
        encode_group_pair<false, decltype(blend)::value>(ja, jb);
    };
    if (blend_chain())
      run(std::true_type{});
    else
      run(std::false_type{});
    return {ja.finish(), jb.finish()};
  }
#endif
  if (has_a) ja.groups(EncodePath::kAuto, vector);
  if (has_b) jb.groups(EncodePath::kAuto, vector);
  return {has_a ? ja.finish() : std::vector<uint8_t>{}, has_b ? jb.finish() : std::vector<uint8_t>{}};
}

std::vector<uint8_t> rans_encode(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                 const std::vector<const RansEncodeTable*>& tables) {
  return rans_encode_impl(symbols, n_rows, n_cols, tables, EncodePath::kAuto);
}

std::vector<uint8_t> rans_encode_portable(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                          const std::vector<const RansEncodeTable*>& tables) {
  return rans_encode_impl(symbols, n_rows, n_cols, tables, EncodePath::kScalar);
}

std::vector<uint8_t> rans_encode_vector_pointers(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                                 const std::vector<const RansEncodeTable*>& tables) {
  return rans_encode_impl(symbols, n_rows, n_cols, tables, EncodePath::kPointers);
}

std::vector<uint8_t> rans_encode_other_chain(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                             const std::vector<const RansEncodeTable*>& tables) {
  return rans_encode_impl(symbols, n_rows, n_cols, tables, EncodePath::kOtherChain);
}

std::vector<uint8_t> rans_encode(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                 const std::vector<const FrequencyTable*>& tables) {
  const std::vector<uint32_t> cols = active_columns(n_cols, tables, "rans_encode");
  checked_count(n_rows, n_cols, "rans_encode");
  const size_t n_active = cols.size();
  const size_t n_coded = n_rows * n_active;
  if (n_coded == 0) return {};
  check_tables(cols, tables);
  check_symbols(symbols, n_rows, n_cols, cols, tables);

  const size_t lanes_used = std::min(kRansLanes, n_coded);
  // At most 2 bytes per symbol (scale <= 16), plus the flushed states.
  std::vector<uint8_t> buf(2 * n_coded + 4 * kRansLanes);
  uint8_t* const end = buf.data() + buf.size();
  uint8_t* p = end;
  uint32_t x[kRansLanes];
  for (auto& v : x) v = kRansLow;

  size_t i = n_coded;
  for (size_t r = n_rows; r-- > 0;) {
    const uint16_t* row = symbols + r * n_cols;
    for (size_t k = n_active; k-- > 0;) {
      --i;
      const FrequencyTable& t = *tables[cols[k]];
      const uint16_t s = row[cols[k]];
      uint32_t& st = x[i % kRansLanes];
      st = encode_step(st, p, t.freq[s], t.cum[s], t.scale_bits);
    }
  }
  for (size_t l = lanes_used; l-- > 0;) {
    p -= 4;
    put_state(p, x[l]);
  }
  return std::vector<uint8_t>(p, end);
}

namespace {

#ifdef KVCODEC_RANS_AVX2
KVCODEC_AVX2_BEGIN
// A stream's position in the paired loop: what a group step changes.
struct PairCursor {
  __m256i X;
  const uint8_t* p;
  size_t i, k0;
};

// One group of each of N packed streams in lockstep: their row loops share
// one loop body and their updates one straight-line block, so the N
// independent dependency chains interleave in program order. The decoder
// is latency-bound (a group is one long chain: search, update,
// renormalisation, next search), so more streams in flight decode faster
// (docs/history/kvtc-speed.md, "Four streams in lockstep"). A lane's keys
// ascend row by row, so the last key <= bound is the largest: each row
// replaces the accumulator where it is <= bound (a blend instead of and +
// max: one vector op less per row, 1.01x the decode in the same A/B as
// the window's). Two accumulators per stream take alternate rows; the
// larger of the two is the answer. Every group is a vector one without
// scalar lanes (run_lockstep takes the other steps one stream at a time).
template <int N>
__attribute__((always_inline)) inline void step_lockstep(SimdStream* const* S, PairCursor* c) {
  const DecodeConsts* k = S[0]->k;
  __m256i q[N], slot[N], bound[N], acc[N];
  const int32_t* row[N];
  const int32_t* end[N];
  uint32_t common = ~0u;
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) {
    const SimdGroup& g = S[j]->group(c[j].k0);
    q[j] = _mm256_srlv_epi32(c[j].X, _mm256_load_si256(reinterpret_cast<const __m256i*>(g.scale)));
    slot[j] = _mm256_and_si256(c[j].X, _mm256_load_si256(reinterpret_cast<const __m256i*>(g.mask)));
    bound[j] = _mm256_or_si256(_mm256_slli_epi32(slot[j], 19), ld(k->key_low));
    const SearchRows sr = search_rows(g, S[j]->rows, bound[j], k);
    acc[j] = _mm256_sub_epi32(bound[j], sr.init);
    row[j] = sr.t;
    end[j] = sr.t + size_t(sr.n) * kRansLanes;
    common = std::min(common, sr.n);
  }
  // The largest key <= bound by key_gap, one accumulator per stream (the
  // N streams' chains overlap; a second one each made GCC spill).
#define KVTC_ROW(j) acc[j] = _mm256_min_epu32(acc[j], key_gap(bound[j], row[j]))
  for (uint32_t r = common; r > 0; --r) {
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) {
      KVTC_ROW(j);
      row[j] += kRansLanes;
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j)
    for (; row[j] < end[j]; row[j] += kRansLanes) KVTC_ROW(j);
#undef KVTC_ROW
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) {
    const __m256i key = _mm256_sub_epi32(bound[j], acc[j]);
    finish_group_at(k, _mm256_and_si256(_mm256_srli_epi32(key, 13), ld(k->sym_mask)), _mm256_srli_epi32(key, 19),
                    _mm256_and_si256(key, ld(k->freq13_mask)), slot[j], q[j], c[j].X, c[j].p, S[j]->dst + c[j].i);
    next_group(c[j].i, c[j].k0, S[j]->n_active);
  }
}

// The lockstep loop while every stream can step and none's next group is
// a scalar one or has scalar lanes (Group::apart), on local cursors (lane
// states, stream pointers, group positions) whose addresses never escape
// and with no call inside, so GCC keeps them in registers. Stepping whole
// local SimdStream copies, with the scalar groups' out-of-line step inside
// the loop, it stored the lane states to the stack after every group and
// loaded them back before the next: a store-to-load round trip in each
// stream's dependency chain. In-process A/B of the two loops (alternating
// whole-cache decodes of the tinycode dump, bench_kvtc, median of the
// ratios): 1.057x the decode at the 1% target (inter-quartile
// 1.036-1.074), 1.050x at 5%.
template <int N>
__attribute__((noinline)) void run_lockstep_vector(SimdStream* const* S) {
  PairCursor c[N];
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) c[j] = PairCursor{S[j]->X, S[j]->p, S[j]->i, S[j]->k0};
  for (;;) {
    bool go = true;
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j)
      go &= group_fits(c[j].i, S[j]->n_coded, c[j].p, S[j]->end) & !S[j]->group(c[j].k0).apart;
    if (!go) break;
    step_lockstep<N>(S, c);
  }
#pragma GCC unroll 4
  for (int j = 0; j < N; ++j) S[j]->X = c[j].X, S[j]->p = c[j].p, S[j]->i = c[j].i, S[j]->k0 = c[j].k0;
}

// N packed streams to where one can no longer step: lockstep runs, and
// between them one step alone of each stream whose next group is apart
// (the others wait for it). (Patching scalar lanes inside the lockstep
// loop cost the defaults, which have none, 5% of their decode: A/B of two
// CLI builds, four alternating rounds.)
template <int N>
void run_lockstep(SimdStream* const* S) {
  for (;;) {
    run_lockstep_vector<N>(S);
    for (int j = 0; j < N; ++j)
      if (!S[j]->can_step()) return;
    for (int j = 0; j < N; ++j)
      if (S[j]->group(S[j]->k0).apart) S[j]->step();
  }
}
KVCODEC_AVX2_END
#endif

// One rANS stream being decoded: start() validates and sets up (states,
// column cycle, the AVX2 group tables), the caller runs the group decoder
// (simd, when usable) and finish() decodes the rest with the scalar lanes,
// checks the end of the stream and scatters skipped columns. The scratch
// vectors are reused across calls (a 64-token block is a few microseconds
// of work: per-call heap allocations would show).
class Decoder {
 public:
  // False when there is nothing to decode (then everything is done).
  bool start(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols,
             const std::vector<const RansDecodeTable*>& tables, uint16_t* out, bool allow_simd,
             const RansGroupTables* pre = nullptr) {
    if (tables.size() != n_cols)
      throw Error(ErrorCode::kInvalidArgument, "rans_decode: " + std::to_string(tables.size()) + " tables for " +
                                                   std::to_string(n_cols) + " columns");
    cols_.clear();
    for (size_t c = 0; c < n_cols; ++c)
      if (tables[c]) cols_.push_back(uint32_t(c));
    const size_t total_out = checked_count(n_rows, n_cols, "rans_decode");
    n_rows_ = n_rows, n_cols_ = n_cols, out_ = out;
    n_active_ = cols_.size();
    n_coded_ = n_rows * n_active_;
    // Skipped columns decode to 0 (with none skipped every entry is written).
    if (total_out && n_active_ != n_cols) std::memset(out, 0, total_out * sizeof(uint16_t));
    if (n_coded_ == 0) {
      if (size != 0) bad_stream(std::to_string(size) + " bytes where no symbols are coded");
      return false;
    }
    // Tables the prebuilt groups were validated with need no second look
    // (~2% of a 64-token block's decode instructions).
    if (!(pre && pre->built_from == tables)) check_decode_tables(cols_, tables);
    lanes_used_ = std::min(kRansLanes, n_coded_);
    if (size < 4 * lanes_used_)
      bad_stream("truncated: " + std::to_string(size) + " bytes cannot hold " + std::to_string(lanes_used_) +
                 " lane states");
    for (size_t l = 0; l < kRansLanes; ++l) {
      x_[l] = kRansLow;
      if (l < lanes_used_) {
        x_[l] = get_state(data + 4 * l);
        if (x_[l] < kRansLow || x_[l] >= (kRansLow << 8))
          bad_stream("lane " + std::to_string(l) + " state " + std::to_string(x_[l]) + " outside [2^23, 2^31)");
      }
    }
    p_ = data + 4 * lanes_used_;
    end_ = data + size;
    tables_ = &tables;
    ext_built_ = false;
    // With no skipped columns the coded order is the output order.
    dense_ = n_active_ == n_cols;
    dst_ = out;
    if (!dense_) {
      compact_.resize(n_coded_);
      dst_ = compact_.data();
    }
    i_ = 0, k0_ = 0;
    simd_ = false;
#ifdef KVCODEC_RANS_AVX2
    if (allow_simd && simd_avx2() && n_coded_ >= 4 * kRansLanes) {
      if (pre && pre->n_active == n_active_ && pre->group_at.size() == n_active_) {
        simd_ = pre->usable;
        group_ptr_ = pre->groups.data(), group_at_ptr_ = pre->group_at.data(), rows_ptr_ = pre->rows.data();
        packed_ = pre->packed;
        if (simd_ && pre->any_scalar) build_ext();
      } else if (build_ext(), build_simd_groups(ext_.data(), n_active_, groups_, group_at_, rows_, packed_, any_scalar_)) {
        simd_ = true;
        group_ptr_ = groups_.data(), group_at_ptr_ = group_at_.data(), rows_ptr_ = rows_.data();
      }
    }
#else
    (void)allow_simd;
    (void)pre;
#endif
    return true;
  }

#ifdef KVCODEC_RANS_AVX2
  bool simd() const { return simd_; }
  KVCODEC_TARGET_AVX2 SimdStream simd_stream() {
    SimdStream st;
    st.groups = group_ptr_, st.group_at = group_at_ptr_, st.rows = rows_ptr_, st.ext = ext_built_ ? ext_.data() : nullptr;
    st.n_active = n_active_, st.n_coded = n_coded_, st.i = i_, st.k0 = k0_;
    st.p = p_, st.end = end_, st.dst = dst_, st.packed = packed_;
    st.X = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x_));
    return st;
  }
  KVCODEC_TARGET_AVX2 void take(const SimdStream& st) {
    i_ = st.i, k0_ = st.k0, p_ = st.p;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x_), st.X);
  }
  // The group decoder alone over what this stream has left (then finish()).
  KVCODEC_TARGET_AVX2 void run_simd() {
    if (!simd_) return;
    SimdStream st = simd_stream();
    while (st.can_step()) st.step();
    step_padded_tail(st);
    take(st);
  }
#endif

  // A started stream decoded on its own: its group decoder, then finish().
  void run_alone() {
#ifdef KVCODEC_RANS_AVX2
    run_simd();
#endif
    finish();
  }

  void finish() {
    if (i_ < n_coded_) build_ext();
    size_t i = i_, k0 = k0_;
    const uint8_t* p = p_;
    const uint8_t* const end = end_;
    uint32_t* const x = x_;
    uint16_t* const dst = dst_;
    const size_t n_coded = n_coded_, n_active = n_active_;
    // Scalar lanes: a group of kRansLanes symbols reads at most 2 bytes each
    // (after a decode step x >= 2^(23 - scale) >= 2^7), so with that many
    // bytes left no per-byte bound check is needed.
    while (group_fits(i, n_coded, p, end)) {
      scalar_group(&ext_[k0], x, p, dst + i);
      next_group(i, k0, n_active);
    }
    // Careful path for the tail: every byte read is bounds-checked.
    for (; i < n_coded; ++i) {
      const DecCol& c = ext_[k0];
      uint32_t& s = x[i % kRansLanes];
      const uint32_t slot = s & c.mask;
      const uint32_t sym = lookup_symbol(c, slot);
      const RansDecodeTable::Sym e = c.syms[sym];
      dst[i] = uint16_t(sym);
      s = e.freq * (s >> c.scale) + slot - e.cum;
      while (s < kRansLow) {
        if (p == end)
          bad_stream("truncated: ran out of bytes at symbol " + std::to_string(i) + " of " + std::to_string(n_coded));
        s = (s << 8) | *p++;
      }
      if (++k0 == n_active) k0 = 0;
    }
    if (p != end) bad_stream(std::to_string(end - p) + " trailing bytes after the last symbol");
    for (size_t l = 0; l < lanes_used_; ++l)
      if (x[l] != kRansLow) bad_stream("lane " + std::to_string(l) + " did not return to its initial state (corrupt data)");
    if (!dense_) {
      size_t q = 0;
      for (size_t r = 0; r < n_rows_; ++r) {
        uint16_t* row = out_ + r * n_cols_;
        for (uint32_t c : cols_) row[c] = compact_[q++];
      }
    }
  }

 private:
  // The per-column data of the scalar lanes (and of build_simd_groups),
  // built only when needed: with prebuilt group tables a whole stream
  // usually decodes without it.
  void build_ext() {
    if (ext_built_) return;
    // Columns unrolled so that positions k0 .. k0 + kRansLanes - 1 of the
    // cyclic column sequence never wrap inside one group.
    ext_.resize(n_active_ + kRansLanes);
    for (size_t k = 0; k < ext_.size(); ++k) {
      ext_[k] = dec_col(*(*tables_)[cols_[k % n_active_]]);
    }
    ext_built_ = true;
  }

  const std::vector<const RansDecodeTable*>* tables_ = nullptr;
  bool ext_built_ = false;
  std::vector<uint32_t> cols_;
  std::vector<DecCol> ext_;
  std::vector<uint16_t> compact_;
#ifdef KVCODEC_RANS_AVX2
  std::vector<SimdGroup> groups_;
  std::vector<uint32_t> group_at_;
  std::vector<int32_t> rows_;
  const SimdGroup* group_ptr_ = nullptr;
  const uint32_t* group_at_ptr_ = nullptr;
  const int32_t* rows_ptr_ = nullptr;
#endif
  size_t n_rows_ = 0, n_cols_ = 0, n_active_ = 0, n_coded_ = 0, lanes_used_ = 0, i_ = 0, k0_ = 0;
  uint16_t* out_ = nullptr;
  uint16_t* dst_ = nullptr;
  const uint8_t* p_ = nullptr;
  const uint8_t* end_ = nullptr;
  alignas(32) uint32_t x_[kRansLanes] = {};
  bool dense_ = true, simd_ = false, packed_ = false, any_scalar_ = false;
};

Decoder& decoder(size_t which) {
  thread_local Decoder d[kRansMaxStreams];
  return d[which];
}

#ifdef KVCODEC_RANS_AVX2
// rans_decode_streams' group decoders over the started streams that have
// one (simd()): packed streams in lockstep, four while four can step, then
// in pairs; what is left (unpacked streams, a packed one without a
// partner, the ends) one group of each stream in turn, then each alone.
KVCODEC_TARGET_AVX2 void run_simd_streams(Decoder* const* d, const bool* started, size_t n) {
  SimdStream st[kRansMaxStreams];
  SimdStream* all[kRansMaxStreams];
  SimdStream* packed[kRansMaxStreams];
  size_t n_all = 0, n_packed = 0;
  for (size_t j = 0; j < n; ++j) {
    if (!started[j] || !d[j]->simd()) continue;
    st[j] = d[j]->simd_stream();
    all[n_all++] = &st[j];
    if (st[j].packed) packed[n_packed++] = &st[j];
  }
  if (n_packed == 4) run_lockstep<4>(packed);
  if (n_packed >= 2) run_lockstep<2>(packed);
  if (n_packed == 4) run_lockstep<2>(packed + 2);
  // Independent chains still alternate while two or more can step.
  for (size_t stepping = n_all; stepping >= 2;) {
    stepping = 0;
    for (size_t j = 0; j < n_all; ++j)
      if (all[j]->can_step()) {
        all[j]->step();
        ++stepping;
      }
  }
  for (size_t j = 0; j < n; ++j) {
    if (!started[j] || !d[j]->simd()) continue;
    while (st[j].can_step()) st[j].step();
    step_padded_tail(st[j]);
    d[j]->take(st[j]);
  }
}
#endif

void rans_decode_impl(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols,
                      const std::vector<const RansDecodeTable*>& tables, uint16_t* out, bool allow_simd,
                      const RansGroupTables* pre = nullptr) {
  Decoder& d = decoder(0);
  if (d.start(data, size, n_rows, n_cols, tables, out, allow_simd, pre)) d.run_alone();
}

}  // namespace

void rans_decode(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols,
                 const std::vector<const RansDecodeTable*>& tables, uint16_t* out) {
  rans_decode_impl(data, size, n_rows, n_cols, tables, out, /*allow_simd=*/true);
}

void rans_decode_streams(const RansDecodeJob* jobs, size_t n) {
  if (n > kRansMaxStreams)
    throw Error(ErrorCode::kInvalidArgument, "rans_decode_streams: " + std::to_string(n) + " streams, at most " +
                                                 std::to_string(kRansMaxStreams));
  Decoder* d[kRansMaxStreams] = {};
  bool started[kRansMaxStreams] = {};
  for (size_t j = 0; j < n; ++j) {
    d[j] = &decoder(j);
    try {
      started[j] = d[j]->start(jobs[j].data, jobs[j].size, jobs[j].n_rows, jobs[j].n_cols, *jobs[j].tables,
                               jobs[j].out, true, jobs[j].groups);
    } catch (const Error&) {
      // As calls one by one would: the streams before it decoded (and the
      // first error among them thrown first).
      for (size_t i = 0; i < j; ++i)
        if (started[i]) d[i]->run_alone();
      throw;
    }
  }
#ifdef KVCODEC_RANS_AVX2
  run_simd_streams(d, started, n);
#endif
  for (size_t j = 0; j < n; ++j)
    if (started[j]) d[j]->finish();
}

void rans_decode_pair(const RansDecodeJob& a, const RansDecodeJob& b) {
  const RansDecodeJob jobs[2] = {a, b};
  rans_decode_streams(jobs, 2);
}

void rans_decode(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols,
                 const std::vector<const RansDecodeTable*>& tables, uint16_t* out, const RansGroupTables& groups) {
  rans_decode_impl(data, size, n_rows, n_cols, tables, out, /*allow_simd=*/true, &groups);
}

namespace {

RansGroupTables group_tables(const std::vector<const RansDecodeTable*>& tables, bool fast_windows) {
  RansGroupTables g;
#ifdef KVCODEC_RANS_AVX2
  std::vector<uint32_t> cols;
  for (size_t c = 0; c < tables.size(); ++c)
    if (tables[c]) cols.push_back(uint32_t(c));
  if (cols.empty()) return g;
  check_decode_tables(cols, tables);
  g.built_from = tables;
  std::vector<DecCol> ext(cols.size() + kRansLanes);
  for (size_t k = 0; k < ext.size(); ++k) {
    ext[k] = dec_col(*tables[cols[k % cols.size()]]);
  }
  g.n_active = cols.size();
  // Not usable: group_at is still sized, so the decoder takes the scalar
  // lanes without rebuilding.
  g.usable = build_simd_groups(ext.data(), g.n_active, g.groups, g.group_at, g.rows, g.packed, g.any_scalar,
                               /*windows=*/true, fast_windows);
  g.groups.shrink_to_fit();  // held for the tables' lifetime: exact size
  g.rows.shrink_to_fit();
#else
  (void)tables, (void)fast_windows;
#endif
  return g;
}

}  // namespace

RansGroupTables rans_group_tables(const std::vector<const RansDecodeTable*>& tables) {
  return group_tables(tables, /*fast_windows=*/true);
}

RansGroupTables rans_group_tables_reference(const std::vector<const RansDecodeTable*>& tables) {
  return group_tables(tables, /*fast_windows=*/false);
}

void rans_decode_portable(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols,
                          const std::vector<const RansDecodeTable*>& tables, uint16_t* out) {
  rans_decode_impl(data, size, n_rows, n_cols, tables, out, /*allow_simd=*/false);
}

// --- single-lane reference ------------------------------------------------------

std::vector<uint8_t> rans_encode_reference(const uint16_t* symbols, size_t n_rows, size_t n_cols,
                                           const std::vector<const FrequencyTable*>& tables) {
  const std::vector<uint32_t> cols = active_columns(n_cols, tables, "rans_encode_reference");
  checked_count(n_rows, n_cols, "rans_encode_reference");
  if (n_rows == 0 || cols.empty()) return {};
  check_tables(cols, tables);
  check_symbols(symbols, n_rows, n_cols, cols, tables);
  std::vector<uint8_t> buf(2 * n_rows * cols.size() + 4);
  uint8_t* const end = buf.data() + buf.size();
  uint8_t* p = end;
  uint32_t x = kRansLow;
  for (size_t r = n_rows; r-- > 0;)
    for (size_t k = cols.size(); k-- > 0;) {
      const FrequencyTable& t = *tables[cols[k]];
      const uint16_t s = symbols[r * n_cols + cols[k]];
      x = encode_step(x, p, t.freq[s], t.cum[s], t.scale_bits);
    }
  p -= 4;
  put_state(p, x);
  return std::vector<uint8_t>(p, end);
}

void rans_decode_reference(const uint8_t* data, size_t size, size_t n_rows, size_t n_cols,
                           const std::vector<const FrequencyTable*>& tables, uint16_t* out) {
  const std::vector<uint32_t> cols = active_columns(n_cols, tables, "rans_decode_reference");
  const size_t total_out = checked_count(n_rows, n_cols, "rans_decode_reference");
  if (total_out) std::memset(out, 0, total_out * sizeof(uint16_t));
  if (n_rows == 0 || cols.empty()) {
    if (size != 0) bad_stream("bytes where no symbols are coded");
    return;
  }
  check_tables(cols, tables);
  if (size < 4) bad_stream("truncated state");
  uint32_t x = get_state(data);
  if (x < kRansLow || x >= (kRansLow << 8)) bad_stream("state outside [2^23, 2^31)");
  const uint8_t* p = data + 4;
  const uint8_t* const end = data + size;
  for (size_t r = 0; r < n_rows; ++r)
    for (uint32_t c : cols) {
      const FrequencyTable& t = *tables[c];
      const uint32_t slot = x & (t.total() - 1);
      // Binary search over cum: slow, obviously correct.
      const uint32_t s = uint32_t(std::upper_bound(t.cum.begin(), t.cum.end(), slot) - t.cum.begin()) - 1;
      out[r * n_cols + c] = uint16_t(s);
      x = t.freq[s] * (x >> t.scale_bits) + slot - t.cum[s];
      while (x < kRansLow) {
        if (p == end) bad_stream("truncated");
        x = (x << 8) | *p++;
      }
    }
  if (p != end) bad_stream("trailing bytes");
  if (x != kRansLow) bad_stream("final state mismatch");
}

}  // namespace kvcodec::entropy

namespace kvcodec::entropy {

uint64_t RansDecodeTable::held_bytes() const {
  return uint64_t(slot_symbol.capacity() + search.capacity()) * sizeof(uint16_t) +
         uint64_t(syms.capacity()) * sizeof(Sym);
}

uint64_t RansGroupTables::held_bytes() const {
  return uint64_t(groups.capacity()) * sizeof(Group) + uint64_t(group_at.capacity()) * sizeof(uint32_t) +
         uint64_t(rows.capacity()) * sizeof(int32_t) +
         uint64_t(built_from.capacity()) * sizeof(const RansDecodeTable*);
}

}  // namespace kvcodec::entropy

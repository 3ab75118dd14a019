// The division-free rANS encoder (RansEncodeTable) against the textbook one:
// its quotient is exact for every frequency and every reachable state, and it
// writes the same bytes on random and worst-case inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <random>
#include <string>

#include "core/cpu_features.hpp"
#include "entropy/entropy.hpp"
#include "entropy_test_util.hpp"

namespace kvcodec::entropy {
namespace {

// floor(x / f) as the encoder computes it.
uint32_t quotient(const RansEncodeTable::Sym& e, uint32_t x) {
  return uint32_t((uint64_t(x) * e.rcp) >> 32) >> e.shift;
}

TEST(RansFast, QuotientIsExactForEveryFrequency) {
  std::mt19937 rng(21);
  const uint32_t x_hi = (kRansLow << 8) - 1;  // largest state (2^31 - 1)
  for (uint32_t f = 2; f < 65536; ++f) {
    const FrequencyTable t = FrequencyTable::from_freqs({f, 65536 - f}, 16);
    const RansEncodeTable enc(t);
    const RansEncodeTable::Sym& e = enc.syms[0];
    // The worst cases sit just below multiples of f; check those near both
    // ends of the range, the top of the range, and random states.
    for (uint32_t x : std::initializer_list<uint32_t>{f - 1, f, 2 * f - 1, 2 * f, x_hi, x_hi - 1, x_hi - x_hi % f, x_hi - x_hi % f - 1, uint32_t(rng() >> 1),
                       uint32_t(rng() >> 1), uint32_t(kRansLow), (x_hi / f) * f - 1})
      ASSERT_EQ(quotient(e, x), x / f) << "f " << f << " x " << x;
  }
  // f == 1 and f == M (a one-symbol alphabet) take the special constants.
  const FrequencyTable ones = FrequencyTable::from_freqs({1, 65535}, 16);
  const RansEncodeTable one(ones);
  for (uint32_t x : {1u, 2u, kRansLow, x_hi}) {
    const auto& e = one.syms[0];
    ASSERT_EQ(x + e.bias + quotient(e, x) * e.cmpl_freq, x * 65536u + 0u) << x;
  }
  const RansEncodeTable full(FrequencyTable::from_freqs({65536}, 16));
  for (uint32_t x : {kRansLow, x_hi}) ASSERT_EQ(quotient(full.syms[0], x), x >> 16);
}

// RansEncodeTable's reciprocals (rans_rcp by a double division, four per
// AVX2 division in tables of 4+ symbols) are the integer division's
// ceil(2^(31 + l) / f) for every frequency: f alone ({f, 65536 - f}: the
// scalar path), and f in the vector lanes ({f, 1, 1, 65534 - f}, f == 1
// lanes taking the special constants).
TEST(RansFast, ReciprocalEqualsTheIntegerDivision) {
  const auto l_of = [](uint32_t f) { return uint32_t(std::bit_width(f - 1)); };
  for (uint32_t f = 2; f <= 65536; ++f) ASSERT_EQ(rans_rcp(f, l_of(f)), rans_rcp_reference(f, l_of(f))) << f;
  const auto check = [&](const FrequencyTable& t) {
    const RansEncodeTable enc(t);
    for (uint32_t s = 0; s < t.alphabet_size; ++s) {
      const uint32_t f = t.freq[s];
      ASSERT_EQ(enc.syms[s].rcp, f == 1 ? 0xffffffffu : rans_rcp_reference(f, l_of(f))) << "f " << f << " s " << s;
    }
  };
  for (uint32_t f = 2; f < 65535; ++f) check(FrequencyTable::from_freqs({f, 65536 - f}, 16));
  for (uint32_t f = 2; f <= 65532; ++f) check(FrequencyTable::from_freqs({f, 1, 1, 65534 - f}, 16));
  for (uint32_t f = 1; f <= 1364; ++f) check(FrequencyTable::from_freqs({f, f, f, 4096 - 3 * f}, 12));
}

// Every constant of RansEncodeTable (four symbols at a time where AVX2
// runs, the last alphabet % 4 and every one elsewhere by the scalar loop)
// is its formula's, for random tables of 1..300 symbols at scales 9..16
// with many frequency-1 symbols (their special constants) and large ones.
TEST(RansFast, EncodeTableEqualsItsFormulas) {
  std::mt19937 rng(5);
  int tables = 0;
  for (uint32_t alphabet = 1; alphabet <= 300; alphabet += 1 + alphabet / 16)
    for (uint32_t scale = 9; scale <= 16; ++scale) {
      const uint32_t M = 1u << scale;
      if (alphabet > M) continue;
      std::vector<uint32_t> f(alphabet, 1);
      uint32_t left = M - alphabet;
      for (uint32_t s = 0; s + 1 < alphabet && left > 0; ++s)
        if (rng() % 3) {
          const uint32_t add = uint32_t(rng() % (left + 1)) / (rng() % 4 + 1);
          f[s] += add, left -= add;
        }
      f[rng() % alphabet] += left;
      const FrequencyTable t = FrequencyTable::from_freqs(f, scale);
      RansEncodeTable enc;
      enc.assign(FrequencyTable::from_freqs(std::vector<uint32_t>(2, M / 2), scale));  // reused below
      enc.assign(t);
      ASSERT_EQ(enc.syms.size(), size_t(alphabet));
      for (uint32_t s = 0; s < alphabet; ++s) {
        const RansEncodeTable::Sym& e = enc.syms[s];
        const uint32_t fs = t.freq[s], l = uint32_t(std::bit_width(fs - 1));
        const std::string what = "alphabet " + std::to_string(alphabet) + " scale " + std::to_string(scale) +
                                 " symbol " + std::to_string(s) + " f " + std::to_string(fs);
        ASSERT_EQ(e.x_max, ((kRansLow >> scale) << 8) * fs) << what;
        ASSERT_EQ(e.cmpl_freq, uint16_t(M - fs)) << what;
        ASSERT_EQ(e.rcp, fs == 1 ? 0xffffffffu : rans_rcp_reference(fs, l)) << what;
        ASSERT_EQ(e.shift, fs == 1 ? 0 : uint16_t(l - 1)) << what;
        ASSERT_EQ(e.bias, fs == 1 ? t.cum[s] + M - 1 : t.cum[s]) << what;
      }
      ++tables;
    }
  EXPECT_GT(tables, 200);
  // A table whose cumulative entries do not match its frequencies (from
  // the vector lanes' symbols too) throws as the scalar loop does.
  FrequencyTable broken = FrequencyTable::from_freqs({100, 200, 300, 400, 24}, 10);
  broken.cum[2] += 1;
  EXPECT_THROW(RansEncodeTable{broken}, Error);
}

struct Case {
  size_t rows, cols;
  std::vector<uint16_t> symbols;
  std::vector<FrequencyTable> ft;  // one per column; skipped columns hold a dummy
  std::vector<bool> skip;
};

Case random_case(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Case c;
  c.rows = rng() % 5 == 0 ? rng() % 10 : rng() % 300;
  c.cols = 1 + rng() % 70;
  c.symbols.resize(c.rows * c.cols);
  for (size_t k = 0; k < c.cols; ++k) {
    c.skip.push_back(rng() % 6 == 0);
    const uint32_t kind = uint32_t(rng() % 5);
    const uint32_t alphabet = kind == 0 ? 1 : kind == 1 ? 2 + rng() % 4 : kind == 2 ? 4096 : uint32_t(1 + rng() % 400);
    const uint32_t scale = rng() % 3 == 0 ? 16 : std::max<uint32_t>(FrequencyTable::default_scale_bits(alphabet), 12);
    // Skewed counts: a dominant symbol (max-frequency entries) and rare ones
    // (frequency 1) in the same table.
    std::vector<uint64_t> counts(alphabet, 0);
    const double sigma = 0.02 + 0.3 * double(rng() % 100) / 100.0;
    testing::Sampler sample(testing::gaussian_probs(alphabet, std::max(0.3, alphabet * sigma)));
    for (size_t r = 0; r < c.rows; ++r) {
      const uint16_t s = rng() % 50 == 0 ? uint16_t(rng() % alphabet) : sample(rng);
      c.symbols[r * c.cols + k] = c.skip.back() ? uint16_t(rng()) : s;  // junk in skipped columns
      if (!c.skip.back()) ++counts[s];
    }
    c.ft.push_back(FrequencyTable::from_counts(counts, scale, rng() % 2 ? 0.0 : kDefaultPrecisionLoss));
  }
  return c;
}

TEST(RansFast, SameBytesAsTheTextbookEncoder) {
  for (uint64_t seed = 0; seed < 100; ++seed) {
    const Case c = random_case(1000 + seed);
    std::vector<RansEncodeTable> et;
    std::vector<RansDecodeTable> dt;
    for (const auto& t : c.ft) et.emplace_back(t), dt.emplace_back(t);
    std::vector<const FrequencyTable*> fp;
    std::vector<const RansEncodeTable*> ep;
    std::vector<const RansDecodeTable*> dp;
    for (size_t k = 0; k < c.cols; ++k) {
      fp.push_back(c.skip[k] ? nullptr : &c.ft[k]);
      ep.push_back(c.skip[k] ? nullptr : &et[k]);
      dp.push_back(c.skip[k] ? nullptr : &dt[k]);
    }
    const auto ref = rans_encode(c.symbols.data(), c.rows, c.cols, fp);
    const auto fast = rans_encode(c.symbols.data(), c.rows, c.cols, ep);
    ASSERT_EQ(fast, ref) << "seed " << seed;
    // The scalar lanes of the division-free encoder (the AVX2 one's reference).
    ASSERT_EQ(rans_encode_portable(c.symbols.data(), c.rows, c.cols, ep), ref) << "seed " << seed;
    // The AVX2 group encoder's fallback (row addresses by pointer, for
    // tables too far apart for 32-bit offsets).
    ASSERT_EQ(rans_encode_vector_pointers(c.symbols.data(), c.rows, c.cols, ep), ref) << "seed " << seed;
    // The state update's other form (the one for the other vendor's cores).
    ASSERT_EQ(rans_encode_other_chain(c.symbols.data(), c.rows, c.cols, ep), ref) << "seed " << seed;
    std::vector<uint16_t> out(c.rows * c.cols, 0xbeef);
    rans_decode(fast.data(), fast.size(), c.rows, c.cols, dp, out.data());
    for (size_t r = 0; r < c.rows; ++r)
      for (size_t k = 0; k < c.cols; ++k)
        ASSERT_EQ(out[r * c.cols + k], c.skip[k] ? 0 : c.symbols[r * c.cols + k]) << seed << " " << r << " " << k;
  }
}

// Two streams through rans_encode_pair give each the bytes rans_encode
// gives it: side by side (the EVEX loop, where the CPU has it), one after
// the other (VNNI paths off) and on the plain paths; of any shapes, either
// or both empty, and a bad symbol in either refused as rans_encode refuses it.
TEST(RansFast, EncodePairEqualsTwoEncodes) {
  struct Built {
    Case c;
    std::vector<RansEncodeTable> et;
    std::vector<const RansEncodeTable*> ep;
    explicit Built(uint64_t seed) : c(random_case(seed)) {
      for (const auto& t : c.ft) et.emplace_back(t);
      for (size_t k = 0; k < c.cols; ++k) ep.push_back(c.skip[k] ? nullptr : &et[k]);
    }
    RansEncodeInput input() const { return {c.symbols.data(), c.rows, c.cols, &ep}; }
    std::vector<uint8_t> alone() const { return rans_encode(c.symbols.data(), c.rows, c.cols, ep); }
  };
  const bool vnni_was = simd_vnni();
  for (uint64_t seed = 0; seed < 60; ++seed) {
    const Built a(3000 + seed), b(4000 + seed);
    for (const bool avx2 : {true, false})
      for (const bool vnni : {true, false}) {
        ScopedSimd mode(avx2);
        set_simd_vnni(vnni);
        const auto ab = rans_encode_pair(a.input(), b.input());
        ASSERT_EQ(ab.first, a.alone()) << "seed " << seed << " avx2 " << avx2 << " vnni " << vnni;
        ASSERT_EQ(ab.second, b.alone()) << "seed " << seed << " avx2 " << avx2 << " vnni " << vnni;
        const auto aa = rans_encode_pair(a.input(), a.input());
        ASSERT_EQ(aa.first, a.alone());
        ASSERT_EQ(aa.second, a.alone());
      }
    set_simd_vnni(vnni_was);
    // A bad symbol in either stream: rans_encode's error.
    Built bad(5000 + seed);
    size_t k = 0;
    while (k < bad.c.cols && bad.c.skip[k]) ++k;
    if (bad.c.rows == 0 || k == bad.c.cols) continue;
    bad.c.symbols[(bad.c.rows - 1) * bad.c.cols + k] = uint16_t(bad.c.ft[k].alphabet_size);
    EXPECT_THROW(rans_encode(bad.c.symbols.data(), bad.c.rows, bad.c.cols, bad.ep), Error);
    EXPECT_THROW(rans_encode_pair(a.input(), bad.input()), Error);
    EXPECT_THROW(rans_encode_pair(bad.input(), a.input()), Error);
  }
}

// Three lookups of a slot's symbol: the slot table, the compare search
// (alphabets <= kRansSearchMax) and, in AVX2 builds with RansLookup::kAuto,
// no table for the alphabets the group decoder covers (the scalar lanes
// bisect cum). Each decodes what the slot table decodes, through the group
// decoder and through the scalar lanes alone (rans_decode_portable: every
// symbol by the lookup).
TEST(RansFast, SearchLookupMatchesSlotTable) {
  std::mt19937_64 rng(31);
  for (int trial = 0; trial < 600; ++trial) {
    const uint32_t alphabet = 1 + uint32_t(rng() % (kRansGroupMaxAlphabet + 3));
    uint32_t min_scale = 1;
    while ((1u << min_scale) < alphabet) ++min_scale;
    const uint32_t scale = min_scale + uint32_t(rng() % (15 - std::min<uint32_t>(min_scale, 14)));
    // Random frequencies summing to 2^scale, each >= 1: uniform cut points.
    std::vector<uint32_t> cuts{0, 1u << scale};
    std::vector<uint32_t> freq;
    {
      std::vector<uint32_t> pos;
      for (uint32_t i = 1; i < (1u << scale); ++i) pos.push_back(i);
      for (uint32_t i = 0; i + 1 < alphabet; ++i) std::swap(pos[i], pos[i + rng() % (pos.size() - i)]);
      cuts.insert(cuts.end(), pos.begin(), pos.begin() + (alphabet - 1));
      std::sort(cuts.begin(), cuts.end());
      for (size_t i = 0; i + 1 < cuts.size(); ++i) freq.push_back(cuts[i + 1] - cuts[i]);
    }
    const FrequencyTable t = FrequencyTable::from_freqs(freq, scale);
    const RansDecodeTable scalar(t, RansLookup::kScalar), with(t);
    const bool search = alphabet <= kRansSearchMax && scale <= 14;
    // No table where the AVX2 group decoder runs (chosen at run time).
    const bool none = simd_avx2() && alphabet <= kRansGroupMaxAlphabet && scale <= kRansGroupMaxScale;
    ASSERT_EQ(!scalar.search.empty(), search) << alphabet << " " << scale;
    ASSERT_EQ(scalar.slot_symbol.empty(), search) << alphabet << " " << scale;
    ASSERT_EQ(with.search.empty() && with.slot_symbol.empty(), none) << alphabet << " " << scale;
    if (!none) {
      EXPECT_EQ(with.search, scalar.search);
      EXPECT_EQ(with.slot_symbol, scalar.slot_symbol);
    }
    // The slot table, whichever lookup the constructor chose.
    RansDecodeTable without = scalar;
    if (!scalar.search.empty()) {
      std::vector<uint16_t>().swap(without.search);  // gives its memory back (= {} keeps the capacity)
      for (uint32_t s = 0; s < alphabet; ++s) without.slot_symbol.insert(without.slot_symbol.end(), freq[s], uint16_t(s));
      // The bytes held count the lookup each one keeps.
      EXPECT_EQ(without.held_bytes(), scalar.held_bytes() - 32 * 2 + without.slot_symbol.capacity() * 2);
    }
    if (none) {
      EXPECT_EQ(with.held_bytes(), with.syms.capacity() * sizeof(RansDecodeTable::Sym));
    }
    const size_t rows = 1 + rng() % 600;
    std::vector<uint16_t> sym(rows);
    for (auto& v : sym) v = uint16_t(rng() % alphabet);
    const auto bytes = rans_encode(sym.data(), rows, 1, std::vector<const FrequencyTable*>{&t});
    std::vector<uint16_t> a(rows), b(rows);
    rans_decode(bytes.data(), bytes.size(), rows, 1, {&with}, a.data());
    rans_decode(bytes.data(), bytes.size(), rows, 1, {&without}, b.data());
    ASSERT_EQ(a, sym) << trial;
    ASSERT_EQ(b, sym) << trial;
    rans_decode_portable(bytes.data(), bytes.size(), rows, 1, {&with}, a.data());
    rans_decode_portable(bytes.data(), bytes.size(), rows, 1, {&without}, b.data());
    ASSERT_EQ(a, sym) << trial;
    ASSERT_EQ(b, sym) << trial;
    rans_decode(bytes.data(), bytes.size(), rows, 1, {&scalar}, a.data());
    ASSERT_EQ(a, sym) << trial;
    // symbol_of (the lookup for decoders outside the module) against the
    // definition, on every table kind: slot table, search, neither.
    for (uint32_t slot = 0; slot < (1u << scale); slot += 1 + slot / 64) {
      uint32_t owner = 0;
      while (owner + 1 < alphabet && cuts[owner + 1] <= slot) ++owner;
      ASSERT_EQ(with.symbol_of(slot), owner) << trial << " slot " << slot;
      ASSERT_EQ(scalar.symbol_of(slot), owner) << trial << " slot " << slot;
      ASSERT_EQ(without.symbol_of(slot), owner) << trial << " slot " << slot;
    }
  }
}

// Random frequencies summing to 2^scale, each >= 1: uniform cut points, or
// (extreme) one symbol holding all but alphabet - 1 slots.
FrequencyTable random_freqs(std::mt19937_64& rng, uint32_t alphabet, uint32_t scale, bool extreme) {
  std::vector<uint32_t> freq;
  if (extreme) {
    freq.assign(alphabet, 1);
    freq[rng() % alphabet] = (1u << scale) - (alphabet - 1);
    return FrequencyTable::from_freqs(freq, scale);
  }
  std::vector<uint32_t> cuts{0, 1u << scale};
  for (uint32_t i = 0; i + 1 < alphabet; ++i) {
    uint32_t c;
    do c = 1 + uint32_t(rng() % ((1u << scale) - 1));
    while (std::find(cuts.begin(), cuts.end(), c) != cuts.end());
    cuts.push_back(c);
  }
  std::sort(cuts.begin(), cuts.end());
  for (size_t i = 0; i + 1 < cuts.size(); ++i) freq.push_back(cuts[i + 1] - cuts[i]);
  return FrequencyTable::from_freqs(freq, scale);
}

// The AVX2 group decoder (8 lanes per vector; alphabets <= 65, scales <= 14)
// against the scalar lanes: same symbols on streams that take it (column
// counts that are and are not multiples of 8, skipped columns, one-symbol
// and max-frequency alphabets, the largest alphabet and scale it serves) and
// on ones that fall back (one column past its limits), and the same errors
// on truncated, extended and corrupted streams.
// A random multi-column stream for the decoder tests (see below).
struct StreamCase {
  size_t rows = 0, cols = 0;
  std::vector<FrequencyTable> ft;
  std::vector<RansDecodeTable> dt;
  std::vector<bool> skip;
  std::vector<uint16_t> sym;
  std::vector<uint8_t> bytes;
  std::vector<const RansDecodeTable*> dp() const {
    std::vector<const RansDecodeTable*> out;
    for (size_t k = 0; k < cols; ++k) out.push_back(skip[k] ? nullptr : &dt[k]);
    return out;
  }
};

StreamCase make_stream_case(std::mt19937_64& rng, int trial) {
  StreamCase c;
  c.cols = trial % 4 == 0 ? 64 : 1 + rng() % 70;
  c.rows = trial % 7 == 0 ? rng() % 4 : 1 + rng() % 200;
  for (size_t k = 0; k < c.cols; ++k) {
    const uint32_t kind = uint32_t(rng() % 6);
    uint32_t alphabet = kind == 0 ? 1 : kind == 1 ? 65 : kind == 2 ? 2 + uint32_t(rng() % 4) : 1 + uint32_t(rng() % 65);
    // Now and then one column past the group decoder's limits (fallback).
    if (trial % 5 == 1 && k == c.cols / 2) alphabet = 66 + uint32_t(rng() % 100);
    uint32_t min_scale = 1;
    while ((1u << min_scale) < alphabet + 1) ++min_scale;
    uint32_t scale = std::min<uint32_t>(14, min_scale + uint32_t(rng() % 8));
    if (rng() % 8 == 0) scale = 14;
    // Every third trial within the packed-key limits (scale <= 12, alphabet <= 64).
    if (trial % 3 == 0) {
      alphabet = std::min<uint32_t>(alphabet, 64);
      scale = std::max<uint32_t>(std::min<uint32_t>(scale, 12), min_scale > 12 ? 12 : min_scale);
      if (trial % 6 == 0 && k == 0) scale = 12, alphabet = 64;  // the largest packed model
    }
    if (trial % 5 == 2 && k == 0) scale = 15 + uint32_t(rng() % 2);
    c.ft.push_back(random_freqs(rng, alphabet, scale, rng() % 4 == 0));
    c.skip.push_back(rng() % 8 == 0);
  }
  c.sym.resize(c.rows * c.cols);
  for (size_t r = 0; r < c.rows; ++r)
    for (size_t k = 0; k < c.cols; ++k) {
      // The most frequent symbol now and then (long renorm-free runs), else uniform.
      const FrequencyTable& t = c.ft[k];
      const uint32_t top = uint32_t(std::max_element(t.freq.begin(), t.freq.end()) - t.freq.begin());
      c.sym[r * c.cols + k] = c.skip[k] ? 0 : uint16_t(rng() % 3 == 0 ? top : rng() % t.alphabet_size);
    }
  for (const auto& t : c.ft) c.dt.emplace_back(t);
  std::vector<const FrequencyTable*> fp;
  for (size_t k = 0; k < c.cols; ++k) fp.push_back(c.skip[k] ? nullptr : &c.ft[k]);
  c.bytes = rans_encode(c.sym.data(), c.rows, c.cols, fp);
  return c;
}

// A damaged copy of a stream: d = 0 one byte short, 1 one byte long, 2 half,
// else d random bit flips.
std::vector<uint8_t> damaged(const std::vector<uint8_t>& bytes, int d, std::mt19937_64& rng) {
  std::vector<uint8_t> bad = bytes;
  if (bad.empty()) return bad;
  if (d == 0) bad.pop_back();
  else if (d == 1) bad.push_back(uint8_t(rng()));
  else if (d == 2) bad.resize(bad.size() / 2);
  else for (int f = 0; f < d; ++f) bad[rng() % bad.size()] ^= uint8_t(1u << (rng() % 8));
  return bad;
}

TEST(RansFast, SimdDecoderMatchesPortable) {
  std::mt19937_64 rng(77);
  for (int trial = 0; trial < 300; ++trial) {
    const StreamCase c = make_stream_case(rng, trial);
    const size_t rows = c.rows, cols = c.cols;
    const auto& sym = c.sym;
    const auto& bytes = c.bytes;
    const auto dp = c.dp();
    std::vector<uint16_t> a(rows * cols, 1), b(rows * cols, 2), g(rows * cols, 3);
    rans_decode(bytes.data(), bytes.size(), rows, cols, dp, a.data());
    rans_decode_portable(bytes.data(), bytes.size(), rows, cols, dp, b.data());
    // Prebuilt group tables (as HeadParams keeps them), and ones built for
    // another column count, which the decoder must ignore.
    const RansGroupTables pre = rans_group_tables(dp);
    rans_decode(bytes.data(), bytes.size(), rows, cols, dp, g.data(), pre);
    ASSERT_EQ(a, sym) << "trial " << trial;
    ASSERT_EQ(b, sym) << "trial " << trial;
    ASSERT_EQ(g, sym) << "trial " << trial;
    if (cols > 1) {
      std::vector<const RansDecodeTable*> fewer(dp.begin(), dp.end() - 1);
      fewer.push_back(nullptr);
      const RansGroupTables other = rans_group_tables(fewer);
      std::fill(g.begin(), g.end(), 3);
      if (other.n_active != pre.n_active) {
        rans_decode(bytes.data(), bytes.size(), rows, cols, dp, g.data(), other);
        ASSERT_EQ(g, sym) << "trial " << trial;
      }
    }
    // Damaged copies: both decoders agree (same symbols, or the same error).
    for (int d = 0; d < 6 && !bytes.empty(); ++d) {
      const std::vector<uint8_t> bad = damaged(bytes, d, rng);
      std::string ea = "ok", eb = "ok";
      std::fill(a.begin(), a.end(), 1);
      std::fill(b.begin(), b.end(), 2);
      try {
        rans_decode(bad.data(), bad.size(), rows, cols, dp, a.data());
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kFormat);
        ea = e.what();
      }
      try {
        rans_decode_portable(bad.data(), bad.size(), rows, cols, dp, b.data());
      } catch (const Error& e) {
        eb = e.what();
      }
      ASSERT_EQ(ea, eb) << "trial " << trial << " damage " << d;
      if (ea == "ok") {
        ASSERT_EQ(a, b) << "trial " << trial << " damage " << d;
      }
    }
  }
}

// Columns past the compare search's limits (alphabet > 65, as the dp
// allocator's 256-level components, or scale > 14) no longer send the whole
// stream to the scalar lanes: a group with a few of them searches its other
// lanes and looks those up apart (scalar_lanes); one with more than four
// takes the scalar lanes inside the vector loop (scalar). Both kinds, in
// packed streams (the two-stream loop) and unpacked ones (a scale-13
// column), give the portable decoder's symbols and errors.
TEST(RansFast, ScalarGroupsInsideTheVectorDecoder) {
  std::mt19937_64 rng(2026);
  size_t patched_groups = 0, scalar_groups = 0;
  for (int trial = 0; trial < 16; ++trial) {
    const size_t rows = 40 + size_t(trial), cols = trial % 3 == 0 ? 64 : 20 + size_t(trial);
    const bool many_big = trial % 4 == 3;  // columns 0..5 too big: a whole scalar group
    std::vector<FrequencyTable> ft;
    std::vector<bool> big(cols, false);
    for (size_t k = 0; k < cols; ++k) {
      if (k == 0 || (many_big && k < 6)) {
        ft.push_back(random_freqs(rng, 256, 12, trial % 2 == 0));  // too many symbols
        big[k] = true;
      } else if (k == 9) {
        ft.push_back(random_freqs(rng, 10, 15, false));  // scale too large
        big[k] = true;
      } else if (k == 7 && trial % 3 == 1) {
        ft.push_back(random_freqs(rng, 12, 13, false));  // searchable, but not as packed keys
      } else {
        ft.push_back(random_freqs(rng, 2 + uint32_t(rng() % 20), trial % 2 ? 12 : 10, false));
      }
    }
    std::vector<uint16_t> sym(rows * cols);
    for (size_t i = 0; i < sym.size(); ++i) sym[i] = uint16_t(rng() % ft[i % cols].alphabet_size);
    std::vector<const FrequencyTable*> fp;
    for (const auto& t : ft) fp.push_back(&t);
    const std::vector<uint8_t> bytes = rans_encode(sym.data(), rows, cols, fp);
    std::vector<RansDecodeTable> dt;
    for (const auto& t : ft) dt.emplace_back(t);
    std::vector<const RansDecodeTable*> dp;
    for (const auto& t : dt) dp.push_back(&t);
    const RansGroupTables pre = rans_group_tables(dp);
#ifdef KVCODEC_HAVE_AVX2_PATHS
    if (simd_avx2()) {
      EXPECT_TRUE(pre.usable) << trial;
      EXPECT_TRUE(pre.any_scalar) << trial;
      EXPECT_EQ(pre.packed, trial % 3 != 1) << trial;
      for (size_t i = 0; i < pre.groups.size(); ++i) {  // groups in visiting order: start i * 8 mod cols
        const size_t k0 = i * kRansLanes % cols;
        int n_big = 0;
        uint32_t lanes = 0;
        for (size_t j = 0; j < kRansLanes; ++j) {
          n_big += big[(k0 + j) % cols];
          lanes |= uint32_t(big[(k0 + j) % cols]) << j;
        }
        const auto& g = pre.groups[i];
        ASSERT_EQ(g.scalar, n_big > 4) << trial << " group " << i;
        ASSERT_EQ(g.scalar_lanes, g.scalar ? 0u : lanes) << trial << " group " << i;
        if (g.scalar_lanes) {
          EXPECT_FALSE(g.windowed) << trial << " group " << i;
        }
        scalar_groups += g.scalar;
        patched_groups += g.scalar_lanes != 0;
      }
    }
#endif
    for (int d = -1; d < 6; ++d) {
      const std::vector<uint8_t> in = d < 0 ? bytes : damaged(bytes, d, rng);
      std::vector<uint16_t> want(sym.size(), 1), a(sym.size(), 2), g(sym.size(), 3), pa(sym.size(), 4),
          pb(sym.size(), 5);
      std::string ew = "ok", ea = "ok", eg = "ok", ep = "ok";
      try { rans_decode_portable(in.data(), in.size(), rows, cols, dp, want.data()); } catch (const Error& e) { ew = e.what(); }
      try { rans_decode(in.data(), in.size(), rows, cols, dp, a.data()); } catch (const Error& e) { ea = e.what(); }
      try { rans_decode(in.data(), in.size(), rows, cols, dp, g.data(), pre); } catch (const Error& e) { eg = e.what(); }
      try {
        RansDecodeJob ja, jb;  // the damaged stream paired with the intact one
        ja.data = in.data(), ja.size = in.size(), ja.n_rows = rows, ja.n_cols = cols, ja.tables = &dp;
        ja.out = pa.data(), ja.groups = &pre;
        jb.data = bytes.data(), jb.size = bytes.size(), jb.n_rows = rows, jb.n_cols = cols, jb.tables = &dp;
        jb.out = pb.data(), jb.groups = &pre;
        rans_decode_pair(ja, jb);
      } catch (const Error& e) {
        ep = e.what();
      }
      ASSERT_EQ(ea, ew) << trial << " " << d;
      ASSERT_EQ(eg, ew) << trial << " " << d;
      ASSERT_EQ(ep, ew) << trial << " " << d;
      if (d < 0) {
        ASSERT_EQ(ew, "ok");
        ASSERT_EQ(want, sym) << trial;
      }
      if (ew == "ok") {
        ASSERT_EQ(a, want) << trial << " " << d;
        ASSERT_EQ(g, want) << trial << " " << d;
        ASSERT_EQ(pa, want) << trial << " " << d;
        ASSERT_EQ(pb, sym) << trial << " " << d;
      }
    }
  }
#ifdef KVCODEC_HAVE_AVX2_PATHS
  if (simd_avx2()) {
    EXPECT_GT(scalar_groups, 0u);
    EXPECT_GT(patched_groups, 10u);
  }
#endif
}

// The vector decoder's last groups run on a zero-padded copy of the final
// (< 16) stream bytes and keep a step only if it stayed within the real
// bytes. Every cut, extension and flip of a stream's last bytes: the vector
// decoder (alone and paired) gives the scalar lanes' symbols or their error.
TEST(RansFast, PaddedTailMatchesPortableAtTheEnd) {
  std::mt19937_64 rng(123);
  int exercised = 0;
  for (int trial = 0; trial < 24; ++trial) {
    // Packed and unpacked keys (trial % 3 == 0 is packed), 64 and odd column counts.
    const StreamCase c = make_stream_case(rng, trial % 2 == 0 ? 3 * trial : trial);
    if (c.bytes.size() < 40 || c.rows * c.cols < 64) continue;
    ++exercised;
    const auto dp = c.dp();
    const RansGroupTables pre = rans_group_tables(dp);
    std::vector<std::vector<uint8_t>> variants;
    for (size_t cut = 0; cut <= 20; ++cut) variants.emplace_back(c.bytes.begin(), c.bytes.end() - cut);
    for (size_t extra = 1; extra <= 3; ++extra) {
      variants.push_back(c.bytes);
      variants.back().resize(c.bytes.size() + extra, uint8_t(0x5a * extra));
    }
    for (size_t back = 1; back <= 20; ++back)
      for (uint8_t flip : {uint8_t(0x01), uint8_t(0x80), uint8_t(0xff)}) {
        variants.push_back(c.bytes);
        variants.back()[c.bytes.size() - back] ^= flip;
      }
    for (size_t v = 0; v < variants.size(); ++v) {
      const std::vector<uint8_t>& bytes = variants[v];
      const size_t n = c.rows * c.cols;
      std::vector<uint16_t> want(n, 7), got(n, 8), paired(n, 9), other(c.sym.size(), 0);
      std::string ew = "ok", eg = "ok", ep = "ok";
      try {
        rans_decode_portable(bytes.data(), bytes.size(), c.rows, c.cols, dp, want.data());
      } catch (const Error& e) {
        ew = e.what();
      }
      try {
        rans_decode(bytes.data(), bytes.size(), c.rows, c.cols, dp, got.data(), pre);
      } catch (const Error& e) {
        eg = e.what();
      }
      // Paired with an intact copy of itself (its tail is decoded the same way).
      try {
        RansDecodeJob ja, jb;
        ja.data = bytes.data(), ja.size = bytes.size(), ja.n_rows = c.rows, ja.n_cols = c.cols, ja.tables = &dp;
        ja.out = paired.data(), ja.groups = &pre;
        jb.data = c.bytes.data(), jb.size = c.bytes.size(), jb.n_rows = c.rows, jb.n_cols = c.cols, jb.tables = &dp;
        jb.out = other.data(), jb.groups = &pre;
        rans_decode_pair(ja, jb);
      } catch (const Error& e) {
        ep = e.what();
      }
      ASSERT_EQ(eg, ew) << "trial " << trial << " variant " << v;
      ASSERT_EQ(ep, ew) << "trial " << trial << " variant " << v;
      if (v == 0) {
        ASSERT_EQ(ew, "ok");
      }
      if (ew == "ok") {
        ASSERT_EQ(got, want) << "trial " << trial << " variant " << v;
        ASSERT_EQ(paired, want) << "trial " << trial << " variant " << v;
        ASSERT_EQ(other, c.sym) << "trial " << trial << " variant " << v;
      }
      if (v == 0) {
        ASSERT_EQ(want, c.sym);
      }
    }
  }
  EXPECT_GE(exercised, 10);
}

// rans_decode_pair (two streams stepped alternately, or in lockstep when
// both take packed keys) against two portable decodes: same symbols, and on
// damaged input the error of the first failing stream.
TEST(RansFast, PairMatchesTwoDecodes) {
  std::mt19937_64 rng(91);
  for (int trial = 0; trial < 200; ++trial) {
    // Both packed (lockstep), one packed, neither; equal and unequal sizes.
    const StreamCase a = make_stream_case(rng, trial % 2 == 0 ? 6 * (trial / 2) : trial);
    const StreamCase b = make_stream_case(rng, trial % 4 < 2 ? 6 * trial + 3 : trial + 1);
    const auto dpa = a.dp(), dpb = b.dp();
    for (int d = -1; d < 6; ++d) {
      // Damage in a, in b, or in both (then a's error must win).
      const std::vector<uint8_t> ba = d >= 0 && trial % 3 != 1 ? damaged(a.bytes, d, rng) : a.bytes;
      const std::vector<uint8_t> bb = d >= 0 && trial % 3 != 0 ? damaged(b.bytes, (d + 2) % 6, rng) : b.bytes;
      std::vector<uint16_t> ra(a.rows * a.cols, 1), rb(b.rows * b.cols, 1);
      std::vector<uint16_t> pa(ra.size(), 2), pb(rb.size(), 2);
      std::string want = "ok", got = "ok";
      try {
        rans_decode_portable(ba.data(), ba.size(), a.rows, a.cols, dpa, pa.data());
        rans_decode_portable(bb.data(), bb.size(), b.rows, b.cols, dpb, pb.data());
      } catch (const Error& e) {
        want = e.what();
      }
      try {
        RansDecodeJob ja, jb;
        ja.data = ba.data(), ja.size = ba.size(), ja.n_rows = a.rows, ja.n_cols = a.cols, ja.tables = &dpa;
        ja.out = ra.data();
        jb.data = bb.data(), jb.size = bb.size(), jb.n_rows = b.rows, jb.n_cols = b.cols, jb.tables = &dpb;
        jb.out = rb.data();
        // Every other trial with prebuilt group tables (as HeadParams keeps
        // them: the only ones with window searches).
        const RansGroupTables ga = rans_group_tables(dpa), gb = rans_group_tables(dpb);
        if (trial % 2) ja.groups = &ga, jb.groups = &gb;
        rans_decode_pair(ja, jb);
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kFormat);
        got = e.what();
      }
      ASSERT_EQ(got, want) << "trial " << trial << " damage " << d;
      if (want == "ok") {
        ASSERT_EQ(ra, pa) << "trial " << trial << " damage " << d;
        ASSERT_EQ(rb, pb) << "trial " << trial << " damage " << d;
        if (d < 0) {
          ASSERT_EQ(ra, a.sym);
          ASSERT_EQ(rb, b.sym);
        }
      }
    }
  }
}

// rans_decode_streams of 1 to 4 streams (four in lockstep where all are
// packed, pairs, streams stepping alone at groups with looked-up lanes or
// past the group decoder's limits) against portable decodes one by one:
// same symbols, and on damaged input the first failing stream's error.
// Most streams share one of a few packed column sets (a cache's keys and
// values of two heads), so the four-stream lockstep runs long.
TEST(RansFast, StreamsMatchDecodesOneByOne) {
  std::mt19937_64 rng(2026);
  size_t lockstep_trials = 0;
  for (int trial = 0; trial < 240; ++trial) {
    const size_t n = 1 + size_t(trial % 4);
    std::vector<StreamCase> cases;
    for (size_t j = 0; j < n; ++j) cases.push_back(make_stream_case(rng, trial % 3 == 0 ? 6 * (trial + int(j)) : trial + int(j)));
    bool all_packed = n == 4;
    std::vector<std::vector<const RansDecodeTable*>> dps;
    std::vector<RansGroupTables> pre;
    for (const StreamCase& c : cases) {
      dps.push_back(c.dp());
      pre.push_back(rans_group_tables(dps.back()));
      all_packed &= pre.back().usable && pre.back().packed;
    }
    lockstep_trials += all_packed;
    for (int d = -1; d < 6; ++d) {
      // Damage in one stream, or (d odd) in two: the earlier one's error wins.
      const size_t hit = size_t(rng() % n), hit2 = size_t(rng() % n);
      std::vector<std::vector<uint8_t>> bytes;
      for (size_t j = 0; j < n; ++j)
        bytes.push_back(d >= 0 && (j == hit || (d % 2 == 1 && j == hit2)) ? damaged(cases[j].bytes, d, rng)
                                                                           : cases[j].bytes);
      std::vector<std::vector<uint16_t>> got, want;
      std::string e_got = "ok", e_want = "ok";
      for (size_t j = 0; j < n; ++j) {
        got.emplace_back(cases[j].rows * cases[j].cols, 1);
        want.emplace_back(cases[j].rows * cases[j].cols, 2);
      }
      try {
        for (size_t j = 0; j < n; ++j)
          rans_decode_portable(bytes[j].data(), bytes[j].size(), cases[j].rows, cases[j].cols, dps[j], want[j].data());
      } catch (const Error& e) {
        e_want = e.what();
      }
      try {
        RansDecodeJob jobs[kRansMaxStreams];
        for (size_t j = 0; j < n; ++j) {
          jobs[j].data = bytes[j].data(), jobs[j].size = bytes[j].size();
          jobs[j].n_rows = cases[j].rows, jobs[j].n_cols = cases[j].cols, jobs[j].tables = &dps[j];
          jobs[j].out = got[j].data();
          if (trial % 2) jobs[j].groups = &pre[j];  // prebuilt tables (with windows) every other trial
        }
        rans_decode_streams(jobs, n);
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kFormat);
        e_got = e.what();
      }
      ASSERT_EQ(e_got, e_want) << "trial " << trial << " damage " << d;
      if (e_want == "ok")
        for (size_t j = 0; j < n; ++j) {
          ASSERT_EQ(got[j], want[j]) << "trial " << trial << " damage " << d << " stream " << j;
          if (d < 0) ASSERT_EQ(got[j], cases[j].sym) << "trial " << trial << " stream " << j;
        }
    }
  }
#ifdef KVCODEC_HAVE_AVX2_PATHS
  if (simd_avx2()) EXPECT_GE(lockstep_trials, 10u);  // four packed streams: the four-stream lockstep ran
#endif
  RansDecodeJob five[kRansMaxStreams + 1];
  try {
    rans_decode_streams(five, kRansMaxStreams + 1);
    FAIL() << "five streams were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("at most 4"), std::string::npos) << e.what();
  }
}

// The window search (RansGroupTables::Group::windowed): peaked tables of
// up to 64 symbols (as a KV head's leading components have) get windows;
// symbols inside every lane's window, and symbols far in the tails (every
// group escaping to the whole search), and a mix decode as the portable
// decoder does, alone and as a pair, and damaged streams give its errors.
TEST(RansFast, WindowSearchMatchesPortable) {
  std::mt19937_64 rng(123);
  size_t windowed = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const size_t cols = 8 + size_t(rng() % 60), rows = 1 + size_t(rng() % 90);
    std::vector<FrequencyTable> ft;
    for (size_t k = 0; k < cols; ++k) {
      // A discretised Laplacian of 7..64 symbols around the middle.
      const uint32_t alphabet = 7 + uint32_t(rng() % 58);
      const double width = 0.5 + double(rng() % 100) / 20.0;
      std::vector<uint64_t> counts(alphabet);
      for (uint32_t s = 0; s < alphabet; ++s)
        counts[s] = 1 + uint64_t(1e6 * std::exp(-std::fabs(double(s) - alphabet / 2.0) / width));
      ft.push_back(FrequencyTable::from_counts(counts, 12));
    }
    std::vector<RansDecodeTable> dt(ft.begin(), ft.end());
    std::vector<const RansDecodeTable*> dp;
    std::vector<const FrequencyTable*> fp;
    for (size_t k = 0; k < cols; ++k) dp.push_back(&dt[k]), fp.push_back(&ft[k]);
    const RansGroupTables pre = rans_group_tables(dp);
    for (const auto& g : pre.groups) windowed += g.windowed;
    for (int mode = 0; mode < 3; ++mode) {
      // 0: the middle symbol (inside every window); 1: the ends (outside);
      // 2: drawn from the tables' own distributions.
      std::vector<uint16_t> sym(rows * cols);
      for (size_t i = 0; i < sym.size(); ++i) {
        const FrequencyTable& t = ft[i % cols];
        if (mode == 0) sym[i] = uint16_t(t.alphabet_size / 2);
        if (mode == 1) sym[i] = uint16_t(rng() % 2 ? 0 : t.alphabet_size - 1);
        if (mode == 2) {
          const uint32_t slot = uint32_t(rng() % t.total());
          sym[i] = uint16_t(std::upper_bound(t.cum.begin(), t.cum.end(), slot) - t.cum.begin() - 1);
        }
      }
      const std::vector<uint8_t> bytes = rans_encode(sym.data(), rows, cols, fp);
      for (int d = -1; d < 4; ++d) {
        const std::vector<uint8_t> bad = d < 0 ? bytes : damaged(bytes, d, rng);
        std::vector<uint16_t> got(sym.size(), 1), want(sym.size(), 2), pair_a(sym.size(), 3), pair_b(sym.size(), 4);
        std::string eg = "ok", ew = "ok", ep = "ok";
        try {
          rans_decode(bad.data(), bad.size(), rows, cols, dp, got.data(), pre);
        } catch (const Error& e) {
          eg = e.what();
        }
        try {
          rans_decode_portable(bad.data(), bad.size(), rows, cols, dp, want.data());
        } catch (const Error& e) {
          ew = e.what();
        }
        try {
          RansDecodeJob ja, jb;
          ja.data = bytes.data(), ja.size = bytes.size(), ja.n_rows = rows, ja.n_cols = cols, ja.tables = &dp;
          ja.out = pair_a.data(), ja.groups = &pre;
          jb = ja;
          jb.data = bad.data(), jb.size = bad.size(), jb.out = pair_b.data();
          rans_decode_pair(ja, jb);
        } catch (const Error& e) {
          ep = e.what();
        }
        ASSERT_EQ(eg, ew) << "trial " << trial << " mode " << mode << " damage " << d;
        ASSERT_EQ(ep, ew) << "trial " << trial << " mode " << mode << " damage " << d;
        if (ew == "ok") {
          ASSERT_EQ(got, want) << "trial " << trial << " mode " << mode << " damage " << d;
          ASSERT_EQ(pair_a, sym) << "trial " << trial << " mode " << mode;
          ASSERT_EQ(pair_b, want) << "trial " << trial << " mode " << mode << " damage " << d;
          if (d < 0) {
            ASSERT_EQ(got, sym) << "trial " << trial << " mode " << mode;
          }
        }
      }
    }
  }
#ifdef KVCODEC_HAVE_AVX2_PATHS
  if (simd_avx2()) {
    EXPECT_GT(windowed, 100u);  // the window search ran (builds with the AVX2 paths build group tables)
  }
#endif
}

// The branch-free window search (window_mass over cumulative frequencies)
// chooses the window lengths and starts the plain loops choose: every field
// of every group and every row equal, for peaked tables of 2..64 symbols
// (windows of many lengths), flat ones (none), and mixes with alphabets the
// group decoder cannot search (scalar groups).
TEST(RansFast, WindowChoiceMatchesReference) {
  std::mt19937_64 rng(321);
  size_t windowed = 0, lengths = 0;
  std::vector<bool> seen_length(70, false);
  for (int trial = 0; trial < 300; ++trial) {
    const size_t cols = 1 + size_t(rng() % 80);
    std::vector<FrequencyTable> ft;
    for (size_t k = 0; k < cols; ++k) {
      const uint32_t alphabet = trial % 7 == 6 && rng() % 8 == 0 ? 66 + uint32_t(rng() % 200) : 2 + uint32_t(rng() % 63);
      const double width = 0.2 + double(rng() % 200) / 20.0;
      const double centre = double(rng() % alphabet);
      std::vector<uint64_t> counts(alphabet);
      for (uint32_t s = 0; s < alphabet; ++s)
        counts[s] = trial % 5 == 4 ? 1 + rng() % 1000
                                   : 1 + uint64_t(1e6 * std::exp(-std::fabs(double(s) - centre) / width));
      ft.push_back(FrequencyTable::from_counts(counts, trial % 3 == 2 ? 0 : 12));
    }
    std::vector<RansDecodeTable> dt(ft.begin(), ft.end());
    std::vector<const RansDecodeTable*> dp;
    for (const auto& t : dt) dp.push_back(&t);
    const RansGroupTables fast = rans_group_tables(dp), ref = rans_group_tables_reference(dp);
    ASSERT_EQ(fast.usable, ref.usable) << "trial " << trial;
    ASSERT_EQ(fast.packed, ref.packed) << "trial " << trial;
    ASSERT_EQ(fast.any_scalar, ref.any_scalar) << "trial " << trial;
    ASSERT_EQ(fast.group_at, ref.group_at) << "trial " << trial;
    ASSERT_EQ(fast.rows, ref.rows) << "trial " << trial;
    ASSERT_EQ(fast.groups.size(), ref.groups.size()) << "trial " << trial;
    for (size_t i = 0; i < ref.groups.size(); ++i) {
      const auto &a = fast.groups[i], &b = ref.groups[i];
      ASSERT_EQ(a.windowed, b.windowed) << "trial " << trial << " group " << i;
      ASSERT_EQ(a.wrows, b.wrows) << "trial " << trial << " group " << i;
      ASSERT_EQ(a.wfirst, b.wfirst) << "trial " << trial << " group " << i;
      ASSERT_EQ(a.first, b.first) << "trial " << trial << " group " << i;
      ASSERT_EQ(a.rows, b.rows) << "trial " << trial << " group " << i;
      ASSERT_EQ(a.scalar, b.scalar) << "trial " << trial << " group " << i;
      ASSERT_EQ(a.scalar_lanes, b.scalar_lanes) << "trial " << trial << " group " << i;
      for (size_t j = 0; j < kRansLanes; ++j) {
        ASSERT_EQ(a.wfloor[j], b.wfloor[j]) << "trial " << trial << " group " << i << " lane " << j;
        ASSERT_EQ(a.wceil[j], b.wceil[j]) << "trial " << trial << " group " << i << " lane " << j;
        ASSERT_EQ(a.scale[j], b.scale[j]);
        ASSERT_EQ(a.mask[j], b.mask[j]);
        ASSERT_EQ(a.key0[j], b.key0[j]);
      }
      windowed += b.windowed;
      if (b.windowed && !seen_length[b.wrows]) seen_length[b.wrows] = true, ++lengths;
    }
  }
#ifdef KVCODEC_HAVE_AVX2_PATHS
  EXPECT_GT(windowed, 300u);  // the window search ran (builds with the AVX2 paths build group tables)
  EXPECT_GT(lengths, 10u);    // over many window lengths
#endif
}

// The vectorised validation (16 columns at a time) finds an out-of-range
// symbol wherever it sits, before any byte is written, and accepts the
// largest symbol of the largest alphabet.
TEST(RansFast, ValidationFindsEveryBadSymbol) {
  std::mt19937_64 rng(5);
  const size_t rows = 9, cols = 37;
  std::vector<FrequencyTable> ft;
  for (size_t k = 0; k < cols; ++k)
    ft.push_back(k == 3 ? FrequencyTable::from_freqs(std::vector<uint32_t>(65536, 1), 16)
                        : random_freqs(rng, 2 + uint32_t(rng() % 30), 12, false));
  std::vector<RansEncodeTable> et;
  for (const auto& t : ft) et.emplace_back(t);
  std::vector<const RansEncodeTable*> ep;
  for (const auto& t : et) ep.push_back(&t);
  std::vector<uint16_t> sym(rows * cols);
  for (size_t i = 0; i < sym.size(); ++i) sym[i] = uint16_t(rng() % ft[i % cols].alphabet_size);
  sym[3] = 65535;  // the largest symbol of a 65536-symbol alphabet is valid
  EXPECT_FALSE(rans_encode(sym.data(), rows, cols, ep).empty());
  for (size_t pos = 0; pos < sym.size(); pos += 7) {
    if (pos % cols == 3) continue;
    std::vector<uint16_t> bad = sym;
    bad[pos] = uint16_t(ft[pos % cols].alphabet_size + rng() % 5);
    for (bool portable : {false, true}) {
      try {
        portable ? rans_encode_portable(bad.data(), rows, cols, ep) : rans_encode(bad.data(), rows, cols, ep);
        ADD_FAILURE() << "no error for position " << pos;
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
        EXPECT_NE(std::string(e.what()).find("column " + std::to_string(pos % cols)), std::string::npos) << e.what();
      }
    }
  }
}

TEST(RansFast, EdgeCases) {
  const FrequencyTable t = FrequencyTable::from_counts({5, 1, 0, 9}, 12);
  const RansEncodeTable e(t);
  std::vector<const RansEncodeTable*> one{&e}, none{nullptr};
  EXPECT_TRUE(rans_encode(nullptr, 0, 1, one).empty());
  const uint16_t sym[3] = {3, 0, 2};
  EXPECT_TRUE(rans_encode(sym, 3, 1, none).empty());
  // A symbol outside its alphabet, and mismatched table counts.
  const uint16_t bad[2] = {1, 4};
  try {
    rans_encode(bad, 2, 1, one);
    ADD_FAILURE();
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ErrorCode::kInvalidArgument);
  }
  EXPECT_THROW(rans_encode(sym, 1, 2, one), Error);
  // Invalid models are refused when the constants are built.
  FrequencyTable broken = t;
  broken.freq[0] += 1;
  EXPECT_THROW(RansEncodeTable{broken}, Error);
  // Every symbol of a max-frequency / min-frequency table round-trips.
  std::vector<uint16_t> all;
  for (int r = 0; r < 100; ++r) all.push_back(uint16_t(r % 4));
  const auto bytes = rans_encode(all.data(), all.size(), 1, one);
  const std::vector<const FrequencyTable*> fp{&t};
  EXPECT_EQ(bytes, rans_encode(all.data(), all.size(), 1, fp));
}

// The AVX2 coders, chosen at run time (core/cpu_features.hpp), against the
// plain paths of the same calls (what runs under KVCODEC_SIMD=off or on a
// CPU without AVX2): the same bytes from every encoder entry point (and
// the same error for a bad symbol), the same symbols or the same error from
// every decoder entry point, on the stream cases above and damaged copies.
TEST(RansFast, AvxAndPlainPathsGiveTheSameBytesAndSymbols) {
  if (!cpu_has_avx2_paths()) GTEST_SKIP() << "this CPU runs the plain paths only";
  std::mt19937_64 rng(91);
  const auto outcome = [](const auto& call) {
    try {
      return call();
    } catch (const Error& e) {
      return std::string("error: ") + e.what();
    }
  };
  const auto as_text = [](const std::vector<uint16_t>& v) { return std::string(v.begin(), v.end()); };
  for (int trial = 0; trial < 200; ++trial) {
    const StreamCase c = make_stream_case(rng, trial);
    std::vector<RansEncodeTable> et;
    for (const auto& t : c.ft) et.emplace_back(t);
    std::vector<const RansEncodeTable*> ep;
    for (size_t k = 0; k < c.cols; ++k) ep.push_back(c.skip[k] ? nullptr : &et[k]);
    const auto dp = c.dp();
    const RansGroupTables pre = rans_group_tables(dp);
    std::vector<uint16_t> bad_sym = c.sym;
    for (size_t k = 0; k < c.cols && c.rows > 0; ++k)
      if (!c.skip[k]) {
        bad_sym[(c.rows - 1) * c.cols + k] = uint16_t(c.ft[k].alphabet_size);
        break;
      }
    const std::vector<uint8_t> damaged_bytes = damaged(c.bytes, trial % 6, rng);
    const auto run = [&](bool on) {
      ScopedSimd mode(on);
      EXPECT_EQ(simd_avx2(), on);
      std::vector<std::string> out;
      const auto bytes = [](const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); };
      out.push_back(outcome([&] { return bytes(rans_encode(c.sym.data(), c.rows, c.cols, ep)); }));
      out.push_back(outcome([&] { return bytes(rans_encode_vector_pointers(c.sym.data(), c.rows, c.cols, ep)); }));
      out.push_back(outcome([&] { return bytes(rans_encode_other_chain(c.sym.data(), c.rows, c.cols, ep)); }));
      out.push_back(outcome([&] { return bytes(rans_encode(bad_sym.data(), c.rows, c.cols, ep)); }));
      for (const std::vector<uint8_t>* b : {&c.bytes, &damaged_bytes}) {
        std::vector<uint16_t> s1(c.rows * c.cols, 7), s2 = s1;
        out.push_back(outcome([&] {
          rans_decode(b->data(), b->size(), c.rows, c.cols, dp, s1.data());
          return as_text(s1);
        }));
        out.push_back(outcome([&] {
          rans_decode(b->data(), b->size(), c.rows, c.cols, dp, s1.data(), pre);
          return as_text(s1);
        }));
        out.push_back(outcome([&] {
          const RansDecodeJob a{b->data(), b->size(), c.rows, c.cols, &dp, s1.data(), &pre};
          const RansDecodeJob d{c.bytes.data(), c.bytes.size(), c.rows, c.cols, &dp, s2.data(), nullptr};
          rans_decode_pair(a, d);
          return as_text(s1) + as_text(s2);
        }));
      }
      return out;
    };
    const auto avx2 = run(true), plain = run(false);
    ASSERT_EQ(avx2.size(), plain.size());
    for (size_t i = 0; i < avx2.size(); ++i) ASSERT_EQ(avx2[i], plain[i]) << "trial " << trial << " call " << i;
  }
}

}  // namespace
}  // namespace kvcodec::entropy

// rANS, Huffman and fixed-width coders: rate, exact round trips, lane
// equivalence, robustness against truncated and corrupted streams.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>

#include "entropy/entropy.hpp"
#include "entropy_test_util.hpp"

namespace kvcodec::entropy {
namespace {

using testing::entropy_bits;
using testing::gaussian_probs;
using testing::histogram;
using testing::Sampler;

// One multi-column problem with models for all three coders.
struct Problem {
  size_t rows = 0, cols = 0;
  std::vector<uint16_t> symbols;            // [rows, cols] token-major
  std::vector<uint32_t> alphabets;          // per column; 0 = skipped
  std::vector<std::unique_ptr<FrequencyTable>> ft;
  std::vector<std::unique_ptr<RansDecodeTable>> dt;
  std::vector<std::unique_ptr<HuffmanTable>> ht;
  std::vector<uint8_t> widths;

  // Models are fitted on model_counts (per column) when given, else on the symbols.
  void fit(const std::vector<std::vector<uint64_t>>* model_counts = nullptr) {
    ft.clear(), dt.clear(), ht.clear(), widths.assign(cols, 0);
    for (size_t c = 0; c < cols; ++c) {
      if (!alphabets[c]) {
        ft.emplace_back(), dt.emplace_back(), ht.emplace_back();
        continue;
      }
      auto counts = model_counts ? (*model_counts)[c] : histogram(symbols, alphabets[c], cols, c);
      ft.push_back(std::make_unique<FrequencyTable>(FrequencyTable::from_counts(counts)));
      dt.push_back(std::make_unique<RansDecodeTable>(*ft.back()));
      ht.push_back(std::make_unique<HuffmanTable>(huffman_build(counts)));
      unsigned w = 0;
      while ((1u << w) < alphabets[c]) ++w;
      widths[c] = uint8_t(std::max(1u, w));
    }
  }
  template <typename T>
  std::vector<const T*> ptrs(const std::vector<std::unique_ptr<T>>& v) const {
    std::vector<const T*> out;
    for (auto& p : v) out.push_back(p.get());
    return out;
  }
  std::vector<const FrequencyTable*> rans_enc() const { return ptrs(ft); }
  std::vector<const RansDecodeTable*> rans_dec() const { return ptrs(dt); }
  std::vector<const HuffmanTable*> huff() const { return ptrs(ht); }
  // What a decoder must return: skipped columns read as 0.
  std::vector<uint16_t> expected() const {
    auto e = symbols;
    for (size_t r = 0; r < rows; ++r)
      for (size_t c = 0; c < cols; ++c)
        if (!alphabets[c]) e[r * cols + c] = 0;
    return e;
  }
};

Problem random_problem(uint64_t seed, size_t rows, std::vector<uint32_t> alphabets, double sigma_frac = 0.15) {
  std::mt19937_64 rng(seed);
  Problem p;
  p.rows = rows;
  p.cols = alphabets.size();
  p.alphabets = alphabets;
  p.symbols.assign(rows * p.cols, 0);
  std::vector<Sampler> samplers;
  for (auto a : alphabets) samplers.emplace_back(gaussian_probs(std::max(1u, a), std::max(0.5, a * sigma_frac)));
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < p.cols; ++c)
      p.symbols[r * p.cols + c] = alphabets[c] ? samplers[c](rng) : uint16_t(rng() % 7);  // junk in skipped columns
  p.fit();
  return p;
}

enum class Which { kRans, kRansRef, kHuffman, kFixed };

std::vector<uint8_t> encode(const Problem& p, Which w) {
  switch (w) {
    case Which::kRans: return rans_encode(p.symbols.data(), p.rows, p.cols, p.rans_enc());
    case Which::kRansRef: return rans_encode_reference(p.symbols.data(), p.rows, p.cols, p.rans_enc());
    case Which::kHuffman: return huffman_encode(p.symbols.data(), p.rows, p.cols, p.huff());
    case Which::kFixed: return pack_fixed(p.symbols.data(), p.rows, p.cols, p.widths);
  }
  return {};
}

std::vector<uint16_t> decode(const Problem& p, Which w, const uint8_t* data, size_t size) {
  std::vector<uint16_t> out(p.rows * p.cols, 0xbeef);
  switch (w) {
    case Which::kRans: rans_decode(data, size, p.rows, p.cols, p.rans_dec(), out.data()); break;
    case Which::kRansRef: rans_decode_reference(data, size, p.rows, p.cols, p.rans_enc(), out.data()); break;
    case Which::kHuffman: huffman_decode(data, size, p.rows, p.cols, p.huff(), out.data()); break;
    case Which::kFixed: unpack_fixed(data, size, p.rows, p.cols, p.widths, out.data()); break;
  }
  return out;
}

const Which kAll[] = {Which::kRans, Which::kRansRef, Which::kHuffman, Which::kFixed};
const char* name(Which w) {
  return w == Which::kRans ? "rans" : w == Which::kRansRef ? "rans-ref" : w == Which::kHuffman ? "huffman" : "fixed";
}

void expect_round_trip(const Problem& p, const char* what) {
  for (Which w : kAll) {
    const auto bytes = encode(p, w);
    const auto out = decode(p, w, bytes.data(), bytes.size());
    ASSERT_EQ(out, p.expected()) << what << " / " << name(w);
  }
}

// --- rate ------------------------------------------------------------------------

TEST(Rans, MillionSkewedSymbolsWithinOnePercentOfEntropy) {
  // Geometric-like, strongly skewed 16-symbol source (H ~ 2.1 bits).
  std::vector<double> probs(16);
  for (size_t s = 0; s < 16; ++s) probs[s] = std::pow(0.55, double(s)) + 1e-4;
  const double H = entropy_bits(probs);
  Sampler sample(probs);
  std::mt19937_64 rng(2024);
  const size_t n = 1000000;
  Problem p;
  p.rows = n, p.cols = 1, p.alphabets = {16};
  p.symbols.resize(n);
  for (auto& s : p.symbols) s = sample(rng);
  p.fit();
  const auto bytes = encode(p, Which::kRans);
  const double bits = 8.0 * double(bytes.size());
  const double bound = double(n) * H;
  std::printf("[ rate  ] rANS, 1e6 symbols, 16-symbol skewed source: H = %.5f bits, n*H = %.0f bits, payload = %.0f bits "
              "(%.4f bits/sym, +%.3f%%), scale_bits %u\n",
              H, bound, bits, bits / n, 100 * (bits / bound - 1), p.ft[0]->scale_bits);
  EXPECT_LT(bits, bound * 1.01);
  EXPECT_GT(bits, bound * 0.99);  // a sanity floor: we cannot beat the source much
  EXPECT_EQ(decode(p, Which::kRans, bytes.data(), bytes.size()), p.symbols);
  // Huffman on the same data, for the record (bounded by H + 1 bit/symbol).
  const auto hb = encode(p, Which::kHuffman);
  std::printf("[ rate  ] Huffman on the same: %.4f bits/sym\n", 8.0 * hb.size() / n);
  EXPECT_LT(8.0 * hb.size(), bound + n);
}

// --- round trips -------------------------------------------------------------------

TEST(RoundTrip, EmptyInput) {
  auto p = random_problem(1, 0, {16, 0, 4});
  for (Which w : kAll) EXPECT_TRUE(encode(p, w).empty()) << name(w);
  expect_round_trip(p, "0 rows");
  auto q = random_problem(1, 10, {0, 0});  // every column skipped
  expect_round_trip(q, "all skipped");
  std::vector<uint16_t> out(2);
  EXPECT_THROW(rans_decode(nullptr, 0, 1, 2, {nullptr}, out.data()), Error) << "wrong table count";
  const uint8_t junk[1] = {0};
  EXPECT_THROW(rans_decode(junk, 1, 0, 1, q.rans_dec(), out.data()), Error) << "bytes where nothing is coded";
}

TEST(RoundTrip, OneSymbol) {
  auto p = random_problem(2, 1, {32});
  expect_round_trip(p, "one symbol");
  EXPECT_EQ(encode(p, Which::kRans).size(), 4u + 0u) << "one lane used: 4 state bytes, no renorm bytes";
}

TEST(RoundTrip, SingleSymbolAlphabetCostsNothing) {
  auto p = random_problem(3, 100, {1, 1});
  expect_round_trip(p, "alphabet 1");
  EXPECT_TRUE(encode(p, Which::kHuffman).empty());
  for (auto b : {Which::kRans}) EXPECT_EQ(encode(p, b).size(), 4 * kRansLanes) << "only the flushed states";
}

TEST(RoundTrip, WorstCaseRareSymbolsOnly) {
  // Models fitted on a skewed distribution; the data uses only its rarest symbols.
  auto p = random_problem(4, 3000, {64, 256, 16});
  std::vector<std::vector<uint64_t>> counts;
  for (size_t c = 0; c < p.cols; ++c) counts.push_back(histogram(p.symbols, p.alphabets[c], p.cols, c));
  for (size_t r = 0; r < p.rows; ++r)
    for (size_t c = 0; c < p.cols; ++c) p.symbols[r * p.cols + c] = uint16_t(r % 2 ? 0 : p.alphabets[c] - 1);
  p.fit(&counts);
  expect_round_trip(p, "rare symbols only");
  const auto bytes = encode(p, Which::kRans);
  EXPECT_GT(bytes.size(), p.rows * p.cols) << "rare symbols must cost many bits each";
}

TEST(RoundTrip, Alphabet4096) {
  auto p = random_problem(5, 2000, {4096, 4096}, 0.1);
  expect_round_trip(p, "alphabet 4096");
  // Extremes included.
  p.symbols[0] = 0, p.symbols[1] = 4095;
  expect_round_trip(p, "alphabet 4096 extremes");
}

TEST(RoundTrip, ManyColumnsDifferentTablesAndSkips) {
  std::vector<uint32_t> alphabets;
  std::mt19937_64 rng(6);
  for (int c = 0; c < 67; ++c) alphabets.push_back(c % 5 == 3 ? 0 : uint32_t(1u << (rng() % 9)));
  for (size_t rows : {1, 2, 3, 7, 8, 9, 64, 257}) {
    auto p = random_problem(100 + rows, rows, alphabets);
    expect_round_trip(p, "many columns");
  }
}

TEST(Rans, InterleavedMatchesReference) {
  std::mt19937_64 rng(8);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<uint32_t> alphabets(1 + rng() % 12);
    for (auto& a : alphabets) a = rng() % 4 == 0 ? 0 : uint32_t(1 + rng() % 300);
    auto p = random_problem(200 + trial, rng() % 300, alphabets, 0.05 + 0.3 * double(rng() % 100) / 100);
    const auto fast = encode(p, Which::kRans);
    const auto ref = encode(p, Which::kRansRef);
    const auto a = decode(p, Which::kRans, fast.data(), fast.size());
    const auto b = decode(p, Which::kRansRef, ref.data(), ref.size());
    ASSERT_EQ(a, b) << trial;
    ASSERT_EQ(a, p.expected()) << trial;
    // Same model, same symbols: the payloads differ only by the extra lanes'
    // flushed states (4 bytes each) and each lane's final partial byte.
    size_t coded = 0;
    for (auto al : alphabets) coded += al ? p.rows : 0;
    const size_t lanes = std::min(kRansLanes, coded);
    const long diff = long(fast.size()) - long(ref.size());
    const long extra = lanes ? 4 * long(lanes - 1) : 0;
    ASSERT_LE(std::labs(diff - extra), long(lanes) + 1) << trial << " fast " << fast.size() << " ref " << ref.size();
  }
}

TEST(Encode, SymbolOutsideAlphabetIsInvalidArgument) {
  auto p = random_problem(9, 10, {16, 16});
  p.symbols[5] = 16;
  for (Which w : kAll) {
    try {
      encode(p, w);
      ADD_FAILURE() << name(w);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << name(w);
    }
  }
}

// --- robustness -----------------------------------------------------------------------

// Every truncation and many random corruptions must give kFormat or an
// in-bounds output (checked by ASan in CI; here also: values in alphabet).
void hammer(const Problem& p, Which w, int flips) {
  const auto bytes = encode(p, w);
  auto check_output = [&](const std::vector<uint16_t>& out) {
    for (size_t r = 0; r < p.rows; ++r)
      for (size_t c = 0; c < p.cols; ++c) {
        const uint16_t v = out[r * p.cols + c];
        if (!p.alphabets[c]) {
          ASSERT_EQ(v, 0);
        } else if (w != Which::kFixed) {
          ASSERT_LT(v, p.alphabets[c]);
        }
      }
  };
  int errors = 0;
  for (size_t len = 0; len < bytes.size(); ++len) {
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + long(len));  // exact-size heap copy for ASan
    try {
      check_output(decode(p, w, cut.data(), cut.size()));
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), ErrorCode::kFormat) << name(w) << " len " << len;
      ++errors;
    }
  }
  // A truncated stream must not decode silently (except possibly the cut of
  // a final byte that carries only padding, for bit-packed coders).
  EXPECT_GE(errors, int(bytes.size()) - 1) << name(w);
  std::mt19937_64 rng(77);
  int detected = 0;
  for (int t = 0; t < flips && !bytes.empty(); ++t) {
    auto bad = bytes;
    bad[rng() % bad.size()] ^= uint8_t(1 + rng() % 255);
    try {
      check_output(decode(p, w, bad.data(), bad.size()));
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), ErrorCode::kFormat);
      ++detected;
    }
  }
  std::printf("[ robust] %-8s %zu-byte stream: %d/%zu truncations rejected, %d/%d corruptions detected\n", name(w),
              bytes.size(), errors, bytes.size(), detected, flips);
  // Appending a byte is always detected.
  auto longer = bytes;
  longer.push_back(0);
  EXPECT_THROW(decode(p, w, longer.data(), longer.size()), Error) << name(w);
}

TEST(Robustness, TruncationsAndFlipsNeverCrash) {
  auto p = random_problem(10, 150, {16, 0, 256, 3, 1, 64});
  for (Which w : kAll) hammer(p, w, 1500);
  auto big = random_problem(11, 40, {4096, 2});
  for (Which w : kAll) hammer(big, w, 300);
}

TEST(Robustness, RandomBytesNeverCrash) {
  auto p = random_problem(12, 64, {16, 256, 0, 2});
  std::mt19937_64 rng(13);
  for (int t = 0; t < 3000; ++t) {
    std::vector<uint8_t> junk(rng() % 400);
    for (auto& b : junk) b = uint8_t(rng());
    for (Which w : kAll) {
      try {
        decode(p, w, junk.data(), junk.size());
      } catch (const Error& e) {
        ASSERT_EQ(e.code(), ErrorCode::kFormat);
      }
    }
  }
}

// --- fixed + choice -------------------------------------------------------------------

TEST(Fixed, SizesAndValidation) {
  auto p = random_problem(14, 33, {16, 0, 5, 1});
  EXPECT_EQ(fixed_bits(33, p.widths), 33u * (4 + 0 + 3 + 1));
  EXPECT_EQ(encode(p, Which::kFixed).size(), (fixed_bits(33, p.widths) + 7) / 8);
  std::vector<uint8_t> bad_w = p.widths;
  bad_w[0] = 17;
  EXPECT_THROW(pack_fixed(p.symbols.data(), p.rows, p.cols, bad_w), Error);
  bad_w[0] = 2;  // symbols up to 15 do not fit in 2 bits
  EXPECT_THROW(pack_fixed(p.symbols.data(), p.rows, p.cols, bad_w), Error);
}

TEST(Choice, PicksStrictlySmallestWithTiesToSimpler) {
  // Uniform 16 symbols: fixed 4 bits/sym; Huffman also 4 bits but pays a
  // table; rANS pays table + flush: fixed must win.
  auto u = random_problem(15, 512, {16, 16}, 100.0);
  std::vector<std::vector<uint64_t>> counts;
  for (size_t c = 0; c < 2; ++c) counts.push_back(histogram(u.symbols, 16, 2, c));
  auto ch = choose_coder(counts, u.rans_enc(), u.huff(), u.widths);
  EXPECT_EQ(ch.best, Coder::kFixed);
  EXPECT_EQ(ch.fixed.total_bits(), 512u * 2 * 4);
  // Skewed data: rANS wins, and the estimate is close to the measured size.
  auto s = random_problem(16, 4096, {64, 64, 0, 64}, 0.02);
  counts.clear();
  for (size_t c = 0; c < 4; ++c)
    counts.push_back(s.alphabets[c] ? histogram(s.symbols, s.alphabets[c], 4, c) : std::vector<uint64_t>{});
  ch = choose_coder(counts, s.rans_enc(), s.huff(), s.widths);
  const auto exact = choose_coder_exact(s.symbols.data(), s.rows, s.cols, s.rans_enc(), s.huff(), s.widths);
  EXPECT_EQ(ch.best, Coder::kRans);
  EXPECT_EQ(exact.best, Coder::kRans);
  EXPECT_EQ(ch.huffman.total_bits(), exact.huffman.total_bits());
  EXPECT_EQ(ch.fixed.total_bits(), exact.fixed.total_bits());
  EXPECT_NEAR(double(ch.rans.payload_bits), double(exact.rans.payload_bits), 8.0 * (kRansLanes + 2));
  std::printf("[ choice] skewed 3x64 cols x 4096 rows: fixed %lu, huffman %lu, rans %lu (exact %lu) bits\n",
              (unsigned long)ch.fixed.total_bits(), (unsigned long)ch.huffman.total_bits(),
              (unsigned long)ch.rans.total_bits(), (unsigned long)exact.rans.total_bits());
  // Exact tie between fixed and Huffman goes to fixed: 2 equiprobable symbols.
  auto t = random_problem(17, 64, {2}, 100.0);
  counts = {histogram(t.symbols, 2)};
  HuffmanTable h = huffman_build(counts[0]);  // lengths {1,1}: payload equals fixed
  CoderChoice tie = choose_coder(counts, {}, {&h}, t.widths);
  ASSERT_EQ(tie.huffman.payload_bits, tie.fixed.payload_bits);
  EXPECT_EQ(tie.best, Coder::kFixed);
  EXPECT_EQ(parse_coder("huffman"), Coder::kHuffman);
  EXPECT_THROW(parse_coder("zip"), Error);
}

}  // namespace
}  // namespace kvcodec::entropy

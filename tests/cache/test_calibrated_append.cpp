// Calibrated KVTC appends (DESIGN 3: a token is coded once): the golden
// files of every saved layout, and the entropy work per appended token.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "cache/append_coder.hpp"
#include "cache/calibrated_fixture.hpp"
#include "entropy/entropy.hpp"
#include "kvtc/block_codes.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec {
namespace {

using namespace calibrated_fixture;

// rANS parameters of the fixture's layer-1 keys (V = 32 dims) and the
// codes of n of its tokens [n, K].
struct Coded {
  kvtc::HeadParams params;
  std::vector<uint16_t> codes;
  int64_t n = 0;
  size_t kept() const { return size_t(params.n_kept()); }
};
Coded coded_tokens(int64_t n, uint32_t seed) {
  const int V = kHeads * kDim;
  const auto fit = synthetic_vectors(1024, 5, 1, true);
  const auto pca = linalg::fit_pca(fit.data(), 1024, V);
  kvtc::CodecOptions o;
  o.bit_budget = 3 * V;
  Coded c;
  c.params = kvtc::fit_head(fit.data(), 1024, V, pca.mean, pca.components, pca.eigenvalues, o);
  c.n = n;
  c.codes.resize(size_t(n) * c.kept());
  const auto x = synthetic_vectors(n, seed, 1, true);
  kvtc::quantize_block(c.params, x.data(), n, c.codes.data());
  return c;
}

// Appending tokens in pieces gives the bytes of one append of them all, the
// decoder gives the codes back, and the rate is that of the codec's forward
// rANS payload (the plain reference: same models) to the flush bytes.
TEST(StackedCodes, PiecesEqualOneRunAndMatchTheForwardCoderRate) {
  const Coded c = coded_tokens(200, 31);
  ASSERT_EQ(c.params.coder, kvtc::CoderChoice::kRans);
  ASSERT_GT(c.kept(), 8u);
  for (const int64_t n : {int64_t(0), int64_t(1), int64_t(3), int64_t(64), int64_t(200)}) {
    std::vector<uint8_t> whole;
    cache_impl::append_stacked_codes(c.params, whole, 0, c.codes.data(), n);
    std::mt19937 rng{uint32_t(n)};
    std::vector<uint8_t> pieces;
    for (int64_t held = 0; held < n;) {
      const int64_t m = std::min<int64_t>(n - held, 1 + int64_t(rng() % 5));
      cache_impl::append_stacked_codes(c.params, pieces, held, c.codes.data() + size_t(held) * c.kept(), m);
      held += m;
    }
    EXPECT_EQ(pieces, whole) << n;
    std::vector<uint16_t> back(size_t(n) * c.kept(), 0xffff);
    cache_impl::decode_stacked_codes(c.params, whole.data(), whole.size(), n, back.data());
    EXPECT_TRUE(std::equal(back.begin(), back.end(), c.codes.begin())) << n;
    const std::vector<uint8_t> forward = kvtc::encode_codes(c.params, c.codes.data(), n);
    EXPECT_LE(whole.size(), forward.size() + 8) << n;
    EXPECT_GE(whole.size() + 8, forward.size()) << n;
  }
}

// The stacked coder with the kernels' division-free constants (the
// default) writes the bytes of its plain reference (ryg_rans's step with a
// division, taken by parameters without encode kernels), in one run and in
// pieces of 1 to 4 tokens, for every prefix length up to 120 tokens.
TEST(StackedCodes, FastCoderWritesTheBytesOfItsPlainReference) {
  const Coded c = coded_tokens(120, 34);
  ASSERT_EQ(c.params.derived().rans_encode.size(), c.kept());
  kvtc::HeadParams plain = c.params;
  plain.build_kernels(kvtc::KernelSet::kDecode);  // no encoder constants: the reference loop
  ASSERT_TRUE(plain.derived().rans_encode.empty());
  std::mt19937 rng(77);
  for (int64_t n = 0; n <= c.n; ++n) {
    std::vector<uint8_t> fast, ref;
    cache_impl::append_stacked_codes(c.params, fast, 0, c.codes.data(), n);
    cache_impl::append_stacked_codes(plain, ref, 0, c.codes.data(), n);
    ASSERT_EQ(fast, ref) << n;
    std::vector<uint8_t> pieces;
    for (int64_t held = 0; held < n;) {
      const int64_t m = std::min<int64_t>(n - held, 1 + int64_t(rng() % 4));
      cache_impl::append_stacked_codes(c.params, pieces, held, c.codes.data() + size_t(held) * c.kept(), m);
      held += m;
    }
    ASSERT_EQ(pieces, ref) << n;
  }
}

// Bad bytes end in Error(kFormat), never a crash or a read out of bounds:
// every truncation, a trailing byte, and every single flipped byte (which
// must either be refused or decode to codes inside every alphabet).
TEST(StackedCodes, BadBytesAreRefused) {
  const Coded c = coded_tokens(40, 32);
  std::vector<uint8_t> good;
  cache_impl::append_stacked_codes(c.params, good, 0, c.codes.data(), c.n);
  std::vector<uint16_t> out(size_t(c.n) * c.kept());
  for (size_t cut = 0; cut < good.size(); ++cut)
    EXPECT_THROW(cache_impl::decode_stacked_codes(c.params, good.data(), cut, c.n, out.data()), Error) << cut;
  std::vector<uint8_t> longer = good;
  longer.insert(longer.begin(), 0x5a);
  EXPECT_THROW(cache_impl::decode_stacked_codes(c.params, longer.data(), longer.size(), c.n, out.data()), Error);
  size_t refused = 0;
  for (size_t i = 0; i < good.size(); ++i) {
    std::vector<uint8_t> bad = good;
    bad[i] ^= 0x24;
    try {
      cache_impl::decode_stacked_codes(c.params, bad.data(), bad.size(), c.n, out.data());
      for (size_t j = 0; j < out.size(); ++j) ASSERT_LT(out[j], c.params.quant[j % c.kept()].levels);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kFormat);
      ++refused;
    }
  }
  EXPECT_GT(refused, good.size() / 2);  // the final-state check catches most flips
  // Codes outside their alphabet are refused before anything is written.
  std::vector<uint16_t> wrong(c.kept(), 0xffff);
  std::vector<uint8_t> payload = good;
  EXPECT_THROW(cache_impl::append_stacked_codes(c.params, payload, c.n, wrong.data(), 1), Error);
  EXPECT_EQ(payload, good);
}

// The default mode codes a token as it leaves the window, appending to the
// partial block's payload, and once more when its block (or refinement
// group) is whole: two codings per token, never the held tokens on every
// append. Only the sinks and the window stay raw; one token at a time ends
// in the state of one call (which codes whole blocks once).
TEST(CalibratedAppend, OneTokenAppendsCodeEachTokenOnceWithoutWaiting) {
  for (const bool refining : {false, true}) {
    const Sequence seq = make_sequence(2, 300, 1, 5150);
    const Settings set = refining ? refined(40, 8, 64) : calibrated(4, 8, 64);
    auto steps = make_cache("kvtc", layer_config(1), set);
    for (int64_t t = 0; t < 300; ++t) steps->append(slice(seq.keys, t, 1), slice(seq.values, t, 1));
    auto once = make_cache("kvtc", layer_config(1), set);
    once->append(seq.keys.view(), seq.values.view());
    EXPECT_EQ(steps->save(), once->save()) << refining;
    const CacheStats st = steps->stats();
    const double V = double(kHeads * kDim);
    EXPECT_EQ(st.extras.at("key.raw_bytes"), 2.0 * (4 + 8) * V * 2) << refining;
    // 300 - 4 sinks - 8 window = 288 coded tokens, 2 rows, K and V components.
    // 300 - 4 sinks - 8 window = 288 coded tokens: 4 whole blocks and 32
    // in the open fifth; refinement groups of 32, all whole. A whole block
    // took 63 one-token appends and then its 64 tokens coded into the
    // codec's bytes: 127 token codings for 64 tokens (a group: 31 + 32).
    const uint64_t base = uint64_t(st.extras.at("key.n_survived.0") + st.extras.at("value.n_survived.0"));
    uint64_t fine = 0;
    if (refining) {
      const KvtcCalibration cal = KvtcCalibration::read_file(refined_calibration_path());
      fine = uint64_t(cal.key_refine[1].n_kept() + cal.value_refine[1].n_kept());
    }
    const uint64_t rows = 2;
    EXPECT_EQ(st.coded_symbols, rows * ((4 * 127 + 32) * base + 9 * 63 * fine)) << refining;
    // One call codes every token once, and refines only the groups it
    // keeps: those ending after the 40 newest coded tokens begin (248), the
    // 64 tokens of [224, 288); the groups a one-token append coded and
    // dropped later it never codes, and saves the same bytes (above).
    EXPECT_EQ(once->stats().coded_symbols, rows * (288 * base + 64 * fine)) << refining;
  }
}

// The stacked decoder's plain reference: one symbol at a time, newest
// first, renormalising byte by byte (the decoder takes groups of 8
// symbols with a branchless renormalisation while 16 bytes are left).
// Returns the error message, or "" with codes written.
std::string decode_stacked_reference(const kvtc::HeadParams& p, const std::vector<uint8_t>& data, int64_t n,
                                     std::vector<uint16_t>& codes) {
  const size_t kept = size_t(p.n_kept());
  const size_t lanes = std::min<size_t>(size_t(n) * kept, entropy::kRansLanes);
  if (data.size() < 4 * lanes) return "states";
  std::vector<uint32_t> x(entropy::kRansLanes, entropy::kRansLow);
  size_t pos = data.size() - 4 * lanes;
  for (size_t j = 0; j < lanes; ++j) {
    std::memcpy(&x[j], data.data() + pos + 4 * j, 4);
    if (x[j] < entropy::kRansLow || x[j] >= (entropy::kRansLow << 8)) return "states";
  }
  codes.assign(size_t(n) * kept, 0);
  for (size_t i = size_t(n) * kept; i-- > 0;) {
    const size_t k = i % kept;
    const entropy::FrequencyTable& t = p.rans_tables[k];
    uint32_t& st = x[i % entropy::kRansLanes];
    const uint32_t slot = st & ((1u << t.scale_bits) - 1);
    uint32_t s = 0;
    while (s + 1 < t.alphabet_size && t.cum[s + 1] <= slot) ++s;
    st = t.freq[s] * (st >> t.scale_bits) + slot - t.cum[s];
    while (st < entropy::kRansLow) {
      if (pos == 0) return "kvtc block: truncated stream";
      st = st << 8 | data[--pos];
    }
    if (s >= p.quant[k].levels) return "kvtc block: code out of range";
    codes[i] = uint16_t(s);
  }
  if (pos != 0) return "kvtc block: trailing bytes";
  for (size_t j = 0; j < lanes; ++j)
    if (x[j] != entropy::kRansLow) return "kvtc block: a lane does not end in its initial state";
  return "";
}

// The decoder equals its reference on good payloads of every length and on
// damaged ones (single flipped bytes, random bytes under good states, cut
// streams): the same codes, or the same error.
TEST(StackedCodes, DecoderEqualsItsPlainReference) {
  const Coded c = coded_tokens(120, 33);
  std::mt19937 rng(4242);
  size_t compared = 0, refused = 0;
  const auto check = [&](const std::vector<uint8_t>& bytes, int64_t n) {
    std::vector<uint16_t> want;
    const std::string expected = decode_stacked_reference(c.params, bytes, n, want);
    std::vector<uint16_t> got(size_t(n) * c.kept());
    std::string error;
    try {
      cache_impl::decode_stacked_codes(c.params, bytes.data(), bytes.size(), n, got.data());
    } catch (const Error& e) {
      error = e.what();
    }
    ++compared;
    if (expected.empty()) {
      EXPECT_EQ(error, "") << n;
      EXPECT_EQ(got, want) << n;
    } else {
      ++refused;
      EXPECT_NE(error, "") << n << " " << expected;
      if (expected != "states") {
        EXPECT_NE(error.find(expected), std::string::npos) << error << " vs " << expected;
      }
    }
  };
  for (const int64_t n : {int64_t(1), int64_t(2), int64_t(7), int64_t(33), int64_t(120)}) {
    std::vector<uint8_t> good;
    cache_impl::append_stacked_codes(c.params, good, 0, c.codes.data(), n);
    check(good, n);
    for (size_t i = 0; i < good.size(); ++i) {
      std::vector<uint8_t> bad = good;
      bad[i] ^= uint8_t(1 + rng() % 255);
      check(bad, n);
    }
    const size_t states = 4 * std::min<size_t>(size_t(n) * c.kept(), entropy::kRansLanes);
    for (int r = 0; r < 50; ++r) {
      std::vector<uint8_t> noise = good;
      for (size_t i = 0; i + states < noise.size(); ++i) noise[i] = uint8_t(rng());
      noise.erase(noise.begin(), noise.begin() + std::ptrdiff_t(rng() % std::max<size_t>(1, good.size() - states)));
      check(noise, n);
    }
  }
  EXPECT_GT(refused, compared / 4);
  EXPECT_LT(refused, compared);
}

// Appends in pieces of random lengths (1 to 150 tokens: some inside a
// refinement group, some across several blocks) end in the bytes of one
// append of them all and of one-token appends: a call skips the refinement
// groups that are aged out by its end, and only those. Both block modes,
// refine windows shorter and longer than a group, a refine window of one
// group exactly.
TEST(CalibratedAppend, PiecesOfAnyLengthSaveTheBytesOfOneCall) {
  std::mt19937 rng(7321);
  for (const int64_t refine : {8, 32, 40, 100}) {
    for (const bool whole_blocks : {false, true}) {
      const Sequence seq = make_sequence(2, 420, 1, uint32_t(5200 + refine));
      Settings set = refined(refine, 8, 64);
      if (whole_blocks) set["whole_blocks"] = "true";
      auto once = make_cache("kvtc", layer_config(1), set);
      once->append(seq.keys.view(), seq.values.view());
      auto pieces = make_cache("kvtc", layer_config(1), set);
      auto steps = make_cache("kvtc", layer_config(1), set);
      for (int64_t t = 0; t < 420;) {
        const int64_t n = std::min<int64_t>(420 - t, std::uniform_int_distribution<int64_t>(1, 150)(rng));
        pieces->append(slice(seq.keys, t, n), slice(seq.values, t, n));
        t += n;
      }
      for (int64_t t = 0; t < 420; ++t) steps->append(slice(seq.keys, t, 1), slice(seq.values, t, 1));
      const auto bytes = once->save();
      EXPECT_EQ(pieces->save(), bytes) << refine << " " << whole_blocks;
      EXPECT_EQ(steps->save(), bytes) << refine << " " << whole_blocks;
      // Less refinement work in one call than token by token, none skipped
      // that the saved bytes hold (their equality above).
      EXPECT_LT(once->stats().coded_symbols, steps->stats().coded_symbols) << refine << " " << whole_blocks;
    }
  }
}

// A token's codes depend on its values rounded to the raw dtype, not on
// the layout it came in: f32 rows, f16 rows (the same values: the raw
// dtype of both), rows of a [B, S, H, D] buffer and rows with a stride
// between elements, appended in pieces of random lengths (the first fills
// the sinks and codes tokens at once), all save and read back as one
// contiguous f32 append, in both block modes and with refinement.
TEST(CalibratedAppend, EveryInputLayoutSavesTheBytesOfOneCall) {
  constexpr int64_t B = 2, S = 300;
  const Sequence seq = make_sequence(B, S, 1, 911);
  // Values a f16 holds exactly, so that the f16 input is the f32 input.
  const Tensor keys = seq.keys.to(DType::kF16).to(DType::kF32), values = seq.values.to(DType::kF16).to(DType::kF32);
  const Tensor keys16 = keys.to(DType::kF16), values16 = values.to(DType::kF16);
  // [B, S, H, D] and element-strided (stride 2) copies, seen as [B, H, S, D].
  const auto token_major = [](const Tensor& t, std::vector<float>& buf) {
    buf.resize(size_t(t.numel()));
    const TensorView v = t.view();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < kHeads; ++h)
        for (int64_t s = 0; s < S; ++s)
          for (int64_t d = 0; d < kDim; ++d) buf[size_t(((b * S + s) * kHeads + h) * kDim + d)] = v.at(b, h, s, d);
    TensorView out = t.view();
    out.data = buf.data();
    out.strides = {S * kHeads * kDim, kDim, kHeads * kDim, 1};
    return out;
  };
  const auto spread = [](const Tensor& t, std::vector<float>& buf) {
    buf.assign(2 * size_t(t.numel()), -1.0f);
    for (int64_t i = 0; i < t.numel(); ++i) buf[size_t(2 * i)] = t.data_as<float>()[i];
    TensorView out = t.view();
    out.data = buf.data();
    for (auto& stride : out.strides) stride *= 2;
    return out;
  };
  std::vector<float> kt, vt, ks, vs;
  const std::vector<std::pair<std::string, std::pair<TensorView, TensorView>>> inputs = {
      {"f16", {keys16.view(), values16.view()}},
      {"token-major", {token_major(keys, kt), token_major(values, vt)}},
      {"element-strided", {spread(keys, ks), spread(values, vs)}}};
  const auto piece = [](const TensorView& v, int64_t first, int64_t n) { return v.slice_tokens(first, n); };
  for (const Settings& set : {refined(40, 8, 64), whole(calibrated(4, 8, 32)), calibrated(0, 0, 16)}) {
    auto once = make_cache("kvtc", layer_config(1), set);
    once->append(keys.view(), values.view());
    const std::vector<uint8_t> bytes = once->save();
    std::mt19937 rng(4242);
    for (const auto& [name, kv] : inputs) {
      auto pieces = make_cache("kvtc", layer_config(1), set);
      for (int64_t t = 0; t < S;) {
        // The first piece fills the sinks and codes what it can.
        const int64_t n = std::min<int64_t>(S - t, t == 0 ? 90 : std::uniform_int_distribution<int64_t>(1, 120)(rng));
        pieces->append(piece(kv.first, t, n), piece(kv.second, t, n));
        t += n;
      }
      EXPECT_EQ(pieces->save(), bytes) << name << " " << set.at("block");
      const KVPair a = once->fetch(DType::kF32), b = pieces->fetch(DType::kF32);
      EXPECT_TRUE(bit_equal(a.keys, b.keys)) << name;
      EXPECT_TRUE(bit_equal(a.values, b.values)) << name;
    }
  }
}

// Golden files of the calibrated layouts, with the calibration they were
// written with (a saved calibrated cache names its parameters' hash, so the
// calibration is stored beside them rather than fitted again).
const std::string kGoldenDir = std::string(KVCODEC_SOURCE_DIR) + "/tests/data/saved_caches_calibrated";
const std::string kGoldenCalibration = kGoldenDir + "/refined.kvcal";

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// refine 24, window 8, block 16, batch 2, 70 tokens one at a time: three
// whole blocks, a partial fourth (10 tokens), refinement groups in the
// newest blocks, one of them partial.
// The golden files were written with the 16-bit projection (before
// kvtc.int8 reached the calibrated mode); the encoder they pin is that one.
Settings golden_settings() {
  Settings s = refined(24, 8, 16);
  s["calibration"] = kGoldenCalibration;
  s["int8"] = "false";
  return s;
}
const Sequence& golden_sequence() {
  static const Sequence seq = make_sequence(2, 70, 1, 2026);
  return seq;
}
std::unique_ptr<KVCache> golden_cache() {
  auto cache = make_cache("kvtc", layer_config(1), golden_settings());
  for (int64_t t = 0; t < 70; ++t)
    cache->append(slice(golden_sequence().keys, t, 1), slice(golden_sequence().values, t, 1));
  return cache;
}

// The saved state of two caches is the same: every section and every meta
// key but "settings", which names the calibration by its path (another in
// every checkout; the parameters' hash identifies it).
void expect_same_state(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, const std::string& what) {
  const ContainerReader ra = ContainerReader::parse(a.data(), a.size());
  const ContainerReader rb = ContainerReader::parse(b.data(), b.size());
  auto meta = [](const ContainerReader& r) {
    auto m = r.meta();
    m.erase("settings");
    return m;
  };
  EXPECT_EQ(meta(ra), meta(rb)) << what;
  ASSERT_EQ(ra.section_names(), rb.section_names()) << what;
  for (const auto& name : ra.section_names()) {
    const auto x = ra.section(name), y = rb.section(name);
    EXPECT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end())) << what << ": section " << name;
  }
}

// The saved layout version (meta "layout") of bytes.
std::string layout_of(const std::vector<uint8_t>& bytes) {
  const ContainerReader r = ContainerReader::parse(bytes.data(), bytes.size());
  return r.meta_or_throw("layout");
}

// KVCODEC_REGENERATE_GOLDEN=1 writes the missing files: the calibration
// (once) and the current layout's cache; never an existing one.
void regenerate_missing() {
  std::filesystem::create_directories(kGoldenDir);
  if (!std::filesystem::exists(kGoldenCalibration))
    std::filesystem::copy_file(refined_calibration_path(), kGoldenCalibration);
  const std::vector<uint8_t> bytes = golden_cache()->save();
  const std::string path = kGoldenDir + "/kvtc_calibrated_layout" + layout_of(bytes) + ".kvc";
  if (!std::filesystem::exists(path)) write_bytes(path, bytes);
}

TEST(CalibratedGolden, EveryLayoutLoadsAndReadsBackTheSameTokens) {
  if (std::getenv("KVCODEC_REGENERATE_GOLDEN")) regenerate_missing();
  if (!std::filesystem::exists(kGoldenCalibration)) GTEST_SKIP() << kGoldenCalibration << " missing";
  auto fresh = golden_cache();
  const KVPair want = fresh->fetch(DType::kF32);
  const std::string current = layout_of(fresh->save());
  int seen = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kGoldenDir)) {
    if (entry.path().extension() != ".kvc") continue;
    const std::vector<uint8_t> bytes = read_bytes(entry.path().string());
    auto loaded = make_cache("kvtc", layer_config(1), golden_settings());
    loaded->load(bytes.data(), bytes.size());
    EXPECT_EQ(loaded->offset(), 70) << entry.path();
    const KVPair got = loaded->fetch(DType::kF32);
    EXPECT_TRUE(bit_equal(got.keys, want.keys)) << entry.path();
    EXPECT_TRUE(bit_equal(got.values, want.values)) << entry.path();
    if (layout_of(bytes) == current) {
      expect_same_state(loaded->save(), bytes, entry.path().string() + ": the saved layout changed without a new version");
    } else {
      // An older layout saves as the current one: the state of a cache that
      // took the same tokens.
      expect_same_state(loaded->save(), fresh->save(), entry.path().string());
    }
    // And it keeps taking tokens as that cache does.
    const Sequence more = make_sequence(2, 20, 1, 77);
    auto twin = golden_cache();
    for (int64_t t = 0; t < 20; ++t) {
      loaded->append(slice(more.keys, t, 1), slice(more.values, t, 1));
      twin->append(slice(more.keys, t, 1), slice(more.values, t, 1));
    }
    EXPECT_EQ(loaded->save(), twin->save()) << entry.path();
    ++seen;
  }
  EXPECT_GE(seen, 1) << "no golden file in " << kGoldenDir << " (KVCODEC_REGENERATE_GOLDEN=1 writes them)";
}

}  // namespace
}  // namespace kvcodec

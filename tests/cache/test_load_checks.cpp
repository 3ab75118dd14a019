// What load() refuses, past the checksums (every bad file here is sealed again
// by format/reseal.hpp): the local kvtc cache's saved state, settings and
// payloads, the stream caches' counters, and the kvtc widths a cache accepts.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>

#include "format/reseal.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"

using namespace kvcodec;
namespace rs = kvcodec::testing_reseal;

namespace {

CacheConfig config() {
  CacheConfig c;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  return c;
}

// [1, 2, S, 16] correlated f32 tokens.
Tensor tokens(int64_t S, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  Tensor t(DType::kF32, {1, 2, S, 16});
  for (int64_t i = 0; i < S * 2; ++i) {
    const float a = 3.0f * g(rng), b = g(rng);
    for (int d = 0; d < 16; ++d)
      t.data_as<float>()[i * 16 + d] = a * std::sin(0.3f * float(d)) + b * std::cos(0.7f * float(d)) + 0.05f * g(rng);
  }
  return t;
}

const Settings kLocal{{"sinks", "4"}, {"block", "8"}, {"min_fit_tokens", "16"}};

// 4 sinks + 5 blocks of 8 (+ 0 raw tail tokens), saved.
std::vector<uint8_t> saved_local(const Settings& s = kLocal, int64_t S = 44) {
  auto c = make_cache("kvtc", config(), s);
  const Tensor k = tokens(S, 1), v = tokens(S, 2);
  c->append(k.view(), v.view());
  return c->save();
}

ErrorCode load_error(const std::vector<uint8_t>& bytes) {
  try {
    auto c = load_cache(bytes.data(), bytes.size());
    (void)c->fetch(DType::kF32);
  } catch (const Error& e) {
    return e.code();
  }
  return ErrorCode(0);
}

// The "state" section: u64 batch, u64 offset, u8 fitted, u8 raw dtype, u64 blocks.
std::vector<uint8_t> with_state(const std::vector<uint8_t>& bytes, size_t at, uint64_t value, int width) {
  return rs::edit_section(bytes, "state", [&](std::vector<uint8_t>& p) {
    for (int i = 0; i < width; ++i) p[at + size_t(i)] = uint8_t(value >> (8 * i));
  });
}

TEST(KvtcLocalLoad, RawDtypeOtherThanF16OrBf16IsRefused) {
  const auto good = saved_local();
  ASSERT_EQ(load_error(good), ErrorCode(0));
  for (uint64_t dtype : {0, 3, 4, 255})  // f32 (its rows would overflow the 16-bit tail), others
    EXPECT_EQ(load_error(with_state(good, 17, dtype, 1)), ErrorCode::kFormat) << dtype;
}

TEST(KvtcLocalLoad, BlocksWithoutTheirSinksAreRefused) {
  // One token fewer and the raw sections one token short: the raw part no
  // longer covers the 4 sinks that sit before the blocks.
  auto bad = with_state(saved_local(), 8, 43, 8);
  bad = rs::edit_container(bad, [](rs::Meta&, rs::Sections& sections) {
    for (auto& [name, p] : sections)
      if (name == "key.raw" || name == "value.raw") p.resize(p.size() / 4 * 3);  // 2 heads x 3 tokens
  });
  EXPECT_EQ(load_error(bad), ErrorCode::kFormat);
}

TEST(KvtcLocalLoad, CountsThatOverflowOrExceedTheBytesAreRefusedFast) {
  const auto good = saved_local();
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t blocks : {uint64_t(1) << 40, ~uint64_t(0), uint64_t(1) << 61})
    EXPECT_EQ(load_error(with_state(good, 18, blocks, 8)), ErrorCode::kFormat) << blocks;
  for (uint64_t offset : {uint64_t(1) << 40, ~uint64_t(0), (uint64_t(1) << 60) + 44})
    EXPECT_EQ(load_error(with_state(good, 8, offset, 8)), ErrorCode::kFormat) << offset;
  for (uint64_t batch : {uint64_t(1) << 19, ~uint64_t(0)})
    EXPECT_EQ(load_error(with_state(good, 0, batch, 8)), ErrorCode::kFormat) << batch;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
}

TEST(KvtcLocalLoad, OtherTokenLayoutSettingsAreAConfigError) {
  const auto bytes = saved_local();
  for (const Settings& mine : {Settings{{"sinks", "4"}, {"block", "16"}, {"min_fit_tokens", "16"}},
                               Settings{{"sinks", "0"}, {"block", "8"}, {"min_fit_tokens", "16"}},
                               Settings{{"sinks", "4"}, {"block", "8"}, {"window", "8"}, {"min_fit_tokens", "16"}}}) {
    auto c = make_cache("kvtc", config(), mine);
    try {
      c->load(bytes.data(), bytes.size());
      ADD_FAILURE() << "loaded a cache saved with other block/sinks/window";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kConfig) << e.what();
    }
  }
  // Other thread counts place tokens alike: that loads.
  Settings threads = kLocal;
  threads["threads"] = "3";
  EXPECT_NO_THROW(make_cache("kvtc", config(), threads)->load(bytes.data(), bytes.size()));
}

// Empty payloads (one byte each: their zero length) must not decode into
// tokens: refused at load, not at fetch.
TEST(KvtcLocalLoad, CorruptPayloadsAreRefusedAtLoad) {
  const auto good = saved_local();
  const auto bad = rs::edit_container(good, [](rs::Meta&, rs::Sections& sections) {
    for (auto& [name, p] : sections)
      if (name == "key.blocks") p.assign(5 * 2, 0);  // 5 blocks x 2 heads, each empty
  });
  auto c = make_cache("kvtc", config(), kLocal);
  EXPECT_THROW(c->load(bad.data(), bad.size()), Error);
  // Flipped payload bytes, with 4 threads decoding: a decode error thrown
  // inside the OpenMP team comes out as an Error (no std::terminate), and
  // whatever loads can be fetched.
  Settings threaded = kLocal;
  threaded["threads"] = "4";
  const auto bytes = saved_local(threaded);
  size_t refused = 0;
  for (size_t i = 0; i < 200; ++i) {
    const auto mutant = rs::edit_section(bytes, i % 2 ? "key.blocks" : "value.blocks", [&](std::vector<uint8_t>& p) {
      p[(i * 7919) % p.size()] ^= uint8_t(1 + i % 255);
    });
    auto d = make_cache("kvtc", config(), threaded);
    try {
      d->load(mutant.data(), mutant.size());
    } catch (const Error&) {
      ++refused;
      continue;
    }
    EXPECT_NO_THROW(d->fetch(DType::kF32)) << "a payload loaded but failed at fetch (mutant " << i << ")";
  }
  EXPECT_GT(refused, 0u);
}

TEST(KvtcLocalLoad, LayoutVersionIsReadAndNewerIsRefused) {
  const auto good = saved_local();
  auto with_layout = [&](const char* v) {
    return rs::edit_container(good, [&](rs::Meta& meta, rs::Sections&) {
      if (v) meta["layout"] = v;
      else meta.erase("layout");
    });
  };
  EXPECT_EQ(load_error(with_layout(nullptr)), ErrorCode(0));  // files from before the key: version 1
  EXPECT_EQ(load_error(with_layout("1")), ErrorCode(0));
  EXPECT_EQ(load_error(with_layout("2")), ErrorCode::kUnsupported);
  EXPECT_EQ(load_error(with_layout("x")), ErrorCode::kFormat);
}

TEST(StreamCacheLoad, RawWindowsLongerThanTheMethodKeepsAreRefused) {
  // kivi2 with residual 16: keys keep < residual + group raw tokens, values <= residual.
  auto c = make_cache("kivi2", config(), {{"residual", "16"}, {"group_size", "8"}});
  const Tensor k = tokens(40, 3), v = tokens(40, 4);
  c->append(k.view(), v.view());
  const auto good = c->save();
  ASSERT_EQ(load_error(good), ErrorCode(0));
  // The value stream's quantized count (its first u64) lowered by 8: the
  // stream then claims a raw window longer than the residual it keeps.
  const auto bad = rs::edit_section(good, "value", [](std::vector<uint8_t>& p) { p[0] = uint8_t(p[0] - 8); });
  EXPECT_EQ(load_error(bad), ErrorCode::kFormat);
}

// Every width the codec codes round-trips through save and load, bit for
// bit; wider ones (no 8192-level quantizer is stored) are a config error.
TEST(KvtcBitChoices, EveryAllowedWidthSavesAndLoadsBitIdentically) {
  const Tensor k = tokens(48, 5), v = tokens(48, 6);
  for (int b = 1; b <= 12; ++b) {
    const Settings s{{"bit_choices", "0," + std::to_string(b)}, {"block", "8"}, {"min_fit_tokens", "32"},
                     {"bit_budget", std::to_string(16 * 6)}};
    auto c = make_cache("kvtc", config(), s);
    c->append(k.view(), v.view());
    const auto bytes = c->save();
    auto d = load_cache(bytes.data(), bytes.size());
    const KVPair x = c->fetch(DType::kF32), y = d->fetch(DType::kF32);
    ASSERT_EQ(x.keys.nbytes(), y.keys.nbytes());
    EXPECT_EQ(std::memcmp(x.keys.data(), y.keys.data(), x.keys.nbytes()), 0) << "width " << b;
    EXPECT_EQ(std::memcmp(x.values.data(), y.values.data(), x.values.nbytes()), 0) << "width " << b;
    EXPECT_EQ(d->save(), bytes) << "width " << b;
  }
  for (const char* bad : {"0,13", "0,14", "0,15", "0,16", "0,4,17", "1,2", "0,0,4"})
    try {
      make_cache("kvtc", config(), {{"bit_choices", bad}});
      ADD_FAILURE() << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kConfig) << bad;
      EXPECT_NE(std::string(e.what()).find("bit_choices"), std::string::npos) << e.what();
    }
}

}  // namespace

// Calibrated KVTC: RoPE removal, calibration files, and the cache contract
// on a small calibration fitted here from synthetic low-rank KV.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <cstring>
#include <unistd.h>

#include "cache/calibrated_fixture.hpp"
#include "cache/kvtc_calibrated.hpp"
#include "cache/mutant_dumps.hpp"
#include "format/reseal.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"
#include "linalg/pca.hpp"

namespace kvcodec {
namespace {

using namespace calibrated_fixture;


TEST(RopeRemoval, RemoveThenApplyIsExactToF32Rounding) {
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.0f, 3.0f);
  for (int D : {16, 64, 128})
    for (int64_t pos : {0, 1, 17, 1023, 4095, 131071}) {
      std::vector<float> x(size_t(4 * D));
      for (auto& v : x) v = g(rng);
      std::vector<float> y = x;
      rope_rotate_token(y.data(), 4, D, pos, 500000.0, /*inverse=*/true);
      rope_rotate_token(y.data(), 4, D, pos, 500000.0, /*inverse=*/false);
      double num = 0, den = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        num += (double(x[i]) - y[i]) * (double(x[i]) - y[i]);
        den += double(x[i]) * x[i];
      }
      EXPECT_LT(std::sqrt(num / den), 1e-6) << "D=" << D << " pos=" << pos;
    }
}

TEST(RopeRemoval, ForwardMatchesRotateHalfReference) {
  // HF rotate-half: (x_i, x_{i+D/2}) -> (x_i c - x_{i+D/2} s, x_{i+D/2} c + x_i s).
  const int D = 8;
  std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<float> y = x;
  rope_rotate_token(y.data(), 1, D, 3, 100.0, false);
  for (int i = 0; i < D / 2; ++i) {
    const double a = 3.0 * std::pow(100.0, -2.0 * i / D);
    EXPECT_NEAR(y[size_t(i)], x[size_t(i)] * std::cos(a) - x[size_t(i + 4)] * std::sin(a), 1e-5);
    EXPECT_NEAR(y[size_t(i + 4)], x[size_t(i + 4)] * std::cos(a) + x[size_t(i)] * std::sin(a), 1e-5);
  }
  // Position 0 is the identity.
  std::vector<float> z = x;
  rope_rotate_token(z.data(), 1, D, 0, 100.0, true);
  EXPECT_EQ(z, x);
}

// Keys moved T positions on (kvcodec bench's steady pass) are the keys of
// the same pre-RoPE vectors at p + T: removing RoPE there gives back what
// removing it at p gives.
TEST(RopeRemoval, AdvancedKeysAreThoseOfTheLaterPositions) {
  std::mt19937 rng(9);
  std::normal_distribution<float> g(0.0f, 2.0f);
  for (int D : {8, 64, 128})
    for (int64_t T : {1, 200, 2048}) {
      const int64_t rows = 5;
      std::vector<float> pre(size_t(rows * D));
      for (auto& v : pre) v = g(rng);
      std::vector<float> keys = pre;  // row r at position 3 r
      for (int64_t r = 0; r < rows; ++r) rope_rotate_token(keys.data() + r * D, 1, D, 3 * r, kTheta, false);
      rope_advance_rows(keys.data(), rows, D, T, kTheta);
      for (int64_t r = 0; r < rows; ++r) rope_rotate_token(keys.data() + r * D, 1, D, 3 * r + T, kTheta, true);
      double num = 0, den = 0;
      for (size_t i = 0; i < pre.size(); ++i) {
        num += (double(pre[i]) - keys[i]) * (double(pre[i]) - keys[i]);
        den += double(pre[i]) * pre[i];
      }
      EXPECT_LT(std::sqrt(num / den), 1e-6) << "D=" << D << " T=" << T;
    }
}

// What the bench's steady pass relies on: a calibrated cache codes keys
// moved on to the positions after those it holds as well as the first
// ones, while the same keys appended unmoved (what the bench appended
// before) are not keys of those positions and code far worse.
TEST(CalibratedCache, KeysAdvancedToTheirPositionsCodeAsWellAsTheFirst) {
  const int64_t S = 200;
  const Sequence seq = make_sequence(1, S, 0, 901);
  Tensor advanced = seq.keys;
  rope_advance_rows(advanced.data_as<float>(), kHeads * S, kDim, S, kTheta);
  const auto second_half_error = [&](const Tensor& second) {
    auto cache = make_cache("kvtc", layer_config(0), calibrated(4, 8));
    cache->append(seq.keys.view(), seq.values.view());
    const KVPair out = cache->update_and_fetch(second.view(), seq.values.view());
    Tensor got(DType::kF32, {1, kHeads, S, kDim});
    for (int64_t h = 0; h < kHeads; ++h)
      std::memcpy(got.data_as<float>() + h * S * kDim,
                  out.keys.data_as<float>() + (h * 2 * S + S) * kDim, size_t(S * kDim) * sizeof(float));
    return rel_mse(second, got);
  };
  const double first = [&] {
    auto cache = make_cache("kvtc", layer_config(0), calibrated(4, 8));
    return rel_mse(seq.keys, cache->update_and_fetch(seq.keys.view(), seq.values.view()).keys);
  }();
  const double moved = second_half_error(advanced), unmoved = second_half_error(seq.keys);
  EXPECT_LT(moved, 2.0 * first + 1e-5) << "first " << first;
  EXPECT_GT(unmoved, 10.0 * moved);
}

TEST(CalibrationFile, RoundTripsAndRefusesCorruption) {
  const KvtcCalibration cal = KvtcCalibration::read_file(calibration_path());
  EXPECT_EQ(cal.n_layers, kLayers);
  EXPECT_EQ(cal.vector_dim(), kHeads * kDim);
  const std::vector<uint8_t> bytes = cal.serialize();
  const KvtcCalibration again = KvtcCalibration::parse(bytes.data(), bytes.size());
  EXPECT_EQ(again.serialize(), bytes);
  // Every truncation and a flip in every 7th byte are refused with an Error.
  for (size_t n = 0; n < bytes.size(); n += 13)
    EXPECT_THROW(KvtcCalibration::parse(bytes.data(), n), Error) << n;
  for (size_t i = 0; i < bytes.size(); i += 7) {
    std::vector<uint8_t> bad = bytes;
    bad[i] ^= 0x20;
    EXPECT_THROW(KvtcCalibration::parse(bad.data(), bad.size()), Error) << i;
  }
  // A corrupted file is refused by the cache too.
  const std::string path = calibration_path() + ".bad";
  {
    std::vector<uint8_t> bad = bytes;
    bad[bad.size() / 2] ^= 1;
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bad.data()), std::streamsize(bad.size()));
  }
  EXPECT_THROW(make_cache("kvtc", layer_config(0), {{"calibration", path}}), Error);
  EXPECT_THROW(make_cache("kvtc", layer_config(0), {{"calibration", path + ".missing"}}), Error);
  std::filesystem::remove(path);
}

TEST(CalibratedCache, RefusesAnotherShapeNamingBoth) {
  CacheConfig other = layer_config(0);
  other.head_dim = 32;
  try {
    make_cache("kvtc", other, {{"calibration", calibration_path()}});
    FAIL() << "a cache of another shape accepted the calibration";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kShapeMismatch);
    const std::string m = e.what();
    EXPECT_NE(m.find("head_dim=16"), std::string::npos) << m;
    EXPECT_NE(m.find("head_dim=32"), std::string::npos) << m;
  }
  CacheConfig layers = layer_config(0);
  layers.n_layers = 3;
  EXPECT_THROW(make_cache("kvtc", layers, {{"calibration", calibration_path()}}), Error);
  EXPECT_THROW(make_cache("kvtc", layer_config(0), {{"calibration", calibration_path()}, {"rope_theta", "500000"}}),
               Error);
}

TEST(CalibratedCache, SettingsAreValidated) {
  EXPECT_THROW(make_cache("kvtc", layer_config(0), {{"mode", "calibrated"}}), Error);
  EXPECT_THROW(make_cache("kvtc", layer_config(0), {{"calibration", calibration_path()}, {"bit_budget", "64"}}),
               Error);
  EXPECT_THROW(make_cache("kvtc", layer_config(0), {{"calibration", calibration_path()}, {"window", "-1"}}), Error);
  EXPECT_NO_THROW(make_cache("kvtc", layer_config(1), {{"mode", "calibrated"}, {"calibration", calibration_path()}}));
}

TEST(CalibratedCache, ReconstructsWithRopeReappliedAndCountsBytes) {
  for (int layer = 0; layer < kLayers; ++layer) {
    const Sequence seq = make_sequence(2, 200, layer, 900);
    auto cache = make_cache("kvtc", layer_config(layer), calibrated(4, 8));
    const KVPair out = cache->update_and_fetch(seq.keys.view(), seq.values.view());
    // The calibration fits these (rank 6) vectors: small error only if RoPE
    // was removed before projecting and re-applied after decoding.
    EXPECT_LT(rel_mse(seq.keys, out.keys), 1e-3);
    EXPECT_LT(rel_mse(seq.values, out.values), 1e-3);
    const CacheStats st = cache->stats();
    EXPECT_EQ(st.tokens, 200);
    EXPECT_EQ(st.extras.at("key.side_bytes"), 0.0);
    // 200 = 4 sinks + 188 coded (11 blocks of 16 + a partial block of 12) +
    // the window of 8: only the sinks and the window stay raw, all counted.
    const double raw = 2.0 * 12 * kHeads * kDim * 2;
    EXPECT_EQ(st.extras.at("key.raw_bytes"), raw);
    EXPECT_EQ(double(st.compressed_key_bytes), st.extras.at("key.payload_bytes") + raw);
    EXPECT_GT(st.compression_ratio(), 2.0);
    EXPECT_GT(st.extras.at("key.calibration_bytes"), 0.0);
  }
}

// The const read path may run on several threads at once (kvcodec/cache.hpp):
// concurrent fetches of one cache are all bit-equal to a lone one (and
// ThreadSanitizer, in scripts/test.sh, sees no race in them).
TEST(CalibratedCache, ConcurrentReadsOfOneCacheAgree) {
  const Sequence seq = make_sequence(2, 300, 1, 77);
  auto cache = make_cache("kvtc", layer_config(1), calibrated(4, 8));
  cache->append(seq.keys.view(), seq.values.view());
  const KVPair alone = cache->fetch(DType::kF32);
  std::vector<KVPair> got(4);
  std::vector<std::thread> readers;
  for (size_t i = 0; i < got.size(); ++i) readers.emplace_back([&, i] { got[i] = cache->fetch(DType::kF32); });
  for (auto& t : readers) t.join();
  for (const auto& g : got) {
    EXPECT_TRUE(bit_equal(g.keys, alone.keys));
    EXPECT_TRUE(bit_equal(g.values, alone.values));
  }
}

TEST(CalibratedCache, StreamingEqualsOneShotAndSaveLoadIsExact) {
  for (auto [sinks, window] : {std::pair{4, 8}, std::pair{0, 0}, std::pair{4, 128}}) {
    const Sequence seq = make_sequence(2, 300, 1, 4242);
    auto whole = make_cache("kvtc", layer_config(1), calibrated(sinks, window));
    whole->append(seq.keys.view(), seq.values.view());
    auto steps = make_cache("kvtc", layer_config(1), calibrated(sinks, window));
    steps->append(slice(seq.keys, 0, 37), slice(seq.values, 0, 37));
    for (int64_t t = 37; t < 300; ++t) steps->append(slice(seq.keys, t, 1), slice(seq.values, t, 1));
    const KVPair a = whole->fetch(DType::kF32), b = steps->fetch(DType::kF32);
    EXPECT_TRUE(bit_equal(a.keys, b.keys));
    EXPECT_TRUE(bit_equal(a.values, b.values));
    EXPECT_EQ(whole->stats().compressed_bytes(), steps->stats().compressed_bytes());
    // Block-wise read covers the history in order.
    int64_t next = 0;
    whole->for_each_block([&](int64_t first, const TensorView& k, const TensorView&) {
      EXPECT_EQ(first, next);
      next += k.shape[2];
    });
    EXPECT_EQ(next, 300);

    const std::vector<uint8_t> saved = whole->save();
    auto loaded = load_cache(saved.data(), saved.size());
    const KVPair c = loaded->fetch(DType::kF32);
    EXPECT_TRUE(bit_equal(a.keys, c.keys));
    EXPECT_TRUE(bit_equal(a.values, c.values));
    EXPECT_EQ(loaded->stats().compressed_key_bytes, whole->stats().compressed_key_bytes);
    EXPECT_EQ(loaded->stats().compressed_value_bytes, whole->stats().compressed_value_bytes);
    for (size_t i = 0; i < saved.size(); i += 97) {
      std::vector<uint8_t> bad = saved;
      bad[i] ^= 0x41;
      EXPECT_THROW(loaded->load(bad.data(), bad.size()), Error) << i;
    }
  }
}

TEST(CalibratedCache, TrimRollsBackAndReappendMatches) {
  const Sequence seq = make_sequence(1, 260, 0, 31);
  auto cache = make_cache("kvtc", layer_config(0), calibrated(4, 8));
  cache->append(slice(seq.keys, 0, 200), slice(seq.values, 0, 200));
  const CacheStats before = cache->stats();
  const KVPair ref = cache->fetch(DType::kF32);
  // 200 tokens = 4 sinks + 188 coded (the newest block holds 12 of 16) + the
  // window of 8. Three more push tokens 192..194 out of the window into the
  // partial block; trimming the three newest cuts the raw window only: the
  // coded tokens keep their reconstruction, the raw counters fall by 3
  // tokens and the payload keeps the 3 newly coded ones.
  const double token_bytes = double(kHeads * kDim * 2);
  EXPECT_EQ(before.extras.at("key.raw_bytes"), 12 * token_bytes);
  cache->append(slice(seq.keys, 200, 3), slice(seq.values, 200, 3));
  EXPECT_EQ(cache->trim(3), 3);
  EXPECT_EQ(cache->offset(), 200);
  const CacheStats after = cache->stats();
  EXPECT_EQ(after.extras.at("key.raw_bytes"), 9 * token_bytes);
  EXPECT_GT(after.extras.at("key.payload_bytes"), before.extras.at("key.payload_bytes"));
  EXPECT_EQ(double(after.compressed_key_bytes), after.extras.at("key.payload_bytes") + 9 * token_bytes);
  {
    const KVPair now = cache->fetch(DType::kF32);
    // [1, H, 200, D]: the sinks, coded tokens 4..191 and the raw tokens
    // 195..199 are as before; 192..194 are now coded (close, not equal).
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t t = 0; t < 200; ++t)
        for (int64_t d = 0; d < kDim; ++d) {
          const size_t i = size_t((h * 200 + t) * kDim + d);
          if (t >= 192 && t < 195)
            EXPECT_NEAR(now.keys.data_as<float>()[i], ref.keys.data_as<float>()[i], 0.1) << t;  // coding error
          else
            EXPECT_EQ(now.keys.data_as<float>()[i], ref.keys.data_as<float>()[i]) << "h=" << h << " t=" << t;
        }
  }
  // Cutting into encoded blocks keeps the reconstruction of what is left.
  EXPECT_EQ(cache->trim(100), 100);
  const KVPair cut = cache->fetch(DType::kF32);
  for (int64_t h = 0; h < kHeads; ++h)
    for (int64_t i = 0; i < 100 * kDim; ++i)
      EXPECT_NEAR(cut.keys.data_as<float>()[h * 100 * kDim + i], ref.keys.data_as<float>()[h * 200 * kDim + i], 2e-2)
          << "h=" << h << " token " << i / kDim;
  EXPECT_EQ(cache->trim(1000), 100);
  EXPECT_EQ(cache->offset(), 0);
  EXPECT_EQ(cache->stats().compressed_bytes(), 0u);
}

TEST(CalibrationFile, WeightsRoundTripAndBadWeightsAreRefused) {
  const KvtcCalibration cal = KvtcCalibration::read_file(weighted_calibration_path());
  ASSERT_TRUE(cal.weighted());
  ASSERT_EQ(cal.key_scale.size(), size_t(kLayers));
  const std::vector<uint8_t> bytes = cal.serialize();
  const KvtcCalibration again = KvtcCalibration::parse(bytes.data(), bytes.size());
  EXPECT_EQ(again.key_scale, cal.key_scale);
  EXPECT_EQ(again.value_scale, cal.value_scale);
  EXPECT_EQ(again.serialize(), bytes);
  // Wrong length, a zero, a negative or a NaN weight; a layer without its scales.
  const std::vector<uint8_t> good(bytes.begin(), bytes.end());
  ByteWriter short_w;
  short_w.f32s(cal.key_scale[1].data(), cal.key_scale[1].size() - 1);
  {
    const auto damaged = with_section(good, "layer.1.key_scale", short_w.take(), ContainerKind::kCalibration);
    EXPECT_THROW(KvtcCalibration::parse(damaged.data(), damaged.size()), Error);
  }
  for (const float bad : {0.0f, -1.0f, std::nanf("")}) {
    std::vector<float> w = cal.value_scale[0];
    w[5] = bad;
    ByteWriter b;
    b.f32s(w.data(), w.size());
    const auto damaged = with_section(good, "layer.0.value_scale", b.take(), ContainerKind::kCalibration);
    try {
      KvtcCalibration::parse(damaged.data(), damaged.size());
      FAIL() << "weight " << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kFormat);
      EXPECT_NE(std::string(e.what()).find("layer.0.value_scale[5]"), std::string::npos) << e.what();
    }
  }
  {
    KvtcCalibration half = cal;
    half.value_scale.clear();
    EXPECT_THROW(half.serialize(), Error);
    half = cal;
    half.key_scale[0][3] = 0.0f;
    EXPECT_THROW(half.serialize(), Error);
  }
  // The unweighted twin (same parameters, no weights) is another calibration:
  // a cache saved with one is refused by the other.
  KvtcCalibration twin = cal;
  twin.key_scale.clear();
  twin.value_scale.clear();
  const std::string twin_path = weighted_calibration_path() + ".twin";
  twin.write_file(twin_path);
  const Sequence seq = make_sequence(1, 80, 0, 5);
  auto a = make_cache("kvtc", layer_config(0), {{"calibration", twin_path}, {"block", "16"}, {"window", "8"}});
  a->append(seq.keys.view(), seq.values.view());
  const auto saved = a->save();
  auto b = make_cache("kvtc", layer_config(0),
                      {{"calibration", weighted_calibration_path()}, {"block", "16"}, {"window", "8"}});
  EXPECT_THROW(b->load(saved.data(), saved.size()), Error);
  std::filesystem::remove(twin_path);
}

TEST(CalibratedCache, WeightedCalibrationReconstructsAndStreams) {
  Settings st = calibrated(4, 8);
  st["calibration"] = weighted_calibration_path();
  for (int layer = 0; layer < kLayers; ++layer) {
    const Sequence seq = make_sequence(2, 150, layer, 700);
    auto whole = make_cache("kvtc", layer_config(layer), st);
    const KVPair out = whole->update_and_fetch(seq.keys.view(), seq.values.view());
    // Fitted on the weighted vectors: small error only if the cache weights
    // before coding and unweights after.
    EXPECT_LT(rel_mse(seq.keys, out.keys), 1e-3);
    EXPECT_LT(rel_mse(seq.values, out.values), 1e-3);
    auto steps = make_cache("kvtc", layer_config(layer), st);
    for (int64_t t = 0; t < 150; t += 7) {
      const int64_t n = std::min<int64_t>(7, 150 - t);
      steps->append(slice(seq.keys, t, n), slice(seq.values, t, n));
    }
    const KVPair b = steps->fetch(DType::kF32);
    EXPECT_TRUE(bit_equal(out.keys, b.keys));
    EXPECT_TRUE(bit_equal(out.values, b.values));
    EXPECT_EQ(whole->stats().compressed_bytes(), steps->stats().compressed_bytes());
  }
}

TEST(CalibratedCache, LoadsSavesWithoutTheNewestBlockField) {
  // Caches saved before partial blocks existed have a 25-byte state (batch,
  // offset, dtype, blocks) and only full blocks: still loaded. A state that
  // claims more coded tokens than it holds is refused.
  for (const int64_t S : {int64_t(44), int64_t(45)}) {  // 4 sinks + 8 window + 32 or 33 coded
    const Sequence seq = make_sequence(1, S, 1, 17);
    auto cache = make_cache("kvtc", layer_config(1), calibrated(4, 8));
    cache->append(seq.keys.view(), seq.values.view());
    const auto saved = cache->save();
    const ContainerReader r = ContainerReader::parse(saved.data(), saved.size());
    const auto state = r.section("state");
    ASSERT_EQ(state.size(), 33u);
    const auto old = with_section(saved, "state", std::vector<uint8_t>(state.begin(), state.begin() + 25),
                                  ContainerKind::kCache);
    auto loaded = make_cache("kvtc", layer_config(1), calibrated(4, 8));
    if (S == 44) {
      loaded->load(old.data(), old.size());
      EXPECT_TRUE(bit_equal(loaded->fetch(DType::kF32).keys, cache->fetch(DType::kF32).keys));
      EXPECT_EQ(loaded->stats().compressed_bytes(), cache->stats().compressed_bytes());
    } else {
      EXPECT_THROW(loaded->load(old.data(), old.size()), Error);
    }
  }
}

TEST(CalibratedCache, Bf16InBf16Out) {
  const Sequence seq = make_sequence(1, 100, 0, 8);
  Tensor kb(DType::kBF16, seq.keys.shape()), vb(DType::kBF16, seq.values.shape());
  convert(seq.keys.data(), DType::kF32, kb.data(), DType::kBF16, size_t(numel(seq.keys.shape())));
  convert(seq.values.data(), DType::kF32, vb.data(), DType::kBF16, size_t(numel(seq.values.shape())));
  auto cache = make_cache("kvtc", layer_config(0), calibrated(4, 8));
  const KVPair out = cache->update_and_fetch(kb.view(), vb.view());
  EXPECT_EQ(out.keys.dtype(), DType::kBF16);
  EXPECT_EQ(out.keys.shape(), kb.shape());
}


// Squared error of token t (all heads) between [B, H, S, D] tensors, batch row b.
double token_error(const Tensor& a, const Tensor& b, int64_t row, int64_t t) {
  const int64_t S = a.shape()[2];
  double e = 0.0;
  for (int64_t h = 0; h < kHeads; ++h)
    for (int64_t d = 0; d < kDim; ++d) {
      const size_t i = size_t(((row * kHeads + h) * S + t) * kDim + d);
      const double diff = double(a.data_as<float>()[i]) - double(b.data_as<float>()[i]);
      e += diff * diff;
    }
  return e;
}

TEST(CalibrationFile, RefinementRoundTripsAndIsAllOrNothing) {
  const KvtcCalibration cal = KvtcCalibration::read_file(refined_calibration_path());
  ASSERT_TRUE(cal.refined());
  ASSERT_EQ(cal.key_refine.size(), size_t(kLayers));
  const std::vector<uint8_t> bytes = cal.serialize();
  const KvtcCalibration again = KvtcCalibration::parse(bytes.data(), bytes.size());
  EXPECT_EQ(again.serialize(), bytes);
  EXPECT_GT(cal.params_bytes(), KvtcCalibration::read_file(calibration_path()).params_bytes() / 2);
  // One layer's refinement section missing: refused, naming it.
  const std::vector<uint8_t> partial = without_section(bytes, "layer.1.value_refine", ContainerKind::kCalibration);
  try {
    KvtcCalibration::parse(partial.data(), partial.size());
    FAIL() << "a calibration with a missing refinement section was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer.1.value_refine"), std::string::npos) << e.what();
  }
}

TEST(CalibratedCache, RefineNeedsRefinementParametersAndCalibratedMode) {
  Settings st = calibrated(4, 8);
  st["refine"] = "16";
  try {
    make_cache("kvtc", layer_config(0), st);
    FAIL() << "refine accepted without refinement parameters";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("refine_ratio"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make_cache("kvtc", layer_config(0), {{"refine", "16"}}), Error);  // local mode
  EXPECT_THROW(make_cache("kvtc", layer_config(0), refined(-1)), Error);
  EXPECT_NO_THROW(make_cache("kvtc", layer_config(0), refined(0)));
}

TEST(CalibratedCache, RefinementSharpensTheNewestCodedTokensOnly) {
  const int64_t S = 200, refine = 40;
  const Sequence seq = make_sequence(2, S, 1, 5151);
  auto plain = make_cache("kvtc", layer_config(1), refined(0));
  auto sharp = make_cache("kvtc", layer_config(1), refined(int(refine)));
  const KVPair a = plain->update_and_fetch(seq.keys.view(), seq.values.view());
  const KVPair b = sharp->update_and_fetch(seq.keys.view(), seq.values.view());
  // 200 = 4 sinks + 188 coded + window 8. Refinement groups of 32 tokens
  // inside blocks of 16 are 16 tokens: the 40 newest coded tokens (148..187)
  // lie in groups 144..191, so coded tokens 144..187 (positions 148..191)
  // are refined, the older ones are the base code exactly.
  const CacheStats st = sharp->stats();
  EXPECT_EQ(st.extras.at("key.refined_tokens"), 44.0);
  EXPECT_GT(st.extras.at("key.refine_bytes"), 0.0);
  EXPECT_EQ(st.compressed_key_bytes, plain->stats().compressed_key_bytes + uint64_t(st.extras.at("key.refine_bytes")));
  EXPECT_EQ(st.compressed_value_bytes,
            plain->stats().compressed_value_bytes + uint64_t(st.extras.at("value.refine_bytes")));
  for (int64_t row = 0; row < 2; ++row) {
    double base_err = 0.0, refined_err = 0.0;
    for (int64_t t = 0; t < S; ++t) {
      const bool in_refined = t >= 148 && t < 192;
      for (const bool is_key : {true, false}) {
        const Tensor& orig = is_key ? seq.keys : seq.values;
        const double ea = token_error(orig, is_key ? a.keys : a.values, row, t);
        const double eb = token_error(orig, is_key ? b.keys : b.values, row, t);
        if (in_refined) {
          base_err += ea;
          refined_err += eb;
        } else {
          EXPECT_EQ(ea, eb) << "row " << row << " token " << t;  // same base code, no refinement
        }
      }
    }
    EXPECT_LT(refined_err, 0.25 * base_err) << "row " << row;
  }
}

// Blocks of 64 hold two refinement groups each; a block's two closed
// groups decode as one rANS pair (finish_decode). Every refined group of
// 32 tokens is sharper than the base code of its tokens, and the tokens
// before the refined ones are the base code exactly.
TEST(CalibratedCache, RefinementGroupsDecodedInPairsSharpenTheirOwnTokens) {
  const int64_t S = 300, refine = 100;
  const Sequence seq = make_sequence(2, S, 1, 5152);
  auto plain = make_cache("kvtc", layer_config(1), refined(0, 8, 64));
  auto sharp = make_cache("kvtc", layer_config(1), refined(int(refine), 8, 64));
  const KVPair a = plain->update_and_fetch(seq.keys.view(), seq.values.view());
  const KVPair b = sharp->update_and_fetch(seq.keys.view(), seq.values.view());
  // 300 = 4 sinks + 288 coded + window 8: blocks [0, 64) ... [256, 288)
  // (open); the groups ending after coded token 188 are kept: [160, 192),
  // [192, 224) and [224, 256) (the whole block [192, 256) a pair), [256, 288).
  EXPECT_EQ(sharp->stats().extras.at("key.refined_tokens"), 128.0);
  for (int64_t row = 0; row < 2; ++row)
    for (int64_t group = 0; group * 32 < 288; ++group) {
      double base_err = 0.0, refined_err = 0.0;
      for (int64_t t = 4 + group * 32; t < 4 + (group + 1) * 32; ++t)
        for (const bool is_key : {true, false}) {
          const Tensor& orig = is_key ? seq.keys : seq.values;
          const double ea = token_error(orig, is_key ? a.keys : a.values, row, t);
          const double eb = token_error(orig, is_key ? b.keys : b.values, row, t);
          if (group < 5) {
            EXPECT_EQ(ea, eb) << "row " << row << " token " << t;
          }
          base_err += ea;
          refined_err += eb;
        }
      if (group >= 5) {
        EXPECT_LT(refined_err, 0.5 * base_err) << "row " << row << " group " << group;
      }
    }
}

TEST(CalibratedCache, RefinedCacheStreamsSavesLoadsAndTrims) {
  const int64_t S = 230;
  const Sequence seq = make_sequence(2, S, 0, 6262);
  auto whole = make_cache("kvtc", layer_config(0), refined(40));
  whole->append(seq.keys.view(), seq.values.view());
  auto steps = make_cache("kvtc", layer_config(0), refined(40));
  steps->append(slice(seq.keys, 0, 21), slice(seq.values, 0, 21));
  for (int64_t t = 21; t < S; ++t) steps->append(slice(seq.keys, t, 1), slice(seq.values, t, 1));
  const SameReads same = expect_steps_and_reload_read_as_whole(*whole, *steps);
  const std::vector<uint8_t>& saved = same.saved;
  const std::unique_ptr<KVCache>& loaded = same.loaded;
  for (size_t i = 0; i < saved.size(); i += 61) {
    std::vector<uint8_t> bad = saved;
    bad[i] ^= 0x41;
    EXPECT_THROW(loaded->load(bad.data(), bad.size()), Error) << i;
  }
  // Appending to the loaded copy continues exactly like the original.
  const Sequence more = make_sequence(2, 40, 0, 7373);
  whole->append(more.keys.view(), more.values.view());
  loaded->append(more.keys.view(), more.values.view());
  EXPECT_TRUE(bit_equal(whole->fetch(DType::kF32).keys, loaded->fetch(DType::kF32).keys));
  EXPECT_EQ(loaded->stats().compressed_bytes(), whole->stats().compressed_bytes());

  // Trimming into coded blocks keeps what is left (the cut block's tokens go
  // back to the raw tail at their refined reconstruction), then appending
  // goes on with refinement for the new tokens.
  const KVPair before = whole->fetch(DType::kF32);
  EXPECT_EQ(whole->trim(60), 60);
  const KVPair cut = whole->fetch(DType::kF32);
  const int64_t S0 = S + 40, S1 = S0 - 60;
  for (int64_t row = 0; row < 2; ++row)
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t t = 0; t < S1; ++t)
        for (int64_t d = 0; d < kDim; ++d)
          EXPECT_NEAR(cut.keys.data_as<float>()[((row * kHeads + h) * S1 + t) * kDim + d],
                      before.keys.data_as<float>()[((row * kHeads + h) * S0 + t) * kDim + d], 2e-2);
  whole->append(slice(more.keys, 0, 30), slice(more.values, 0, 30));
  EXPECT_EQ(whole->offset(), S1 + 30);
  EXPECT_GT(whole->stats().extras.at("key.refined_tokens"), 0.0);
  const std::vector<uint8_t> again = whole->save();
  auto reloaded = load_cache(again.data(), again.size());
  EXPECT_TRUE(bit_equal(whole->fetch(DType::kF32).values, reloaded->fetch(DType::kF32).values));
}

TEST(CalibratedCache, MalformedRefinementSectionsAreRefused) {
  const Sequence seq = make_sequence(1, 230, 1, 8484);
  auto cache = make_cache("kvtc", layer_config(1), refined(40));
  cache->append(seq.keys.view(), seq.values.view());
  const std::vector<uint8_t> saved = cache->save();
  const ContainerReader r = ContainerReader::parse(saved.data(), saved.size());
  const auto section = r.section("key.refine");
  const std::vector<uint8_t> good(section.begin(), section.end());
  auto refused = [&](const std::vector<uint8_t>& replacement, const char* what) {
    const std::vector<uint8_t> bad = with_section(saved, "key.refine", replacement, ContainerKind::kCache);
    auto fresh = make_cache("kvtc", layer_config(1), refined(40));
    EXPECT_THROW(fresh->load(bad.data(), bad.size()), Error) << what;
  };
  refused({}, "empty section");
  refused({0xff, 0xff, 0xff, 0x7f}, "a group count beyond the coded tokens");
  refused(std::vector<uint8_t>(good.begin(), good.end() - 1), "truncated");
  {
    std::vector<uint8_t> extra = good;
    extra.push_back(0);
    refused(extra, "trailing byte");
  }
  {
    // Section = varint count, then per group varint first, varint tokens,
    // payloads: rewrite the first group's header.
    size_t at = 0;
    auto varint = [&]() {
      uint64_t v = 0;
      for (int shift = 0;; shift += 7) {
        const uint8_t b = good.at(at++);
        v |= uint64_t(b & 0x7f) << shift;
        if (!(b & 0x80)) return v;
      }
    };
    const uint64_t count = varint(), first = varint(), tokens = varint();
    const std::vector<uint8_t> rest(good.begin() + int64_t(at), good.end());
    auto header = [&](uint64_t f, uint64_t t) {
      std::vector<uint8_t> out;
      for (uint64_t v : {count, f, t}) {
        while (v >= 0x80) {
          out.push_back(uint8_t(v | 0x80));
          v >>= 7;
        }
        out.push_back(uint8_t(v));
      }
      out.insert(out.end(), rest.begin(), rest.end());
      return out;
    };
    ASSERT_EQ(header(first, tokens), good);  // the parse above is right
    refused(header(first + 1, tokens), "first group moved");
    refused(header(first, 0), "a group of 0 tokens");
    refused(header(first, 33), "a group over 32 tokens");
  }
  {
    // Value refinement missing while keys have it.
    const std::vector<uint8_t> bad = without_section(saved, "value.refine", ContainerKind::kCache);
    auto fresh = make_cache("kvtc", layer_config(1), refined(40));
    EXPECT_THROW(fresh->load(bad.data(), bad.size()), Error);
  }
  // The untouched bytes still load.
  auto fresh = make_cache("kvtc", layer_config(1), refined(40));
  EXPECT_NO_THROW(fresh->load(saved.data(), saved.size()));
}

// Tokens are coded once (DESIGN 3) with whole_blocks=true: fed one at a
// time, a calibrated cache entropy-codes each coded token's components exactly once (the coded-symbol
// counter), holds the tokens of its unfinished block raw, and ends in the
// state of one call with every token: same saved bytes, same reconstruction.
TEST(CalibratedCache, OneTokenAppendsCodeEachTokenOnce) {
  for (const bool refining : {false, true}) {
    const Sequence seq = make_sequence(2, 300, 1, 5151);
    Settings set = refining ? refined(40, 8, 64) : calibrated(4, 8, 64);
    set["whole_blocks"] = "true";
    auto whole = make_cache("kvtc", layer_config(1), set);
    whole->append(seq.keys.view(), seq.values.view());
    auto steps = make_cache("kvtc", layer_config(1), set);
    for (int64_t t = 0; t < 300; ++t) steps->append(slice(seq.keys, t, 1), slice(seq.values, t, 1));
    EXPECT_EQ(steps->save(), whole->save()) << refining;
    EXPECT_TRUE(bit_equal(steps->fetch(DType::kF32).keys, whole->fetch(DType::kF32).keys));
    const CacheStats st = steps->stats();
    // 300 tokens - 4 sinks - 8 window = 288 ready: 4 blocks of 64 coded, 32 wait raw.
    const double V = double(kHeads * kDim);
    EXPECT_EQ(st.extras.at("key.raw_bytes"), 2.0 * (4 + 32 + 8) * V * 2);
    const uint64_t base = uint64_t(4 * 64) * 2 *
                          uint64_t(st.extras.at("key.n_survived.0") + st.extras.at("value.n_survived.0"));
    // Refinement: one-token appends refine each coded token once (and drop
    // the aged groups later); one call refines only the groups it keeps,
    // those ending after the 40 newest coded tokens begin (216): the 64
    // tokens of [192, 256). The same bytes either way (above).
    uint64_t fine = 0;
    if (refining) {
      const KvtcCalibration cal = KvtcCalibration::read_file(refined_calibration_path());
      fine = uint64_t(cal.key_refine[1].n_kept() + cal.value_refine[1].n_kept()) * 2;  // 2 batch rows
    }
    EXPECT_EQ(st.coded_symbols, base + 256 * fine) << refining;
    EXPECT_EQ(whole->stats().coded_symbols, base + 64 * fine) << refining;
    EXPECT_GE(st.resident_bytes, st.compressed_bytes());
  }
}

// The default mode codes tokens as they leave the window (a raw tail of the
// sinks and the window only), and once more when their block is whole; the
// whole-block mode holds the partial block raw until it is whole and codes
// it once. Both end in the state of one call, and at a whole block they agree.
TEST(CalibratedCache, DefaultCodesPartialBlocksWholeBlocksWaits) {
  const Sequence seq = make_sequence(1, 300, 1, 4242);
  const double V = double(kHeads * kDim);
  for (const bool whole_mode : {false, true}) {
    Settings set = calibrated(4, 8, 64);
    if (whole_mode) set["whole_blocks"] = "true";
    auto steps = make_cache("kvtc", layer_config(1), set);
    for (int64_t t = 0; t < 300; ++t) steps->append(slice(seq.keys, t, 1), slice(seq.values, t, 1));
    auto once = make_cache("kvtc", layer_config(1), set);
    once->append(seq.keys.view(), seq.values.view());
    EXPECT_EQ(steps->save(), once->save()) << whole_mode;
    const CacheStats st = steps->stats();
    // 300 - 4 sinks - 8 window = 288 past the window: 4 blocks of 64 + 32.
    EXPECT_EQ(st.extras.at("key.raw_bytes"), 2.0 * (4 + 8 + (whole_mode ? 32 : 0)) * V) << whole_mode;
    const uint64_t once_per_token = uint64_t(st.extras.at("key.n_survived.0") + st.extras.at("value.n_survived.0"));
    // Default: 63 appends and 64 codes at the close per whole block.
    EXPECT_EQ(st.coded_symbols, (whole_mode ? 256 : 4 * 127 + 32) * once_per_token) << whole_mode;
  }
  // 4 + 8 + 256 tokens: every block whole, the two modes hold the same
  // payload and reconstruction (the saved meta names the mode).
  auto a = make_cache("kvtc", layer_config(1), calibrated(4, 8, 64));
  auto b = make_cache("kvtc", layer_config(1), whole(calibrated(4, 8, 64)));
  a->append(slice(seq.keys, 0, 268), slice(seq.values, 0, 268));
  b->append(slice(seq.keys, 0, 268), slice(seq.values, 0, 268));
  EXPECT_EQ(a->stats().compressed_bytes(), b->stats().compressed_bytes());
  EXPECT_TRUE(bit_equal(a->fetch(DType::kF32).keys, b->fetch(DType::kF32).keys));
  EXPECT_TRUE(bit_equal(a->fetch(DType::kF32).values, b->fetch(DType::kF32).values));
}

// The calibration and the RoPE table are held once for every cache using
// them: in CacheStats::shared under one identity each, so summing the
// stats of several layers' caches counts them once, not per layer.
TEST(CalibratedCache, SharedBytesCountOncePerCalibration) {
  const Sequence seq = make_sequence(1, 100, 1, 77);
  CacheStats sum;
  std::vector<std::unique_ptr<KVCache>> caches;
  for (int layer = 0; layer < 2; ++layer) {
    caches.push_back(make_cache("kvtc", layer_config(layer), calibrated(4, 8)));
    caches.back()->append(seq.keys.view(), seq.values.view());
    sum += caches.back()->stats();
  }
  const CacheStats one = caches[0]->stats();
  ASSERT_EQ(one.shared.size(), 2u);  // the calibration, the RoPE table
  EXPECT_GT(one.shared_bytes(), 0u);
  EXPECT_EQ(sum.shared_bytes(), one.shared_bytes());
  EXPECT_EQ(sum.resident_bytes, one.resident_bytes + caches[1]->stats().resident_bytes);
}

// whole_blocks=true: a file whose newest block is partial (blocks grew
// token by token), still loads and reads back exactly; the next tokens
// complete that block into the bytes of a cache that coded it whole.
// Built here: the blocks and raw of a cache with block 12 (one block,
// tokens 4..15) under the state of a block-16 cache holding 24 tokens.
TEST(CalibratedCache, EarlierLayoutPartialBlockLoadsAndCompletes) {
  const Sequence seq = make_sequence(1, 28, 1, 606);
  auto twelve = make_cache("kvtc", layer_config(1), whole(calibrated(4, 8, 12)));
  twelve->append(slice(seq.keys, 0, 24), slice(seq.values, 0, 24));
  auto sixteen = make_cache("kvtc", layer_config(1), whole(calibrated(4, 8, 16)));
  sixteen->append(slice(seq.keys, 0, 24), slice(seq.values, 0, 24));  // nothing coded yet
  const std::vector<uint8_t> a = twelve->save(), b = sixteen->save();
  const ContainerReader ra = ContainerReader::parse(a.data(), a.size());
  std::vector<uint8_t> old = b;
  for (const char* name : {"key.blocks", "value.blocks", "key.raw", "value.raw"}) {
    const auto sec = ra.section(name);
    old = with_section(old, name, std::vector<uint8_t>(sec.begin(), sec.end()), ContainerKind::kCache);
  }
  ByteWriter state;
  state.u64(1);   // batch
  state.u64(24);  // offset
  state.u8(uint8_t(DType::kF32 == seq.keys.dtype() ? DType::kF16 : DType::kBF16));
  state.u64(1);   // blocks
  state.u64(12);  // tokens of the newest (partial) block
  old = with_section(old, "state", state.take(), ContainerKind::kCache);
  // Layout 1: the partial block in the codec's bytes (a block-12 cache's whole block).
  old = testing_reseal::edit_container(old, [](testing_reseal::Meta& meta, testing_reseal::Sections&) {
    meta["layout"] = "1";
  });
  auto loaded = make_cache("kvtc", layer_config(1), whole(calibrated(4, 8, 16)));
  loaded->load(old.data(), old.size());
  EXPECT_TRUE(bit_equal(loaded->fetch(DType::kF32).keys, twelve->fetch(DType::kF32).keys));
  EXPECT_TRUE(bit_equal(loaded->fetch(DType::kF32).values, twelve->fetch(DType::kF32).values));
  // Four more tokens: 28 - 4 sinks - 8 window = 16 ready, the block is full.
  loaded->append(slice(seq.keys, 24, 4), slice(seq.values, 24, 4));
  sixteen->append(slice(seq.keys, 24, 4), slice(seq.values, 24, 4));
  EXPECT_EQ(loaded->save(), sixteen->save());
}

// Past the checksums (format/reseal.hpp): every flipped byte of a refined,
// batch-2 cache, sealed again, is refused or loads a cache whose reads work;
// a refused load leaves the target cache as it was. KVCODEC_MUTANTS random
// sealed mutants more (default 200; the campaign in docs/format.md runs
// 100,000 under ASan).
TEST(CalibratedCache, SealedCorruptionsFailCleanlyAndLeaveTheCache) {
  const Sequence seq = make_sequence(2, 70, 1, 31);
  auto whole = make_cache("kvtc", layer_config(1), refined(24));
  whole->append(seq.keys.view(), seq.values.view());
  const std::vector<uint8_t> saved = whole->save();
  auto target = make_cache("kvtc", layer_config(1), refined(24));
  const Sequence other = make_sequence(1, 30, 1, 32);
  target->append(other.keys.view(), other.values.view());
  const std::vector<uint8_t> before = target->save();
  size_t refused = 0, loaded = 0;
  auto attempt = [&](const std::vector<uint8_t>& bad) {
    try {
      target->load(bad.data(), bad.size());
    } catch (const Error&) {
      ++refused;
      EXPECT_EQ(target->save(), before);
      return;
    }
    ++loaded;
    EXPECT_NO_THROW(target->fetch(DType::kF32));
    target->load(before.data(), before.size());
  };
  for (size_t i = 0; i < saved.size(); i += 3) {
    std::vector<uint8_t> bad = saved;
    bad[i] ^= 0x41;
    if (testing_reseal::reseal(bad)) attempt(bad);
  }
  const char* env = std::getenv("KVCODEC_MUTANTS");
  const long n = env ? std::atol(env) : 200;
  std::mt19937_64 rng(testing_reseal::mutant_seed(5));
  for (long i = 0; i < n; ++i) attempt(testing_reseal::sealed_mutant(saved, rng));
  std::printf("calibrated (refine) sealed corruptions: %zu refused, %zu loaded\n", refused, loaded);
  {  // files for the kvcodec decompress campaign (layer 0: the dump's only layer)
    CacheConfig layer0 = layer_config(0);
    layer0.n_layers = kLayers;
    auto c0 = make_cache("kvtc", layer0, refined(24));
    const Sequence seq0 = make_sequence(1, 70, 0, 34);
    c0->append(seq0.keys.view(), seq0.values.view());
    testing_reseal::write_dump_mutants(*c0, "kvtc_calibrated", 98);
  }
  EXPECT_GT(refused, loaded / 4);
}

TEST(CalibratedCache, HugeOffsetIsRefusedBeforeAnythingIsSizedByIt) {
  const Sequence seq = make_sequence(1, 40, 1, 33);
  auto cache = make_cache("kvtc", layer_config(1), calibrated(4, 8));
  cache->append(seq.keys.view(), seq.values.view());
  const auto saved = cache->save();
  const auto t0 = std::chrono::steady_clock::now();
  for (const uint64_t offset : {uint64_t(1) << 30, uint64_t(1) << 40, ~uint64_t(0)}) {
    const auto bad = testing_reseal::edit_section(saved, "state", [&](std::vector<uint8_t>& p) {
      for (int b = 0; b < 8; ++b) p[size_t(8 + b)] = uint8_t(offset >> (8 * b));
    });
    auto fresh = make_cache("kvtc", layer_config(1), calibrated(4, 8));
    EXPECT_THROW(fresh->load(bad.data(), bad.size()), Error) << offset;
  }
  // A RoPE table for 2^30 positions would take seconds and gigabytes.
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  // Another block size places tokens elsewhere: a configuration error.
  auto other = make_cache("kvtc", layer_config(1), calibrated(4, 8, 32));
  try {
    other->load(saved.data(), saved.size());
    ADD_FAILURE() << "loaded a cache saved with block 16 into one of block 32";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kConfig) << e.what();
  }
}

// Both kvtc modes take f32, f16 and bf16 keys and values with any strides:
// a view whose last dimension is strided (every other element of a wider
// tensor) and, in calibrated mode, one split into pieces save the bytes of the contiguous
// tensor appended at once (the rows go through the SIMD conversion, a
// copy, or the strided gather: head_rows_to_raw).
TEST(KvtcAppendRows, StridedAndConvertedInputsSaveTheContiguousBytes) {
  const Sequence seq = make_sequence(2, 200, 1, 6161);
  for (const bool calibrated_mode : {true, false}) {
    const Settings set = calibrated_mode ? refined(40, 8, 64) : Settings{};
    for (const DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      const Tensor k = Tensor::from_view(seq.keys.view(), dtype), v = Tensor::from_view(seq.values.view(), dtype);
      auto plain = make_cache("kvtc", layer_config(1), set);
      plain->append(k.view(), v.view());
      const auto bytes = plain->save();
      // The same values at every other element of [B, H, S, 2D].
      const auto widen = [&](const Tensor& t) {
        const auto& sh = t.shape();
        Tensor w(dtype, {sh[0], sh[1], sh[2], 2 * sh[3]});
        const size_t e = dtype_size(dtype);
        for (int64_t i = 0; i < numel(sh); ++i)
          std::memcpy(static_cast<uint8_t*>(w.data()) + size_t(2 * i) * e,
                      static_cast<const uint8_t*>(t.data()) + size_t(i) * e, e);
        return w;
      };
      const Tensor wk = widen(k), wv = widen(v);
      const auto narrow = [&](const Tensor& w, int64_t first, int64_t n) {
        TensorView view = w.view();
        view.shape[3] /= 2;
        view.strides[3] = 2;
        view.data = static_cast<const uint8_t*>(view.data) + first * view.strides[2] * int64_t(dtype_size(dtype));
        view.shape[2] = n;
        return view;
      };
      auto strided = make_cache("kvtc", layer_config(1), set);
      strided->append(narrow(wk, 0, 200), narrow(wv, 0, 200));
      EXPECT_EQ(strided->save(), bytes) << calibrated_mode << " " << dtype_name(dtype);
      // Pieces: the calibrated mode only (local kvtc fits on what its first
      // append past min_fit_tokens holds, so its bytes depend on the split).
      if (!calibrated_mode) continue;
      auto pieces = make_cache("kvtc", layer_config(1), set);
      for (const auto& [first, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 7}, {7, 90}, {97, 103}})
        pieces->append(slice(k, first, n), slice(v, first, n));
      EXPECT_EQ(pieces->save(), bytes) << calibrated_mode << " " << dtype_name(dtype);
    }
  }
}

}  // namespace
}  // namespace kvcodec

// Streaming cross-layer KVTC (cache/kvtc_crosslayer_stream.hpp): the
// per-layer caches of one sequence sharing one coder, against the stored
// prefix's codes of the same blocks (kvtc_crosslayer.hpp, itself checked
// against a per-token reconstruction in test_crosslayer.cpp).
#include <gtest/gtest.h>

#include <cstring>

#include "cache/kvtc_crosslayer.hpp"
#include "cache/kvtc_crosslayer_stream.hpp"
#include "cache/saved_meta.hpp"
#include "kvcodec/error.hpp"
#include "model/crosslayer_fixtures.hpp"

namespace kvcodec::model {
namespace {

using namespace testing;  // crosslayer_fixtures.hpp

std::shared_ptr<const KvtcCalibration> calibration() {
  static const auto cal = std::make_shared<const KvtcCalibration>(
      fit_cross_layer_calibrations(config(), "h", samples(2048), options(), {6.0})[0]);
  return cal;
}

CacheConfig cache_config() {
  CacheConfig c;
  c.n_layers = kL;
  c.n_kv_heads = kH;
  c.head_dim = kD;
  c.rope_theta = 10000.0;
  return c;
}

// The prefix with every value rounded to f16 (what the cache's raw rows hold).
std::vector<KVPair> f16_prefix(int64_t S, uint32_t seed) {
  std::vector<KVPair> p = prefix_of(S, seed);
  for (KVPair& kv : p) {
    kv.keys = kv.keys.to(DType::kF16).to(DType::kF32);
    kv.values = kv.values.to(DType::kF16).to(DType::kF32);
  }
  return p;
}

// Appends tokens [t0, t0 + n) of `p` to every layer's cache, layer 0 first (as a forward pass does).
void feed(std::vector<std::unique_ptr<KVCache>>& caches, const std::vector<KVPair>& p, int64_t t0, int64_t n) {
  for (int l = 0; l < kL; ++l)
    caches[size_t(l)]->append(p[size_t(l)].keys.view().slice_tokens(t0, n),
                              p[size_t(l)].values.view().slice_tokens(t0, n));
}

CrossLayerStreamOptions opts(bool scratch) {
  CrossLayerStreamOptions o;
  o.sinks = 4;
  o.window = 8;
  o.block = 16;
  o.decoded_scratch = scratch;
  return o;
}

TEST(CrossLayerStream, CodedTokensEqualTheStoredPrefixCodesAndTheWindowStaysRaw) {
  // Blocks of 16 from token 4, each coded once 8 newer tokens follow it: 8
  // blocks (4..131); 132..149 raw (the window and 10 waiting).
  const int64_t S = 150;
  const std::vector<KVPair> p = f16_prefix(S, 7);
  for (const bool scratch : {true, false}) {
    auto caches = make_cross_layer_stream_caches(calibration(), cache_config(), opts(scratch));
    for (int64_t t = 0; t < S;) {  // chunks of 1, 7, 40, 1, 7, 40, ...
      const int64_t n = std::min<int64_t>(S - t, t % 3 == 0 ? 1 : t % 3 == 1 ? 7 : 40);
      feed(caches, p, t, n);
      t += n;
    }
    const int64_t coded_end = 132;
    const CrossLayerPrefixBytes stored = store_prefix_cross_layer(*calibration(), p, 4, 16);
    const std::vector<KVPair> want = restore_prefix_cross_layer(*calibration(), stored);
    for (int l = 0; l < kL; ++l) {
      ASSERT_EQ(caches[size_t(l)]->offset(), S);
      const KVPair got = caches[size_t(l)]->fetch(DType::kF32);
      for (const bool is_key : {true, false}) {
        const float* g = (is_key ? got.keys : got.values).data_as<float>();
        const float* w = (is_key ? want[size_t(l)].keys : want[size_t(l)].values).data_as<float>();
        const float* raw = (is_key ? p[size_t(l)].keys : p[size_t(l)].values).data_as<float>();
        for (int h = 0; h < kH; ++h)
          for (int64_t t = 0; t < S; ++t)
            for (int d = 0; d < kD; ++d) {
              const int64_t i = (h * S + t) * kD + d;
              // Sinks and the tail raw (f16 inputs: exact); coded tokens the stored prefix's codes, bit for bit.
              ASSERT_EQ(g[i], t < 4 || t >= coded_end ? raw[i] : w[i]) << "l " << l << " t " << t << " k " << is_key;
            }
      }
    }
    EXPECT_EQ(caches[0]->stats().extras.at("coded_tokens"), double(coded_end - 4));
  }
}

TEST(CrossLayerStream, StatsCountEveryStoredByteAndScratchApart) {
  const int64_t S = 150, coded_end = 132;
  const std::vector<KVPair> p = f16_prefix(S, 11);
  auto caches = make_cross_layer_stream_caches(calibration(), cache_config(), opts(true));
  feed(caches, p, 0, S);
  CacheStats total;
  for (const auto& c : caches) total += c->stats();
  // The same blocks as a stored prefix of the coded tokens: its streams less
  // their header (3 varints) are the sinks and every block's size and payload.
  std::vector<KVPair> coded;
  for (const KVPair& kv : p)
    coded.push_back({Tensor::from_view(kv.keys.view().slice_tokens(0, coded_end)),
                     Tensor::from_view(kv.values.view().slice_tokens(0, coded_end))});
  const CrossLayerPrefixBytes b = store_prefix_cross_layer(*calibration(), coded, 4, 16);
  const uint64_t header = cache_impl::varint_size(coded_end) + 2;
  const uint64_t tail = uint64_t(kL) * uint64_t(S - coded_end) * kV * 2;
  EXPECT_EQ(total.compressed_key_bytes, b.keys.size() - header + tail);
  EXPECT_EQ(total.compressed_value_bytes, b.values.size() - header + tail);
  EXPECT_EQ(total.fp16_bytes(), uint64_t(2 * kL * S * kV * 2));
  EXPECT_EQ(total.tokens, kL * S);
  // The decoded scratch (f32 of every coded value) is held, so counted as resident, never as stored.
  const double scratch = total.extras.at("scratch_bytes");
  EXPECT_GE(scratch, double(2 * kL * (coded_end - 4) * kV * 4));
  EXPECT_GE(double(total.resident_bytes), scratch + double(total.compressed_bytes()));
  EXPECT_EQ(total.shared.size(), 1u);  // the calibration, once for all layers
  EXPECT_EQ(total.shared.begin()->second, calibration()->held_bytes());
}

TEST(CrossLayerStream, ScratchAndPerReadDecodingAgreeAndTheWorkIsAsStated) {
  const int64_t S = 120;
  const std::vector<KVPair> p = f16_prefix(S, 5);
  auto with = make_cross_layer_stream_caches(calibration(), cache_config(), opts(true));
  auto without = make_cross_layer_stream_caches(calibration(), cache_config(), opts(false));
  const uint64_t raw_bound = uint64_t(4 + 8 + 16 - 1) * kV * 2;  // sinks + window + block - 1 tokens
  for (int64_t t = 0; t < S; ++t) {  // one token per step, as decoding
    feed(with, p, t, 1);
    feed(without, p, t, 1);
    for (int l = 0; l < kL; ++l) {
      const KVPair a = with[size_t(l)]->fetch(DType::kF32), b = without[size_t(l)]->fetch(DType::kF32);
      ASSERT_EQ(0, std::memcmp(a.keys.data(), b.keys.data(), a.keys.nbytes())) << "t " << t << " l " << l;
      ASSERT_EQ(0, std::memcmp(a.values.data(), b.values.data(), a.values.nbytes()));
      // O(1) state per appended token: the raw part stays bounded.
      ASSERT_LE(with[size_t(l)]->stats().extras.at("key.raw_bytes"), double(raw_bound));
    }
  }
  // With scratch each coded token is decoded once (when coded); without it
  // every read of a layer decodes all coded tokens (every layer of them).
  const CacheStats sw = with[0]->stats(), so = without[0]->stats();
  const double coded = sw.extras.at("coded_tokens");
  EXPECT_EQ(coded, 6.0 * 16);  // 4 + 96 + 8 + 16 > 120: the 7th block waits
  EXPECT_EQ(sw.extras.at("decoded_token_vectors"), coded);
  const double before = so.extras.at("decoded_token_vectors");
  (void)without[1]->fetch(DType::kF32);
  EXPECT_EQ(without[0]->stats().extras.at("decoded_token_vectors"), before + coded);
  EXPECT_EQ(sw.compressed_bytes(), so.compressed_bytes());
}

// A higher-rate calibration for the recent tier.
std::shared_ptr<const KvtcCalibration> recent_calibration() {
  static const auto cal = std::make_shared<const KvtcCalibration>(
      fit_cross_layer_calibrations(config(), "h", samples(2048), options(), {3.0})[0]);
  return cal;
}

TEST(CrossLayerStream, RecentTierCodesNewBlocksFinerAndRecodesThemFromTheirReconstructionOnce) {
  // sinks 4, window 8, blocks of 16: 8 blocks (4..131) coded at 150 tokens.
  // recent 32: a block leaves the tier once 32 coded tokens follow it, so
  // blocks 4..99 are re-coded with the base calibration and 100..131 stay.
  const int64_t S = 150, coded_end = 132, recent_from = 100;
  const std::vector<KVPair> p = f16_prefix(S, 13);
  // Plain reference from whole-prefix stores: the recent tier's reconstruction
  // of every block, then the base code of that reconstruction.
  std::vector<KVPair> coded;
  for (const KVPair& kv : p)
    coded.push_back({Tensor::from_view(kv.keys.view().slice_tokens(0, coded_end)),
                     Tensor::from_view(kv.values.view().slice_tokens(0, coded_end))});
  const std::vector<KVPair> fine =
      restore_prefix_cross_layer(*recent_calibration(), store_prefix_cross_layer(*recent_calibration(), coded, 4, 16));
  const CrossLayerPrefixBytes recoded_bytes = store_prefix_cross_layer(*calibration(), fine, 4, 16);
  const std::vector<KVPair> recoded = restore_prefix_cross_layer(*calibration(), recoded_bytes);
  uint64_t stored[2] = {0, 0};
  for (const bool scratch : {true, false}) {
    CrossLayerStreamOptions o = opts(scratch);
    o.recent = 32;
    o.recent_calibration = recent_calibration();
    auto caches = make_cross_layer_stream_caches(calibration(), cache_config(), o);
    for (int64_t t = 0; t < S;) {  // one token per step after a prefill of 60
      const int64_t n = t == 0 ? 60 : 1;
      feed(caches, p, t, n);
      t += n;
    }
    for (int l = 0; l < kL; ++l) {
      const KVPair got = caches[size_t(l)]->fetch(DType::kF32);
      for (const bool is_key : {true, false}) {
        const float* g = (is_key ? got.keys : got.values).data_as<float>();
        const float* raw = (is_key ? p[size_t(l)].keys : p[size_t(l)].values).data_as<float>();
        const float* f = (is_key ? fine[size_t(l)].keys : fine[size_t(l)].values).data_as<float>();
        const float* r = (is_key ? recoded[size_t(l)].keys : recoded[size_t(l)].values).data_as<float>();
        for (int h = 0; h < kH; ++h)
          for (int64_t t = 0; t < S; ++t)
            for (int d = 0; d < kD; ++d) {
              const int64_t i = (h * S + t) * kD + d, j = (h * coded_end + t) * kD + d;
              const float want = t < 4 || t >= coded_end ? raw[i] : t >= recent_from ? f[j] : r[j];
              ASSERT_EQ(g[i], want) << "l " << l << " t " << t << " k " << is_key << " scratch " << scratch;
            }
      }
    }
    const CacheStats s0 = caches[0]->stats();
    EXPECT_EQ(s0.extras.at("recoded_tokens"), double(recent_from - 4));
    EXPECT_EQ(s0.extras.at("recent_tokens"), double(coded_end - recent_from));
    CacheStats total;
    for (const auto& c : caches) total += c->stats();
    EXPECT_EQ(total.shared.size(), 2u);  // both calibrations, apart
    stored[scratch] = total.compressed_bytes();
  }
  EXPECT_EQ(stored[0], stored[1]);
  // Every byte of both tiers: more than the base code alone of the same
  // blocks, since the newest two blocks hold the finer code.
  const uint64_t base_only = recoded_bytes.keys.size() + recoded_bytes.values.size();
  EXPECT_GT(stored[1], base_only);
  // Refused: a tier without its calibration, a calibration without a tier.
  CrossLayerStreamOptions bad = opts(true);
  bad.recent = 16;
  EXPECT_THROW(make_cross_layer_stream_caches(calibration(), cache_config(), bad), Error);
  bad.recent = 0;
  bad.recent_calibration = recent_calibration();
  EXPECT_THROW(make_cross_layer_stream_caches(calibration(), cache_config(), bad), Error);
}

TEST(CrossLayerStream, RefusesWhatItCannotDoWithClearErrors) {
  auto code_of = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::kInternal;  // nothing thrown
  };
  auto caches = make_cross_layer_stream_caches(calibration(), cache_config(), opts(true));
  const std::vector<KVPair> p = f16_prefix(40, 3);
  feed(caches, p, 0, 40);
  KVCache& c = *caches[1];
  EXPECT_FALSE(c.is_trimmable());
  EXPECT_EQ(c.trim(0), 0);
  EXPECT_EQ(code_of([&] { c.trim(1); }), ErrorCode::kUnsupported);
  EXPECT_EQ(code_of([&] { (void)c.save(); }), ErrorCode::kUnsupported);
  EXPECT_EQ(code_of([&] { c.load(nullptr, 0); }), ErrorCode::kUnsupported);
  EXPECT_EQ(c.offset(), 40);  // nothing changed
  const Tensor two(DType::kF32, {2, kH, 1, kD}), heads(DType::kF32, {1, kH + 1, 1, kD});
  EXPECT_EQ(code_of([&] { c.append(two.view(), two.view()); }), ErrorCode::kUnsupported);
  EXPECT_EQ(code_of([&] { c.append(heads.view(), heads.view()); }), ErrorCode::kShapeMismatch);
  const Tensor one(DType::kF32, {1, kH, 1, kD});
  EXPECT_EQ(code_of([&] { c.append(one.view(), two.view()); }), ErrorCode::kShapeMismatch);
  // A per-layer calibration, another model's shape, bad options.
  KvtcCalibration per_layer = *calibration();
  per_layer.info.erase("cross_layers");
  auto pl = std::make_shared<const KvtcCalibration>(per_layer);
  EXPECT_EQ(code_of([&] { make_cross_layer_stream_caches(pl, cache_config(), opts(true)); }),
            ErrorCode::kShapeMismatch);
  CacheConfig other = cache_config();
  other.n_layers = kL + 1;
  EXPECT_EQ(code_of([&] { make_cross_layer_stream_caches(calibration(), other, opts(true)); }),
            ErrorCode::kShapeMismatch);
  CrossLayerStreamOptions bad = opts(true);
  bad.block = 0;
  EXPECT_EQ(code_of([&] { make_cross_layer_stream_caches(calibration(), cache_config(), bad); }), ErrorCode::kConfig);
  // The factory hands out one sequence's layers in order.
  auto factory = cross_layer_stream_factory(calibration(), opts(true));
  CacheConfig cc = cache_config();
  cc.layer = 1;
  EXPECT_EQ(code_of([&] { factory(cc); }), ErrorCode::kInvalidArgument);
  for (int l = 0; l < kL; ++l) {
    cc.layer = l;
    EXPECT_EQ(factory(cc)->config().layer, l);
  }
}

}  // namespace
}  // namespace kvcodec::model

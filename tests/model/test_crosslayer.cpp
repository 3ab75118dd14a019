// Cross-layer KVTC of stored prefixes (cache/kvtc_crosslayer.hpp) fitted by
// model::fit_cross_layer_calibrations on synthetic samples whose layers share
// a latent, against a plain per-token reconstruction.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "cache/kvtc_crosslayer.hpp"
#include "kvcodec/error.hpp"
#include "kvtc/codec.hpp"
#include "model/calibrate.hpp"
#include "model/eval_prefix.hpp"
#include "model/crosslayer_fixtures.hpp"

namespace kvcodec::model {
namespace {

using namespace testing;  // crosslayer_fixtures.hpp

TEST(CrossLayer, FitsOneCodecPerTensorOverAllLayersAndRoundTripsTheFile) {
  const auto cals = fit_cross_layer_calibrations(config(), "h", samples(2048), options(), {4.0, 8.0});
  ASSERT_EQ(cals.size(), 2u);
  for (const KvtcCalibration& c : cals) {
    EXPECT_EQ(cross_layer_count(c), kL);
    EXPECT_EQ(c.vector_dim(), kL * kV);
    ASSERT_EQ(c.keys.size(), 1u);
    EXPECT_EQ(c.keys[0].dim, kL * kV);
    const auto bytes = c.serialize();
    const KvtcCalibration back = KvtcCalibration::parse(bytes.data(), bytes.size());
    EXPECT_EQ(cross_layer_count(back), kL);
    EXPECT_EQ(back.key_scale, c.key_scale);
    check_cross_layer_calibration(back, kL, kH, kD, 10000.0, "test");
    EXPECT_THROW(check_cross_layer_calibration(back, kL + 1, kH, kD, 10000.0, "test"), Error);
  }
  // Each fit meets its payload target on the samples.
  EXPECT_GE(std::stod(cals[0].info.at("key_payload_ratio")), 4.0);
  EXPECT_GE(std::stod(cals[1].info.at("value_payload_ratio")), 8.0);
  // Unit RMS per layer: layer 2's data is 7x layer 0's, so its scale is ~1/7 of it.
  const float r = cals[0].key_scale[0][2 * kV] / cals[0].key_scale[0][0];
  EXPECT_GT(r, 0.05f);
  EXPECT_LT(r, 0.3f);
}

TEST(CrossLayer, StoredPrefixMatchesAPlainReconstructionAndCountsEveryByte) {
  const KvtcCalibration cal = fit_cross_layer_calibrations(config(), "h", samples(2048), options(), {6.0})[0];
  const int64_t S = 150;  // sinks 4, blocks of 64: 64 + 64 + 18
  const std::vector<KVPair> prefix = prefix_of(S, 7);
  const CrossLayerPrefixBytes bytes = store_prefix_cross_layer(cal, prefix, 4);
  const std::vector<KVPair> back = restore_prefix_cross_layer(cal, bytes);
  ASSERT_EQ(back.size(), size_t(kL));
  // Plain reference: per token, gather the layers, remove RoPE, scale,
  // quantize and reconstruct it alone (the codec's kernels are tested against
  // their reference loops in tests/kvtc), unscale, RoPE.
  const std::vector<double> inv = rope_inv_freq(kD, 10000.0);
  double err = 0, energy = 0;
  for (const bool is_key : {true, false}) {
    const kvtc::HeadParams& p = is_key ? cal.keys[0] : cal.values[0];
    const std::vector<float>& scale = is_key ? cal.key_scale[0] : cal.value_scale[0];
    for (int64_t t = 0; t < S; ++t) {
      std::vector<float> x(size_t(kL * kV)), rec(x.size());
      for (int l = 0; l < kL; ++l) {
        const Tensor& src = is_key ? prefix[size_t(l)].keys : prefix[size_t(l)].values;
        for (int h = 0; h < kH; ++h)
          for (int d = 0; d < kD; ++d) x[size_t(l * kV + h * kD + d)] = src.data_as<float>()[(h * S + t) * kD + d];
        if (is_key) rope_rotate_tokens(x.data() + l * kV, 1, kH, kD, t, inv, true);
      }
      if (t >= 4) {
        for (size_t i = 0; i < x.size(); ++i) x[i] *= scale[i];
        std::vector<uint16_t> codes(size_t(p.n_kept()));
        kvtc::quantize_block(p, x.data(), 1, codes.data());
        kvtc::dequantize_block(p, codes.data(), 1, rec.data());
        for (size_t i = 0; i < x.size(); ++i) rec[i] /= scale[i];
        for (int l = 0; l < kL; ++l)
          if (is_key) rope_rotate_tokens(rec.data() + l * kV, 1, kH, kD, t, inv, false);
      }
      for (int l = 0; l < kL; ++l) {
        const Tensor& src = is_key ? prefix[size_t(l)].keys : prefix[size_t(l)].values;
        const Tensor& got = is_key ? back[size_t(l)].keys : back[size_t(l)].values;
        for (int h = 0; h < kH; ++h)
          for (int d = 0; d < kD; ++d) {
            const float orig = src.data_as<float>()[(h * S + t) * kD + d];
            const float g = got.data_as<float>()[(h * S + t) * kD + d];
            if (t < 4) {
              EXPECT_EQ(g, f16_to_f32(f32_to_f16(orig)));  // sinks raw (f16)
              continue;
            }
            const float want = rec[size_t(l * kV + h * kD + d)];
            ASSERT_NEAR(g, want, 1e-5f * (1.0f + std::abs(want))) << "t " << t << " l " << l;
            err += std::pow(double(g) - orig, 2);
            energy += double(orig) * orig;
          }
      }
    }
  }
  EXPECT_LT(err / energy, 0.05);  // the shared latent is captured
  // Every byte is in the two streams, and the store reports exactly those.
  const PrefixCoder coder = cross_layer_prefix_coder(std::make_shared<const KvtcCalibration>(cal), 4);
  ModelConfig c = config();
  const StoredPrefix sp = coder(c, prefix);
  EXPECT_EQ(sp.stats.compressed_key_bytes, bytes.keys.size());
  EXPECT_EQ(sp.stats.compressed_value_bytes, bytes.values.size());
  EXPECT_EQ(sp.stats.fp16_bytes(), uint64_t(2 * kL * kV * S * 2));
  // Sinks alone: 4 tokens x L x H x D x 2 bytes per tensor.
  EXPECT_GT(bytes.keys.size(), size_t(4 * kL * kV * 2));
  EXPECT_EQ(sp.restored[1].values.shape(), back[1].values.shape());
}

TEST(CrossLayer, RefusesWrongShapesAndMalformedBytes) {
  const KvtcCalibration cal = fit_cross_layer_calibrations(config(), "h", samples(512), options(), {4.0})[0];
  std::vector<KVPair> prefix = prefix_of(70, 3);
  CrossLayerPrefixBytes bytes = store_prefix_cross_layer(cal, prefix, 4);
  // Truncated / trailing bytes: Error(kFormat), never a crash.
  CrossLayerPrefixBytes cut = bytes;
  cut.keys.resize(cut.keys.size() - 3);
  EXPECT_THROW(restore_prefix_cross_layer(cal, cut), Error);
  CrossLayerPrefixBytes longer = bytes;
  longer.values.push_back(0);
  EXPECT_THROW(restore_prefix_cross_layer(cal, longer), Error);
  // A per-layer calibration is not a cross-layer one.
  KvtcCalibration per_layer = cal;
  per_layer.info.erase("cross_layers");
  EXPECT_THROW(store_prefix_cross_layer(per_layer, prefix, 4), Error);
  prefix.pop_back();
  try {
    store_prefix_cross_layer(cal, prefix, 4);
    ADD_FAILURE() << "2 layers accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kShapeMismatch);
  }
}

}  // namespace
}  // namespace kvcodec::model

// KL sensitivities measured with the stream window in place (issue 21,
// CalibrateOptions::sensitivity_window): the reconstructing cache codes a
// token only once it has left the raw window, block by block, and a window
// that covers the whole calibration window leaves nothing coded.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kvcodec/tensor.hpp"
#include "model/calibrate.hpp"
#include "model/model_fixtures.hpp"

namespace kvcodec::model {
namespace {

using namespace testing;  // model_fixtures.hpp

class StreamSensitivity : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = tiny_config(4, 2);
    config_.n_layers = 2;
    model_ = std::make_unique<LlamaModel>(tiny_model(config_));
    options_.first_window = 0;
    options_.windows = 2;
    options_.window_length = 96;
    options_.sinks = 2;
    options_.measured_allocation = true;
    options_.attention_weighting = true;
    options_.target_ratio = 3.0;
    samples_ = collect_calibration_samples(*model_, random_tokens(2 * 96, config_.vocab_size, 11), options_);
    cal_ = fit_calibration(config_, "", samples_, options_, {}, model_.get());
  }
  CacheConfig cache_config(int layer) const { return layer_cache_config(config_, layer); }
  ModelConfig config_;
  std::unique_ptr<LlamaModel> model_;
  CalibrateOptions options_;
  CalibrationSamples samples_;
  KvtcCalibration cal_;
};

// The cache's keys and values as f32 [H, T, D] (one block visit per call).
void held(const KVCache& c, std::vector<float>& k, std::vector<float>& v) {
  k.clear(), v.clear();
  c.for_each_block([&](int64_t, const TensorView& bk, const TensorView& bv) {
    k.resize(size_t(numel(bk.shape))), v.resize(size_t(numel(bv.shape)));
    copy_to_contiguous(bk, k.data(), DType::kF32);
    copy_to_contiguous(bv, v.data(), DType::kF32);
  });
}

TEST_F(StreamSensitivity, CodesATokenOnlyOnceItHasLeftTheWindow) {
  const int H = config_.n_kv_heads, D = config_.head_dim, sinks = 2, window = 6, block = 4;
  const int64_t T = 41;
  std::vector<float> keys(size_t(H * T * D)), values(keys.size());
  uint32_t r = 3;
  for (float& x : keys) x = float((r = r * 1664525u + 1013904223u) >> 8) / float(1 << 24) - 0.5f;
  for (float& x : values) x = float((r = r * 1664525u + 1013904223u) >> 8) / float(1 << 24) - 0.5f;
  const auto view = [&](const std::vector<float>& x, int64_t a, int64_t n, std::vector<float>& buf) {
    buf.resize(size_t(H * n * D));
    for (int h = 0; h < H; ++h)
      std::copy_n(x.data() + (h * T + a) * D, n * D, buf.data() + h * n * D);
    return TensorView::contiguous(buf.data(), DType::kF32, {1, H, n, D});
  };
  const int layer = 1;
  for (const bool is_key : {true, false}) {
    const kvtc::HeadParams& p = (is_key ? cal_.keys : cal_.values)[layer];
    const std::vector<float>* scale = &(is_key ? cal_.key_scale : cal_.value_scale)[layer];
    // Everything coded at once: the reconstruction of every non-sink token.
    auto whole = make_reconstructing_cache(cache_config(layer), p, scale, is_key, sinks);
    std::vector<float> kb, vb, ck, cv, raw_k, raw_v;
    whole->append(view(keys, 0, T, kb), view(values, 0, T, vb));
    held(*whole, ck, cv);
    auto plain = make_cache("fp16", cache_config(layer));
    plain->append(view(keys, 0, T, kb), view(values, 0, T, vb));
    held(*plain, raw_k, raw_v);
    const std::vector<float>& coded = is_key ? ck : cv;
    const std::vector<float>& raw = is_key ? raw_k : raw_v;
    ASSERT_NE(coded, raw);  // the coding changes the tensor
    // Appended in chunks of 5 (as the sensitivity runs go, in blocks).
    auto stream = make_reconstructing_cache(cache_config(layer), p, scale, is_key, sinks, window, block);
    int64_t o = 0;
    for (const int64_t n : {5, 5, 1, 5, 7, 5, 5, 8}) {
      const int64_t reach = o + 1 - window - sinks;
      const int64_t boundary = std::min<int64_t>(o, sinks + (reach > 0 ? reach / block * block : 0));
      stream->append(view(keys, o, n, kb), view(values, o, n, vb));
      o += n;
      std::vector<float> sk, sv;
      held(*stream, sk, sv);
      ASSERT_EQ(sk.size(), size_t(H * o * D));
      const std::vector<float>& tested = is_key ? sk : sv;
      const std::vector<float>& other = is_key ? sv : sk;
      const std::vector<float>& other_raw = is_key ? raw_v : raw_k;
      for (int h = 0; h < H; ++h)
        for (int64_t t = 0; t < o; ++t)
          for (int d = 0; d < D; ++d) {
            const float got = tested[size_t((h * o + t) * D + d)];
            const size_t full = size_t((h * T + t) * D + d);
            // Below the boundary the reconstruction (bit for bit that of the
            // whole-prefix cache), sinks and the window raw.
            const float want = t >= sinks && t < boundary ? coded[full] : raw[full];
            ASSERT_EQ(got, want) << is_key << " token " << t << " of " << o << " boundary " << boundary;
            ASSERT_EQ(other[size_t((h * o + t) * D + d)], other_raw[full]);
          }
    }
    EXPECT_EQ(o, T);
  }
}

TEST_F(StreamSensitivity, AWindowOverTheWholeSequenceCodesNothing) {
  const int sinks = options_.sinks;
  const std::vector<double> whole = measure_tensor_kl(*model_, samples_, cal_, 1, sinks, 0, 1);
  const std::vector<double> streamed = measure_tensor_kl(*model_, samples_, cal_, 1, sinks, 16, 16);
  const std::vector<double> none = measure_tensor_kl(*model_, samples_, cal_, 1, sinks, 96, 16);
  ASSERT_EQ(whole.size(), size_t(2 * config_.n_layers));
  ASSERT_EQ(streamed.size(), whole.size());
  for (size_t t = 0; t < whole.size(); ++t) {
    EXPECT_GT(whole[t], 0.0) << t;
    EXPECT_GT(streamed[t], 0.0) << t;
    EXPECT_NE(streamed[t], whole[t]) << t;
    EXPECT_EQ(none[t], 0.0) << t;  // every token raw: the runs equal the clean one exactly
  }
}

}  // namespace
}  // namespace kvcodec::model

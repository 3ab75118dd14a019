// Cross-layer calibration with the layer sensitivity (issue 21): each
// layer's block of the one tensor is scaled by sqrt(KL per distortion) of
// that layer's tensor instead of to unit RMS, so the tensor's squared error
// is the KL the per-layer measurement predicts.
#include <gtest/gtest.h>

#include <cmath>

#include "model/calibrate.hpp"
#include "kvcodec/error.hpp"
#include "model/model_fixtures.hpp"

namespace kvcodec::model {
namespace {

using namespace testing;  // model_fixtures.hpp

class CrossLayerSensitivity : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = tiny_config(4, 2);
    config_.n_layers = 3;
    model_ = std::make_unique<LlamaModel>(tiny_model(config_));
    options_.first_window = 0;
    options_.windows = 4;
    options_.window_length = 128;
    options_.sinks = 2;
    options_.measured_allocation = true;
    options_.attention_weighting = true;
    samples_ = collect_calibration_samples(*model_, random_tokens(4 * 128, config_.vocab_size, 5), options_);
  }
  // RMS of layer l's block of the tensor the codec is fitted on: x * scale.
  double scaled_rms(const KvtcCalibration& c, bool is_key, int l) const {
    const std::vector<float>& x = (is_key ? samples_.keys : samples_.values)[size_t(l)];
    const std::vector<float>& scale = (is_key ? c.key_scale : c.value_scale)[0];
    const int64_t V = config_.kv_dim();
    double sq = 0.0;
    for (int64_t t = 0; t < samples_.tokens; ++t)
      for (int64_t d = 0; d < V; ++d) sq += std::pow(double(x[size_t(t * V + d)]) * scale[size_t(l * V + d)], 2);
    return std::sqrt(sq / double(samples_.tokens * V));
  }
  ModelConfig config_;
  std::unique_ptr<LlamaModel> model_;
  CalibrateOptions options_;
  CalibrationSamples samples_;
};

TEST_F(CrossLayerSensitivity, ScalesEachLayerBySqrtOfItsMeasuredSensitivity) {
  const int L = config_.n_layers, V = config_.kv_dim();
  CalibrateOptions o = options_;
  o.sensitivity_allocation = true;
  // The middle target (3) is the one the per-layer sensitivities are measured at.
  const auto cals = fit_cross_layer_calibrations(config_, "", samples_, o, {2.0, 3.0, 4.0}, {}, model_.get());
  ASSERT_EQ(cals.size(), 3u);
  CalibrateOptions po = o;
  po.target_ratio = 3.0;
  std::vector<TensorSensitivity> sens;
  fit_calibration(config_, "", samples_, po, {}, model_.get(), &sens);
  ASSERT_EQ(sens.size(), size_t(2 * L));
  for (const KvtcCalibration& c : cals) {
    EXPECT_EQ(c.info.at("layer_scaling"), "attention weights x sqrt(layer KL sensitivity)");
    EXPECT_NE(c.info.at("layer_sensitivity").find("L2V="), std::string::npos);
    for (const bool is_key : {true, false}) {
      const std::vector<float>& scale = (is_key ? c.key_scale : c.value_scale)[0];
      // Layer l's factor c_l: its scale over its attention weights.
      const auto factor = [&](int l) {
        const auto w = attention_weights(*model_, samples_, l, o.weight_floor);
        return double(scale[size_t(l * V)]) / (is_key ? w.first : w.second)[0];
      };
      const double c_0 = factor(0);
      double ms = 0.0;
      for (int l = 0; l < L; ++l) {
        // Within a layer the scale is the attention weights times one factor c_l.
        const auto w = attention_weights(*model_, samples_, l, o.weight_floor);
        const std::vector<float>& wl = is_key ? w.first : w.second;
        const double c_l = factor(l);
        for (int d = 0; d < V; ++d) EXPECT_NEAR(double(scale[size_t(l * V + d)]), wl[size_t(d)] * c_l, 1e-5 * c_l);
        // Between layers c_l^2 follows the sensitivity (KL per distortion).
        const double a0 = sens[is_key ? 0 : 1].per_distortion(), al = sens[size_t(2 * l + (is_key ? 0 : 1))].per_distortion();
        EXPECT_NEAR(c_l * c_l / (c_0 * c_0), al / a0, 1e-4 * al / a0) << l << is_key;
        ms += std::pow(scaled_rms(c, is_key, l), 2);
      }
      EXPECT_NEAR(ms / L, 1.0, 1e-3);  // the tensor as a whole at unit RMS
    }
  }
  // The sensitivities differ between layers here, so the scaling is not the
  // unit-RMS one: some layer's block is off unit RMS.
  o.sensitivity_allocation = false;
  const KvtcCalibration plain = fit_cross_layer_calibrations(config_, "", samples_, o, {3.0}, {}, model_.get())[0];
  EXPECT_EQ(plain.info.at("layer_scaling"), "attention weights / layer RMS");
  EXPECT_EQ(plain.info.count("layer_sensitivity"), 0u);
  double off = 0.0;
  for (int l = 0; l < L; ++l) {
    EXPECT_NEAR(scaled_rms(plain, true, l), 1.0, 1e-4);
    off = std::max(off, std::fabs(scaled_rms(cals[1], true, l) - 1.0));
  }
  EXPECT_GT(off, 0.05);
}

TEST_F(CrossLayerSensitivity, NeedsTheModel) {
  CalibrateOptions o = options_;
  o.attention_weighting = false;
  o.sensitivity_allocation = true;
  EXPECT_THROW(fit_cross_layer_calibrations(config_, "", samples_, o, {3.0}, {}, nullptr), Error);
}

}  // namespace
}  // namespace kvcodec::model

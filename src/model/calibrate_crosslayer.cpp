// Cross-layer calibration (issue 21): one codec per tensor over every layer of
// a token; the parameters' layout is cache/kvtc_crosslayer.hpp's.
#include <cmath>
#include <string>

#include "cache/kvtc_crosslayer.hpp"
#include "kvcodec/error.hpp"
#include "model/calibrate.hpp"

namespace kvcodec::model {

std::vector<KvtcCalibration> fit_cross_layer_calibrations(const ModelConfig& config, const std::string& config_hash,
                                                          const CalibrationSamples& s, const CalibrateOptions& o,
                                                          const std::vector<double>& targets,
                                                          const CalibrationProgress& progress,
                                                          const LlamaModel* model) {
  if (o.attention_weighting && !model)
    throw Error(ErrorCode::kInvalidArgument, "fit_cross_layer_calibrations: attention weighting needs the model");
  if (s.n_layers != config.n_layers || s.n_kv_heads != config.n_kv_heads || s.head_dim != config.head_dim)
    throw Error(ErrorCode::kShapeMismatch, "calibration samples do not match the model config");
  if (s.tokens < 64) throw Error(ErrorCode::kInvalidArgument, "calibration needs at least 64 tokens per layer");
  if (targets.empty()) throw Error(ErrorCode::kInvalidArgument, "fit_cross_layer_calibrations: no target ratio");
  const int L = s.n_layers;
  const int64_t V = int64_t(s.n_kv_heads) * s.head_dim, W = L * V, n = s.tokens;
  std::vector<KvtcCalibration> cals(targets.size());
  for (size_t i = 0; i < targets.size(); ++i) {
    KvtcCalibration& c = cals[i];
    c.n_layers = 1;
    c.n_kv_heads = L * s.n_kv_heads;
    c.head_dim = s.head_dim;
    c.rope_theta = config.rope_theta;
    c.config_hash = config_hash;
    c.key_scale.assign(1, std::vector<float>(size_t(W)));
    c.value_scale.assign(1, std::vector<float>(size_t(W)));
  }
  for (const bool is_key : {true, false}) {
    // scale_l[d] = w_l[d] / RMS_l(x * w_l): unit RMS per layer after weighting.
    std::vector<float> scale(static_cast<size_t>(W)), x(static_cast<size_t>(n * W));
    for (int l = 0; l < L; ++l) {
      std::vector<float> w(size_t(V), 1.0f);
      if (o.attention_weighting) {
        auto kw = attention_weights(*model, s, l, o.weight_floor);
        w = is_key ? std::move(kw.first) : std::move(kw.second);
      }
      const std::vector<float>& src = (is_key ? s.keys : s.values)[size_t(l)];
      double sq = 0.0;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t d = 0; d < V; ++d) sq += std::pow(double(src[size_t(t * V + d)]) * w[size_t(d)], 2);
      const double rms = std::sqrt(sq / double(n * V));
      if (!(rms > 0.0) || !std::isfinite(rms))
        throw Error(ErrorCode::kInvalidArgument, "cross-layer calibration: layer " + std::to_string(l) +
                                                     (is_key ? " keys" : " values") + " have RMS " + std::to_string(rms));
      for (int64_t d = 0; d < V; ++d) scale[size_t(l * V + d)] = float(double(w[size_t(d)]) / rms);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t d = 0; d < V; ++d) x[size_t(t * W + l * V + d)] = src[size_t(t * V + d)] * scale[size_t(l * V + d)];
    }
    if (progress) progress(is_key ? 0 : 1, 2, std::string("fitting cross-layer ") + (is_key ? "keys" : "values"));
    std::vector<double> tt = targets;
    const double fixed = is_key ? o.key_target_ratio : o.value_target_ratio;
    if (fixed > 0) tt.assign(targets.size(), fixed);
    std::vector<double> achieved;
    std::vector<kvtc::HeadParams> fits = fit_tensor_at_ratios(x, n, int(W), o, tt, &achieved);
    for (size_t i = 0; i < targets.size(); ++i) {
      KvtcCalibration& c = cals[i];
      (is_key ? c.keys : c.values).push_back(std::move(fits[i]));
      (is_key ? c.key_scale : c.value_scale)[0] = scale;
      c.info[is_key ? "key_payload_ratio" : "value_payload_ratio"] = std::to_string(achieved[i]);
      if (progress)
        progress(is_key ? 1 : 2, 2, "target " + std::to_string(tt[i]) + ": " + std::to_string((is_key ? c.keys : c.values)[0].n_kept()) +
                                        " components, payload ratio " + std::to_string(achieved[i]));
    }
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    KvtcCalibration& c = cals[i];
    c.info["cross_layers"] = std::to_string(L);
    c.info["layer_scaling"] = "attention weights / layer RMS";
    c.info["tokens_per_layer"] = std::to_string(n);
    c.info["sinks"] = std::to_string(o.sinks);
    c.info["windows"] = std::to_string(o.first_window) + "-" + std::to_string(o.first_window + o.windows - 1);
    c.info["allocator"] = o.measured_allocation ? "measured" : kvtc::allocator_name(o.codec.allocator);
    if (o.measured_allocation) c.info["quantizers"] = quantizer_family_name(o.quantizers);
    c.info["weighting"] = o.attention_weighting ? "attention (floor " + std::to_string(o.weight_floor) + ")" : "none";
    c.info["target_ratio"] = std::to_string(targets[i]);
    c.info["coder"] = kvtc::coder_name(o.codec.coder);
  }
  return cals;
}

}  // namespace kvcodec::model

// Cross-layer calibration (issue 21): one codec per tensor over every layer of
// a token; the parameters' layout is cache/kvtc_crosslayer.hpp's.
#include <algorithm>
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
  // Layer sensitivity (o.sensitivity_allocation): per tensor t = 2 * l +
  // {0 key, 1 value}, KL per unit of distortion in the per-layer weighted
  // space (x * w), measured on a per-layer fit at the middle target. Scaling
  // layer l by sqrt(alpha_t) instead of 1 / RMS_l makes the one tensor's
  // squared error sum_l alpha_t D_t, the KL it predicts, so the cross-layer
  // allocation spends bits where an error costs the most.
  std::vector<double> alpha(size_t(2 * L), 0.0);
  if (o.sensitivity_allocation) {
    if (!model) throw Error(ErrorCode::kInvalidArgument, "fit_cross_layer_calibrations: layer sensitivity needs the model");
    CalibrateOptions po = o;
    std::vector<double> sorted = targets;
    std::sort(sorted.begin(), sorted.end());
    po.target_ratio = sorted[sorted.size() / 2];
    po.refine_ratio = 0.0;
    std::vector<TensorSensitivity> sens;
    if (progress) progress(0, 2, "layer sensitivity: per-layer fit at target " + std::to_string(po.target_ratio));
    fit_calibration(config, config_hash, s, po, progress, model, &sens);
    for (int t = 0; t < 2 * L; ++t) {
      alpha[size_t(t)] = sens[size_t(t)].per_distortion();
      if (!(alpha[size_t(t)] > 0.0) || !std::isfinite(alpha[size_t(t)]))
        throw Error(ErrorCode::kInvalidArgument, "cross-layer calibration: layer " + std::to_string(t / 2) +
                                                     (t % 2 == 0 ? " keys" : " values") + " have KL sensitivity " +
                                                     std::to_string(alpha[size_t(t)]));
    }
  }
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
  // Each layer's attention weights {keys, values}, computed once for both tensors.
  std::vector<std::pair<std::vector<float>, std::vector<float>>> layer_weights(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l)
    layer_weights[size_t(l)] = o.attention_weighting
                                   ? attention_weights(*model, s, l, o.weight_floor)
                                   : std::pair{std::vector<float>(size_t(V), 1.0f), std::vector<float>(size_t(V), 1.0f)};
  for (const bool is_key : {true, false}) {
    // scale_l[d] = w_l[d] * c_l: c_l = 1 / RMS_l(x * w_l) (unit RMS per layer
    // after weighting), or sqrt(alpha_l) / norm with the layer sensitivity,
    // norm making the tensor's overall RMS 1.
    std::vector<float> scale(static_cast<size_t>(W)), x(static_cast<size_t>(n * W));
    std::vector<double> rms(static_cast<size_t>(L));
    for (int l = 0; l < L; ++l) {
      const std::vector<float>& w = is_key ? layer_weights[size_t(l)].first : layer_weights[size_t(l)].second;
      const std::vector<float>& src = (is_key ? s.keys : s.values)[size_t(l)];
      double sq = 0.0;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t d = 0; d < V; ++d) sq += std::pow(double(src[size_t(t * V + d)]) * w[size_t(d)], 2);
      const double layer_rms = std::sqrt(sq / double(n * V));
      if (!(layer_rms > 0.0) || !std::isfinite(layer_rms))
        throw Error(ErrorCode::kInvalidArgument, "cross-layer calibration: layer " + std::to_string(l) +
                                                     (is_key ? " keys" : " values") + " have RMS " + std::to_string(layer_rms));
      rms[size_t(l)] = layer_rms;
    }
    double norm = 1.0;
    if (o.sensitivity_allocation) {
      double ms = 0.0;
      for (int l = 0; l < L; ++l) ms += alpha[size_t(2 * l + (is_key ? 0 : 1))] * rms[size_t(l)] * rms[size_t(l)];
      norm = std::sqrt(ms / L);
    }
    for (int l = 0; l < L; ++l) {
      const double c = o.sensitivity_allocation ? std::sqrt(alpha[size_t(2 * l + (is_key ? 0 : 1))]) / norm : 0.0;
      const std::vector<float>& src = (is_key ? s.keys : s.values)[size_t(l)];
      for (int64_t d = 0; d < V; ++d) {
        const double w = (is_key ? layer_weights[size_t(l)].first : layer_weights[size_t(l)].second)[size_t(d)];
        scale[size_t(l * V + d)] = float(o.sensitivity_allocation ? w * c : w / rms[size_t(l)]);
      }
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
    c.info["layer_scaling"] = o.sensitivity_allocation ? "attention weights x sqrt(layer KL sensitivity)"
                                                        : "attention weights / layer RMS";
    if (o.sensitivity_allocation) {
      std::string a;
      for (int t = 0; t < 2 * L; ++t)
        a += (t ? " L" : "L") + std::to_string(t / 2) + (t % 2 == 0 ? "K=" : "V=") + std::to_string(alpha[size_t(t)]);
      c.info["layer_sensitivity"] = a;
      if (o.sensitivity_window > 0)
        c.info["sensitivity_measured"] = "streaming: raw window " + std::to_string(o.sensitivity_window) +
                                         ", block " + std::to_string(o.sensitivity_block);
    }
    c.info["tokens_per_layer"] = std::to_string(n);
    c.info["sinks"] = std::to_string(o.sinks);
    c.info["windows"] = std::to_string(o.first_window) + "-" + std::to_string(o.first_window + o.windows - 1);
    c.info["allocator"] = o.measured_allocation ? "measured" : kvtc::allocator_name(o.codec.allocator);
    if (o.measured_allocation) c.info["quantizers"] = quantizer_family_name(o.quantizers);
    if (o.reconstruction != Reconstruction::kLattice) c.info["reconstruction"] = reconstruction_name(o.reconstruction);
    c.info["weighting"] = o.attention_weighting ? "attention (floor " + std::to_string(o.weight_floor) + ")" : "none";
    c.info["target_ratio"] = std::to_string(targets[i]);
    c.info["coder"] = kvtc::coder_name(o.codec.coder);
  }
  return cals;
}

}  // namespace kvcodec::model

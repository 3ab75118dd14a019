// A small calibration built from code (1 layer, 2 KV heads, head_dim 8,
// weighted, with refinement parameters), shared by the calibration and the
// calibrated-cache fuzz targets. Deterministic, so its parameters' hash
// (which a saved calibrated cache names) is the same in every run.
#pragma once

#include <string>
#include <vector>

#include "cache/kvtc_calibrated.hpp"
#include "fuzz_seeds.hpp"
#include "kvtc/codec.hpp"
#include "linalg/pca.hpp"

namespace kvcodec::fuzz {

constexpr int kCalHeads = 2, kCalDim = 8;

inline KvtcCalibration small_calibration() {
  KvtcCalibration cal;
  cal.n_layers = 1;
  cal.n_kv_heads = kCalHeads;
  cal.head_dim = kCalDim;
  cal.rope_theta = 10000.0;
  cal.config_hash = "0123456789abcdef";
  const int V = kCalHeads * kCalDim;
  const int64_t n = 256;
  kvtc::CodecOptions base, refine;
  base.bit_budget = V;
  refine.bit_budget = 2 * V;
  for (const bool is_key : {true, false}) {
    const std::vector<float> x = low_rank(n, V, is_key ? 11 : 12);
    const linalg::PcaBasis pca = linalg::fit_pca(x.data(), n, V);
    const kvtc::HeadParams p = kvtc::fit_head(x.data(), n, V, pca.mean, pca.components, pca.eigenvalues, base);
    std::vector<uint16_t> codes(size_t(n) * size_t(p.n_kept()));
    std::vector<float> residual(x.size());
    kvtc::quantize_block(p, x.data(), n, codes.data());
    kvtc::dequantize_block(p, codes.data(), n, residual.data());
    for (size_t i = 0; i < x.size(); ++i) residual[i] = x[i] - residual[i];
    const linalg::PcaBasis rpca = linalg::fit_pca(residual.data(), n, V);
    (is_key ? cal.keys : cal.values).push_back(p);
    (is_key ? cal.key_refine : cal.value_refine)
        .push_back(kvtc::fit_head(residual.data(), n, V, rpca.mean, rpca.components, rpca.eigenvalues, refine));
    std::vector<float> scale(static_cast<size_t>(V));
    for (int d = 0; d < V; ++d) scale[size_t(d)] = 0.5f + 0.125f * float(d / 2 % 4);  // constant over RoPE pairs
    (is_key ? cal.key_scale : cal.value_scale).push_back(scale);
  }
  return cal;
}

// The calibration written once per process to a fixed path (the same bytes
// in every process, so concurrent fuzz jobs may share it).
inline const std::string& small_calibration_path() {
  static const std::string path = [] {
    const char* tmp = std::getenv("TMPDIR");
    const std::string p = std::string(tmp && *tmp ? tmp : "/tmp") + "/kvcodec-fuzz-calibration.kvc";
    small_calibration().write_file(p);
    return p;
  }();
  return path;
}

}  // namespace kvcodec::fuzz

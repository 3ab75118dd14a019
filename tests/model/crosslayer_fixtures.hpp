// Shared by the cross-layer tests (stored prefixes, streaming): synthetic
// keys and values whose layers share a latent, and the shapes they use.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "cache/kvtc_calibrated.hpp"
#include "kvcodec/cache.hpp"
#include "model/calibrate.hpp"

namespace kvcodec::model::testing {

constexpr int kL = 3, kH = 2, kD = 8;
constexpr int64_t kV = kH * kD;

// Token t's vector of layer l: one latent z_t [4] shared by all layers
// through per-layer mixing, plus a little noise (what a cross-layer basis
// can exploit), at layer-dependent scales.
inline std::vector<std::vector<float>> correlated(int64_t n, uint32_t seed, int tensor) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::mt19937 mix_rng(99 + tensor);
  std::vector<std::vector<float>> mix(kL, std::vector<float>(kV * 4));
  for (auto& m : mix)
    for (auto& v : m) v = g(mix_rng);
  std::vector<std::vector<float>> out(kL, std::vector<float>(size_t(n * kV)));
  for (int64_t t = 0; t < n; ++t) {
    float z[4];
    for (float& v : z) v = g(rng);
    for (int l = 0; l < kL; ++l)
      for (int64_t d = 0; d < kV; ++d) {
        float v = 0.05f * g(rng);
        for (int j = 0; j < 4; ++j) v += mix[size_t(l)][size_t(d * 4 + j)] * z[j];
        out[size_t(l)][size_t(t * kV + d)] = v * float(1 + 3 * l);
      }
  }
  return out;
}

inline ModelConfig config() {
  ModelConfig c;
  c.n_layers = kL;
  c.n_kv_heads = kH;
  c.n_heads = kH;
  c.head_dim = kD;
  c.rope_theta = 10000.0;
  return c;
}

inline CalibrationSamples samples(int64_t n) {
  CalibrationSamples s;
  s.n_layers = kL;
  s.n_kv_heads = kH;
  s.head_dim = kD;
  s.tokens = n;
  s.keys = correlated(n, 1, 0);
  s.values = correlated(n, 2, 1);
  return s;
}

inline CalibrateOptions options() {
  CalibrateOptions o;
  o.measured_allocation = true;
  o.quantizers = QuantizerFamily::kMidtread;
  o.attention_weighting = false;
  return o;
}

// A prefix of S tokens as a model would hand it: per layer [1, H, S, D],
// keys post-RoPE at positions 0..S-1.
inline std::vector<KVPair> prefix_of(int64_t S, uint32_t seed) {
  const auto k = correlated(S, seed, 0), v = correlated(S, seed + 1, 1);
  const std::vector<double> inv = rope_inv_freq(kD, 10000.0);
  std::vector<KVPair> p;
  for (int l = 0; l < kL; ++l) {
    std::vector<float> rows = k[size_t(l)];
    rope_rotate_tokens(rows.data(), S, kH, kD, 0, inv, /*inverse=*/false);
    KVPair kv{Tensor(DType::kF32, {1, kH, S, kD}), Tensor(DType::kF32, {1, kH, S, kD})};
    for (int h = 0; h < kH; ++h)
      for (int64_t t = 0; t < S; ++t)
        for (int d = 0; d < kD; ++d) {
          kv.keys.data_as<float>()[(h * S + t) * kD + d] = rows[size_t(t * kV + h * kD + d)];
          kv.values.data_as<float>()[(h * S + t) * kD + d] = v[size_t(l)][size_t(t * kV + h * kD + d)];
        }
    p.push_back(std::move(kv));
  }
  return p;
}

}  // namespace kvcodec::model::testing

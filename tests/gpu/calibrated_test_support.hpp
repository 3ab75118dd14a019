// A synthetic calibration and KV rows for it, shared by the tests of the
// calibrated GPU format (test_gpu_calibrated.cpp) and the offload tier
// (test_offload.cpp).
#pragma once

#include <random>
#include <string>
#include <vector>

#include "cache/kvtc_calibrated.hpp"
#include "gpu/gpu_test_support.hpp"
#include "gpu/kvtc_variant.hpp"

namespace kvcodec::gpu {

constexpr int kHeads = 2, kHeadDim = 64, kDim = kHeads * kHeadDim;

// The calibration the repository ships (the bench's and the CLI's default).
[[maybe_unused]] inline std::string shipped_calibration_path() {
  return std::string(KVCODEC_SOURCE_DIR) + "/models/tinycode/kvtc.kvcal";
}

// A calibration of `layers` layers fitted on synthetic RoPE-free vectors
// (weighted by random per-dimension scales), and KV rows for it: per layer
// keys (RoPE applied at the token's position) and values, [S, H * D] bf16.
// Even layers are fitted at the default budget, odd ones at odd_budget bits
// per token.
struct Synthetic {
  KvtcCalibration cal;
  std::vector<std::vector<uint16_t>> keys, values;  // [layers][S * kDim]
};

inline Synthetic synthetic(int layers, int64_t S, uint32_t seed, int odd_budget = 2 * kDim) {
  Synthetic out;
  KvtcCalibration& c = out.cal;
  c.n_layers = layers;
  c.n_kv_heads = kHeads;
  c.head_dim = kHeadDim;
  c.rope_theta = 10000.0;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.5f, 2.0f);
  const std::vector<double> inv_freq = rope_inv_freq(kHeadDim, c.rope_theta);
  for (int l = 0; l < layers; ++l)
    for (const bool is_key : {true, false}) {
      const std::vector<uint16_t> z = synth_bf16(S, kDim, seed + uint32_t(2 * l + (is_key ? 0 : 1)));
      std::vector<float> w(kDim);
      for (float& v : w) v = u(rng);
      std::vector<uint16_t> zw(z.size());
      for (size_t i = 0; i < z.size(); ++i) zw[i] = f32_to_bf16_rne(bf16_bits_to_f32(z[i]) * w[i % kDim]);
      (is_key ? c.keys : c.values).push_back(fit(zw.data(), S, kDim, l % 2 ? odd_budget : 0));
      (is_key ? c.key_scale : c.value_scale).push_back(w);
      std::vector<float> x = to_f32(z.data(), z.size());
      if (is_key) rope_rotate_tokens(x.data(), S, kHeads, kHeadDim, 0, inv_freq, /*inverse=*/false);
      std::vector<uint16_t> xb(x.size());
      for (size_t i = 0; i < x.size(); ++i) xb[i] = f32_to_bf16_rne(x[i]);
      (is_key ? out.keys : out.values).push_back(std::move(xb));
    }
  return out;
}

// The batch [layer][key, value][batch row = 1] as the GPU codec takes it.
inline std::vector<uint16_t> batch_of(const Synthetic& s) {
  std::vector<uint16_t> x;
  for (int l = 0; l < s.cal.n_layers; ++l)
    for (const auto* t : {&s.keys[size_t(l)], &s.values[size_t(l)]}) x.insert(x.end(), t->begin(), t->end());
  return x;
}

inline std::vector<int> all_layers(int n) {
  std::vector<int> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[size_t(i)] = i;
  return v;
}

}  // namespace kvcodec::gpu

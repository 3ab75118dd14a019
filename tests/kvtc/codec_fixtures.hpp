// Test fixtures of the kvtc codec's tests: correlated rows, fitted heads
// and the settings the integer-path tests fit.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kvtc/codec.hpp"
#include "linalg/pca.hpp"

namespace kvcodec::kvtc::fixtures {

// Correlated vectors: a decaying spectrum mixed by a random rotation, plus an offset.
inline std::vector<float> correlated(int64_t n, int dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> mix(size_t(dim * dim));
  for (auto& m : mix) m = g(rng) / std::sqrt(float(dim));
  std::vector<float> x(size_t(n * dim));
  std::vector<float> z(static_cast<size_t>(dim));
  for (int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < dim; ++k) z[size_t(k)] = g(rng) * 4.0f * std::exp(-0.12f * float(k));
    for (int d = 0; d < dim; ++d) {
      float acc = 0.3f * float(d % 5);
      for (int k = 0; k < dim; ++k) acc += mix[size_t(d * dim + k)] * z[size_t(k)];
      x[size_t(i * dim + d)] = acc;
    }
  }
  return x;
}

inline double rel_mse(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0, r = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    e += double(a[i] - b[i]) * (a[i] - b[i]);
    r += double(a[i]) * a[i];
  }
  return e / r;
}

inline HeadParams fit(const std::vector<float>& x, int64_t n, int dim, const CodecOptions& o) {
  const linalg::PcaBasis pca = linalg::fit_pca(x.data(), n, dim);
  return fit_head(x.data(), n, dim, pca.mean, pca.components, pca.eigenvalues, o);
}

// The four settings the integer-path tests fit per dim: the rate allocator
// at 1% and 5% (int8 basis), the dp allocator at a small budget and at 3
// bits per component.
inline CodecOptions setting_options(int setting, int dim, int small_budget) {
  CodecOptions o;
  if (setting < 2) {
    o.allocator = Allocator::kRate;
    o.target_rel_mse = setting == 0 ? 0.01 : 0.05;
    o.basis_bits = 8;
  } else {
    o.bit_budget = setting == 2 ? small_budget : 3 * dim;
  }
  return o;
}

}  // namespace kvcodec::kvtc::fixtures

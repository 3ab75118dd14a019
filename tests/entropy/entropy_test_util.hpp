// Shared helpers for the entropy tests: deterministic sampling.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace kvcodec::entropy::testing {

// Inverse-CDF sampling with our own arithmetic so results do not depend on
// the standard library's distribution implementations.
class Sampler {
 public:
  explicit Sampler(std::vector<double> probs) {
    double acc = 0;
    for (double p : probs) cdf_.push_back(acc += p);
    for (double& c : cdf_) c /= acc;
  }
  template <typename Rng>
  uint16_t operator()(Rng& rng) const {
    const double u = double(rng() >> 11) * (1.0 / 9007199254740992.0);
    size_t lo = 0, hi = cdf_.size() - 1;
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (u < cdf_[mid]) hi = mid; else lo = mid + 1;
    }
    return uint16_t(lo);
  }

 private:
  std::vector<double> cdf_;
};

// Discretized Gaussian over [0, alphabet) centred in the middle, sigma in
// symbols: the shape of quantized principal components.
inline std::vector<double> gaussian_probs(size_t alphabet, double sigma) {
  std::vector<double> p(alphabet);
  const double mid = (double(alphabet) - 1) / 2;
  for (size_t s = 0; s < alphabet; ++s) p[s] = std::exp(-0.5 * std::pow((double(s) - mid) / sigma, 2));
  return p;
}

inline std::vector<uint64_t> histogram(const std::vector<uint16_t>& sym, size_t alphabet, size_t stride = 1,
                                       size_t offset = 0) {
  std::vector<uint64_t> h(alphabet, 0);
  for (size_t i = offset; i < sym.size(); i += stride) ++h[sym[i]];
  return h;
}

inline double entropy_bits(const std::vector<double>& probs) {
  double sum = 0, h = 0;
  for (double p : probs) sum += p;
  for (double p : probs)
    if (p > 0) h -= (p / sum) * std::log2(p / sum);
  return h;
}

}  // namespace kvcodec::entropy::testing

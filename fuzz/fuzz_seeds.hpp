// Seeds a fuzz target makes itself: valid inputs built from code (a small
// calibration, saved caches, serialised parameters), so they always match
// the current format. With KVCODEC_FUZZ_SEEDS=<dir> set, write_seed() writes
// one there; scripts/fuzz.sh runs each target once that way (-runs=0) to fill
// its corpus before fuzzing. Without it, write_seed() does nothing.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace kvcodec::fuzz {

inline void write_seed(const std::string& name, const std::vector<uint8_t>& bytes) {
  const char* dir = std::getenv("KVCODEC_FUZZ_SEEDS");
  if (!dir || !*dir) return;
  std::ofstream(std::string(dir) + "/seed_" + name, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// n vectors [n, dim] of rank 4 plus small noise, fixed seed.
inline std::vector<float> low_rank(int64_t n, int dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> basis(size_t(4 * dim)), x(size_t(n * dim));
  for (auto& b : basis) b = g(rng);
  for (int64_t t = 0; t < n; ++t) {
    float z[4];
    for (float& v : z) v = g(rng);
    for (int d = 0; d < dim; ++d) {
      float s = 0.01f * g(rng);
      for (int r = 0; r < 4; ++r) s += z[r] * basis[size_t(r * dim + d)];
      x[size_t(t * dim + d)] = s;
    }
  }
  return x;
}

}  // namespace kvcodec::fuzz

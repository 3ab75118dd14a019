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

#include "kvcodec/cache.hpp"
#include "kvcodec/tensor.hpp"

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

// Layer 0 of a one-layer model of H KV heads of D (the small calibrations' shape).
inline CacheConfig one_layer_config(int H, int D) {
  CacheConfig c;
  c.layer = 0;
  c.n_layers = 1;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.rope_theta = 10000.0;
  return c;
}

// [B, H, S, D] f32 tokens whose H * D values per token are low_rank's
// vectors (one per (b, s)), as calibrations built from low_rank expect.
inline Tensor low_rank_tokens(int64_t B, int64_t H, int64_t S, int64_t D, uint32_t seed) {
  const std::vector<float> x = low_rank(B * S, int(H * D), seed);
  Tensor t(DType::kF32, {B, H, S, D});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t d = 0; d < D; ++d)
          t.data_as<float>()[((b * H + h) * S + s) * D + d] = x[size_t(((b * S + s) * H + h) * D + d)];
  return t;
}

}  // namespace kvcodec::fuzz

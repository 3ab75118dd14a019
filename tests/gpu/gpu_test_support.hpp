// Helpers shared by the GPU codec tests (tests/gpu/*.cpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gpu/kvtc_variant.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/gpu.hpp"
#include "kvtc/codec.hpp"
#include "linalg/pca.hpp"

#ifdef KVCODEC_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kvcodec::gpu {

// The GPU tests draw fresh inputs when KVCODEC_GPU_TEST_SEED is set (the
// bench script sets it to a new value each run); CI stays deterministic.
[[maybe_unused]] inline uint32_t test_seed(uint32_t fallback) {
  const char* s = std::getenv("KVCODEC_GPU_TEST_SEED");
  return s ? uint32_t(std::strtoul(s, nullptr, 10)) : fallback;
}

// The shared model's KV dump (KVCODEC_KV_DUMP overrides it: the device
// runs carry the dump without ../shared).
[[maybe_unused]] inline std::string kv_dump_path() {
  if (const char* p = std::getenv("KVCODEC_KV_DUMP")) return p;
  return std::string(KVCODEC_SHARED_DIR) + "/models/tinycode/kv_dump.safetensors";
}

// Correlated Gaussian tokens [n, D] with a decaying spectrum, rounded to bf16.
inline std::vector<uint16_t> synth_bf16(int64_t n, int dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  std::vector<float> mix(size_t(dim * dim));
  for (auto& m : mix) m = g(rng) / std::sqrt(float(dim));
  std::vector<uint16_t> x(size_t(n * dim));
  std::vector<float> z(static_cast<size_t>(dim));
  for (int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < dim; ++k) z[size_t(k)] = g(rng) * 4.0f * std::exp(-0.08f * float(k));
    for (int d = 0; d < dim; ++d) {
      float acc = 0.5f * float(d % 7) - 1.0f;
      for (int k = 0; k < dim; ++k) acc += mix[size_t(d * dim + k)] * z[size_t(k)];
      x[size_t(i * dim + d)] = f32_to_bf16_rne(acc);
    }
  }
  return x;
}

inline std::vector<float> to_f32(const uint16_t* x, size_t n) {
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = bf16_bits_to_f32(x[i]);
  return f;
}

inline kvtc::HeadParams fit(const uint16_t* x, int64_t n, int dim, int bit_budget = 0, std::vector<int> bit_choices = {}) {
  const std::vector<float> xf = to_f32(x, size_t(n * dim));
  const linalg::PcaBasis pca = linalg::fit_pca(xf.data(), n, dim);
  kvtc::CodecOptions o;
  o.coder = kvtc::CoderChoice::kRans;
  o.bit_budget = bit_budget;
  if (!bit_choices.empty()) o.bit_choices = bit_choices;
  return kvtc::fit_head(xf.data(), n, dim, pca.mean, pca.components, pca.eigenvalues, o);
}

// p with every component's rANS table rebuilt at 16 bits of precision (the
// CPU codec's most; the GPU streams code at most 15 and rebuild such tables).
inline kvtc::HeadParams with_16_bit_tables(kvtc::HeadParams p) {
  for (entropy::FrequencyTable& ft : p.rans_tables)
    ft = entropy::FrequencyTable::from_counts(std::vector<uint64_t>(ft.freq.begin(), ft.freq.end()), 16, 0.0);
  return p;
}

inline bool have_gpu() { return device_count() > 0; }

#ifdef KVCODEC_HAVE_CUDA
template <typename T>
struct DevBuf {
  T* p = nullptr;
  explicit DevBuf(size_t n) { EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess); }
  ~DevBuf() { cudaFree(p); }
};

// Stream 0 loses its last byte (stream 1 gains a leading one): decoding the
// device payload `in` (size bytes, offsets as `offsets` with that change,
// copied to doff) must be reported by check_errors().
inline void expect_truncation_flagged(KvtcGpuCodec& codec, const std::vector<uint64_t>& offsets, uint64_t* doff,
                                      const uint8_t* in, uint64_t size, int64_t tokens, uint16_t* y) {
  if (offsets.size() < 3 || offsets[2] <= offsets[1] + 1) return;
  std::vector<uint64_t> cut = offsets;
  cut[1] -= 1;
  ASSERT_EQ(cudaMemcpy(doff, cut.data(), cut.size() * 8, cudaMemcpyHostToDevice), cudaSuccess);
  codec.decode(in, size, doff, tokens, y);
  EXPECT_THROW(codec.check_errors(), Error);
}

#endif

}  // namespace kvcodec::gpu

// PALU on the GPU: the CPU reference (the cache's own projection and latent
// quantizer over a [rows, tokens, dim] head group) in every build, and the
// CUDA kernels against it, byte for byte, when a GPU is there.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>

#include "gpu/kvtc_variant.hpp"
#include "gpu/palu_reference.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/gpu.hpp"
#include "palu/projection.hpp"

#ifdef KVCODEC_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kvcodec::gpu {
namespace {

[[maybe_unused]] uint32_t seed_or(uint32_t fallback) {
  const char* s = std::getenv("KVCODEC_GPU_TEST_SEED");
  return s ? uint32_t(std::strtoul(s, nullptr, 10)) : fallback;
}

// [rows, tokens, dim] bf16 with a low-rank-ish structure plus noise.
std::vector<uint16_t> synth(int rows, int64_t tokens, int dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g;
  const int latent = 16;
  std::vector<float> mix(size_t(latent * dim));
  for (auto& m : mix) m = g(rng);
  std::vector<uint16_t> x(size_t(rows) * size_t(tokens) * size_t(dim));
  std::vector<float> z(latent);
  for (size_t v = 0; v < x.size() / size_t(dim); ++v) {
    for (int k = 0; k < latent; ++k) z[size_t(k)] = g(rng) * std::exp(-0.2f * float(k));
    for (int d = 0; d < dim; ++d) {
      float acc = 0.1f * g(rng) + 0.3f;
      for (int k = 0; k < latent; ++k) acc += z[size_t(k)] * mix[size_t(k * dim + d)];
      x[v * size_t(dim) + size_t(d)] = f32_to_bf16_rne(acc);
    }
  }
  return x;
}

palu::Projection fit(const std::vector<uint16_t>& x, int dim, int rank, int hi_bit, int lo_bit) {
  std::vector<float> xf(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_bits_to_f32(x[i]);
  palu::FitOptions o;
  o.rank = rank;
  o.hi_bit = hi_bit;
  o.lo_bit = lo_bit;
  return palu::fit_projection(xf.data(), int64_t(x.size()) / dim, dim, o);
}

TEST(PaluReference, SizesRoundTripAndErrors) {
  const int rows = 3, dim = 64, gs = 32;
  const int64_t tokens = 96;
  const std::vector<uint16_t> x = synth(rows, tokens, dim, 5);
  const palu::Projection p = fit(x, dim, 12, 4, 2);
  const std::vector<uint8_t> blob = palu_encode_reference(p, x.data(), rows, tokens, gs);
  EXPECT_EQ(blob.size(), 3 * palu::latent_group_bytes(p, rows, gs));
  std::vector<uint16_t> y(x.size());
  palu_decode_reference(p, blob.data(), blob.size(), rows, tokens, gs, y.data());
  // The reconstruction is the rank-12 projection U U^T x plus the noise of
  // 4-bit (3 channels) and 2-bit (9 channels) latents over groups of 32.
  double err = 0, err_proj = 0, nrm = 0;
  std::vector<float> xf(dim), z(12), xp(dim);
  for (size_t v = 0; v < x.size() / dim; ++v) {
    for (int d = 0; d < dim; ++d) xf[size_t(d)] = bf16_bits_to_f32(x[v * dim + size_t(d)]);
    p.project(xf.data(), z.data());
    p.reconstruct(z.data(), xp.data());
    for (int d = 0; d < dim; ++d) {
      const double a = xf[size_t(d)], b = bf16_bits_to_f32(y[v * dim + size_t(d)]);
      err += (a - b) * (a - b), nrm += a * a, err_proj += (a - xp[size_t(d)]) * (a - xp[size_t(d)]);
    }
  }
  EXPECT_GT(err, err_proj);                  // quantization adds noise...
  EXPECT_LT(err / nrm, err_proj / nrm + 0.1);  // ...but 2-bit noise stays a fraction of the signal
  EXPECT_THROW(palu_encode_reference(p, x.data(), rows, 95, gs), Error);
  EXPECT_THROW(palu_decode_reference(p, blob.data(), blob.size() - 1, rows, tokens, gs, y.data()), Error);
}

#ifdef KVCODEC_HAVE_CUDA
void palu_gpu_matches_cpu(int rows, int64_t tokens, int dim, int rank, int hi, int lo, int gs, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "rows " << rows << " dim " << dim << " rank " << rank << " bits " << hi << "/"
                                  << lo << " group " << gs << " seed " << seed);
  const std::vector<uint16_t> x = synth(rows, tokens, dim, seed);
  const palu::Projection p = fit(x, dim, rank, hi, lo);
  const std::vector<uint8_t> ref = palu_encode_reference(p, x.data(), rows, tokens, gs);
  std::vector<uint16_t> yref(x.size());
  palu_decode_reference(p, ref.data(), ref.size(), rows, tokens, gs, yref.data());

  PaluGpuCodec codec(p, rows, gs, tokens);
  // A codec with smaller tables made after it must not lower the kernels'
  // shared-memory limit (one setting per process) under this one's.
  const PaluGpuCodec smaller(p, rows, 32, tokens);
  ASSERT_EQ(codec.group_bytes() * uint64_t(tokens / gs), ref.size());
  uint16_t *dx = nullptr, *dy = nullptr;
  uint8_t* dblob = nullptr;
  ASSERT_EQ(cudaMalloc(&dx, x.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dy, x.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dblob, ref.size()), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  // Poison the outputs: every byte must be written.
  ASSERT_EQ(cudaMemset(dblob, 0xa5, ref.size()), cudaSuccess);
  ASSERT_EQ(cudaMemset(dy, 0xff, x.size() * 2), cudaSuccess);
  codec.encode(dx, tokens, dblob);
  std::vector<uint8_t> got(ref.size());
  ASSERT_EQ(cudaMemcpy(got.data(), dblob, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  size_t diff = 0;
  for (size_t i = 0; i < got.size(); ++i) diff += got[i] != ref[i];
  EXPECT_EQ(diff, 0u) << "bytes differ from the CPU's of " << got.size();
  // Decode of the CPU's bytes.
  ASSERT_EQ(cudaMemcpy(dblob, ref.data(), ref.size(), cudaMemcpyHostToDevice), cudaSuccess);
  codec.decode(dblob, tokens, dy);
  std::vector<uint16_t> y(x.size());
  ASSERT_EQ(cudaMemcpy(y.data(), dy, y.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  size_t ybad = 0;
  double worst = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    ybad += y[i] != yref[i];
    worst = std::max(worst, double(std::fabs(bf16_bits_to_f32(y[i]) - bf16_bits_to_f32(yref[i]))));
  }
  EXPECT_EQ(ybad, 0u) << "reconstructed values differ (largest difference " << worst << ")";
  cudaFree(dx);
  cudaFree(dy);
  cudaFree(dblob);
}
#endif

TEST(PaluGpu, MatchesCpuBytesAndReconstruction) {
  if (!cuda_compiled()) GTEST_SKIP() << "built without CUDA (-DKVCODEC_CUDA=ON)";
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
#ifdef KVCODEC_HAVE_CUDA
  const uint32_t seed = seed_or(99);
  std::printf("seed %u\n", seed);
  palu_gpu_matches_cpu(8, 256, 128, 32, 4, 2, 32, seed);       // shared mode, defaults
  palu_gpu_matches_cpu(2, 128, 256, 48, 4, 2, 32, seed + 1);    // joint mode: 2 heads of 128 concatenated
  palu_gpu_matches_cpu(3, 192, 64, 13, 5, 3, 64, seed + 2);     // odd widths: codes straddle words
#endif
}

TEST(PaluGpu, RejectsBadShapes) {
  if (!cuda_compiled()) GTEST_SKIP() << "built without CUDA (-DKVCODEC_CUDA=ON)";
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<uint16_t> x = synth(2, 64, 64, 1);
  const palu::Projection p = fit(x, 64, 8, 4, 2);
  EXPECT_THROW(PaluGpuCodec(p, 2, 48, 64), Error);  // group size not a multiple of 32
  EXPECT_THROW(PaluGpuCodec(p, 0, 32, 64), Error);
  PaluGpuCodec c(p, 2, 32, 64);
  EXPECT_THROW(c.encode(nullptr, 40, nullptr), Error);
  EXPECT_THROW(c.decode(nullptr, 128, nullptr), Error);
}

}  // namespace
}  // namespace kvcodec::gpu

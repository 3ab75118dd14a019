// What the GPU benches share: CUDA error checks, event timing, the dump's
// layer count.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu/kvtc_variant.hpp"
#include "kvcodec/safetensors.hpp"

#define CK(x)                                                            \
  do {                                                                   \
    cudaError_t e_ = (x);                                                \
    if (e_ != cudaSuccess) {                                             \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));     \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

namespace kvcodec::bench {

// Medians over `reps` calls (after one warm-up) of fn's wall time until the
// stream is done (host overhead included, as a caller waiting for it sees)
// and of the GPU time between events recorded on the stream around it.
struct StreamTimes {
  double wall_ms, gpu_ms;
};
template <typename F>
StreamTimes median_stream_ms(cudaStream_t s, F&& fn, int reps) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  fn();
  CK(cudaDeviceSynchronize());
  std::vector<double> wall, gpu;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    CK(cudaEventRecord(e0, s));
    fn();
    CK(cudaEventRecord(e1, s));
    CK(cudaStreamSynchronize(s));
    wall.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    gpu.push_back(double(ms));
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(wall.begin(), wall.end());
  std::sort(gpu.begin(), gpu.end());
  return {wall[wall.size() / 2], gpu[gpu.size() / 2]};
}

// Median of `reps` timed calls of fn (each between two events on the
// default stream), after one warm-up call.
template <typename F>
double median_ms(F&& fn, int reps) {
  return median_stream_ms(nullptr, fn, reps).gpu_ms;
}

// Squared error of y against x over their squared norm (n bf16 values each).
inline double rel_mse(const uint16_t* x, const uint16_t* y, size_t n) {
  double err = 0, nrm = 0;
  for (size_t i = 0; i < n; ++i) {
    const double a = gpu::bf16_bits_to_f32(x[i]), b = gpu::bf16_bits_to_f32(y[i]);
    err += (a - b) * (a - b), nrm += a * a;
  }
  return err / nrm;
}

// Layers of a KV dump: the N with a tensor "layers.<N>.key", counted up
// from 0 (a dump of any depth).
inline int dump_layers(const SafetensorsFile& f) {
  const std::vector<std::string> names = f.names();
  int n = 0;
  while (std::binary_search(names.begin(), names.end(), "layers." + std::to_string(n) + ".key")) ++n;
  return n;
}

}  // namespace kvcodec::bench

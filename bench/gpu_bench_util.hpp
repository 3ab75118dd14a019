// What the GPU benches share: CUDA error checks, event timing, the dump's
// layer count.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

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

// Median of `reps` timed calls of fn (each between two events on the
// default stream), after one warm-up call.
template <typename F>
double median_ms(F&& fn, int reps) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  fn();
  CK(cudaDeviceSynchronize());
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(e0));
    fn();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(double(ms));
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
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

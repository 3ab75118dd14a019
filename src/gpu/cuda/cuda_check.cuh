// A failed CUDA runtime call as kvcodec's Error (kInternal), naming the
// call; the kernels' shared-memory limit.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kvcodec/error.hpp"

namespace kvcodec::gpu {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::kInternal, std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

// A kernel's dynamic shared-memory limit is one setting for the whole
// process: raise it to `bytes` when lower, never lower it, or a codec with
// smaller tables would break the launches of a live one with larger tables.
inline void raise_dynamic_smem_limit(const void* kernel, int bytes) {
  cudaFuncAttributes a{};
  check_cuda(cudaFuncGetAttributes(&a, kernel), "kernel attributes");
  if (bytes > a.maxDynamicSharedSizeBytes)
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), "smem attribute");
}

}  // namespace kvcodec::gpu

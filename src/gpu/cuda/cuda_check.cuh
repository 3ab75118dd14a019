// A failed CUDA runtime call as kvcodec's Error (kInternal), naming the call.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kvcodec/error.hpp"

namespace kvcodec::gpu {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::kInternal, std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace kvcodec::gpu

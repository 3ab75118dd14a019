// The C API's GPU codecs (prefix_codec.cpp, palu_codec.cpp) refuse a CUDA
// device the same way: a build without CUDA, or no usable device.
#pragma once

#include <string>

#include "kvcodec/error.hpp"
#include "kvcodec/gpu.hpp"

namespace kvcodec::capi {

// device: the enum value's name the caller passed (e.g. "KVCODEC_DEVICE_CUDA");
// host: the one that codes the same bytes on the CPU.
inline void require_cuda_device(const std::string& device, const std::string& host) {
  if (!gpu::cuda_compiled())
    throw Error(ErrorCode::kUnsupported, "device " + device +
                                             ": this libkvcodec was built without CUDA (configure with "
                                             "-DKVCODEC_CUDA=ON); " + host + " codes the same bytes on the host");
  if (gpu::device_count() == 0) throw Error(ErrorCode::kUnsupported, "device " + device + ": no usable CUDA device");
}

}  // namespace kvcodec::capi

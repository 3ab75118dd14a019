// The C API's calibration handle, shared by the caches (cache.cpp) and the
// whole-prefix codec (prefix_codec.cpp).
#pragma once

#include <memory>
#include <string>

#include "cache/kvtc_calibrated.hpp"
#include "kvcodec/kvcodec.h"

struct kvcodec_calibration {
  std::string path;  // absolute: saved caches name it, and may be loaded from another directory
  std::shared_ptr<const kvcodec::KvtcCalibration> params;  // the process-wide copy of that file
};

namespace kvcodec::capi {
inline std::shared_ptr<const KvtcCalibration> calibration_params(const kvcodec_calibration* c) { return c->params; }
}  // namespace kvcodec::capi

// Small calibrated-PALU calibrations built from code (1 layer, 2 KV heads,
// head_dim 8; shared mode with 2 head groups, joint mode with 1), shared by
// the PALU calibration and calibrated-PALU cache fuzz targets. Deterministic,
// so every process writes the same bytes.
#pragma once

#include <cstdlib>
#include <string>
#include <vector>

#include "cache/palu_calibration.hpp"
#include "fuzz_seeds.hpp"

namespace kvcodec::fuzz {

constexpr int kPaluHeads = 2, kPaluDim = 8;

inline PaluCalibration small_palu_calibration(bool joint) {
  const int64_t n = 256;
  const std::vector<std::vector<float>> keys{low_rank(n, kPaluHeads * kPaluDim, 21)};
  const std::vector<std::vector<float>> values{low_rank(n, kPaluHeads * kPaluDim, 22)};
  return fit_palu_calibration(1, kPaluHeads, kPaluDim, 10000.0, "0123456789abcdef", keys, values, n, joint,
                              joint ? 1 : 2);
}

// Written once per process to a fixed path (the same bytes in every
// process, so concurrent fuzz jobs may share it).
inline std::string palu_calibration_path_written(bool joint) {
  const char* tmp = std::getenv("TMPDIR");
  const std::string p = std::string(tmp && *tmp ? tmp : "/tmp") + "/kvcodec-fuzz-palu-" +
                        (joint ? "joint" : "shared") + ".pcal";
  small_palu_calibration(joint).write_file(p);
  return p;
}

inline const std::string& small_palu_calibration_path(bool joint) {
  static const std::string shared_path = palu_calibration_path_written(false);
  static const std::string joint_path = palu_calibration_path_written(true);
  return joint ? joint_path : shared_path;
}

}  // namespace kvcodec::fuzz

// Calibrated PALU (issue 21, the PALU paper's mode): projections fitted
// offline over many sequences instead of a per-sequence SVD at prefill.
//
// A calibration holds, per transformer layer, tensor (key, value) and head
// group, the eigenbasis of the calibration vectors' second moment (the
// right singular vectors of the stacked vectors, palu::Eigenbasis). Keys
// are taken with RoPE removed (pre-RoPE, as the PALU paper projects them:
// RoPE turns each dimension pair by a position-dependent angle, so a fixed
// low-rank basis of post-RoPE keys needs more rank for the same energy), and
// the cache re-applies RoPE to the keys it reconstructs. The cache picks the
// rank, the bit widths and the Walsh-Hadamard rotation from its own settings
// (palu::calibrated_projection), so one calibration serves every setting.
// A calibrated cache stores no projection: its bytes are the raw sinks and
// the quantized latents. The file is reported apart (per model) as the
// extra calibration_bytes and, in memory, CacheStats::shared.
//
// File (container kind "calibration"):
//   meta   format=palu-calibration, version=1, n_layers, n_kv_heads,
//          head_dim, rope_theta, group_mode (shared|joint), n_head_groups,
//          config_hash (hex XXH3-64 of config.json, "" if unknown), fit.*
//   sections layer.<l>.key.<g> / layer.<l>.value.<g>, every layer and group:
//          u16 dim (head_dim in shared mode, heads * head_dim in joint),
//          dim f64 eigenvalues (finite, >= 0, non-increasing), dim * dim
//          f32 eigenvectors row-major (column k the k-th; orthonormal to 1e-3).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cache/calibration_shape.hpp"
#include "kvcodec/cache.hpp"
#include "palu/projection.hpp"

namespace kvcodec {

// The model's shape, config hash and fit notes: cache_impl::CalibrationShape.
struct PaluCalibration : cache_impl::CalibrationShape {
  static constexpr int kVersion = 1;
  bool joint = false;       // joint: a group's heads concatenated into one vector
  int n_head_groups = 1;    // as palu::split_head_groups clamps it
  std::vector<std::vector<palu::Eigenbasis>> keys;    // [n_layers][group], keys with RoPE removed
  std::vector<std::vector<palu::Eigenbasis>> values;  // [n_layers][group]

  std::vector<std::pair<int, int>> groups() const { return palu::split_head_groups(n_kv_heads, n_head_groups); }
  int group_dim(int group) const;

  std::vector<uint8_t> serialize() const;
  void write_file(const std::string& path) const;  // atomic (temporary file + rename)
  // Throws Error(kFormat / kChecksum) naming the file and what is wrong.
  static PaluCalibration parse(const uint8_t* data, size_t size, const std::string& label = "<memory>");
  static PaluCalibration read_file(const std::string& path);
  // read_file() once per process per path (reloaded when size or mtime change).
  static std::shared_ptr<const PaluCalibration> load_shared(const std::string& path);
  uint64_t layer_bytes(int layer, bool is_key) const;  // its sections' bytes as stored
  uint64_t params_bytes() const;                       // all sections
  uint64_t held_bytes() const;                         // in memory
};

// Fits a calibration from per-layer samples [n_layers][tokens, H_kv * D]
// ([h][d] within a token; keys with RoPE removed), as
// model::collect_calibration_samples gathers them.
PaluCalibration fit_palu_calibration(int n_layers, int n_kv_heads, int head_dim, double rope_theta,
                                     const std::string& config_hash, const std::vector<std::vector<float>>& keys,
                                     const std::vector<std::vector<float>>& values, int64_t tokens, bool joint,
                                     int n_head_groups);

// Error(kShapeMismatch) naming both shapes unless the calibration fits this cache.
void check_palu_calibration_matches(const PaluCalibration& cal, const CacheConfig& config, const std::string& path);

}  // namespace kvcodec

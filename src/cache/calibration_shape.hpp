// What every calibration file (kvtc's .kvcal, PALU's .pcal) says of the model
// it was fitted on, and how that is written as container meta and read back.
#pragma once

#include <map>
#include <string>

#include "kvcodec/container.hpp"

namespace kvcodec::cache_impl {

struct CalibrationShape {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  double rope_theta = 10000.0;
  std::string config_hash;                  // hex XXH3-64 of the model's config.json ("" if unknown)
  std::map<std::string, std::string> info;  // how it was fitted (written as meta "fit.<key>")

  std::string shape_string() const;  // "n_layers=6, n_kv_heads=2, head_dim=64, rope_theta=10000"
  // Meta "format" = format, the shape fields above and "fit.<key>".
  void write_shape_meta(ContainerWriter& w, const std::string& format) const;
  // The same back, each field range-checked; errors begin with `what` (the
  // file kind and its label).
  void read_shape_meta(const ContainerReader& r, const std::string& format, const std::string& what);
};

}  // namespace kvcodec::cache_impl

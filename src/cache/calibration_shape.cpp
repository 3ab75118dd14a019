#include "cache/calibration_shape.hpp"

#include <cmath>
#include <cstdlib>

#include "cache/saved_meta.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec::cache_impl {

std::string CalibrationShape::shape_string() const {
  return "n_layers=" + std::to_string(n_layers) + ", n_kv_heads=" + std::to_string(n_kv_heads) +
         ", head_dim=" + std::to_string(head_dim) + ", rope_theta=" + double_text(rope_theta);
}

void CalibrationShape::write_shape_meta(ContainerWriter& w, const std::string& format) const {
  w.set_meta("format", format);
  w.set_meta("n_layers", std::to_string(n_layers));
  w.set_meta("n_kv_heads", std::to_string(n_kv_heads));
  w.set_meta("head_dim", std::to_string(head_dim));
  w.set_meta("rope_theta", double_text(rope_theta));
  w.set_meta("config_hash", config_hash);
  for (const auto& [k, v] : info) w.set_meta("fit." + k, v);
}

void CalibrationShape::read_shape_meta(const ContainerReader& r, const std::string& format, const std::string& what) {
  if (r.meta_or_throw("format") != format)
    throw Error(ErrorCode::kFormat, what + ": format '" + r.meta_or_throw("format") + "', expected '" + format + "'");
  n_layers = int(meta_int(r, "n_layers", 1, 4096));
  n_kv_heads = int(meta_int(r, "n_kv_heads", 1, 4096));
  head_dim = int(meta_int(r, "head_dim", 2, 4096));
  const std::string& v = r.meta_or_throw("rope_theta");
  char* end = nullptr;
  rope_theta = std::strtod(v.c_str(), &end);
  if (v.empty() || end != v.c_str() + v.size() || !std::isfinite(rope_theta) || rope_theta <= 0)
    throw Error(ErrorCode::kFormat, what + ": rope_theta '" + v + "' is not a positive number");
  config_hash = r.meta_or_throw("config_hash");
  info.clear();
  for (const auto& [k, value] : r.meta())
    if (k.rfind("fit.", 0) == 0) info[k.substr(4)] = value;
}

}  // namespace kvcodec::cache_impl

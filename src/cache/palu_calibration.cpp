// The calibration file of calibrated PALU (its layout: palu_calibration.hpp):
// fitting, writing, parsing with every field checked, the shared copy.
#include "cache/palu_calibration.hpp"

#include <cmath>

#include "cache/saved_meta.hpp"
#include "cache/shared_file.hpp"
#include "cache/streams.hpp"
#include "core/held_bytes.hpp"
#include "core/mmap_file.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec {
namespace {

std::string section_name(int layer, bool is_key, int group) {
  return "layer." + std::to_string(layer) + (is_key ? ".key." : ".value.") + std::to_string(group);
}

size_t basis_bytes(int dim) { return 2 + 8 * size_t(dim) + 4 * size_t(dim) * size_t(dim); }

std::vector<uint8_t> serialize_basis(const palu::Eigenbasis& e) {
  ByteWriter w;
  w.u16(uint16_t(e.dim));
  for (double v : e.lambda) w.f64(v);
  for (double v : e.vectors) w.f32(float(v));
  return w.take();
}

palu::Eigenbasis parse_basis(std::span<const uint8_t> bytes, int expected_dim, const std::string& where) {
  ByteReader r(bytes, where);
  palu::Eigenbasis e;
  e.dim = r.u16();
  if (e.dim != expected_dim)
    throw Error(ErrorCode::kFormat, where + ": dim " + std::to_string(e.dim) + ", expected " + std::to_string(expected_dim));
  if (bytes.size() != basis_bytes(e.dim))
    throw Error(ErrorCode::kFormat, where + ": " + std::to_string(bytes.size()) + " bytes, expected " +
                                        std::to_string(basis_bytes(e.dim)) + " for dim " + std::to_string(e.dim));
  // Little-endian f64 / f32 as serialize_basis writes them (the size was
  // checked against the bytes above, so these reads cannot run short).
  e.lambda.resize(size_t(e.dim));
  for (double& v : e.lambda) v = r.f64();
  for (int k = 0; k < e.dim; ++k) {
    const double v = e.lambda[size_t(k)];
    if (!std::isfinite(v) || v < 0 || (k > 0 && v > e.lambda[size_t(k) - 1]))
      throw Error(ErrorCode::kFormat, where + ": eigenvalue " + std::to_string(k) + " = " + std::to_string(v) +
                                          " is not finite, >= 0 and <= the one before");
  }
  e.vectors.resize(size_t(e.dim) * e.dim);
  for (size_t i = 0; i < e.vectors.size(); ++i) {
    const float f = r.f32();
    if (!std::isfinite(f)) throw Error(ErrorCode::kFormat, where + ": eigenvector entry " + std::to_string(i) + " is not finite");
    e.vectors[i] = f;
  }
  // Orthonormal columns, to f32 rounding: anything else is not a basis.
  for (int a = 0; a < e.dim; ++a)
    for (int b = a; b < e.dim; ++b) {
      double dot = 0.0;
      for (int i = 0; i < e.dim; ++i) dot += e.vectors[size_t(i) * e.dim + a] * e.vectors[size_t(i) * e.dim + b];
      if (std::abs(dot - (a == b ? 1.0 : 0.0)) > 1e-3)
        throw Error(ErrorCode::kFormat, where + ": eigenvectors " + std::to_string(a) + " and " + std::to_string(b) +
                                            " are not orthonormal (dot " + std::to_string(dot) + ")");
    }
  return e;
}

}  // namespace

int PaluCalibration::group_dim(int group) const {
  return joint ? groups()[size_t(group)].second * head_dim : head_dim;
}

std::vector<uint8_t> PaluCalibration::serialize() const {
  const size_t n_groups = groups().size();
  ContainerWriter w(ContainerKind::kCalibration);
  write_shape_meta(w, "palu-calibration");
  w.set_meta("version", std::to_string(kVersion));
  w.set_meta("group_mode", joint ? "joint" : "shared");
  w.set_meta("n_head_groups", std::to_string(n_groups));
  for (int l = 0; l < n_layers; ++l)
    for (const bool is_key : {true, false}) {
      const auto& per_group = (is_key ? keys : values).at(size_t(l));
      if (per_group.size() != n_groups)
        throw Error(ErrorCode::kInternal, "PALU calibration: layer " + std::to_string(l) + " has " +
                                              std::to_string(per_group.size()) + " groups, expected " +
                                              std::to_string(n_groups));
      for (size_t g = 0; g < n_groups; ++g) w.add_section(section_name(l, is_key, int(g)), serialize_basis(per_group[g]));
    }
  return w.finish();
}

void PaluCalibration::write_file(const std::string& path) const {
  const std::vector<uint8_t> bytes = serialize();
  write_file_atomic(path, bytes.data(), bytes.size());
}

PaluCalibration PaluCalibration::parse(const uint8_t* data, size_t size, const std::string& label) {
  const ContainerReader r = ContainerReader::parse(data, size, {}, label);
  r.expect_kind(ContainerKind::kCalibration);
  const std::string what = "PALU calibration " + label;
  PaluCalibration c;
  c.read_shape_meta(r, "palu-calibration", what);
  if (cache_impl::meta_int(r, "version", 1, 1 << 20) != kVersion)
    throw Error(ErrorCode::kFormat, what + ": version " + r.meta_or_throw("version") + ", this build reads " +
                                        std::to_string(kVersion));
  if (c.head_dim % 2 != 0)
    throw Error(ErrorCode::kFormat, what + ": head_dim " + std::to_string(c.head_dim) + " is odd (RoPE pairs dimensions)");
  c.n_head_groups = int(cache_impl::meta_int(r, "n_head_groups", 1, c.n_kv_heads));
  const std::string mode = r.meta_or_throw("group_mode");
  if (mode != "shared" && mode != "joint")
    throw Error(ErrorCode::kFormat, what + ": group_mode '" + mode + "', expected shared or joint");
  c.joint = mode == "joint";
  const size_t n_groups = c.groups().size();
  for (int g = 0; g < int(n_groups); ++g)
    if (c.group_dim(g) > 65535) throw Error(ErrorCode::kFormat, what + ": group vectors exceed 65535 values");
  size_t expected_sections = 0;
  for (int l = 0; l < c.n_layers; ++l)
    for (const bool is_key : {true, false}) {
      auto& per_group = (is_key ? c.keys : c.values).emplace_back();
      for (int g = 0; g < int(n_groups); ++g) {
        const std::string name = section_name(l, is_key, g);
        if (!r.has(name)) throw Error(ErrorCode::kFormat, what + ": section " + name + " is missing");
        per_group.push_back(parse_basis(r.section(name), c.group_dim(g), what + ", section " + name));
        ++expected_sections;
      }
    }
  if (r.section_names().size() != expected_sections)
    throw Error(ErrorCode::kFormat, what + ": " + std::to_string(r.section_names().size()) + " sections, expected " +
                                        std::to_string(expected_sections));
  return c;
}

PaluCalibration PaluCalibration::read_file(const std::string& path) {
  // A few MB for a 32-layer model; refuse anything absurd before allocating.
  const std::vector<uint8_t> bytes = read_file_bytes(path, uint64_t(1) << 31);
  return parse(bytes.data(), bytes.size(), path);
}

std::shared_ptr<const PaluCalibration> PaluCalibration::load_shared(const std::string& path) {
  return cache_impl::load_shared_file<PaluCalibration>(path, "PALU calibration file", &PaluCalibration::read_file);
}

uint64_t PaluCalibration::layer_bytes(int layer, bool is_key) const {
  uint64_t n = 0;
  for (const auto& e : (is_key ? keys : values).at(size_t(layer))) n += basis_bytes(e.dim);
  return n;
}

uint64_t PaluCalibration::params_bytes() const {
  uint64_t n = 0;
  for (int l = 0; l < n_layers; ++l) n += layer_bytes(l, true) + layer_bytes(l, false);
  return n;
}

uint64_t PaluCalibration::held_bytes() const {
  uint64_t n = sizeof(*this);
  for (const auto* list : {&keys, &values})
    for (const auto& per_group : *list)
      for (const auto& e : per_group) n += sizeof(e) + kvcodec::held_bytes(e.lambda) + kvcodec::held_bytes(e.vectors);
  return n;
}

PaluCalibration fit_palu_calibration(int n_layers, int n_kv_heads, int head_dim, double rope_theta,
                                     const std::string& config_hash, const std::vector<std::vector<float>>& keys,
                                     const std::vector<std::vector<float>>& values, int64_t tokens, bool joint,
                                     int n_head_groups) {
  PaluCalibration c;
  c.n_layers = n_layers;
  c.n_kv_heads = n_kv_heads;
  c.head_dim = head_dim;
  c.rope_theta = rope_theta;
  c.joint = joint;
  c.n_head_groups = int(palu::split_head_groups(n_kv_heads, n_head_groups).size());
  c.config_hash = config_hash;
  c.info["tokens_per_layer"] = std::to_string(tokens);
  const int64_t V = int64_t(n_kv_heads) * head_dim;
  if (int(keys.size()) != n_layers || int(values.size()) != n_layers)
    throw Error(ErrorCode::kInvalidArgument, "PALU calibration: samples for " + std::to_string(keys.size()) +
                                                 " layers, expected " + std::to_string(n_layers));
  std::vector<float> x;
  for (int l = 0; l < n_layers; ++l)
    for (const bool is_key : {true, false}) {
      const std::vector<float>& s = (is_key ? keys : values)[size_t(l)];
      if (int64_t(s.size()) != tokens * V)
        throw Error(ErrorCode::kInvalidArgument, "PALU calibration: layer " + std::to_string(l) + " holds " +
                                                     std::to_string(s.size()) + " values, expected tokens * H_kv * D");
      auto& per_group = (is_key ? c.keys : c.values).emplace_back();
      for (auto [first, count] : c.groups()) {
        // The group's heads are adjacent in a token: count * D values, one
        // vector (joint) or count vectors of D (shared).
        x.resize(size_t(tokens * count * head_dim));
        for (int64_t t = 0; t < tokens; ++t)
          std::memcpy(x.data() + t * count * head_dim, s.data() + t * V + int64_t(first) * head_dim,
                      size_t(count) * head_dim * sizeof(float));
        const int dim = joint ? count * head_dim : head_dim;
        per_group.push_back(palu::gram_eigenbasis(x.data(), int64_t(x.size()) / dim, dim));
      }
    }
  return c;
}

void check_palu_calibration_matches(const PaluCalibration& cal, const CacheConfig& config, const std::string& path) {
  if (cal.n_layers == config.n_layers && cal.n_kv_heads == config.n_kv_heads && cal.head_dim == config.head_dim &&
      cal.rope_theta == config.rope_theta)
    return;
  PaluCalibration model;
  model.n_layers = config.n_layers;
  model.n_kv_heads = config.n_kv_heads;
  model.head_dim = config.head_dim;
  model.rope_theta = config.rope_theta;
  throw Error(ErrorCode::kShapeMismatch, "PALU calibration " + path + " was fitted for a model with " +
                                             cal.shape_string() + "; this cache has " + model.shape_string());
}

}  // namespace kvcodec

// The calibration file of calibrated KVTC (its layout: kvtc_calibrated.hpp):
// writing, parsing with every field checked, the per-process shared copy.
#include <xxhash.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>

#include "cache/kvtc_calibrated.hpp"
#include "cache/saved_meta.hpp"
#include "cache/shared_file.hpp"
#include "core/held_bytes.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec {


std::string hash_hex(const void* data, size_t size) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)XXH3_64bits(data, size));
  return buf;
}

std::vector<uint8_t> KvtcCalibration::serialize() const {
  if (int(keys.size()) != n_layers || int(values.size()) != n_layers)
    throw Error(ErrorCode::kInternal, "calibration: params for " + std::to_string(keys.size()) + "/" +
                                          std::to_string(values.size()) + " layers, expected " +
                                          std::to_string(n_layers));
  const auto scales_ok = [&](const std::vector<std::vector<float>>& sc) {
    if (sc.empty()) return !weighted();
    if (int(sc.size()) != n_layers) return false;
    for (const auto& v : sc) {
      if (int(v.size()) != vector_dim()) return false;
      for (float x : v)
        if (!(x > 0.0f) || !std::isfinite(x)) return false;
    }
    return true;
  };
  if (refined() && (int(key_refine.size()) != n_layers || int(value_refine.size()) != n_layers))
    throw Error(ErrorCode::kInternal, "calibration: refinement params for " + std::to_string(key_refine.size()) +
                                          "/" + std::to_string(value_refine.size()) + " layers, expected " +
                                          std::to_string(n_layers));
  if (!scales_ok(key_scale) || !scales_ok(value_scale))
    throw Error(ErrorCode::kInternal, "calibration: key/value scales must both be empty or hold " +
                                          std::to_string(n_layers) + " x " + std::to_string(vector_dim()) +
                                          " finite positive weights");
  ContainerWriter w(ContainerKind::kCalibration);
  write_shape_meta(w, "kvtc-calibration");
  for (int l = 0; l < n_layers; ++l) {
    for (const bool is_key : {true, false}) {
      ByteWriter b;
      (is_key ? keys : values)[size_t(l)].serialize(b);
      w.add_section("layer." + std::to_string(l) + (is_key ? ".key" : ".value"), b.take());
    }
    if (weighted()) {
      for (const bool is_key : {true, false}) {
        const auto& scale = (is_key ? key_scale : value_scale)[size_t(l)];
        ByteWriter b;
        b.f32s(scale.data(), scale.size());
        w.add_section("layer." + std::to_string(l) + (is_key ? ".key_scale" : ".value_scale"), b.take());
      }
    }
    if (refined()) {
      for (const bool is_key : {true, false}) {
        ByteWriter b;
        (is_key ? key_refine : value_refine)[size_t(l)].serialize(b);
        w.add_section("layer." + std::to_string(l) + (is_key ? ".key_refine" : ".value_refine"), b.take());
      }
    }
  }
  return w.finish();
}

void KvtcCalibration::write_file(const std::string& path) const {
  // Through the container writer for its atomic temporary-file + rename.
  const std::vector<uint8_t> bytes = serialize();
  const ContainerReader r = ContainerReader::parse(bytes.data(), bytes.size());
  ContainerWriter w(ContainerKind::kCalibration);
  for (const auto& [k, v] : r.meta()) w.set_meta(k, v);
  for (const auto& name : r.section_names()) {
    const auto s = r.section(name);
    w.add_section(name, std::vector<uint8_t>(s.begin(), s.end()));
  }
  w.write_file(path);
}

KvtcCalibration KvtcCalibration::parse(const uint8_t* data, size_t size, const std::string& label) {
  const ContainerReader r = ContainerReader::parse(data, size, {}, label);
  r.expect_kind(ContainerKind::kCalibration);
  KvtcCalibration c;
  c.read_shape_meta(r, "kvtc-calibration", "calibration " + label);
  if (int64_t(c.n_kv_heads) * c.head_dim > 65535)
    throw Error(ErrorCode::kFormat, "calibration " + label + ": n_kv_heads * head_dim = " +
                                        std::to_string(int64_t(c.n_kv_heads) * c.head_dim) + " exceeds 65535");
  const int dim = c.vector_dim();
  // One serialised HeadParams section (base or refinement), the file and
  // section named in any error.
  const auto read_params = [&](const std::string& name) {
    ByteReader in(r.section(name), "calibration " + name);
    kvtc::HeadParams p;
    try {
      // Held by every cache using it; the 8-bit projection for the caches'
      // encoders that take it (kvtc.int8).
      p = kvtc::HeadParams::deserialize(in, dim, kvtc::KernelSet::kHeld | kvtc::KernelSet::kProj8);
    } catch (const Error& e) {
      throw Error(e.code(), "calibration " + label + ", section " + name + ": " + e.what());
    }
    if (!in.at_end()) throw Error(ErrorCode::kFormat, "calibration " + label + ": trailing bytes in " + name);
    return p;
  };
  for (int l = 0; l < c.n_layers; ++l)
    for (const bool is_key : {true, false})
      (is_key ? c.keys : c.values)
          .push_back(read_params("layer." + std::to_string(l) + (is_key ? ".key" : ".value")));
  // Optional per-layer sections "layer.<l>.key_<suffix>" and
  // "layer.<l>.value_<suffix>": all layers or none; `read` gets each one.
  const auto read_optional = [&](const std::string& suffix, const std::string& kind, const auto& read) {
    if (!r.has("layer.0.key_" + suffix) && !r.has("layer.0.value_" + suffix)) return;
    for (int l = 0; l < c.n_layers; ++l)
      for (const bool is_key : {true, false}) {
        const std::string name = "layer." + std::to_string(l) + (is_key ? ".key_" : ".value_") + suffix;
        if (!r.has(name))
          throw Error(ErrorCode::kFormat, "calibration " + label + ": " + kind + " calibration without section " + name);
        read(name, is_key);
      }
  };
  // Optional weights, each dim finite positive f32.
  read_optional("scale", "weighted", [&](const std::string& name, bool is_key) {
    const auto bytes = r.section(name);
    if (bytes.size() != size_t(dim) * 4)
      throw Error(ErrorCode::kFormat, "calibration " + label + ": " + name + " holds " +
                                          std::to_string(bytes.size()) + " bytes, expected " +
                                          std::to_string(size_t(dim) * 4) + " (" + std::to_string(dim) + " f32)");
    ByteReader in(bytes, "calibration " + name);
    std::vector<float> scale = in.f32s(size_t(dim));
    for (int d = 0; d < dim; ++d)
      if (!(scale[size_t(d)] > 0.0f) || !std::isfinite(scale[size_t(d)]))
        throw Error(ErrorCode::kFormat, "calibration " + label + ": " + name + "[" + std::to_string(d) +
                                            "] = " + std::to_string(scale[size_t(d)]) +
                                            " is not a finite positive weight");
    (is_key ? c.key_scale : c.value_scale).push_back(std::move(scale));
  });
  // Optional refinement parameters.
  read_optional("refine", "refined", [&](const std::string& name, bool is_key) {
    (is_key ? c.key_refine : c.value_refine).push_back(read_params(name));
  });
  return c;
}

KvtcCalibration KvtcCalibration::read_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw Error(ErrorCode::kIo, "calibration: cannot open " + path);
  std::fseek(f, 0, SEEK_END);
  const long n = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  // Calibration files are a few MB; refuse anything absurd before allocating.
  if (n < 0 || n > (1l << 31)) {
    std::fclose(f);
    throw Error(ErrorCode::kFormat, "calibration: " + path + " has an unreadable or implausible size (" +
                                        std::to_string(n) + " bytes)");
  }
  std::vector<uint8_t> bytes(static_cast<size_t>(n));
  const size_t got = std::fread(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
  if (got != bytes.size()) throw Error(ErrorCode::kIo, "calibration: short read of " + path);
  return parse(bytes.data(), bytes.size(), path);
}

std::shared_ptr<const KvtcCalibration> KvtcCalibration::load_shared(const std::string& path) {
  // One parsed copy per file for the whole process: a model has one cache per
  // layer per sequence, and each must not re-read and re-build the tables.
  return cache_impl::load_shared_file<KvtcCalibration>(path, "calibration file", read_file);
}

uint64_t KvtcCalibration::held_bytes() const {
  uint64_t n = sizeof(*this) + kvcodec::held_bytes(key_scale) + kvcodec::held_bytes(value_scale);
  for (const auto* list : {&keys, &values, &key_refine, &value_refine}) {
    n += uint64_t(list->capacity()) * sizeof(kvtc::HeadParams);
    for (const auto& p : *list) n += p.params_held_bytes() + p.derived_held_bytes();
  }
  return n;
}

uint64_t KvtcCalibration::params_bytes() const {
  uint64_t n = 0;
  for (const auto& p : keys) n += p.serialized_size();
  for (const auto& p : values) n += p.serialized_size();
  for (const auto& p : key_refine) n += p.serialized_size();
  for (const auto& p : value_refine) n += p.serialized_size();
  return n;
}

void check_calibration_matches(const KvtcCalibration& cal, const CacheConfig& config, double rope_theta,
                               const std::string& path) {
  const bool same = cal.n_layers == config.n_layers && cal.n_kv_heads == config.n_kv_heads &&
                    cal.head_dim == config.head_dim && cal.rope_theta == rope_theta;
  if (!same) {
    KvtcCalibration model;
    model.n_layers = config.n_layers;
    model.n_kv_heads = config.n_kv_heads;
    model.head_dim = config.head_dim;
    model.rope_theta = rope_theta;
    throw Error(ErrorCode::kShapeMismatch, "kvtc calibration " + path + " was fitted for a model with " +
                                               cal.shape_string() + "; this cache has " + model.shape_string());
  }
}

}  // namespace kvcodec

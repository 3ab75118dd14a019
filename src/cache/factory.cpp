// The method registry: make_cache, load_cache, list_methods (DESIGN 3, 9).
//
// Every method is one row of method_registry(): its name, description,
// fields with defaults, and a maker that validates the settings and builds the
// cache. Adding a method is adding a row (the kvtc row comes from src/kvtc).
//
// Saved caches carry, as container meta, "method", "settings" and the
// "config.*" keys (see stream_cache.cpp); load_cache() rebuilds the cache from
// them with make_cache() and then calls load(). A method living elsewhere
// (kvtc) writes the same meta keys so load_cache() can find it.
#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "cache/kvtc_cache.hpp"
#include "cache/palu_calibration.hpp"
#include "cache/saved_meta.hpp"
#include "cache/settings.hpp"
#include "cache/streams.hpp"
#include "kvcodec/container.hpp"

namespace kvcodec {
namespace {

using Maker = std::unique_ptr<KVCache> (*)(const CacheConfig&, const Settings&);

struct MethodEntry {
  MethodInfo info;
  Maker make;
};

const std::vector<FieldInfo> kIntFields = {
    {"group_size", "32", "values per quantization group along head_dim (must divide it)"}};
const std::vector<FieldInfo> kKiviFields = {
    {"group_size", "32", "tokens per key group (per-channel) and channels per value group (must divide head_dim)"},
    {"residual", "128", "newest tokens kept raw (f16/bf16) and counted"}};
const std::vector<FieldInfo> kPaluFields = {
    {"rank", "none", "latents per projection; none: smallest rank reaching energy_threshold"},
    {"energy_threshold", "0.999", "share of sum sigma^2 the rank must keep, in (0, 1]"},
    {"n_head_groups", "4", "contiguous head groups, clamped to [1, H_kv]"},
    {"group_mode", "shared", "shared: one D x r basis per group, r latents per head; joint: heads concatenated"},
    {"hi_bit", "8", "code width of the highest-variance latent channels, [1, 8]"},
    {"lo_bit", "4", "code width of the other latent channels, [1, 8]"},
    {"hi_fraction", "0.25", "share of latent channels at hi_bit (at least one), [0, 1]"},
    {"group_size", "32", "tokens per quantization group of the latents"},
    {"quantize_values", "true", "false: value latents stay f16"},
    {"hadamard", "false", "rotate latents by a seeded random orthogonal matrix before quantizing"},
    {"min_fit_tokens", "", "tokens needed before the projections are fitted; default 2 * head_dim"},
    {"key_energy_threshold", "", "energy_threshold for the keys only; default energy_threshold"},
    {"value_energy_threshold", "", "energy_threshold for the values only; default energy_threshold"},
    {"calibration", "", "a PALU calibration file (kvcodec calibrate --method palu): projections fitted offline, "
                        "no SVD at prefill; hadamard then means Walsh-Hadamard blocks per bit class"},
    {"sinks", "", "calibrated: first tokens kept raw and counted; default 4"}};

void check_config(const std::string& method, const CacheConfig& c) {
  if (c.n_kv_heads < 1 || c.n_kv_heads > 4096)
    throw_config_error(method + ".n_kv_heads", std::to_string(c.n_kv_heads), "an integer in [1, 4096]");
  if (c.head_dim < 1 || c.head_dim > 4096)
    throw_config_error(method + ".head_dim", std::to_string(c.head_dim), "an integer in [1, 4096]");
  if (c.n_layers < 1 || c.layer < 0 || c.layer >= c.n_layers)
    throw_config_error(method + ".layer", std::to_string(c.layer),
                       "an integer in [0, n_layers) with n_layers = " + std::to_string(c.n_layers) + " >= 1");
}

int64_t group_dividing_dim(const SettingsReader& r, const CacheConfig& c) {
  const int64_t g = r.get_int("group_size", 32, 1, c.head_dim);
  if (c.head_dim % g != 0)
    r.fail("group_size", "a divisor of head_dim = " + std::to_string(c.head_dim));
  return g;
}

std::unique_ptr<KVCache> make_fp16(const CacheConfig& c, const Settings& s) {
  SettingsReader r("fp16", s, {});
  return cache_impl::make_stream_cache("fp16", c, s, cache_impl::make_raw_stream(), cache_impl::make_raw_stream());
}

template <int Bits>
std::unique_ptr<KVCache> make_int(const CacheConfig& c, const Settings& s) {
  const std::string name = Bits == 8 ? "int8" : "int4";
  SettingsReader r(name, s, kIntFields);
  const int64_t g = group_dividing_dim(r, c);
  return cache_impl::make_stream_cache(name, c, s, cache_impl::make_symmetric_stream(Bits, g),
                                       cache_impl::make_symmetric_stream(Bits, g));
}

std::unique_ptr<KVCache> make_kivi2(const CacheConfig& c, const Settings& s) {
  SettingsReader r("kivi2", s, kKiviFields);
  const int64_t g = group_dividing_dim(r, c);
  const int64_t residual = r.get_int("residual", 128, 0, 1 << 20);
  return cache_impl::make_stream_cache("kivi2", c, s, cache_impl::make_kivi_key_stream(g, residual, 2),
                                       cache_impl::make_kivi_value_stream(g, residual, 2));
}

std::unique_ptr<KVCache> make_palu(const CacheConfig& c, const Settings& s) {
  SettingsReader r("palu", s, kPaluFields);
  cache_impl::PaluOptions o;
  std::shared_ptr<const PaluCalibration> cal;
  if (const std::string* path = r.find("calibration")) {
    // The grouping is the calibration's; nothing is fitted per sequence.
    for (const char* f : {"group_mode", "n_head_groups", "min_fit_tokens"})
      if (r.find(f)) r.fail(f, "unset with palu.calibration (the calibration fixes it)");
    cal = PaluCalibration::load_shared(*path);
    check_palu_calibration_matches(*cal, c, *path);
    o.calibration = cal;
    o.calibration_path = *path;
    o.layer = c.layer;
    o.rope_theta = c.rope_theta;
    o.sinks = r.get_int("sinks", 4, 0, 1 << 20);
  } else if (r.find("sinks")) {
    r.fail("sinks", "unset without palu.calibration (the per-sequence fit keeps no sinks)");
  }
  o.joint = cal ? cal->joint : r.get_choice("group_mode", "shared", {"shared", "joint"}) == "joint";
  o.n_head_groups = cal ? cal->n_head_groups : int(r.get_int("n_head_groups", 4, 1, 4096));
  // The smallest group has H / G heads: in joint mode its vectors have that many times D values.
  const int64_t groups = std::clamp<int64_t>(o.n_head_groups, 1, c.n_kv_heads);
  const int64_t max_rank = o.joint ? (c.n_kv_heads / groups) * c.head_dim : c.head_dim;
  o.fit.rank = int(r.get_optional_int("rank", 1, max_rank).value_or(0));
  // Defaults: the best measured setting within 1% perplexity (docs/eval.md, "palu's defaults":
  // chosen on windows 9-12 of the default corpus; the paper's 50% rank at 3-4 bits is +90% there).
  o.fit.energy_threshold = r.get_double("energy_threshold", 0.999, 0.0, 1.0, /*lo_open=*/true);
  const double key_energy = r.get_double("key_energy_threshold", o.fit.energy_threshold, 0.0, 1.0, /*lo_open=*/true);
  const double value_energy =
      r.get_double("value_energy_threshold", o.fit.energy_threshold, 0.0, 1.0, /*lo_open=*/true);
  o.fit.hi_bit = int(r.get_int("hi_bit", 8, 1, 8));
  o.fit.lo_bit = int(r.get_int("lo_bit", 4, 1, 8));
  o.fit.hi_fraction = r.get_double("hi_fraction", 0.25, 0.0, 1.0);
  o.fit.hadamard = r.get_bool("hadamard", false);
  o.group_size = r.get_int("group_size", 32, 1, 1 << 16);
  o.quantize = true;
  const bool quantize_values = r.get_bool("quantize_values", true);
  o.min_fit_tokens = r.get_int("min_fit_tokens", 2 * int64_t(c.head_dim), 1, 1 << 20);
  cache_impl::PaluOptions ov = o;
  ov.quantize = quantize_values;
  o.fit.energy_threshold = key_energy;
  o.is_key = true;
  ov.fit.energy_threshold = value_energy;
  return cache_impl::make_stream_cache("palu", c, s, cache_impl::make_palu_stream(o), cache_impl::make_palu_stream(ov));
}

const std::vector<MethodEntry>& method_registry() {
  static const std::vector<MethodEntry> registry = {
      {{"fp16", "no compression: the input's 16-bit values (bf16 kept as bf16, f32 stored as f16)", {}}, make_fp16},
      {{"int8", "per-token groups along head_dim, f16 scale, 8-bit symmetric codes (llama.cpp q8_0 style)",
        kIntFields},
       make_int<8>},
      {{"int4", "per-token groups along head_dim, f16 scale, 4-bit codes (llama.cpp q4_0 style)", kIntFields},
       make_int<4>},
      {{"kivi2", "KIVI 2-bit: keys per-channel over token groups, values per-token, newest tokens raw",
        kKiviFields},
       make_kivi2},
      {{"palu", "PALU: low-rank latents per head group (SVD at prefill, or calibrated offline), mixed-bit quantized",
        kPaluFields},
       make_palu},
      {kvtc_method_info(), make_kvtc_cache},
  };
  return registry;
}

const MethodEntry& find_method(const std::string& method) {
  const auto& reg = method_registry();
  for (const auto& e : reg)
    if (e.info.name == method) return e;
  std::string known;
  for (const auto& e : reg) known += (known.empty() ? "" : ", ") + e.info.name;
  throw Error(ErrorCode::kInvalidArgument, "unknown cache method '" + method + "' (known: " + known + ")");
}

}  // namespace

std::vector<MethodInfo> list_methods() {
  std::vector<MethodInfo> out;
  for (const auto& e : method_registry()) out.push_back(e.info);
  return out;
}

std::unique_ptr<KVCache> make_cache(const std::string& method, const CacheConfig& config, const Settings& settings) {
  const MethodEntry& e = find_method(method);
  check_config(method, config);
  return e.make(config, settings);
}

std::unique_ptr<KVCache> load_cache(const uint8_t* data, size_t size) {
  const ContainerReader c = ContainerReader::parse(data, size, {}, "saved cache");
  c.expect_kind(ContainerKind::kCache);
  CacheConfig cfg;
  cfg.layer = int(cache_impl::meta_int(c, "config.layer", 0, 1 << 20));
  cfg.n_layers = int(cache_impl::meta_int(c, "config.n_layers", 1, 1 << 20));
  cfg.n_kv_heads = int(cache_impl::meta_int(c, "config.n_kv_heads", 1, 4096));
  cfg.head_dim = int(cache_impl::meta_int(c, "config.head_dim", 1, 4096));
  const std::string& theta = c.meta_or_throw("config.rope_theta");
  char* end = nullptr;
  cfg.rope_theta = std::strtod(theta.c_str(), &end);
  if (theta.empty() || end != theta.c_str() + theta.size())
    throw Error(ErrorCode::kFormat, "saved cache meta config.rope_theta = '" + theta + "' is not a number");
  const std::string& method = c.meta_or_throw("method");
  Settings settings;
  try {
    settings = decode_settings(c.meta_or_throw("settings"));
    auto cache = make_cache(method, cfg, settings);
    cache->load(data, size);
    return cache;
  } catch (const Error& e) {
    // A config or method error here means the saved bytes are bad, not the caller's settings.
    if (e.code() == ErrorCode::kConfig || e.code() == ErrorCode::kInvalidArgument)
      throw Error(ErrorCode::kFormat, std::string("saved cache: ") + e.what());
    throw;
  }
}

}  // namespace kvcodec

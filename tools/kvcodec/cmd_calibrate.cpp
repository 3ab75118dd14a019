// kvcodec calibrate: fit calibrated-KVTC parameters offline (DESIGN 4, issue 5)
// and write them to a calibration file for kvtc.calibration=FILE; with
// --method palu, PALU's per-layer eigenbases for palu.calibration=FILE
// (issue 21, cache/palu_calibration.hpp).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <memory>
#include <string>

#include "cache/kvtc_cache.hpp"
#include "cache/palu_calibration.hpp"
#include "commands.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"
#include "model/calibrate.hpp"
#include "model/eval.hpp"
#include "model/paths.hpp"

namespace kvcodec::cli {
namespace {

struct CalibrateArgs {
  std::string model_dir;
  std::string tokens;
  std::string windows = "16-31";
  std::string output;
  std::vector<std::string> sets;
  int64_t window_length = 2048;
  int64_t tokens_per_window = 0;
  int sinks = 4;
  int threads = 0;
  std::string target_ratios;
  std::string allocators;
  std::string weightings;
  std::string quantizers;
  bool cross_layer = false;
  std::string method = "kvtc";
};

model::CalibrationProgress progress_printer(std::chrono::steady_clock::time_point t0) {
  return [t0](int64_t done, int64_t total, const std::string& what) {
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "[%6.1fs] %lld/%lld %s\n", sec, (long long)done, (long long)total, what.c_str());
  };
}

// --method palu: per layer, tensor and head group the eigenbasis of the
// calibration tokens (keys with RoPE removed); rank and bits are cache settings.
void run_palu_calibrate(const CalibrateArgs& a, const model::CalibrateOptions& o, const model::LlamaModel& m,
                        const std::string& token_path, const std::string& dir,
                        std::chrono::steady_clock::time_point t0) {
  Settings s = settings_for_method(a.sets, "palu");
  bool joint = false;
  int n_groups = 4;
  for (const auto& [field, value] : s) {
    if (field == "group_mode" && (value == "shared" || value == "joint")) {
      joint = value == "joint";
    } else if (field == "n_head_groups" && !value.empty() &&
               value.find_first_not_of("0123456789") == std::string::npos && value.size() < 5 && std::stoi(value) >= 1) {
      n_groups = std::stoi(value);
    } else {
      throw_config_error("palu." + field, value,
                         "group_mode=shared|joint or n_head_groups=N >= 1 (the only calibration fields; rank and bits "
                         "are cache settings)");
    }
  }
  if (!a.target_ratios.empty() || !a.allocators.empty() || !a.weightings.empty() || !a.quantizers.empty() ||
      a.cross_layer)
    throw_config_error("--method", "palu", "without the kvtc-only options (--target-ratios, --allocators, "
                                           "--weightings, --quantizers, --cross-layer)");
  const std::vector<int32_t> tokens = model::load_u16_tokens(token_path);
  const model::CalibrationSamples samples = model::collect_calibration_samples(m, tokens, o, progress_printer(t0));
  const model::ModelConfig& c = m.config();
  PaluCalibration cal = fit_palu_calibration(c.n_layers, c.n_kv_heads, c.head_dim, c.rope_theta,
                                             model::model_config_hash(dir), samples.keys, samples.values,
                                             samples.tokens, joint, n_groups);
  cal.info["windows"] = a.windows;
  cal.info["sinks"] = std::to_string(o.sinks);
  cal.write_file(a.output);
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("wrote %s: palu, %s, %s x %d head groups, %llu parameter bytes, %lld tokens per layer, %.1f s\n",
              a.output.c_str(), cal.shape_string().c_str(), joint ? "joint" : "shared", cal.n_head_groups,
              (unsigned long long)cal.params_bytes(), (long long)samples.tokens, sec);
}

// "a,b,,c" -> {a, b, c}.
std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> items;
  std::string item;
  for (char ch : list + ",") {
    if (ch == ',') {
      if (!item.empty()) items.push_back(item);
      item.clear();
    } else {
      item += ch;
    }
  }
  return items;
}

void run_calibrate(const CalibrateArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string dir = a.model_dir.empty() ? model::default_model_dir() : a.model_dir;
  const std::string token_path = a.tokens.empty() ? model::default_eval_tokens(dir) : a.tokens;
  if (token_path.empty()) throw Error(ErrorCode::kNotFound, "no --tokens given and no eval_tokens.u16 found");
  model::CalibrateOptions o;
  {
    const auto dash = a.windows.find('-');
    try {
      size_t used = 0;
      const long first = std::stol(a.windows.substr(0, dash), &used);
      const long last = dash == std::string::npos ? first : std::stol(a.windows.substr(dash + 1));
      if (last < first || first < 0) throw std::invalid_argument("order");
      o.first_window = first;
      o.windows = last - first + 1;
    } catch (const std::exception&) {
      throw_config_error("--windows", a.windows, "a window range a-b with 0 <= a <= b, e.g. 16-31");
    }
  }
  o.window_length = a.window_length;
  o.tokens_per_window = a.tokens_per_window;
  o.sinks = a.sinks;
  const model::LlamaModel m = model::LlamaModel::load(dir);
  if (a.method == "palu") return run_palu_calibrate(a, o, m, token_path, dir, t0);
  if (a.method != "kvtc") throw_config_error("--method", a.method, "kvtc or palu");
  // Codec fields through the same validation as the cache (local-mode parse:
  // bit_budget scales with the vector, so it is re-read for H_kv * D).
  Settings s = settings_for_method(a.sets, "kvtc");
  CacheConfig probe;
  probe.n_layers = m.config().n_layers;
  probe.n_kv_heads = 1;
  probe.head_dim = m.config().kv_dim();
  probe.rope_theta = m.config().rope_theta;
  for (const char* f : {"mode", "calibration", "sinks", "window", "block", "rope_theta", "min_fit_tokens"})
    if (s.count(f)) throw_config_error(std::string("kvtc.") + f, s.at(f), "unset for calibrate (a cache setting)");
  // Calibrate-only fields, taken out before the cache's parser sees them:
  // allocator=measured (DP on measured distortion and rate) and per-tensor
  // target ratios.
  // The default is `measured`: at the same target (payload 20x) it gave a
  // 26% lower KL than `dp` (docs/history/calibrated-sessions.md, "Allocation: measured DP vs the beta model").
  if (!s.count("allocator") || s.at("allocator") == "measured") {
    o.measured_allocation = true;
    s.erase("allocator");
  }
  auto take_ratio = [&](const char* field, double& dst) {
    if (!s.count(field)) return;
    const std::string v = s.at(field);
    char* end = nullptr;
    dst = std::strtod(v.c_str(), &end);
    if (v.empty() || end != v.c_str() + v.size() || !(dst >= 1.0) || !(dst <= 1000.0))
      throw_config_error(std::string("kvtc.") + field, v, "a ratio in [1, 1000]");
    s.erase(field);
  };
  // weighting=attention|none [attention]: distortion weighted by each
  // dimension's effect on attention (model::CalibrateOptions).
  if (s.count("weighting")) {
    const std::string v = s.at("weighting");
    if (v != "attention" && v != "none") throw_config_error("kvtc.weighting", v, "attention or none");
    o.attention_weighting = v == "attention";
    s.erase("weighting");
  } else {
    o.attention_weighting = true;
  }
  // sensitivity=kl|none [kl]: one allocation across layers and K/V weighted
  // by each tensor's measured KL sensitivity (model::CalibrateOptions).
  const bool sensitivity_given = s.count("sensitivity") > 0;
  o.sensitivity_allocation = true;
  if (sensitivity_given) {
    const std::string v = s.at("sensitivity");
    if (v != "kl" && v != "none") throw_config_error("kvtc.sensitivity", v, "kl or none");
    o.sensitivity_allocation = v == "kl";
    s.erase("sensitivity");
  }
  if (s.count("sensitivity_windows")) {
    const std::string v = s.at("sensitivity_windows");
    char* end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || end != v.c_str() + v.size() || n < 1 || n > o.windows)
      throw_config_error("kvtc.sensitivity_windows", v, "[1, number of calibration windows]");
    o.sensitivity_windows = int(n);
    s.erase("sensitivity_windows");
  }
  // sensitivity_window=W [0], sensitivity_block=B [16]: measure the KL
  // sensitivities as a streaming cache with a raw window of W tokens coding
  // blocks of B (model::CalibrateOptions::sensitivity_window); 0: whole prefix.
  for (const char* field : {"sensitivity_window", "sensitivity_block"}) {
    if (!s.count(field)) continue;
    const std::string v = s.at(field);
    char* end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    const bool is_window = std::string(field) == "sensitivity_window";
    if (v.empty() || end != v.c_str() + v.size() || n < (is_window ? 0 : 1) || n > 4096)
      throw_config_error(std::string("kvtc.") + field, v, is_window ? "[0, 4096] tokens" : "[1, 4096] tokens");
    (is_window ? o.sensitivity_window : o.sensitivity_block) = int(n);
    s.erase(field);
  }
  if (s.count("weight_floor")) {
    const std::string v = s.at("weight_floor");
    char* end = nullptr;
    o.weight_floor = std::strtod(v.c_str(), &end);
    if (v.empty() || end != v.c_str() + v.size() || !(o.weight_floor > 0.0) || !(o.weight_floor <= 1.0))
      throw_config_error("kvtc.weight_floor", v, "a number in (0, 1]");
    s.erase("weight_floor");
  }
  // quantizers=midtread|midrise [midtread] (measured allocator): the grids
  // the allocation chooses from (model::QuantizerFamily). midtread is the
  // default: on windows 0-7 at the same targets it gave +0.41% / +1.19%
  // perplexity where midrise gave +1.18% / +1.85% (docs/calibrated.md).
  o.quantizers = model::QuantizerFamily::kMidtread;
  if (s.count("quantizers")) {
    const std::string v = s.at("quantizers");
    if (v != "midrise" && v != "midtread") throw_config_error("kvtc.quantizers", v, "midrise or midtread");
    o.quantizers = v == "midtread" ? model::QuantizerFamily::kMidtread : model::QuantizerFamily::kMidrise;
    s.erase("quantizers");
  }
  // reconstruction=lattice|centroid|centroid_allocated [lattice] (measured
  // allocator): cells reconstructed at their calibration centroids
  // (model::Reconstruction; docs/calibrated.md). The GPU codec refuses
  // centroid calibrations.
  if (s.count("reconstruction")) {
    const std::string v = s.at("reconstruction");
    bool known = false;
    for (const auto r : {model::Reconstruction::kLattice, model::Reconstruction::kCentroid,
                         model::Reconstruction::kCentroidAllocated})
      if (v == model::reconstruction_name(r)) o.reconstruction = r, known = true;
    if (!known) throw_config_error("kvtc.reconstruction", v, "lattice, centroid or centroid_allocated");
    if (o.reconstruction != model::Reconstruction::kLattice && !o.measured_allocation)
      throw_config_error("kvtc.reconstruction", v, "allocator=measured (the centroids come from measured tables)");
    s.erase("reconstruction");
  }
  take_ratio("key_target_ratio", o.key_target_ratio);
  take_ratio("refine_ratio", o.refine_ratio);
  take_ratio("value_target_ratio", o.value_target_ratio);
  // The cache's local-mode preset is not calibrate's: its fields keep their own defaults.
  const KvtcSettings ks = parse_kvtc_settings(s, probe, KvtcDefaults::kPerField);
  o.codec = ks.codec;
  o.target_ratio = ks.target_ratio;
  if (o.measured_allocation && o.codec.basis_bits != 16)
    throw_config_error("kvtc.basis_bits", std::to_string(o.codec.basis_bits), "16 with allocator=measured");
  // Every setting is checked before the model runs (a bad one fails in
  // milliseconds, not after the samples): the variants are built first.
  // --target-ratios R1,R2,...: one fit per ratio from the same samples (the
  // model runs once), written to the output path with "{}" replaced by R.
  std::vector<std::string> ratios = split_list(a.target_ratios);
  if (!ratios.empty() && a.output.find("{}") == std::string::npos)
    throw_config_error("--output", a.output, "a path containing {} (replaced by each of --target-ratios)");
  if (ratios.empty()) ratios.push_back("");
  // --allocators / --weightings / --quantizers A,B: one calibration per
  // listed value from one model run, the output path's placeholder replaced
  // by it; each value must be one of `allowed`. Empty list: one pass ("").
  const auto variants = [&](const char* option, const std::string& list, const std::vector<std::string>& allowed,
                            const std::string& placeholder) {
    std::vector<std::string> values = split_list(list);
    std::string names;
    for (const auto& v : allowed) names += (names.empty() ? "" : ", ") + v;
    for (const auto& v : values)
      if (std::find(allowed.begin(), allowed.end(), v) == allowed.end())
        throw_config_error(option, list, "a comma-separated list of " + names);
    if (!values.empty() && a.output.find(placeholder) == std::string::npos)
      throw_config_error("--output", a.output,
                         "a path containing " + placeholder + " (replaced by each of " + option + ")");
    if (values.empty()) values.push_back("");
    return values;
  };
  const std::vector<std::string> allocators =
      variants("--allocators", a.allocators, {"measured", "dp", "rate"}, "{alloc}");
  const std::vector<std::string> weightings =
      variants("--weightings", a.weightings, {"none", "attention"}, "{weighting}");
  const std::vector<std::string> families = variants("--quantizers", a.quantizers, {"midrise", "midtread"}, "{quant}");
  const std::string hash = model::model_config_hash(dir);
  if (a.cross_layer) {
    // One cross-layer calibration per target (stored prefixes; xkvtc in eval).
    if (!a.allocators.empty() || !a.weightings.empty() || !a.quantizers.empty() || o.refine_ratio > 0)
      throw_config_error("--cross-layer", "set", "without --allocators / --weightings / --quantizers / refine_ratio");
    // Across layers the sensitivity scales each layer inside the one tensor
    // (model::fit_cross_layer_calibrations); off unless asked for.
    if (!sensitivity_given) o.sensitivity_allocation = false;
    if (o.sensitivity_window > 0 && !o.sensitivity_allocation)
      throw_config_error("kvtc.sensitivity_window", std::to_string(o.sensitivity_window),
                         "set only with kvtc.sensitivity=kl (it changes how the sensitivities are measured)");
    std::vector<double> targets;
    for (const std::string& r : ratios) {
      char* end = nullptr;
      const double t = r.empty() ? o.target_ratio : std::strtod(r.c_str(), &end);
      if ((!r.empty() && end != r.c_str() + r.size()) || !(t >= 1.0) || !(t <= 1000.0))
        throw_config_error("--target-ratios / kvtc.target_ratio", r.empty() ? "(unset)" : r,
                           "ratios in [1, 1000] (--cross-layer fits for a target ratio)");
      targets.push_back(t);
    }
    const std::vector<int32_t> tokens = model::load_u16_tokens(token_path);
    const model::CalibrationProgress progress = progress_printer(t0);
    const model::CalibrationSamples samples = model::collect_calibration_samples(m, tokens, o, progress);
    const auto cals = model::fit_cross_layer_calibrations(m.config(), hash, samples, o, targets, progress, &m);
    for (size_t i = 0; i < cals.size(); ++i) {
      std::string path = a.output;
      if (!ratios[i].empty()) path.replace(path.find("{}"), 2, ratios[i]);
      cals[i].write_file(path);
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("wrote %s: cross-layer over %d layers (%s), %llu parameter bytes, %lld tokens per layer, %.1f s\n",
                  path.c_str(), m.config().n_layers, cals[i].shape_string().c_str(),
                  (unsigned long long)cals[i].params_bytes(), (long long)samples.tokens, sec);
      std::fflush(stdout);
    }
    return;
  }
  std::vector<std::pair<model::CalibrateOptions, std::string>> fits;  // options and output path of each
  for (const std::string& qf : families)
  for (const std::string& wt : weightings)
  for (const std::string& al : allocators)
  for (const std::string& r : ratios) {
    model::CalibrateOptions oi = o;
    std::string path = a.output;
    if (!qf.empty()) {
      oi.quantizers = qf == "midtread" ? model::QuantizerFamily::kMidtread : model::QuantizerFamily::kMidrise;
      path.replace(path.find("{quant}"), 7, qf);
    }
    if (!wt.empty()) {
      oi.attention_weighting = wt == "attention";
      path.replace(path.find("{weighting}"), 11, wt);
    }
    if (!al.empty()) {
      oi.measured_allocation = al == "measured";
      if (al != "measured") oi.codec.allocator = al == "dp" ? kvtc::Allocator::kDp : kvtc::Allocator::kRate;
      path.replace(path.find("{alloc}"), 7, al);
    }
    if (!r.empty()) {
      char* end = nullptr;
      oi.target_ratio = std::strtod(r.c_str(), &end);
      if (end != r.c_str() + r.size() || !(oi.target_ratio >= 1.0) || !(oi.target_ratio <= 1000.0))
        throw_config_error("--target-ratios", a.target_ratios, "comma-separated ratios in [1, 1000]");
      path.replace(path.find("{}"), 2, r);
    }
    // By default the sensitivity allocation is on where it applies (measured
    // allocator, a ratio to share out); asked for explicitly elsewhere, the
    // fit refuses with the reason.
    if (!sensitivity_given)
      oi.sensitivity_allocation = oi.measured_allocation &&
                                  (oi.target_ratio > 0 || (oi.key_target_ratio > 0 && oi.value_target_ratio > 0));
    if (oi.sensitivity_window > 0 && !oi.sensitivity_allocation)
      throw_config_error("kvtc.sensitivity_window", std::to_string(oi.sensitivity_window),
                         "set only where the KL sensitivity allocation runs (measured allocator, a target ratio)");
    fits.emplace_back(std::move(oi), std::move(path));
  }
  const std::vector<int32_t> tokens = model::load_u16_tokens(token_path);
  const model::CalibrationProgress progress = progress_printer(t0);
  const model::CalibrationSamples samples = model::collect_calibration_samples(m, tokens, o, progress);
  for (const auto& [oi, path] : fits) {
    const KvtcCalibration cal = model::fit_calibration(m.config(), hash, samples, oi, progress, &m);
    cal.write_file(path);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("wrote %s: %s, %llu parameter bytes, %lld tokens per layer, %.1f s\n", path.c_str(),
                cal.shape_string().c_str(), (unsigned long long)cal.params_bytes(), (long long)samples.tokens, sec);
    std::fflush(stdout);
  }
}

}  // namespace

void register_calibrate(CLI::App& app) {
  auto args = std::make_shared<CalibrateArgs>();
  auto* cmd = app.add_subcommand("calibrate", "Fit calibrated-KVTC parameters (per-layer PCA, allocation, entropy models)");
  cmd->add_option("--model", args->model_dir, "HF Llama checkpoint folder (default: the shipped models/tinycode)");
  cmd->add_option("--tokens", args->tokens, "uint16 token windows (default: eval_tokens.u16 of the model)");
  cmd->add_option("--windows", args->windows, "Window range a-b used for calibration")->capture_default_str();
  cmd->add_option("--window-length", args->window_length, "Tokens per window in the file")->capture_default_str();
  cmd->add_option("--tokens-per-window", args->tokens_per_window, "Tokens of each window run (0: all)")
      ->capture_default_str();
  cmd->add_option("--sinks", args->sinks, "First tokens of each window left out of the fit")->capture_default_str();
  cmd->add_option("-o,--output", args->output, "Calibration file to write")->required();
  cmd->add_option("--set", args->sets, "kvtc.<field>=<value>: bit_budget, target_ratio, key_target_ratio, value_target_ratio, "
                                  "allocator (measured [default]|dp|rate), weighting (attention [default]|none), weight_floor [0.01], "
                                  "sensitivity (kl [default; none with --cross-layer]|none), sensitivity_windows [2], sensitivity_window (raw tokens while measuring the sensitivities as a stream; 0 [default]: whole prefix), sensitivity_block [16], quantizers (midtread [default]|midrise), reconstruction (lattice [default]|centroid|centroid_allocated), refine_ratio (refinement code's payload ratio; none by default), "
                                  "bit_choices, beta, coder, basis_bits");
  cmd->add_option("--target-ratios", args->target_ratios,
                  "Comma-separated target ratios: one calibration each from one model run; -o must contain {}");
  cmd->add_option("--allocators", args->allocators,
                  "Comma-separated allocators (measured, dp, rate): one calibration each; -o must contain {alloc}");
  cmd->add_option("--weightings", args->weightings,
                  "Comma-separated weightings (none, attention): one calibration each; -o must contain {weighting}");
  cmd->add_option("--quantizers", args->quantizers,
                  "Comma-separated quantizer families (midrise, midtread): one calibration each; -o must contain {quant}");
  cmd->add_flag("--cross-layer", args->cross_layer,
                "One codec per tensor over every layer of a token (stored prefixes: eval --protocol prefix, method "
                "xkvtc); with kvtc.target_ratio or --target-ratios; kvtc.sensitivity=kl scales each layer by its measured KL "
                "sensitivity instead of to unit RMS");
  cmd->add_option("--method", args->method,
                  "kvtc (default) or palu: PALU's per-layer eigenbases (--set palu.group_mode=shared|joint, "
                  "palu.n_head_groups=N [4]) for palu.calibration=FILE")
      ->capture_default_str();
  cmd->add_option("--threads", args->threads, "OpenMP threads (0: all cores)")->capture_default_str();
  cmd->callback([args] {
    if (args->threads < 0) throw_config_error("--threads", std::to_string(args->threads), ">= 0 (0: all cores)");
    if (args->threads > 0) omp_set_num_threads(args->threads);
    run_calibrate(*args);
  });
}

}  // namespace kvcodec::cli

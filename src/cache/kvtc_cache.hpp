// The KVTC streaming cache (DESIGN 3 and 4), local mode.
//
// Token layout along S for every head: [sinks raw][encoded blocks][raw tail].
// The basis, allocation, quantizer ranges and entropy models of every
// (batch, head) are fitted once, batched over B*H, at the first append that
// brings at least min_fit_tokens (sinks excluded), then frozen. Tokens leave
// the raw tail in blocks of `block` once `window` newer tokens follow them;
// a block's codes are never rewritten.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"
#include "kvtc/codec.hpp"

namespace kvcodec {

struct KvtcSettings {
  std::string mode = "local";
  kvtc::CodecOptions codec;
  int min_fit_tokens = 0;  // 0 -> 2 * D
  int block = 64;
  int sinks = 0;
  int window = 0;
  double target_ratio = 0.0;  // 0: none
  int threads = 1;
  double key_target_rel_mse = 0.0;    // rate allocator: per-tensor distortion targets
  double value_target_rel_mse = 0.0;
  // Calibrated mode (src/cache/kvtc_calibrated.hpp): the calibration file and
  // the RoPE base used to remove/re-apply RoPE on keys (default: the model's).
  std::string calibration;
  double rope_theta = 0.0;
  // Calibrated mode: the `refine` newest coded tokens also keep a refinement
  // code of their residual (the calibration's refinement parameters); it is
  // dropped as they age. 0: none.
  int refine = 0;
  // Calibrated mode: true codes a block only once it is whole, so every
  // token is entropy-coded exactly once but up to block - 1 tokens past the
  // window wait raw (counted); false (the default) codes tokens as they
  // leave the window, re-coding the newest partial block on each append
  // (up to block / 2 times the entropy work per token, a smaller raw tail).
  bool whole_blocks = false;
};

// Local mode's default distortion target (the rate allocator's, on the fit
// tokens), used when no rate-control field is set: chosen on windows 9-17 of
// the default corpus as the largest measured target within 1% perplexity
// below the first one past it (the curve is noisy: 0.01 read +1.82%, 0.015
// +0.43%), checked on windows 0-8 (docs/kvtc.md "Defaults").
inline constexpr double kDefaultTargetRelMse = 0.0075;

// Which defaults local mode's rate-control fields take. kLocalPreset (a
// cache): with none of allocator, bit_budget, target_ratio, *target_rel_mse
// set, the rate allocator at kDefaultTargetRelMse with basis_bits=8; else
// each field's own default (dp, 4*D bits, basis_bits=16). kPerField (kvcodec
// calibrate, which reads the same fields): always each field's own default.
enum class KvtcDefaults { kLocalPreset, kPerField };

// Parses and validates kvtc settings (errors name field, value and range).
KvtcSettings parse_kvtc_settings(const Settings& settings, const CacheConfig& config,
                                 KvtcDefaults defaults = KvtcDefaults::kLocalPreset);
// The fields and defaults of kvtc, for list_methods().
MethodInfo kvtc_method_info();

std::unique_ptr<KVCache> make_kvtc_cache(const CacheConfig& config, const Settings& settings);

// What both kvtc modes check of a saved cache's meta before its sections: a
// saved kvtc cache of this mode (a calibrated one names
// calibration.params_hash), a layout version up to `newest` (returned),
// the config fields in `same` equal to these values, and the saved
// settings placing tokens as `options` does. Errors name `who`.
int check_saved_kvtc_meta(const ContainerReader& r, bool calibrated, int newest,
                          const std::vector<std::pair<const char*, int>>& same, const CacheConfig& config,
                          const KvtcSettings& options, const std::string& who);

}  // namespace kvcodec

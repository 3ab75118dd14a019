// Model identity: what tells two checkpoints apart where cached state made
// with one must never be used with the other (the server's prefix store,
// calibrations).
#pragma once

#include <string>

#include "kvcodec/cache.hpp"
#include "model/llama.hpp"

namespace kvcodec::model {

// "<config>-<weights>": hex XXH3-64 of DIR/config.json (model_config_hash,
// the identity calibrations store) and hex XXH3-64 of every loaded weight's
// f32 values in a fixed order (embed, final_norm, lm_head, then each layer's
// tensors). Hashing the loaded values rather than the files' headers and
// sizes is sound (any changed weight changes it, whatever the dtype or
// sharding: f16/bf16 -> f32 is exact) and cheap: one pass over memory the
// model holds anyway (tinycode: 44 MB, a few ms; a 7B model in f32 ~28 GB,
// seconds, next to the minutes its load takes).
std::string model_identity(const LlamaModel& model, const std::string& model_dir);

// Where a method's settings name a calibration (kvtc, calibrated mode),
// loads it (one shared copy per process) and refuses it unless it was made
// for this model: check_calibration_for_model() (Error kShapeMismatch or
// kConfig). Other methods and settings: nothing to check.
void check_method_for_model(const std::string& method, const Settings& settings, const ModelConfig& config,
                            const std::string& config_hash);

}  // namespace kvcodec::model

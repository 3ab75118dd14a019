// Where the shipped model and the shared evaluation tokens are found when the
// command line does not say.
#pragma once

#include <string>

#include "kvcodec/cache.hpp"

namespace kvcodec::model {

// First folder holding a config.json among: $KVCODEC_MODEL, ./models/tinycode,
// <executable dir>/../models/tinycode, <executable dir>/models/tinycode and
// <source dir>/models/tinycode (compiled in). Throws Error(kNotFound) listing
// the places tried.
std::string default_model_dir();

// First existing eval_tokens.u16 among: <model_dir>/eval_tokens.u16,
// ./../shared/models/tinycode, <source dir>/../shared/models/tinycode (the
// KVCODEC_SHARED_DIR of the build). Empty string when none exists.
std::string default_eval_tokens(const std::string& model_dir);

// The model folder's default settings for `method` under the user's own:
// when <model_dir>/<method>.settings exists (lines <method>.<field>=<value>,
// '#' comments) and the user set neither `mode` nor `calibration`, its
// fields are used wherever `user` does not set them; a `calibration` path in
// it is relative to the model folder. Otherwise `user` unchanged. So kvtc on
// the shipped model is calibrated kvtc with the shipped calibration, and
// --set kvtc.mode=local (or any calibration=FILE) takes the user's way.
// Throws Error(kIo / kConfig) for an unreadable or malformed file.
Settings with_model_defaults(const std::string& model_dir, const std::string& method, Settings user);

}  // namespace kvcodec::model

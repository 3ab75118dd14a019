// Where the shipped model and the shared evaluation tokens are found when the
// command line does not say.
#pragma once

#include <string>

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

}  // namespace kvcodec::model

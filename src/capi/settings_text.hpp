// The C API's settings strings: "field=value;field=value" (kvcodec.h).
#pragma once

#include <string>

#include "kvcodec/cache.hpp"

namespace kvcodec::capi {

// Splits text into fields; "" gives no fields and empty items (";;", a
// trailing ';') are skipped. Throws Error(kConfig) for an item without '=',
// an empty field name, or a field given twice. Field names and values are
// checked by the method when the cache is made.
Settings parse_settings_text(const std::string& text);

}  // namespace kvcodec::capi

#include "capi/settings_text.hpp"

#include "kvcodec/error.hpp"

namespace kvcodec::capi {

Settings parse_settings_text(const std::string& text) {
  Settings out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(';', start);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(start, end - start);
    start = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0)
      throw_config_error("settings", item, "items of the form field=value separated by ';', e.g. mode=local;block=64");
    const std::string field = item.substr(0, eq);
    if (!out.emplace(field, item.substr(eq + 1)).second)
      throw_config_error("settings", text, "each field at most once ('" + field + "' is given twice)");
  }
  return out;
}

}  // namespace kvcodec::capi

#include "cache/settings.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "kvcodec/error.hpp"

namespace kvcodec {

SettingsReader::SettingsReader(std::string method, const Settings& settings, const std::vector<FieldInfo>& fields)
    : method_(std::move(method)), settings_(settings) {
  for (const auto& entry : settings) {
    // Plain references, not a structured binding: clang 14 cannot capture those in a lambda.
    const std::string& name = entry.first;
    const std::string& value = entry.second;
    const bool known = std::any_of(fields.begin(), fields.end(), [&](const FieldInfo& f) { return f.name == name; });
    if (!known) {
      std::string valid;
      for (const auto& f : fields) valid += (valid.empty() ? "" : ", ") + f.name;
      throw_config_error(method_ + "." + name, value,
                         "unknown field for method " + method_ + "; valid fields: " + (valid.empty() ? "(none)" : valid));
    }
  }
}

const std::string* SettingsReader::find(const std::string& field) const {
  const auto it = settings_.find(field);
  return it == settings_.end() ? nullptr : &it->second;
}

void SettingsReader::fail(const std::string& field, const std::string& allowed) const {
  const std::string* v = find(field);
  throw_config_error(method_ + "." + field, v ? *v : std::string("(absent)"), allowed);
}

static bool parse_int(const std::string& s, int64_t& out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size()) return false;
  out = v;
  return true;
}

static std::string range_text(int64_t lo, int64_t hi) {
  return "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

int64_t SettingsReader::get_int(const std::string& field, int64_t def, int64_t lo, int64_t hi) const {
  const std::string* v = find(field);
  if (!v) return def;
  int64_t x = 0;
  if (!parse_int(*v, x) || x < lo || x > hi) fail(field, range_text(lo, hi));
  return x;
}

std::optional<int64_t> SettingsReader::get_optional_int(const std::string& field, int64_t lo, int64_t hi) const {
  const std::string* v = find(field);
  if (!v || v->empty() || *v == "none") return std::nullopt;
  int64_t x = 0;
  if (!parse_int(*v, x) || x < lo || x > hi) fail(field, range_text(lo, hi) + " or none");
  return x;
}

double SettingsReader::get_double(const std::string& field, double def, double lo, double hi, bool lo_open) const {
  const std::string* v = find(field);
  if (!v) return def;
  const std::string allowed = std::string("a number in ") + (lo_open ? "(" : "[") + std::to_string(lo) + ", " +
                              std::to_string(hi) + "]";
  if (v->empty()) fail(field, allowed);
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(v->c_str(), &end);
  if (errno != 0 || end != v->c_str() + v->size() || !std::isfinite(x) || x > hi || x < lo || (lo_open && x == lo))
    fail(field, allowed);
  return x;
}

bool SettingsReader::get_bool(const std::string& field, bool def) const {
  const std::string* v = find(field);
  if (!v) return def;
  if (*v == "true" || *v == "1" || *v == "yes" || *v == "on") return true;
  if (*v == "false" || *v == "0" || *v == "no" || *v == "off") return false;
  fail(field, "true or false");
}

std::string SettingsReader::get_choice(const std::string& field, const std::string& def,
                                       const std::vector<std::string>& choices) const {
  const std::string* v = find(field);
  if (!v) return def;
  if (std::find(choices.begin(), choices.end(), *v) != choices.end()) return *v;
  std::string allowed = "one of ";
  for (size_t i = 0; i < choices.size(); ++i) allowed += (i ? "|" : "") + choices[i];
  fail(field, allowed);
}

std::vector<int64_t> SettingsReader::get_int_list(const std::string& field, const std::vector<int64_t>& def,
                                                  int64_t lo, int64_t hi) const {
  const std::string* v = find(field);
  if (!v) return def;
  std::vector<int64_t> out;
  size_t start = 0;
  while (start <= v->size()) {
    const size_t comma = v->find(',', start);
    const std::string item = v->substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    int64_t x = 0;
    if (!parse_int(item, x) || x < lo || x > hi)
      fail(field, "a comma-separated list of integers in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    out.push_back(x);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

std::string encode_settings(const Settings& settings) {
  std::string out;
  for (const auto& [k, v] : settings) {
    if (k.find_first_of("=;") != std::string::npos || v.find(';') != std::string::npos)
      throw_config_error(k, v, "setting names may not contain '=' or ';', values may not contain ';'");
    out += (out.empty() ? "" : ";") + k + "=" + v;
  }
  return out;
}

Settings decode_settings(const std::string& text) {
  Settings out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(';', start);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(start, end - start);
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0)
      throw Error(ErrorCode::kFormat, "saved settings malformed near '" + item + "'");
    out[item.substr(0, eq)] = item.substr(eq + 1);
    start = end + 1;
  }
  return out;
}

}  // namespace kvcodec

// Typed, validated reading of method settings (DESIGN 3: a bad value throws a
// configuration error naming the field, the value and the allowed range).
//
// A SettingsReader is made from the method's declared fields; any field the
// caller passed that is not declared is rejected with the list of valid ones.
// Every error goes through kvcodec::throw_config_error("<method>.<field>",
// value, allowed) so all of them read alike.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvcodec/cache.hpp"

namespace kvcodec {

class SettingsReader {
 public:
  SettingsReader(std::string method, const Settings& settings, const std::vector<FieldInfo>& fields);

  // Integer in [lo, hi]; def when absent.
  int64_t get_int(const std::string& field, int64_t def, int64_t lo, int64_t hi) const;
  // Integer in [lo, hi], or nullopt when absent, empty or "none".
  std::optional<int64_t> get_optional_int(const std::string& field, int64_t lo, int64_t hi) const;
  // Real in [lo, hi] (or (lo, hi] when lo_open).
  double get_double(const std::string& field, double def, double lo, double hi, bool lo_open = false) const;
  // true/false/1/0/yes/no/on/off.
  bool get_bool(const std::string& field, bool def) const;
  // One of choices.
  std::string get_choice(const std::string& field, const std::string& def,
                         const std::vector<std::string>& choices) const;
  // Comma-separated integers, each in [lo, hi], at least one.
  std::vector<int64_t> get_int_list(const std::string& field, const std::vector<int64_t>& def, int64_t lo,
                                    int64_t hi) const;

  [[noreturn]] void fail(const std::string& field, const std::string& allowed) const;
  const std::string* find(const std::string& field) const;

 private:
  std::string method_;
  const Settings& settings_;
};

// "k1=v1;k2=v2" (sorted by key) and back, for the saved cache's meta.
std::string encode_settings(const Settings& settings);
Settings decode_settings(const std::string& text);

}  // namespace kvcodec

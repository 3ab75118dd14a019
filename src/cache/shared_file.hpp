// One parsed copy of a parameter file per process (calibrations): a model
// has one cache per layer per sequence, and each must not re-read the file.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "kvcodec/error.hpp"

namespace kvcodec::cache_impl {

// read(path) once per path, reloaded when the file's size or modification
// time changes; `what` names the file kind in the not-found error.
template <typename T, typename Read>
std::shared_ptr<const T> load_shared_file(const std::string& path, const std::string& what, Read read) {
  static std::mutex mutex;
  static std::map<std::string, std::pair<std::string, std::shared_ptr<const T>>> loaded;
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) throw Error(ErrorCode::kNotFound, what + " " + path + ": " + ec.message());
  const auto mtime = std::filesystem::last_write_time(path, ec).time_since_epoch().count();
  const std::string stamp = std::to_string(size) + ":" + std::to_string(mtime);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded.find(path);
  if (it != loaded.end() && it->second.first == stamp) return it->second.second;
  auto parsed = std::make_shared<const T>(read(path));
  loaded[path] = {stamp, parsed};
  return parsed;
}

}  // namespace kvcodec::cache_impl

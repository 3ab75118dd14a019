#include "model/paths.hpp"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "kvcodec/error.hpp"

namespace kvcodec::model {
namespace {

namespace fs = std::filesystem;

fs::path executable_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : exe.parent_path();
}

}  // namespace

std::string default_model_dir() {
  std::vector<fs::path> tried;
  if (const char* env = std::getenv("KVCODEC_MODEL"); env && *env) tried.emplace_back(env);
  tried.emplace_back("models/tinycode");
  const fs::path exe = executable_dir();
  if (!exe.empty()) {
    tried.push_back(exe / ".." / "models" / "tinycode");
    tried.push_back(exe / "models" / "tinycode");
  }
  tried.push_back(fs::path(KVCODEC_MODEL_SOURCE_DIR) / "models" / "tinycode");
  std::string list;
  for (const fs::path& p : tried) {
    std::error_code ec;
    if (fs::exists(p / "config.json", ec)) return fs::weakly_canonical(p, ec).string();
    list += (list.empty() ? "" : ", ") + p.string();
  }
  throw Error(ErrorCode::kNotFound, "no model given (--model) and none found at " + list);
}

std::string default_eval_tokens(const std::string& model_dir) {
  const std::vector<fs::path> tried{fs::path(model_dir) / "eval_tokens.u16",
                                    fs::path("..") / "shared" / "models" / "tinycode" / "eval_tokens.u16",
                                    fs::path(KVCODEC_MODEL_SHARED_DIR) / "models" / "tinycode" / "eval_tokens.u16"};
  for (const fs::path& p : tried) {
    std::error_code ec;
    if (fs::is_regular_file(p, ec)) return fs::weakly_canonical(p, ec).string();
  }
  return {};
}

Settings with_model_defaults(const std::string& model_dir, const std::string& method, Settings user) {
  const fs::path file = fs::path(model_dir) / (method + ".settings");
  std::error_code ec;
  if (user.count("mode") || user.count("calibration") || !fs::is_regular_file(file, ec)) return user;
  std::ifstream in(file);
  if (!in) throw Error(ErrorCode::kIo, "cannot read " + file.string());
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    if (line.rfind(method + ".", 0) != 0)
      throw_config_error(file.string(), line, method + ".<field>=<value> (one a line)");
    lines.push_back(line);
  }
  Settings defaults = settings_for_method(lines, method);
  if (auto it = defaults.find("calibration"); it != defaults.end() && fs::path(it->second).is_relative())
    it->second = (fs::path(model_dir) / it->second).string();
  for (auto& [field, value] : user) defaults[field] = value;
  return defaults;
}

}  // namespace kvcodec::model

#include "model/paths.hpp"

#include <cstdlib>
#include <filesystem>
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

}  // namespace kvcodec::model

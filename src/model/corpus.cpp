#include "model/corpus.hpp"

#include <xxhash.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kvcodec/error.hpp"

namespace kvcodec::model {
namespace {

namespace fs = std::filesystem;

// Paths relative to the root; the order is part of the corpus's definition
// (a listing of the folders would pick up files a later package adds).
constexpr const char* kDefaultCorpus[] = {
    "usr/share/python3/py3versions.py",         "usr/share/python3/debpython/__init__.py",
    "usr/share/python3/debpython/files.py",     "usr/share/python3/debpython/interpreter.py",
    "usr/share/python3/debpython/option.py",    "usr/share/python3/debpython/version.py",
    "usr/bin/py3compile",                       "usr/bin/py3clean",
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::kIo, "cannot open text file " + path);
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw Error(ErrorCode::kIo, "cannot read text file " + path);
  return text.str();
}

TextCorpus read_files(const std::vector<std::string>& files, const Tokenizer& tokenizer) {
  TextCorpus corpus;
  corpus.files = files;
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  try {
    for (const std::string& f : files) {
      const std::string text = read_file(f);
      XXH3_64bits_update(state, text.data(), text.size());
      const std::vector<int32_t> ids = tokenizer.encode(text, /*parse_special=*/false);
      corpus.tokens.insert(corpus.tokens.end(), ids.begin(), ids.end());
    }
  } catch (...) {
    XXH3_freeState(state);
    throw;
  }
  corpus.content_hash = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return corpus;
}

}  // namespace

std::vector<std::string> default_corpus_files(const std::string& root) {
  std::vector<std::string> files;
  for (const char* rel : kDefaultCorpus) files.push_back((fs::path(root) / rel).string());
  return files;
}

TextCorpus read_default_corpus(const Tokenizer& tokenizer, const std::string& root) {
  const std::vector<std::string> files = default_corpus_files(root);
  for (const std::string& f : files) {
    std::error_code ec;
    if (!fs::is_regular_file(f, ec))
      throw Error(ErrorCode::kNotFound,
                  "default evaluation corpus: " + f +
                      " is missing (Debian package python3-minimal installs it; run scripts/install_deps.sh), "
                      "or give --text FILE|DIR or --tokens FILE.u16");
  }
  return read_files(files, tokenizer);
}

TextCorpus read_text_corpus(const std::string& path, const Tokenizer& tokenizer) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return read_files({path}, tokenizer);
  if (!fs::is_directory(path, ec)) throw Error(ErrorCode::kNotFound, "--text " + path + ": no such file or folder");
  std::vector<std::string> files;
  for (fs::recursive_directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec))
    if (it->is_regular_file(ec)) files.push_back(it->path().string());
  if (ec) throw Error(ErrorCode::kIo, "--text " + path + ": cannot list the folder: " + ec.message());
  if (files.empty()) throw Error(ErrorCode::kNotFound, "--text " + path + ": the folder holds no files");
  std::sort(files.begin(), files.end());
  return read_files(files, tokenizer);
}

}  // namespace kvcodec::model

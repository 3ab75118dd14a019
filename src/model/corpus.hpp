// Evaluation corpora given as text: the default corpus every machine has
// after scripts/install_deps.sh, and user text (--text FILE|DIR).
//
// The default corpus is Debian's own Python tooling, installed by package
// python3-minimal (pulled in by python3, which install_deps.sh installs):
// code text the shipped model has not seen (tinycode was trained on the .py
// files of a Python 3.12 installation's standard library and site-packages;
// these files live in /usr/share/python3 and /usr/bin, in neither). The
// files are read in the fixed order of default_corpus_files(), each
// tokenized on its own and the ids concatenated. docs/eval.md lists them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/tokenizer.hpp"

namespace kvcodec::model {

struct TextCorpus {
  std::vector<std::string> files;  // in reading order
  std::vector<int32_t> tokens;     // each file tokenized on its own, concatenated
  uint64_t content_hash = 0;       // XXH3-64 of the files' bytes, concatenated in order
};

// The default corpus's files under `root` ("/" on a real machine; tests
// point it at a temporary folder), in reading order.
std::vector<std::string> default_corpus_files(const std::string& root = "/");

// The content_hash of the default corpus as installed on Debian 12 by
// python3-minimal 3.11.2-1+b1. Another hash means other figures (a warning,
// not an error).
inline constexpr uint64_t kDefaultCorpusHash = 0x4f4e84792b1c9032ull;

// Reads the default corpus under `root`. Throws Error(kNotFound) naming the
// first missing file, the package that installs it and the alternatives
// (--text, --tokens).
TextCorpus read_default_corpus(const Tokenizer& tokenizer, const std::string& root = "/");

// Reads a text file, or every regular file under a folder (recursively, in
// sorted path order). Special-token text in the files is read as text.
// Throws Error(kNotFound) for a missing path or a folder without files,
// Error(kIo) for an unreadable file.
TextCorpus read_text_corpus(const std::string& path, const Tokenizer& tokenizer);

}  // namespace kvcodec::model

// Text corpora (model/corpus.hpp), the token check of eval and the model
// folder's default settings (model/paths.hpp), on temporary folders: nothing
// here needs ../shared.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <filesystem>
#include <fstream>

#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"
#include "model/config.hpp"
#include "model/corpus.hpp"
#include "model/eval.hpp"
#include "model/paths.hpp"
#include "model_fixtures.hpp"

namespace kvcodec::model {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string name = (fs::temp_directory_path() / "kvcodec-corpus-XXXXXX").string();
    if (!mkdtemp(name.data())) throw std::runtime_error("mkdtemp failed");
    path_ = name;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  void write(const std::string& rel, const std::string& text) const {
    fs::create_directories((path_ / rel).parent_path());
    std::ofstream(path_ / rel, std::ios::binary) << text;
  }

 private:
  fs::path path_;
};

const Tokenizer& shipped_tokenizer() {
  static const Tokenizer tok = Tokenizer::load(testing::shipped_model_dir() + "/tokenizer.json");
  return tok;
}

ErrorCode code_of(const std::function<void()>& f, std::string* message = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (message) *message = e.what();
    return e.code();
  }
  return ErrorCode(0);
}

// Each file tokenized on its own, ids concatenated; hash over the bytes in order.
void expect_corpus_of(const TextCorpus& c, const std::vector<std::string>& texts) {
  std::vector<int32_t> tokens;
  std::string all;
  for (const std::string& t : texts) {
    const auto ids = shipped_tokenizer().encode(t, false);
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    all += t;
  }
  EXPECT_EQ(c.tokens, tokens);
  EXPECT_EQ(c.content_hash, XXH3_64bits(all.data(), all.size()));
}

TEST(Corpus, DefaultCorpusIsReadUnderTheRootInItsFixedOrder) {
  TempDir root;
  const std::vector<std::string> files = default_corpus_files(root.path().string());
  ASSERT_EQ(files.size(), 8u);
  std::vector<std::string> texts;
  // Written in reverse, so a folder listing's order would differ from the fixed one.
  for (size_t i = files.size(); i-- > 0;) {
    texts.insert(texts.begin(), "def f" + std::to_string(i) + "(x):\n    return x * " + std::to_string(i) + "\n");
    root.write(fs::relative(files[i], root.path()).string(), texts.front());
  }
  const TextCorpus c = read_default_corpus(shipped_tokenizer(), root.path().string());
  EXPECT_EQ(c.files, files);
  EXPECT_EQ(fs::path(files.front()).filename(), "py3versions.py");
  expect_corpus_of(c, texts);
  // "<|endoftext|>" in a file is text, not the special token.
  root.write(fs::relative(files[0], root.path()).string(), "x = '<|endoftext|>'\n");
  const auto special = shipped_tokenizer().token_id("<|endoftext|>");
  if (special) {
    const TextCorpus s = read_default_corpus(shipped_tokenizer(), root.path().string());
    EXPECT_EQ(std::count(s.tokens.begin(), s.tokens.end(), *special), 0);
  }
}

TEST(Corpus, MissingDefaultFileIsNamedWithItsPackage) {
  TempDir root;  // empty: like a machine where install_deps.sh has not run
  std::string message;
  EXPECT_EQ(code_of([&] { read_default_corpus(shipped_tokenizer(), root.path().string()); }, &message),
            ErrorCode::kNotFound);
  EXPECT_NE(message.find("py3versions.py"), std::string::npos) << message;
  EXPECT_NE(message.find("python3-minimal"), std::string::npos) << message;
  EXPECT_NE(message.find("--text"), std::string::npos) << message;
}

TEST(Corpus, TextFileOrFolderInSortedOrder) {
  TempDir dir;
  dir.write("b.py", "print('b')\n");
  dir.write("a.py", "print('a')\n");
  dir.write("sub/c.py", "print('c')\n");
  const TextCorpus folder = read_text_corpus(dir.path().string(), shipped_tokenizer());
  ASSERT_EQ(folder.files.size(), 3u);
  EXPECT_EQ(fs::path(folder.files[0]).filename(), "a.py");
  EXPECT_EQ(fs::path(folder.files[1]).filename(), "b.py");
  EXPECT_EQ(fs::path(folder.files[2]).filename(), "c.py");
  expect_corpus_of(folder, {"print('a')\n", "print('b')\n", "print('c')\n"});
  const TextCorpus one = read_text_corpus((dir.path() / "b.py").string(), shipped_tokenizer());
  expect_corpus_of(one, {"print('b')\n"});

  std::string message;
  EXPECT_EQ(code_of([&] { read_text_corpus((dir.path() / "nope.txt").string(), shipped_tokenizer()); }, &message),
            ErrorCode::kNotFound);
  EXPECT_NE(message.find("nope.txt"), std::string::npos) << message;
  fs::create_directories(dir.path() / "empty");
  EXPECT_EQ(code_of([&] { read_text_corpus((dir.path() / "empty").string(), shipped_tokenizer()); }),
            ErrorCode::kNotFound);
}

// The corpus as this machine has it: the documented hash, and enough tokens
// for several windows of the README's eval (context 1024 + score 128).
TEST(Corpus, InstalledDefaultCorpusHasTheDocumentedHashAndSeveralWindows) {
  for (const std::string& f : default_corpus_files())
    if (!fs::exists(f)) GTEST_SKIP() << "SKIP: " << f << " absent (scripts/install_deps.sh installs python3-minimal)";
  const TextCorpus c = read_default_corpus(shipped_tokenizer());
  EXPECT_EQ(c.content_hash, kDefaultCorpusHash) << std::hex << c.content_hash;
  EXPECT_GE(c.tokens.size(), 8u * 1152u);
}

TEST(Eval, TooShortCorpusSaysHowManyTokensAreNeeded) {
  EvalOptions o;
  o.window_length = 1152;
  o.windows = 2;
  o.first_window = 1;
  EXPECT_NO_THROW(require_corpus_tokens(o, 3 * 1152, "corpus.txt"));
  std::string message;
  EXPECT_EQ(code_of([&] { require_corpus_tokens(o, 3000, "corpus.txt"); }, &message), ErrorCode::kNotFound);
  EXPECT_NE(message.find("corpus.txt has 3000 tokens"), std::string::npos) << message;
  EXPECT_NE(message.find("need 3456"), std::string::npos) << message;
}

TEST(ModelDefaults, KvtcTakesTheModelFolderSettingsUnlessTheUserChoosesAMode) {
  TempDir dir;
  EXPECT_EQ(with_model_defaults(dir.path().string(), "kvtc", {{"window", "3"}}), (Settings{{"window", "3"}}));
  dir.write("kvtc.settings", "# shipped\nkvtc.calibration=kvtc.kvcal\nkvtc.window=8\n\nkvtc.refine=128\n");
  const std::string cal = (dir.path() / "kvtc.kvcal").string();
  EXPECT_EQ(with_model_defaults(dir.path().string(), "kvtc", {}),
            (Settings{{"calibration", cal}, {"window", "8"}, {"refine", "128"}}));
  EXPECT_EQ(with_model_defaults(dir.path().string(), "kvtc", {{"window", "32"}}),
            (Settings{{"calibration", cal}, {"window", "32"}, {"refine", "128"}}));
  EXPECT_EQ(with_model_defaults(dir.path().string(), "kvtc", {{"mode", "local"}}), (Settings{{"mode", "local"}}));
  EXPECT_EQ(with_model_defaults(dir.path().string(), "kvtc", {{"calibration", "/x.kvcal"}}),
            (Settings{{"calibration", "/x.kvcal"}}));
  EXPECT_EQ(with_model_defaults(dir.path().string(), "int4", {}), Settings{});
  dir.write("kvtc.settings", "window=8\n");
  std::string message;
  EXPECT_EQ(code_of([&] { with_model_defaults(dir.path().string(), "kvtc", {}); }, &message), ErrorCode::kConfig);
  EXPECT_NE(message.find("window=8"), std::string::npos) << message;
}

// The shipped model folder makes kvtc calibrated with its own file, and the
// cache accepts those settings for the model's shape; mode=local still works.
TEST(ModelDefaults, ShippedModelMakesKvtcCalibrated) {
  const std::string dir = testing::shipped_model_dir();
  const Settings s = with_model_defaults(dir, "kvtc", {});
  ASSERT_TRUE(s.count("calibration"));
  EXPECT_TRUE(fs::is_regular_file(s.at("calibration"))) << s.at("calibration");
  EXPECT_EQ(s.at("window"), "8");
  EXPECT_EQ(s.at("refine"), "128");
  const ModelConfig mc = load_model_config(dir + "/config.json");
  CacheConfig c;
  c.n_layers = mc.n_layers;
  c.n_kv_heads = mc.n_kv_heads;
  c.head_dim = mc.head_dim;
  c.rope_theta = mc.rope_theta;
  EXPECT_NE(make_cache("kvtc", c, s), nullptr);
  EXPECT_NE(make_cache("kvtc", c, with_model_defaults(dir, "kvtc", {{"mode", "local"}})), nullptr);
}

}  // namespace
}  // namespace kvcodec::model

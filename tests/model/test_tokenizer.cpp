// Tokenizer: the GPT-2 split, BPE, special tokens, round trips on the shared
// evaluation text and the held-out ids.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "kvcodec/error.hpp"
#include "model/tokenizer.hpp"
#include "model_fixtures.hpp"

namespace kvcodec::model {
namespace {

std::vector<std::string> split(std::string_view s) {
  std::vector<std::string> out;
  for (auto p : Tokenizer::pre_tokenize(s)) out.emplace_back(p);
  return out;
}

TEST(PreTokenize, Gpt2Split) {
  using V = std::vector<std::string>;
  EXPECT_EQ(split("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(split("it's we'll they're I'd"), (V{"it", "'s", " we", "'ll", " they", "'re", " I", "'d"}));
  EXPECT_EQ(split("x = 42+y"), (V{"x", " =", " 42", "+", "y"}));
  // \s+(?!\S): a run of spaces leaves its last one to the next word.
  EXPECT_EQ(split("a   b"), (V{"a", "  ", " b"}));
  EXPECT_EQ(split("def f():\n    return 1\n"),
            (V{"def", " f", "():", "\n   ", " return", " 1", "\n"}));
  EXPECT_EQ(split("a\nb"), (V{"a", "\n", "b"}));
  EXPECT_EQ(split("a \n\n  b"), (V{"a", " \n\n ", " b"}));
  EXPECT_EQ(split("end  "), (V{"end", "  "}));
  EXPECT_EQ(split(" 'x"), (V{" '", "x"}));
  EXPECT_EQ(split("abc123"), (V{"abc", "123"}));
  // Non-ASCII letters join ASCII letters; U+00A0 is whitespace.
  EXPECT_EQ(split("caf\xC3\xA9 na\xC3\xAFve"), (V{"caf\xC3\xA9", " na\xC3\xAFve"}));
  EXPECT_EQ(split("a\xC2\xA0" "b"), (V{"a", "\xC2\xA0", "b"}));
  EXPECT_TRUE(split("").empty());
  // The pieces always tile the input, even for invalid UTF-8.
  const std::string junk = "\xFF\xFE a\x80'\xC3";
  std::string joined;
  for (const auto& p : split(junk)) joined += p;
  EXPECT_EQ(joined, junk);
}

class TinycodeTokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { tok_ = new Tokenizer(Tokenizer::load(testing::shipped_model_dir() + "/tokenizer.json")); }
  static void TearDownTestSuite() { delete tok_; }
  static Tokenizer* tok_;
};
Tokenizer* TinycodeTokenizer::tok_ = nullptr;

TEST_F(TinycodeTokenizer, EncodesAndDecodes) {
  const Tokenizer& t = *tok_;
  EXPECT_EQ(t.vocab_size(), 4096);
  const std::string text = "import torch\n\nclass Foo(nn.Module):\n    def forward(self, x):\n        return x * 2\n";
  const auto ids = t.encode(text);
  EXPECT_LT(ids.size(), text.size() / 2) << "BPE merged too little";
  EXPECT_EQ(t.decode(ids), text);
  // Special tokens are recognised in text, and only when asked.
  const auto with_special = t.encode("a<|endoftext|>b");
  ASSERT_EQ(with_special.size(), 3u);
  EXPECT_EQ(with_special[1], 0);
  EXPECT_TRUE(t.is_special(0));
  EXPECT_GT(t.encode("a<|endoftext|>b", false).size(), 3u);
  EXPECT_EQ(t.decode(with_special), "a<|endoftext|>b");
  // Every byte encodes (byte-level: no unknown token).
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) all_bytes.push_back(char(b));
  EXPECT_EQ(t.decode(t.encode(all_bytes)), all_bytes);
  const int32_t bad = 4096;
  EXPECT_THROW(t.decode(&bad, 1), Error);
}

// encode/decode round-trip the whole evaluation text, and encoding the
// decoded held-out windows reproduces their ids except near window edges
// (a window cuts the text mid-word, where the split differs).
TEST_F(TinycodeTokenizer, RoundTripsSharedEvalData) {
  const std::string dir = testing::shared_tinycode_dir();
  if (!testing::exists(dir + "/eval_text.txt") || !testing::exists(dir + "/eval_tokens.u16"))
    GTEST_SKIP() << "no " << dir << "/eval_text.txt or eval_tokens.u16 (../shared absent)";
  std::ifstream in(dir + "/eval_text.txt", std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const auto ids = tok_->encode(text);
  EXPECT_EQ(tok_->decode(ids), text);
  std::printf("[ tokens ] eval_text.txt: %zu bytes -> %zu tokens\n", text.size(), ids.size());

  int64_t total = 0, mismatched = 0, windows_exact = 0;
  for (int w = 0; w < 32; ++w) {
    const auto window = testing::eval_window(dir + "/eval_tokens.u16", w, 2048);
    ASSERT_EQ(window.size(), 2048u);
    const auto again = tok_->encode(tok_->decode(window));
    // Align from the front and from the back; mismatches lie between.
    size_t front = 0;
    while (front < window.size() && front < again.size() && window[front] == again[front]) ++front;
    size_t back = 0;
    while (back < window.size() - front && back < again.size() - front &&
           window[window.size() - 1 - back] == again[again.size() - 1 - back])
      ++back;
    const int64_t bad = int64_t(window.size() - front - back);
    total += 2048;
    mismatched += bad;
    if (bad == 0) ++windows_exact;
    // The only place re-encoding may differ is the window's first/last word.
    EXPECT_LE(bad, 4) << "window " << w << ": front " << front << ", back " << back;
  }
  std::printf("[ tokens ] re-encoded held-out windows: %lld of %lld ids differ, %lld of 32 windows exact\n",
              (long long)mismatched, (long long)total, (long long)windows_exact);
}

TEST(Tokenizer, RejectsUnsupportedFiles) {
  const std::string base = R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
      "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true}})";
  try {
    Tokenizer::parse(base);
    FAIL() << "accepted a vocabulary without the 256 byte tokens";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
  }
  EXPECT_THROW(Tokenizer::parse("{not json"), Error);
  EXPECT_THROW(Tokenizer::parse(R"({"model": {"type": "WordPiece", "vocab": {}}})"), Error);
  try {
    Tokenizer::parse(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": {"type": "Metaspace"}})");
    FAIL() << "accepted a Metaspace pre-tokenizer";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("pre_tokenizer"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Tokenizer::parse(R"({"model": {"type": "BPE", "vocab": {"a": "zero"}, "merges": []},
      "pre_tokenizer": {"type": "ByteLevel"}})"), Error);
}

}  // namespace
}  // namespace kvcodec::model

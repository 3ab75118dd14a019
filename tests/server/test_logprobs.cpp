// Logprobs and echo (docs/server.md, "Logprobs"): the top-k fast path against
// its plain reference, the field checks, the OpenAI response shapes
// (completions and chat, streaming included), and the scoring contract: the
// fp16 cache's echoed prompt logprobs equal `kvcodec eval`'s NLL
// (model::evaluate, whole-window protocol) on the same tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <sstream>

#include "kvcodec/error.hpp"
#include "model/eval.hpp"
#include "model/llama.hpp"
#include "server/logprobs.hpp"
#include "server_process.hpp"

namespace kvcodec::server {
namespace {
namespace fs = std::filesystem;
using json = nlohmann::json;

TEST(Logprobs, TopKMatchesTheReference) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int vocab : {1, 5, 300, 4096}) {
    std::vector<float> logits(static_cast<size_t>(vocab));
    for (auto& x : logits) x = normal(rng);
    // Ties (equal logits) must order by the lower id in both.
    if (vocab > 10) logits[9] = logits[3] = logits[7];
    for (int top : {0, 1, 5, 20}) {
      const int32_t token = int32_t(rng() % uint32_t(vocab));
      const TokenLogprob fast = token_logprob(logits.data(), vocab, token, top);
      const TokenLogprob ref = token_logprob_reference(logits.data(), vocab, token, top);
      ASSERT_TRUE(fast.logprob && ref.logprob);
      EXPECT_NEAR(*fast.logprob, *ref.logprob, 1e-12) << vocab << " " << top;
      ASSERT_EQ(fast.top.size(), size_t(std::min(top, vocab)));
      ASSERT_EQ(fast.top.size(), ref.top.size());
      for (size_t i = 0; i < fast.top.size(); ++i) {
        EXPECT_EQ(fast.top[i].first, ref.top[i].first) << vocab << " " << top << " rank " << i;
        EXPECT_NEAR(fast.top[i].second, ref.top[i].second, 1e-12);
      }
    }
  }
}

TEST(Logprobs, FieldsAreCheckedAndNamed) {
  auto refusal = [](const char* body, bool chat) -> std::string {
    try {
      parse_logprobs(json::parse(body), chat);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      return e.what();
    }
    return "";
  };
  EXPECT_NE(refusal(R"({"logprobs":6})", false).find("'logprobs'"), std::string::npos);
  EXPECT_NE(refusal(R"({"logprobs":-1})", false).find("[0, 5]"), std::string::npos);
  EXPECT_NE(refusal(R"({"logprobs":true})", false).find("'logprobs' must be an integer"), std::string::npos);
  EXPECT_NE(refusal(R"({"echo":1})", false).find("'echo'"), std::string::npos);
  EXPECT_NE(refusal(R"({"top_logprobs":2})", false).find("'top_logprobs'"), std::string::npos);
  EXPECT_NE(refusal(R"({"logprobs":3})", true).find("must be a boolean"), std::string::npos);
  EXPECT_NE(refusal(R"({"logprobs":true,"top_logprobs":21})", true).find("[0, 20]"), std::string::npos);
  EXPECT_NE(refusal(R"({"top_logprobs":2})", true).find("needs 'logprobs': true"), std::string::npos);
  EXPECT_NE(refusal(R"({"echo":true})", true).find("'echo'"), std::string::npos);
  const LogprobRequest c = parse_logprobs(json::parse(R"({"logprobs":0,"echo":true})"), false);
  EXPECT_TRUE(c.enabled && c.echo);
  EXPECT_EQ(c.top, 0);
  const LogprobRequest h = parse_logprobs(json::parse(R"({"logprobs":true,"top_logprobs":20})"), true);
  EXPECT_TRUE(h.enabled);
  EXPECT_EQ(h.top, 20);
  EXPECT_FALSE(parse_logprobs(json::parse(R"({"logprobs":null})"), false).enabled);
}

class LogprobsServer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!testing::have_model()) return;
    ServeOptions o = testing::test_options();
    o.max_body_bytes = 1 << 16;
    server_ = testing::ServerProcess::start(o);
  }
  static void TearDownTestSuite() { server_.stop(); }
  void SetUp() override {
    if (!testing::have_model()) GTEST_SKIP() << "models/tinycode is absent (copy it from ../shared/models)";
    ASSERT_GT(server_.port, 0) << server_.startup;
  }
  static json post(const std::string& path, const json& body, int status = 200) {
    return server_.post(path, body.dump(), status);
  }
  static std::vector<json> stream(const std::string& path, json body) {
    body["stream"] = true;
    auto c = server_.client();
    auto r = c.Post(path.c_str(), body.dump(), "application/json");
    std::vector<json> events;
    EXPECT_TRUE(r) << path << ": " << httplib::to_string(r.error());
    if (!r) return events;
    EXPECT_EQ(r->status, 200) << path << " -> " << r->body.substr(0, 400);
    std::istringstream in(r->body);
    std::string line;
    while (std::getline(in, line))
      if (line.rfind("data: {", 0) == 0) events.push_back(json::parse(line.substr(6)));
    return events;
  }
  static inline testing::ServerProcess server_;
};

std::string joined(const json& strings) {
  std::string out;
  for (const auto& s : strings) out += s.get<std::string>();
  return out;
}

TEST_F(LogprobsServer, CompletionShapeAndGreedyTokensAreTheTopOnes) {
  const json r = post("/v1/completions", {{"prompt", "def add(a, b):"}, {"max_tokens", 6}, {"logprobs", 3}});
  const json& lp = r["choices"][0]["logprobs"];
  const std::string text = r["choices"][0]["text"];
  ASSERT_EQ(lp["tokens"].size(), 6u) << lp.dump();
  EXPECT_EQ(joined(lp["tokens"]), text);
  size_t offset = 0;
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(lp["text_offset"][i], offset);
    offset += lp["tokens"][i].get<std::string>().size();
    const json& top = lp["top_logprobs"][i];
    ASSERT_EQ(top.size(), 3u);
    // Greedy: the chosen token is the most likely one, and no alternative beats it.
    const double chosen = lp["token_logprobs"][i];
    EXPECT_LE(chosen, 0.0);
    double best = -1e300;
    for (const auto& [tok, v] : top.items()) best = std::max(best, v.get<double>());
    EXPECT_DOUBLE_EQ(chosen, best);
    EXPECT_TRUE(top.contains(lp["tokens"][i].get<std::string>()));
  }
  EXPECT_TRUE(post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 1}})["choices"][0]["logprobs"].is_null());
}

TEST_F(LogprobsServer, EchoScoresThePromptWithoutGenerating) {
  const std::string prompt = "for i in range(10):\n    print(i)\n";
  const json r = post("/v1/completions", {{"prompt", prompt}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 1}});
  const json& lp = r["choices"][0]["logprobs"];
  EXPECT_EQ(r["choices"][0]["text"], prompt);
  EXPECT_EQ(r["usage"]["completion_tokens"], 0);
  ASSERT_EQ(lp["tokens"].size(), r["usage"]["prompt_tokens"].get<size_t>());
  EXPECT_EQ(joined(lp["tokens"]), prompt);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  for (size_t i = 1; i < lp["tokens"].size(); ++i) {
    EXPECT_LT(lp["token_logprobs"][i].get<double>(), 0.0);
    EXPECT_EQ(lp["top_logprobs"][i].size(), 1u);
  }
  // Asking again (the first request's caches are now in the prefix store)
  // scores the same: a scored prompt is always computed whole.
  const json again = post("/v1/completions", {{"prompt", prompt}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 1}});
  EXPECT_EQ(again["choices"][0]["logprobs"]["token_logprobs"], lp["token_logprobs"]);
  EXPECT_EQ(again["kvcodec"]["reused_prompt_tokens"], 0);
  // Echo with generation: prompt text, then the reply; offsets run through both.
  // (A prompt after which the model does not end the text at once.)
  const std::string open_prompt = "def add(a, b):";
  const json g = post("/v1/completions", {{"prompt", open_prompt}, {"max_tokens", 3}, {"echo", true}, {"logprobs", 0}});
  const json& gl = g["choices"][0]["logprobs"];
  const size_t n_prompt = g["usage"]["prompt_tokens"];
  ASSERT_EQ(g["usage"]["completion_tokens"], 3);
  ASSERT_EQ(gl["tokens"].size(), n_prompt + 3);
  EXPECT_EQ(joined(gl["tokens"]), g["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(g["choices"][0]["text"].get<std::string>().rfind(open_prompt, 0), 0u);
  EXPECT_EQ(gl["text_offset"][n_prompt], open_prompt.size());
  // Echo alone: the text, no logprobs.
  const json e = post("/v1/completions", {{"prompt", prompt}, {"max_tokens", 2}, {"echo", true}});
  EXPECT_EQ(e["choices"][0]["text"].get<std::string>().rfind(prompt, 0), 0u);
  EXPECT_TRUE(e["choices"][0]["logprobs"].is_null());
}

TEST_F(LogprobsServer, OutOfRangeValuesAre400NamingTheField) {
  for (const auto& [path, body, field] : std::vector<std::tuple<std::string, json, std::string>>{
           {"/v1/completions", {{"prompt", "x"}, {"logprobs", 6}}, "logprobs"},
           {"/v1/completions", {{"prompt", "x"}, {"echo", "yes"}}, "echo"},
           {"/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"logprobs", true}, {"top_logprobs", 21}}, "top_logprobs"},
           {"/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"top_logprobs", 2}}, "top_logprobs"},
       }) {
    const json r = post(path, body, 400);
    EXPECT_NE(r["error"]["message"].get<std::string>().find("'" + field + "'"), std::string::npos) << r.dump();
    EXPECT_EQ(r["error"]["type"], "invalid_request_error");
  }
}

TEST_F(LogprobsServer, ChatShapeAndStreamingCarryTheSameLogprobs) {
  const json body = {{"messages", {{{"role", "user"}, {"content", "write a loop"}}}}, {"max_tokens", 5},
                     {"logprobs", true}, {"top_logprobs", 2}};
  const json r = post("/v1/chat/completions", body);
  const json& content = r.at("choices").at(0).at("logprobs").at("content");
  ASSERT_EQ(content.size(), 5u) << r.dump();
  std::string text;
  for (const auto& c : content) {
    text += c["token"].get<std::string>();
    std::string bytes;
    for (const auto& b : c["bytes"]) bytes += char(b.get<int>());
    EXPECT_EQ(bytes, c["token"].get<std::string>());
    ASSERT_EQ(c["top_logprobs"].size(), 2u);
    EXPECT_DOUBLE_EQ(c["logprob"].get<double>(), c["top_logprobs"][0]["logprob"].get<double>());  // greedy
    EXPECT_GE(c["top_logprobs"][0]["logprob"].get<double>(), c["top_logprobs"][1]["logprob"].get<double>());
  }
  EXPECT_EQ(text, r.at("choices").at(0).at("message").at("content").get<std::string>());
  EXPECT_TRUE(post("/v1/chat/completions", {{"messages", body["messages"]}, {"max_tokens", 1}})["choices"][0]["logprobs"].is_null());

  json streamed = json::array();
  for (const auto& e : stream("/v1/chat/completions", body))
    if (!e.at("choices").empty() && e["choices"].at(0).at("logprobs").is_object())
      for (const auto& c : e["choices"][0]["logprobs"].at("content")) streamed.push_back(c);
  EXPECT_EQ(streamed, content);

  const json cbody = {{"prompt", "import os\n"}, {"max_tokens", 5}, {"logprobs", 2}, {"echo", true}};
  const json whole = post("/v1/completions", cbody).at("choices").at(0).at("logprobs");
  json tokens = json::array(), values = json::array(), offsets = json::array();
  std::string stream_text;
  for (const auto& e : stream("/v1/completions", cbody)) {
    if (e.at("choices").empty()) continue;
    stream_text += e["choices"].at(0).at("text").get<std::string>();
    const json& lp = e["choices"][0].at("logprobs");
    if (!lp.is_object()) continue;
    // at(): a chunk whose arrays disagree in length fails here, by name.
    for (size_t i = 0; i < lp.at("tokens").size(); ++i) {
      tokens.push_back(lp["tokens"][i]);
      values.push_back(lp.at("token_logprobs").at(i));
      offsets.push_back(lp.at("text_offset").at(i));
    }
  }
  EXPECT_EQ(tokens, whole["tokens"]);
  EXPECT_EQ(values, whole["token_logprobs"]);
  EXPECT_EQ(offsets, whole["text_offset"]);
  EXPECT_EQ(stream_text, joined(whole["tokens"]));
}

// The scoring contract: for the fp16 cache, a harness that sends the tokens
// of an evaluation window with echo + logprobs + max_tokens 0 gets the
// log-likelihood `kvcodec eval --whole-window` computes on those tokens.
TEST_F(LogprobsServer, EchoedLogprobsEqualEvalNll) {
  const std::string tokens_path = std::string(KVCODEC_SHARED_DIR) + "/models/tinycode/eval_tokens.u16";
  if (!fs::exists(tokens_path)) GTEST_SKIP() << tokens_path << " is absent";
  constexpr int64_t kWindow = 192;  // within the test server's 200-token prompt limit
  const std::vector<int32_t> all = model::load_u16_tokens(tokens_path);
  ASSERT_GE(all.size(), size_t(kWindow));
  const std::vector<int32_t> window(all.begin(), all.begin() + kWindow);

  const json r = post("/v1/completions", {{"prompt", window}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 0}});
  const json& values = r["choices"][0]["logprobs"]["token_logprobs"];
  ASSERT_EQ(values.size(), size_t(kWindow)) << r.dump().substr(0, 400);

  const model::LlamaModel m = model::LlamaModel::load(testing::model_dir());
  model::EvalOptions o;
  o.whole_window = true;
  o.window_length = kWindow;
  o.windows = 1;
  const model::MethodSpec fp16{"fp16", model::method_cache_factory("fp16")};
  const std::vector<model::EvalResult> eval = model::evaluate(m, window, {fp16}, fp16, o);
  ASSERT_EQ(eval.size(), 1u);
  ASSERT_EQ(eval[0].scored, kWindow - 1);
  double nll = 0.0;
  for (int64_t i = 1; i < kWindow; ++i) nll -= values[size_t(i)].get<double>();
  EXPECT_NEAR(nll / double(kWindow - 1), eval[0].nll, 1e-4);

  // Token by token, against the same forward pass read directly.
  model::Session session(m, model::method_cache_factory("fp16"));
  std::vector<float> logits;
  session.forward(window.data(), kWindow, logits, true);
  std::vector<double> lp;
  const int vocab = m.config().vocab_size;
  for (int64_t i = 1; i < kWindow; ++i) {
    model::log_softmax(logits.data() + (i - 1) * vocab, vocab, lp);
    EXPECT_NEAR(values[size_t(i)].get<double>(), lp[size_t(window[size_t(i)])], 1e-4) << "token " << i;
  }
}

}  // namespace
}  // namespace kvcodec::server

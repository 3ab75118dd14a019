// Request-size limits: a prompt text that cannot fit is refused before it is
// tokenized, so a 1 MB single-word prompt is answered at once while the
// server keeps answering /health.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "server_process.hpp"
#include "timing.hpp"

namespace kvcodec::server {
namespace {
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

using kvcodec::testing::kTimedBuild;

TEST(ServerLimits, MegabytePromptAnsweredAtOnceWhileHealthStaysFast) {
  if (!testing::have_model()) GTEST_SKIP() << "models/tinycode is absent";
  ServeOptions o = testing::test_options();
  o.max_body_bytes = 2u << 20;
  o.max_prompt_tokens = 0;  // the model's context minus 1: 2047 tokens
  testing::ServerProcess srv = testing::ServerProcess::start(o);
  ASSERT_GT(srv.port, 0) << srv.startup;
  // 2047 tokens x 64 bytes (tinycode's longest token).
  EXPECT_NE(srv.startup.find("max prompt 2047 tokens (131008 bytes before tokenizing)"), std::string::npos) << srv.startup;

  std::atomic<bool> done{false};
  std::atomic<int> health_polls{0};
  double health_worst_ms = 0;
  std::thread poller([&] {
    auto c = srv.client();
    while (!done.load()) {
      const auto t0 = Clock::now();
      auto r = c.Get("/health");
      const double ms = testing::ms_since(t0);
      EXPECT_TRUE(r && r->status == 200);
      health_worst_ms = std::max(health_worst_ms, ms);
      ++health_polls;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  const std::string word(1000000, 'x');
  struct Case {
    const char* path;
    json body;
  };
  const Case cases[] = {
      {"/v1/completions", {{"prompt", word}, {"max_tokens", 1}}},
      {"/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", word}}}}}},
      {"/tokenize", {{"prompt", word}}},
  };
  for (const auto& c : cases) {
    const auto t0 = Clock::now();
    const json r = srv.post(c.path, c.body.dump(), 400);
    const double ms = testing::ms_since(t0);
    std::printf("[ limits ] 1 MB single-word prompt to %s: 400 in %.1f ms\n", c.path, ms);
    if (kTimedBuild) {
      EXPECT_LT(ms, 1000.0) << c.path;
    }
    ASSERT_TRUE(r.contains("error")) << r.dump();
    EXPECT_NE(r["error"]["message"].get<std::string>().find("at most 131008 bytes"), std::string::npos) << r.dump();
  }
  // Just within the byte bound: tokenized, then refused by its token count.
  const json near = srv.post("/v1/completions", json{{"prompt", std::string(131008, 'x')}}.dump(), 400);
  EXPECT_NE(near["error"]["message"].get<std::string>().find("tokens; this server takes at most 2047"), std::string::npos)
      << near.dump();
  done = true;
  poller.join();
  std::printf("[ limits ] /health: %d polls during the requests, slowest %.1f ms\n", health_polls.load(), health_worst_ms);
  EXPECT_GT(health_polls.load(), 0);
  if (kTimedBuild) {
    EXPECT_LT(health_worst_ms, 50.0);
  }
  // A token-id prompt longer than allowed is refused before its ids are checked.
  srv.post("/v1/completions", json{{"prompt", std::vector<int>(3000, 99999)}}.dump(), 400);
  srv.stop();
}

}  // namespace
}  // namespace kvcodec::server

// 16 clients at once (completions, chat, streaming) while a monitor polls
// /v1/kv/stats: every reply equals the one the same request got alone
// (greedy, fp16), and the stats stay consistent at every poll. Also run
// under ThreadSanitizer (scripts/test.sh).
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>

#include "server_process.hpp"

namespace kvcodec::server {
namespace {
using json = nlohmann::json;

struct Call {
  std::string path;
  json body;
  bool stream = false;
};

// The reply text of one call (streamed chunks joined), or "" with a failure.
std::string reply_text(const testing::ServerProcess& srv, const Call& c) {
  auto cl = srv.client();
  auto r = cl.Post(c.path.c_str(), c.body.dump(), "application/json");
  EXPECT_TRUE(r && r->status == 200) << c.body.dump() << " -> " << (r ? r->body : "no answer");
  if (!r || r->status != 200) return "";
  const bool chat = c.path.find("chat") != std::string::npos;
  if (!c.stream) {
    const json j = json::parse(r->body);
    return chat ? j["choices"][0]["message"]["content"].get<std::string>() : j["choices"][0]["text"].get<std::string>();
  }
  std::string text;
  std::istringstream in(r->body);
  std::string line;
  bool done = false;
  while (std::getline(in, line)) {
    if (line.rfind("data: ", 0) != 0) continue;
    if (line == "data: [DONE]") {
      done = true;
      continue;
    }
    const json e = json::parse(line.substr(6));
    if (e["choices"].empty()) continue;
    const json& ch = e["choices"][0];
    if (chat && ch["delta"].contains("content")) text += ch["delta"]["content"].get<std::string>();
    if (!chat) text += ch["text"].get<std::string>();
  }
  EXPECT_TRUE(done) << "stream without [DONE]";
  return text;
}

TEST(ServerConcurrency, SixteenClientsGetTheirSequentialReplies) {
  if (!testing::have_model()) GTEST_SKIP() << "models/tinycode is absent";
  ServeOptions o = testing::test_options();
  o.max_queue = 16;
  testing::ServerProcess srv = testing::ServerProcess::start(o);
  ASSERT_GT(srv.port, 0) << srv.startup;
  std::vector<Call> calls;
  for (int i = 0; i < 16; ++i) {
    const std::string p = "def f" + std::to_string(i) + "(x):\n    return x + " + std::to_string(i * 7) + "\n\n";
    const bool stream = i % 4 == 3;
    if (i % 2 == 0) {
      calls.push_back({"/v1/completions", {{"prompt", p}, {"max_tokens", 6}, {"stream", stream}}, stream});
    } else {
      calls.push_back({"/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", p}}}}, {"max_tokens", 6},
                                                {"stream", stream}}, stream});
    }
  }
  std::vector<std::string> alone;
  for (const auto& c : calls) alone.push_back(reply_text(srv, c));

  std::vector<std::string> together(calls.size());
  std::atomic<bool> finished{false};
  std::atomic<int> polls{0};
  std::thread monitor([&] {
    auto cl = srv.client();
    while (!finished.load()) {
      auto r = cl.Get("/v1/kv/stats");
      ASSERT_TRUE(r && r->status == 200);
      const json s = json::parse(r->body);
      EXPECT_LE(s["requests"]["queued"].get<int>(), 16);
      EXPECT_LE(s["requests"]["running"].get<int>(), 1);
      EXPECT_LE(s["prefix_store"]["hits"].get<uint64_t>(), s["prefix_store"]["lookups"].get<uint64_t>());
      EXPECT_LE(s["prefix_store"]["bytes"].get<uint64_t>(), s["prefix_store"]["budget_bytes"].get<uint64_t>());
      ++polls;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  // All clients start at once.
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  std::vector<std::thread> clients;
  for (size_t i = 0; i < calls.size(); ++i)
    clients.emplace_back([&, i] {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return go; });
      }
      together[i] = reply_text(srv, calls[i]);
    });
  {
    std::lock_guard<std::mutex> lock(mu);
    go = true;
  }
  cv.notify_all();
  for (auto& t : clients) t.join();
  finished = true;
  monitor.join();
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_FALSE(alone[i].empty()) << i;
    EXPECT_EQ(together[i], alone[i]) << "client " << i << " " << calls[i].body.dump();
  }
  const json s = srv.get("/v1/kv/stats");
  EXPECT_EQ(s["requests"]["served"], 32);
  EXPECT_EQ(s["requests"]["rejected_queue_full"], 0);
  EXPECT_EQ(s["requests"]["failed"], 0);
  EXPECT_GT(polls.load(), 0);
  std::printf("[ concurrency ] 16 clients, 32 replies equal to the sequential ones, %d stats polls\n", polls.load());
  srv.stop();
}

}  // namespace
}  // namespace kvcodec::server

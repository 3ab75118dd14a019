// Faults a request must survive: a prefix store that cannot write (its
// folder replaced by a file) and a non-streaming client that leaves.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <fstream>
#include <thread>

#include "server_process.hpp"

namespace kvcodec::server {
namespace {
namespace fs = std::filesystem;
using json = nlohmann::json;

class ServerFaults : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!testing::have_model()) return;
    dir_ = fs::temp_directory_path() / ("kvcodec_faults_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    ServeOptions o = testing::test_options();
    o.prefix_store_dir = (dir_ / "store").string();
    o.max_tokens_limit = 1024;
    o.max_prompt_tokens = 0;
    server_ = testing::ServerProcess::start(o);
  }
  static void TearDownTestSuite() {
    server_.stop();
    fs::remove_all(dir_);
  }
  void SetUp() override {
    if (!testing::have_model()) GTEST_SKIP() << "models/tinycode is absent";
    ASSERT_GT(server_.port, 0) << server_.startup;
  }
  static inline testing::ServerProcess server_;
  static inline fs::path dir_;
};

TEST_F(ServerFaults, StoreWriteFailureIsCountedAndTheRequestAnswered) {
  // The store folder becomes a file: every entry write fails (even for root).
  const fs::path store = dir_ / "store";
  fs::remove_all(store);
  { std::ofstream f(store); f << "not a folder"; }
  std::string prompt;
  for (int i = 0; i < 6; ++i) prompt += "def w" + std::to_string(i) + "(q):\n    return q ** " + std::to_string(i) + "\n";
  const json r = server_.post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 3}}.dump(), 200);
  EXPECT_EQ(r["usage"]["completion_tokens"], 3);
  const json st = server_.get("/v1/kv/stats");
  EXPECT_EQ(st["prefix_store"]["write_failures"], 1) << st["prefix_store"].dump();
  EXPECT_EQ(st["prefix_store"]["entries"], 0);
  EXPECT_EQ(st["requests"]["failed"], 0);
  EXPECT_NE(st["prefix_store"]["last_failure"].get<std::string>().find("cannot write"), std::string::npos);
  auto c = server_.client();
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m && m->status == 200);
  EXPECT_NE(m->body.find("kvcodec_prefix_store_write_failures_total 1\n"), std::string::npos) << m->body;
  EXPECT_NE(m->body.find("# TYPE kvcodec_requests_served_total counter\n"), std::string::npos);
  fs::remove(store);
  fs::create_directories(store);  // writable again: the next request stores
  server_.post("/v1/completions", json{{"prompt", prompt + "#"}, {"max_tokens", 2}}.dump(), 200);
  EXPECT_EQ(server_.get("/v1/kv/stats")["prefix_store"]["entries"], 1);
}

TEST_F(ServerFaults, NonStreamingClientLeavingCancelsTheGeneration) {
  const json before = server_.get("/v1/kv/stats");
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(server_.port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  const std::string body = R"({"prompt":"def main():","max_tokens":1000})";
  const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                          std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(write(fd, req.data(), req.size()), ssize_t(req.size()));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  close(fd);
  bool cancelled = false;
  json after;
  for (int i = 0; i < 100 && !cancelled; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    after = server_.get("/v1/kv/stats");
    cancelled = after["requests"]["cancelled"].get<uint64_t>() > before["requests"]["cancelled"].get<uint64_t>();
  }
  ASSERT_TRUE(cancelled) << "the model kept generating for a client that left";
  // Stopped early: far fewer than the 1000 tokens asked went through the caches.
  const uint64_t fed = after["tokens"]["seen"].get<uint64_t>() - before["tokens"]["seen"].get<uint64_t>();
  std::printf("[ faults ] client left after 300 ms: %llu of 1004 tokens fed before the cancel\n", (unsigned long long)fed);
  EXPECT_LT(fed, 500u);
  EXPECT_EQ(after["requests"]["served"], before["requests"]["served"]);
  EXPECT_EQ(server_.post("/v1/completions", R"({"prompt":"y = 2","max_tokens":1})", 200)["usage"]["completion_tokens"], 1);
}

}  // namespace
}  // namespace kvcodec::server

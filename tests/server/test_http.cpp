// Integration: the server runs in a child process on a free loopback port;
// the test waits for its ready line, then checks every endpoint (streaming
// included), the error cases, prefix reuse, a client vanishing mid-stream,
// the dashboard in headless Chromium (when installed) and SIGTERM draining.
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <png.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "server/server.hpp"
#include "server_process.hpp"

namespace kvcodec::server {
namespace {
namespace fs = std::filesystem;
using json = nlohmann::json;

using testing::model_dir;

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!testing::have_model()) return;
    server_ = testing::ServerProcess::start(testing::test_options());
    pid_ = server_.pid;
    port_ = server_.port;
    log_ = server_.log;
  }
  static void TearDownTestSuite() {
    server_.pid = pid_;  // -1 once the SIGTERM test has reaped it
    server_.stop();
  }
  void SetUp() override {
    if (!testing::have_model()) GTEST_SKIP() << "models/tinycode is absent (copy it from ../shared/models)";
    ASSERT_GT(port_, 0) << "server did not print its ready line";
  }
  static httplib::Client client() { return server_.client(); }
  static json post(const std::string& path, const std::string& body, int expect_status) {
    return server_.post(path, body, expect_status);
  }
  static json get(const std::string& path) { return server_.get(path); }
  static inline testing::ServerProcess server_;
  static inline pid_t pid_ = -1;
  static inline int port_ = 0;
  static inline FILE* log_ = nullptr;
};

TEST_F(ServerTest, HealthAndModels) {
  EXPECT_EQ(get("/health")["status"], "ok");
  const json m = get("/v1/models");
  ASSERT_EQ(m["data"].size(), 1u);
  EXPECT_EQ(m["data"][0]["id"], "tinycode");
}

TEST_F(ServerTest, CompletionAndChat) {
  const json r = post("/v1/completions", R"({"model":"tinycode","prompt":"def add(a, b):","max_tokens":5})", 200);
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["usage"]["completion_tokens"], 5);
  EXPECT_FALSE(r["choices"][0]["text"].get<std::string>().empty());
  EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
  const json c = post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"print hello"}],"max_tokens":3})", 200);
  EXPECT_EQ(c["object"], "chat.completion");
  EXPECT_EQ(c["choices"][0]["message"]["role"], "assistant");
}

std::vector<json> parse_sse(const std::string& body, bool& saw_done) {
  std::vector<json> events;
  std::istringstream in(body);
  std::string line;
  saw_done = false;
  while (std::getline(in, line)) {
    if (line.rfind("data: ", 0) != 0) continue;
    const std::string data = line.substr(6);
    if (data == "[DONE]") saw_done = true;
    else events.push_back(json::parse(data));
  }
  return events;
}

TEST_F(ServerTest, StreamingChatMatchesNonStreaming) {
  const std::string req = R"({"messages":[{"role":"user","content":"write a loop"}],"max_tokens":6)";
  const json whole = post("/v1/chat/completions", req + "}", 200);
  auto c = client();
  auto r = c.Post("/v1/chat/completions", req + R"(,"stream":true,"stream_options":{"include_usage":true}})", "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_NE(r->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
  bool done = false;
  const auto events = parse_sse(r->body, done);
  EXPECT_TRUE(done);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events[0]["choices"][0]["delta"]["role"], "assistant");
  std::string text;
  std::string finish;
  for (const auto& e : events) {
    EXPECT_EQ(e["object"], "chat.completion.chunk");
    if (e["choices"].empty()) {
      EXPECT_EQ(e["usage"]["completion_tokens"], 6);  // the usage chunk
      continue;
    }
    const auto& ch = e["choices"][0];
    if (ch["delta"].contains("content")) text += ch["delta"]["content"].get<std::string>();
    if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
  }
  EXPECT_EQ(finish, "length");
  EXPECT_EQ(text, whole["choices"][0]["message"]["content"].get<std::string>());
}

TEST_F(ServerTest, StreamingCompletion) {
  auto c = client();
  auto r = c.Post("/v1/completions", R"({"prompt":"import os","max_tokens":4,"stream":true})", "application/json");
  ASSERT_TRUE(r);
  bool done = false;
  const auto events = parse_sse(r->body, done);
  EXPECT_TRUE(done);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back()["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(events.back()["object"], "text_completion");
}

TEST_F(ServerTest, PrefixReuseGivesSameOutput) {
  std::string prompt;
  for (int i = 0; i < 12; ++i) prompt += "def function_" + std::to_string(i) + "(x):\n    return x * " + std::to_string(i) + "\n";
  const std::string body = json{{"prompt", prompt}, {"max_tokens", 8}}.dump();
  const json first = post("/v1/completions", body, 200);
  const json second = post("/v1/completions", body, 200);
  EXPECT_GT(second["kvcodec"]["reused_prompt_tokens"].get<int64_t>(), 32);
  EXPECT_LT(second["kvcodec"]["reused_prompt_tokens"].get<int64_t>(), second["usage"]["prompt_tokens"].get<int64_t>());
  EXPECT_EQ(first["choices"][0]["text"], second["choices"][0]["text"]);  // fp16, greedy
  const json s = get("/v1/kv/stats");
  EXPECT_GE(s["prefix_store"]["hits"].get<int>(), 1);
  EXPECT_GT(s["prefix_store"]["bytes"].get<uint64_t>(), 0u);
  EXPECT_GT(s["tokens"]["retained"].get<uint64_t>(), 0u);
}

TEST_F(ServerTest, ConversationReusesThePreviousTurnAndItsReply) {
  // Turn 2 sends turn 1's prompt, the reply text and a new message. The
  // store keeps the caches with the reply tokens, and the match extends past
  // the last block boundary, so all but the few tokens where the reply text
  // re-tokenizes differently are reused.
  std::string prompt;
  for (int i = 0; i < 8; ++i) prompt += "def g" + std::to_string(i) + "(y):\n    return y + " + std::to_string(i) + "\n";
  const json first = post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 6}}.dump(), 200);
  const int64_t n1 = first["usage"]["prompt_tokens"].get<int64_t>();
  ASSERT_GT(n1, 40);
  const std::string turn2 = prompt + first["choices"][0]["text"].get<std::string>() + "\nprint(g1(2))\n";
  const json second = post("/v1/completions", json{{"prompt", turn2}, {"max_tokens", 2}}.dump(), 200);
  const int64_t reused = second["kvcodec"]["reused_prompt_tokens"].get<int64_t>();
  EXPECT_GE(reused, n1 - 2);  // not cut back to a block boundary (16 here)
  EXPECT_LT(reused, second["usage"]["prompt_tokens"].get<int64_t>());
  EXPECT_GE(second["kvcodec"]["prefix_load_ms"].get<double>(), 0.0);
  EXPECT_GE(get("/v1/kv/stats")["prefix_store"]["superseded"].get<int>(), 1);  // turn 2 extends turn 1
}

TEST_F(ServerTest, TokenizeCountsLikeARequest) {
  const std::string prompt = "import os\nprint(os.getcwd())\n";
  const json t = post("/tokenize", json{{"prompt", prompt}}.dump(), 200);
  const json r = post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 1}}.dump(), 200);
  EXPECT_EQ(t["count"], r["usage"]["prompt_tokens"]);
  EXPECT_EQ(t["tokens"].size(), t["count"].get<size_t>());
  EXPECT_EQ(t["max_model_len"], 2048);
  EXPECT_EQ(t["max_prompt_tokens"], 200);
  const json chat = post("/tokenize", R"({"messages":[{"role":"user","content":"hi"}]})", 200);
  EXPECT_GT(chat["count"].get<int>(), 2);
  const json both = post("/tokenize", R"({"prompt":"a","messages":[]})", 400);
  EXPECT_NE(both["error"]["message"].get<std::string>().find("exactly one"), std::string::npos);
  const json odd = post("/tokenize", R"({"prompt":"a","max_tokens":3})", 400);
  EXPECT_NE(odd["error"]["message"].get<std::string>().find("max_tokens"), std::string::npos);
}

TEST_F(ServerTest, StatsFields) {
  post("/v1/completions", R"({"prompt":"x = 1","max_tokens":2})", 200);
  const json s = get("/v1/kv/stats");
  // --threads reaches the model thread (OpenMP's count is per thread).
  EXPECT_EQ(s["requests"]["model_threads"], 1);
  EXPECT_EQ(s["method"], "fp16");
  EXPECT_EQ(s["coverage"]["layers"], 6);
  for (const char* part : {"key", "value"}) {
    EXPECT_GT(s["last_request"][part]["compressed_bytes"].get<uint64_t>(), 0u);
    EXPECT_DOUBLE_EQ(s["last_request"][part]["ratio"].get<double>(), 1.0);  // fp16 stores f16
  }
  // Memory held by the request's caches: at least what they store, nothing
  // shared for fp16, and the held ratio f16 / resident (just below 1).
  const uint64_t stored = s["last_request"]["key"]["compressed_bytes"].get<uint64_t>() +
                          s["last_request"]["value"]["compressed_bytes"].get<uint64_t>();
  EXPECT_GE(s["last_request"]["resident_bytes"].get<uint64_t>(), stored);
  EXPECT_EQ(s["last_request"]["shared_bytes"].get<uint64_t>(), 0u);
  EXPECT_GT(s["last_request"]["resident_ratio"].get<double>(), 0.5);
  EXPECT_LE(s["last_request"]["resident_ratio"].get<double>(), 1.0);
  EXPECT_GT(s["tokens"]["seen"].get<uint64_t>(), 0u);
  EXPECT_GT(s["memory"]["rss_bytes"].get<uint64_t>(), 1u << 20);
  EXPECT_FALSE(s["ttft"]["recent"].empty());
  EXPECT_EQ(s["requests"]["max_queue"], 4);
  EXPECT_TRUE(s["prefix_store"].contains("hit_rate"));
}

TEST_F(ServerTest, BadRequestsGetJsonErrors) {
  auto expect_error = [](const json& j, const std::string& needle) {
    ASSERT_TRUE(j.is_object() && j.contains("error")) << j.dump();
    EXPECT_NE(j["error"]["message"].get<std::string>().find(needle), std::string::npos) << j.dump();
  };
  expect_error(post("/v1/completions", "{not json", 400), "invalid JSON");
  expect_error(post("/v1/completions", "[1,2]", 400), "JSON object");
  expect_error(post("/v1/completions", R"({"prompt":"a","bogus":1})", 400), "bogus");
  expect_error(post("/v1/completions", R"({"prompt":"a","max_tokens":-1})", 400), "max_tokens");
  expect_error(post("/v1/completions", R"({"prompt":"a","temperature":"hot"})", 400), "temperature");
  expect_error(post("/v1/completions", R"({"max_tokens":1})", 400), "prompt");
  expect_error(post("/v1/chat/completions", R"({"messages":[]})", 400), "messages");
  expect_error(post("/v1/chat/completions", R"({"messages":[{"role":"robot","content":"x"}]})", 400), "robot");
  expect_error(post("/v1/completions", R"({"model":"gpt-9","prompt":"a"})", 404), "gpt-9");
  json long_prompt = {{"prompt", std::vector<int>(300, 5)}};
  expect_error(post("/v1/completions", long_prompt.dump(), 400), "at most 200");
  expect_error(post("/v1/completions", json{{"prompt", std::vector<int>{1, 99999}}}.dump(), 400), "vocabulary");
  expect_error(post("/v1/completions", json{{"prompt", std::string(9000, 'a')}}.dump(), 413), "larger");
  auto c = client();
  auto r = c.Get("/v1/nothing");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  expect_error(json::parse(r->body), "no such endpoint");
  EXPECT_EQ(get("/health")["status"], "ok");  // still serving
}

TEST_F(ServerTest, ClientVanishingMidStreamIsCancelled) {
  const uint64_t before = get("/v1/kv/stats")["requests"]["cancelled"].get<uint64_t>();
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port_));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  const std::string body = R"({"prompt":"def main():","max_tokens":256,"stream":true})";
  const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                          std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(write(fd, req.data(), req.size()), ssize_t(req.size()));
  char buf[512];
  ASSERT_GT(read(fd, buf, sizeof buf), 0);  // the stream has started
  close(fd);
  bool cancelled = false;
  for (int i = 0; i < 100 && !cancelled; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    cancelled = get("/v1/kv/stats")["requests"]["cancelled"].get<uint64_t>() > before;
  }
  EXPECT_TRUE(cancelled) << "the model kept generating for a client that left";
  EXPECT_EQ(post("/v1/completions", R"({"prompt":"y = 2","max_tokens":1})", 200)["usage"]["completion_tokens"], 1);
}

// Renders the dashboard in headless Chromium after 3 s of virtual time (a
// few polls), once: writes its screenshot to `png` and returns its DOM.
std::string chromium(int port, const fs::path& png) {
  const fs::path profile = fs::temp_directory_path() / ("kvcodec_chromium_" + std::to_string(getpid()));
  fs::remove_all(profile);
  const fs::path out = profile.string() + ".out";
  const std::string cmd = "timeout 60 /usr/bin/chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
                          "--disable-background-networking --disable-component-update --disable-sync --hide-scrollbars "
                          "--force-color-profile=srgb --force-device-scale-factor=1 --window-size=900,1700 "
                          "--user-data-dir=" + profile.string() + " --virtual-time-budget=3000 --dump-dom --screenshot=" + png.string() +
                          " http://127.0.0.1:" + std::to_string(port) + "/ > " + out.string() + " 2>/dev/null";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(out);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  fs::remove_all(profile);
  fs::remove(out);
  EXPECT_EQ(rc, 0) << cmd;
  return text;
}

// How many pixels of a PNG have each colour (0xRRGGBB).
std::map<uint32_t, size_t> colour_counts(const fs::path& png_path) {
  std::map<uint32_t, size_t> counts;
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_file(&image, png_path.c_str())) {
    ADD_FAILURE() << "cannot read " << png_path << ": " << image.message;
    return counts;
  }
  image.format = PNG_FORMAT_RGB;
  std::vector<uint8_t> rgb(PNG_IMAGE_SIZE(image));
  if (!png_image_finish_read(&image, nullptr, rgb.data(), 0, nullptr)) {
    ADD_FAILURE() << "cannot decode " << png_path << ": " << image.message;
    return counts;
  }
  for (size_t i = 0; i + 2 < rgb.size(); i += 3) ++counts[uint32_t(rgb[i]) << 16 | uint32_t(rgb[i + 1]) << 8 | rgb[i + 2]];
  return counts;
}

TEST_F(ServerTest, DashboardShowsFigures) {
  auto c = client();
  auto r = c.Get("/");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("/v1/kv/stats"), std::string::npos);
  if (!fs::exists("/usr/bin/chromium")) GTEST_SKIP() << "/usr/bin/chromium is absent (scripts/install_deps.sh installs it); page served but not rendered";
  // Served requests: the second reuses the first's prefix (a hit), so every chart has points.
  const std::string prompt = "def dashboard_test(): pass\n# enough tokens for one block of sixteen tokens";
  post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 2}}.dump(), 200);
  const json hit = post("/v1/completions", json{{"prompt", prompt + " and more"}, {"max_tokens", 2}}.dump(), 200);
  EXPECT_GT(hit["kvcodec"]["reused_prompt_tokens"].get<int64_t>(), 0);
  const json st = get("/v1/kv/stats");
  const json& ps = st["prefix_store"];
  ASSERT_GT(ps["lookups"].get<uint64_t>(), 0u);
  char rate[32];
  std::snprintf(rate, sizeof rate, "%.1f %%", 100.0 * ps["hits"].get<double>() / ps["lookups"].get<double>());
  ASSERT_EQ(st["last_request"]["layers"].size(), 6u);
  EXPECT_EQ(st["last_request"]["layers"][5]["key"]["fp16_bytes"].get<uint64_t>() * 6,
            st["last_request"]["key"]["fp16_bytes"].get<uint64_t>());
  EXPECT_GT(st["ttft"]["recent"].back()["at_s"].get<double>(), 0.0);

  const fs::path png = fs::temp_directory_path() / ("kvcodec_dashboard_" + std::to_string(getpid()) + ".png");
  const std::string dom = chromium(port_, png);
  EXPECT_NE(dom.find("id=\"method\">fp16<"), std::string::npos) << dom.substr(0, 2000);
  EXPECT_NE(dom.find("id=\"ratio\">1.00x<"), std::string::npos);
  EXPECT_NE(dom.find("id=\"rss\">"), std::string::npos);
  EXPECT_NE(dom.find("id=\"status\">updated"), std::string::npos);  // the poll succeeded
  EXPECT_NE(dom.find(" MiB</b>"), std::string::npos);
  EXPECT_NE(dom.find("id=\"backend\">memory<"), std::string::npos);
  EXPECT_NE(dom.find("id=\"health\">healthy<"), std::string::npos);
  EXPECT_NE(dom.find("id=\"hitrate\">" + std::string(rate) + "<"), std::string::npos) << rate;
  EXPECT_NE(dom.find("id=\"ttft_points\">" + std::to_string(st["ttft"]["recent"].size()) + "<"), std::string::npos);
  for (int l = 0; l < 6; ++l) EXPECT_NE(dom.find("id=\"layer" + std::to_string(l) + "\""), std::string::npos) << l;

  // The screenshot: each chart's solid colours are on screen (a dot is 5x5
  // pixels, a layer bar is tens of pixels high), and the health badge is green.
  const std::map<uint32_t, size_t> counts = colour_counts(png);
  fs::remove(png);
  auto count = [&](uint32_t rgb) { return counts.count(rgb) ? counts.at(rgb) : size_t(0); };
  EXPECT_GE(count(0x3366cc), 25u) << "TTFT dots";
  EXPECT_GE(count(0xcc3333), 25u) << "prefix reuse dots";
  EXPECT_GE(count(0xee8800), 6u * 50) << "K bars of 6 layers";
  EXPECT_GE(count(0x339933), 6u * 50) << "V bars of 6 layers";
  EXPECT_GE(count(0x22aa22), 14u * 14) << "the healthy store's badge";
  EXPECT_EQ(count(0xcc2222), 0u) << "an unhealthy badge";
}

// A store that reports its own backend and health (the Redis store's
// fields): the page shows them, the extra counters, and a red badge when
// unhealthy. Served by a stand-in server with fixed stats, so no store is needed.
TEST(DashboardPage, ShowsAStoreReportedBackendAndHealth) {
  if (!fs::exists("/usr/bin/chromium")) GTEST_SKIP() << "/usr/bin/chromium is absent (scripts/install_deps.sh installs it)";
  std::ifstream in(std::string(KVCODEC_SOURCE_DIR) + "/web/index.html");
  const std::string page((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(page.empty());
  const json part = {{"compressed_bytes", 100}, {"fp16_bytes", 1000}, {"ratio", 10.0}};
  const json stats = {
      {"method", "kvtc"},
      {"retained", {{"key", part}, {"value", part}, {"total", part}}},
      {"memory", {{"rss_bytes", 1 << 20}}},
      {"ttft", {{"mean_ms", 5.0}, {"recent", json::array({{{"ttft_ms", 5.0}, {"reused_tokens", 0}, {"at_s", 1.0}}})}}},
      {"last_request", {{"layers", json::array({{{"key", part}, {"value", part}, {"total", part}}})}}},
      {"requests", {{"served", 1}, {"queued", 0}}},
      {"prefix_store", {{"kind", "redis"}, {"backend", "redis://127.0.0.1:6399"}, {"healthy", false}, {"hits", 3},
                        {"lookups", 4}, {"misses", 1}, {"corrupt", 2}, {"foreign", 5}, {"bytes_stored", 4096},
                        {"rtt_ms", 0.25}, {"write_failures", 0}, {"read_failures", 0}, {"erase_failures", 0}}}};
  httplib::Server fake;
  fake.Get("/", [&](const httplib::Request&, httplib::Response& res) { res.set_content(page, "text/html"); });
  fake.Get("/v1/kv/stats", [&](const httplib::Request&, httplib::Response& res) {
    res.set_content(stats.dump(), "application/json");
  });
  const int port = fake.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  std::thread serving([&] { fake.listen_after_bind(); });
  const fs::path png = fs::temp_directory_path() / ("kvcodec_dashboard_fake_" + std::to_string(getpid()) + ".png");
  const std::string dom = chromium(port, png);
  fake.stop();
  serving.join();
  EXPECT_NE(dom.find("id=\"backend\">redis://127.0.0.1:6399<"), std::string::npos) << dom.substr(0, 3000);
  EXPECT_NE(dom.find("id=\"health\">unhealthy<"), std::string::npos);
  EXPECT_NE(dom.find("id=\"hitrate\">75.0 %<"), std::string::npos);
  EXPECT_NE(dom.find("misses 1, corrupt 2, foreign 5, bytes_stored 4096, rtt_ms 0.25"), std::string::npos);
  const std::map<uint32_t, size_t> counts = colour_counts(png);
  fs::remove(png);
  EXPECT_GE(counts.count(0xcc2222) ? counts.at(0xcc2222) : 0, 14u * 14) << "the unhealthy store's red badge";
  EXPECT_EQ(counts.count(0x22aa22), 0u) << "a green badge";
}

// Last (gtest runs tests in order of definition): SIGTERM drains and exits 0.
TEST_F(ServerTest, ZzSigtermDrainsAndExitsCleanly) {
  // A request in flight when the signal arrives still gets its answer.
  std::thread in_flight([] { post("/v1/completions", R"({"prompt":"def last():","max_tokens":24})", 200); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_EQ(kill(pid_, SIGTERM), 0);
  in_flight.join();
  int status = 0;
  pid_t got = 0;
  for (int i = 0; i < 200 && got == 0; ++i) {
    got = waitpid(pid_, &status, WNOHANG);
    if (got == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(got, pid_) << "server did not exit within 10 s of SIGTERM";
  pid_ = -1;
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  std::string rest;
  char line[4096];
  while (fgets(line, sizeof line, log_)) rest += line;
  EXPECT_NE(rest.find("draining"), std::string::npos) << rest;
  EXPECT_NE(rest.find("stopped"), std::string::npos) << rest;
}

}  // namespace
}  // namespace kvcodec::server

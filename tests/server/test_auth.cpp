// --api-key (docs/server.md, "API key"): the Bearer check, its constant-time
// compare, the loopback rule at start-up, and a real server refusing
// requests without the key with an OpenAI-shaped 401.
#include <gtest/gtest.h>

#include "kvcodec/error.hpp"
#include "server/auth.hpp"
#include "server_process.hpp"

namespace kvcodec::server {
namespace {
using json = nlohmann::json;

TEST(ServerAuth, ConstantTimeEqualIsEquality) {
  EXPECT_TRUE(constant_time_equal("", ""));
  EXPECT_TRUE(constant_time_equal("sk-abc", "sk-abc"));
  EXPECT_FALSE(constant_time_equal("sk-abc", "sk-abd"));
  EXPECT_FALSE(constant_time_equal("sk-abc", "sk-ab"));
  EXPECT_FALSE(constant_time_equal("sk-ab", "sk-abc"));
  EXPECT_FALSE(constant_time_equal("", "x"));
  EXPECT_FALSE(constant_time_equal(std::string("a\0b", 3), std::string("a\0c", 3)));
  EXPECT_FALSE(constant_time_equal(std::string("ab\0", 3), "ab"));  // a padding zero is not a match
}

TEST(ServerAuth, BearerHeader) {
  EXPECT_FALSE(bearer_refusal("Bearer k3y", "k3y"));
  EXPECT_NE(bearer_refusal("", "k3y").value_or("").find("Authorization: Bearer"), std::string::npos);
  EXPECT_NE(bearer_refusal("Basic k3y", "k3y").value_or("").find("must be 'Bearer"), std::string::npos);
  EXPECT_NE(bearer_refusal("Bearer k3", "k3y").value_or("").find("incorrect API key"), std::string::npos);
  EXPECT_TRUE(bearer_refusal("Bearer  k3y", "k3y"));
  EXPECT_TRUE(bearer_refusal("bearer", "k3y"));
  EXPECT_FALSE(path_needs_key("/health"));
  EXPECT_FALSE(path_needs_key("/"));
  for (const char* p : {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/kv/stats", "/metrics", "/tokenize"})
    EXPECT_TRUE(path_needs_key(p)) << p;
}

TEST(ServerAuth, NonLoopbackHostNeedsAKey) {
  for (const char* h : {"127.0.0.1", "127.5.0.9", "::1", "localhost"}) {
    EXPECT_TRUE(is_loopback_host(h)) << h;
    EXPECT_NO_THROW(check_bind_policy(h, "", false)) << h;
  }
  for (const char* h : {"0.0.0.0", "10.0.0.1", "::", "192.168.1.2", "example.com", "128.0.0.1"}) {
    EXPECT_FALSE(is_loopback_host(h)) << h;
    try {
      check_bind_policy(h, "", false);
      ADD_FAILURE() << h << " was allowed without a key";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kConfig);  // the CLI's exit status 2
      EXPECT_NE(std::string(e.what()).find("--host"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("--insecure-no-api-key"), std::string::npos) << e.what();
    }
    EXPECT_NO_THROW(check_bind_policy(h, "k", false));
    EXPECT_NO_THROW(check_bind_policy(h, "", true));
  }
}

TEST(ServerAuth, RequestsWithoutTheKeyGet401) {
  if (!testing::have_model()) GTEST_SKIP() << "models/tinycode is absent";
  ServeOptions o = testing::test_options();
  o.api_key = "sk-test-0123456789";
  testing::ServerProcess p = testing::ServerProcess::start(o);
  ASSERT_GT(p.port, 0) << p.startup;
  EXPECT_NE(p.startup.find("api key required"), std::string::npos) << p.startup;
  auto c = p.client();
  const std::string body = R"({"prompt":"def f():","max_tokens":1})";
  auto expect_401 = [&](const httplib::Result& r, const char* what) {
    ASSERT_TRUE(r) << what;
    EXPECT_EQ(r->status, 401) << what << ": " << r->body;
    EXPECT_EQ(r->get_header_value("WWW-Authenticate"), "Bearer") << what;
    const json j = json::parse(r->body, nullptr, false);
    EXPECT_EQ(j["error"]["type"], "authentication_error") << what << ": " << r->body;
    EXPECT_EQ(j["error"]["code"], 401) << what;
    EXPECT_TRUE(j["error"]["message"].is_string()) << what;
  };
  expect_401(c.Get("/v1/models"), "models without a key");
  expect_401(c.Get("/v1/kv/stats"), "stats without a key");
  expect_401(c.Get("/metrics"), "metrics without a key");
  expect_401(c.Post("/v1/completions", body, "application/json"), "completion without a key");
  expect_401(c.Post("/v1/completions", {{"Authorization", "Bearer sk-test-012345678"}}, body, "application/json"),
             "completion with a wrong key");
  expect_401(c.Post("/v1/chat/completions", {{"Authorization", "sk-test-0123456789"}},
                    R"({"messages":[{"role":"user","content":"x"}]})", "application/json"),
             "chat without the Bearer scheme");
  // /health and the dashboard page stay open (load balancers, a browser).
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto d = c.Get("/");
  ASSERT_TRUE(d);
  EXPECT_EQ(d->status, 200);
  const httplib::Headers key = {{"Authorization", "Bearer sk-test-0123456789"}};
  auto ok = c.Post("/v1/completions", key, body, "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  EXPECT_EQ(json::parse(ok->body)["usage"]["completion_tokens"], 1);
  auto m = c.Get("/v1/models", key);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  p.stop();
}

TEST(ServerAuth, NonLoopbackBindWithoutKeyRefusesToStart) {
  if (!testing::have_model()) GTEST_SKIP() << "models/tinycode is absent";
  ServeOptions o = testing::test_options();
  o.host = "0.0.0.0";
  testing::ServerProcess p = testing::ServerProcess::start(o);
  EXPECT_EQ(p.port, 0) << "it started: " << p.startup;
  EXPECT_NE(p.startup.find("--host"), std::string::npos) << p.startup;
  int status = 0;
  ASSERT_EQ(waitpid(p.pid, &status, 0), p.pid);
  p.pid = -1;
  EXPECT_TRUE(WIFEXITED(status));
  p.stop();
}

}  // namespace
}  // namespace kvcodec::server

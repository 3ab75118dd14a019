// Model identity in the prefix-store scope: a persistent store shared by two
// checkpoints of the same shape (the shipped model and a copy with one
// weight changed) never serves one's KV to the other.
#include <gtest/gtest.h>

#include <fstream>

#include "server_process.hpp"

namespace kvcodec::server {
namespace {
namespace fs = std::filesystem;
using json = nlohmann::json;

// A copy of the shipped model in `to` with the lowest mantissa bit of one
// value of the last tensor flipped (a file's last bytes are tensor data).
void copy_with_one_weight_changed(const fs::path& to) {
  fs::create_directories(to);
  for (const auto& f : fs::directory_iterator(testing::model_dir())) fs::copy_file(f.path(), to / f.path().filename());
  const fs::path shard = to / "model-00002-of-00002.safetensors";
  fs::permissions(shard, fs::perms::owner_read | fs::perms::owner_write);
  std::fstream io(shard, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(io) << shard;
  io.seekg(-2, std::ios::end);
  char c = 0;
  io.get(c);
  io.seekp(-2, std::ios::end);
  io.put(char(c ^ 1));
}

TEST(ServerModelIdentity, PersistentStoreNeverServesAnotherCheckpoint) {
  if (!testing::have_model()) GTEST_SKIP() << "models/tinycode is absent";
  const fs::path tmp = fs::temp_directory_path() / ("kvcodec_identity_" + std::to_string(getpid()));
  fs::remove_all(tmp);
  copy_with_one_weight_changed(tmp / "tinycode");
  ServeOptions o = testing::test_options();
  o.prefix_store_dir = (tmp / "store").string();
  ServeOptions changed = o;
  changed.model_dir = (tmp / "tinycode").string();
  std::string prompt;
  for (int i = 0; i < 6; ++i) prompt += "def h" + std::to_string(i) + "(z):\n    return z - " + std::to_string(i) + "\n";
  const std::string body = json{{"prompt", prompt}, {"max_tokens", 4}}.dump();

  testing::ServerProcess a = testing::ServerProcess::start(o);
  ASSERT_GT(a.port, 0) << a.startup;
  a.post("/v1/completions", body, 200);
  EXPECT_GT(a.post("/v1/completions", body, 200)["kvcodec"]["reused_prompt_tokens"].get<int64_t>(), 16);
  const std::string identity_a = a.get("/v1/kv/stats")["model_identity"];
  a.stop();

  testing::ServerProcess b = testing::ServerProcess::start(changed);
  ASSERT_GT(b.port, 0) << b.startup;
  EXPECT_NE(b.startup.find("0 entries found"), std::string::npos) << b.startup;
  const json rb = b.post("/v1/completions", body, 200);
  EXPECT_EQ(rb["kvcodec"]["reused_prompt_tokens"], 0) << "served the other checkpoint's KV";
  const json sb = b.get("/v1/kv/stats");
  EXPECT_EQ(sb["prefix_store"]["hits"], 0);
  const std::string identity_b = sb["model_identity"];
  b.stop();
  // Same config.json, so the first half (the config hash) agrees; the weights' half differs.
  EXPECT_NE(identity_a, identity_b);
  EXPECT_EQ(identity_a.substr(0, identity_a.find('-')), identity_b.substr(0, identity_b.find('-')));

  // The first model's entry was left alone by the second server (another
  // scope) and still serves the first model after a restart.
  testing::ServerProcess again = testing::ServerProcess::start(o);
  ASSERT_GT(again.port, 0) << again.startup;
  EXPECT_NE(again.startup.find("1 entries found"), std::string::npos) << again.startup;
  EXPECT_GT(again.post("/v1/completions", body, 200)["kvcodec"]["reused_prompt_tokens"].get<int64_t>(), 16);
  EXPECT_EQ(again.get("/v1/kv/stats")["model_identity"], identity_a);
  again.stop();
  fs::remove_all(tmp);
}

}  // namespace
}  // namespace kvcodec::server

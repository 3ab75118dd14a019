// Prefix store: index at block boundaries, LRU within the byte budget,
// token confirmation, disk persistence, corrupted entries dropped.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "kvcodec/error.hpp"
#include "server/prefix_store.hpp"

namespace kvcodec::server {
namespace {
namespace fs = std::filesystem;

PrefixEntry make_entry(const std::string& scope, std::vector<int32_t> tokens, size_t layer_bytes = 100) {
  PrefixEntry e;
  e.scope = scope;
  e.tokens = std::move(tokens);
  for (int l = 0; l < 2; ++l) {
    std::vector<uint8_t> b(layer_bytes);
    for (size_t i = 0; i < b.size(); ++i) b[i] = uint8_t(i * 7 + l + e.tokens[0]);
    e.layers.push_back(b);
  }
  e.bytes = {10, 20, 40, 80};
  return e;
}

std::vector<int32_t> seq(int n, int start = 0) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[size_t(i)] = start + i;
  return t;
}

TEST(PrefixEntry, RoundTripsAndRejectsCorruption) {
  const PrefixEntry e = make_entry("fp16", seq(8));
  std::vector<uint8_t> bytes = encode_prefix_entry(e);
  const PrefixEntry d = decode_prefix_entry(bytes.data(), bytes.size());
  EXPECT_EQ(d.scope, "fp16");
  EXPECT_EQ(d.tokens, e.tokens);
  EXPECT_EQ(d.layers, e.layers);
  EXPECT_EQ(d.bytes.fp16_value, 80u);
  for (size_t i = 0; i < bytes.size(); i += 13) {
    std::vector<uint8_t> bad = bytes;
    bad[i] ^= 0x20;
    EXPECT_THROW(decode_prefix_entry(bad.data(), bad.size()), Error) << "flip at " << i;
  }
  EXPECT_THROW(decode_prefix_entry(bytes.data(), bytes.size() / 2), Error);
}

TEST(PrefixStore, FindsLongestSharedPrefixTokenByToken) {
  MemoryPrefixStore store("fp16", 4, 1 << 20);
  std::vector<int32_t> a = seq(12);
  ASSERT_TRUE(store.put(make_entry("fp16", a)));
  // Same first 9 tokens, then different: found at the 8-token boundary,
  // extended to the 9 shared tokens.
  std::vector<int32_t> q = seq(9);
  q.push_back(1000);
  q.push_back(1001);
  auto m = store.lookup(q.data(), int64_t(q.size()), int64_t(q.size()) - 1);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->matched_tokens, 9);
  EXPECT_EQ(m->entry.tokens, a);
  // max_tokens caps the match (the server keeps at least one token to prefill).
  m = store.lookup(a.data(), 12, 11);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->matched_tokens, 11);
  // Nothing shared in the first block: a miss.
  std::vector<int32_t> other = seq(12, 500);
  EXPECT_FALSE(store.lookup(other.data(), 12, 12));
  const auto st = store.stats();
  EXPECT_EQ(st.lookups, 3u);
  EXPECT_EQ(st.hits, 2u);
  EXPECT_EQ(st.reused_tokens, 20u);
  EXPECT_EQ(st.entries, 1u);
  EXPECT_EQ(st.tokens, 12u);
  EXPECT_EQ(st.cache_bytes.compressed_value, 20u);
}

TEST(PrefixStore, PrefersTheLongestCandidateAtABoundary) {
  MemoryPrefixStore store("m", 4, 1 << 20);
  // Two entries share the first 8 tokens and differ after; the prompt
  // follows the second one further, although the first is more recent.
  std::vector<int32_t> x = seq(8), y = seq(8);
  x.insert(x.end(), {50, 51, 52});
  y.insert(y.end(), {60, 61, 62});
  ASSERT_TRUE(store.put(make_entry("m", y)));
  ASSERT_TRUE(store.put(make_entry("m", x)));
  std::vector<int32_t> q = seq(8);
  q.insert(q.end(), {60, 61, 99, 98});
  auto m = store.lookup(q.data(), int64_t(q.size()), int64_t(q.size()) - 1);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->matched_tokens, 10);
  EXPECT_EQ(m->entry.tokens, y);
  // Sharing less than one block: nothing to find through the index.
  std::vector<int32_t> short_q = {0, 1, 2, 77, 78};
  EXPECT_FALSE(store.lookup(short_q.data(), 5, 4));
}

TEST(PrefixStore, AnEntryThatExtendsAnotherSupersedesIt) {
  MemoryPrefixStore store("m", 4, 1 << 20);
  ASSERT_TRUE(store.put(make_entry("m", seq(6))));   // turn 1
  ASSERT_TRUE(store.put(make_entry("m", seq(6, 40))));  // another conversation
  ASSERT_TRUE(store.put(make_entry("m", seq(10))));  // turn 2 extends turn 1
  auto st = store.stats();
  EXPECT_EQ(st.entries, 2u);
  EXPECT_EQ(st.superseded, 1u);
  EXPECT_EQ(st.tokens, 16u);
  std::vector<int32_t> q = seq(6);
  q.push_back(500);
  auto m = store.lookup(q.data(), 7, 6);
  ASSERT_TRUE(m);  // the longer entry serves the shorter prefix
  EXPECT_EQ(m->matched_tokens, 6);
  EXPECT_EQ(m->entry.tokens.size(), 10u);
  // A branch (not a prefix) does not supersede.
  std::vector<int32_t> branch = seq(5);
  branch.push_back(900);
  ASSERT_TRUE(store.put(make_entry("m", branch)));
  EXPECT_EQ(store.stats().entries, 3u);
}

TEST(PrefixStore, RejectsEntriesShorterThanABlockAndOtherScopes) {
  MemoryPrefixStore store("fp16", 4, 1 << 20);
  EXPECT_THROW(store.put(make_entry("fp16", seq(3))), Error);
  EXPECT_TRUE(store.put(make_entry("fp16", seq(6))));  // any length from one block up
  EXPECT_THROW(store.put(make_entry("kvtc", seq(8))), Error);
  EXPECT_THROW(MemoryPrefixStore("x", 0, 10), Error);
}

TEST(PrefixStore, EvictsLeastRecentlyUsedWithinBudget) {
  const size_t one = encode_prefix_entry(make_entry("m", seq(4, 0))).size();
  MemoryPrefixStore store("m", 4, 2 * one + one / 2);  // room for two entries
  ASSERT_TRUE(store.put(make_entry("m", seq(4, 0))));
  ASSERT_TRUE(store.put(make_entry("m", seq(4, 100))));
  std::vector<int32_t> q0 = seq(4, 0);
  ASSERT_TRUE(store.lookup(q0.data(), 4, 4));  // touch the first: the second is now LRU
  ASSERT_TRUE(store.put(make_entry("m", seq(4, 200))));
  std::vector<int32_t> q1 = seq(4, 100), q2 = seq(4, 200);
  EXPECT_TRUE(store.lookup(q0.data(), 4, 4));
  EXPECT_FALSE(store.lookup(q1.data(), 4, 4));
  EXPECT_TRUE(store.lookup(q2.data(), 4, 4));
  const auto st = store.stats();
  EXPECT_EQ(st.entries, 2u);
  EXPECT_EQ(st.evictions, 1u);
  EXPECT_LE(st.bytes, st.budget_bytes);
  // Larger than the whole budget: refused, nothing evicted.
  EXPECT_FALSE(store.put(make_entry("m", seq(8, 300), 4 * one)));
  EXPECT_EQ(store.stats().entries, 2u);
  EXPECT_EQ(store.stats().rejected_too_large, 1u);
}

TEST(PrefixStore, ReplacingAnEntryKeepsCountsRight) {
  MemoryPrefixStore store("m", 4, 1 << 20);
  ASSERT_TRUE(store.put(make_entry("m", seq(8))));
  ASSERT_TRUE(store.put(make_entry("m", seq(8))));
  EXPECT_EQ(store.stats().entries, 1u);
  EXPECT_EQ(store.stats().tokens, 8u);
}

class DiskStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kvcodec_prefix_test_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(DiskStoreTest, SurvivesRestart) {
  {
    DiskPrefixStore store("m", 4, 1 << 20, dir_.string());
    ASSERT_TRUE(store.put(make_entry("m", seq(8))));
    ASSERT_TRUE(store.put(make_entry("m", seq(4, 50))));
  }
  DiskPrefixStore again("m", 4, 1 << 20, dir_.string());
  EXPECT_EQ(again.stats().entries, 2u);
  EXPECT_EQ(again.stats().corrupt_dropped, 0u);
  std::vector<int32_t> q = seq(10);
  auto m = again.lookup(q.data(), 10, 9);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->matched_tokens, 8);
  EXPECT_EQ(m->entry.layers, make_entry("m", seq(8)).layers);
  // Another scope sees none of them and deletes none of them.
  DiskPrefixStore other("kvtc", 4, 1 << 20, dir_.string());
  EXPECT_EQ(other.stats().entries, 0u);
  EXPECT_EQ(other.stats().corrupt_dropped, 0u);
}

void flip_byte_in_each(const fs::path& dir, size_t at) {
  for (const auto& f : fs::directory_iterator(dir)) {
    std::fstream io(f.path(), std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(std::streamoff(at));
    char c = 0;
    io.read(&c, 1);
    c ^= 0x01;
    io.seekp(std::streamoff(at));
    io.write(&c, 1);
  }
}

TEST_F(DiskStoreTest, SupersededEntryFileIsRemoved) {
  DiskPrefixStore store("m", 4, 1 << 20, dir_.string());
  ASSERT_TRUE(store.put(make_entry("m", seq(6))));
  ASSERT_TRUE(store.put(make_entry("m", seq(11))));  // extends it
  size_t files = 0;
  for (const auto& f : fs::directory_iterator(dir_)) files += f.path().extension() == ".kvprefix";
  EXPECT_EQ(files, 1u);
  EXPECT_EQ(store.stats().superseded, 1u);
  // After a restart the one file still serves the shorter prefix, token-exact.
  DiskPrefixStore again("m", 4, 1 << 20, dir_.string());
  std::vector<int32_t> q = seq(7);
  q.push_back(-5);
  auto m = again.lookup(q.data(), 8, 7);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->matched_tokens, 7);
  EXPECT_EQ(m->entry.tokens, seq(11));
}

TEST_F(DiskStoreTest, CorruptedEntryAtLookupIsDroppedNotServed) {
  DiskPrefixStore store("m", 4, 1 << 20, dir_.string());
  ASSERT_TRUE(store.put(make_entry("m", seq(8))));
  flip_byte_in_each(dir_, 150);  // inside a layer payload
  std::vector<int32_t> q = seq(8);
  EXPECT_FALSE(store.lookup(q.data(), 8, 8));
  EXPECT_EQ(store.stats().corrupt_dropped, 1u);
  EXPECT_EQ(store.stats().entries, 0u);
  EXPECT_TRUE(fs::is_empty(dir_));
  // Recomputed and stored again: served.
  ASSERT_TRUE(store.put(make_entry("m", seq(8))));
  EXPECT_TRUE(store.lookup(q.data(), 8, 8));
}

TEST_F(DiskStoreTest, CorruptedEntryAtStartupIsRemoved) {
  {
    DiskPrefixStore store("m", 4, 1 << 20, dir_.string());
    ASSERT_TRUE(store.put(make_entry("m", seq(8))));
  }
  flip_byte_in_each(dir_, 40);
  { std::ofstream junk(dir_ / "0123456789abcdef.kvprefix"); junk << "not a container"; }
  DiskPrefixStore again("m", 4, 1 << 20, dir_.string());
  EXPECT_EQ(again.stats().entries, 0u);
  EXPECT_EQ(again.stats().corrupt_dropped, 2u);
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(DiskStoreTest, BudgetAppliesToEntriesFoundAtStartup) {
  const size_t one = encode_prefix_entry(make_entry("m", seq(4, 0))).size();
  {
    DiskPrefixStore store("m", 4, 1 << 20, dir_.string());
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(store.put(make_entry("m", seq(4, 100 * i))));
  }
  DiskPrefixStore small("m", 4, 2 * one, dir_.string());
  EXPECT_EQ(small.stats().entries, 2u);
  EXPECT_LE(small.stats().bytes, 2 * one);
  size_t files = 0;
  for (const auto& f : fs::directory_iterator(dir_)) files += f.is_regular_file();
  EXPECT_EQ(files, 2u);
}

// A back end that fails or stalls on demand.
class FaultyStore final : public IndexedPrefixStore {
 public:
  using IndexedPrefixStore::IndexedPrefixStore;
  std::atomic<bool> fail_writes{false}, lose_reads{false};
  std::atomic<int> write_sleep_ms{0};
  std::atomic<bool> writing{false};

 protected:
  void write_blob(uint64_t id, const std::vector<uint8_t>& bytes) override {
    writing = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(write_sleep_ms.load()));
    writing = false;
    if (fail_writes) throw Error(ErrorCode::kIo, "disk full (test)");
    std::lock_guard<std::mutex> lock(mu_);
    blobs_[id] = bytes;
  }
  std::optional<std::vector<uint8_t>> read_blob(uint64_t id) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blobs_.find(id);
    if (lose_reads || it == blobs_.end()) return std::nullopt;
    return it->second;
  }
  void erase_blob(uint64_t id) override {
    std::lock_guard<std::mutex> lock(mu_);
    blobs_.erase(id);
  }
  const char* kind() const override { return "faulty"; }

 private:
  std::mutex mu_;
  std::map<uint64_t, std::vector<uint8_t>> blobs_;
};

TEST(PrefixStore, BackEndFailuresAreCountedNeverThrown) {
  FaultyStore store("m", 4, 1 << 20);
  store.fail_writes = true;
  bool stored = true;
  EXPECT_NO_THROW(stored = store.put(make_entry("m", seq(8))));
  EXPECT_FALSE(stored);
  auto st = store.stats();
  EXPECT_EQ(st.write_failures, 1u);
  EXPECT_EQ(st.entries, 0u);  // the index never learnt of bytes that are not there
  EXPECT_NE(st.last_failure.find("disk full (test)"), std::string::npos) << st.last_failure;
  const auto q = seq(8);
  EXPECT_FALSE(store.lookup(q.data(), 8, 8));
  // Bytes that vanish after the write: a miss, counted, the entry dropped.
  store.fail_writes = false;
  ASSERT_TRUE(store.put(make_entry("m", seq(8))));
  store.lose_reads = true;
  EXPECT_FALSE(store.lookup(q.data(), 8, 8));
  st = store.stats();
  EXPECT_EQ(st.read_failures, 1u);
  EXPECT_EQ(st.entries, 0u);
  EXPECT_EQ(st.hits, 0u);
  EXPECT_EQ(st.failures(), 2u);
}

// No back-end I/O under the store's lock: stats() and lookups of other
// entries answer while a write sleeps.
TEST(PrefixStore, StatsDoNotWaitBehindASlowWrite) {
  FaultyStore store("m", 4, 1 << 20);
  ASSERT_TRUE(store.put(make_entry("m", seq(8, 300))));
  store.write_sleep_ms = 800;
  std::thread writer([&] { EXPECT_TRUE(store.put(make_entry("m", seq(8)))); });
  while (!store.writing) std::this_thread::yield();
  const auto t0 = std::chrono::steady_clock::now();
  const auto st = store.stats();
  const auto q = seq(8, 300);
  const bool hit = store.lookup(q.data(), 8, 8).has_value();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(store.writing) << "the write ended before the check: the measurement says nothing";
  writer.join();
  EXPECT_TRUE(hit);
  EXPECT_EQ(st.entries, 1u);  // the entry being written is not indexed yet
  EXPECT_LT(ms, 400.0) << "stats and lookup waited behind the 800 ms write";
  EXPECT_EQ(store.stats().entries, 2u);
}

}  // namespace
}  // namespace kvcodec::server

// The Redis prefix store against a real redis-server (started here on a free
// loopback port): chunk codec, longest run of chunks, the partial last chunk,
// corrupt / foreign / truncated / evicted chunks as counted misses, write-once
// keys, Redis down / hung / back / restarted from its AOF.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"
#include "redis_process.hpp"
#include "server/redis_store.hpp"

namespace kvcodec::server {
namespace {
using testing::RedisProcess;

constexpr int64_t kChunk = 8;
constexpr int kLayers = 2;

std::vector<int32_t> seq(int64_t n, int32_t start = 0) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[size_t(i)] = start + int32_t(i);
  return t;
}

// Real fp16 caches of n tokens with K/V drawn from the token ids, so the same
// tokens always give the same caches (as a model would).
PrefixEntry make_entry(const std::string& scope, const std::vector<int32_t>& tokens, const std::string& method = "fp16") {
  PrefixEntry e;
  e.scope = scope;
  e.tokens = tokens;
  const int64_t n = int64_t(tokens.size());
  for (int l = 0; l < kLayers; ++l) {
    CacheConfig cc;
    cc.layer = l;
    cc.n_layers = kLayers;
    cc.n_kv_heads = 2;
    cc.head_dim = 16;
    auto cache = make_cache(method, cc);
    Tensor k(DType::kF32, {1, 2, n, 16}), v(DType::kF32, {1, 2, n, 16});
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t s = 0; s < n; ++s)
        for (int64_t d = 0; d < 16; ++d) {
          const size_t i = size_t((h * n + s) * 16 + d);
          k.data_as<float>()[i] = std::sin(float(tokens[size_t(s)] * 31 + d + l));
          v.data_as<float>()[i] = std::cos(float(tokens[size_t(s)] * 17 + d * 3 + h));
        }
    cache->append(k.view(), v.view());
    e.layers.push_back(cache->save());
    e.bytes.add(cache->stats());
  }
  return e;
}

// The served caches hold exactly what caches made from the first `len` tokens hold.
void expect_caches_of(const PrefixMatch& m, const std::vector<int32_t>& tokens, int64_t len) {
  ASSERT_EQ(m.matched_tokens, len);
  const PrefixEntry want = make_entry(m.entry.scope, std::vector<int32_t>(tokens.begin(), tokens.begin() + len));
  ASSERT_EQ(m.entry.layers.size(), want.layers.size());
  for (size_t l = 0; l < want.layers.size(); ++l) {
    auto got = load_cache(m.entry.layers[l].data(), m.entry.layers[l].size());
    auto ref = load_cache(want.layers[l].data(), want.layers[l].size());
    ASSERT_EQ(got->offset(), len);
    const KVPair a = got->fetch(DType::kF32), b = ref->fetch(DType::kF32);
    EXPECT_EQ(std::memcmp(a.keys.data(), b.keys.data(), a.keys.nbytes()), 0) << "layer " << l;
    EXPECT_EQ(std::memcmp(a.values.data(), b.values.data(), a.values.nbytes()), 0) << "layer " << l;
  }
}

TEST(RedisChunk, RoundTripsAndRefusesAnotherBaseOrFlippedBytes) {
  const std::vector<uint8_t> base = encode_prefix_entry(make_entry("s", seq(8)));
  const std::vector<uint8_t> state = encode_prefix_entry(make_entry("s", seq(16)));
  const auto ids = seq(16);
  const std::vector<uint8_t> v = encode_redis_chunk("s", 8, 1, ids.data() + 8, base, state);
  // The delta costs what the new tokens add, not the whole state.
  EXPECT_LT(v.size(), state.size() * 3 / 4) << "base " << base.size() << " state " << state.size();
  const RedisChunk c = decode_redis_chunk(v.data(), v.size());
  EXPECT_EQ(c.index, 1);
  EXPECT_EQ(c.tokens, std::vector<int32_t>(ids.begin() + 8, ids.end()));
  EXPECT_EQ(redis_chunk_state(c, base), state);
  EXPECT_THROW(redis_chunk_state(c, state), Error);  // chained to another state
  EXPECT_THROW(redis_chunk_state(c, {}), Error);
  for (size_t i = 0; i < v.size(); i += 29) {
    std::vector<uint8_t> bad = v;
    bad[i] ^= 0x10;
    EXPECT_THROW(redis_chunk_state(decode_redis_chunk(bad.data(), bad.size()), base), Error) << "flip at " << i;
  }
  EXPECT_THROW(decode_redis_chunk(v.data(), v.size() - 5), Error);
}

// A chunk of a long prefix costs about what its tokens add (zstd must find
// the previous state's bytes megabytes back, not only the recent ones).
TEST(RedisChunk, ALongPrefixsChunkCostsWhatItsTokensAdd) {
  const auto ids = seq(3064);
  const std::vector<uint8_t> base = encode_prefix_entry(make_entry("s", seq(3000)));
  const std::vector<uint8_t> state = encode_prefix_entry(make_entry("s", ids));
  const std::vector<uint8_t> v = encode_redis_chunk("s", 64, 47, ids.data() + 3000, base, state);
  const double added = double(state.size() - base.size());
  EXPECT_LT(double(v.size()), 1.1 * added + 2048) << "state " << state.size() << ", the chunk's tokens add " << added;
  EXPECT_EQ(redis_chunk_state(decode_redis_chunk(v.data(), v.size()), base), state);
}

TEST(RedisChunk, KeysDependOnScopeChunkSizeAndEveryToken) {
  const auto t = seq(24);
  const auto a = redis_chunk_keys("s", 8, t.data(), 24);
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(redis_chunk_keys("s", 8, t.data(), 23).size(), 2u);  // only whole chunks
  EXPECT_NE(redis_chunk_keys("other", 8, t.data(), 24)[0], a[0]);
  EXPECT_NE(redis_chunk_keys("s", 4, t.data(), 24)[1], a[0]);
  auto u = t;
  u[0] = 99;  // an early token changes every later key
  const auto b = redis_chunk_keys("s", 8, u.data(), 24);
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(a[i], b[i]);
}

TEST(RedisUrl, ParsesHostAndPortAndNamesTheFlagOtherwise) {
  EXPECT_EQ(parse_redis_url("redis://10.0.0.7:6380").host, "10.0.0.7");
  EXPECT_EQ(parse_redis_url("redis://10.0.0.7:6380").port, 6380);
  EXPECT_EQ(parse_redis_url("redis://cache/").port, 6379);
  for (const char* bad : {"http://h:1", "redis://", "redis://h:0", "redis://h:65536", "redis://h:x", "redis://u@h:1",
                          "redis://h:1/2"}) {
    try {
      parse_redis_url(bad);
      ADD_FAILURE() << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kConfig) << bad;
      EXPECT_NE(std::string(e.what()).find("--prefix-store"), std::string::npos) << e.what();
    }
  }
}

class RedisStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::have_redis_server()) GTEST_SKIP() << "redis-server is absent (scripts/install_deps.sh installs it)";
    ASSERT_TRUE(redis_.start()) << "redis-server did not answer on port " << redis_.port;
  }
  void TearDown() override { redis_.stop(); }
  RedisEndpoint endpoint() const {
    RedisEndpoint ep;
    ep.port = redis_.port;
    ep.command_timeout_ms = 300;
    ep.max_backoff_ms = 200;
    return ep;
  }
  std::unique_ptr<RedisPrefixStore> store(const std::string& scope = "fp16@m") const {
    return std::make_unique<RedisPrefixStore>(scope, kChunk, 1 << 20, endpoint());
  }
  RedisProcess redis_;
};

TEST_F(RedisStoreTest, LongestRunOfWholeChunksIsServedExactly) {
  auto s = store();
  const auto t = seq(28);  // 3 whole chunks and a partial one
  ASSERT_TRUE(s->put(make_entry("fp16@m", t)));
  EXPECT_EQ(redis_.keys().size(), 3u);  // the partial chunk is never stored
  auto m = s->lookup(t.data(), 28, 27);
  ASSERT_TRUE(m);
  expect_caches_of(*m, t, 24);
  // max_tokens bounds the run (a prompt keeps a token to prefill).
  m = s->lookup(t.data(), 24, 23);
  ASSERT_TRUE(m);
  expect_caches_of(*m, t, 16);
  // A prompt that shares the partial chunk's first tokens, then differs: only
  // whole shared chunks are served, never the stored request's later tokens.
  auto q = seq(40);
  q[26] = 500;
  m = s->lookup(q.data(), 40, 39);
  ASSERT_TRUE(m);
  expect_caches_of(*m, q, 24);
  q[20] = 501;  // differs inside chunk 2
  m = s->lookup(q.data(), 40, 39);
  ASSERT_TRUE(m);
  expect_caches_of(*m, q, 16);
  // The longer prompt's chunks extend the run.
  ASSERT_TRUE(s->put(make_entry("fp16@m", q)));
  m = s->lookup(q.data(), 40, 39);
  ASSERT_TRUE(m);
  expect_caches_of(*m, q, 32);
  const PrefixStoreStats st = s->stats();
  EXPECT_EQ(st.kind, "redis");
  EXPECT_TRUE(st.healthy);
  EXPECT_EQ(st.lookups, 5u);
  EXPECT_EQ(st.hits, 5u);
  EXPECT_EQ(st.stores, 6u);  // 3 chunks, then q's chunks 2, 3 and 4 (0 and 1 were there)
  EXPECT_GT(st.rtt_ms, 0.0);
  EXPECT_EQ(st.failures(), 0u) << st.last_failure;
}

// Raw f16 tokens of a cache (kvtc's window and partial block), from its telemetry.
int64_t raw_tokens_of(const PrefixEntry& e) {
  int64_t most = 0;
  for (const auto& l : e.layers) {
    const CacheStats st = load_cache(l.data(), l.size())->stats();
    most = std::max(most, int64_t(st.extras.at("key.raw_bytes") / (double(st.fp16_key_bytes) / double(st.tokens))));
  }
  return most;
}

TEST_F(RedisStoreTest, ChunksAmongAMethodsRawTokensWaitForALongerRequest) {
  auto s = store("kvtc@m");
  const auto t = seq(100);
  const PrefixEntry e = make_entry("kvtc@m", t, "kvtc");
  const int64_t raw = raw_tokens_of(e);
  ASSERT_GT(raw, 0) << "the kvtc cache holds no raw tail: the test says nothing";
  ASSERT_LT(raw, 100 - kChunk);
  ASSERT_TRUE(s->put(e));
  EXPECT_EQ(int64_t(redis_.keys().size()), (100 - raw) / kChunk) << "raw tail " << raw;
  // Every stored chunk's state holds its tokens coded, as the full cache did.
  auto m = s->lookup(t.data(), 100, 99);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->matched_tokens, (100 - raw) / kChunk * kChunk);
  const PrefixEntry longer = make_entry("kvtc@m", seq(200), "kvtc");
  ASSERT_TRUE(s->put(longer));
  EXPECT_EQ(int64_t(redis_.keys().size()), (200 - raw_tokens_of(longer)) / kChunk);
}

TEST_F(RedisStoreTest, CorruptTruncatedForeignAndEvictedChunksAreCountedMisses) {
  auto s = store();
  const auto t = seq(24);
  ASSERT_TRUE(s->put(make_entry("fp16@m", t)));
  const auto keys = redis_chunk_keys("fp16@m", kChunk, t.data(), 24);
  const std::string chunk1 = redis_.command({"GET", keys[1]}).value();
  // A flipped byte in chunk 1: served up to chunk 0, counted, removed.
  std::string bad = chunk1;
  bad[bad.size() / 2] ^= 0x01;
  redis_.command({"SET", keys[1], bad});
  auto m = s->lookup(t.data(), 24, 23);
  ASSERT_TRUE(m);
  expect_caches_of(*m, t, 8);
  EXPECT_EQ(s->stats().corrupt_dropped, 1u);
  EXPECT_EQ(redis_.command({"EXISTS", keys[1]}).value(), "0");
  // Truncated chunk 0: a miss.
  const std::string chunk0 = redis_.command({"GET", keys[0]}).value();
  redis_.command({"SET", keys[0], chunk0.substr(0, chunk0.size() - 40)});
  EXPECT_FALSE(s->lookup(t.data(), 24, 23));
  EXPECT_EQ(s->stats().corrupt_dropped, 2u);
  // A put rebuilds the removed chunks.
  ASSERT_TRUE(s->put(make_entry("fp16@m", t)));
  m = s->lookup(t.data(), 24, 23);
  ASSERT_TRUE(m);
  expect_caches_of(*m, t, 16);
  // Foreign: another scope's chunk under our key (valid bytes, other model).
  const PrefixEntry other = make_entry("fp16@other", seq(8));
  const auto ov = encode_redis_chunk("fp16@other", kChunk, 0, other.tokens.data(), {}, encode_prefix_entry(other));
  redis_.command({"SET", keys[0], std::string(ov.begin(), ov.end())});
  EXPECT_FALSE(s->lookup(t.data(), 24, 23));
  EXPECT_EQ(s->stats().foreign, 1u);
  // Evicted (gone): a plain miss.
  redis_.command({"DEL", keys[0]});
  EXPECT_FALSE(s->lookup(t.data(), 24, 23));
  const PrefixStoreStats st = s->stats();
  EXPECT_EQ(st.lookups, 5u);
  EXPECT_EQ(st.hits, 2u);
  EXPECT_EQ(st.misses(), 3u);
  EXPECT_EQ(st.corrupt_dropped, 2u);
  EXPECT_EQ(st.read_failures, 0u);
}

TEST_F(RedisStoreTest, ConcurrentWritersOfTheSameChunksAreHarmless) {
  auto a = store(), b = store();
  const auto t = seq(32);
  const PrefixEntry e = make_entry("fp16@m", t);
  std::thread ta([&] { for (int i = 0; i < 5; ++i) a->put(e); });
  std::thread tb([&] { for (int i = 0; i < 5; ++i) b->put(e); });
  ta.join();
  tb.join();
  EXPECT_EQ(a->stats().stores + b->stats().stores, 4u);  // each chunk written once
  EXPECT_EQ(redis_.keys().size(), 4u);
  auto m = b->lookup(t.data(), 32, 31);
  ASSERT_TRUE(m);
  expect_caches_of(*m, t, 24);
  EXPECT_EQ(a->stats().failures() + b->stats().failures(), 0u);
}

TEST_F(RedisStoreTest, RedisDownThenBackReconnectsWithBackoff) {
  redis_.kill_now();
  auto s = store();  // Redis away at start: constructed, unhealthy
  EXPECT_FALSE(s->stats().healthy);
  const auto t = seq(16);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(s->put(make_entry("fp16@m", t)));
  EXPECT_FALSE(s->lookup(t.data(), 16, 15));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  EXPECT_GE(s->stats().read_failures + s->stats().write_failures, 2u);
  ASSERT_TRUE(redis_.start());
  // Within the backoff (at most 200 ms here) the store finds Redis again.
  bool stored = false;
  for (int i = 0; i < 50 && !stored; ++i) {
    stored = s->put(make_entry("fp16@m", t));
    if (!stored) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(stored);
  EXPECT_TRUE(s->stats().healthy);
  EXPECT_TRUE(s->lookup(t.data(), 16, 15));
}

TEST_F(RedisStoreTest, AHungRedisCostsAtMostTheTimeout) {
  auto s = store();
  const auto t = seq(16);
  ASSERT_TRUE(s->put(make_entry("fp16@m", t)));
  ::kill(redis_.pid, SIGSTOP);  // accepts nothing, answers nothing
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(s->lookup(t.data(), 16, 15));
  const double first = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(s->lookup(t.data(), 16, 15));  // within the backoff: no wait at all
  const double both = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ::kill(redis_.pid, SIGCONT);
  EXPECT_LT(first, 1000.0);
  EXPECT_LT(both - first, 50.0);
  EXPECT_FALSE(s->stats().healthy);
}

TEST_F(RedisStoreTest, PrefixesSurviveARedisRestartFromItsAppendOnlyFile) {
  redis_.kill_now();
  redis_.persist = true;
  ASSERT_TRUE(redis_.start());
  const auto t = seq(16);
  {
    auto s = store();
    ASSERT_TRUE(s->put(make_entry("fp16@m", t)));
  }
  redis_.kill_now();  // SIGKILL: only what the AOF holds survives
  ASSERT_TRUE(redis_.start());
  auto s = store();
  auto m = s->lookup(t.data(), 16, 15);
  ASSERT_TRUE(m);
  expect_caches_of(*m, t, 8);
}

}  // namespace
}  // namespace kvcodec::server

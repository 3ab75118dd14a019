#include "server/redis_store.hpp"

#include <xxhash.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec::server {
namespace {

constexpr const char* kLayout = "chunk-v1";
constexpr uint64_t kMaxStateBytes = 1ull << 30;  // a hostile chunk cannot ask for more

std::string hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", (unsigned long long)v);
  return b;
}

std::string state_hash(const std::vector<uint8_t>& state) {
  return state.empty() ? "-" : hex64(XXH3_64bits(state.data(), state.size()));
}

int window_log_for(size_t bytes) {
  int log = 10;  // zstd's smallest window
  while (log < 30 && (size_t(1) << log) < bytes) ++log;
  return log;
}

struct Cctx {
  ZSTD_CCtx* p = ZSTD_createCCtx();
  ~Cctx() { ZSTD_freeCCtx(p); }
};
struct Dctx {
  ZSTD_DCtx* p = ZSTD_createDCtx();
  ~Dctx() { ZSTD_freeDCtx(p); }
};

void check_zstd(size_t rc, const char* what) {
  if (ZSTD_isError(rc)) throw Error(ErrorCode::kFormat, std::string("redis chunk: ") + what + ": " + ZSTD_getErrorName(rc));
}

// zstd with the previous state as prefix: bytes shared with it cost a match.
std::vector<uint8_t> delta_encode(const std::vector<uint8_t>& base, const std::vector<uint8_t>& state) {
  Cctx c;
  if (!c.p) throw Error(ErrorCode::kInternal, "redis chunk: out of memory for a zstd context");
  check_zstd(ZSTD_CCtx_setParameter(c.p, ZSTD_c_compressionLevel, 1), "level");
  check_zstd(ZSTD_CCtx_setParameter(c.p, ZSTD_c_windowLog, window_log_for(base.size() + state.size())), "window");
  // Long-distance matching finds the previous state's bytes megabytes back
  // (level 1's hash table alone keeps only recent positions: measured 2.6x
  // the new tokens' bytes per chunk of a 3000-token state without it).
  check_zstd(ZSTD_CCtx_setParameter(c.p, ZSTD_c_enableLongDistanceMatching, 1), "long-distance matching");
  if (!base.empty()) check_zstd(ZSTD_CCtx_refPrefix(c.p, base.data(), base.size()), "prefix");
  std::vector<uint8_t> out(ZSTD_compressBound(state.size()));
  const size_t n = ZSTD_compress2(c.p, out.data(), out.size(), state.data(), state.size());
  check_zstd(n, "compress");
  out.resize(n);
  return out;
}

// The newest tokens a cache keeps uncompressed (kvtc's raw window and
// partial block; its sinks too, which only makes the bound safe), from the
// method's "key.raw_bytes" telemetry; 0 for methods that report none.
int64_t raw_tail_tokens(const std::vector<std::unique_ptr<KVCache>>& caches) {
  int64_t most = 0;
  for (const auto& c : caches) {
    const CacheStats st = c->stats();
    const auto raw = st.extras.find("key.raw_bytes");
    if (raw == st.extras.end() || st.tokens <= 0 || st.fp16_key_bytes == 0) continue;
    const double f16_per_token = double(st.fp16_key_bytes) / double(st.tokens);
    most = std::max(most, int64_t(std::ceil(raw->second / f16_per_token)));
  }
  return most;
}

}  // namespace

std::vector<std::string> redis_chunk_keys(const std::string& scope, int64_t chunk_tokens, const int32_t* tokens,
                                          int64_t n) {
  std::vector<std::string> keys;
  if (chunk_tokens <= 0) return keys;
  // Seeded by scope and chunk size: two models, methods or chunk sizes never share a key.
  const std::string seed_text = scope + "\n" + std::to_string(chunk_tokens);
  XXH3_state_t* st = XXH3_createState();
  if (!st) throw Error(ErrorCode::kInternal, "redis store: out of memory for a hash state");
  XXH3_128bits_reset_withSeed(st, XXH3_64bits(seed_text.data(), seed_text.size()));
  for (int64_t k = 0; (k + 1) * chunk_tokens <= n; ++k) {
    XXH3_128bits_update(st, tokens + k * chunk_tokens, size_t(chunk_tokens) * sizeof(int32_t));
    const XXH128_hash_t h = XXH3_128bits_digest(st);
    keys.push_back("kvcodec:chunk:" + hex64(h.high64) + hex64(h.low64));
  }
  XXH3_freeState(st);
  return keys;
}

std::vector<uint8_t> encode_redis_chunk(const std::string& scope, int64_t chunk_tokens, int64_t index,
                                        const int32_t* chunk_ids, const std::vector<uint8_t>& base,
                                        const std::vector<uint8_t>& state) {
  ContainerWriter w(ContainerKind::kPrefix);
  w.set_meta("layout", kLayout);
  w.set_meta("scope", scope);
  w.set_meta("chunk_tokens", std::to_string(chunk_tokens));
  w.set_meta("index", std::to_string(index));
  w.set_meta("base", state_hash(base));
  w.set_meta("state", state_hash(state));
  w.set_meta("state_size", std::to_string(state.size()));
  ByteWriter tw;
  for (int64_t i = 0; i < chunk_tokens; ++i) tw.u32(uint32_t(chunk_ids[i]));
  w.add_section("tokens", tw.take());
  w.add_section("delta", delta_encode(base, state));
  return w.finish();
}

RedisChunk decode_redis_chunk(const uint8_t* data, size_t size) {
  const std::string label = "redis chunk";
  const ContainerReader r = ContainerReader::parse(data, size, {}, label);
  r.expect_kind(ContainerKind::kPrefix);
  if (r.meta_or_throw("layout") != kLayout)
    throw Error(ErrorCode::kFormat, label + ": layout '" + r.meta_or_throw("layout") + "', expected " + kLayout);
  auto number = [&](const char* key, uint64_t most) {
    const std::string t = r.meta_or_throw(key);
    if (t.empty() || t.size() > 19 || t.find_first_not_of("0123456789") != std::string::npos || std::stoull(t) > most)
      throw Error(ErrorCode::kFormat, label + ": meta '" + key + "' is not a number in [0, " + std::to_string(most) + "]: '" + t + "'");
    return std::stoull(t);
  };
  RedisChunk c;
  c.scope = r.meta_or_throw("scope");
  c.chunk_tokens = int64_t(number("chunk_tokens", 1u << 20));
  c.index = int64_t(number("index", 1u << 24));
  c.state_size = number("state_size", kMaxStateBytes);
  c.base_hash = r.meta_or_throw("base");
  c.state_hash = r.meta_or_throw("state");
  const auto ts = r.section("tokens");
  if (ts.size() != uint64_t(c.chunk_tokens) * 4)
    throw Error(ErrorCode::kFormat, label + ": section 'tokens' holds " + std::to_string(ts.size()) + " bytes, expected " +
                                        std::to_string(c.chunk_tokens * 4));
  ByteReader br(ts, label + " tokens");
  c.tokens.resize(size_t(c.chunk_tokens));
  for (auto& t : c.tokens) t = int32_t(br.u32());
  const auto d = r.section("delta");
  c.delta.assign(d.begin(), d.end());
  return c;
}

std::vector<uint8_t> redis_chunk_state(const RedisChunk& chunk, const std::vector<uint8_t>& base) {
  if (chunk.base_hash != state_hash(base))
    throw Error(ErrorCode::kChecksum, "redis chunk " + std::to_string(chunk.index) + " is chained to state " +
                                          chunk.base_hash + ", not to the " + state_hash(base) + " rebuilt so far");
  Dctx d;
  if (!d.p) throw Error(ErrorCode::kInternal, "redis chunk: out of memory for a zstd context");
  check_zstd(ZSTD_DCtx_setParameter(d.p, ZSTD_d_windowLogMax, 31), "window");
  if (!base.empty()) check_zstd(ZSTD_DCtx_refPrefix(d.p, base.data(), base.size()), "prefix");
  std::vector<uint8_t> state(size_t(chunk.state_size));
  const size_t n = ZSTD_decompressDCtx(d.p, state.data(), state.size(), chunk.delta.data(), chunk.delta.size());
  check_zstd(n, "decompress");
  if (n != state.size() || state_hash(state) != chunk.state_hash)
    throw Error(ErrorCode::kChecksum, "redis chunk " + std::to_string(chunk.index) + " does not rebuild the state it names");
  return state;
}

// --- the store -------------------------------------------------------------------

RedisPrefixStore::RedisPrefixStore(std::string scope, int64_t chunk_tokens, uint64_t budget_bytes,
                                   RedisEndpoint endpoint)
    : scope_(std::move(scope)), chunk_(chunk_tokens), budget_(budget_bytes), client_(std::move(endpoint)) {
  if (chunk_tokens < 1 || chunk_tokens > 65536)
    throw_config_error("--prefix-chunk", std::to_string(chunk_tokens), "[1, 65536] tokens");
  stats_.kind = "redis";
  stats_.budget_bytes = budget_bytes;
  try {
    client_.ping();
  } catch (const Error& e) {
    count(&PrefixStoreStats::read_failures, e.what());
  }
}

void RedisPrefixStore::count(uint64_t PrefixStoreStats::*counter, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  ++(stats_.*counter);
  if (!why.empty()) stats_.last_failure = why;
}

std::vector<std::vector<uint8_t>> RedisPrefixStore::read_run(const std::vector<std::string>& keys,
                                                             const int32_t* tokens) {
  std::vector<std::vector<uint8_t>> states;
  const auto values = client_.get_many(keys);
  for (size_t k = 0; k < values.size() && values[k]; ++k) {
    const std::string& v = *values[k];
    const std::vector<uint8_t> none;
    try {
      const RedisChunk c = decode_redis_chunk(reinterpret_cast<const uint8_t*>(v.data()), v.size());
      if (c.scope != scope_ || c.chunk_tokens != chunk_ || c.index != int64_t(k)) {
        count(&PrefixStoreStats::foreign, "redis chunk " + keys[k] + " holds scope '" + c.scope + "', chunk " +
                                              std::to_string(c.index) + " of " + std::to_string(c.chunk_tokens));
        break;
      }
      if (!std::equal(c.tokens.begin(), c.tokens.end(), tokens + int64_t(k) * chunk_))
        throw Error(ErrorCode::kFormat, "redis chunk " + keys[k] + " holds other token ids (hash collision)");
      states.push_back(redis_chunk_state(c, states.empty() ? none : states.back()));
    } catch (const Error& e) {
      // Never served; removed so the next writer can store it again.
      count(&PrefixStoreStats::corrupt_dropped, e.what());
      try {
        client_.del(keys[k]);
      } catch (const Error& e2) {
        count(&PrefixStoreStats::erase_failures, e2.what());
      }
      break;
    }
  }
  return states;
}

std::optional<PrefixMatch> RedisPrefixStore::lookup(const int32_t* tokens, int64_t n, int64_t max_tokens) {
  count(&PrefixStoreStats::lookups);
  const std::vector<std::string> keys = redis_chunk_keys(scope_, chunk_, tokens, std::min(n, max_tokens));
  if (keys.empty()) return std::nullopt;
  std::vector<std::vector<uint8_t>> states;
  try {
    states = read_run(keys, tokens);
  } catch (const Error& e) {
    count(&PrefixStoreStats::read_failures, e.what());
    return std::nullopt;
  }
  if (states.empty()) return std::nullopt;
  PrefixMatch m;
  try {
    m.entry = decode_prefix_entry(states.back().data(), states.back().size(), "redis prefix state");
  } catch (const Error& e) {
    count(&PrefixStoreStats::corrupt_dropped, e.what());
    return std::nullopt;
  }
  const int64_t len = int64_t(states.size()) * chunk_;
  if (m.entry.scope != scope_ || int64_t(m.entry.tokens.size()) != len ||
      !std::equal(m.entry.tokens.begin(), m.entry.tokens.end(), tokens)) {
    count(&PrefixStoreStats::corrupt_dropped, "redis prefix state holds another scope or other tokens");
    return std::nullopt;
  }
  m.matched_tokens = len;
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.hits;
  stats_.reused_tokens += uint64_t(len);
  return m;
}

bool RedisPrefixStore::put(const PrefixEntry& entry) {
  if (entry.scope != scope_)
    throw Error(ErrorCode::kInvalidArgument, "redis store: entry scope '" + entry.scope + "' is not the store's '" + scope_ + "'");
  const int32_t* ids = entry.tokens.data();
  const std::vector<std::string> keys = redis_chunk_keys(scope_, chunk_, ids, int64_t(entry.tokens.size()));
  if (keys.empty()) return false;
  bool wrote = false;
  try {
    // The chunks already there (and the state they rebuild, the base of the next).
    std::vector<std::vector<uint8_t>> run = read_run(keys, ids);
    const size_t first = run.size();
    int64_t held = int64_t(entry.tokens.size());
    std::vector<std::unique_ptr<KVCache>> caches;
    for (const auto& bytes : entry.layers) caches.push_back(load_cache(bytes.data(), bytes.size()));
    // Chunks ending among the tokens the method still holds raw (a kvtc
    // window) wait for a later, longer request, which writes them coded:
    // stored now they would keep those tokens at f16 size for good.
    const size_t m = std::min(keys.size(), size_t(std::max<int64_t>(0, held - raw_tail_tokens(caches)) / chunk_));
    if (first >= m) return false;
    // States at every missing chunk end: each layer loaded once and trimmed
    // back chunk by chunk, newest end first.
    std::vector<PrefixEntry> states(m);
    for (size_t k = m; k-- > first;) {
      const int64_t end = int64_t(k + 1) * chunk_;
      PrefixEntry& s = states[k];
      s.scope = scope_;
      s.tokens.assign(ids, ids + end);
      for (auto& c : caches) {
        if (c->trim(held - end) != held - end)
          throw Error(ErrorCode::kUnsupported, "redis store: a " + c->method() + " cache cannot be trimmed to a chunk end");
        s.layers.push_back(c->save());
        s.bytes.add(c->stats());
      }
      held = end;
    }
    caches.clear();
    std::vector<uint8_t> base = first ? std::move(run.back()) : std::vector<uint8_t>{};
    PrefixBytes base_bytes;
    if (first) base_bytes = decode_prefix_entry(base.data(), base.size(), "redis prefix state").bytes;
    for (size_t k = first; k < m; ++k) {
      std::vector<uint8_t> state = encode_prefix_entry(states[k]);
      const std::vector<uint8_t> value = encode_redis_chunk(scope_, chunk_, int64_t(k), ids + int64_t(k) * chunk_, base, state);
      if (value.size() > budget_) {
        count(&PrefixStoreStats::rejected_too_large);
        break;
      }
      // Taken by another writer: its next chunk is chained to its state, not ours.
      if (!client_.set_if_absent(keys[k], std::string(value.begin(), value.end()))) break;
      wrote = true;
      const PrefixBytes& b = states[k].bytes;
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.stores;
      ++stats_.entries;
      stats_.bytes += value.size();
      stats_.tokens += uint64_t(chunk_);
      // The bytes this chunk's tokens add to the caches (the state's minus the previous one's).
      stats_.cache_bytes.compressed_key += b.compressed_key - std::min(b.compressed_key, base_bytes.compressed_key);
      stats_.cache_bytes.compressed_value += b.compressed_value - std::min(b.compressed_value, base_bytes.compressed_value);
      stats_.cache_bytes.fp16_key += b.fp16_key - std::min(b.fp16_key, base_bytes.fp16_key);
      stats_.cache_bytes.fp16_value += b.fp16_value - std::min(b.fp16_value, base_bytes.fp16_value);
      base_bytes = b;
      base = std::move(state);
    }
  } catch (const Error& e) {
    count(&PrefixStoreStats::write_failures, e.what());
  }
  return wrote;
}

PrefixStoreStats RedisPrefixStore::stats() const {
  PrefixStoreStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = stats_;
  }
  s.healthy = client_.healthy();
  s.rtt_ms = client_.mean_rtt_ms();
  s.reconnects = client_.reconnects();
  return s;
}

}  // namespace kvcodec::server

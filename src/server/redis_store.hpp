// The Redis prefix store (issue 19): compressed prefixes in chunks of a fixed
// number of tokens, shared by every server pointed at the same Redis.
//
// Chunk k of a token sequence covers tokens [k*C, (k+1)*C). Its key hashes
// the scope (model identity, method, settings), C and every token id up to
// the chunk's end (XXH3-128), so a lookup is the longest run of consecutive
// chunks whose keys exist (one MGET), and two servers of the same scope
// compute the same keys. Only whole chunks are stored: the tokens of a
// prompt past its last whole chunk are never stored, so a later request
// that shares only part of that chunk cannot be served its tokens.
//
// A chunk's value is a container (kind prefix, meta layout=chunk-v1) of:
//   meta   scope, chunk_tokens, index, base (XXH3-64 of the previous chunk's
//          state, "-" for chunk 0), state (XXH3-64 of this chunk's state),
//          state_size;
//   tokens the chunk's own C token ids (u32 LE);
//   delta  the chunk's state, zstd-compressed with the previous chunk's
//          state as its dictionary (zstd's patch-from), so a chunk costs
//          only what its tokens add: the previous chunks' compressed blocks
//          are matches, not bytes.
// The state after chunk k is encode_prefix_entry() of the caches holding
// tokens [0, (k+1)*C): the caches the request left, loaded and trimmed back
// to the chunk's end (exactly what the memory store serves for that
// prefix). A lookup rebuilds the states chunk by chunk and serves the last.
// Chunks ending among the tokens a method still holds raw (kvtc's window,
// reported as key.raw_bytes) are not written yet: the next, longer request
// of the conversation writes them coded.
//
// Keys are written once (SET NX): concurrent writers of a chunk are
// harmless, and a writer that finds a chunk taken stops (its next chunk
// would be chained to its own state, which it cannot know Redis holds).
// A missing, evicted, truncated or corrupted chunk, one of another scope
// (foreign), or one chained to a state other than the one rebuilt so far
// ends the run there: a counted miss, never an error or a wrong cache.
// Every Redis call is bounded (redis_client.hpp); while Redis is away the
// store answers misses at once and reconnects with backoff.
//
// Memory: bounded by Redis (maxmemory with allkeys-lru evicts whole chunks;
// an evicted chunk ends runs there). budget_bytes bounds one chunk's value;
// stats count the bytes this server wrote.
#pragma once

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "server/prefix_store.hpp"
#include "server/redis_client.hpp"

namespace kvcodec::server {

// Keys of the chunks of tokens[0 .. n): one per whole chunk, "kvcodec:chunk:<32 hex>".
std::vector<std::string> redis_chunk_keys(const std::string& scope, int64_t chunk_tokens, const int32_t* tokens,
                                          int64_t n);

// What a chunk says about itself, decoded.
struct RedisChunk {
  std::string scope;
  int64_t chunk_tokens = 0, index = 0;
  std::vector<int32_t> tokens;  // the chunk's own chunk_tokens ids
  std::string base_hash, state_hash;
  uint64_t state_size = 0;
  std::vector<uint8_t> delta;
};

// `base` is the previous chunk's state (empty for chunk 0).
std::vector<uint8_t> encode_redis_chunk(const std::string& scope, int64_t chunk_tokens, int64_t index,
                                        const int32_t* chunk_ids, const std::vector<uint8_t>& base,
                                        const std::vector<uint8_t>& state);
// Throws Error(kFormat / kChecksum) for malformed bytes.
RedisChunk decode_redis_chunk(const uint8_t* data, size_t size);
// The state a chunk holds, given the previous state; throws Error(kFormat /
// kChecksum) when the chunk is chained to another base or its bytes do not
// rebuild the state it names.
std::vector<uint8_t> redis_chunk_state(const RedisChunk& chunk, const std::vector<uint8_t>& base);

class RedisPrefixStore final : public PrefixStore {
 public:
  // Never throws for Redis being away (start-up says so through stats()).
  RedisPrefixStore(std::string scope, int64_t chunk_tokens, uint64_t budget_bytes, RedisEndpoint endpoint);

  bool put(const PrefixEntry& entry) override;
  std::optional<PrefixMatch> lookup(const int32_t* tokens, int64_t n, int64_t max_tokens) override;
  PrefixStoreStats stats() const override;
  int64_t block() const override { return chunk_; }

 private:
  // Rebuilds the states of the run of chunks present for `keys` (in order),
  // checking each against the tokens; counts corrupt and foreign chunks.
  // Returns the states (one per chunk of the run). Throws Error(kIo) when
  // Redis cannot be asked.
  std::vector<std::vector<uint8_t>> read_run(const std::vector<std::string>& keys, const int32_t* tokens);
  void count(uint64_t PrefixStoreStats::*counter, const std::string& why = {});

  std::string scope_;
  int64_t chunk_;
  uint64_t budget_;
  RedisClient client_;
  mutable std::mutex mu_;  // guards stats_ only (no Redis call under it)
  PrefixStoreStats stats_;
};

}  // namespace kvcodec::server

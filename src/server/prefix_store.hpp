// Compressed prefix store of the server (DESIGN 10, issue 6).
//
// After a request, the server saves its per-layer caches (KVCache::save(),
// so the bytes are as compressed as the method makes them) in one entry: a
// container of kind kPrefix with the token ids and one section per layer.
// Entries (any length from one block up: the prompt and the reply tokens)
// are found by hashes of token prefixes at block boundaries
// (tokens[0 .. k*block) for every k), so a later prompt that shares only the
// first part of a stored prefix still finds it; the match is then extended
// token by token past the boundary, and the server loads the entry and trims
// the caches back to the shared length. Hash hits are confirmed by
// comparing the stored token ids, so a hash collision can never serve a
// wrong cache. An entry that extends a stored one supersedes it.
//
// PrefixStore is the interface the server holds; IndexedPrefixStore keeps
// the index described here in the process, and RedisPrefixStore
// (redis_store.hpp) keeps chunks in a Redis shared by several servers.
//
// The indexed store is bounded by a byte budget (the entry bytes as stored)
// with LRU eviction. Two back ends share the index and the policy:
//   MemoryPrefixStore  entries in memory;
//   DiskPrefixStore    one file per entry in a folder, written atomically;
//                      the index is rebuilt from the folder at start-up, so
//                      entries survive a restart (a temporary file left
//                      by a killed write is removed). Every read re-checks the
//                      container checksums; an entry that fails is dropped
//                      (file removed) and reported as a miss, so it is
//                      recomputed, never served.
// Thread-safe: one mutex guards the index and the counters, and no back-end
// I/O runs under it (blobs are written before the index learns of them, read
// and decoded after the lookup has chosen them, erased after they left the
// index), so stats() never waits behind a slow disk. A back end that fails
// (write error, full disk, unreadable or corrupted bytes) never fails the
// caller: put() returns false, lookup() reports a miss; each failure is
// counted (write_failures, read_failures, corrupt_dropped, erase_failures)
// and the last one is kept as text (last_failure) for the server's log.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvcodec/cache.hpp"

namespace kvcodec::server {

// Byte telemetry of the caches in an entry (summed over layers), kept in
// the index for stats.
struct PrefixBytes {
  uint64_t compressed_key = 0, compressed_value = 0, fp16_key = 0, fp16_value = 0;
  void add(const CacheStats& st) {
    compressed_key += st.compressed_key_bytes;
    compressed_value += st.compressed_value_bytes;
    fp16_key += st.fp16_key_bytes;
    fp16_value += st.fp16_value_bytes;
  }
};

// What an entry holds, decoded.
struct PrefixEntry {
  std::string scope;                         // method + settings the caches were made with
  std::vector<int32_t> tokens;               // the prefix, token ids
  std::vector<std::vector<uint8_t>> layers;  // KVCache::save() of each layer
  PrefixBytes bytes;
};

// Container kind kPrefix: meta "scope", "n_tokens", "n_layers", "bytes"
// ("<ck>,<cv>,<fk>,<fv>"); sections "tokens" (u32 LE ids) and "layer.<i>".
std::vector<uint8_t> encode_prefix_entry(const PrefixEntry& entry);
// Throws Error(kFormat / kChecksum) for any malformed or corrupted input.
PrefixEntry decode_prefix_entry(const uint8_t* data, size_t size, const std::string& label = "<prefix entry>");

struct PrefixStoreStats {
  std::string kind;          // the back end: "memory", "disk", "redis" (or "off" where there is no store)
  bool healthy = true;       // the back end answers (redis: connected; memory and disk: always)
  uint64_t entries = 0;      // entries (redis: chunks this server wrote)
  uint64_t bytes = 0;        // entry bytes as stored (redis: bytes this server wrote)
  uint64_t budget_bytes = 0;
  uint64_t tokens = 0;       // tokens held over all entries
  PrefixBytes cache_bytes;   // summed telemetry of the stored caches
  uint64_t lookups = 0, hits = 0, reused_tokens = 0;
  uint64_t stores = 0, evictions = 0, rejected_too_large = 0, corrupt_dropped = 0;
  uint64_t foreign = 0;     // entries of another scope (model, method, settings) found where ours were looked for
  uint64_t superseded = 0;  // entries dropped because a new entry extends them
  uint64_t write_failures = 0, read_failures = 0, erase_failures = 0;  // back-end errors, never request errors
  double rtt_ms = 0.0;       // mean round trip of a back-end call (redis; 0 for memory and disk)
  uint64_t reconnects = 0;   // redis: connections made again after a loss
  std::string last_failure;  // what the last failure (of any kind above, or corrupt_dropped) was
  uint64_t failures() const { return write_failures + read_failures + erase_failures + corrupt_dropped + foreign; }
  uint64_t misses() const { return lookups - hits; }
  double hit_rate() const { return lookups ? double(hits) / double(lookups) : 0.0; }
};

struct PrefixMatch {
  int64_t matched_tokens = 0;   // shared prefix length, tokens (found at a block boundary, then extended)
  PrefixEntry entry;            // entry.tokens.size() >= matched_tokens
};

// The interface the server uses; the index-based stores (memory, disk) and
// the Redis chunk store (redis_store.hpp) implement it. put() and lookup()
// never throw for back-end trouble (counted in the stats instead); they
// throw Error(kInvalidArgument) only for a caller's mistake.
class PrefixStore {
 public:
  virtual ~PrefixStore() = default;
  // Keeps the caches of entry (entry.layers: KVCache::save() of every layer
  // holding entry.tokens). Returns whether anything was stored.
  virtual bool put(const PrefixEntry& entry) = 0;
  // The longest stored prefix of tokens[0 .. n) at most max_tokens long: its
  // caches hold exactly match.entry.tokens, of which the first
  // matched_tokens are shared with the prompt (the server trims the rest).
  virtual std::optional<PrefixMatch> lookup(const int32_t* tokens, int64_t n, int64_t max_tokens) = 0;
  virtual PrefixStoreStats stats() const = 0;
  // The shortest entry put() takes, tokens.
  virtual int64_t block() const = 0;
};

class IndexedPrefixStore : public PrefixStore {
 public:
  // block: the boundary spacing of the index (tokens); budget_bytes: 0 disables storing.
  IndexedPrefixStore(std::string scope, int64_t block, uint64_t budget_bytes);
  IndexedPrefixStore(const IndexedPrefixStore&) = delete;
  IndexedPrefixStore& operator=(const IndexedPrefixStore&) = delete;

  // Stores the entry (at least one block of tokens, any length beyond);
  // evicts least recently used entries to stay within the budget. An entry
  // larger than the whole budget is not stored. Replaces an entry for the
  // same tokens and drops entries whose tokens are a prefix of the new one
  // (superseded). Returns whether it was stored.
  bool put(const PrefixEntry& entry) override;

  // The longest stored prefix of tokens[0 .. n) that is at most max_tokens
  // long: found through the block-boundary index (so at least one block
  // must be shared), then extended token by token against the stored ids.
  // Counts a lookup (and a hit). A corrupted entry is dropped and the
  // search goes on.
  std::optional<PrefixMatch> lookup(const int32_t* tokens, int64_t n, int64_t max_tokens) override;

  PrefixStoreStats stats() const override;
  int64_t block() const override { return block_; }
  const std::string& scope() const { return scope_; }

 protected:
  // Back end: bytes of entry `id` (a hash of its full token list, seeded by
  // the scope). Called without the store's lock, possibly from several
  // threads: a back end guards its own state. May throw (counted).
  virtual void write_blob(uint64_t id, const std::vector<uint8_t>& bytes) = 0;
  // nullopt when the bytes are gone or unreadable.
  virtual std::optional<std::vector<uint8_t>> read_blob(uint64_t id) = 0;
  virtual void erase_blob(uint64_t id) = 0;
  virtual const char* kind() const = 0;

  // For back ends that find entries at start-up (disk): adds an entry to the
  // index as least recently used so far. Caller holds no lock (constructor).
  void index_existing(uint64_t id, const std::vector<int32_t>& tokens, uint64_t size, const PrefixBytes& bytes);
  void count_corrupt(const std::string& what) { note_failure(stats_.corrupt_dropped, what); }

 private:
  struct Entry {
    std::vector<int32_t> tokens;
    uint64_t size = 0;
    PrefixBytes bytes;
    std::list<uint64_t>::iterator lru;  // position in lru_ (front = most recent)
  };
  struct Candidate {
    uint64_t id;
    int64_t shared;               // tokens shared with the prompt
    std::vector<int32_t> tokens;  // the entry's tokens, to confirm its bytes against
  };
  // Removes `id` from the index; its bytes are erased later, outside the
  // lock (erase_blobs), so the id joins `erase`.
  void drop_locked(uint64_t id, std::vector<uint64_t>& erase);
  void erase_blobs(const std::vector<uint64_t>& ids);
  void note_failure(uint64_t& counter, const std::string& what);
  void evict_to_fit_locked(uint64_t incoming, std::vector<uint64_t>& erase);
  void insert_locked(uint64_t id, const std::vector<int32_t>& tokens, uint64_t size, const PrefixBytes& bytes,
                     bool most_recent);
  // The longest (then most recently used) entry sharing a block boundary.
  std::optional<Candidate> best_candidate_locked(const int32_t* tokens, int64_t limit,
                                                 const std::vector<uint64_t>& hashes);

  std::string scope_;
  int64_t block_;
  uint64_t budget_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Entry> entries_;
  std::list<uint64_t> lru_;
  // hash of tokens[0 .. k*block) -> ids of entries holding that prefix.
  std::unordered_map<uint64_t, std::vector<uint64_t>> boundary_index_;
  PrefixStoreStats stats_;
};

// Hashes of tokens[0 .. k*block) for k = 1 .. n/block (XXH3-64, streamed).
std::vector<uint64_t> prefix_boundary_hashes(const int32_t* tokens, int64_t n, int64_t block);

class MemoryPrefixStore final : public IndexedPrefixStore {
 public:
  using IndexedPrefixStore::IndexedPrefixStore;

 protected:
  void write_blob(uint64_t id, const std::vector<uint8_t>& bytes) override;
  std::optional<std::vector<uint8_t>> read_blob(uint64_t id) override;
  void erase_blob(uint64_t id) override;
  const char* kind() const override { return "memory"; }

 private:
  std::mutex blobs_mu_;  // the blobs are touched outside the index lock
  std::unordered_map<uint64_t, std::vector<uint8_t>> blobs_;
};

class DiskPrefixStore final : public IndexedPrefixStore {
 public:
  // Creates dir when missing; indexes the entries found there (files
  // "<16 hex>.kvprefix" of the same scope; unreadable or corrupted ones are
  // removed, those of another scope are left alone). Entries beyond the
  // budget are evicted at once.
  DiskPrefixStore(std::string scope, int64_t block, uint64_t budget_bytes, std::string dir);

 protected:
  void write_blob(uint64_t id, const std::vector<uint8_t>& bytes) override;
  std::optional<std::vector<uint8_t>> read_blob(uint64_t id) override;
  void erase_blob(uint64_t id) override;
  const char* kind() const override { return "disk"; }

 private:
  std::string path_of(uint64_t id) const;
  std::string dir_;
};

// What the server's flags ask of the store.
struct PrefixStoreOptions {
  uint64_t budget_bytes = 0;  // 0: no store
  std::string dir;            // --prefix-store-dir: a disk store
  std::string url;            // --prefix-store redis://HOST:PORT: the Redis chunk store (wins over dir)
  int64_t block = 64;         // index spacing (memory, disk)
  int64_t chunk_tokens = 256; // chunk size (redis)
  int redis_timeout_ms = 500; // bound of every Redis call
};

// budget 0 -> nullptr (off); url set -> redis; dir set -> disk; else memory.
std::unique_ptr<PrefixStore> make_prefix_store(const std::string& scope, const PrefixStoreOptions& options);

}  // namespace kvcodec::server

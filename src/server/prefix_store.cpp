#include "server/prefix_store.hpp"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"
#include "server/redis_store.hpp"

namespace kvcodec::server {
namespace fs = std::filesystem;

namespace {

// A prefix entry never needs more layers than a real model has; the bound
// keeps a hostile file from asking for absurd loops.
constexpr uint64_t kMaxLayers = 4096;
constexpr uint64_t kMaxTokens = 1u << 24;

// An entry's id (its file name on disk): the tokens hashed with the scope
// as seed, so stores of two scopes sharing a folder (two models, two
// methods) never overwrite each other's entry for the same tokens.
uint64_t entry_id(const std::string& scope, const std::vector<int32_t>& tokens) {
  return XXH3_64bits_withSeed(tokens.data(), tokens.size() * sizeof(int32_t), XXH3_64bits(scope.data(), scope.size()));
}

uint64_t parse_u64(const std::string& text, const char* what, const std::string& label) {
  if (text.empty() || text.size() > 20 || text.find_first_not_of("0123456789") != std::string::npos)
    throw Error(ErrorCode::kFormat, label + ": meta '" + what + "' is not a number: '" + text + "'");
  return std::stoull(text);
}

}  // namespace

std::vector<uint64_t> prefix_boundary_hashes(const int32_t* tokens, int64_t n, int64_t block) {
  std::vector<uint64_t> out;
  if (block <= 0 || n < block) return out;
  XXH3_state_t* st = XXH3_createState();
  if (!st) throw Error(ErrorCode::kInvalidArgument, "prefix store: out of memory for a hash state");
  XXH3_64bits_reset(st);
  for (int64_t k = 1; k * block <= n; ++k) {
    XXH3_64bits_update(st, tokens + (k - 1) * block, size_t(block) * sizeof(int32_t));
    out.push_back(XXH3_64bits_digest(st));
  }
  XXH3_freeState(st);
  return out;
}

std::vector<uint8_t> encode_prefix_entry(const PrefixEntry& entry) {
  ContainerWriter w(ContainerKind::kPrefix);
  w.set_meta("scope", entry.scope);
  w.set_meta("n_tokens", std::to_string(entry.tokens.size()));
  w.set_meta("n_layers", std::to_string(entry.layers.size()));
  const PrefixBytes& b = entry.bytes;
  w.set_meta("bytes", std::to_string(b.compressed_key) + "," + std::to_string(b.compressed_value) + "," +
                          std::to_string(b.fp16_key) + "," + std::to_string(b.fp16_value));
  ByteWriter tw;
  for (int32_t t : entry.tokens) tw.u32(uint32_t(t));
  w.add_section("tokens", tw.take());
  for (size_t i = 0; i < entry.layers.size(); ++i) w.add_section("layer." + std::to_string(i), entry.layers[i]);
  return w.finish();
}

PrefixEntry decode_prefix_entry(const uint8_t* data, size_t size, const std::string& label) {
  const ContainerReader r = ContainerReader::parse(data, size, {}, label);
  r.expect_kind(ContainerKind::kPrefix);
  PrefixEntry e;
  e.scope = r.meta_or_throw("scope");
  const uint64_t n_tokens = parse_u64(r.meta_or_throw("n_tokens"), "n_tokens", label);
  const uint64_t n_layers = parse_u64(r.meta_or_throw("n_layers"), "n_layers", label);
  if (n_tokens == 0 || n_tokens > kMaxTokens)
    throw Error(ErrorCode::kFormat, label + ": n_tokens " + std::to_string(n_tokens) + " outside [1, 2^24]");
  if (n_layers == 0 || n_layers > kMaxLayers)
    throw Error(ErrorCode::kFormat, label + ": n_layers " + std::to_string(n_layers) + " outside [1, 4096]");
  {
    const std::string text = r.meta_or_throw("bytes");
    uint64_t* fields[4] = {&e.bytes.compressed_key, &e.bytes.compressed_value, &e.bytes.fp16_key, &e.bytes.fp16_value};
    size_t pos = 0;
    for (int i = 0; i < 4; ++i) {
      const size_t end = i < 3 ? text.find(',', pos) : text.size();
      if (end == std::string::npos) throw Error(ErrorCode::kFormat, label + ": meta 'bytes' is not 4 numbers: '" + text + "'");
      *fields[i] = parse_u64(text.substr(pos, end - pos), "bytes", label);
      pos = end + 1;
    }
  }
  const auto ts = r.section("tokens");
  if (ts.size() != n_tokens * 4)
    throw Error(ErrorCode::kFormat, label + ": section 'tokens' holds " + std::to_string(ts.size()) +
                                        " bytes, expected " + std::to_string(n_tokens * 4));
  ByteReader br(ts, label + " tokens");
  e.tokens.resize(size_t(n_tokens));
  for (auto& t : e.tokens) {
    const uint32_t v = br.u32();
    if (v > uint32_t(INT32_MAX)) br.fail("token id " + std::to_string(v) + " out of range");
    t = int32_t(v);
  }
  e.layers.resize(size_t(n_layers));
  for (uint64_t i = 0; i < n_layers; ++i) {
    const auto s = r.section("layer." + std::to_string(i));
    e.layers[size_t(i)].assign(s.begin(), s.end());
  }
  return e;
}

// --- PrefixStore ------------------------------------------------------------

IndexedPrefixStore::IndexedPrefixStore(std::string scope, int64_t block, uint64_t budget_bytes)
    : scope_(std::move(scope)), block_(block), budget_(budget_bytes) {
  if (block <= 0) throw_config_error("prefix_block", std::to_string(block), ">= 1 tokens");
  stats_.budget_bytes = budget_bytes;
}

void IndexedPrefixStore::drop_locked(uint64_t id, std::vector<uint64_t>& erase) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  const Entry& e = it->second;
  for (uint64_t h : prefix_boundary_hashes(e.tokens.data(), int64_t(e.tokens.size()), block_)) {
    auto b = boundary_index_.find(h);
    if (b == boundary_index_.end()) continue;
    auto& ids = b->second;
    ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
    if (ids.empty()) boundary_index_.erase(b);
  }
  stats_.bytes -= e.size;
  stats_.tokens -= e.tokens.size();
  stats_.cache_bytes.compressed_key -= e.bytes.compressed_key;
  stats_.cache_bytes.compressed_value -= e.bytes.compressed_value;
  stats_.cache_bytes.fp16_key -= e.bytes.fp16_key;
  stats_.cache_bytes.fp16_value -= e.bytes.fp16_value;
  lru_.erase(e.lru);
  entries_.erase(it);
  --stats_.entries;
  erase.push_back(id);
}

void IndexedPrefixStore::erase_blobs(const std::vector<uint64_t>& ids) {
  for (uint64_t id : ids) {
    try {
      erase_blob(id);
    } catch (const std::exception& e) {
      note_failure(stats_.erase_failures, std::string("cannot erase entry: ") + e.what());
    }
  }
}

void IndexedPrefixStore::note_failure(uint64_t& counter, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  ++counter;
  stats_.last_failure = what;
}

void IndexedPrefixStore::evict_to_fit_locked(uint64_t incoming, std::vector<uint64_t>& erase) {
  while (!lru_.empty() && stats_.bytes + incoming > budget_) {
    drop_locked(lru_.back(), erase);
    ++stats_.evictions;
  }
}

void IndexedPrefixStore::insert_locked(uint64_t id, const std::vector<int32_t>& tokens, uint64_t size,
                                const PrefixBytes& bytes, bool most_recent) {
  Entry e;
  e.tokens = tokens;
  e.size = size;
  e.bytes = bytes;
  if (most_recent) {
    lru_.push_front(id);
    e.lru = lru_.begin();
  } else {
    lru_.push_back(id);
    e.lru = std::prev(lru_.end());
  }
  for (uint64_t h : prefix_boundary_hashes(tokens.data(), int64_t(tokens.size()), block_)) boundary_index_[h].push_back(id);
  stats_.bytes += size;
  stats_.tokens += tokens.size();
  stats_.cache_bytes.compressed_key += bytes.compressed_key;
  stats_.cache_bytes.compressed_value += bytes.compressed_value;
  stats_.cache_bytes.fp16_key += bytes.fp16_key;
  stats_.cache_bytes.fp16_value += bytes.fp16_value;
  ++stats_.entries;
  entries_.emplace(id, std::move(e));
}

void IndexedPrefixStore::index_existing(uint64_t id, const std::vector<int32_t>& tokens, uint64_t size,
                                 const PrefixBytes& bytes) {
  std::vector<uint64_t> erase;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (entries_.count(id)) return;
    if (size > budget_) {
      erase.push_back(id);
    } else {
      // Files come oldest first; each newer one goes to the front, and the
      // oldest are evicted when the folder holds more than the budget.
      evict_to_fit_locked(size, erase);
      insert_locked(id, tokens, size, bytes, true);
    }
  }
  erase_blobs(erase);
}

bool IndexedPrefixStore::put(const PrefixEntry& entry) {
  const int64_t n = int64_t(entry.tokens.size());
  if (n < block_)
    throw Error(ErrorCode::kInvalidArgument, "prefix store: an entry of " + std::to_string(n) +
                                                 " tokens is shorter than one block (" + std::to_string(block_) +
                                                 "), so no lookup could find it");
  if (entry.scope != scope_)
    throw Error(ErrorCode::kInvalidArgument, "prefix store: entry scope '" + entry.scope + "' is not the store's '" + scope_ + "'");
  std::vector<uint8_t> blob = encode_prefix_entry(entry);
  const uint64_t id = entry_id(scope_, entry.tokens);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (blob.size() > budget_) {
      ++stats_.rejected_too_large;
      return false;
    }
  }
  // The bytes go to the back end outside the lock (stats and lookups do not
  // wait behind a slow disk); the index learns of the entry only once its
  // bytes are in place, so a lookup never finds an entry it cannot read.
  try {
    write_blob(id, blob);
  } catch (const std::exception& e) {
    note_failure(stats_.write_failures, std::string("cannot write entry: ") + e.what());
    return false;
  }
  std::vector<uint64_t> erase;
  {
    std::lock_guard<std::mutex> lock(mu_);
    drop_locked(id, erase);  // same tokens: the new bytes (already written) replace the old
    // An entry whose tokens are a prefix of the new one holds nothing the new
    // one does not (a conversation's previous turn): drop it, so the budget
    // keeps distinct conversations rather than every turn of one.
    std::vector<uint64_t> older;
    for (uint64_t h : prefix_boundary_hashes(entry.tokens.data(), n, block_)) {
      auto b = boundary_index_.find(h);
      if (b == boundary_index_.end()) continue;
      for (uint64_t other : b->second) {
        const auto& ot = entries_.at(other).tokens;
        if (ot.size() <= size_t(n) && std::equal(ot.begin(), ot.end(), entry.tokens.begin())) older.push_back(other);
      }
    }
    std::sort(older.begin(), older.end());
    older.erase(std::unique(older.begin(), older.end()), older.end());
    for (uint64_t other : older) {
      drop_locked(other, erase);
      ++stats_.superseded;
    }
    evict_to_fit_locked(blob.size(), erase);
    insert_locked(id, entry.tokens, blob.size(), entry.bytes, true);
    ++stats_.stores;
    erase.erase(std::remove(erase.begin(), erase.end(), id), erase.end());  // its bytes are the new ones
  }
  erase_blobs(erase);
  return true;
}

std::optional<IndexedPrefixStore::Candidate> IndexedPrefixStore::best_candidate_locked(const int32_t* tokens, int64_t limit,
                                                                         const std::vector<uint64_t>& hashes) {
  // The deepest boundary with a candidate gives the longest match: an entry
  // sharing more than (k+1) blocks would also be indexed at boundary k+1.
  for (int64_t k = int64_t(hashes.size()); k >= 1; --k) {
    auto b = boundary_index_.find(hashes[size_t(k - 1)]);
    if (b == boundary_index_.end()) continue;
    const int64_t len = k * block_;
    // Confirm against the stored tokens (a hash collision never serves a
    // wrong cache) and extend token by token past the boundary, so a prompt
    // that diverges mid-block (a re-tokenized reply, a new message) still
    // reuses everything it shares. Longest first, then most recently used.
    std::optional<Candidate> best;
    size_t best_rank = 0;
    for (uint64_t id : b->second) {
      auto it = entries_.find(id);
      if (it == entries_.end()) continue;
      const auto& st = it->second.tokens;
      if (int64_t(st.size()) < len || !std::equal(st.begin(), st.begin() + len, tokens)) continue;  // collision
      int64_t shared = len;
      const int64_t most = std::min<int64_t>(limit, int64_t(st.size()));
      while (shared < most && st[size_t(shared)] == tokens[shared]) ++shared;
      const size_t rank = size_t(std::distance(lru_.begin(), it->second.lru));
      if (!best || shared > best->shared || (shared == best->shared && rank < best_rank)) {
        best = Candidate{id, shared, st};
        best_rank = rank;
      }
    }
    if (best) return best;
  }
  return std::nullopt;
}

std::optional<PrefixMatch> IndexedPrefixStore::lookup(const int32_t* tokens, int64_t n, int64_t max_tokens) {
  const int64_t limit = std::min(n, max_tokens);
  const std::vector<uint64_t> hashes = prefix_boundary_hashes(tokens, limit, block_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.lookups;
  }
  for (;;) {
    std::optional<Candidate> best;
    {
      std::lock_guard<std::mutex> lock(mu_);
      best = best_candidate_locked(tokens, limit, hashes);
    }
    if (!best) return std::nullopt;
    // Read and check the bytes outside the lock.
    std::optional<std::vector<uint8_t>> blob;
    std::string why;
    try {
      blob = read_blob(best->id);
      if (!blob) why = "entry unreadable or missing";
    } catch (const std::exception& e) {
      why = std::string("cannot read entry: ") + e.what();
    }
    PrefixMatch m;
    bool ok = false;
    if (blob) {
      try {
        m.entry = decode_prefix_entry(blob->data(), blob->size(), "prefix entry " + std::to_string(best->id));
        ok = m.entry.scope == scope_ && m.entry.tokens == best->tokens;
        if (!ok) why = "entry holds another scope or other tokens";
      } catch (const Error& e) {
        why = e.what();
      }
    }
    std::vector<uint64_t> erase;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ok) {
        auto it = entries_.find(best->id);
        if (it != entries_.end()) lru_.splice(lru_.begin(), lru_, it->second.lru);
        ++stats_.hits;
        m.matched_tokens = best->shared;
        stats_.reused_tokens += uint64_t(m.matched_tokens);
        return m;
      }
      // Never served: dropped, so it is recomputed; then look again.
      ++(blob ? stats_.corrupt_dropped : stats_.read_failures);
      stats_.last_failure = why;
      drop_locked(best->id, erase);
    }
    erase_blobs(erase);
  }
}

PrefixStoreStats IndexedPrefixStore::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  PrefixStoreStats s = stats_;
  s.kind = kind();
  return s;
}

// --- back ends ----------------------------------------------------------------

void MemoryPrefixStore::write_blob(uint64_t id, const std::vector<uint8_t>& bytes) {
  std::lock_guard<std::mutex> lock(blobs_mu_);
  blobs_[id] = bytes;
}

void MemoryPrefixStore::erase_blob(uint64_t id) {
  std::lock_guard<std::mutex> lock(blobs_mu_);
  blobs_.erase(id);
}

std::optional<std::vector<uint8_t>> MemoryPrefixStore::read_blob(uint64_t id) {
  std::lock_guard<std::mutex> lock(blobs_mu_);
  auto it = blobs_.find(id);
  if (it == blobs_.end()) return std::nullopt;
  return it->second;
}

DiskPrefixStore::DiskPrefixStore(std::string scope, int64_t block, uint64_t budget_bytes, std::string dir)
    : IndexedPrefixStore(std::move(scope), block, budget_bytes), dir_(std::move(dir)) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (!fs::is_directory(dir_))
    throw Error(ErrorCode::kIo, "--prefix-store-dir '" + dir_ + "' is not a folder and cannot be made one: " + ec.message());
  std::vector<std::pair<fs::file_time_type, fs::path>> files;
  for (const auto& f : fs::directory_iterator(dir_, ec)) {
    std::error_code e2;
    if (!f.is_regular_file(e2)) continue;
    if (f.path().extension() == ".kvprefix") files.emplace_back(f.last_write_time(e2), f.path());
    // A write killed before its rename (SIGKILL, power loss) leaves its
    // temporary file: never an entry, so it is removed.
    if (f.path().extension() == ".tmp" && f.path().stem().extension() == ".kvprefix") fs::remove(f.path(), e2);
  }
  if (ec) throw Error(ErrorCode::kIo, "--prefix-store-dir '" + dir_ + "' cannot be listed: " + ec.message());
  std::sort(files.begin(), files.end());  // oldest first
  for (const auto& [time, path] : files) {
    (void)time;
    const std::string stem = path.stem().string();
    uint64_t id = 0;
    bool named = stem.size() == 16 && stem.find_first_not_of("0123456789abcdef") == std::string::npos;
    if (named) id = std::stoull(stem, nullptr, 16);
    std::optional<std::vector<uint8_t>> blob = named ? read_blob(id) : std::nullopt;
    bool ok = false;
    try {
      if (blob) {
        const PrefixEntry e = decode_prefix_entry(blob->data(), blob->size(), path.string());
        if (e.scope != this->scope()) continue;  // another method's entry: not ours to judge
        ok = int64_t(e.tokens.size()) >= block && entry_id(e.scope, e.tokens) == id;
        if (ok) index_existing(id, e.tokens, blob->size(), e.bytes);
      }
    } catch (const Error&) {
      ok = false;
    }
    if (!ok) {
      // Unreadable, corrupted or misnamed: never served, removed so it is recomputed.
      std::error_code e3;
      fs::remove(path, e3);
      count_corrupt("entry at start-up unreadable or corrupted: " + path.string());
    }
  }
}

std::string DiskPrefixStore::path_of(uint64_t id) const {
  char name[32];
  std::snprintf(name, sizeof name, "%016llx.kvprefix", (unsigned long long)id);
  return (fs::path(dir_) / name).string();
}

void DiskPrefixStore::write_blob(uint64_t id, const std::vector<uint8_t>& bytes) {
  // Temporary file + rename: a crash leaves the old entry or none, never half of one.
  const std::string path = path_of(id), tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    out.flush();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw Error(ErrorCode::kIo, "prefix store: cannot write '" + tmp + "'");
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw Error(ErrorCode::kIo, "prefix store: cannot rename '" + tmp + "' to '" + path + "': " + ec.message());
}

std::optional<std::vector<uint8_t>> DiskPrefixStore::read_blob(uint64_t id) {
  std::ifstream in(path_of(id), std::ios::binary | std::ios::ate);
  if (!in) return std::nullopt;
  const std::streamoff size = in.tellg();
  if (size <= 0) return std::nullopt;
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(bytes.data()), size);
  if (!in) return std::nullopt;
  return bytes;
}

void DiskPrefixStore::erase_blob(uint64_t id) {
  std::error_code ec;
  fs::remove(path_of(id), ec);
}

std::unique_ptr<PrefixStore> make_prefix_store(const std::string& scope, const PrefixStoreOptions& o) {
  if (o.budget_bytes == 0) return nullptr;
  if (!o.url.empty()) {
    RedisEndpoint ep = parse_redis_url(o.url);
    ep.command_timeout_ms = o.redis_timeout_ms;
    return std::make_unique<RedisPrefixStore>(scope, o.chunk_tokens, o.budget_bytes, std::move(ep));
  }
  if (o.dir.empty()) return std::make_unique<MemoryPrefixStore>(scope, o.block, o.budget_bytes);
  return std::make_unique<DiskPrefixStore>(scope, o.block, o.budget_bytes, o.dir);
}

}  // namespace kvcodec::server

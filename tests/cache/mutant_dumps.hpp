// For the `kvcodec decompress` campaign (scripts/mutant_campaign.sh): with
// KVCODEC_MUTANT_DIR set, write KVCODEC_MUTANT_FILES (default 1000) sealed
// mutants of a saved cache, each wrapped as the one layer of a compressed
// dump (container kind 2) whose meta matches the unmutated cache. Nothing
// happens without the variable.
#pragma once

#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "format/reseal.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"

namespace kvcodec::testing_reseal {

// The seed of a mutant test's generator: `base`, moved by
// KVCODEC_MUTANT_SEED (default 0: `base` itself) so that a campaign's
// shards (scripts/fuzz_campaign.sh) draw other mutants of the same cache.
inline uint64_t mutant_seed(uint64_t base) {
  const char* shard = std::getenv("KVCODEC_MUTANT_SEED");
  return base + (shard ? uint64_t(std::strtoull(shard, nullptr, 10)) : 0) * 0x9E3779B97F4A7C15ull;
}

inline void write_dump_mutants(const KVCache& cache, const std::string& tag, uint64_t seed) {
  const char* dir = std::getenv("KVCODEC_MUTANT_DIR");
  if (!dir || !*dir) return;
  const char* count = std::getenv("KVCODEC_MUTANT_FILES");
  const long n = count ? std::atol(count) : 1000;
  const std::vector<uint8_t> saved = cache.save();
  const KVPair kv = cache.fetch(DType::kF32);
  std::mt19937_64 rng(seed);
  for (long i = 0; i < n; ++i) {
    ContainerWriter w(ContainerKind::kDump);
    w.set_meta("format", "kvcodec-dump");
    w.set_meta("method", cache.method());
    w.set_meta("n_layers", "1");
    w.set_meta("batch", std::to_string(kv.keys.shape()[0]));
    w.set_meta("heads", std::to_string(cache.config().n_kv_heads));
    w.set_meta("tokens", std::to_string(cache.offset()));
    w.set_meta("head_dim", std::to_string(cache.config().head_dim));
    w.set_meta("dtype", "f32");
    w.add_section("layer.0", sealed_mutant(saved, rng));
    const std::vector<uint8_t> bytes = w.finish();
    std::ofstream(std::string(dir) + "/" + tag + "_" + std::to_string(i) + ".kvc", std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  }
}

}  // namespace kvcodec::testing_reseal

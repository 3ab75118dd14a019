// Memory as held against bytes stored (issue 16 item 6) on the real KV dump
// (../shared/models/tinycode/kv_dump.safetensors, layers.{i}.key/value
// [1, 2, 2048, 64]): local kvtc at default settings, every layer appended in
// one call as `kvcodec compress` does. Skipped when the shared folder is absent.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "kvcodec/cache.hpp"
#include "kvcodec/safetensors.hpp"

using namespace kvcodec;

// resident / stored was 4.33 before the decoder tables were cut (slot tables
// only where the scalar lanes need them, group tables of the reachable
// column starts only, no cached transposed basis). The target is
// 1.25; what is left above it is listed in docs/kvtc.md (Memory held).
TEST(ResidentDump, LocalKvtcHoldsCloseToWhatItStores) {
  const std::string path = std::string(KVCODEC_SHARED_DIR) + "/models/tinycode/kv_dump.safetensors";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no KV dump at " << path << " (shared folder absent)";
  const SafetensorsFile f = SafetensorsFile::open(path);
  CacheStats total;
  int layers = 0;
  for (int layer = 0; f.contains("layers." + std::to_string(layer) + ".key"); ++layer) {
    const TensorView k = f.view4("layers." + std::to_string(layer) + ".key");
    const TensorView v = f.view4("layers." + std::to_string(layer) + ".value");
    CacheConfig cfg;
    cfg.layer = layer;
    cfg.n_layers = 6;
    cfg.n_kv_heads = int(k.heads());
    cfg.head_dim = int(k.head_dim());
    auto cache = make_cache("kvtc", cfg, {});
    cache->append(k, v);
    total += cache->stats();
    ++layers;
  }
  ASSERT_EQ(layers, 6);
  const double ratio = double(total.resident_bytes) / double(total.compressed_bytes());
  std::printf("[resident dump] kvtc local defaults: stored %llu, resident %llu, resident / stored %.3f\n",
              (unsigned long long)total.compressed_bytes(), (unsigned long long)total.resident_bytes, ratio);
  EXPECT_EQ(total.shared_bytes(), 0u);  // local mode shares nothing
  EXPECT_GE(ratio, 1.0);                // never below the bytes stored
  EXPECT_LE(ratio, 2.42);  // measured 2.419 (4,030,116 / 1,666,074)
}

// Memory as held against bytes stored (issue 16 item 6) on the real KV dump
// (../shared/models/tinycode/kv_dump.safetensors, layers.{i}.key/value
// [1, 2, 2048, 64]): local kvtc at default settings through `kvcodec
// compress`'s path (every layer appended in one call), as compressed and as
// loaded back (`kvcodec inspect`). Skipped when the shared folder is absent.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "cache/dump_codec.hpp"
#include "kvcodec/cache.hpp"

using namespace kvcodec;

namespace {

// The cache config of one layer of the dump (tinycode's rope_theta).
CacheConfig layer_config(const dump::KvDump& kv, int layer) {
  CacheConfig cfg;
  cfg.layer = layer;
  cfg.n_layers = kv.n_layers();
  cfg.n_kv_heads = int(kv.shape[1]);
  cfg.head_dim = int(kv.shape[3]);
  cfg.rope_theta = 10000.0;
  return cfg;
}

}  // namespace

// resident / stored was 4.33 before the decoder tables were cut (slot tables
// only where the scalar lanes need them, group tables of the reachable
// column starts only, no cached transposed basis), 2.42 before the cache
// held its parameters as their stored bytes and built the codec's tables
// per call (docs/kvtc.md, Memory held). The target is 1.25.
TEST(ResidentDump, LocalKvtcHoldsCloseToWhatItStores) {
  const std::string path = std::string(KVCODEC_SHARED_DIR) + "/models/tinycode/kv_dump.safetensors";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no KV dump at " << path << " (shared folder absent)";
  const dump::KvDump kv = dump::read_kv_dump(path);
  ASSERT_EQ(kv.n_layers(), 6);
  // The defaults (the rate allocator at its 1% target, int8 basis) and the
  // dp allocator at 4*D bits (the defaults before that preset). Each bound
  // is its measured ratio rounded up: the fixed per-cache bytes weigh more
  // beside the preset's smaller payload.
  struct Case {
    const char* name;
    Settings settings;
    double bound;
  };
  const Case cases[] = {{"defaults", {}, 1.025},  // measured 1.024 (1,334,119 / 1,302,967)
                        {"dp, bit_budget=256", {{"bit_budget", "256"}}, 1.02}};  // 1.019 (1,697,226 / 1,666,074)
  for (const Case& c : cases) {
    CacheStats fresh;
    for (int layer = 0; layer < kv.n_layers(); ++layer) {
      auto cache = make_cache("kvtc", layer_config(kv, layer), c.settings);
      cache->append(kv.keys[size_t(layer)], kv.values[size_t(layer)]);
      fresh += cache->stats();
    }
    dump::CompressOptions options;
    options.settings = c.settings;
    const std::vector<uint8_t> file = dump::compress_dump(kv, options);
    const CacheStats loaded = dump::open_compressed_dump(ContainerReader::parse(file.data(), file.size())).stats();
    ASSERT_EQ(loaded.compressed_bytes(), fresh.compressed_bytes()) << c.name;
    for (const CacheStats* st : {static_cast<const CacheStats*>(&fresh), &loaded}) {
      const double ratio = double(st->resident_bytes) / double(st->compressed_bytes());
      std::printf("[resident dump] kvtc local %s, %s: stored %llu, resident %llu, resident / stored %.3f\n", c.name,
                  st == &fresh ? "compressed" : "loaded", (unsigned long long)st->compressed_bytes(),
                  (unsigned long long)st->resident_bytes, ratio);
      EXPECT_EQ(st->shared_bytes(), 0u) << c.name;  // local mode shares nothing
      EXPECT_GE(ratio, 1.0) << c.name;              // never below the bytes stored
      EXPECT_LE(ratio, c.bound) << c.name;
    }
  }
}

// Calibrated kvtc with the shipped calibration and settings
// (models/tinycode/kvtc.settings: 4 sinks, 8 raw newest tokens, 128
// refined), each layer of the dump as a sequence does it: a 1024-token
// prefill, then 128 one-token appends. Per sequence it holds within 10% of
// what it stores (the calibration is shared, reported apart); before its
// raw tail and block list grew by eighths and it dropped its copy of the
// calibration's 1 / scale, 1.478.
TEST(ResidentDump, CalibratedKvtcHoldsCloseToWhatItStores) {
  const std::string path = std::string(KVCODEC_SHARED_DIR) + "/models/tinycode/kv_dump.safetensors";
  const std::string calibration = std::string(KVCODEC_SOURCE_DIR) + "/models/tinycode/kvtc.kvcal";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no KV dump at " << path << " (shared folder absent)";
  ASSERT_TRUE(std::filesystem::exists(calibration)) << calibration;
  const dump::KvDump kv = dump::read_kv_dump(path);
  CacheStats total;
  for (int layer = 0; layer < kv.n_layers(); ++layer) {
    auto cache = make_cache("kvtc", layer_config(kv, layer),
                            {{"calibration", calibration}, {"sinks", "4"}, {"window", "8"}, {"refine", "128"}});
    const TensorView k = kv.keys[size_t(layer)], v = kv.values[size_t(layer)];
    cache->append(k.slice_tokens(0, 1024), v.slice_tokens(0, 1024));
    for (int64_t t = 1024; t < 1152; ++t) cache->append(k.slice_tokens(t, 1), v.slice_tokens(t, 1));
    total += cache->stats();
  }
  const double ratio = double(total.resident_bytes) / double(total.compressed_bytes());
  std::printf("[resident dump] kvtc calibrated, shipped settings: stored %llu, resident %llu (%.3f), shared %llu\n",
              (unsigned long long)total.compressed_bytes(), (unsigned long long)total.resident_bytes, ratio,
              (unsigned long long)total.shared_bytes());
  EXPECT_GT(total.shared_bytes(), 0u);  // the calibration, apart
  EXPECT_GE(ratio, 1.0);
  EXPECT_LE(ratio, 1.10);  // measured 1.097 (472,731 / 431,111)
}

// The saved caches in tests/data/saved_caches are fuzzer seeds and golden
// files of each method's saved layout: every one loads, and saving the loaded
// cache gives back the same bytes. Files from before the meta key "layout"
// (<method>_<i>.kvc) are layout 1 without the key: they save back as the
// same bytes plus "layout" = "1". KVCODEC_REGENERATE_GOLDEN=1 writes the
// golden files of the current layouts that are missing; it never rewrites an
// existing one (old layouts must keep loading).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "format/reseal.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"

using namespace kvcodec;

namespace {

// scripts/fuzz.sh seeds fuzz_cache_load with every file of this folder.
const std::string kSeedDir = std::string(KVCODEC_SOURCE_DIR) + "/tests/data/saved_caches";

void regenerate() {
  std::mt19937 rng(42);
  std::normal_distribution<float> g(0.f, 1.f);
  Tensor k(DType::kBF16, {1, 2, 48, 32}), v(DType::kBF16, {1, 2, 48, 32});
  std::vector<float> kf(size_t(k.numel())), vf(kf.size());
  for (size_t i = 0; i < kf.size(); ++i) {
    kf[i] = g(rng) * std::sin(0.1f * float(i % 32));
    vf[i] = g(rng);
  }
  convert(kf.data(), DType::kF32, k.data(), DType::kBF16, kf.size());
  convert(vf.data(), DType::kF32, v.data(), DType::kBF16, vf.size());
  CacheConfig cfg;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 32;
  const std::vector<std::pair<std::string, Settings>> runs = {
      {"fp16", {}}, {"int8", {}}, {"int4", {}}, {"kivi2", {{"residual", "16"}}},
      {"palu", {{"min_fit_tokens", "16"}, {"group_size", "8"}}},
      {"kvtc", {{"min_fit_tokens", "16"}, {"block", "8"}}},
      {"kvtc", {{"min_fit_tokens", "16"}, {"block", "8"}, {"allocator", "rate"}, {"coder", "huffman"}, {"basis_bits", "8"}}}};
  std::filesystem::create_directories(kSeedDir);
  int i = 0;
  for (const auto& [method, settings] : runs) {
    const std::string path = kSeedDir + "/" + method + "_" + std::to_string(i++) + "_layout1.kvc";
    if (std::filesystem::exists(path)) continue;
    auto cache = make_cache(method, cfg, settings);
    cache->append(k.view(), v.view());
    const auto bytes = cache->save();
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  }
}

TEST(FuzzSeeds, EverySavedCacheLoadsAndSavesBackIdentically) {
  if (std::getenv("KVCODEC_REGENERATE_GOLDEN")) regenerate();
  int seen = 0, versioned = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kSeedDir)) {
    std::ifstream in(entry.path(), std::ios::binary);
    const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto cache = load_cache(bytes.data(), bytes.size());
    EXPECT_GT(cache->offset(), 0) << entry.path();
    const ContainerReader r = ContainerReader::parse(bytes.data(), bytes.size());
    if (r.meta().count("layout")) {
      EXPECT_EQ(cache->save(), bytes) << entry.path() << ": saved layout changed";
      ++versioned;
    } else {
      const auto as_layout1 = testing_reseal::edit_container(
          bytes, [](testing_reseal::Meta& meta, testing_reseal::Sections&) { meta["layout"] = "1"; });
      EXPECT_EQ(cache->save(), as_layout1) << entry.path() << ": an unversioned file is not layout 1";
    }
    ++seen;
  }
  EXPECT_GE(versioned, 7) << "layout-1 golden files missing (KVCODEC_REGENERATE_GOLDEN=1 writes them)";
  EXPECT_GE(seen, 14) << "seed files missing in " << kSeedDir << " (KVCODEC_REGENERATE_GOLDEN=1 writes them)";
}

}  // namespace

// What every method writes does not depend on the CPU: the saved caches and
// the fetched tensors of the real KV dump are the same bytes with the AVX2
// paths (chosen at run time, core/cpu_features.hpp) and with the plain ones
// (KVCODEC_SIMD=off, or a CPU without AVX2). The kernels have their own
// bit-for-bit tests (test_entropy, test_kvtc); this checks the caches that
// stream over them, local fits and the shipped calibration included.
// Skipped when the shared folder is absent.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/cpu_features.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/safetensors.hpp"

using namespace kvcodec;

namespace {

TEST(SimdBytes, CachesSaveAndFetchTheSameBytesWithAndWithoutAvx2) {
  if (!cpu_has_avx2_paths()) GTEST_SKIP() << "this CPU runs the plain paths only";
  const std::string path = std::string(KVCODEC_SHARED_DIR) + "/models/tinycode/kv_dump.safetensors";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no KV dump at " << path << " (shared folder absent)";
  const SafetensorsFile f = SafetensorsFile::open(path);
  const std::string calibration = std::string(KVCODEC_SOURCE_DIR) + "/models/tinycode/kvtc.kvcal";
  const std::vector<std::pair<std::string, Settings>> cases = {
      {"kvtc", {}},                         // local kvtc's default preset: rate allocator, int8 basis
      {"kvtc", {{"bit_budget", "256"}}},    // the dp allocator, f16 basis
      {"kvtc", {{"allocator", "rate"}, {"coder", "huffman"}, {"basis_bits", "8"}}},
      {"kvtc", {{"calibration", calibration}}},
      // The shipped model's kvtc settings (models/tinycode/kvtc.settings): refinement codes, weights, RoPE.
      {"kvtc", {{"calibration", calibration}, {"sinks", "4"}, {"window", "8"}, {"refine", "128"}}},
      {"palu", {}},
      {"int8", {}},
      {"kivi2", {}},
  };
  const int layer = 2;
  const TensorView k = f.view4("layers." + std::to_string(layer) + ".key");
  const TensorView v = f.view4("layers." + std::to_string(layer) + ".value");
  for (const auto& one : cases) {
    // Plain references: clang 14 cannot capture structured bindings in a lambda.
    const auto& method = one.first;
    const auto& settings = one.second;
    std::string label = method;
    for (const auto& [key, val] : settings) label += " " + key + "=" + val;
    const auto run = [&](bool on, bool vnni) {
      ScopedSimd mode(on);
      ScopedVnni vnni_mode(vnni);
      EXPECT_EQ(simd_avx2(), on);
      CacheConfig cfg;
      cfg.layer = layer;
      cfg.n_layers = 6;
      cfg.n_kv_heads = int(k.heads());
      cfg.head_dim = int(k.head_dim());
      auto cache = make_cache(method, cfg, settings);
      // A prefill, then decode-sized appends (kvtc codes tokens as they leave its window).
      const int64_t S = k.tokens(), pre = std::min<int64_t>(1024, S);
      cache->append(k.slice_tokens(0, pre), v.slice_tokens(0, pre));
      for (int64_t t = pre; t < S; t += 61) {
        const int64_t n = std::min<int64_t>(61, S - t);
        cache->append(k.slice_tokens(t, n), v.slice_tokens(t, n));
      }
      const KVPair out = cache->fetch(DType::kF32);
      const auto* kb = static_cast<const uint8_t*>(out.keys.data());
      const auto* vb = static_cast<const uint8_t*>(out.values.data());
      return std::vector<std::vector<uint8_t>>{cache->save(), std::vector<uint8_t>(kb, kb + out.keys.nbytes()),
                                               std::vector<uint8_t>(vb, vb + out.values.nbytes())};
    };
    const auto avx2 = run(true, false), plain = run(false, false);
    EXPECT_EQ(avx2[0], plain[0]) << label << ": saved bytes differ";
    EXPECT_EQ(avx2[1], plain[1]) << label << ": fetched keys differ";
    EXPECT_EQ(avx2[2], plain[2]) << label << ": fetched values differ";
    // And with AVX512-VNNI's products, which only kvtc's integer projection uses.
    if (cpu_has_vnni_paths() && method == "kvtc") {
      const auto vnni = run(true, true);
      EXPECT_EQ(vnni[0], plain[0]) << label << ": saved bytes differ with VNNI";
      EXPECT_EQ(vnni[1], plain[1]) << label << ": fetched keys differ with VNNI";
      EXPECT_EQ(vnni[2], plain[2]) << label << ": fetched values differ with VNNI";
    }
  }
}

}  // namespace

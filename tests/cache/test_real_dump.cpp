// Measured figures on the real KV dump (../shared/models/tinycode/kv_dump.safetensors,
// layers.{i}.key/value [1, 2, 2048, 64]): compression ratio and relative MSE of
// the caches in this folder, prefilled with 1024 tokens then fed the rest in
// chunks of 64. Skipped when the shared folder is absent.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "kvcodec/cache.hpp"
#include "kvcodec/safetensors.hpp"

using namespace kvcodec;

namespace {

double rel_mse(const TensorView& ref, const Tensor& got) {
  const Tensor r = Tensor::from_view(ref, DType::kF32), g = got.to(DType::kF32);
  double num = 0, den = 0;
  for (int64_t i = 0; i < r.numel(); ++i) {
    const double d = double(r.data_as<float>()[i]) - g.data_as<float>()[i];
    num += d * d;
    den += double(r.data_as<float>()[i]) * r.data_as<float>()[i];
  }
  return num / den;
}

TEST(RealDump, MethodsOnTinycodeLayers) {
  const std::string path = std::string(KVCODEC_SHARED_DIR) + "/models/tinycode/kv_dump.safetensors";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no KV dump at " << path << " (shared folder absent)";
  const SafetensorsFile f = SafetensorsFile::open(path);
  struct Case {
    std::string method;
    Settings settings;
    double max_rel_mse;
  };
  const std::vector<Case> cases = {
      {"fp16", {}, 1e-6},
      {"int8", {}, 1e-3},
      {"int4", {}, 0.03},
      {"kivi2", {}, 0.2},
      {"palu", {}, 0.3},
      {"palu", {{"group_mode", "joint"}, {"n_head_groups", "1"}}, 0.3},
      {"palu", {{"hadamard", "true"}}, 0.3},
      {"palu", {{"energy_threshold", "0.98"}, {"lo_bit", "3"}}, 0.2},
  };
  for (const Case& c : cases) {
    CacheStats total;
    double mk = 0, mv = 0;
    int layers = 0;
    for (int layer = 0; layer < 6 && f.contains("layers." + std::to_string(layer) + ".key"); layer += 2) {
      const TensorView k = f.view4("layers." + std::to_string(layer) + ".key");
      const TensorView v = f.view4("layers." + std::to_string(layer) + ".value");
      CacheConfig cfg;
      cfg.layer = layer;
      cfg.n_layers = 6;
      cfg.n_kv_heads = int(k.heads());
      cfg.head_dim = int(k.head_dim());
      auto cache = make_cache(c.method, cfg, c.settings);
      const int64_t S = k.tokens(), pre = std::min<int64_t>(1024, S);
      cache->append(k.slice_tokens(0, pre), v.slice_tokens(0, pre));
      for (int64_t t = pre; t < S; t += 64) {
        const int64_t n = std::min<int64_t>(64, S - t);
        cache->append(k.slice_tokens(t, n), v.slice_tokens(t, n));
      }
      const KVPair out = cache->fetch(k.dtype);
      mk += rel_mse(k, out.keys);
      mv += rel_mse(v, out.values);
      total += cache->stats();
      ++layers;
    }
    ASSERT_GT(layers, 0);
    mk /= layers;
    mv /= layers;
    std::string label = c.method;
    for (const auto& [key, val] : c.settings) label += " " + key + "=" + val;
    std::printf("[real dump] %-40s ratio %6.2f  rel_mse key %.4g value %.4g\n", label.c_str(),
                total.compression_ratio(), mk, mv);
    EXPECT_LT(mk, c.max_rel_mse) << label;
    EXPECT_LT(mv, c.max_rel_mse) << label;
    if (c.method != "fp16") {
      EXPECT_GT(total.compression_ratio(), 1.5) << label;
    }
  }
}

}  // namespace

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

// The squared error of got against ref and ref's energy.
struct ErrorSums {
  double err = 0, energy = 0;
};
ErrorSums error_sums(const TensorView& ref, const Tensor& got) {
  const Tensor r = Tensor::from_view(ref, DType::kF32), g = got.to(DType::kF32);
  ErrorSums s;
  for (int64_t i = 0; i < r.numel(); ++i) {
    const double d = double(r.data_as<float>()[i]) - g.data_as<float>()[i];
    s.err += d * d;
    s.energy += double(r.data_as<float>()[i]) * r.data_as<float>()[i];
  }
  return s;
}

double rel_mse(const TensorView& ref, const Tensor& got) {
  const ErrorSums s = error_sums(ref, got);
  return s.err / s.energy;
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

// Calibrated kvtc's 8-bit projection (kvtc.int8, the default) against the
// 16-bit one on the dump with the shipped calibration (no refinement, so
// the base codes alone): it takes most rows (the bytes differ) and adds at
// most its gate's share, 1/16 of each kept component's quantisation noise,
// to the error; the sizes stay within 1%.
TEST(RealDump, CalibratedInt8ProjectionAddsWithinItsGate) {
  const std::string path = std::string(KVCODEC_SHARED_DIR) + "/models/tinycode/kv_dump.safetensors";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no KV dump at " << path << " (shared folder absent)";
  const SafetensorsFile f = SafetensorsFile::open(path);
  const std::string calibration = std::string(KVCODEC_SOURCE_DIR) + "/models/tinycode/kvtc.kvcal";
  double err[2][2] = {}, energy[2] = {}, stored[2] = {};
  int layers_differ = 0;
  for (int layer = 0; layer < 6; ++layer) {
    const TensorView k = f.view4("layers." + std::to_string(layer) + ".key");
    const TensorView v = f.view4("layers." + std::to_string(layer) + ".value");
    CacheConfig cfg;
    cfg.layer = layer;
    cfg.n_layers = 6;
    cfg.n_kv_heads = int(k.heads());
    cfg.head_dim = int(k.head_dim());
    std::vector<uint8_t> saved[2];
    for (const int int8 : {0, 1}) {
      auto cache = make_cache("kvtc", cfg,
                              {{"calibration", calibration}, {"sinks", "4"}, {"window", "8"},
                               {"int8", int8 ? "true" : "false"}});
      cache->append(k, v);
      const KVPair out = cache->fetch(DType::kF32);
      for (const bool is_key : {true, false}) {
        const ErrorSums e = error_sums(is_key ? k : v, is_key ? out.keys : out.values);
        err[int8][is_key] += e.err;
        if (int8) energy[is_key] += e.energy;
      }
      stored[int8] += double(cache->stats().compressed_bytes());
      saved[int8] = cache->save();
    }
    layers_differ += saved[0] != saved[1];
  }
  EXPECT_EQ(layers_differ, 6);
  for (const bool is_key : {true, false}) {
    const double r16 = err[0][is_key] / energy[is_key], r8 = err[1][is_key] / energy[is_key];
    std::printf("[real dump] calibrated kvtc %s rel_mse: 16-bit projection %.5f, 8-bit %.5f (x%.4f)\n",
                is_key ? "keys" : "values", r16, r8, r8 / r16);
    EXPECT_LE(r8, r16 * (1.0 + 1.0 / 16.0)) << (is_key ? "keys" : "values");
  }
  std::printf("[real dump] calibrated kvtc bytes: 16-bit projection %.0f, 8-bit %.0f\n", stored[0], stored[1]);
  EXPECT_NEAR(stored[1], stored[0], 0.01 * stored[0]);
}

}  // namespace

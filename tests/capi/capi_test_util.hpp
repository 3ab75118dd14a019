// Helpers of the C API tests: synthetic KV, C handles as RAII, C calls that
// must succeed, and the calibration file the calibrated-kvtc cases use.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "kvcodec/kvcodec.h"

namespace capi_test {

// Checks a C call returned KVCODEC_OK, printing kvcodec_last_error() if not.
#define KVC_OK(call)                                                                   \
  do {                                                                                 \
    const kvcodec_status kvc_status_ = (call);                                         \
    ASSERT_EQ(kvc_status_, KVCODEC_OK) << #call << ": " << kvcodec_last_error();       \
  } while (0)

struct CacheDeleter {
  void operator()(kvcodec_cache* c) const { kvcodec_cache_free(c); }
};
using CachePtr = std::unique_ptr<kvcodec_cache, CacheDeleter>;
struct CalibrationDeleter {
  void operator()(kvcodec_calibration* c) const { kvcodec_calibration_free(c); }
};
using CalibrationPtr = std::unique_ptr<kvcodec_calibration, CalibrationDeleter>;

// Low-rank f32 KV [1, H, S, D] with a per-channel offset, so every method
// (PCA and SVD fits included) sees structure like a real cache's.
inline std::vector<float> synthetic_kv(int64_t heads, int64_t tokens, int64_t dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t rank = 8;
  std::vector<float> basis(size_t(heads * rank * dim)), out(size_t(heads * tokens * dim));
  for (float& b : basis) b = normal(rng);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t s = 0; s < tokens; ++s) {
      float coef[rank];
      for (int64_t r = 0; r < rank; ++r) coef[r] = normal(rng) / float(r + 1);
      for (int64_t d = 0; d < dim; ++d) {
        float x = 0.3f * std::sin(float(d)) + 0.01f * normal(rng);
        for (int64_t r = 0; r < rank; ++r) x += coef[r] * basis[size_t((h * rank + r) * dim + d)];
        out[size_t((h * tokens + s) * dim + d)] = x;
      }
    }
  return out;
}

inline kvcodec_tensor contiguous_tensor(const void* data, kvcodec_dtype dtype, int64_t b, int64_t h, int64_t s,
                                        int64_t d) {
  kvcodec_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.shape[0] = b, t.shape[1] = h, t.shape[2] = s, t.shape[3] = d;
  t.strides[0] = h * s * d, t.strides[1] = s * d, t.strides[2] = d, t.strides[3] = 1;
  return t;
}

inline kvcodec_cache_config layer_config(int layer, int n_layers = 6, int heads = 2, int dim = 64) {
  kvcodec_cache_config c{};
  c.layer = layer;
  c.n_layers = n_layers;
  c.n_kv_heads = heads;
  c.head_dim = dim;
  c.rope_theta = 10000.0;
  return c;
}

inline std::string shared_dir() { return KVCODEC_SHARED_DIR; }
inline std::string kv_dump_path() { return shared_dir() + "/models/tinycode/kv_dump.safetensors"; }

// A small calibration of the shipped model by `kvcodec calibrate` (one
// window of 128 tokens), made once per build folder (KVCODEC_TEST_CALIBRATION,
// remade when the CLI is newer); "" when the shared model is absent.
inline const std::string& calibration_path() {
  static const std::string path = [] {
    namespace fs = std::filesystem;
    const std::string tokens = shared_dir() + "/models/tinycode/eval_tokens.u16";
    if (!fs::exists(tokens)) return std::string();
    const std::string out = KVCODEC_TEST_CALIBRATION;
    std::error_code ec;
    if (fs::exists(out) && fs::last_write_time(out, ec) >= fs::last_write_time(KVCODEC_CLI, ec)) return out;
    // Written aside and renamed: tests running in parallel never read half a file.
    const std::string tmp = out + ".tmp" + std::to_string(::getpid());
    const std::string cmd = std::string(KVCODEC_CLI) + " calibrate --tokens " + tokens +
                            " --windows 3-3 --tokens-per-window 128 --threads 1 --set kvtc.target_ratio=8"
                            " --set kvtc.sensitivity=none -o " + tmp + " > /dev/null 2>&1";
    if (std::system(cmd.c_str()) != 0) return std::string();
    fs::rename(tmp, out, ec);
    return ec ? std::string() : out;
  }();
  return path;
}

// The cache's saved bytes through the size query and save.
inline std::vector<uint8_t> saved_bytes(kvcodec_cache* cache) {
  size_t n = 0;
  EXPECT_EQ(kvcodec_cache_save_size(cache, &n), KVCODEC_OK) << kvcodec_last_error();
  std::vector<uint8_t> out(n);
  size_t written = 0;
  EXPECT_EQ(kvcodec_cache_save(cache, out.data(), out.size(), &written), KVCODEC_OK) << kvcodec_last_error();
  EXPECT_EQ(written, n);
  return out;
}

}  // namespace capi_test

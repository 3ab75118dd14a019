// Fixtures of the calibrated-cache tests: small calibrations fitted here
// from synthetic low-rank KV (2 layers, 2 KV heads, head_dim 16), sequences
// [B, H, S, D] of it with keys post-RoPE, and the settings that use them.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <filesystem>
#include <random>
#include <string>
#include <vector>
#include <unistd.h>

#include "cache/kvtc_calibrated.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"
#include "linalg/pca.hpp"

namespace kvcodec::calibrated_fixture {

inline constexpr int kLayers = 2, kHeads = 2, kDim = 16;
inline constexpr double kTheta = 10000.0;

// Pre-RoPE token vectors [n, H*D] from a fixed rank-6 model plus small noise:
// the structure a calibrated basis should capture.
inline std::vector<float> synthetic_vectors(int64_t n, uint32_t seed, int layer, bool is_key) {
  const int V = kHeads * kDim;
  std::mt19937 basis_rng(1234 + layer * 2 + (is_key ? 1 : 0));  // same basis for every seed
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> A(static_cast<size_t>(6 * V)), mean(static_cast<size_t>(V));
  for (auto& a : A) a = g(basis_rng);
  for (auto& m : mean) m = 0.5f * g(basis_rng);
  std::mt19937 rng(seed);
  std::vector<float> x(size_t(n * V));
  for (int64_t t = 0; t < n; ++t) {
    float z[6];
    for (int r = 0; r < 6; ++r) z[r] = g(rng) / float(1 + r);
    for (int v = 0; v < V; ++v) {
      float s = mean[size_t(v)] + 0.01f * g(rng);
      for (int r = 0; r < 6; ++r) s += z[r] * A[size_t(r * V + v)];
      x[size_t(t * V + v)] = s;
    }
  }
  return x;
}

// An empty calibration of the test shape (layers, heads, dim, theta).
inline KvtcCalibration test_shape_calibration() {
  KvtcCalibration cal;
  cal.n_layers = kLayers;
  cal.n_kv_heads = kHeads;
  cal.head_dim = kDim;
  cal.rope_theta = kTheta;
  cal.config_hash = "test";
  return cal;
}

// Removes path when the test process ends: the fixtures' calibrations are
// written once per process, and were left in the temp directory (hundreds
// of files after a few runs of the suite).
inline void remove_at_exit(const std::string& path) {
  struct Files {
    std::vector<std::string> paths;
    ~Files() {
      for (const std::string& p : paths) std::remove(p.c_str());
    }
  };
  static Files files;
  files.paths.push_back(path);
}

// Writes cal to a per-process temporary file named after `tag`, removed
// when the process ends.
inline std::string write_temp_calibration(const KvtcCalibration& cal, const std::string& tag) {
  const std::string p = (std::filesystem::temp_directory_path() /
                         ("kvcodec_test_calib_" + tag + std::to_string(::getpid()) + ".kvcal")).string();
  cal.write_file(p);
  remove_at_exit(p);
  return p;
}

inline std::string calibration_path() {
  static const std::string path = [] {
    KvtcCalibration cal = test_shape_calibration();
    const int V = kHeads * kDim;
    kvtc::CodecOptions o;
    o.bit_budget = 3 * V;
    for (int l = 0; l < kLayers; ++l)
      for (bool is_key : {true, false}) {
        const auto x = synthetic_vectors(2048, 77 + l, l, is_key);
        const auto pca = linalg::fit_pca(x.data(), 2048, V);
        (is_key ? cal.keys : cal.values)
            .push_back(kvtc::fit_head(x.data(), 2048, V, pca.mean, pca.components, pca.eigenvalues, o));
      }
    return write_temp_calibration(cal, "");
  }();
  return path;
}

// The same calibration fitted on weighted vectors x * w (keys' weights
// constant over each RoPE pair, as calibration makes them), with the weights
// stored: the calibrated cache must apply and undo them.
inline std::string weighted_calibration_path() {
  static const std::string path = [] {
    KvtcCalibration cal = test_shape_calibration();
    const int V = kHeads * kDim;
    kvtc::CodecOptions o;
    o.bit_budget = 3 * V;
    std::mt19937 rng(99);
    std::uniform_real_distribution<float> u(0.5f, 2.0f);
    for (int l = 0; l < kLayers; ++l)
      for (bool is_key : {true, false}) {
        std::vector<float> w(static_cast<size_t>(V));
        for (int h = 0; h < kHeads; ++h)
          for (int i = 0; i < kDim / 2; ++i) {
            w[size_t(h * kDim + i)] = u(rng);
            w[size_t(h * kDim + i + kDim / 2)] = is_key ? w[size_t(h * kDim + i)] : u(rng);
          }
        auto x = synthetic_vectors(2048, 77 + l, l, is_key);
        for (size_t i = 0; i < x.size(); ++i) x[i] *= w[i % size_t(V)];
        const auto pca = linalg::fit_pca(x.data(), 2048, V);
        (is_key ? cal.keys : cal.values)
            .push_back(kvtc::fit_head(x.data(), 2048, V, pca.mean, pca.components, pca.eigenvalues, o));
        (is_key ? cal.key_scale : cal.value_scale).push_back(w);
      }
    return write_temp_calibration(cal, "w_");
  }();
  return path;
}

// A coarse base code (1 bit per dimension on average) plus refinement
// parameters fitted on its residuals: the refined tokens must come out
// sharper than the base alone.
inline std::string refined_calibration_path() {
  static const std::string path = [] {
    KvtcCalibration cal = test_shape_calibration();
    const int V = kHeads * kDim;
    kvtc::CodecOptions base_options, refine_options;
    base_options.bit_budget = V;
    refine_options.bit_budget = 3 * V;
    for (int l = 0; l < kLayers; ++l)
      for (bool is_key : {true, false}) {
        const auto x = synthetic_vectors(2048, 77 + l, l, is_key);
        const auto pca = linalg::fit_pca(x.data(), 2048, V);
        const kvtc::HeadParams base =
            kvtc::fit_head(x.data(), 2048, V, pca.mean, pca.components, pca.eigenvalues, base_options);
        std::vector<uint16_t> codes(size_t(2048) * size_t(base.n_kept()));
        std::vector<float> residual(x.size());
        kvtc::quantize_block(base, x.data(), 2048, codes.data());
        kvtc::dequantize_block(base, codes.data(), 2048, residual.data());
        for (size_t i = 0; i < x.size(); ++i) residual[i] = x[i] - residual[i];
        const auto rpca = linalg::fit_pca(residual.data(), 2048, V);
        (is_key ? cal.keys : cal.values).push_back(base);
        (is_key ? cal.key_refine : cal.value_refine)
            .push_back(kvtc::fit_head(residual.data(), 2048, V, rpca.mean, rpca.components, rpca.eigenvalues,
                                      refine_options));
      }
    return write_temp_calibration(cal, "r_");
  }();
  return path;
}

// bytes of a container rewritten with section `name` replaced, or dropped
// when replacement is null (checksums recomputed).
inline std::vector<uint8_t> rewritten(const std::vector<uint8_t>& bytes, const std::string& name,
                               const std::vector<uint8_t>* replacement, ContainerKind kind) {
  const ContainerReader r = ContainerReader::parse(bytes.data(), bytes.size());
  ContainerWriter w(kind);
  for (const auto& [k, v] : r.meta()) w.set_meta(k, v);
  for (const auto& n : r.section_names()) {
    if (n == name && !replacement) continue;
    const auto sec = r.section(n);
    w.add_section(n, n == name ? *replacement : std::vector<uint8_t>(sec.begin(), sec.end()));
  }
  return w.finish();
}
inline std::vector<uint8_t> with_section(const std::vector<uint8_t>& bytes, const std::string& name,
                                  const std::vector<uint8_t>& replacement, ContainerKind kind) {
  return rewritten(bytes, name, &replacement, kind);
}
inline std::vector<uint8_t> without_section(const std::vector<uint8_t>& bytes, const std::string& name, ContainerKind kind) {
  return rewritten(bytes, name, nullptr, kind);
}

inline CacheConfig layer_config(int layer) {
  CacheConfig c;
  c.layer = layer;
  c.n_layers = kLayers;
  c.n_kv_heads = kHeads;
  c.head_dim = kDim;
  c.rope_theta = kTheta;
  return c;
}

// A sequence [B, H, S, D] f32: keys post-RoPE at positions 0..S-1.
struct Sequence {
  Tensor keys, values;
};
inline Sequence make_sequence(int64_t B, int64_t S, int layer, uint32_t seed) {
  Sequence s{Tensor(DType::kF32, {B, kHeads, S, kDim}), Tensor(DType::kF32, {B, kHeads, S, kDim})};
  const int V = kHeads * kDim;
  for (int64_t b = 0; b < B; ++b) {
    auto k = synthetic_vectors(S, seed + uint32_t(b), layer, true);
    auto v = synthetic_vectors(S, seed + 100 + uint32_t(b), layer, false);
    for (int64_t t = 0; t < S; ++t) rope_rotate_token(&k[size_t(t * V)], kHeads, kDim, t, kTheta, false);
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t t = 0; t < S; ++t)
        for (int64_t d = 0; d < kDim; ++d) {
          s.keys.data_as<float>()[((b * kHeads + h) * S + t) * kDim + d] = k[size_t(t * V + h * kDim + d)];
          s.values.data_as<float>()[((b * kHeads + h) * S + t) * kDim + d] = v[size_t(t * V + h * kDim + d)];
        }
  }
  return s;
}

// Tokens [first, first + n) of a [B, H, S, D] tensor as a strided view.
inline TensorView slice(const Tensor& t, int64_t first, int64_t n) {
  TensorView v = t.view();
  v.data = static_cast<const uint8_t*>(v.data) + first * v.strides[2] * int64_t(dtype_size(v.dtype));
  v.shape[2] = n;
  return v;
}

inline double rel_mse(const Tensor& a, const Tensor& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < numel(a.shape()); ++i) {
    const double d = double(a.data_as<float>()[i]) - double(b.data_as<float>()[i]);
    num += d * d;
    den += double(a.data_as<float>()[i]) * double(a.data_as<float>()[i]);
  }
  return num / den;
}

inline bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), size_t(numel(a.shape())) * dtype_size(a.dtype())) == 0;
}

// A cache fed token by token (`steps`) reads back bit for bit as one fed at
// once (`whole`) and counts the same bytes; whole's save loads into a cache
// that does too. What the callers go on testing with.
struct SameReads {
  KVPair whole_read;
  std::vector<uint8_t> saved;
  std::unique_ptr<KVCache> loaded;
};
inline SameReads expect_steps_and_reload_read_as_whole(const KVCache& whole, const KVCache& steps) {
  SameReads r{whole.fetch(DType::kF32), whole.save(), nullptr};
  const KVPair b = steps.fetch(DType::kF32);
  EXPECT_TRUE(bit_equal(r.whole_read.keys, b.keys));
  EXPECT_TRUE(bit_equal(r.whole_read.values, b.values));
  EXPECT_EQ(whole.stats().compressed_bytes(), steps.stats().compressed_bytes());
  r.loaded = load_cache(r.saved.data(), r.saved.size());
  const KVPair c = r.loaded->fetch(DType::kF32);
  EXPECT_TRUE(bit_equal(r.whole_read.keys, c.keys));
  EXPECT_TRUE(bit_equal(r.whole_read.values, c.values));
  EXPECT_EQ(r.loaded->stats().compressed_bytes(), whole.stats().compressed_bytes());
  return r;
}

inline Settings calibrated(int sinks, int window, int block = 16) {
  return {{"calibration", calibration_path()},
          {"sinks", std::to_string(sinks)},
          {"window", std::to_string(window)},
          {"block", std::to_string(block)}};
}

inline Settings refined(int refine, int window = 8, int block = 16) {
  return {{"calibration", refined_calibration_path()},
          {"sinks", "4"},
          {"window", std::to_string(window)},
          {"block", std::to_string(block)},
          {"refine", std::to_string(refine)}};
}

// The whole-block mode of settings s (each token coded once).
inline Settings whole(Settings s) {
  s["whole_blocks"] = "true";
  return s;
}

}  // namespace kvcodec::calibrated_fixture

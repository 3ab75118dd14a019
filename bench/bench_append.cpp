// Append cost must stay flat (DESIGN 3: O(1) amortised work per token, never
// re-coding stored tokens). For each method: prefill 256 tokens (past every
// default fit point), then append N tokens one at a time ([1, 2, 1, 64] bf16)
// and compare the per-token time of the first 1K appends after the fit with
// the last 1K. A ratio near 1 means flat; growth with history would show up
// as a ratio well above 1.
//
// "kvtc-calibrated" (not in the default list) runs calibrated kvtc with a
// calibration fitted here on the prefill tokens (one layer, keys as given),
// and also prints the symbols entropy-coded per appended token
// (CacheStats::coded_symbols) over the last 1K appends; held/stored is
// resident_bytes / compressed bytes at the end (shared bytes apart).
//
// Usage: bench_append [tokens=16384] [methods=fp16,int8,int4,kivi2,palu,kvtc]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cache/kvtc_calibrated.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"
#include "linalg/pca.hpp"

using namespace kvcodec;

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 16384;
  std::vector<std::string> methods;
  {
    std::stringstream ss(argc > 2 ? argv[2] : "");
    for (std::string m; std::getline(ss, m, ',');) methods.push_back(m);
    if (methods.empty())
      for (const auto& m : list_methods()) methods.push_back(m.name);
  }
  const int64_t H = 2, D = 64, prefill = 256, window = 1024;
  if (n < 2 * window) {
    std::fprintf(stderr, "need at least %lld tokens\n", (long long)(2 * window));
    return 2;
  }
  // Correlated synthetic data (rank 8 + noise), fixed seed.
  const int64_t total = prefill + n;
  std::mt19937 rng(42);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> w(size_t(H * D * 8));
  for (auto& v : w) v = g(rng);
  std::vector<float> x(size_t(H * total * D));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t s = 0; s < total; ++s) {
      float z[8];
      for (float& v : z) v = g(rng);
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.05f * g(rng);
        for (int k = 0; k < 8; ++k) acc += w[size_t((h * D + d) * 8 + k)] * z[k];
        x[size_t((h * total + s) * D + d)] = acc;
      }
    }
  Tensor kv = Tensor::from_view(TensorView::contiguous(x.data(), DType::kF32, {1, H, total, D}), DType::kBF16);

  CacheConfig cfg;
  cfg.n_kv_heads = int(H);
  cfg.head_dim = int(D);
  // The calibration of "kvtc-calibrated": keys and values share the same
  // synthetic data, one HeadParams over the H*D vector of each token.
  const auto calibration_file = [&] {
    KvtcCalibration cal;
    cal.n_layers = 1;
    cal.n_kv_heads = int(H);
    cal.head_dim = int(D);
    cal.rope_theta = cfg.rope_theta;
    const int V = int(H * D);
    std::vector<float> tok(size_t(prefill) * size_t(V));
    for (int64_t s = 0; s < prefill; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) tok[size_t((s * H + h) * D + d)] = x[size_t((h * total + s) * D + d)];
    const linalg::PcaBasis pca = linalg::fit_pca(tok.data(), prefill, V);
    const kvtc::HeadParams p =
        kvtc::fit_head(tok.data(), prefill, V, pca.mean, pca.components, pca.eigenvalues, kvtc::CodecOptions{});
    cal.keys = {p};
    cal.values = {p};
    const std::string path = "/tmp/bench_append_calibration.kvcal";
    cal.write_file(path);
    return path;
  };
  std::printf("%-16s %14s %14s %8s %10s %14s %12s\n", "method", "first1K_us/tok", "last1K_us/tok", "ratio",
              "comp_ratio", "symbols/tok", "held/stored");
  for (const std::string& m : methods) {
    try {
      auto cache = m == "kvtc-calibrated" ? make_cache("kvtc", cfg, {{"calibration", calibration_file()}})
                                          : make_cache(m, cfg);
      cache->append(kv.view().slice_tokens(0, prefill), kv.view().slice_tokens(0, prefill));
      double first = 0, last = 0;
      uint64_t symbols_before_last = 0;
      for (int64_t t = 0; t < n; ++t) {
        if (t == n - window) symbols_before_last = cache->stats().coded_symbols;
        const auto t0 = std::chrono::steady_clock::now();
        const TensorView tok = kv.view().slice_tokens(prefill + t, 1);
        cache->append(tok, tok);
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        if (t < window) first += us;
        if (t >= n - window) last += us;
      }
      const CacheStats st = cache->stats();
      std::printf("%-16s %14.3f %14.3f %8.2f %10.2f %14.2f %12.3f\n", m.c_str(), first / window, last / window,
                  last / first, st.compression_ratio(), double(st.coded_symbols - symbols_before_last) / double(window),
                  double(st.resident_bytes) / double(st.compressed_bytes()));
    } catch (const Error& e) {
      std::printf("%-8s error: %s\n", m.c_str(), e.what());
    }
  }
  return 0;
}

// Append cost must stay flat (DESIGN 3: O(1) amortised work per token, never
// re-coding stored tokens). For each method: prefill 256 tokens (past every
// default fit point), then append N tokens one at a time ([1, 2, 1, 64] bf16)
// and compare the per-token time of the first 1K appends after the fit with
// the last 1K. A ratio near 1 means flat; growth with history would show up
// as a ratio well above 1.
//
// Usage: bench_append [tokens=16384] [methods=fp16,int8,int4,kivi2,palu,kvtc]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"

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
  std::printf("%-8s %14s %14s %8s %10s\n", "method", "first1K_us/tok", "last1K_us/tok", "ratio", "comp_ratio");
  for (const std::string& m : methods) {
    try {
      auto cache = make_cache(m, cfg);
      cache->append(kv.view().slice_tokens(0, prefill), kv.view().slice_tokens(0, prefill));
      double first = 0, last = 0;
      for (int64_t t = 0; t < n; ++t) {
        const auto t0 = std::chrono::steady_clock::now();
        const TensorView tok = kv.view().slice_tokens(prefill + t, 1);
        cache->append(tok, tok);
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        if (t < window) first += us;
        if (t >= n - window) last += us;
      }
      std::printf("%-8s %14.3f %14.3f %8.2f %10.2f\n", m.c_str(), first / window, last / window, last / first,
                  cache->stats().compression_ratio());
    } catch (const Error& e) {
      std::printf("%-8s error: %s\n", m.c_str(), e.what());
    }
  }
  return 0;
}

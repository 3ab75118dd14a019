// The stored-prefix protocol of evaluate() (model/eval_prefix.hpp) against a
// direct computation on a small random model.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kvcodec/error.hpp"
#include "model/eval.hpp"
#include "model_fixtures.hpp"
#include "raw_cache.hpp"

namespace kvcodec::model {
namespace {

using testing::RawF32Cache;
using testing::raw_factory;

using testing::random_tokens;

// A known perturbation of a layer's keys [1, H, S, D] (element index i).
float perturbed(float x, int64_t i) { return x + 0.3f * float((i * 7919) % 11 - 5) / 5.0f; }

// A store that perturbs every key and claims 100 bytes per layer.
StoredPrefix noisy_store(const ModelConfig& c, const std::vector<KVPair>& prefix) {
  StoredPrefix out;
  for (const KVPair& kv : prefix) {
    KVPair r{kv.keys.to(DType::kF32), kv.values.to(DType::kF32)};
    float* k = r.keys.data_as<float>();
    for (int64_t i = 0; i < r.keys.numel(); ++i) k[i] = perturbed(k[i], i);
    out.restored.push_back(std::move(r));
    out.stats.compressed_key_bytes += 60;
    out.stats.compressed_value_bytes += 40;
    out.stats.fp16_key_bytes += uint64_t(kv.keys.numel()) * 2;
    out.stats.fp16_value_bytes += uint64_t(kv.values.numel()) * 2;
  }
  EXPECT_EQ(int(prefix.size()), c.n_layers);
  return out;
}

// NLL of targets window[stored + 1 .. stored + score] computed directly: an
// exact prefill of `stored` tokens into raw caches, their keys perturbed (when
// `noisy`), fresh raw caches holding that, then one decode step per token.
double direct_prefix_nll(const LlamaModel& m, const int32_t* window, int64_t stored, int64_t score, bool noisy) {
  std::vector<float> logits;
  auto prefix = std::make_shared<std::vector<KVPair>>();
  {
    Session exact(m, raw_factory(8));
    exact.forward(window, stored, logits, false);
    for (const auto& cache : exact.caches()) {
      KVPair kv = cache->fetch(DType::kF32);
      float* k = kv.keys.data_as<float>();
      if (noisy)
        for (int64_t i = 0; i < kv.keys.numel(); ++i) k[i] = perturbed(k[i], i);
      prefix->push_back(std::move(kv));
    }
  }
  Session on_top(m, [prefix](const CacheConfig& cc) {
    auto cache = std::make_unique<RawF32Cache>(cc, 8);
    cache->append((*prefix)[size_t(cc.layer)].keys.view(), (*prefix)[size_t(cc.layer)].values.view());
    return cache;
  });
  EXPECT_EQ(on_top.position(), stored);
  double nll = 0.0;
  std::vector<double> lp;
  for (int64_t i = 0; i < score; ++i) {
    on_top.forward(window + stored + i, 1, logits, false);
    log_softmax(logits.data(), m.config().vocab_size, lp);
    nll -= lp[size_t(window[stored + i + 1])];
  }
  return nll;
}

TEST(EvalStoredPrefix, MatchesDirectComputationAndCountsStoredBytes) {
  const LlamaModel m = testing::tiny_model(testing::tiny_config());
  const ModelConfig& c = m.config();
  const auto tokens = random_tokens(3 * 40, c.vocab_size, 5);
  EvalOptions o = testing::two_windows_of_40();
  o.stored_prefix = true;
  const MethodSpec base{"raw", raw_factory(8)};
  MethodSpec noisy{"noisy", raw_factory(8)};
  noisy.prefix_coder = noisy_store;
  int64_t last = 0, total = 0;
  const auto r = evaluate(m, tokens, {base, noisy}, base, o, [&](int64_t d, int64_t t) {
    last = d;
    total = t;
  });
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(last, total);
  EXPECT_EQ(total, 2 * 2 * 10);
  // Targets are the streaming protocol's: tokens context .. context + score - 1,
  // predicted by positions context - 1 .. (the stored prefix holds context - 1 tokens).
  double base_nll = 0, noisy_nll = 0;
  for (int w = 1; w <= 2; ++w) {
    base_nll += direct_prefix_nll(m, tokens.data() + w * 40, 24, 10, false);
    noisy_nll += direct_prefix_nll(m, tokens.data() + w * 40, 24, 10, true);
  }
  EXPECT_EQ(r[0].scored, 20);
  EXPECT_NEAR(r[0].nll, base_nll / 20, 1e-5);
  EXPECT_NEAR(r[1].nll, noisy_nll / 20, 1e-5);
  EXPECT_GT(std::abs(r[1].nll - r[0].nll), 1e-4);  // the perturbation is seen
  EXPECT_GT(r[1].kl, 0.0);
  // The baseline stores each layer through one raw cache: f32 = twice f16;
  // 24 tokens per window.
  const uint64_t f16 = uint64_t(2) * 24 * c.n_layers * c.n_kv_heads * c.head_dim * 2 * 2;  // windows, K+V, bytes
  EXPECT_EQ(r[0].stats.fp16_bytes(), f16);
  EXPECT_EQ(r[0].stats.compressed_bytes(), 2 * f16);
  EXPECT_DOUBLE_EQ(r[0].compression_ratio, 0.5);
  // The noisy store: 100 bytes per layer and window, all of them counted.
  EXPECT_EQ(r[1].stats.compressed_bytes(), uint64_t(2 * 100 * c.n_layers));
  EXPECT_DOUBLE_EQ(r[1].compression_ratio, double(f16) / double(2 * 100 * c.n_layers));
}

TEST(EvalStoredPrefix, PerLayerStoreAppendsTheWholePrefixOnce) {
  // A cache counting its appends: the per-layer store gives it the prefix in one call.
  struct Counting : RawF32Cache {
    using RawF32Cache::RawF32Cache;
    std::shared_ptr<std::vector<int64_t>> appends;
    void append(const TensorView& k, const TensorView& v) override {
      appends->push_back(k.tokens());
      RawF32Cache::append(k, v);
    }
  };
  const LlamaModel m = testing::tiny_model(testing::tiny_config());
  auto appends = std::make_shared<std::vector<int64_t>>();
  const PrefixCoder coder = per_layer_prefix_coder([appends](const CacheConfig& cc) {
    auto cache = std::make_unique<Counting>(cc, 8);
    cache->appends = appends;
    return cache;
  });
  std::vector<KVPair> prefix;
  for (int l = 0; l < m.config().n_layers; ++l)
    prefix.push_back({Tensor(DType::kF32, {1, m.config().n_kv_heads, 13, m.config().head_dim}),
                      Tensor(DType::kF32, {1, m.config().n_kv_heads, 13, m.config().head_dim})});
  const StoredPrefix sp = coder(m.config(), prefix);
  EXPECT_EQ(*appends, std::vector<int64_t>(size_t(m.config().n_layers), 13));
  EXPECT_EQ(sp.stats.tokens, 13 * m.config().n_layers);
  ASSERT_EQ(sp.restored.size(), size_t(m.config().n_layers));
  EXPECT_EQ(sp.restored[0].keys.shape(), prefix[0].keys.shape());
  prefix.pop_back();
  EXPECT_THROW(coder(m.config(), prefix), Error);
}

TEST(EvalStoredPrefix, RefusesWholeWindowAndAContextWithNothingStored) {
  const LlamaModel m = testing::tiny_model(testing::tiny_config());
  const auto tokens = random_tokens(40, m.config().vocab_size, 6);
  const MethodSpec base{"raw", raw_factory(8)};
  EvalOptions o;
  o.window_length = 40;
  o.windows = 1;
  o.stored_prefix = true;
  o.whole_window = true;
  EXPECT_THROW(evaluate(m, tokens, {base}, base, o), Error);
  o.whole_window = false;
  o.context = 1;
  o.score = 5;
  try {
    evaluate(m, tokens, {base}, base, o);
    ADD_FAILURE() << "context 1 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kConfig);
    EXPECT_NE(std::string(e.what()).find("context"), std::string::npos);
  }
}

}  // namespace
}  // namespace kvcodec::model

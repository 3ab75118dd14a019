// Evaluation protocol, sampling and generation on a small random model.
#include <gtest/gtest.h>

#include <cmath>

#include "kvcodec/error.hpp"
#include "model/eval.hpp"
#include "model/generate.hpp"
#include "model_fixtures.hpp"
#include "raw_cache.hpp"

namespace kvcodec::model {
namespace {

using testing::RawF32Cache;
using testing::raw_factory;

// A lossy cache: the raw cache with a fixed perturbation of every key, so
// its attention differs from the baseline's.
class NoisyCache : public RawF32Cache {
 public:
  using RawF32Cache::RawF32Cache;
  std::string method() const override { return "noisy"; }
  void append(const TensorView& keys, const TensorView& values) override {
    Tensor k = Tensor::from_view(keys, DType::kF32);
    float* p = k.data_as<float>();
    for (int64_t i = 0; i < k.numel(); ++i) p[i] += 0.5f * float((i * 7919) % 13 - 6) / 6.0f;
    RawF32Cache::append(k.view(), values);
  }
};

using testing::random_tokens;

// NLL of predictions [from, to) of one window computed directly from one
// all-logits prefill.
double direct_nll(const LlamaModel& m, const int32_t* window, int64_t length, int64_t from, int64_t to) {
  Session s(m, raw_factory(16));
  std::vector<float> logits;
  s.forward(window, length, logits, true);
  const int V = m.config().vocab_size;
  double nll = 0.0;
  for (int64_t i = from; i < to; ++i) {
    const float* row = logits.data() + i * V;
    double mx = row[0], sum = 0.0;
    for (int v = 1; v < V; ++v) mx = std::max(mx, double(row[v]));
    for (int v = 0; v < V; ++v) sum += std::exp(row[v] - mx);
    nll -= row[window[i + 1]] - mx - std::log(sum);
  }
  return nll;
}

TEST(Eval, ProtocolMatchesDirectComputation) {
  const LlamaModel m = testing::tiny_model(testing::tiny_config());
  const auto tokens = random_tokens(3 * 40, m.config().vocab_size, 3);
  EvalOptions o = testing::two_windows_of_40();
  const MethodSpec base{"raw", raw_factory(8)};
  const MethodSpec noisy{"noisy", [](const CacheConfig& c) { return std::make_unique<NoisyCache>(c, 8); }};
  int64_t last_done = 0, last_total = 0;
  const auto results = evaluate(m, tokens, {base, noisy}, base, o, [&](int64_t d, int64_t t) {
    EXPECT_EQ(d, last_done + 1);
    last_done = d;
    last_total = t;
  });
  EXPECT_EQ(last_done, last_total);
  EXPECT_EQ(last_total, 2 * 10 * 2);
  ASSERT_EQ(results.size(), 2u);
  // Logits at position context-1 predict token context: predictions 24..33.
  double expect = 0.0;
  for (int w = 1; w <= 2; ++w) expect += direct_nll(m, tokens.data() + w * 40, 40, 24, 34);
  EXPECT_EQ(results[0].scored, 20);
  EXPECT_NEAR(results[0].nll, expect / 20, 1e-4);
  EXPECT_NEAR(results[0].ppl, std::exp(results[0].nll), 1e-9);
  EXPECT_EQ(results[0].kl, 0.0);
  EXPECT_EQ(results[0].top1, 1.0);
  // Byte accounting at the end: context + score - 1 tokens held per window.
  EXPECT_EQ(results[0].stats.tokens, 2 * 34 * m.config().n_layers);
  EXPECT_DOUBLE_EQ(results[0].compression_ratio, 0.5);  // f32 raw holds twice the f16 bytes
  EXPECT_GT(results[0].tokens_per_s, 0.0);
  // The perturbed keys change the distributions.
  EXPECT_GT(results[1].kl, 1e-4);
  EXPECT_LE(results[1].top1, 1.0);
  EXPECT_NE(results[1].nll, results[0].nll);
  // Spread: the standard error over the two windows of ppl_w(noisy) / ppl_w(raw) - 1.
  EXPECT_EQ(results[0].ppl_change_se, 0.0);
  double change[2];
  for (int w = 0; w < 2; ++w) {
    const int32_t* win = tokens.data() + (w + 1) * 40;
    const double raw_nll = direct_nll(m, win, 40, 24, 34) / 10;
    // The noisy method's per-window NLL from a one-window evaluation of that window.
    EvalOptions one = o;
    one.first_window = w + 1;
    one.windows = 1;
    const auto r1 = evaluate(m, tokens, {base, noisy}, base, one);
    EXPECT_EQ(r1[1].ppl_change_se, 0.0);  // one window: no spread
    change[w] = std::exp(r1[1].nll - raw_nll) - 1;
  }
  const double mean = (change[0] + change[1]) / 2;
  const double se = std::sqrt((std::pow(change[0] - mean, 2) + std::pow(change[1] - mean, 2)) / 1.0 / 2.0);
  EXPECT_GT(se, 0.0);
  EXPECT_NEAR(results[1].ppl_change_se, se, 1e-6);
}

TEST(Eval, WholeWindowMatchesDirectComputation) {
  const LlamaModel m = testing::tiny_model(testing::tiny_config());
  const auto tokens = random_tokens(2 * 40, m.config().vocab_size, 4);
  EvalOptions o;
  o.window_length = 40;
  o.windows = 2;
  o.whole_window = true;
  const MethodSpec base{"raw", raw_factory(8)};
  const auto r = evaluate(m, tokens, {base}, base, o);
  const double expect = direct_nll(m, tokens.data(), 40, 0, 39) + direct_nll(m, tokens.data() + 40, 40, 0, 39);
  EXPECT_EQ(r[0].scored, 78);
  EXPECT_NEAR(r[0].nll, expect / 78, 1e-4);
}

TEST(Eval, RejectsOptionsThatDoNotFit) {
  const LlamaModel m = testing::tiny_model(testing::tiny_config());
  const auto tokens = random_tokens(2 * 40, m.config().vocab_size, 4);
  const MethodSpec base{"raw", raw_factory(8)};
  auto field_of_error = [&](EvalOptions o) -> std::string {
    try {
      evaluate(m, tokens, {base}, base, o);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kConfig);
      return e.what();
    }
    return "no error";
  };
  EvalOptions o;
  o.window_length = 40;
  o.context = 30;
  o.score = 11;
  o.windows = 1;
  EXPECT_NE(field_of_error(o).find("score"), std::string::npos);
  o.score = 10;
  o.windows = 3;
  EXPECT_NE(field_of_error(o).find("windows"), std::string::npos);
  o.windows = 1;
  o.context = 0;
  EXPECT_NE(field_of_error(o).find("context"), std::string::npos);
  o.context = 30;
  o.first_window = 2;
  EXPECT_NE(field_of_error(o).find("first_window"), std::string::npos);
  auto bad_tokens = tokens;
  bad_tokens[5] = 5000;
  o.first_window = 0;
  EXPECT_THROW(evaluate(m, bad_tokens, {base}, base, o), Error);
}

TEST(Sampler, GreedyTemperatureTopP) {
  const float logits[4] = {1.0f, 3.0f, 2.0f, 3.0f};
  Sampler greedy({0.0, 1.0, 1});
  EXPECT_EQ(greedy.sample(logits, 4), 1);  // first of the tied maxima
  // A tiny nucleus keeps only the most likely token.
  Sampler narrow({1.0, 1e-6, 5});
  for (int i = 0; i < 50; ++i) EXPECT_EQ(narrow.sample(logits, 4), 1);
  // T = 1 draws follow the softmax; the same seed gives the same draws.
  Sampler a({1.0, 1.0, 42}), b({1.0, 1.0, 42});
  std::vector<int> count(4, 0);
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const int32_t x = a.sample(logits, 4);
    EXPECT_EQ(x, b.sample(logits, 4));
    ++count[size_t(x)];
  }
  double z = 0.0;
  for (float l : logits) z += std::exp(l);
  for (int v = 0; v < 4; ++v) EXPECT_NEAR(count[size_t(v)] / double(n), std::exp(logits[v]) / z, 0.015) << v;
  // top_p = 0.5 keeps tokens 1 and 3 (0.37 each) only.
  Sampler half({1.0, 0.5, 9});
  for (int i = 0; i < 200; ++i) {
    const int32_t x = half.sample(logits, 4);
    EXPECT_TRUE(x == 1 || x == 3) << x;
  }
  EXPECT_THROW(Sampler({-1.0, 1.0, 0}), Error);
  EXPECT_THROW(Sampler({1.0, 0.0, 0}), Error);
  EXPECT_THROW(Sampler({1.0, 1.5, 0}), Error);
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingTheMassInProportion) {
  const float logits[4] = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  for (const auto& [top_p, keep] : {std::pair{0.75, 2}, std::pair{0.9, 3}, std::pair{1.0, 4}}) {
    Sampler s({1.0, top_p, 7});
    std::vector<int> count(4, 0);
    const int n = 20000;
    for (int i = 0; i < n; ++i) ++count[size_t(s.sample(logits, 4))];
    double mass = 0.0;
    for (int v = 0; v < keep; ++v) mass += std::exp(logits[v]);
    for (int v = 0; v < 4; ++v) {
      const double expected = v < keep ? std::exp(logits[v]) / mass : 0.0;
      EXPECT_NEAR(count[size_t(v)] / double(n), expected, 0.015) << "top_p " << top_p << " token " << v;
    }
  }
}

TEST(Sampler, RepetitionPenaltyLowersRecentTokensOnly) {
  SamplingOptions o{0.0, 1.0, 0, 1.1, 2};
  const float pos[3] = {2.0f, 1.9f, -1.0f};
  Sampler greedy(o);
  EXPECT_EQ(greedy.sample(pos, 3), 0);
  greedy.observe(0);
  EXPECT_EQ(greedy.sample(pos, 3), 1);  // 2.0 / 1.1 = 1.82 < 1.9
  greedy.observe(0);                    // seen twice: still penalised once
  EXPECT_EQ(greedy.sample(pos, 3), 1);
  greedy.observe(2);
  greedy.observe(2);  // token 0 has left the window of 2
  EXPECT_EQ(greedy.sample(pos, 3), 0);
  const float neg[2] = {-1.0f, -1.05f};
  Sampler n(o);
  n.observe(0);
  EXPECT_EQ(n.sample(neg, 2), 1);  // -1.0 * 1.1 = -1.1 < -1.05
  Sampler off({0.0, 1.0, 0, 1.0, 64});
  off.observe(0);
  EXPECT_EQ(off.sample(pos, 3), 0);
  // Sampled: the penalised token's share is the softmax of the penalised logits.
  const float flat[2] = {1.0f, 0.0f};
  Sampler t({1.0, 1.0, 3, 2.0, 8});
  t.observe(0);
  int zeros = 0;
  const int draws = 20000;
  for (int i = 0; i < draws; ++i) zeros += t.sample(flat, 2) == 0;
  EXPECT_NEAR(zeros / double(draws), std::exp(0.5) / (std::exp(0.5) + 1.0), 0.015);
  EXPECT_THROW(Sampler({1.0, 1.0, 0, 0.9, 64}), Error);
  EXPECT_THROW(Sampler({1.0, 1.0, 0, 1.1, -1}), Error);
}

TEST(Generate, SampledTextIsDeterministicForASeed) {
  const LlamaModel m = testing::tiny_model(testing::tiny_config());
  const std::vector<int32_t> prompt{1, 2, 3};
  auto run = [&](uint64_t seed, double penalty) {
    Session s(m, raw_factory(8));
    GenerateOptions g;
    g.max_tokens = 24;
    g.sampling = {1.0, 0.9, seed, penalty, 16};
    return generate(s, prompt, g).tokens;
  };
  EXPECT_EQ(run(5, 1.15), run(5, 1.15));
  EXPECT_NE(run(5, 1.15), run(6, 1.15));
  EXPECT_NE(run(5, 1.15), run(5, 3.0));  // the penalty reaches generate's sampler
}

// generate_with_logits hands each step the logits its token was sampled
// from: greedy picks their argmax, and they are the logits a plain forward
// pass of the same tokens gives at that position.
TEST(Generate, WithLogitsGivesTheLogitsEachTokenCameFrom) {
  const LlamaModel m = testing::tiny_model(testing::tiny_config());
  const std::vector<int32_t> prompt{1, 2, 3};
  const int vocab = m.config().vocab_size;
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> rows;
  Session s(m, raw_factory(8));
  GenerateOptions g;
  g.max_tokens = 5;
  const auto r = generate_with_logits(s, prompt, g, [&](int32_t t, const float* logits) {
    tokens.push_back(t);
    rows.emplace_back(logits, logits + vocab);
  });
  EXPECT_EQ(tokens, r.tokens);
  ASSERT_EQ(rows.size(), 5u);
  std::vector<int32_t> all(prompt);
  all.insert(all.end(), tokens.begin(), tokens.end());
  Session ref(m, raw_factory(8));
  std::vector<float> logits;
  ref.forward(all.data(), int64_t(all.size()) - 1, logits, true);
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(argmax(rows[i].data(), vocab), tokens[i]) << i;
    const float* want = logits.data() + (prompt.size() - 1 + i) * size_t(vocab);
    for (int v = 0; v < vocab; ++v) ASSERT_NEAR(rows[i][size_t(v)], want[v], 1e-4f) << "step " << i << " token " << v;
  }
}

TEST(Generate, StopsAtEosOrMaxTokensAndStreams) {
  const LlamaModel m = testing::tiny_model(testing::tiny_config());
  const std::vector<int32_t> prompt{1, 2, 3};
  std::vector<int32_t> streamed;
  Session s(m, raw_factory(8));
  GenerateOptions g;
  g.max_tokens = 12;
  const auto r = generate(s, prompt, g, [&](int32_t t) { streamed.push_back(t); });
  EXPECT_EQ(r.tokens.size(), 12u);
  EXPECT_EQ(streamed, r.tokens);
  EXPECT_EQ(s.position(), 3 + 11);  // the last token is not fed back
  // Greedy generation equals argmax of the reference path, step by step.
  Session ref(m, raw_factory(8));
  GenerateOptions gr = g;
  gr.reference = true;
  EXPECT_EQ(generate(ref, prompt, gr).tokens, r.tokens);
  // Stop at the EOS: make the 4th generated token the "EOS".
  Session s2(m, raw_factory(8));
  GenerateOptions ge = g;
  ge.eos_token = r.tokens[3];
  const auto r2 = generate(s2, prompt, ge);
  EXPECT_TRUE(r2.stopped_at_eos);
  EXPECT_LE(r2.tokens.size(), 4u);
  EXPECT_EQ(r2.tokens.back(), r.tokens[3]);
  Session s3(m, raw_factory(8));
  EXPECT_THROW(generate(s3, {}, g), Error);
}

}  // namespace
}  // namespace kvcodec::model

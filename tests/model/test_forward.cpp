// Forward pass: fast path vs plain-loop reference, chunking invariance, and
// the shipped model against HF reference logits.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <unistd.h>

#include "kvcodec/error.hpp"
#include "kvcodec/safetensors.hpp"
#include "model/llama.hpp"
#include "model_fixtures.hpp"
#include "raw_cache.hpp"

namespace kvcodec::model {
namespace {

using testing::raw_factory;

using testing::random_tokens;

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0.0f;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// Prefill then decode steps, collecting every position's logits.
std::vector<float> run(Session& s, const std::vector<int32_t>& tokens, int prefill, bool reference) {
  std::vector<float> all, step;
  if (reference) s.forward_reference(tokens.data(), prefill, step, true);
  else s.forward(tokens.data(), prefill, step, true);
  all = step;
  for (size_t i = size_t(prefill); i < tokens.size(); ++i) {
    if (reference) s.forward_reference(&tokens[i], 1, step, false);
    else s.forward(&tokens[i], 1, step, false);
    all.insert(all.end(), step.begin(), step.end());
  }
  return all;
}

class ForwardVsReference : public ::testing::TestWithParam<std::tuple<int, int, bool, int>> {};

TEST_P(ForwardVsReference, SameLogits) {
  const auto [hq, hkv, tied, block] = GetParam();
  const LlamaModel m = testing::tiny_model(testing::tiny_config(hq, hkv, tied));
  const auto tokens = random_tokens(53, m.config().vocab_size, 11);
  Session fast(m, raw_factory(block)), ref(m, raw_factory(block));
  const auto a = run(fast, tokens, 41, false);
  const auto b = run(ref, tokens, 41, true);
  ASSERT_EQ(a.size(), tokens.size() * size_t(m.config().vocab_size));
  float scale = 0.0f;
  for (float x : b) scale = std::max(scale, std::abs(x));
  EXPECT_LT(max_abs_diff(a, b), 1e-4f * std::max(1.0f, scale));
  EXPECT_EQ(fast.position(), 53);
  EXPECT_EQ(fast.caches()[0]->offset(), 53);
}

INSTANTIATE_TEST_SUITE_P(Shapes, ForwardVsReference,
                         ::testing::Values(std::make_tuple(4, 2, true, 16), std::make_tuple(4, 4, false, 5),
                                           std::make_tuple(6, 1, true, 1000), std::make_tuple(4, 2, true, 1)));

// One prefill of everything, token-by-token decoding, and uneven chunks all
// give the same logits: the cache and the causal mask see the same history.
TEST(Forward, ChunkingInvariant) {
  const LlamaModel m = testing::tiny_model(testing::tiny_config());
  const auto tokens = random_tokens(70, m.config().vocab_size, 5);
  std::vector<float> whole;
  Session s1(m, raw_factory(64));
  s1.forward(tokens.data(), 70, whole, true);

  Session s2(m, raw_factory(3));
  std::vector<float> pieces, out;
  for (int start : {0, 1, 33, 34, 60}) {
    const int end = start == 60 ? 70 : (start == 0 ? 1 : start == 1 ? 33 : start == 33 ? 34 : 60);
    s2.forward(&tokens[size_t(start)], end - start, out, true);
    pieces.insert(pieces.end(), out.begin(), out.end());
  }
  EXPECT_LT(max_abs_diff(whole, pieces), 1e-4f);

  // Last-token logits equal the last row of all-token logits.
  Session s3(m, raw_factory(64));
  s3.forward(tokens.data(), 70, out, false);
  const int V = m.config().vocab_size;
  std::vector<float> last(whole.end() - V, whole.end());
  EXPECT_LT(max_abs_diff(out, last), 1e-5f);
}

// Work is split over rows of the weights and over (head, query chunk) pairs,
// never inside a sum, so the thread count does not change a single bit.
TEST(Forward, ThreadCountDoesNotChangeResults) {
  const LlamaModel m = testing::tiny_model(testing::tiny_config(6, 2, true));
  const auto tokens = random_tokens(150, m.config().vocab_size, 9);
  const int saved = omp_get_max_threads();
  std::vector<float> out[2];
  for (int t = 0; t < 2; ++t) {
    omp_set_num_threads(t == 0 ? 1 : 3);
    Session s(m, raw_factory(32));
    out[t] = run(s, tokens, 140, false);
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(out[0], out[1]);
}

TEST(Forward, RejectsBadInput) {
  const LlamaModel m = testing::tiny_model(testing::tiny_config());
  Session s(m, raw_factory(8));
  std::vector<float> out;
  const int32_t bad[] = {3, 97};
  try {
    s.forward(bad, 2, out);
    FAIL() << "no error for a token outside the vocabulary";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("97"), std::string::npos) << e.what();
  }
  EXPECT_THROW(s.forward(bad, 0, out), Error);
  EXPECT_EQ(s.position(), 0);

  ModelWeights w = testing::tiny_model(testing::tiny_config()).weights();
  w.layers[1].wk.pop_back();
  try {
    LlamaModel broken(testing::tiny_config(), w);
    FAIL() << "no error for a short weight";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kShapeMismatch);
    EXPECT_NE(std::string(e.what()).find("model.layers.1.self_attn.k_proj.weight"), std::string::npos) << e.what();
  }
}

TEST(Forward, RopeMatchesDefinition) {
  // Rotation by angle a of pair (i, i + D/2) with a = pos * theta^(-2i/D).
  const int D = 8;
  std::vector<float> cs(4), sn(4);
  rope_angles(5, D, 10000.0, cs.data(), sn.data());
  float x[D] = {1, 2, 3, 4, 5, 6, 7, 8};
  rope_row(x, D, cs.data(), sn.data());
  for (int i = 0; i < 4; ++i) {
    const double a = 5.0 * std::pow(10000.0, -2.0 * i / D);
    EXPECT_NEAR(x[i], (i + 1) * std::cos(a) - (i + 5) * std::sin(a), 1e-5);
    EXPECT_NEAR(x[i + 4], (i + 5) * std::cos(a) + (i + 1) * std::sin(a), 1e-5);
  }
}

// --- the shipped checkpoint -------------------------------------------------

TEST(Loader, ShippedModelMatchesReferenceLogits) {
  const std::string shared = testing::shared_tinycode_dir();
  if (!testing::exists(shared + "/reference_logits.safetensors") || !testing::exists(shared + "/eval_tokens.u16"))
    GTEST_SKIP() << "no " << shared << "/reference_logits.safetensors (../shared absent)";
  const LlamaModel m = LlamaModel::load(testing::shipped_model_dir());
  // One thread: this test checks numbers, not threading (which has its own
  // test), and stays fast on a busy, oversubscribed CI machine.
  const int saved_threads = omp_get_max_threads();
  omp_set_num_threads(1);
  struct Restore {
    int n;
    ~Restore() { omp_set_num_threads(n); }
  } restore{saved_threads};
  EXPECT_EQ(m.config().n_layers, 6);
  EXPECT_EQ(m.config().n_kv_heads, 2);
  EXPECT_DOUBLE_EQ(m.config().rope_theta, 10000.0);
  const auto tokens = testing::eval_window(shared + "/eval_tokens.u16", 0, 64);
  ASSERT_EQ(tokens.size(), 64u);
  const SafetensorsFile ref_file = SafetensorsFile::open(shared + "/reference_logits.safetensors");
  ASSERT_TRUE(ref_file.contains("logits"));
  const std::vector<float> ref = ref_file.read_f32("logits");
  if (ref_file.contains("input_ids")) {  // the reference's own record of its input
    const auto& info = ref_file.info("input_ids");
    ASSERT_EQ(info.dtype, "I64");
    ASSERT_EQ(info.size, 64u * 8u);
    const auto* ids = reinterpret_cast<const int64_t*>(ref_file.raw("input_ids"));
    for (int i = 0; i < 64; ++i) ASSERT_EQ(ids[i], tokens[size_t(i)]) << "input id " << i;
  }
  const int V = m.config().vocab_size;
  ASSERT_EQ(ref.size(), size_t(64 * V));

  // Positions [0, n) of got against the reference.
  auto check = [&](const std::vector<float>& got, const char* what, int n = 64) {
    ASSERT_EQ(got.size(), size_t(n) * V) << what;
    float worst = 0.0f;
    for (int p = 0; p < n; ++p) {
      const float* g = got.data() + size_t(p) * V;
      const float* r = ref.data() + size_t(p) * V;
      for (int v = 0; v < V; ++v) worst = std::max(worst, std::abs(g[v] - r[v]));
      EXPECT_EQ(std::max_element(g, g + V) - g, std::max_element(r, r + V) - r) << what << " top-1 at " << p;
    }
    EXPECT_LE(worst, 5e-3f) << what;
    std::printf("[ logits ] %s: max |diff| vs HF reference = %.2e\n", what, double(worst));
  };
  {  // one prefill of 64 tokens
    Session s(m, raw_factory(64));
    std::vector<float> logits;
    s.forward(tokens.data(), 64, logits, true);
    check(logits, "prefill");
  }
  {  // 16-token prefill then 48 decode steps, through 7-token cache blocks
    Session s(m, raw_factory(7));
    check(run(s, tokens, 16, false), "prefill+decode");
  }
  {  // the plain-loop reference on the real weights (16 positions: it is slow)
    Session s(m, raw_factory(64));
    std::vector<float> logits;
    s.forward_reference(tokens.data(), 16, logits, true);
    check(logits, "reference", 16);
  }
}

// A checkpoint missing a tensor, or with one of the wrong shape, is refused
// with an error naming the tensor.
TEST(Loader, NamesMissingAndMisshapenTensors) {
  namespace fs = std::filesystem;
  const ModelConfig c = testing::tiny_config(4, 2, true);
  const LlamaModel m = testing::tiny_model(c);
  const fs::path dir = fs::temp_directory_path() / ("kvcodec_model_loader_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string config_json = R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "intermediate_size": 64, "vocab_size": 97, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": true})";
  std::ofstream(dir / "config.json") << config_json;

  auto write = [&](const std::string& skip, const std::string& misshape) {
    SafetensorsWriter w;
    auto add = [&](const std::string& name, const std::vector<float>& v, std::vector<int64_t> shape) {
      if (name == skip) return;
      if (name == misshape) shape.back() -= 1;
      std::vector<uint8_t> bytes(size_t(shape[0] * (shape.size() > 1 ? shape[1] : 1)) * 4);
      std::memcpy(bytes.data(), v.data(), bytes.size());
      w.add(name, "F32", shape, std::move(bytes));
    };
    const auto& W = m.weights();
    add("model.embed_tokens.weight", W.embed, {97, 48});
    add("model.norm.weight", W.final_norm, {48});
    for (int l = 0; l < 2; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      const auto& L = W.layers[size_t(l)];
      add(p + "input_layernorm.weight", L.attn_norm, {48});
      add(p + "self_attn.q_proj.weight", L.wq, {32, 48});
      add(p + "self_attn.k_proj.weight", L.wk, {16, 48});
      add(p + "self_attn.v_proj.weight", L.wv, {16, 48});
      add(p + "self_attn.o_proj.weight", L.wo, {48, 32});
      add(p + "post_attention_layernorm.weight", L.mlp_norm, {48});
      add(p + "mlp.gate_proj.weight", L.w_gate, {64, 48});
      add(p + "mlp.up_proj.weight", L.w_up, {64, 48});
      add(p + "mlp.down_proj.weight", L.w_down, {48, 64});
    }
    w.write((dir / "model.safetensors").string());
  };

  write("", "");
  const LlamaModel loaded = LlamaModel::load(dir.string());
  EXPECT_EQ(loaded.weights().layers[1].w_down, m.weights().layers[1].w_down);

  write("model.layers.1.mlp.up_proj.weight", "");
  try {
    LlamaModel::load(dir.string());
    ADD_FAILURE() << "no error for a missing tensor";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_NE(std::string(e.what()).find("model.layers.1.mlp.up_proj.weight"), std::string::npos) << e.what();
  }
  write("", "model.layers.0.self_attn.k_proj.weight");
  try {
    LlamaModel::load(dir.string());
    ADD_FAILURE() << "no error for a misshapen tensor";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kShapeMismatch);
    EXPECT_NE(std::string(e.what()).find("model.layers.0.self_attn.k_proj.weight"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvcodec::model

// Shared helpers of the model tests: a small random Llama and the paths of
// the shipped model and the shared data.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "model/eval.hpp"
#include "model/llama.hpp"

namespace kvcodec::model::testing {

inline std::string shipped_model_dir() { return std::string(KVCODEC_SOURCE_DIR) + "/models/tinycode"; }
inline std::string shared_tinycode_dir() { return std::string(KVCODEC_SHARED_DIR) + "/models/tinycode"; }
inline bool exists(const std::string& p) { return std::filesystem::exists(p); }

inline std::vector<float> random_vector(std::mt19937& rng, size_t n, float scale, float offset = 0.0f) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = offset + scale * u(rng);
  return v;
}

// A small random Llama: hidden 48, H_q = n_heads, H_kv = n_kv, D = 8.
inline ModelConfig tiny_config(int n_heads = 4, int n_kv = 2, bool tied = true) {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.hidden_size = 48;
  c.n_layers = 2;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv;
  c.head_dim = 8;
  c.intermediate_size = 64;
  c.vocab_size = 97;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = tied;
  return c;
}

inline LlamaModel tiny_model(const ModelConfig& c, uint32_t seed = 7) {
  std::mt19937 rng(seed);
  const size_t hid = size_t(c.hidden_size), qd = size_t(c.q_dim()), kvd = size_t(c.kv_dim()),
               inter = size_t(c.intermediate_size), vocab = size_t(c.vocab_size);
  const float s = 0.3f;
  ModelWeights w;
  w.embed = random_vector(rng, vocab * hid, 1.0f);
  w.final_norm = random_vector(rng, hid, 0.2f, 1.0f);
  if (!c.tie_word_embeddings) w.lm_head = random_vector(rng, vocab * hid, 0.5f);
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights lw;
    lw.attn_norm = random_vector(rng, hid, 0.2f, 1.0f);
    lw.wq = random_vector(rng, qd * hid, s);
    lw.wk = random_vector(rng, kvd * hid, s);
    lw.wv = random_vector(rng, kvd * hid, s);
    lw.wo = random_vector(rng, hid * qd, s);
    lw.mlp_norm = random_vector(rng, hid, 0.2f, 1.0f);
    lw.w_gate = random_vector(rng, inter * hid, s);
    lw.w_up = random_vector(rng, inter * hid, s);
    lw.w_down = random_vector(rng, hid * inter, s);
    w.layers.push_back(std::move(lw));
  }
  return LlamaModel(c, std::move(w));
}

// n token ids in [0, vocab), from seed.
inline std::vector<int32_t> random_tokens(int64_t n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % uint32_t(vocab));
  return t;
}

// Window w of eval_tokens.u16 (2048 uint16 tokens per window), as int32.
// The eval tests' protocol on random tokens of windows of 40: windows 1
// and 2, context 25, 10 scored tokens each.
inline EvalOptions two_windows_of_40() {
  EvalOptions o;
  o.window_length = 40;
  o.context = 25;
  o.score = 10;
  o.windows = 2;
  o.first_window = 1;
  return o;
}

inline std::vector<int32_t> eval_window(const std::string& path, int64_t window, int64_t count) {
  std::ifstream in(path, std::ios::binary);
  std::vector<uint16_t> raw(static_cast<size_t>(count));
  in.seekg(std::streamoff(window * 2048 * 2));
  in.read(reinterpret_cast<char*>(raw.data()), std::streamsize(count * 2));
  if (!in) return {};
  return std::vector<int32_t>(raw.begin(), raw.end());
}

}  // namespace kvcodec::model::testing

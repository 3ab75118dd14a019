// Llama-family forward pass through per-layer KV caches (DESIGN 8).
//
// LlamaModel holds f32 weights (converted at load from bf16/f16/f32).
// Session is one sequence (batch B = 1): it owns one KVCache per layer, made
// by a CacheFactory, and scratch buffers sized for the largest chunk seen, so
// a decode step allocates nothing once warm. Every layer's attention goes
// through its cache: post-RoPE keys and values [1, H_kv, S, D] are appended,
// then the history is read back block by block with for_each_block() and
// consumed with an online softmax, so no method's history is materialised
// whole.
//
// Two implementations of the same arithmetic:
//   forward()           Eigen GEMM/GEMV + OpenMP over rows and heads;
//   forward_reference() plain loops, attention over cache->fetch(f32);
// tests compare them (tests/model/test_forward.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvcodec/cache.hpp"
#include "model/config.hpp"

namespace kvcodec::model {

struct LayerWeights {
  // Row-major [out, in], as stored by HF (y = W x).
  std::vector<float> attn_norm;  // [hidden]
  std::vector<float> wq;         // [H_q * D, hidden]
  std::vector<float> wk;         // [H_kv * D, hidden]
  std::vector<float> wv;         // [H_kv * D, hidden]
  std::vector<float> wo;         // [hidden, H_q * D]
  std::vector<float> mlp_norm;   // [hidden]
  std::vector<float> w_gate;     // [intermediate, hidden]
  std::vector<float> w_up;       // [intermediate, hidden]
  std::vector<float> w_down;     // [hidden, intermediate]
};

struct ModelWeights {
  std::vector<float> embed;       // [vocab, hidden]
  std::vector<float> final_norm;  // [hidden]
  std::vector<float> lm_head;     // [vocab, hidden]; empty when tied to embed
  std::vector<LayerWeights> layers;
};

class LlamaModel {
 public:
  // Checks every tensor's size against the config; throws Error(kShapeMismatch)
  // naming the tensor.
  LlamaModel(ModelConfig config, ModelWeights weights);

  // DIR with config.json and model.safetensors or model.safetensors.index.json.
  // Missing tensors -> Error(kNotFound), wrong shapes -> Error(kShapeMismatch),
  // both naming the tensor; unsupported architectures -> Error(kUnsupported).
  static LlamaModel load(const std::string& dir);

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  // The output projection [vocab, hidden] (embed when tied).
  const float* lm_head() const { return weights_.lm_head.empty() ? weights_.embed.data() : weights_.lm_head.data(); }

 private:
  ModelConfig config_;
  ModelWeights weights_;
};

// The CacheConfig of layer `layer` of a model of config c.
CacheConfig layer_cache_config(const ModelConfig& c, int layer);

// Makes the cache of one layer (called once per layer with its CacheConfig).
using CacheFactory = std::function<std::unique_ptr<KVCache>(const CacheConfig&)>;

// A factory over kvcodec::make_cache(method, config, settings).
CacheFactory method_cache_factory(const std::string& method, const Settings& settings = {});

class Session {
 public:
  Session(const LlamaModel& model, const CacheFactory& factory);

  // Feeds n tokens at positions position() .. position() + n - 1 and appends
  // their keys and values to the caches. Logits are written to `logits`
  // (resized): [n, vocab] when all_logits, else [vocab] of the last token.
  void forward(const int32_t* tokens, int64_t n, std::vector<float>& logits, bool all_logits = false);
  // Same contract, naive loops; attention reads cache->fetch(). For tests and
  // as the speed reference.
  void forward_reference(const int32_t* tokens, int64_t n, std::vector<float>& logits, bool all_logits = false);

  // Called in forward() (not forward_reference) for every layer with that
  // layer's queries after RoPE, [n, H_q * D] row-major: calibration
  // (src/model/calibrate) measures from them how much each key dimension
  // matters to attention scores. Empty (the default) costs nothing.
  using QueryObserver = std::function<void(int layer, const float* queries, int64_t n)>;
  void set_query_observer(QueryObserver observer) { query_observer_ = std::move(observer); }

  int64_t position() const { return position_; }
  const LlamaModel& model() const { return *model_; }
  const std::vector<std::unique_ptr<KVCache>>& caches() const { return caches_; }
  // Sum over layers.
  CacheStats cache_stats() const;

 private:
  void check_tokens(const int32_t* tokens, int64_t n) const;
  void ensure_scratch(int64_t n);
  void attention(int layer, int64_t n);

  const LlamaModel* model_;
  std::vector<std::unique_ptr<KVCache>> caches_;
  int64_t position_ = 0;
  QueryObserver query_observer_;

  // Scratch, [n, width] row-major; grown, never shrunk.
  int64_t capacity_ = 0;
  std::vector<float> x_, h_, q_, k_, v_, attn_, gate_, up_;
  std::vector<float> kv_k_, kv_v_;      // [1, H_kv, n, D] for append()
  std::vector<float> cos_, sin_;        // [n, D/2]
  std::vector<float> row_max_, row_sum_;  // online softmax state [n, H_q]
  std::vector<float> block_k_, block_v_;  // a block converted to f32 when the cache gives another layout
  std::vector<std::vector<float>> score_scratch_;  // per OpenMP thread
};

// OpenMP threads worth using now: the cores not already busy (1-minute load
// average), at least 1. Fork-join threading with a barrier per matmul
// collapses when cores are oversubscribed (a preempted thread stalls every
// barrier: 10-20x slower decode measured on a shared 2-core machine), so the
// CLI uses this unless --threads is given. Results do not depend on it.
int auto_thread_count();

// RMSNorm of one row: out = x / sqrt(mean(x^2) + eps) * w (in f32 sums of
// double precision accumulators, as HF computes in f32; see llama.cpp).
void rms_norm_row(const float* x, const float* w, int n, double eps, float* out);

// HF rotate-half RoPE on one [D] row in place: for i < D/2,
// (x_i, x_{i+D/2}) -> (x_i c - x_{i+D/2} s, x_{i+D/2} c + x_i s),
// with angle position * theta^(-2i/D).
void rope_row(float* x, int head_dim, const float* cos, const float* sin);
void rope_angles(int64_t position, int head_dim, double theta, float* cos, float* sin);

}  // namespace kvcodec::model

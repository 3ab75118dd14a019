#include "model/llama.hpp"

#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>

#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"

namespace kvcodec::model {
namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMat = Eigen::Map<const RowMat>;
using MutMat = Eigen::Map<RowMat>;
using ConstStrided = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;
using MutStrided = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;

// Y[n, out] (+)= X[n, in] * W[out, in]^T, split over rows of W (columns of
// Y) across OpenMP threads; each piece is an Eigen GEMV (n = 1) or GEMM.
// Eigen's own GEMM threading is off (EIGEN_DONT_PARALLELIZE, CMakeLists):
// it spin-waits between its threads, which collapses on a shared, busy
// machine; plain row splits need one barrier and give the same bits for any
// thread count (no reduction is split).
void matmul_wt(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y, bool accumulate) {
  // Fixed 64-row pieces, whatever the thread count: the pieces' shapes pick
  // Eigen's kernels, so a split that followed the thread count would change
  // the last bits of the result with it.
  constexpr int64_t kRows = 64;
  const int64_t chunks = (out + kRows - 1) / kRows;
  ConstMat xm(x, n, in);
#pragma omp parallel for schedule(static) if (n * out * in >= (1 << 16))
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t r0 = c * kRows, rows = std::min(kRows, out - r0);
    ConstMat wm(w + r0 * in, rows, in);
    if (n == 1) {
      Eigen::Map<const Eigen::VectorXf> xv(x, in);
      Eigen::Map<Eigen::VectorXf> yv(y + r0, rows);
      if (accumulate) yv.noalias() += wm * xv;
      else yv.noalias() = wm * xv;
    } else {
      MutStrided ym(y + r0, n, rows, Eigen::OuterStride<>(out));
      if (accumulate) ym.noalias() += xm * wm.transpose();
      else ym.noalias() = xm * wm.transpose();
    }
  }
}

// Reference: the same product with plain loops (double accumulators keep the
// reference a little more exact than what it checks).
void matmul_wt_reference(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y,
                         bool accumulate) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double s = 0.0;
      for (int64_t i = 0; i < in; ++i) s += double(x[r * in + i]) * double(w[o * in + i]);
      y[r * out + o] = accumulate ? float(y[r * out + o] + s) : float(s);
    }
}

float silu(float g) { return g / (1.0f + std::exp(-g)); }

void check_size(const std::vector<float>& v, size_t expected, const std::string& name) {
  if (v.size() != expected)
    throw Error(ErrorCode::kShapeMismatch, "weight " + name + " has " + std::to_string(v.size()) +
                                               " elements, the config needs " + std::to_string(expected));
}

}  // namespace

void rms_norm_row(const float* x, const float* w, int n, double eps, float* out) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  const float inv = float(1.0 / std::sqrt(ss / n + eps));
  for (int i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

void rope_angles(int64_t position, int head_dim, double theta, float* cos, float* sin) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double inv_freq = std::pow(theta, -2.0 * i / head_dim);
    const double a = double(position) * inv_freq;
    cos[i] = float(std::cos(a));
    sin[i] = float(std::sin(a));
  }
}

void rope_row(float* x, int head_dim, const float* cos, const float* sin) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

// --- LlamaModel ---------------------------------------------------------------

LlamaModel::LlamaModel(ModelConfig config, ModelWeights weights)
    : config_(std::move(config)), weights_(std::move(weights)) {
  const ModelConfig& c = config_;
  const size_t hid = size_t(c.hidden_size), qd = size_t(c.q_dim()), kvd = size_t(c.kv_dim()),
               inter = size_t(c.intermediate_size), vocab = size_t(c.vocab_size);
  check_size(weights_.embed, vocab * hid, "model.embed_tokens.weight");
  check_size(weights_.final_norm, hid, "model.norm.weight");
  if (!c.tie_word_embeddings) check_size(weights_.lm_head, vocab * hid, "lm_head.weight");
  else if (!weights_.lm_head.empty()) check_size(weights_.lm_head, vocab * hid, "lm_head.weight");
  if (weights_.layers.size() != size_t(c.n_layers))
    throw Error(ErrorCode::kShapeMismatch, "model has " + std::to_string(weights_.layers.size()) +
                                               " layers of weights, the config says " + std::to_string(c.n_layers));
  for (size_t l = 0; l < weights_.layers.size(); ++l) {
    const LayerWeights& w = weights_.layers[l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    check_size(w.attn_norm, hid, p + "input_layernorm.weight");
    check_size(w.wq, qd * hid, p + "self_attn.q_proj.weight");
    check_size(w.wk, kvd * hid, p + "self_attn.k_proj.weight");
    check_size(w.wv, kvd * hid, p + "self_attn.v_proj.weight");
    check_size(w.wo, hid * qd, p + "self_attn.o_proj.weight");
    check_size(w.mlp_norm, hid, p + "post_attention_layernorm.weight");
    check_size(w.w_gate, inter * hid, p + "mlp.gate_proj.weight");
    check_size(w.w_up, inter * hid, p + "mlp.up_proj.weight");
    check_size(w.w_down, hid * inter, p + "mlp.down_proj.weight");
  }
}

// --- Session --------------------------------------------------------------------

CacheConfig layer_cache_config(const ModelConfig& c, int layer) {
  CacheConfig cc;
  cc.layer = layer;
  cc.n_layers = c.n_layers;
  cc.n_kv_heads = c.n_kv_heads;
  cc.head_dim = c.head_dim;
  cc.rope_theta = c.rope_theta;
  return cc;
}

Session::Session(const LlamaModel& model, const CacheFactory& factory) : model_(&model) {
  const ModelConfig& c = model.config();
  for (int l = 0; l < c.n_layers; ++l) {
    std::unique_ptr<KVCache> cache = factory(layer_cache_config(c, l));
    if (!cache) throw Error(ErrorCode::kInvalidArgument, "cache factory returned no cache for layer " + std::to_string(l));
    caches_.push_back(std::move(cache));
  }
  // A factory may hand back caches that already hold tokens (a prefix loaded
  // from a store); the session then continues after them. Every layer must
  // hold the same number of tokens, or positions would disagree.
  position_ = caches_.empty() ? 0 : caches_.front()->offset();
  for (const auto& cache : caches_)
    if (cache->offset() != position_)
      throw Error(ErrorCode::kShapeMismatch, "cache factory returned caches holding different token counts (" +
                                                 std::to_string(cache->offset()) + " vs " +
                                                 std::to_string(position_) + ")");
}

CacheStats Session::cache_stats() const {
  CacheStats total;
  for (const auto& c : caches_) total += c->stats();
  return total;
}

void Session::check_tokens(const int32_t* tokens, int64_t n) const {
  if (n <= 0) throw Error(ErrorCode::kInvalidArgument, "forward needs at least one token, got " + std::to_string(n));
  const int vocab = model_->config().vocab_size;
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab)
      throw Error(ErrorCode::kInvalidArgument, "token " + std::to_string(tokens[i]) + " at index " +
                                                   std::to_string(i) + " is outside the vocabulary [0, " +
                                                   std::to_string(vocab) + ")");
}

void Session::ensure_scratch(int64_t n) {
  if (n <= capacity_) return;
  const ModelConfig& c = model_->config();
  const size_t N = size_t(n);
  x_.resize(N * c.hidden_size);
  h_.resize(N * c.hidden_size);
  q_.resize(N * c.q_dim());
  k_.resize(N * c.kv_dim());
  v_.resize(N * c.kv_dim());
  attn_.resize(N * c.q_dim());
  gate_.resize(N * c.intermediate_size);
  up_.resize(N * c.intermediate_size);
  kv_k_.resize(N * c.kv_dim());
  kv_v_.resize(N * c.kv_dim());
  cos_.resize(N * (c.head_dim / 2));
  sin_.resize(N * (c.head_dim / 2));
  row_max_.resize(N * c.n_heads);
  row_sum_.resize(N * c.n_heads);
  capacity_ = n;
}

// Attention of the n new queries (q_, post-RoPE) over the layer's whole
// history, read block by block from the cache. Online softmax per (query
// head, query row): running max m, running sum l, unnormalised output in
// attn_. Causal: query r (position p0 + r) sees keys at positions <= p0 + r.
void Session::attention(int layer, int64_t n) {
  const ModelConfig& c = model_->config();
  const int D = c.head_dim, Hq = c.n_heads, group = c.n_heads / c.n_kv_heads;
  const int64_t p0 = position_;
  const int64_t q_stride = c.q_dim();
  const float scale = 1.0f / std::sqrt(float(D));
  std::fill(attn_.begin(), attn_.begin() + n * q_stride, 0.0f);
  std::fill(row_max_.begin(), row_max_.begin() + n * Hq, -std::numeric_limits<float>::infinity());
  std::fill(row_sum_.begin(), row_sum_.begin() + n * Hq, 0.0f);

  constexpr int64_t kChunk = 32;  // query rows per task: bounds the score scratch
  const int64_t n_chunks = (n + kChunk - 1) / kChunk;
  const int n_threads = omp_get_max_threads();
  if (int(score_scratch_.size()) < n_threads) score_scratch_.resize(size_t(n_threads));
  int64_t visited = 0;

  caches_[size_t(layer)]->for_each_block([&](int64_t first, const TensorView& kb, const TensorView& vb) {
    const int64_t m = kb.tokens();
    visited += m;
    if (m == 0) return;
    if (kb.shape[0] < 1 || kb.heads() != c.n_kv_heads || kb.head_dim() != D || vb.shape != kb.shape)
      throw Error(ErrorCode::kInternal, "cache block of shape " + shape_string(kb.shape) +
                                            " does not match the layer's [1, " + std::to_string(c.n_kv_heads) +
                                            ", n, " + std::to_string(D) + "]");
    // Blocks come as f32 per the contract; anything else (or a strided head
    // dimension) is converted once into contiguous scratch.
    const float* kp;
    const float* vp;
    int64_t k_head_stride, k_row_stride, v_head_stride, v_row_stride;
    auto as_f32 = [&](const TensorView& t, std::vector<float>& buf, const float*& p, int64_t& hs, int64_t& rs) {
      if (t.dtype == DType::kF32 && t.strides[3] == 1) {
        p = static_cast<const float*>(t.data);
        hs = t.strides[1];
        rs = t.strides[2];
      } else {
        const TensorView one = TensorView{t.data, t.dtype, {1, t.shape[1], t.shape[2], t.shape[3]}, t.strides};
        buf.resize(size_t(numel(one.shape)));
        copy_to_contiguous(one, buf.data(), DType::kF32);
        p = buf.data();
        hs = m * D;
        rs = D;
      }
    };
    as_f32(kb, block_k_, kp, k_head_stride, k_row_stride);
    as_f32(vb, block_v_, vp, v_head_stride, v_row_stride);

    const int64_t tasks = int64_t(Hq) * n_chunks;
#pragma omp parallel for schedule(dynamic, 1) if (tasks > 1 && m * n >= 64)
    for (int64_t t = 0; t < tasks; ++t) {
      const int h = int(t / n_chunks);
      const int g = h / group;
      const int64_t r_begin = (t % n_chunks) * kChunk;
      const int64_t r_end = std::min(n, r_begin + kChunk);
      // Rows whose position precedes this block see none of it.
      const int64_t r0 = std::max(r_begin, first - p0);
      if (r0 >= r_end) continue;
      const int64_t rows = r_end - r0;
      const int64_t cols = std::min(m, p0 + r_end - 1 - first + 1);  // keys visible to the last row
      std::vector<float>& sbuf = score_scratch_[size_t(omp_get_thread_num())];
      if (sbuf.size() < size_t(rows * cols)) sbuf.resize(size_t(rows * cols));
      MutMat scores(sbuf.data(), rows, cols);
      ConstStrided qm(q_.data() + r0 * q_stride + int64_t(h) * D, rows, D, Eigen::OuterStride<>(q_stride));
      ConstStrided km(kp + g * k_head_stride, cols, D, Eigen::OuterStride<>(k_row_stride));
      ConstStrided vm(vp + g * v_head_stride, cols, D, Eigen::OuterStride<>(v_row_stride));
      scores.noalias() = (qm * km.transpose()) * scale;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = r0 + r;
        const int64_t visible = std::min(cols, p0 + row - first + 1);
        float* s = scores.row(r).data();
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < visible; ++j) mx = std::max(mx, s[j]);
        float& m_run = row_max_[size_t(row * Hq + h)];
        float& l_run = row_sum_[size_t(row * Hq + h)];
        const float m_new = std::max(m_run, mx);
        const float correction = std::exp(m_run - m_new);  // 0 on the first block (m_run = -inf)
        float sum = 0.0f;
        for (int64_t j = 0; j < visible; ++j) {
          s[j] = std::exp(s[j] - m_new);
          sum += s[j];
        }
        for (int64_t j = visible; j < cols; ++j) s[j] = 0.0f;  // masked (future) keys
        l_run = l_run * correction + sum;
        m_run = m_new;
        float* acc = attn_.data() + row * q_stride + int64_t(h) * D;
        if (correction != 1.0f)
          for (int d = 0; d < D; ++d) acc[d] *= correction;
      }
      MutStrided out(attn_.data() + r0 * q_stride + int64_t(h) * D, rows, D, Eigen::OuterStride<>(q_stride));
      out.noalias() += scores * vm;
    }
  });
  if (visited != p0 + n)
    throw Error(ErrorCode::kInternal, "layer " + std::to_string(layer) + " cache visited " + std::to_string(visited) +
                                          " tokens, expected " + std::to_string(p0 + n));
  for (int64_t r = 0; r < n; ++r)
    for (int h = 0; h < Hq; ++h) {
      const float inv = 1.0f / row_sum_[size_t(r * Hq + h)];
      float* acc = attn_.data() + r * q_stride + int64_t(h) * D;
      for (int d = 0; d < D; ++d) acc[d] *= inv;
    }
}

void Session::forward(const int32_t* tokens, int64_t n, std::vector<float>& logits, bool all_logits) {
  check_tokens(tokens, n);
  ensure_scratch(n);
  const ModelConfig& c = model_->config();
  const ModelWeights& W = model_->weights();
  const int hid = c.hidden_size, D = c.head_dim, half = D / 2, Hkv = c.n_kv_heads, Hq = c.n_heads;
  const int64_t qd = c.q_dim(), kvd = c.kv_dim(), inter = c.intermediate_size;

  for (int64_t r = 0; r < n; ++r) {
    std::copy_n(W.embed.data() + int64_t(tokens[r]) * hid, hid, x_.data() + r * hid);
    rope_angles(position_ + r, D, c.rope_theta, cos_.data() + r * half, sin_.data() + r * half);
  }
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = W.layers[size_t(l)];
#pragma omp parallel for if (n > 8)
    for (int64_t r = 0; r < n; ++r) rms_norm_row(x_.data() + r * hid, w.attn_norm.data(), hid, c.rms_norm_eps, h_.data() + r * hid);
    matmul_wt(h_.data(), n, hid, w.wq.data(), qd, q_.data(), false);
    matmul_wt(h_.data(), n, hid, w.wk.data(), kvd, k_.data(), false);
    matmul_wt(h_.data(), n, hid, w.wv.data(), kvd, v_.data(), false);
    // RoPE, and keys/values transposed to [1, H_kv, n, D] for the cache.
#pragma omp parallel for if (n > 8)
    for (int64_t r = 0; r < n; ++r) {
      const float* cs = cos_.data() + r * half;
      const float* sn = sin_.data() + r * half;
      for (int h = 0; h < Hq; ++h) rope_row(q_.data() + r * qd + h * D, D, cs, sn);
      for (int h = 0; h < Hkv; ++h) {
        float* kr = k_.data() + r * kvd + h * D;
        rope_row(kr, D, cs, sn);
        std::copy_n(kr, D, kv_k_.data() + (int64_t(h) * n + r) * D);
        std::copy_n(v_.data() + r * kvd + h * D, D, kv_v_.data() + (int64_t(h) * n + r) * D);
      }
    }
    if (query_observer_) query_observer_(l, q_.data(), n);
    const Shape4 kv_shape{1, Hkv, n, D};
    caches_[size_t(l)]->append(TensorView::contiguous(kv_k_.data(), DType::kF32, kv_shape),
                               TensorView::contiguous(kv_v_.data(), DType::kF32, kv_shape));
    attention(l, n);
    matmul_wt(attn_.data(), n, qd, w.wo.data(), hid, x_.data(), true);
#pragma omp parallel for if (n > 8)
    for (int64_t r = 0; r < n; ++r) rms_norm_row(x_.data() + r * hid, w.mlp_norm.data(), hid, c.rms_norm_eps, h_.data() + r * hid);
    matmul_wt(h_.data(), n, hid, w.w_gate.data(), inter, gate_.data(), false);
    matmul_wt(h_.data(), n, hid, w.w_up.data(), inter, up_.data(), false);
    for (int64_t i = 0; i < n * inter; ++i) gate_[size_t(i)] = silu(gate_[size_t(i)]) * up_[size_t(i)];
    matmul_wt(gate_.data(), n, inter, w.w_down.data(), hid, x_.data(), true);
  }
  const int64_t first_out = all_logits ? 0 : n - 1;
  const int64_t n_out = n - first_out;
  for (int64_t r = first_out; r < n; ++r)
    rms_norm_row(x_.data() + r * hid, W.final_norm.data(), hid, c.rms_norm_eps, h_.data() + r * hid);
  logits.resize(size_t(n_out * c.vocab_size));
  matmul_wt(h_.data() + first_out * hid, n_out, hid, model_->lm_head(), c.vocab_size, logits.data(), false);
  position_ += n;
}

void Session::forward_reference(const int32_t* tokens, int64_t n, std::vector<float>& logits, bool all_logits) {
  check_tokens(tokens, n);
  const ModelConfig& c = model_->config();
  const ModelWeights& W = model_->weights();
  const int hid = c.hidden_size, D = c.head_dim, half = D / 2, Hkv = c.n_kv_heads, Hq = c.n_heads;
  const int64_t qd = c.q_dim(), kvd = c.kv_dim(), inter = c.intermediate_size;
  const int group = Hq / Hkv;
  const size_t N = size_t(n);
  // Plain local buffers: this path is about being obviously right, not fast.
  std::vector<float> x(N * hid), h(N * hid), q(N * qd), k(N * kvd), v(N * kvd), att(N * qd), gate(N * inter),
      up(N * inter), kt(N * kvd), vt(N * kvd), cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
  for (int64_t r = 0; r < n; ++r)
    for (int i = 0; i < hid; ++i) x[size_t(r * hid + i)] = W.embed[size_t(int64_t(tokens[r]) * hid + i)];
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = W.layers[size_t(l)];
    for (int64_t r = 0; r < n; ++r) rms_norm_row(&x[size_t(r * hid)], w.attn_norm.data(), hid, c.rms_norm_eps, &h[size_t(r * hid)]);
    matmul_wt_reference(h.data(), n, hid, w.wq.data(), qd, q.data(), false);
    matmul_wt_reference(h.data(), n, hid, w.wk.data(), kvd, k.data(), false);
    matmul_wt_reference(h.data(), n, hid, w.wv.data(), kvd, v.data(), false);
    for (int64_t r = 0; r < n; ++r) {
      rope_angles(position_ + r, D, c.rope_theta, cs.data(), sn.data());
      for (int hh = 0; hh < Hq; ++hh) rope_row(&q[size_t(r * qd + hh * D)], D, cs.data(), sn.data());
      for (int hh = 0; hh < Hkv; ++hh) {
        rope_row(&k[size_t(r * kvd + hh * D)], D, cs.data(), sn.data());
        for (int d = 0; d < D; ++d) {
          kt[size_t((hh * n + r) * D + d)] = k[size_t(r * kvd + hh * D + d)];
          vt[size_t((hh * n + r) * D + d)] = v[size_t(r * kvd + hh * D + d)];
        }
      }
    }
    const Shape4 kv_shape{1, Hkv, n, D};
    KVCache& cache = *caches_[size_t(l)];
    cache.append(TensorView::contiguous(kt.data(), DType::kF32, kv_shape),
                 TensorView::contiguous(vt.data(), DType::kF32, kv_shape));
    const KVPair hist = cache.fetch(DType::kF32);  // [1, H_kv, S_total, D]
    const int64_t total = hist.keys.shape()[2];
    const float* K = hist.keys.data_as<float>();
    const float* V = hist.values.data_as<float>();
    std::vector<double> p(static_cast<size_t>(total));
    for (int64_t r = 0; r < n; ++r)
      for (int hh = 0; hh < Hq; ++hh) {
        const int g = hh / group;
        const int64_t last = position_ + r;  // causal: keys 0..last
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= last; ++j) {
          double s = 0.0;
          for (int d = 0; d < D; ++d) s += double(q[size_t(r * qd + hh * D + d)]) * K[size_t((g * total + j) * D + d)];
          p[size_t(j)] = s / std::sqrt(double(D));
          mx = std::max(mx, p[size_t(j)]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j <= last; ++j) sum += (p[size_t(j)] = std::exp(p[size_t(j)] - mx));
        for (int d = 0; d < D; ++d) {
          double o = 0.0;
          for (int64_t j = 0; j <= last; ++j) o += p[size_t(j)] * V[size_t((g * total + j) * D + d)];
          att[size_t(r * qd + hh * D + d)] = float(o / sum);
        }
      }
    matmul_wt_reference(att.data(), n, qd, w.wo.data(), hid, x.data(), true);
    for (int64_t r = 0; r < n; ++r) rms_norm_row(&x[size_t(r * hid)], w.mlp_norm.data(), hid, c.rms_norm_eps, &h[size_t(r * hid)]);
    matmul_wt_reference(h.data(), n, hid, w.w_gate.data(), inter, gate.data(), false);
    matmul_wt_reference(h.data(), n, hid, w.w_up.data(), inter, up.data(), false);
    for (size_t i = 0; i < gate.size(); ++i) gate[i] = silu(gate[i]) * up[i];
    matmul_wt_reference(gate.data(), n, inter, w.w_down.data(), hid, x.data(), true);
  }
  const int64_t first_out = all_logits ? 0 : n - 1;
  const int64_t n_out = n - first_out;
  for (int64_t r = first_out; r < n; ++r) rms_norm_row(&x[size_t(r * hid)], W.final_norm.data(), hid, c.rms_norm_eps, &h[size_t(r * hid)]);
  logits.resize(size_t(n_out * c.vocab_size));
  matmul_wt_reference(h.data() + first_out * hid, n_out, hid, model_->lm_head(), c.vocab_size, logits.data(), false);
  position_ += n;
}

}  // namespace kvcodec::model

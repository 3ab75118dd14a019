#include "cache/kvtc_crosslayer.hpp"

#include <algorithm>
#include <cstdlib>

#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"
#include "kvtc/codec.hpp"

namespace kvcodec {

int cross_layer_count(const KvtcCalibration& cal) {
  const auto it = cal.info.find("cross_layers");
  if (it == cal.info.end()) return 0;
  char* end = nullptr;
  const long n = std::strtol(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end != '\0' || n < 1 || n > cal.n_kv_heads || cal.n_kv_heads % n != 0 || cal.n_layers != 1)
    throw Error(ErrorCode::kFormat, "calibration: fit.cross_layers = '" + it->second + "' does not divide " +
                                        std::to_string(cal.n_kv_heads) + " heads of one layer");
  return int(n);
}

void check_cross_layer_calibration(const KvtcCalibration& cal, int n_layers, int n_kv_heads, int head_dim,
                                   double rope_theta, const std::string& label) {
  const int L = cross_layer_count(cal);
  const bool same = L == n_layers && cal.n_kv_heads == n_layers * n_kv_heads && cal.head_dim == head_dim &&
                    cal.rope_theta == rope_theta && cal.weighted();
  if (!same)
    throw Error(ErrorCode::kShapeMismatch,
                "cross-layer calibration " + label + " has " + cal.shape_string() + ", cross_layers=" +
                    std::to_string(L) + "; the model needs cross_layers=" + std::to_string(n_layers) +
                    ", n_kv_heads=" + std::to_string(n_layers * n_kv_heads) + " (layers x kv heads), head_dim=" +
                    std::to_string(head_dim) + ", rope_theta=" + std::to_string(rope_theta) +
                    " and per-dimension scales");
}

void cross_layer_to_codec(const float* const* layer_rows, int L, int H, int D, int64_t n, int64_t t0, bool is_key,
                          const std::vector<double>& inv_freq, const std::vector<float>& scale, float* x) {
  const int64_t V = int64_t(H) * D, W = int64_t(L) * V;
  std::vector<float> rows(size_t(n * V));
  for (int l = 0; l < L; ++l) {
    std::copy_n(layer_rows[l], n * V, rows.data());
    if (is_key) rope_rotate_tokens(rows.data(), n, H, D, t0, inv_freq, /*inverse=*/true);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < V; ++d) x[t * W + l * V + d] = rows[size_t(t * V + d)] * scale[size_t(l * V + d)];
  }
}

void cross_layer_from_codec(const float* x, int L, int H, int D, int64_t n, int64_t t0, bool is_key,
                            const std::vector<double>& inv_freq, const std::vector<float>& scale,
                            float* const* layer_rows) {
  const int64_t V = int64_t(H) * D, W = int64_t(L) * V;
  for (int l = 0; l < L; ++l) {
    float* rows = layer_rows[l];
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < V; ++d) rows[t * V + d] = x[t * W + l * V + d] / scale[size_t(l * V + d)];
    if (is_key) rope_rotate_tokens(rows, n, H, D, t0, inv_freq, /*inverse=*/false);
  }
}

namespace {

struct Shape {
  int L, H, D;
  int64_t S;
  int64_t V() const { return int64_t(H) * D; }
};

Shape shape_of(const KvtcCalibration& cal) {
  const int L = cross_layer_count(cal);
  if (L == 0) throw Error(ErrorCode::kInvalidArgument, "calibration is not cross-layer (no fit.cross_layers)");
  return {L, cal.n_kv_heads / L, cal.head_dim, 0};
}

// [l][1, H, S, D] tensors, tokens [t0, t0 + n) -> rows [n, L * H * D] in the
// codec's space (cross_layer_to_codec).
void gather(const std::vector<Tensor>& layers, const Shape& s, int64_t t0, int64_t n, bool is_key,
            const std::vector<double>& inv_freq, const std::vector<float>& scale, std::vector<float>& x) {
  const int64_t V = s.V();
  std::vector<float> rows(size_t(s.L * n * V));
  std::vector<const float*> ptrs;
  for (int l = 0; l < s.L; ++l) {
    const float* src = layers[size_t(l)].data_as<float>();
    float* dst = rows.data() + l * n * V;
    for (int h = 0; h < s.H; ++h)
      for (int64_t t = 0; t < n; ++t)
        std::copy_n(src + (int64_t(h) * s.S + t0 + t) * s.D, s.D, dst + t * V + int64_t(h) * s.D);
    ptrs.push_back(dst);
  }
  x.resize(size_t(n * s.L * V));
  cross_layer_to_codec(ptrs.data(), s.L, s.H, s.D, n, t0, is_key, inv_freq, scale, x.data());
}

// The inverse of gather into out[l] (f32 [1, H, S, D]).
void scatter(const std::vector<float>& x, const Shape& s, int64_t t0, int64_t n, bool is_key,
             const std::vector<double>& inv_freq, const std::vector<float>& scale, std::vector<Tensor>& out) {
  const int64_t V = s.V();
  std::vector<float> rows(size_t(s.L * n * V));
  std::vector<float*> ptrs;
  for (int l = 0; l < s.L; ++l) ptrs.push_back(rows.data() + l * n * V);
  cross_layer_from_codec(x.data(), s.L, s.H, s.D, n, t0, is_key, inv_freq, scale, ptrs.data());
  for (int l = 0; l < s.L; ++l) {
    float* dst = out[size_t(l)].data_as<float>();
    for (int h = 0; h < s.H; ++h)
      for (int64_t t = 0; t < n; ++t)
        std::copy_n(ptrs[size_t(l)] + t * V + int64_t(h) * s.D, s.D, dst + (int64_t(h) * s.S + t0 + t) * s.D);
  }
}

std::vector<uint8_t> store_tensor(const KvtcCalibration& cal, const std::vector<Tensor>& layers, const Shape& s,
                                  int sinks, int block, bool is_key) {
  const kvtc::HeadParams& p = is_key ? cal.keys[0] : cal.values[0];
  const std::vector<float>& scale = is_key ? cal.key_scale[0] : cal.value_scale[0];
  const std::vector<double> inv_freq = rope_inv_freq(s.D, cal.rope_theta);
  ByteWriter w;
  w.varint(uint64_t(s.S));
  w.varint(uint64_t(sinks));
  w.varint(uint64_t(block));
  for (int l = 0; l < s.L; ++l)
    for (int h = 0; h < s.H; ++h)
      w.f16s_from_f32(layers[size_t(l)].data_as<float>() + int64_t(h) * s.S * s.D, size_t(sinks) * size_t(s.D));
  std::vector<float> x;
  for (int64_t t0 = sinks; t0 < s.S; t0 += block) {
    const int64_t n = std::min<int64_t>(block, s.S - t0);
    gather(layers, s, t0, n, is_key, inv_freq, scale, x);
    const std::vector<uint8_t> payload = kvtc::encode_block(p, x.data(), n);
    w.varint(payload.size());
    w.bytes(payload.data(), payload.size());
  }
  return w.take();
}

std::vector<Tensor> restore_tensor(const KvtcCalibration& cal, const std::vector<uint8_t>& bytes, bool is_key,
                                   int64_t* tokens_out) {
  Shape s = shape_of(cal);
  const kvtc::HeadParams& p = is_key ? cal.keys[0] : cal.values[0];
  const std::vector<float>& scale = is_key ? cal.key_scale[0] : cal.value_scale[0];
  const std::vector<double> inv_freq = rope_inv_freq(s.D, cal.rope_theta);
  ByteReader r(bytes.data(), bytes.size(), is_key ? "cross-layer prefix keys" : "cross-layer prefix values");
  s.S = int64_t(r.count(uint64_t(1) << 24, "tokens"));
  const int64_t sinks = int64_t(r.count(uint64_t(s.S), "sinks"));
  const int64_t block = int64_t(r.count(uint64_t(1) << 20, "block"));
  if (block < 1) r.fail("block 0");
  std::vector<Tensor> out;
  for (int l = 0; l < s.L; ++l) out.emplace_back(DType::kF32, Shape4{1, s.H, s.S, s.D});
  for (int l = 0; l < s.L; ++l)
    for (int h = 0; h < s.H; ++h) {
      const std::vector<float> raw = r.f16s_to_f32(size_t(sinks) * size_t(s.D));
      std::copy(raw.begin(), raw.end(), out[size_t(l)].data_as<float>() + int64_t(h) * s.S * s.D);
    }
  std::vector<float> x;
  for (int64_t t0 = sinks; t0 < s.S; t0 += block) {
    const int64_t n = std::min<int64_t>(block, s.S - t0);
    const size_t size = size_t(r.count(r.remaining(), "block payload size"));
    const std::span<const uint8_t> payload = r.bytes(size);
    x.assign(size_t(n) * size_t(p.dim), 0.0f);
    kvtc::decode_block(p, payload.data(), payload.size(), n, x.data());
    scatter(x, s, t0, n, is_key, inv_freq, scale, out);
  }
  r.expect_end();
  *tokens_out = s.S;
  return out;
}

}  // namespace

CrossLayerPrefixBytes store_prefix_cross_layer(const KvtcCalibration& cal, const std::vector<KVPair>& prefix, int sinks,
                                               int block) {
  Shape s = shape_of(cal);
  if (int(prefix.size()) != s.L)
    throw Error(ErrorCode::kShapeMismatch, "cross-layer prefix: " + std::to_string(prefix.size()) +
                                               " layers given, the calibration spans " + std::to_string(s.L));
  const Shape4 want{1, s.H, prefix[0].keys.shape()[2], s.D};
  for (size_t l = 0; l < prefix.size(); ++l)
    if (prefix[l].keys.shape() != want || prefix[l].values.shape() != want)
      throw Error(ErrorCode::kShapeMismatch, "cross-layer prefix: layer " + std::to_string(l) + " keys " +
                                                 shape_string(prefix[l].keys.shape()) + ", values " +
                                                 shape_string(prefix[l].values.shape()) + ", expected " +
                                                 shape_string(want));
  s.S = want[2];
  if (sinks < 0 || block < 1) throw Error(ErrorCode::kInvalidArgument, "cross-layer prefix: sinks >= 0, block >= 1");
  sinks = int(std::min<int64_t>(sinks, s.S));
  std::vector<Tensor> k, v;
  for (const KVPair& kv : prefix) {
    k.push_back(kv.keys.to(DType::kF32));
    v.push_back(kv.values.to(DType::kF32));
  }
  return {store_tensor(cal, k, s, sinks, block, true), store_tensor(cal, v, s, sinks, block, false)};
}

std::vector<KVPair> restore_prefix_cross_layer(const KvtcCalibration& cal, const CrossLayerPrefixBytes& bytes) {
  int64_t sk = 0, sv = 0;
  std::vector<Tensor> k = restore_tensor(cal, bytes.keys, true, &sk);
  std::vector<Tensor> v = restore_tensor(cal, bytes.values, false, &sv);
  if (sk != sv)
    throw Error(ErrorCode::kFormat, "cross-layer prefix: " + std::to_string(sk) + " key tokens, " + std::to_string(sv) +
                                        " value tokens");
  std::vector<KVPair> out;
  for (size_t l = 0; l < k.size(); ++l) out.push_back({std::move(k[l]), std::move(v[l])});
  return out;
}

}  // namespace kvcodec

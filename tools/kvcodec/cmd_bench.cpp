// kvcodec bench: compress a KV dump with each method and report what was
// saved (ratio, bits per element), what it cost (relative MSE, attention
// error, distance to the rate-distortion bound) and how fast (MB/s of f16
// input, beside zstd measured in the same run).
#include <zstd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/safetensors.hpp"
#include "linalg/pca.hpp"

namespace kvcodec::cli {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Layer {
  Tensor key, value;  // [B, H, T, D] f32
  Tensor query;       // [B, Hq, 256, D] f32, or empty
};

struct Dump {
  std::vector<Layer> layers;
  int64_t batch = 0, heads = 0, tokens = 0, dim = 0;
  double f16_bytes() const { return double(layers.size()) * 2.0 * double(batch * heads * tokens * dim) * 2.0; }
};

Dump load_dump(const std::string& path) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  Dump dump;
  for (int i = 0;; ++i) {
    const std::string k = "layers." + std::to_string(i) + ".key", v = "layers." + std::to_string(i) + ".value";
    if (!file.contains(k) && !file.contains(v)) break;
    if (!file.contains(k) || !file.contains(v))
      throw Error(ErrorCode::kNotFound, path + ": layer " + std::to_string(i) + " has only one of key/value");
    Layer layer;
    const TensorView kv = file.view4(k), vv = file.view4(v);
    if (kv.shape != vv.shape)
      throw Error(ErrorCode::kShapeMismatch, path + ": " + k + " " + shape_string(kv.shape) + " vs " + v + " " +
                                                 shape_string(vv.shape));
    if (i > 0 && kv.shape != dump.layers[0].key.shape())
      throw Error(ErrorCode::kShapeMismatch, path + ": " + k + " " + shape_string(kv.shape) + " differs from layer 0");
    layer.key = Tensor::from_view(kv, DType::kF32);
    layer.value = Tensor::from_view(vv, DType::kF32);
    const std::string q = "layers." + std::to_string(i) + ".query_last256";
    if (file.contains(q)) layer.query = Tensor::from_view(file.view4(q), DType::kF32);
    dump.layers.push_back(std::move(layer));
  }
  if (dump.layers.empty()) throw Error(ErrorCode::kNotFound, path + ": no layers.{i}.key / layers.{i}.value tensors");
  const Shape4 s = dump.layers[0].key.shape();
  dump.batch = s[0];
  dump.heads = s[1];
  dump.tokens = s[2];
  dump.dim = s[3];
  return dump;
}

// Causal attention of the last Q positions' queries over K/V [B, H, T, D]
// (GQA: query head h reads KV head h / (Hq / H)). Output [B, Hq, Q, D].
std::vector<double> attention(const Tensor& query, const Tensor& keys, const Tensor& values) {
  const Shape4 qs = query.shape(), ks = keys.shape();
  const int64_t B = qs[0], Hq = qs[1], Q = qs[2], D = qs[3], H = ks[1], T = ks[2];
  const int64_t group = Hq / H;
  std::vector<double> out(size_t(B * Hq * Q * D), 0.0);
  const float* q = query.data_as<float>();
  const float* k = keys.data_as<float>();
  const float* v = values.data_as<float>();
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<double> score(static_cast<size_t>(T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < Q; ++i) {
        const int64_t pos = T - Q + i;
        const float* qi = q + ((b * Hq + h) * Q + i) * D;
        const int64_t kvh = b * H + h / group;
        double mx = -1e300;
        for (int64_t t = 0; t <= pos; ++t) {
          const float* kt = k + (kvh * T + t) * D;
          double s = 0.0;
          for (int64_t d = 0; d < D; ++d) s += double(qi[d]) * kt[d];
          score[size_t(t)] = s * scale;
          mx = std::max(mx, score[size_t(t)]);
        }
        double sum = 0.0;
        for (int64_t t = 0; t <= pos; ++t) sum += (score[size_t(t)] = std::exp(score[size_t(t)] - mx));
        double* o = &out[size_t(((b * Hq + h) * Q + i) * D)];
        for (int64_t t = 0; t <= pos; ++t) {
          const float* vt = v + (kvh * T + t) * D;
          const double w = score[size_t(t)] / sum;
          for (int64_t d = 0; d < D; ++d) o[d] += w * vt[d];
        }
      }
  return out;
}

struct MethodResult {
  nlohmann::json json;
};

MethodResult bench_zstd(const Dump& dump, int repeats, int level) {
  // The f16 bytes of every K and V tensor, concatenated.
  std::vector<uint16_t> f16;
  for (const Layer& l : dump.layers)
    for (const Tensor* t : {&l.key, &l.value}) {
      const size_t at = f16.size();
      f16.resize(at + size_t(t->numel()));
      convert(t->data(), DType::kF32, f16.data() + at, DType::kF16, size_t(t->numel()));
    }
  const size_t in_bytes = f16.size() * 2;
  std::vector<uint8_t> compressed(ZSTD_compressBound(in_bytes));
  std::vector<uint16_t> restored(f16.size());
  double best_enc = 1e300, best_dec = 1e300;
  size_t csize = 0;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = Clock::now();
    csize = ZSTD_compress(compressed.data(), compressed.size(), f16.data(), in_bytes, level);
    best_enc = std::min(best_enc, seconds_since(t0));
    if (ZSTD_isError(csize)) throw Error(ErrorCode::kInternal, std::string("zstd: ") + ZSTD_getErrorName(csize));
    t0 = Clock::now();
    const size_t dsize = ZSTD_decompress(restored.data(), in_bytes, compressed.data(), csize);
    best_dec = std::min(best_dec, seconds_since(t0));
    if (ZSTD_isError(dsize) || dsize != in_bytes || restored != f16)
      throw Error(ErrorCode::kInternal, "zstd round trip failed");
  }
  nlohmann::json j;
  j["method"] = "zstd";
  j["compression_ratio"] = double(in_bytes) / double(csize);
  j["compressed_bytes"] = csize;
  j["rel_mse_key"] = 0.0;
  j["rel_mse_value"] = 0.0;
  j["bits_per_element"] = 8.0 * double(csize) / double(f16.size());
  j["encode_mb_per_s"] = double(in_bytes) / best_enc / 1e6;
  j["decode_mb_per_s"] = double(in_bytes) / best_dec / 1e6;
  j["settings"] = {{"level", level}};
  return {j};
}

MethodResult bench_cache_method(const Dump& dump, const std::string& method, const Settings& settings,
                                int repeats, int threads, bool with_bound) {
  const int n_layers = int(dump.layers.size());
  CacheConfig config;
  config.n_layers = n_layers;
  config.n_kv_heads = int(dump.heads);
  config.head_dim = int(dump.dim);
  std::vector<std::unique_ptr<KVCache>> caches(static_cast<size_t>(n_layers));
  double best_enc = 1e300, best_dec = 1e300;
  for (int r = 0; r < repeats; ++r) {
    for (int i = 0; i < n_layers; ++i) {
      config.layer = i;
      caches[size_t(i)] = make_cache(method, config, settings);
    }
    auto t0 = Clock::now();
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int i = 0; i < n_layers; ++i)
      caches[size_t(i)]->append(dump.layers[size_t(i)].key.view(), dump.layers[size_t(i)].value.view());
    best_enc = std::min(best_enc, seconds_since(t0));
    t0 = Clock::now();
    double sink = 0.0;
#pragma omp parallel for num_threads(threads) schedule(dynamic) reduction(+ : sink)
    for (int i = 0; i < n_layers; ++i)
      caches[size_t(i)]->for_each_block([&](int64_t, const TensorView& k, const TensorView&) {
        sink += static_cast<const float*>(k.data)[0];  // keep the decode from being elided
      });
    best_dec = std::min(best_dec, seconds_since(t0));
    if (std::isnan(sink)) std::fprintf(stderr, "bench: NaN in %s reconstruction\n", method.c_str());
  }

  // Steady-state encode: the same tokens appended again, now through the
  // frozen parameters (no fit). The one-shot time above includes the fit.
  double best_steady = 1e300;
  {
    std::vector<std::unique_ptr<KVCache>> again(caches.size());
    for (int r = 0; r < repeats; ++r) {
      for (int i = 0; i < n_layers; ++i) {
        config.layer = i;
        again[size_t(i)] = make_cache(method, config, settings);
        again[size_t(i)]->append(dump.layers[size_t(i)].key.view(), dump.layers[size_t(i)].value.view());
      }
      const auto t0 = Clock::now();
#pragma omp parallel for num_threads(threads) schedule(dynamic)
      for (int i = 0; i < n_layers; ++i)
        again[size_t(i)]->append(dump.layers[size_t(i)].key.view(), dump.layers[size_t(i)].value.view());
      best_steady = std::min(best_steady, seconds_since(t0));
    }
  }

  // Errors, per layer and head, and the reverse water-filling bound at the
  // MSE each head achieved (from the PCA eigenvalues of the original data).
  double err_k = 0, err_v = 0, ref_k = 0, ref_v = 0, attn_err = 0, attn_ref = 0, bound_bits = 0;
  bool have_query = false;
  CacheStats total;
  const int64_t T = dump.tokens, D = dump.dim;
  for (int i = 0; i < n_layers; ++i) {
    const Layer& layer = dump.layers[size_t(i)];
    const KVPair rec = caches[size_t(i)]->fetch(DType::kF32);
    total += caches[size_t(i)]->stats();
    for (int which = 0; which < 2; ++which) {
      const Tensor& orig = which == 0 ? layer.key : layer.value;
      const Tensor& back = which == 0 ? rec.keys : rec.values;
      const float* a = orig.data_as<float>();
      const float* b = back.data_as<float>();
      for (int64_t h = 0; h < dump.batch * dump.heads; ++h) {
        double e = 0.0, ref = 0.0;
        for (int64_t j = h * T * D; j < (h + 1) * T * D; ++j) {
          const double diff = double(a[j]) - b[j];
          e += diff * diff;
          ref += double(a[j]) * a[j];
        }
        (which == 0 ? err_k : err_v) += e;
        (which == 0 ? ref_k : ref_v) += ref;
        if (with_bound && e > 0.0) {
          const linalg::PcaBasis pca = linalg::fit_pca(a + h * T * D, T, int(D));
          bound_bits += double(T) * linalg::reverse_water_filling_bits(pca.eigenvalues, e / double(T));
        }
      }
    }
    if (layer.query.numel() > 0) {
      have_query = true;
      const std::vector<double> o = attention(layer.query, layer.key, layer.value);
      const std::vector<double> oh = attention(layer.query, rec.keys, rec.values);
      for (size_t j = 0; j < o.size(); ++j) {
        attn_err += (o[j] - oh[j]) * (o[j] - oh[j]);
        attn_ref += o[j] * o[j];
      }
    }
  }
  const double elements = 2.0 * double(n_layers) * double(dump.batch * dump.heads * T * D);
  nlohmann::json j;
  j["method"] = method;
  j["compression_ratio"] = total.compression_ratio();
  j["compressed_bytes"] = total.compressed_bytes();
  j["compressed_key_bytes"] = total.compressed_key_bytes;
  j["compressed_value_bytes"] = total.compressed_value_bytes;
  j["rel_mse_key"] = ref_k > 0 ? err_k / ref_k : 0.0;
  j["rel_mse_value"] = ref_v > 0 ? err_v / ref_v : 0.0;
  j["bits_per_element"] = 8.0 * double(total.compressed_bytes()) / elements;
  j["encode_mb_per_s"] = dump.f16_bytes() / best_steady / 1e6;
  j["fit_encode_mb_per_s"] = dump.f16_bytes() / best_enc / 1e6;
  j["decode_mb_per_s"] = dump.f16_bytes() / best_dec / 1e6;
  if (have_query) j["attn_rel_err"] = attn_ref > 0 ? std::sqrt(attn_err / attn_ref) : 0.0;
  if (with_bound) j["rd_bound_bits_per_element"] = bound_bits / elements;
  const auto extra = [&](const std::string& name) {
    const auto k = total.extras.find("key." + name), v = total.extras.find("value." + name);
    return (k == total.extras.end() ? 0.0 : k->second) + (v == total.extras.end() ? 0.0 : v->second);
  };
  if (method == "kvtc") {
    j["payload_bits_per_element"] = 8.0 * extra("payload_bytes") / elements;
    j["side_bits_per_element"] = 8.0 * extra("side_bytes") / elements;
    j["raw_bits_per_element"] = 8.0 * extra("raw_bytes") / elements;
    j["entropy_coding_gain"] = extra("payload_bytes") > 0 ? extra("pre_entropy_bytes") / extra("payload_bytes") : 0.0;
    double survived = 0.0;
    int n = 0;
    for (const auto& [name, value] : total.extras)
      if (name.find(".n_survived.") != std::string::npos) {
        survived += value;
        ++n;
      }
    j["mean_n_survived"] = n ? survived / double(n) / double(n_layers) : 0.0;
  }
  nlohmann::json extras = nlohmann::json::object();
  for (const auto& [name, value] : total.extras) extras[name] = value;
  j["extras"] = extras;
  nlohmann::json set = nlohmann::json::object();
  for (const auto& [k, v] : settings) set[k] = v;
  j["settings"] = set;
  return {j};
}

}  // namespace

void register_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Compress a KV dump with each method; report ratio, error and speed");
  struct Options {
    std::string kv;
    std::string methods = "kvtc,zstd";
    std::vector<std::string> sets;
    bool json = false;
    int threads = 1;
    int repeats = 3;
    int zstd_level = 3;
    bool no_bound = false;
  };
  auto opt = std::make_shared<Options>();
  cmd->add_option("--kv", opt->kv, "KV dump (safetensors with layers.{i}.key / layers.{i}.value [B, H, T, D])")
      ->required();
  cmd->add_option("--methods", opt->methods, "comma-separated methods (kvtc, palu, fp16, int8, int4, kivi2, zstd)")
      ->capture_default_str();
  cmd->add_option("--set", opt->sets, "method setting, <method>.<field>=<value> (repeatable)");
  cmd->add_flag("--json", opt->json, "print one JSON array on stdout");
  cmd->add_option("--threads", opt->threads, "threads (layers in parallel)")->check(CLI::Range(1, 256))->capture_default_str();
  cmd->add_option("--repeats", opt->repeats, "timing repeats (best is reported)")->check(CLI::Range(1, 100))->capture_default_str();
  cmd->add_option("--zstd-level", opt->zstd_level, "zstd level of the lossless baseline")->capture_default_str();
  cmd->add_flag("--no-bound", opt->no_bound, "skip the reverse water-filling bound (faster)");
  cmd->callback([opt] {
    const Dump dump = load_dump(opt->kv);
    std::vector<std::string> methods;
    std::stringstream ss(opt->methods);
    for (std::string m; std::getline(ss, m, ',');)
      if (!m.empty()) methods.push_back(m);
    // Validate every --set up front (a typo fails before minutes of work).
    (void)settings_for_method(opt->sets, "");
    nlohmann::json results = nlohmann::json::array();
    for (const std::string& m : methods) {
      if (!opt->json) std::fprintf(stderr, "bench: %s ...\n", m.c_str());
      if (m == "zstd") {
        results.push_back(bench_zstd(dump, opt->repeats, opt->zstd_level).json);
      } else {
        const Settings settings = settings_for_method(opt->sets, m);
        results.push_back(bench_cache_method(dump, m, settings, opt->repeats, opt->threads, !opt->no_bound).json);
      }
    }
    if (opt->json) {
      std::printf("%s\n", results.dump(2).c_str());
      return;
    }
    fmt::print("KV dump {}: {} layers x [B={}, H={}, T={}, D={}], {:.2f} MB as f16\n", opt->kv, dump.layers.size(),
               dump.batch, dump.heads, dump.tokens, dump.dim, dump.f16_bytes() / 1e6);
    fmt::print("{:<8} {:>7} {:>8} {:>11} {:>11} {:>9} {:>9} {:>10} {:>10}\n", "method", "ratio", "bits/el",
               "rel_mse_K", "rel_mse_V", "attn_err", "bound", "enc MB/s", "dec MB/s");
    for (const auto& r : results) {
      auto num = [&](const char* key) { return r.contains(key) ? fmt::format("{:.4g}", r[key].get<double>()) : std::string("-"); };
      fmt::print("{:<8} {:>7.2f} {:>8.3f} {:>11} {:>11} {:>9} {:>9} {:>10.1f} {:>10.1f}\n",
                 r["method"].get<std::string>(), r["compression_ratio"].get<double>(),
                 r["bits_per_element"].get<double>(), num("rel_mse_key"), num("rel_mse_value"), num("attn_rel_err"),
                 num("rd_bound_bits_per_element"), r["encode_mb_per_s"].get<double>(),
                 r["decode_mb_per_s"].get<double>());
    }
  });
}

}  // namespace kvcodec::cli

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
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.hpp"
#include "kvcodec/cache.hpp"
#include "cache/kvtc_calibrated.hpp"
#include "core/first_exception.hpp"
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
  // The steady pass's keys: `key` as the model gives them T positions on
  // (see next_keys).
  Tensor next_key;
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

// The keys the model gives for the dump's tokens at positions T..2T-1,
// where the steady pass appends them: the same pre-RoPE keys, so each
// stored key [B, H, T, D] rotated by T positions more (RoPE's rotations
// compose: R(p + T) = R(T) R(p)), at rope_theta. Appending the unrotated
// keys again gave a RoPE-aware cache (calibrated kvtc, which removes RoPE
// at each key's own position) keys no model produces: half of them fell
// outside its integer projection's range. Odd head_dim has no RoPE: the
// keys stay as they are.
Tensor next_keys(const Tensor& key, int64_t positions, double rope_theta) {
  Tensor out = key;
  const Shape4 s = key.shape();
  if (s[3] % 2 == 0) rope_advance_rows(out.data_as<float>(), s[0] * s[1] * s[2], int(s[3]), positions, rope_theta);
  return out;
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

// The lossless baseline: the f16 bytes of every K and V tensor,
// concatenated, through zstd. One encode() / decode() is one timed pass.
class ZstdRunner {
 public:
  ZstdRunner(const Dump& dump, int level) : level_(level) {
    for (const Layer& l : dump.layers)
      for (const Tensor* t : {&l.key, &l.value}) {
        const size_t at = f16_.size();
        f16_.resize(at + size_t(t->numel()));
        convert(t->data(), DType::kF32, f16_.data() + at, DType::kF16, size_t(t->numel()));
      }
    compressed_.resize(ZSTD_compressBound(in_bytes()));
    restored_.resize(f16_.size());
    encode();  // so that decode() has a frame before the first timed encode
  }
  size_t in_bytes() const { return f16_.size() * 2; }
  double encode() {
    const auto t0 = Clock::now();
    csize_ = ZSTD_compress(compressed_.data(), compressed_.size(), f16_.data(), in_bytes(), level_);
    const double s = seconds_since(t0);
    if (ZSTD_isError(csize_)) throw Error(ErrorCode::kInternal, std::string("zstd: ") + ZSTD_getErrorName(csize_));
    best_enc_ = std::min(best_enc_, s);
    return s;
  }
  double decode() {
    const auto t0 = Clock::now();
    const size_t dsize = ZSTD_decompress(restored_.data(), in_bytes(), compressed_.data(), csize_);
    const double s = seconds_since(t0);
    if (ZSTD_isError(dsize) || dsize != in_bytes() || restored_ != f16_)
      throw Error(ErrorCode::kInternal, "zstd round trip failed");
    best_dec_ = std::min(best_dec_, s);
    return s;
  }
  nlohmann::json result() const {
    nlohmann::json j;
    j["method"] = "zstd";
    j["compression_ratio"] = double(in_bytes()) / double(csize_);
    j["compressed_bytes"] = csize_;
    j["rel_mse_key"] = 0.0;
    j["rel_mse_value"] = 0.0;
    j["bits_per_element"] = 8.0 * double(csize_) / double(f16_.size());
    j["encode_mb_per_s"] = double(in_bytes()) / best_enc_ / 1e6;
    j["decode_mb_per_s"] = double(in_bytes()) / best_dec_ / 1e6;
    j["settings"] = {{"level", level_}};
    return j;
  }

 private:
  int level_;
  std::vector<uint16_t> f16_, restored_;
  std::vector<uint8_t> compressed_;
  size_t csize_ = 0;
  double best_enc_ = 1e300, best_dec_ = 1e300;
};

// One cache method's timed passes over the dump. A repeat is: fresh caches
// and the dump appended (fit + encode, timed), then for_each_block over them
// (decode, timed), then the dump appended again through the now frozen
// parameters (steady-state encode, timed): three separately callable steps
// so that the bench can put a zstd pass right beside each.
class CacheRunner {
 public:
  CacheRunner(const Dump& dump, std::string method, Settings settings, int threads)
      : dump_(dump), method_(std::move(method)), settings_(std::move(settings)), threads_(threads) {
    config_.n_layers = int(dump.layers.size());
    config_.n_kv_heads = int(dump.heads);
    config_.head_dim = int(dump.dim);
    caches_.resize(dump.layers.size());
  }
  const std::string& method() const { return method_; }
  const Settings& settings() const { return settings_; }

  double fit_encode() {
    make_caches(caches_);
    const double s = append_all(caches_);
    best_fit_ = std::min(best_fit_, s);
    return s;
  }
  double decode() {
    const int n_layers = int(caches_.size());
    const auto t0 = Clock::now();
    double sink = 0.0;
    FirstException failure;
#pragma omp parallel for num_threads(threads_) schedule(dynamic) reduction(+ : sink)
    for (int i = 0; i < n_layers; ++i)
      failure.capture([&] {
        caches_[size_t(i)]->for_each_block([&](int64_t, const TensorView& k, const TensorView&) {
          sink += static_cast<const float*>(k.data)[0];  // keep the decode from being elided
        });
      });
    failure.rethrow();
    const double s = seconds_since(t0);
    if (std::isnan(sink)) std::fprintf(stderr, "bench: NaN in %s reconstruction\n", method_.c_str());
    best_dec_ = std::min(best_dec_, s);
    return s;
  }
  // After fit_encode (and decode): the same tokens again, now with no fit.
  double steady_encode() {
    const double s = append_all(caches_, /*next=*/true);
    best_steady_ = std::min(best_steady_, s);
    return s;
  }
  double best_fit() const { return best_fit_; }
  double best_decode() const { return best_dec_; }
  double best_steady() const { return best_steady_; }

  // Caches holding the dump once (for the error figures).
  std::vector<std::unique_ptr<KVCache>> one_shot() {
    std::vector<std::unique_ptr<KVCache>> caches(dump_.layers.size());
    make_caches(caches);
    append_all(caches);
    return caches;
  }

 private:
  void make_caches(std::vector<std::unique_ptr<KVCache>>& caches) {
    for (size_t i = 0; i < caches.size(); ++i) {
      config_.layer = int(i);
      caches[i].reset();  // the old set's memory goes before the new one's
      caches[i] = make_cache(method_, config_, settings_);
    }
  }
  // next: the steady pass, whose keys are those of positions T..2T-1.
  double append_all(std::vector<std::unique_ptr<KVCache>>& caches, bool next = false) {
    const int n_layers = int(caches.size());
    const auto t0 = Clock::now();
    FirstException failure;
#pragma omp parallel for num_threads(threads_) schedule(dynamic)
    for (int i = 0; i < n_layers; ++i)
      failure.capture([&] {
        const Layer& layer = dump_.layers[size_t(i)];
        caches[size_t(i)]->append((next ? layer.next_key : layer.key).view(), layer.value.view());
      });
    failure.rethrow();
    return seconds_since(t0);
  }

  const Dump& dump_;
  std::string method_;
  Settings settings_;
  int threads_;
  CacheConfig config_;
  std::vector<std::unique_ptr<KVCache>> caches_;
  double best_fit_ = 1e300, best_dec_ = 1e300, best_steady_ = 1e300;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The quality figures of a cache method (the speed fields come from the
// timing loop): errors per layer and head, and the reverse water-filling
// bound at the MSE each head achieved (from the PCA eigenvalues of the
// original data).
nlohmann::json cache_method_result(const Dump& dump, CacheRunner& runner, bool with_bound) {
  const std::string& method = runner.method();
  const std::vector<std::unique_ptr<KVCache>> caches = runner.one_shot();
  const int n_layers = int(dump.layers.size());
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
  j["resident_bytes"] = total.resident_bytes;
  j["shared_bytes"] = total.shared_bytes();
  j["resident_ratio"] = total.resident_ratio();
  j["rel_mse_key"] = ref_k > 0 ? err_k / ref_k : 0.0;
  j["rel_mse_value"] = ref_v > 0 ? err_v / ref_v : 0.0;
  j["bits_per_element"] = 8.0 * double(total.compressed_bytes()) / elements;
  j["encode_mb_per_s"] = dump.f16_bytes() / runner.best_steady() / 1e6;
  j["fit_encode_mb_per_s"] = dump.f16_bytes() / runner.best_fit() / 1e6;
  j["decode_mb_per_s"] = dump.f16_bytes() / runner.best_decode() / 1e6;
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
  for (const auto& [k, v] : runner.settings()) set[k] = v;
  j["settings"] = set;
  return j;
}

// Same-run ratios of one method against zstd: per repeat, each of the
// method's timed passes has a zstd pass of the same direction right beside
// it, and the ratio of that pair (method MB/s / zstd MB/s = zstd seconds /
// method seconds) is one sample. The median over repeats is what the
// machine's drift (other processes, frequency) disturbs least: a slow
// phase hits both sides of a pair, where best-of figures taken phases apart
// do not.
struct PairedRatios {
  std::vector<double> encode, decode;
};

// Runs a pair of timed passes (method's and zstd's) in an order that
// alternates with the repeat, so that neither side is always the one right
// after the other's cache-polluting pass. Returns zstd seconds / method seconds.
template <class A, class B>
double timed_pair(int repeat, A&& method_pass, B&& zstd_pass) {
  double m, z;
  if (repeat % 2 == 0) {
    z = zstd_pass();
    m = method_pass();
  } else {
    m = method_pass();
    z = zstd_pass();
  }
  return z / m;
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
    int repeats = 11;
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
  cmd->add_option("--repeats", opt->repeats,
                  "timing repeats; every *_mb_per_s is the best (fastest) repeat, every *_vs_zstd the median over "
                  "repeats of the same-repeat ratio")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  cmd->add_option("--zstd-level", opt->zstd_level, "zstd level of the lossless baseline")->capture_default_str();
  cmd->add_flag("--no-bound", opt->no_bound, "skip the reverse water-filling bound (faster)");
  cmd->footer(
      "Speed fields (MB/s of the dump as f16, wall clock, single thread unless --threads):\n"
      "  encode_mb_per_s      steady-state encode: the dump appended again to caches that hold it (no fit), its\n"
      "                       keys rotated by T positions more (RoPE, rope_theta 10000), as the model gives them there\n"
      "  fit_encode_mb_per_s  fresh caches: fit + encode of the dump\n"
      "  decode_mb_per_s      for_each_block over caches holding the dump once\n"
      "With zstd among the methods the methods are timed interleaved: in every repeat each method's decode and\n"
      "steady encode run right beside a zstd decode / encode (the order alternating with the repeat), and each\n"
      "other method gets\n"
      "  encode_vs_zstd       median over repeats of (method encode MB/s / zstd encode MB/s) of the same repeat\n"
      "  decode_vs_zstd       the same for decode\n"
      "These ratios are what machine-speed drift disturbs least; the best-of MB/s fields are kept as they were.");
  cmd->callback([opt] {
    Dump dump = load_dump(opt->kv);
    for (Layer& layer : dump.layers) layer.next_key = next_keys(layer.key, dump.tokens, CacheConfig{}.rope_theta);
    std::vector<std::string> methods;
    std::stringstream ss(opt->methods);
    for (std::string m; std::getline(ss, m, ',');)
      if (!m.empty()) methods.push_back(m);
    // Validate every --set up front (a typo fails before minutes of work).
    check_set_methods(opt->sets, methods);
    std::unique_ptr<ZstdRunner> zstd;
    std::vector<std::unique_ptr<CacheRunner>> runners;  // the non-zstd methods, in the order given
    for (const std::string& m : methods) {
      if (m == "zstd") {
        if (!zstd) zstd = std::make_unique<ZstdRunner>(dump, opt->zstd_level);
      } else {
        runners.push_back(std::make_unique<CacheRunner>(dump, m, settings_for_method(opt->sets, m), opt->threads));
      }
    }
    if (!opt->json)
      std::fprintf(stderr, "bench: timing %s (%d repeats%s) ...\n", opt->methods.c_str(), opt->repeats,
                   zstd && !runners.empty() ? ", interleaved with zstd" : "");
    std::vector<PairedRatios> ratios(runners.size());
    for (int r = 0; r < opt->repeats; ++r) {
      for (size_t k = 0; k < runners.size(); ++k) {
        CacheRunner& run = *runners[k];
        run.fit_encode();
        if (zstd) {
          ratios[k].decode.push_back(timed_pair(r, [&] { return run.decode(); }, [&] { return zstd->decode(); }));
          ratios[k].encode.push_back(
              timed_pair(r, [&] { return run.steady_encode(); }, [&] { return zstd->encode(); }));
        } else {
          run.decode();
          run.steady_encode();
        }
      }
      if (zstd && runners.empty()) {
        zstd->encode();
        zstd->decode();
      }
    }
    nlohmann::json results = nlohmann::json::array();
    size_t next_runner = 0;
    for (const std::string& m : methods) {
      if (m == "zstd") {
        results.push_back(zstd->result());
        continue;
      }
      const size_t k = next_runner++;
      if (!opt->json) std::fprintf(stderr, "bench: %s quality ...\n", m.c_str());
      nlohmann::json j = cache_method_result(dump, *runners[k], !opt->no_bound);
      if (zstd) {
        j["encode_vs_zstd"] = median(ratios[k].encode);
        j["decode_vs_zstd"] = median(ratios[k].decode);
      }
      results.push_back(std::move(j));
    }
    if (opt->json) {
      std::printf("%s\n", results.dump(2).c_str());
      return;
    }
    fmt::print("KV dump {}: {} layers x [B={}, H={}, T={}, D={}], {:.2f} MB as f16\n", opt->kv, dump.layers.size(),
               dump.batch, dump.heads, dump.tokens, dump.dim, dump.f16_bytes() / 1e6);
    fmt::print("{:<8} {:>7} {:>8} {:>11} {:>11} {:>9} {:>9} {:>10} {:>10} {:>9} {:>9}\n", "method", "ratio",
               "bits/el", "rel_mse_K", "rel_mse_V", "attn_err", "bound", "enc MB/s", "dec MB/s", "enc/zstd",
               "dec/zstd");
    for (const auto& r : results) {
      auto num = [&](const char* key) { return r.contains(key) ? fmt::format("{:.4g}", r[key].get<double>()) : std::string("-"); };
      auto ratio = [&](const char* key) { return r.contains(key) ? fmt::format("{:.3f}", r[key].get<double>()) : std::string("-"); };
      fmt::print("{:<8} {:>7.2f} {:>8.3f} {:>11} {:>11} {:>9} {:>9} {:>10.1f} {:>10.1f} {:>9} {:>9}\n",
                 r["method"].get<std::string>(), r["compression_ratio"].get<double>(),
                 r["bits_per_element"].get<double>(), num("rel_mse_key"), num("rel_mse_value"), num("attn_rel_err"),
                 num("rd_bound_bits_per_element"), r["encode_mb_per_s"].get<double>(),
                 r["decode_mb_per_s"].get<double>(), ratio("encode_vs_zstd"), ratio("decode_vs_zstd"));
    }
  });
}

}  // namespace kvcodec::cli

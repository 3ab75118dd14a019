#include "cache/dump_codec.hpp"

#include <exception>
#include <mutex>

#include "cache/saved_meta.hpp"
#include "cache/settings.hpp"
#include "core/first_exception.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec::dump {

namespace {

constexpr const char* kFormatName = "kvcodec-dump";
// Bounds on what a dump's metadata may claim before anything is allocated.
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxDim = int64_t(1) << 31;

std::string layer_name(int i, const char* what) { return "layers." + std::to_string(i) + "." + what; }
std::string section_name(int i) { return "layer." + std::to_string(i); }

}  // namespace

uint64_t KvDump::f16_bytes() const { return uint64_t(n_layers()) * 2u * uint64_t(numel(shape)) * 2u; }

KvDump read_kv_dump(const std::string& path) {
  KvDump dump;
  dump.file = SafetensorsFile::open(path);
  for (int i = 0;; ++i) {
    const std::string k = layer_name(i, "key"), v = layer_name(i, "value");
    const bool has_k = dump.file.contains(k), has_v = dump.file.contains(v);
    if (!has_k && !has_v) break;
    if (!has_k || !has_v)
      throw Error(ErrorCode::kNotFound, path + ": layer " + std::to_string(i) + " has " + (has_k ? k : v) +
                                            " but no " + (has_k ? v : k));
    const TensorView kv = dump.file.view4(k), vv = dump.file.view4(v);
    if (kv.shape != vv.shape)
      throw Error(ErrorCode::kShapeMismatch,
                  path + ": " + k + " " + shape_string(kv.shape) + " vs " + v + " " + shape_string(vv.shape));
    if (i == 0) {
      dump.shape = kv.shape;
      dump.dtype = kv.dtype;
    } else if (kv.shape != dump.shape) {
      throw Error(ErrorCode::kShapeMismatch, path + ": " + k + " " + shape_string(kv.shape) + " differs from layer 0's " +
                                                 shape_string(dump.shape));
    }
    if (kv.dtype != dump.dtype || vv.dtype != dump.dtype)
      throw Error(ErrorCode::kFormat, path + ": layer " + std::to_string(i) + " is " + dtype_name(kv.dtype) + "/" +
                                          dtype_name(vv.dtype) + ", layer 0 is " + dtype_name(dump.dtype) +
                                          " (one dtype per dump)");
    dump.keys.push_back(kv);
    dump.values.push_back(vv);
  }
  if (dump.keys.empty())
    throw Error(ErrorCode::kNotFound, path + ": no layers.0.key / layers.0.value tensors (not a KV dump)");
  if (numel(dump.shape) == 0)
    throw Error(ErrorCode::kShapeMismatch, path + ": empty KV tensors " + shape_string(dump.shape));
  return dump;
}

std::vector<uint8_t> compress_dump(const KvDump& dump, const CompressOptions& options) {
  const int L = dump.n_layers();
  CacheConfig config;
  config.n_layers = L;
  config.n_kv_heads = int(dump.shape[1]);
  config.head_dim = int(dump.shape[3]);
  config.rope_theta = options.rope_theta;
  // Made up front, on this thread: a bad method or setting fails before any work.
  std::vector<std::unique_ptr<KVCache>> caches(static_cast<size_t>(L));
  for (int i = 0; i < L; ++i) {
    config.layer = i;
    caches[size_t(i)] = make_cache(options.method, config, options.settings);
  }
  std::vector<std::vector<uint8_t>> saved(static_cast<size_t>(L));
  FirstException failure;
  std::mutex mutex;
  int done = 0;
#pragma omp parallel for num_threads(options.threads > 0 ? options.threads : 1) schedule(dynamic)
  for (int i = 0; i < L; ++i) {
    failure.capture([&] {
      caches[size_t(i)]->append(dump.keys[size_t(i)], dump.values[size_t(i)]);
      saved[size_t(i)] = caches[size_t(i)]->save();
      caches[size_t(i)].reset();  // one layer's reconstruction buffers at a time
    });
    failure.capture([&] {
      std::lock_guard<std::mutex> lock(mutex);
      ++done;
      if (options.progress) options.progress(done, L);
    });
  }
  failure.rethrow();

  ContainerWriter out(ContainerKind::kDump);
  out.set_meta("format", kFormatName);
  out.set_meta("method", options.method);
  out.set_meta("settings", encode_settings(options.settings));
  out.set_meta("n_layers", std::to_string(L));
  out.set_meta("batch", std::to_string(dump.shape[0]));
  out.set_meta("heads", std::to_string(dump.shape[1]));
  out.set_meta("tokens", std::to_string(dump.shape[2]));
  out.set_meta("head_dim", std::to_string(dump.shape[3]));
  out.set_meta("dtype", dtype_name(dump.dtype));
  for (int i = 0; i < L; ++i) out.add_section(section_name(i), std::move(saved[size_t(i)]));
  return out.finish();
}

CacheStats CompressedDump::stats() const {
  CacheStats total;
  for (const auto& layer : layers) total += layer->stats();
  return total;
}

CompressedDump open_compressed_dump(const ContainerReader& c) {
  c.expect_kind(ContainerKind::kDump);
  const std::string& format = c.meta_or_throw("format");
  if (format != kFormatName)
    throw Error(ErrorCode::kFormat, c.label() + ": dump format '" + format + "', expected '" + kFormatName + "'");
  CompressedDump d;
  d.method = c.meta_or_throw("method");
  const int64_t L = cache_impl::meta_int(c, "n_layers", 1, kMaxLayers);
  d.shape = {cache_impl::meta_int(c, "batch", 1, kMaxDim), cache_impl::meta_int(c, "heads", 1, kMaxDim),
             cache_impl::meta_int(c, "tokens", 1, kMaxDim), cache_impl::meta_int(c, "head_dim", 1, kMaxDim)};
  d.dtype = parse_dtype(c.meta_or_throw("dtype"));
  if (c.section_names().size() != size_t(L))
    throw Error(ErrorCode::kFormat, c.label() + ": " + std::to_string(c.section_names().size()) +
                                        " sections for n_layers = " + std::to_string(L));
  for (int i = 0; i < int(L); ++i) {
    const std::string name = section_name(i);
    const std::span<const uint8_t> bytes = c.section(name);
    std::unique_ptr<KVCache> cache;
    try {
      cache = load_cache(bytes.data(), bytes.size());
    } catch (const Error& e) {
      throw Error(e.code(), c.label() + ": section " + name + ": " + e.what());
    }
    const CacheConfig& cfg = cache->config();
    if (cache->method() != d.method || cfg.layer != i || cfg.n_kv_heads != d.shape[1] ||
        cfg.head_dim != d.shape[3] || cache->offset() != d.shape[2])
      throw Error(ErrorCode::kFormat,
                  c.label() + ": section " + name + " holds a " + cache->method() + " cache of layer " +
                      std::to_string(cfg.layer) + ", " + std::to_string(cfg.n_kv_heads) + " heads x " +
                      std::to_string(cfg.head_dim) + ", " + std::to_string(cache->offset()) +
                      " tokens; the dump promises " + d.method + ", layer " + std::to_string(i) + ", shape " +
                      shape_string(d.shape));
    d.layers.push_back(std::move(cache));
  }
  return d;
}

SafetensorsWriter decompress_dump(const CompressedDump& d, DType dtype) {
  SafetensorsWriter out;
  out.add_metadata("method", d.method);
  for (size_t i = 0; i < d.layers.size(); ++i) {
    const KVPair kv = d.layers[i]->fetch(dtype);
    if (kv.keys.shape()[0] != d.shape[0])
      throw Error(ErrorCode::kFormat, "layer " + std::to_string(i) + " reconstructs batch " +
                                          std::to_string(kv.keys.shape()[0]) + ", the dump promises " +
                                          std::to_string(d.shape[0]));
    out.add(layer_name(int(i), "key"), kv.keys.view());
    out.add(layer_name(int(i), "value"), kv.values.view());
  }
  return out;
}

}  // namespace kvcodec::dump

// The C API's caches and calibrations: thin handles over kvcodec::KVCache
// (include/kvcodec/cache.hpp) and the shared calibrated-kvtc parameters.
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <vector>

#include "cache/kvtc_calibrated.hpp"
#include "capi/cache_handle.hpp"
#include "capi/calibration_handle.hpp"
#include "capi/guard.hpp"
#include "capi/settings_text.hpp"
#include "kvcodec/cache.hpp"

using kvcodec::DType;
using kvcodec::Error;
using kvcodec::ErrorCode;
using kvcodec::TensorView;
using kvcodec::capi::guarded;
using kvcodec::capi::require;

namespace {

// Thrown from inside a block visit to stop it early (caught right outside).
struct StopVisit {};

DType checked_dtype(int dtype, const char* name) {
  if (dtype < KVCODEC_F32 || dtype > KVCODEC_BF16)
    throw Error(ErrorCode::kInvalidArgument, std::string(name) + " dtype " + std::to_string(dtype) +
                                                 " is not KVCODEC_F32 (0), KVCODEC_F16 (1) or KVCODEC_BF16 (2)");
  return static_cast<DType>(dtype);
}

int32_t c_dtype(DType dtype) { return static_cast<int32_t>(dtype); }

// A caller's tensor as a view, after checking what can be checked without
// knowing the buffer's size: dtype, non-negative shape and strides whose
// largest offset fits in int64, data present when there are elements.
TensorView view_of(const kvcodec_tensor* t, const char* name) {
  require(t, name);
  TensorView v;
  v.dtype = checked_dtype(t->dtype, name);
  v.data = t->data;
  bool all_zero = true;
  for (int i = 0; i < 4; ++i) {
    v.shape[size_t(i)] = t->shape[i];
    v.strides[size_t(i)] = t->strides[i];
    all_zero = all_zero && t->strides[i] == 0;
    if (t->shape[i] < 0 || t->strides[i] < 0)
      throw Error(ErrorCode::kInvalidArgument, std::string(name) + " has shape " + kvcodec::shape_string(v.shape) +
                                                   " and strides " + kvcodec::shape_string(v.strides) +
                                                   ": both must be >= 0");
  }
  if (all_zero) v.strides = kvcodec::contiguous_strides(v.shape);
  int64_t last = 0;
  for (size_t i = 0; i < 4; ++i) {
    int64_t span = 0;
    if (v.shape[i] > 0 && (__builtin_mul_overflow(v.shape[i] - 1, v.strides[i], &span) ||
                           __builtin_add_overflow(last, span, &last)))
      throw Error(ErrorCode::kInvalidArgument, std::string(name) + " shape " + kvcodec::shape_string(v.shape) +
                                                   " with strides " + kvcodec::shape_string(v.strides) +
                                                   " overflows 64-bit offsets");
  }
  if (kvcodec::numel(v.shape) > 0 && v.data == nullptr)
    throw Error(ErrorCode::kInvalidArgument, std::string(name) + " data is NULL for shape " +
                                                 kvcodec::shape_string(v.shape));
  return v;
}

kvcodec_tensor tensor_of(const TensorView& v) {
  kvcodec_tensor t;
  t.data = v.data;
  t.dtype = c_dtype(v.dtype);
  for (size_t i = 0; i < 4; ++i) {
    t.shape[i] = v.shape[i];
    t.strides[i] = v.strides[i];
  }
  return t;
}

int64_t batch_of(const kvcodec_cache* h) {
  if (h->batch >= 0) return h->batch;
  if (h->cache->offset() == 0) return 0;
  int64_t batch = 0;
  try {
    h->cache->for_each_block([&](int64_t, const TensorView& k, const TensorView&) {
      batch = k.shape[0];
      throw StopVisit{};
    });
  } catch (const StopVisit&) {
  }
  h->batch = batch;
  return batch;
}

kvcodec::Shape4 history_shape(const kvcodec_cache* h) {
  const kvcodec::CacheConfig& c = h->cache->config();
  return {batch_of(h), c.n_kv_heads, h->cache->offset(), c.head_dim};
}

// Memory held by this cache, and apart from it the bytes it shares with
// other caches (a calibration), as CacheStats reports them.
void copy_resident(const kvcodec::CacheStats& s, kvcodec_stats* out) {
  out->resident_bytes = s.resident_bytes;
  out->shared_bytes = s.shared_bytes();
}

}  // namespace

extern "C" {

KVCODEC_API size_t kvcodec_dtype_size(int dtype) {
  return dtype >= KVCODEC_F32 && dtype <= KVCODEC_BF16 ? kvcodec::dtype_size(static_cast<DType>(dtype)) : 0;
}

KVCODEC_API const char* kvcodec_method_name(size_t i) {
  // Names are copied once; list_methods() builds them afresh on every call.
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& m : kvcodec::list_methods()) out.push_back(m.name);
    return out;
  }();
  return i < names.size() ? names[i].c_str() : nullptr;
}

// --- calibrations -------------------------------------------------------------

KVCODEC_API kvcodec_status kvcodec_calibration_load(const char* path, kvcodec_calibration** out) {
  return guarded("kvcodec_calibration_load", [&] {
    require(out, "out");
    *out = nullptr;
    require(path, "path");
    std::error_code ec;
    std::string absolute = std::filesystem::absolute(path, ec).lexically_normal().string();
    if (ec) absolute = path;
    auto h = std::make_unique<kvcodec_calibration>();
    h->path = absolute;
    h->params = kvcodec::KvtcCalibration::load_shared(absolute);
    *out = h.release();
  });
}

KVCODEC_API void kvcodec_calibration_free(kvcodec_calibration* calibration) { delete calibration; }

KVCODEC_API kvcodec_status kvcodec_calibration_info(const kvcodec_calibration* calibration, int32_t* n_layers,
                                                    int32_t* n_kv_heads, int32_t* head_dim, double* rope_theta,
                                                    uint64_t* params_bytes) {
  return guarded("kvcodec_calibration_info", [&] {
    require(calibration, "calibration");
    const kvcodec::KvtcCalibration& c = *calibration->params;
    if (n_layers) *n_layers = c.n_layers;
    if (n_kv_heads) *n_kv_heads = c.n_kv_heads;
    if (head_dim) *head_dim = c.head_dim;
    if (rope_theta) *rope_theta = c.rope_theta;
    if (params_bytes) *params_bytes = c.params_bytes();
  });
}

// --- making, loading, freeing -------------------------------------------------

KVCODEC_API kvcodec_status kvcodec_cache_create(const char* method, const char* settings,
                                                const kvcodec_cache_config* config,
                                                const kvcodec_calibration* calibration, kvcodec_cache** out) {
  return guarded("kvcodec_cache_create", [&] {
    require(out, "out");
    *out = nullptr;
    require(method, "method");
    require(config, "config");
    kvcodec::Settings s = kvcodec::capi::parse_settings_text(settings ? settings : "");
    if (calibration) {
      if (std::string(method) != "kvtc")
        throw Error(ErrorCode::kInvalidArgument,
                    std::string("a calibration is for method kvtc, not '") + method + "'");
      const auto it = s.find("calibration");
      if (it != s.end() && it->second != calibration->path)
        kvcodec::throw_config_error("kvtc.calibration", it->second,
                                    "unset, or the calibration handle's file " + calibration->path);
      s["calibration"] = calibration->path;
    }
    kvcodec::CacheConfig c;
    c.layer = config->layer;
    c.n_layers = config->n_layers;
    c.n_kv_heads = config->n_kv_heads;
    c.head_dim = config->head_dim;
    c.rope_theta = config->rope_theta;
    auto h = std::make_unique<kvcodec_cache>();
    h->cache = kvcodec::make_cache(method, c, s);
    h->method = h->cache->method();
    h->batch = 0;
    *out = h.release();
  });
}

KVCODEC_API kvcodec_status kvcodec_cache_load(const void* data, size_t size, kvcodec_cache** out) {
  return guarded("kvcodec_cache_load", [&] {
    require(out, "out");
    *out = nullptr;
    require(data, "data");
    auto h = std::make_unique<kvcodec_cache>();
    h->cache = kvcodec::load_cache(static_cast<const uint8_t*>(data), size);
    h->method = h->cache->method();
    *out = h.release();
  });
}

KVCODEC_API void kvcodec_cache_free(kvcodec_cache* cache) { delete cache; }

KVCODEC_API const char* kvcodec_cache_method(const kvcodec_cache* cache) {
  return cache ? cache->method.c_str() : "";
}

KVCODEC_API kvcodec_status kvcodec_cache_get_config(const kvcodec_cache* cache, kvcodec_cache_config* out) {
  return guarded("kvcodec_cache_get_config", [&] {
    require(cache, "cache");
    require(out, "out");
    const kvcodec::CacheConfig& c = cache->cache->config();
    out->layer = c.layer;
    out->n_layers = c.n_layers;
    out->n_kv_heads = c.n_kv_heads;
    out->head_dim = c.head_dim;
    out->rope_theta = c.rope_theta;
  });
}

// --- appending and reading ----------------------------------------------------

KVCODEC_API kvcodec_status kvcodec_cache_append(kvcodec_cache* cache, const kvcodec_tensor* keys,
                                                const kvcodec_tensor* values) {
  return guarded("kvcodec_cache_append", [&] {
    require(cache, "cache");
    const TensorView k = view_of(keys, "keys");
    const TensorView v = view_of(values, "values");
    if (k.dtype != v.dtype)
      throw Error(ErrorCode::kInvalidArgument, std::string("keys are ") + kvcodec::dtype_name(k.dtype) +
                                                   " but values are " + kvcodec::dtype_name(v.dtype));
    cache->changed();
    cache->cache->append(k, v);
    if (k.shape[0] > 0) cache->batch = k.shape[0];
  });
}

KVCODEC_API kvcodec_status kvcodec_cache_offset(const kvcodec_cache* cache, int64_t* out) {
  return guarded("kvcodec_cache_offset", [&] {
    require(cache, "cache");
    require(out, "out");
    *out = cache->cache->offset();
  });
}

KVCODEC_API kvcodec_status kvcodec_cache_shape(const kvcodec_cache* cache, int64_t shape[4]) {
  return guarded("kvcodec_cache_shape", [&] {
    require(cache, "cache");
    require(shape, "shape");
    const kvcodec::Shape4 s = history_shape(cache);
    for (size_t i = 0; i < 4; ++i) shape[i] = s[i];
  });
}

KVCODEC_API kvcodec_status kvcodec_cache_fetch_size(const kvcodec_cache* cache, int dtype, size_t* bytes) {
  return guarded("kvcodec_cache_fetch_size", [&] {
    require(cache, "cache");
    require(bytes, "bytes");
    const DType d = checked_dtype(dtype, "fetch");
    *bytes = size_t(kvcodec::numel(history_shape(cache))) * kvcodec::dtype_size(d);
  });
}

KVCODEC_API kvcodec_status kvcodec_cache_fetch(kvcodec_cache* cache, int dtype, void* keys, void* values,
                                               size_t capacity) {
  return guarded("kvcodec_cache_fetch", [&] {
    require(cache, "cache");
    const DType d = checked_dtype(dtype, "fetch");
    const kvcodec::Shape4 s = history_shape(cache);
    const size_t elem = kvcodec::dtype_size(d);
    const size_t need = size_t(kvcodec::numel(s)) * elem;
    if (capacity < need)
      throw kvcodec::capi::CapiError(KVCODEC_ERROR_BUFFER_TOO_SMALL,
                                     "capacity " + std::to_string(capacity) + " bytes, the history " +
                                         kvcodec::shape_string(s) + " in " + kvcodec::dtype_name(d) + " needs " +
                                         std::to_string(need));
    if (need == 0) return;
    require(keys, "keys");
    require(values, "values");
    // Block by block as KVCache::fetch() does (the same conversion, so the
    // same bits), but straight into the caller's buffers: no second copy of
    // the whole history.
    const int64_t rows = s[0] * s[1], total = s[2];
    const size_t row_bytes = size_t(s[3]) * elem;
    std::vector<uint8_t> kb, vb;
    int64_t token = 0;
    cache->cache->for_each_block([&](int64_t first, const TensorView& k, const TensorView& v) {
      const int64_t n = k.shape[2];
      if (first != token || token + n > total || k.shape[0] != s[0])
        throw Error(ErrorCode::kInternal, "cache visited a block at token " + std::to_string(first) + " of " +
                                              kvcodec::shape_string(k.shape) + ", expected token " +
                                              std::to_string(token) + " of " + kvcodec::shape_string(s));
      kb.resize(size_t(kvcodec::numel(k.shape)) * elem);
      vb.resize(kb.size());
      kvcodec::copy_to_contiguous(k, kb.data(), d);
      kvcodec::copy_to_contiguous(v, vb.data(), d);
      for (int64_t r = 0; r < rows; ++r) {
        const size_t dst = size_t(r * total + token) * row_bytes, src = size_t(r * n) * row_bytes;
        std::memcpy(static_cast<uint8_t*>(keys) + dst, kb.data() + src, size_t(n) * row_bytes);
        std::memcpy(static_cast<uint8_t*>(values) + dst, vb.data() + src, size_t(n) * row_bytes);
      }
      token += n;
    });
    if (token != total)
      throw Error(ErrorCode::kInternal, "cache visited " + std::to_string(token) + " tokens but holds " +
                                            std::to_string(total));
  });
}

KVCODEC_API kvcodec_status kvcodec_cache_visit(kvcodec_cache* cache, kvcodec_block_visitor visit, void* user) {
  return guarded("kvcodec_cache_visit", [&] {
    require(cache, "cache");
    require(reinterpret_cast<const void*>(visit), "visit");
    try {
      cache->cache->for_each_block([&](int64_t first, const TensorView& k, const TensorView& v) {
        const kvcodec_tensor kt = tensor_of(k), vt = tensor_of(v);
        if (visit(user, first, &kt, &vt) != 0) throw StopVisit{};
      });
    } catch (const StopVisit&) {
    }
  });
}

// --- trim, save ---------------------------------------------------------------

KVCODEC_API kvcodec_status kvcodec_cache_is_trimmable(const kvcodec_cache* cache, int* out) {
  return guarded("kvcodec_cache_is_trimmable", [&] {
    require(cache, "cache");
    require(out, "out");
    *out = cache->cache->is_trimmable() ? 1 : 0;
  });
}

KVCODEC_API kvcodec_status kvcodec_cache_trim(kvcodec_cache* cache, int64_t n, int64_t* dropped) {
  return guarded("kvcodec_cache_trim", [&] {
    require(cache, "cache");
    if (n < 0) throw Error(ErrorCode::kInvalidArgument, "n = " + std::to_string(n) + " is negative");
    if (!cache->cache->is_trimmable())
      throw Error(ErrorCode::kUnsupported, "a " + cache->method + " cache is not trimmable");
    cache->changed();
    const int64_t m = cache->cache->trim(n);
    if (dropped) *dropped = m;
  });
}

KVCODEC_API kvcodec_status kvcodec_cache_save_size(kvcodec_cache* cache, size_t* bytes) {
  return guarded("kvcodec_cache_save_size", [&] {
    require(cache, "cache");
    require(bytes, "bytes");
    if (!cache->saved_current) {
      cache->saved = cache->cache->save();
      cache->saved_current = true;
    }
    *bytes = cache->saved.size();
  });
}

KVCODEC_API kvcodec_status kvcodec_cache_save(kvcodec_cache* cache, void* dst, size_t capacity, size_t* written) {
  return guarded("kvcodec_cache_save", [&] {
    require(cache, "cache");
    if (!cache->saved_current) {
      cache->saved = cache->cache->save();
      cache->saved_current = true;
    }
    const size_t n = cache->saved.size();
    if (written) *written = n;
    if (capacity < n)
      throw kvcodec::capi::CapiError(KVCODEC_ERROR_BUFFER_TOO_SMALL, "capacity " + std::to_string(capacity) +
                                                                         " bytes, the saved cache takes " +
                                                                         std::to_string(n));
    require(dst, "dst");
    std::memcpy(dst, cache->saved.data(), n);
    cache->changed();  // the copy is the caller's now; keep none
  });
}

// --- telemetry ----------------------------------------------------------------

KVCODEC_API kvcodec_status kvcodec_cache_stats(kvcodec_cache* cache, kvcodec_stats* out) {
  return guarded("kvcodec_cache_stats", [&] {
    require(cache, "cache");
    require(out, "out");
    const kvcodec::CacheStats s = cache->cache->stats();
    *out = kvcodec_stats{};
    out->tokens = s.tokens;
    out->compressed_key_bytes = s.compressed_key_bytes;
    out->compressed_value_bytes = s.compressed_value_bytes;
    out->fp16_key_bytes = s.fp16_key_bytes;
    out->fp16_value_bytes = s.fp16_value_bytes;
    copy_resident(s, out);
    out->compression_ratio = s.compression_ratio();
  });
}

KVCODEC_API kvcodec_status kvcodec_cache_extras(kvcodec_cache* cache, kvcodec_extra_visitor visit, void* user) {
  return guarded("kvcodec_cache_extras", [&] {
    require(cache, "cache");
    require(reinterpret_cast<const void*>(visit), "visit");
    for (const auto& [name, value] : cache->cache->stats().extras)
      if (visit(user, name.c_str(), value) != 0) break;
  });
}

}  // extern "C"

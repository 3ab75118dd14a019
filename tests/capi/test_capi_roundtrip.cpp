// The C API against the C++ library it wraps: for every method, the same
// input gives the same reconstructions, saved bytes, stats and trims; a
// saved cache loads back exactly; the visitor sees the history in order;
// and caches fed the KV dump through the C API save the bytes of
// `kvcodec compress`'s per-layer sections.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <thread>

#include "capi_test_util.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/safetensors.hpp"

using namespace capi_test;

namespace {

struct MethodCase {
  std::string method;
  std::string settings;  // C API form
  kvcodec::Settings cpp;  // the same for make_cache()
};

std::vector<MethodCase> method_cases() {
  return {{"fp16", "", {}},
          {"int8", "group_size=32", {{"group_size", "32"}}},
          {"int4", "", {}},
          {"kivi2", "residual=64;group_size=32", {{"residual", "64"}, {"group_size", "32"}}},
          {"palu", "hi_fraction=0.5", {{"hi_fraction", "0.5"}}},
          {"kvtc", "mode=local;block=64", {{"mode", "local"}, {"block", "64"}}}};
}

std::map<std::string, double> extras_of(kvcodec_cache* c) {
  std::map<std::string, double> out;
  EXPECT_EQ(kvcodec_cache_extras(
                c,
                [](void* user, const char* name, double value) {
                  (*static_cast<std::map<std::string, double>*>(user))[name] = value;
                  return 0;
                },
                &out),
            KVCODEC_OK);
  return out;
}

// Memory held: a cache built by the same appends as ref holds what ref
// holds; a loaded one holds its vectors at their exact size (no growth
// slack), so there only the bounds hold: at least the stored bytes, at most
// what ref holds, and the same shared bytes.
void expect_resident(const kvcodec_stats& s, const kvcodec::CacheStats& r, bool same_appends) {
  if (same_appends) {
    EXPECT_EQ(s.resident_bytes, r.resident_bytes);
  } else {
    EXPECT_GE(s.resident_bytes, s.compressed_key_bytes + s.compressed_value_bytes);
    EXPECT_LE(s.resident_bytes, r.resident_bytes);
  }
  EXPECT_EQ(s.shared_bytes, r.shared_bytes());
}

void expect_stats_equal(kvcodec_cache* c, const kvcodec::KVCache& ref, bool same_appends = true) {
  kvcodec_stats s{};
  ASSERT_EQ(kvcodec_cache_stats(c, &s), KVCODEC_OK) << kvcodec_last_error();
  const kvcodec::CacheStats r = ref.stats();
  EXPECT_EQ(s.tokens, r.tokens);
  EXPECT_EQ(s.compressed_key_bytes, r.compressed_key_bytes);
  EXPECT_EQ(s.compressed_value_bytes, r.compressed_value_bytes);
  EXPECT_EQ(s.fp16_key_bytes, r.fp16_key_bytes);
  EXPECT_EQ(s.fp16_value_bytes, r.fp16_value_bytes);
  EXPECT_DOUBLE_EQ(s.compression_ratio, r.compression_ratio());
  expect_resident(s, r, same_appends);
  EXPECT_EQ(extras_of(c), r.extras);
}

// fetch() in every dtype gives the C++ fetch()'s bytes.
void expect_fetch_equal(kvcodec_cache* c, const kvcodec::KVCache& ref) {
  for (int dtype : {KVCODEC_F32, KVCODEC_F16, KVCODEC_BF16}) {
    const kvcodec::KVPair r = ref.fetch(static_cast<kvcodec::DType>(dtype));
    size_t n = 0;
    ASSERT_EQ(kvcodec_cache_fetch_size(c, dtype, &n), KVCODEC_OK) << kvcodec_last_error();
    ASSERT_EQ(n, r.keys.nbytes());
    std::vector<uint8_t> k(n), v(n);
    ASSERT_EQ(kvcodec_cache_fetch(c, dtype, k.data(), v.data(), n), KVCODEC_OK) << kvcodec_last_error();
    EXPECT_EQ(0, std::memcmp(k.data(), r.keys.data(), n)) << "keys, dtype " << dtype;
    EXPECT_EQ(0, std::memcmp(v.data(), r.values.data(), n)) << "values, dtype " << dtype;
    int64_t shape[4];
    ASSERT_EQ(kvcodec_cache_shape(c, shape), KVCODEC_OK);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(shape[i], r.keys.shape()[i]);
  }
}

// Appends the same tokens to a C cache (as [B, S, H, D] memory: strided
// views) and a C++ cache (contiguous), in two chunks, in dtype.
void feed_both(kvcodec_cache* c, kvcodec::KVCache& ref, const std::vector<float>& k, const std::vector<float>& v,
               int64_t H, int64_t S, int64_t D, kvcodec::DType dtype) {
  const kvcodec::Shape4 shape{1, H, S, D};
  const kvcodec::Tensor kt = kvcodec::Tensor::from_view(kvcodec::TensorView::contiguous(k.data(), kvcodec::DType::kF32, shape), dtype);
  const kvcodec::Tensor vt = kvcodec::Tensor::from_view(kvcodec::TensorView::contiguous(v.data(), kvcodec::DType::kF32, shape), dtype);
  // The same values laid out token-major [1, S, H, D].
  const size_t elem = kvcodec::dtype_size(dtype);
  std::vector<uint8_t> kt_s(kt.nbytes()), vt_s(vt.nbytes());
  for (int64_t h = 0; h < H; ++h)
    for (int64_t s = 0; s < S; ++s) {
      std::memcpy(&kt_s[size_t((s * H + h) * D) * elem], static_cast<const uint8_t*>(kt.data()) + size_t((h * S + s) * D) * elem, size_t(D) * elem);
      std::memcpy(&vt_s[size_t((s * H + h) * D) * elem], static_cast<const uint8_t*>(vt.data()) + size_t((h * S + s) * D) * elem, size_t(D) * elem);
    }
  const int64_t first = S * 2 / 3;
  for (const auto& [begin, count] : {std::pair<int64_t, int64_t>{0, first}, {first, S - first}}) {
    kvcodec_tensor ck{}, cv{};
    ck.dtype = cv.dtype = static_cast<kvcodec_dtype>(dtype);
    ck.data = kt_s.data() + size_t(begin * H * D) * elem;
    cv.data = vt_s.data() + size_t(begin * H * D) * elem;
    const int64_t shp[4] = {1, H, count, D}, str[4] = {S * H * D, D, H * D, 1};
    for (int i = 0; i < 4; ++i) ck.shape[i] = cv.shape[i] = shp[i], ck.strides[i] = cv.strides[i] = str[i];
    KVC_OK(kvcodec_cache_append(c, &ck, &cv));
    ref.append(kt.view().slice_tokens(begin, count), vt.view().slice_tokens(begin, count));
  }
}

kvcodec::CacheConfig cpp_config(const kvcodec_cache_config& c) {
  kvcodec::CacheConfig out;
  out.layer = c.layer;
  out.n_layers = c.n_layers;
  out.n_kv_heads = c.n_kv_heads;
  out.head_dim = c.head_dim;
  out.rope_theta = c.rope_theta;
  return out;
}

void round_trip(const MethodCase& m, kvcodec::DType dtype, const kvcodec_calibration* cal) {
  SCOPED_TRACE(m.method + " " + m.settings + " " + kvcodec::dtype_name(dtype));
  const int64_t H = 2, S = 300, D = 64;
  const kvcodec_cache_config cfg = layer_config(1);
  kvcodec_cache* raw = nullptr;
  KVC_OK(kvcodec_cache_create(m.method.c_str(), m.settings.c_str(), &cfg, cal, &raw));
  CachePtr c(raw);
  EXPECT_EQ(std::string(kvcodec_cache_method(c.get())), m.method);
  auto ref = kvcodec::make_cache(m.method, cpp_config(cfg), m.cpp);
  feed_both(c.get(), *ref, synthetic_kv(H, S, D, 1), synthetic_kv(H, S, D, 2), H, S, D, dtype);
  int64_t offset = 0;
  KVC_OK(kvcodec_cache_offset(c.get(), &offset));
  EXPECT_EQ(offset, S);
  expect_fetch_equal(c.get(), *ref);
  expect_stats_equal(c.get(), *ref);
  const std::vector<uint8_t> saved = saved_bytes(c.get());
  EXPECT_EQ(saved, ref->save());

  kvcodec_cache* loaded_raw = nullptr;
  KVC_OK(kvcodec_cache_load(saved.data(), saved.size(), &loaded_raw));
  CachePtr loaded(loaded_raw);
  expect_fetch_equal(loaded.get(), *ref);
  expect_stats_equal(loaded.get(), *ref, false);
  EXPECT_EQ(saved_bytes(loaded.get()), saved);

  int trimmable = -1;
  KVC_OK(kvcodec_cache_is_trimmable(loaded.get(), &trimmable));
  EXPECT_EQ(trimmable, ref->is_trimmable() ? 1 : 0);
  if (trimmable) {
    int64_t dropped = 0;
    KVC_OK(kvcodec_cache_trim(loaded.get(), 37, &dropped));
    EXPECT_EQ(dropped, ref->trim(37));
    expect_fetch_equal(loaded.get(), *ref);
    expect_stats_equal(loaded.get(), *ref, false);
    EXPECT_EQ(saved_bytes(loaded.get()), ref->save());
  }
}

TEST(CapiRoundTrip, EveryMethodEveryDtypeMatchesTheCppCache) {
  for (const MethodCase& m : method_cases())
    for (kvcodec::DType dtype : {kvcodec::DType::kF32, kvcodec::DType::kF16, kvcodec::DType::kBF16})
      round_trip(m, dtype, nullptr);
}

// Tests named CapiWithCli.* run the kvcodec CLI (label slow: not in the sanitizer pass).
TEST(CapiWithCli, CalibratedKvtcThroughASharedCalibration) {
  const std::string& path = calibration_path();
  if (path.empty()) GTEST_SKIP() << "no calibration: shared model absent at " << shared_dir();
  kvcodec_calibration* raw = nullptr;
  KVC_OK(kvcodec_calibration_load(path.c_str(), &raw));
  CalibrationPtr cal(raw);
  int32_t layers = 0, heads = 0, dim = 0;
  double theta = 0;
  uint64_t params = 0;
  KVC_OK(kvcodec_calibration_info(cal.get(), &layers, &heads, &dim, &theta, &params));
  EXPECT_EQ(layers, 6);
  EXPECT_EQ(heads, 2);
  EXPECT_EQ(dim, 64);
  EXPECT_EQ(theta, 10000.0);
  EXPECT_GT(params, 0u);
  // The handle's path is absolute; settings naming the same file give the same cache.
  const std::string abs = std::filesystem::absolute(path).lexically_normal().string();
  round_trip({"kvtc", "window=16", {{"window", "16"}, {"calibration", abs}}}, kvcodec::DType::kF32, cal.get());
  round_trip({"kvtc", "calibration=" + abs + ";window=16", {{"window", "16"}, {"calibration", abs}}},
             kvcodec::DType::kBF16, nullptr);

  // Caches keep the calibration alive after the handle is freed.
  const kvcodec_cache_config cfg = layer_config(0);
  kvcodec_cache* c_raw = nullptr;
  KVC_OK(kvcodec_cache_create("kvtc", "window=16", &cfg, cal.get(), &c_raw));
  CachePtr c(c_raw);
  cal.reset();
  const std::vector<float> k = synthetic_kv(2, 300, 64, 5), v = synthetic_kv(2, 300, 64, 6);
  const kvcodec_tensor kt = contiguous_tensor(k.data(), KVCODEC_F32, 1, 2, 300, 64);
  const kvcodec_tensor vt = contiguous_tensor(v.data(), KVCODEC_F32, 1, 2, 300, 64);
  KVC_OK(kvcodec_cache_append(c.get(), &kt, &vt));
  kvcodec_stats s{};
  KVC_OK(kvcodec_cache_stats(c.get(), &s));
  EXPECT_EQ(s.tokens, 300);
  EXPECT_GT(s.compression_ratio, 1.0);
}

TEST(CapiRoundTrip, VisitSeesTheHistoryInOrderAndCanStop) {
  const kvcodec_cache_config cfg = layer_config(0);
  kvcodec_cache* raw = nullptr;
  KVC_OK(kvcodec_cache_create("int8", "", &cfg, nullptr, &raw));
  CachePtr c(raw);
  const int64_t S = 700;  // several blocks
  const std::vector<float> k = synthetic_kv(2, S, 64, 3), v = synthetic_kv(2, S, 64, 4);
  const kvcodec_tensor kt = contiguous_tensor(k.data(), KVCODEC_F32, 1, 2, S, 64);
  const kvcodec_tensor vt = contiguous_tensor(v.data(), KVCODEC_F32, 1, 2, S, 64);
  KVC_OK(kvcodec_cache_append(c.get(), &kt, &vt));
  std::vector<float> fk(size_t(2 * S * 64)), fv(fk.size());
  KVC_OK(kvcodec_cache_fetch(c.get(), KVCODEC_F32, fk.data(), fv.data(), fk.size() * 4));
  struct Seen {
    const std::vector<float>* fetched;
    int64_t next = 0;
    int blocks = 0;
    int stop_after = 1 << 30;
    bool equal = true;
  };
  auto visitor = [](void* user, int64_t first, const kvcodec_tensor* key, const kvcodec_tensor*) {
    Seen& seen = *static_cast<Seen*>(user);
    seen.equal = seen.equal && first == seen.next && key->dtype == KVCODEC_F32;
    const float* p = static_cast<const float*>(key->data);
    for (int64_t h = 0; h < key->shape[1]; ++h)
      for (int64_t s = 0; s < key->shape[2]; ++s)
        for (int64_t d = 0; d < key->shape[3]; ++d)
          seen.equal = seen.equal && p[h * key->strides[1] + s * key->strides[2] + d * key->strides[3]] ==
                                         (*seen.fetched)[size_t((h * S + first + s) * 64 + d)];
    seen.next = first + key->shape[2];
    return ++seen.blocks >= seen.stop_after ? 1 : 0;
  };
  Seen all{&fk};
  KVC_OK(kvcodec_cache_visit(c.get(), visitor, &all));
  EXPECT_TRUE(all.equal);
  EXPECT_EQ(all.next, S);
  EXPECT_GT(all.blocks, 1);
  Seen one{&fk};
  one.stop_after = 1;
  KVC_OK(kvcodec_cache_visit(c.get(), visitor, &one));
  EXPECT_EQ(one.blocks, 1);
  EXPECT_LT(one.next, S);
}

// kvcodec.h: different handles may be used from different threads at once.
TEST(CapiRoundTrip, SeparateCachesOnSeparateThreadsSaveTheSameBytes) {
  const std::vector<float> k = synthetic_kv(2, 256, 64, 11), v = synthetic_kv(2, 256, 64, 12);
  auto saved_of = [&](const char* method, const char* settings) {
    const kvcodec_cache_config cfg = layer_config(2);
    kvcodec_cache* raw = nullptr;
    std::vector<uint8_t> out;
    if (kvcodec_cache_create(method, settings, &cfg, nullptr, &raw) != KVCODEC_OK) return out;
    CachePtr c(raw);
    const kvcodec_tensor kt = contiguous_tensor(k.data(), KVCODEC_F32, 1, 2, 256, 64);
    const kvcodec_tensor vt = contiguous_tensor(v.data(), KVCODEC_F32, 1, 2, 256, 64);
    if (kvcodec_cache_append(c.get(), &kt, &vt) != KVCODEC_OK) return out;
    size_t n = 0;
    if (kvcodec_cache_save_size(c.get(), &n) != KVCODEC_OK) return out;
    out.resize(n);
    if (kvcodec_cache_save(c.get(), out.data(), n, nullptr) != KVCODEC_OK) out.clear();
    return out;
  };
  const char* methods[][2] = {{"kvtc", "mode=local;block=64"}, {"palu", ""}, {"int4", ""}, {"kivi2", ""}};
  std::vector<std::vector<uint8_t>> expected, got(8);
  for (const auto& m : methods) expected.push_back(saved_of(m[0], m[1]));
  std::vector<std::thread> threads;
  for (size_t t = 0; t < got.size(); ++t)
    threads.emplace_back([&, t] { got[t] = saved_of(methods[t % 4][0], methods[t % 4][1]); });
  for (auto& t : threads) t.join();
  for (size_t t = 0; t < got.size(); ++t) {
    EXPECT_FALSE(got[t].empty()) << "thread " << t;
    EXPECT_EQ(got[t], expected[t % 4]) << "thread " << t << ", " << methods[t % 4][0];
  }
}

// Caches fed layer by layer through the C API save exactly the per-layer
// sections of `kvcodec compress` with the same method and settings.
TEST(CapiWithCli, SavesMatchKvcodecCompressOnTheKvDump) {
  if (!std::filesystem::exists(kv_dump_path())) GTEST_SKIP() << "no KV dump at " << kv_dump_path();
  const kvcodec::SafetensorsFile dump = kvcodec::SafetensorsFile::open(kv_dump_path());
  const std::string out = (std::filesystem::temp_directory_path() / ("capi_cli_" + std::to_string(::getpid()) + ".kvc")).string();
  struct CliCase {
    std::string method, c_settings, cli_sets;
  };
  const std::vector<CliCase> cases = {
      {"fp16", "", ""},
      {"int8", "", ""},
      {"int4", "group_size=64", " --set int4.group_size=64"},
      {"kivi2", "", ""},
      {"palu", "rank=16", " --set palu.rank=16"},
      {"kvtc", "mode=local;block=128", " --set kvtc.mode=local --set kvtc.block=128"}};
  for (const CliCase& m : cases) {
    SCOPED_TRACE(m.method);
    const std::string cmd = std::string(KVCODEC_CLI) + " compress --kv " + kv_dump_path() + " -o " + out +
                            " --method " + m.method + m.cli_sets + " > /dev/null 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::ifstream f(out, std::ios::binary);
    const std::vector<uint8_t> file((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const kvcodec::ContainerReader container = kvcodec::ContainerReader::parse(file.data(), file.size(), {}, out);
    const int layers = std::stoi(container.meta_or_throw("n_layers"));
    ASSERT_EQ(layers, 6);
    for (int i = 0; i < layers; ++i) {
      const kvcodec::TensorView k = dump.view4("layers." + std::to_string(i) + ".key");
      const kvcodec::TensorView v = dump.view4("layers." + std::to_string(i) + ".value");
      const kvcodec_cache_config cfg = layer_config(i, layers, int(k.shape[1]), int(k.shape[3]));
      kvcodec_cache* raw = nullptr;
      KVC_OK(kvcodec_cache_create(m.method.c_str(), m.c_settings.c_str(), &cfg, nullptr, &raw));
      CachePtr c(raw);
      kvcodec_tensor kt{}, vt{};
      kt.data = k.data, vt.data = v.data;
      kt.dtype = vt.dtype = static_cast<kvcodec_dtype>(k.dtype);
      for (size_t d = 0; d < 4; ++d)
        kt.shape[d] = vt.shape[d] = k.shape[d], kt.strides[d] = k.strides[d], vt.strides[d] = v.strides[d];
      KVC_OK(kvcodec_cache_append(c.get(), &kt, &vt));
      const auto section = container.section("layer." + std::to_string(i));
      const std::vector<uint8_t> saved = saved_bytes(c.get());
      EXPECT_TRUE(saved.size() == section.size() && std::equal(saved.begin(), saved.end(), section.begin()))
          << "layer " << i << ": C API save " << saved.size() << " bytes, compress section " << section.size();
    }
  }
  std::filesystem::remove(out);
}

}  // namespace

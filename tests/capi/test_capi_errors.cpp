// Bad input through the C API: every failure returns its numbered status
// and leaves a message naming what was wrong; nothing crashes or throws.
#include <gtest/gtest.h>

#include <cstdio>
#include <thread>

#include "capi_test_util.hpp"

using namespace capi_test;

namespace {

// The call fails with `status` and the message mentions `words`.
#define KVC_FAILS(call, status, words)                                                       \
  do {                                                                                       \
    EXPECT_EQ((call), (status)) << #call;                                                    \
    EXPECT_NE(std::string(kvcodec_last_error()).find(words), std::string::npos)              \
        << #call << ": message '" << kvcodec_last_error() << "' lacks '" << (words) << "'"; \
  } while (0)

class CapiErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg_ = layer_config(0);
    kvcodec_cache* raw = nullptr;
    KVC_OK(kvcodec_cache_create("int4", "", &cfg_, nullptr, &raw));
    cache_.reset(raw);
    k_ = synthetic_kv(2, 40, 64, 7);
    v_ = synthetic_kv(2, 40, 64, 8);
    kt_ = contiguous_tensor(k_.data(), KVCODEC_F32, 1, 2, 40, 64);
    vt_ = contiguous_tensor(v_.data(), KVCODEC_F32, 1, 2, 40, 64);
  }
  kvcodec_cache_config cfg_{};
  CachePtr cache_;
  std::vector<float> k_, v_;
  kvcodec_tensor kt_{}, vt_{};
};

TEST_F(CapiErrors, VersionAndStatusNames) {
  EXPECT_STREQ(kvcodec_version(), "0.1.0");
  EXPECT_EQ(kvcodec_version_number(), unsigned(KVCODEC_VERSION_NUMBER));
  EXPECT_STREQ(kvcodec_status_name(KVCODEC_OK), "ok");
  EXPECT_STREQ(kvcodec_status_name(KVCODEC_ERROR_CONFIG), "configuration error");
  EXPECT_STREQ(kvcodec_status_name(KVCODEC_ERROR_BUFFER_TOO_SMALL), "buffer too small");
  EXPECT_STREQ(kvcodec_status_name(55), "unknown error");
  EXPECT_EQ(kvcodec_dtype_size(KVCODEC_BF16), 2u);
  EXPECT_EQ(kvcodec_dtype_size(9), 0u);
  std::vector<std::string> names;
  for (size_t i = 0; kvcodec_method_name(i); ++i) names.push_back(kvcodec_method_name(i));
  EXPECT_EQ(names, (std::vector<std::string>{"fp16", "int8", "int4", "kivi2", "palu", "kvtc"}));
}

TEST_F(CapiErrors, NullPointers) {
  kvcodec_cache* out = nullptr;
  KVC_FAILS(kvcodec_cache_create(nullptr, "", &cfg_, nullptr, &out), KVCODEC_ERROR_INVALID_ARGUMENT, "method is NULL");
  KVC_FAILS(kvcodec_cache_create("int8", "", nullptr, nullptr, &out), KVCODEC_ERROR_INVALID_ARGUMENT, "config is NULL");
  KVC_FAILS(kvcodec_cache_create("int8", "", &cfg_, nullptr, nullptr), KVCODEC_ERROR_INVALID_ARGUMENT, "out is NULL");
  KVC_FAILS(kvcodec_cache_append(nullptr, &kt_, &vt_), KVCODEC_ERROR_INVALID_ARGUMENT, "cache is NULL");
  KVC_FAILS(kvcodec_cache_append(cache_.get(), nullptr, &vt_), KVCODEC_ERROR_INVALID_ARGUMENT, "keys is NULL");
  kvcodec_tensor no_data = kt_;
  no_data.data = nullptr;
  KVC_FAILS(kvcodec_cache_append(cache_.get(), &no_data, &vt_), KVCODEC_ERROR_INVALID_ARGUMENT, "keys data is NULL");
  int64_t n = 0;
  KVC_FAILS(kvcodec_cache_offset(nullptr, &n), KVCODEC_ERROR_INVALID_ARGUMENT, "cache is NULL");
  KVC_FAILS(kvcodec_cache_offset(cache_.get(), nullptr), KVCODEC_ERROR_INVALID_ARGUMENT, "out is NULL");
  KVC_FAILS(kvcodec_cache_stats(cache_.get(), nullptr), KVCODEC_ERROR_INVALID_ARGUMENT, "out is NULL");
  KVC_FAILS(kvcodec_cache_visit(cache_.get(), nullptr, nullptr), KVCODEC_ERROR_INVALID_ARGUMENT, "visit is NULL");
  KVC_FAILS(kvcodec_cache_load(nullptr, 10, &out), KVCODEC_ERROR_INVALID_ARGUMENT, "data is NULL");
  KVC_FAILS(kvcodec_calibration_load(nullptr, nullptr), KVCODEC_ERROR_INVALID_ARGUMENT, "out is NULL");
  kvcodec_cache_free(nullptr);
  kvcodec_calibration_free(nullptr);
  EXPECT_STREQ(kvcodec_cache_method(nullptr), "");
}

TEST_F(CapiErrors, WrongDtypeShapeAndStrides) {
  kvcodec_tensor bad = kt_;
  bad.dtype = static_cast<kvcodec_dtype>(7);
  KVC_FAILS(kvcodec_cache_append(cache_.get(), &bad, &vt_), KVCODEC_ERROR_INVALID_ARGUMENT, "keys dtype 7");
  kvcodec_tensor f16 = vt_;
  f16.dtype = KVCODEC_F16;
  KVC_FAILS(kvcodec_cache_append(cache_.get(), &kt_, &f16), KVCODEC_ERROR_INVALID_ARGUMENT, "values are f16");
  kvcodec_tensor heads = kt_, heads_v = vt_;
  heads.shape[1] = heads_v.shape[1] = 1;
  KVC_FAILS(kvcodec_cache_append(cache_.get(), &heads, &heads_v), KVCODEC_ERROR_SHAPE_MISMATCH, "expected [B in 1..1048576, 2, S, 64]");
  kvcodec_tensor shorter = vt_;
  shorter.shape[2] = 39;
  KVC_FAILS(kvcodec_cache_append(cache_.get(), &kt_, &shorter), KVCODEC_ERROR_SHAPE_MISMATCH, "f32 differ");
  kvcodec_tensor negative = kt_;
  negative.strides[2] = -64;
  KVC_FAILS(kvcodec_cache_append(cache_.get(), &negative, &vt_), KVCODEC_ERROR_INVALID_ARGUMENT, "must be >= 0");
  kvcodec_tensor huge = kt_;
  huge.strides[0] = INT64_MAX / 2;
  huge.shape[0] = 4;
  KVC_FAILS(kvcodec_cache_append(cache_.get(), &huge, &vt_), KVCODEC_ERROR_INVALID_ARGUMENT, "overflows");
  KVC_OK(kvcodec_cache_append(cache_.get(), &kt_, &vt_));
  kvcodec_tensor batch2 = kt_, batch2_v = vt_;
  batch2.shape[0] = batch2_v.shape[0] = 2;
  batch2.shape[2] = batch2_v.shape[2] = 20;
  KVC_FAILS(kvcodec_cache_append(cache_.get(), &batch2, &batch2_v), KVCODEC_ERROR_SHAPE_MISMATCH, "batch 2 appended to a cache holding batch 1");
  size_t n = 0;
  KVC_FAILS(kvcodec_cache_fetch_size(cache_.get(), 3, &n), KVCODEC_ERROR_INVALID_ARGUMENT, "fetch dtype 3");
  // A failed append leaves the cache as it was.
  int64_t offset = 0;
  KVC_OK(kvcodec_cache_offset(cache_.get(), &offset));
  EXPECT_EQ(offset, 40);
}

TEST_F(CapiErrors, BadMethodAndSettings) {
  kvcodec_cache* out = nullptr;
  KVC_FAILS(kvcodec_cache_create("zip", "", &cfg_, nullptr, &out), KVCODEC_ERROR_INVALID_ARGUMENT, "unknown cache method 'zip'");
  KVC_FAILS(kvcodec_cache_create("kvtc", "block=abc", &cfg_, nullptr, &out), KVCODEC_ERROR_CONFIG, "kvtc.block");
  KVC_FAILS(kvcodec_cache_create("int4", "colour=blue", &cfg_, nullptr, &out), KVCODEC_ERROR_CONFIG, "colour");
  KVC_FAILS(kvcodec_cache_create("int4", "group_size=48", &cfg_, nullptr, &out), KVCODEC_ERROR_CONFIG, "divisor of head_dim");
  KVC_FAILS(kvcodec_cache_create("int4", "group_size", &cfg_, nullptr, &out), KVCODEC_ERROR_CONFIG, "field=value");
  KVC_FAILS(kvcodec_cache_create("int4", "group_size=8;group_size=16", &cfg_, nullptr, &out), KVCODEC_ERROR_CONFIG, "twice");
  KVC_FAILS(kvcodec_cache_create("kvtc", "calibration=/nonexistent.kvcal", &cfg_, nullptr, &out), KVCODEC_ERROR_NOT_FOUND, "/nonexistent.kvcal");
  kvcodec_cache_config bad = cfg_;
  bad.head_dim = 0;
  KVC_FAILS(kvcodec_cache_create("int8", "", &bad, nullptr, &out), KVCODEC_ERROR_CONFIG, "head_dim");
  bad = cfg_;
  bad.layer = 6;
  KVC_FAILS(kvcodec_cache_create("int8", "", &bad, nullptr, &out), KVCODEC_ERROR_CONFIG, "layer");
  EXPECT_EQ(out, nullptr);
  // ";" separated items, empty items skipped.
  KVC_OK(kvcodec_cache_create("kivi2", "group_size=16;;residual=8;", &cfg_, nullptr, &out));
  kvcodec_cache_free(out);
}

TEST_F(CapiErrors, CalibrationFileErrors) {
  kvcodec_calibration* cal = nullptr;
  KVC_FAILS(kvcodec_calibration_load("/nonexistent/cal.kvcal", &cal), KVCODEC_ERROR_NOT_FOUND, "/nonexistent/cal.kvcal");
  const std::string junk = (std::filesystem::temp_directory_path() / ("capi_junk_" + std::to_string(::getpid()))).string();
  {
    std::FILE* f = std::fopen(junk.c_str(), "wb");
    std::fputs("not a calibration file at all", f);
    std::fclose(f);
  }
  KVC_FAILS(kvcodec_calibration_load(junk.c_str(), &cal), KVCODEC_ERROR_FORMAT, junk);
  std::filesystem::remove(junk);
  EXPECT_EQ(cal, nullptr);
}

TEST_F(CapiErrors, SmallBuffersAndDamagedBytes) {
  KVC_OK(kvcodec_cache_append(cache_.get(), &kt_, &vt_));
  size_t need = 0;
  KVC_OK(kvcodec_cache_fetch_size(cache_.get(), KVCODEC_F16, &need));
  EXPECT_EQ(need, size_t(2 * 40 * 64 * 2));
  std::vector<uint8_t> k(need), v(need);
  KVC_FAILS(kvcodec_cache_fetch(cache_.get(), KVCODEC_F16, k.data(), v.data(), need - 1),
            KVCODEC_ERROR_BUFFER_TOO_SMALL, "needs " + std::to_string(need));
  KVC_FAILS(kvcodec_cache_fetch(cache_.get(), KVCODEC_F16, nullptr, v.data(), need), KVCODEC_ERROR_INVALID_ARGUMENT, "keys is NULL");
  size_t size = 0, written = 0;
  KVC_OK(kvcodec_cache_save_size(cache_.get(), &size));
  std::vector<uint8_t> bytes(size);
  KVC_FAILS(kvcodec_cache_save(cache_.get(), bytes.data(), size - 1, &written), KVCODEC_ERROR_BUFFER_TOO_SMALL, "takes");
  EXPECT_EQ(written, size);
  KVC_OK(kvcodec_cache_save(cache_.get(), bytes.data(), bytes.size(), &written));

  kvcodec_cache* out = nullptr;
  KVC_FAILS(kvcodec_cache_load(bytes.data(), bytes.size() / 2, &out), KVCODEC_ERROR_FORMAT, "");
  std::vector<uint8_t> flipped = bytes;
  flipped[flipped.size() - 20] ^= 0x5a;
  const kvcodec_status s = kvcodec_cache_load(flipped.data(), flipped.size(), &out);
  EXPECT_TRUE(s == KVCODEC_ERROR_CHECKSUM || s == KVCODEC_ERROR_FORMAT) << s << ": " << kvcodec_last_error();
  EXPECT_GT(std::string(kvcodec_last_error()).size(), 20u);
  std::vector<uint8_t> zeros(100, 0);
  KVC_FAILS(kvcodec_cache_load(zeros.data(), zeros.size(), &out), KVCODEC_ERROR_FORMAT, "kvcodec_cache_load");
  EXPECT_EQ(out, nullptr);
  int64_t dropped = 0;
  KVC_FAILS(kvcodec_cache_trim(cache_.get(), -1, &dropped), KVCODEC_ERROR_INVALID_ARGUMENT, "negative");
}

// Needs `kvcodec calibrate` (label slow: not in the sanitizer pass).
TEST(CapiWithCli, CalibratedCacheErrors) {
  const kvcodec_cache_config cfg = layer_config(0);
  const std::string& path = calibration_path();
  if (path.empty()) GTEST_SKIP() << "no calibration: shared model absent at " << shared_dir();
  kvcodec_calibration* cal = nullptr;
  KVC_OK(kvcodec_calibration_load(path.c_str(), &cal));
  CalibrationPtr owned(cal);
  kvcodec_cache* out = nullptr;
  KVC_FAILS(kvcodec_cache_create("int8", "", &cfg, cal, &out), KVCODEC_ERROR_INVALID_ARGUMENT, "for method kvtc");
  KVC_FAILS(kvcodec_cache_create("kvtc", "calibration=/other.kvcal", &cfg, cal, &out), KVCODEC_ERROR_CONFIG, "/other.kvcal");
  const kvcodec_cache_config wrong = layer_config(0, 6, 4, 64);
  KVC_FAILS(kvcodec_cache_create("kvtc", "", &wrong, cal, &out), KVCODEC_ERROR_SHAPE_MISMATCH, "fitted for");
}

TEST_F(CapiErrors, LastErrorIsPerThread) {
  kvcodec_cache* out = nullptr;
  ASSERT_EQ(kvcodec_cache_create("zip", "", &cfg_, nullptr, &out), KVCODEC_ERROR_INVALID_ARGUMENT);
  const std::string mine = kvcodec_last_error();
  std::string theirs;
  std::thread t([&] {
    theirs = kvcodec_last_error();
    kvcodec_cache* o = nullptr;
    kvcodec_cache_create("int4", "colour=red", &cfg_, nullptr, &o);
  });
  t.join();
  EXPECT_EQ(theirs, "");
  EXPECT_EQ(std::string(kvcodec_last_error()), mine);
}

}  // namespace

// The C API's PALU latent codec on the CPU (KVCODEC_DEVICE_CPU): its bytes
// are the token groups a palu cache stores for the same tokens (read from the
// cache's saved section), its decode is the cache's reconstruction, shared
// and joint mode, from a live and from a loaded cache, and after a calibrated
// cache's sinks; its refusals; and, in
// a build without CUDA, the plain refusal of KVCODEC_DEVICE_CUDA. (The GPU
// side: tests/gpu for the kernels against the same reference,
// tests/python/test_palu_codec.py on the GPU machine for this API.)
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "cache/palu_calibration.hpp"
#include "capi_test_util.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/tensor.hpp"

using namespace capi_test;

namespace {

struct PaluDeleter {
  void operator()(kvcodec_palu_codec* c) const { kvcodec_palu_codec_free(c); }
};
using PaluPtr = std::unique_ptr<kvcodec_palu_codec, PaluDeleter>;

constexpr int64_t kBatch = 2, kHeads = 4, kDim = 64, kTokens = 200;

// [B, H, S, D] bf16 keys or values: two synthetic batch rows.
std::vector<uint16_t> synthetic_bf16(uint32_t seed) {
  std::vector<float> x;
  for (int64_t b = 0; b < kBatch; ++b) {
    const std::vector<float> row = synthetic_kv(kHeads, kTokens, kDim, seed + uint32_t(b));
    x.insert(x.end(), row.begin(), row.end());
  }
  std::vector<uint16_t> out(x.size());
  kvcodec::convert(x.data(), kvcodec::DType::kF32, out.data(), kvcodec::DType::kBF16, x.size());
  return out;
}

CachePtr palu_cache(const char* settings, const std::vector<uint16_t>& k, const std::vector<uint16_t>& v,
                    int64_t tokens) {
  const kvcodec_cache_config cfg = layer_config(0, 1, int(kHeads), int(kDim));
  kvcodec_cache* c = nullptr;
  EXPECT_EQ(kvcodec_cache_create("palu", settings, &cfg, nullptr, &c), KVCODEC_OK) << kvcodec_last_error();
  CachePtr cache(c);
  if (tokens > 0) {
    // The first `tokens` of the [B, H, kTokens, D] buffers, through strides.
    kvcodec_tensor kt = contiguous_tensor(k.data(), KVCODEC_BF16, kBatch, kHeads, kTokens, kDim);
    kvcodec_tensor vt = contiguous_tensor(v.data(), KVCODEC_BF16, kBatch, kHeads, kTokens, kDim);
    kt.shape[2] = vt.shape[2] = tokens;
    EXPECT_EQ(kvcodec_cache_append(cache.get(), &kt, &vt), KVCODEC_OK) << kvcodec_last_error();
  }
  return cache;
}

// Tokens [first, first + tokens) of a head group of x [B, H, S, D] in the
// codec's layout [rows, tokens, dim] (shared: one row per batch row and head;
// joint: the heads of a token concatenated).
std::vector<uint16_t> group_rows(const std::vector<uint16_t>& x, const kvcodec_palu_layout& l, int64_t tokens,
                                 int64_t first = 0) {
  std::vector<uint16_t> out;
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t h = 0; h < (l.joint ? 1 : l.n_heads); ++h)
      for (int64_t t = first; t < first + tokens; ++t)
        for (int64_t hj = 0; hj < (l.joint ? l.n_heads : 1); ++hj) {
          const int64_t head = l.first_head + h + hj;
          const auto* src = x.data() + ((b * kHeads + head) * kTokens + t) * kDim;
          out.insert(out.end(), src, src + kDim);
        }
  return out;
}

std::vector<kvcodec_palu_layout> layouts(kvcodec_cache* cache, int32_t part) {
  int32_t n = 0;
  EXPECT_EQ(kvcodec_palu_head_groups(cache, &n), KVCODEC_OK) << kvcodec_last_error();
  std::vector<kvcodec_palu_layout> out(static_cast<size_t>(n));
  for (int32_t g = 0; g < n; ++g) {
    kvcodec_palu_codec* c = nullptr;
    EXPECT_EQ(kvcodec_palu_codec_create(cache, part, g, 256, KVCODEC_DEVICE_CPU, &c), KVCODEC_OK)
        << kvcodec_last_error();
    PaluPtr codec(c);
    EXPECT_EQ(kvcodec_palu_codec_layout(codec.get(), &out[size_t(g)]), KVCODEC_OK) << kvcodec_last_error();
  }
  return out;
}

// Group g's token groups in the cache's saved section of `part`: u8 mode (1:
// fitted per sequence), no raw tokens, then per head group its projection (4
// + rank + 2 * dim * rank bytes), its token groups and its f16 tail
// (src/cache/palu_stream.cpp).
std::vector<uint8_t> stored_token_groups(kvcodec_cache* cache, int32_t part, int32_t group, int64_t tokens) {
  const std::vector<uint8_t> saved = saved_bytes(cache);
  const auto reader = kvcodec::ContainerReader::parse(saved.data(), saved.size());
  const auto section = reader.section(part == KVCODEC_KEYS ? "key" : "value");
  EXPECT_EQ(section[0], 1) << "mode byte: fitted per sequence";
  size_t at = 1;
  const std::vector<kvcodec_palu_layout> ls = layouts(cache, part);
  for (int32_t g = 0; g < int32_t(ls.size()); ++g) {
    const kvcodec_palu_layout& l = ls[size_t(g)];
    const size_t blocks = size_t(tokens / l.group_size), tail = size_t(tokens % l.group_size);
    at += 4 + size_t(l.rank) + 2 * size_t(l.dim) * size_t(l.rank);
    if (g == group) return {section.begin() + long(at), section.begin() + long(at + blocks * l.group_bytes)};
    at += blocks * l.group_bytes + 2 * tail * size_t(l.rows) * size_t(l.rank);
  }
  ADD_FAILURE() << "no group " << group;
  return {};
}

void expect_error(kvcodec_status status, kvcodec_status want, const char* words) {
  EXPECT_EQ(status, want) << kvcodec_last_error();
  EXPECT_NE(std::string(kvcodec_last_error()).find(words), std::string::npos)
      << "'" << words << "' not in: " << kvcodec_last_error();
}

}  // namespace

TEST(CapiPalu, CpuCodesTheCachesOwnTokenGroupsAndDecodesItsReconstruction) {
  const std::vector<uint16_t> k = synthetic_bf16(11), v = synthetic_bf16(23);
  const int64_t coded = 192;  // 6 token groups of 32; the cache's last 8 tokens wait in its f16 tail
  for (const char* settings : {"n_head_groups=2;min_fit_tokens=64;hi_bit=5;lo_bit=3",
                               "group_mode=joint;n_head_groups=2;min_fit_tokens=64;group_size=64"}) {
    SCOPED_TRACE(settings);
    CachePtr cache = palu_cache(settings, k, v, kTokens);
    CachePtr loaded;
    {
      const std::vector<uint8_t> saved = saved_bytes(cache.get());
      kvcodec_cache* c = nullptr;
      KVC_OK(kvcodec_cache_load(saved.data(), saved.size(), &c));
      loaded.reset(c);
    }
    std::vector<uint16_t> fk(size_t(kBatch * kHeads * kTokens * kDim)), fv(fk.size());
    KVC_OK(kvcodec_cache_fetch(cache.get(), KVCODEC_BF16, fk.data(), fv.data(), fk.size() * 2));
    for (int32_t part : {KVCODEC_KEYS, KVCODEC_VALUES}) {
      const std::vector<uint16_t>& x = part == KVCODEC_KEYS ? k : v;
      const std::vector<uint16_t>& fetched = part == KVCODEC_KEYS ? fk : fv;
      int32_t n_groups = 0;
      KVC_OK(kvcodec_palu_head_groups(cache.get(), &n_groups));
      ASSERT_EQ(n_groups, 2);
      for (int32_t g = 0; g < n_groups; ++g) {
        SCOPED_TRACE(testing::Message() << (part == KVCODEC_KEYS ? "keys" : "values") << " group " << g);
        kvcodec_palu_codec* raw = nullptr;
        KVC_OK(kvcodec_palu_codec_create(cache.get(), part, g, 256, KVCODEC_DEVICE_CPU, &raw));
        PaluPtr codec(raw);
        kvcodec_palu_layout l{};
        KVC_OK(kvcodec_palu_codec_layout(codec.get(), &l));
        EXPECT_EQ(l.first_head, 2 * g);
        EXPECT_EQ(l.n_heads, 2);
        EXPECT_EQ(l.rows, l.joint ? kBatch : kBatch * 2);
        EXPECT_EQ(l.dim, l.joint ? 2 * kDim : kDim);
        EXPECT_EQ(l.first_token, 0);
        EXPECT_EQ(l.keys_without_rope, 0);
        EXPECT_EQ(l.max_tokens, 256);
        ASSERT_GT(l.rank, 0);
        const int64_t tokens = coded / l.group_size * l.group_size;
        const std::vector<uint16_t> rows = group_rows(x, l, tokens);
        std::vector<uint8_t> packed(size_t(tokens / l.group_size) * l.group_bytes);
        KVC_OK(kvcodec_palu_encode(codec.get(), rows.data(), tokens, packed.data(), packed.size(), nullptr));
        EXPECT_EQ(packed, stored_token_groups(cache.get(), part, g, kTokens)) << "not the cache's token groups";

        // The same projection from the loaded cache: the same bytes.
        kvcodec_palu_codec* again = nullptr;
        KVC_OK(kvcodec_palu_codec_create(loaded.get(), part, g, 256, KVCODEC_DEVICE_CPU, &again));
        PaluPtr from_loaded(again);
        std::vector<uint8_t> packed2(packed.size());
        KVC_OK(kvcodec_palu_encode(from_loaded.get(), rows.data(), tokens, packed2.data(), packed2.size(), nullptr));
        EXPECT_EQ(packed2, packed);

        // Decode: the cache's own reconstruction of those tokens (fetch in bf16).
        std::vector<uint16_t> y(rows.size());
        KVC_OK(kvcodec_palu_decode(codec.get(), packed.data(), packed.size(), tokens, y.data(), nullptr));
        EXPECT_EQ(y, group_rows(fetched, l, tokens)) << "not the cache's reconstruction";
        EXPECT_NE(y, rows) << "lossy";
      }
    }
  }
}

// A calibrated cache keeps its first `sinks` tokens raw and stores no
// projection: section = u8 mode 2, the raw sinks [sinks, B * H, D] bf16, then
// per head group its token groups and f16 tail. Its values are projected as
// they come; its keys with RoPE removed (the codec says so and does not).
TEST(CapiPalu, CalibratedCachesTokenGroupsStartAfterTheSinks) {
  const std::vector<uint16_t> k = synthetic_bf16(31), v = synthetic_bf16(37);
  // Calibration samples [tokens, H * D] per layer: this KV token-major, as f32.
  std::vector<float> ks, vs;
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t t = 0; t < kTokens; ++t)
      for (int64_t h = 0; h < kHeads; ++h)
        for (int64_t d = 0; d < kDim; ++d) {
          const size_t i = size_t(((b * kHeads + h) * kTokens + t) * kDim + d);
          ks.push_back(kvcodec::bf16_to_f32(k[i]));
          vs.push_back(kvcodec::bf16_to_f32(v[i]));
        }
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kvcodec_capi_palu_" + std::to_string(::getpid()) + ".pcal")).string();
  kvcodec::fit_palu_calibration(1, int(kHeads), int(kDim), 10000.0, "", {ks}, {vs}, kBatch * kTokens, false, 2)
      .write_file(path);
  const int64_t sinks = 4, coded = 192;  // latents [4, 196) in 6 token groups; 4 in the tail
  CachePtr cache = palu_cache(("calibration=" + path + ";sinks=4").c_str(), k, v, kTokens);
  std::filesystem::remove(path);
  const std::vector<kvcodec_palu_layout> keys = layouts(cache.get(), KVCODEC_KEYS);
  const std::vector<kvcodec_palu_layout> values = layouts(cache.get(), KVCODEC_VALUES);
  ASSERT_EQ(keys.size(), 2u);
  ASSERT_EQ(values.size(), 2u);
  std::vector<uint16_t> fk(size_t(kBatch * kHeads * kTokens * kDim)), fv(fk.size());
  KVC_OK(kvcodec_cache_fetch(cache.get(), KVCODEC_BF16, fk.data(), fv.data(), fk.size() * 2));
  const std::vector<uint8_t> saved = saved_bytes(cache.get());
  const auto section = kvcodec::ContainerReader::parse(saved.data(), saved.size()).section("value");
  ASSERT_EQ(section[0], 2) << "mode byte: calibrated";
  size_t at = 1 + size_t(sinks * kBatch * kHeads * kDim * 2);
  for (int32_t g = 0; g < 2; ++g) {
    EXPECT_EQ(keys[size_t(g)].keys_without_rope, 1);
    EXPECT_EQ(keys[size_t(g)].first_token, sinks);
    const kvcodec_palu_layout& l = values[size_t(g)];
    EXPECT_EQ(l.keys_without_rope, 0);
    EXPECT_EQ(l.first_token, sinks);
    kvcodec_palu_codec* raw = nullptr;
    KVC_OK(kvcodec_palu_codec_create(cache.get(), KVCODEC_VALUES, g, 256, KVCODEC_DEVICE_CPU, &raw));
    PaluPtr codec(raw);
    const std::vector<uint16_t> rows = group_rows(v, l, coded, sinks);
    std::vector<uint8_t> packed(size_t(coded / l.group_size) * l.group_bytes);
    KVC_OK(kvcodec_palu_encode(codec.get(), rows.data(), coded, packed.data(), packed.size(), nullptr));
    EXPECT_EQ(packed, std::vector<uint8_t>(section.begin() + long(at), section.begin() + long(at + packed.size())))
        << "group " << g << ": not the cache's token groups";
    at += packed.size() + 2 * size_t(kTokens - sinks - coded) * size_t(l.rows) * size_t(l.rank);
    std::vector<uint16_t> y(rows.size());
    KVC_OK(kvcodec_palu_decode(codec.get(), packed.data(), packed.size(), coded, y.data(), nullptr));
    EXPECT_EQ(y, group_rows(fv, l, coded, sinks)) << "group " << g << ": not the cache's reconstruction";
  }
  EXPECT_EQ(at, section.size()) << "every byte of the section accounted for";
}

TEST(CapiPalu, RefusesWhatItCannotCodeWithTheProblemNamed) {
  const std::vector<uint16_t> k = synthetic_bf16(5), v = synthetic_bf16(6);
  kvcodec_palu_codec* out = reinterpret_cast<kvcodec_palu_codec*>(&out);
  int32_t n = -1;
  expect_error(kvcodec_palu_head_groups(nullptr, &n), KVCODEC_ERROR_INVALID_ARGUMENT, "cache is NULL");
  expect_error(kvcodec_palu_codec_create(nullptr, KVCODEC_KEYS, 0, 64, KVCODEC_DEVICE_CPU, &out),
               KVCODEC_ERROR_INVALID_ARGUMENT, "cache is NULL");
  EXPECT_EQ(out, nullptr) << "out is cleared on failure";
  const kvcodec_cache_config cfg = layer_config(0, 1, int(kHeads), int(kDim));
  kvcodec_cache* c = nullptr;
  KVC_OK(kvcodec_cache_create("int8", "", &cfg, nullptr, &c));
  CachePtr int8(c);
  expect_error(kvcodec_palu_head_groups(int8.get(), &n), KVCODEC_ERROR_INVALID_ARGUMENT, "'int8', not 'palu'");
  CachePtr empty = palu_cache("min_fit_tokens=64", k, v, 0);
  expect_error(kvcodec_palu_codec_create(empty.get(), KVCODEC_KEYS, 0, 64, KVCODEC_DEVICE_CPU, &out),
               KVCODEC_ERROR_INVALID_ARGUMENT, "not fitted its projections yet (0 tokens held");
  CachePtr unfitted = palu_cache("min_fit_tokens=64", k, v, 63);
  expect_error(kvcodec_palu_head_groups(unfitted.get(), &n), KVCODEC_ERROR_INVALID_ARGUMENT,
               "not fitted its projections yet (63 tokens held");

  CachePtr cache = palu_cache("n_head_groups=2;min_fit_tokens=64;quantize_values=false", k, v, 64);
  expect_error(kvcodec_palu_head_groups(cache.get(), nullptr), KVCODEC_ERROR_INVALID_ARGUMENT, "n_groups is NULL");
  expect_error(kvcodec_palu_codec_create(cache.get(), KVCODEC_KEYS, 0, 64, KVCODEC_DEVICE_CPU, nullptr),
               KVCODEC_ERROR_INVALID_ARGUMENT, "out is NULL");
  expect_error(kvcodec_palu_codec_create(cache.get(), 2, 0, 64, KVCODEC_DEVICE_CPU, &out),
               KVCODEC_ERROR_INVALID_ARGUMENT, "part 2");
  expect_error(kvcodec_palu_codec_create(cache.get(), KVCODEC_KEYS, 0, 64, 7, &out), KVCODEC_ERROR_INVALID_ARGUMENT,
               "device 7");
  expect_error(kvcodec_palu_codec_create(cache.get(), KVCODEC_KEYS, 2, 64, KVCODEC_DEVICE_CPU, &out),
               KVCODEC_ERROR_INVALID_ARGUMENT, "head_group 2 outside [0, 2)");
  expect_error(kvcodec_palu_codec_create(cache.get(), KVCODEC_KEYS, -1, 64, KVCODEC_DEVICE_CPU, &out),
               KVCODEC_ERROR_INVALID_ARGUMENT, "head_group -1");
  expect_error(kvcodec_palu_codec_create(cache.get(), KVCODEC_KEYS, 0, 31, KVCODEC_DEVICE_CPU, &out),
               KVCODEC_ERROR_INVALID_ARGUMENT, "max_tokens 31");
  expect_error(kvcodec_palu_codec_create(cache.get(), KVCODEC_KEYS, 0, int64_t(1) << 40, KVCODEC_DEVICE_CPU, &out),
               KVCODEC_ERROR_INVALID_ARGUMENT, "2^31");
  expect_error(kvcodec_palu_codec_create(cache.get(), KVCODEC_VALUES, 0, 64, KVCODEC_DEVICE_CPU, &out),
               KVCODEC_ERROR_UNSUPPORTED, "quantize_values=false");
  CachePtr small_groups = palu_cache("group_size=16;min_fit_tokens=64", k, v, 64);
  expect_error(kvcodec_palu_codec_create(small_groups.get(), KVCODEC_VALUES, 0, 64, KVCODEC_DEVICE_CPU, &out),
               KVCODEC_ERROR_UNSUPPORTED, "group_size 16 is not a multiple of 32");
  int compiled = -1;
  kvcodec_cuda_device_count(&compiled);
  if (!compiled)
    expect_error(kvcodec_palu_codec_create(cache.get(), KVCODEC_KEYS, 0, 64, KVCODEC_DEVICE_CUDA, &out),
                 KVCODEC_ERROR_UNSUPPORTED, "built without CUDA");

  KVC_OK(kvcodec_palu_codec_create(cache.get(), KVCODEC_KEYS, 1, 128, KVCODEC_DEVICE_CPU, &out));
  PaluPtr codec(out);
  kvcodec_palu_layout l{};
  expect_error(kvcodec_palu_codec_layout(codec.get(), nullptr), KVCODEC_ERROR_INVALID_ARGUMENT, "out is NULL");
  expect_error(kvcodec_palu_codec_layout(nullptr, &l), KVCODEC_ERROR_INVALID_ARGUMENT, "codec is NULL");
  KVC_OK(kvcodec_palu_codec_layout(codec.get(), &l));
  const std::vector<uint16_t> x = group_rows(k, l, 64);
  std::vector<uint8_t> packed(2 * l.group_bytes);
  for (int64_t tokens : {int64_t(0), int64_t(31), int64_t(-32), int64_t(160)})
    expect_error(kvcodec_palu_encode(codec.get(), x.data(), tokens, packed.data(), packed.size(), nullptr),
                 KVCODEC_ERROR_INVALID_ARGUMENT,
                 ("tokens " + std::to_string(tokens) + " is not a positive multiple of group_size 32 up to "
                  "max_tokens 128").c_str());
  expect_error(kvcodec_palu_encode(codec.get(), nullptr, 64, packed.data(), packed.size(), nullptr),
               KVCODEC_ERROR_INVALID_ARGUMENT, "x is NULL");
  expect_error(kvcodec_palu_encode(codec.get(), x.data(), 64, nullptr, packed.size(), nullptr),
               KVCODEC_ERROR_INVALID_ARGUMENT, "packed is NULL");
  expect_error(kvcodec_palu_encode(codec.get(), x.data(), 64, packed.data(), packed.size() - 1, nullptr),
               KVCODEC_ERROR_BUFFER_TOO_SMALL, ("capacity is " + std::to_string(packed.size() - 1)).c_str());
  int stream_stand_in = 0;
  expect_error(kvcodec_palu_encode(codec.get(), x.data(), 64, packed.data(), packed.size(), &stream_stand_in),
               KVCODEC_ERROR_INVALID_ARGUMENT, "cuda_stream given to a codec on the CPU");
  KVC_OK(kvcodec_palu_encode(codec.get(), x.data(), 64, packed.data(), packed.size(), nullptr));
  std::vector<uint16_t> y(x.size());
  expect_error(kvcodec_palu_decode(codec.get(), packed.data(), packed.size() - 1, 64, y.data(), nullptr),
               KVCODEC_ERROR_FORMAT, "token groups of");
  expect_error(kvcodec_palu_decode(codec.get(), packed.data(), packed.size(), 32, y.data(), nullptr),
               KVCODEC_ERROR_FORMAT, "packed bytes for 32 tokens");
  expect_error(kvcodec_palu_decode(codec.get(), packed.data(), packed.size(), 64, nullptr, nullptr),
               KVCODEC_ERROR_INVALID_ARGUMENT, "x is NULL");
  expect_error(kvcodec_palu_decode(codec.get(), packed.data(), packed.size(), 64, y.data(), &stream_stand_in),
               KVCODEC_ERROR_INVALID_ARGUMENT, "cuda_stream given to a codec on the CPU");
  expect_error(kvcodec_palu_decode(nullptr, packed.data(), packed.size(), 64, y.data(), nullptr),
               KVCODEC_ERROR_INVALID_ARGUMENT, "codec is NULL");
  KVC_OK(kvcodec_palu_decode(codec.get(), packed.data(), packed.size(), 64, y.data(), nullptr));
  kvcodec_palu_codec_free(nullptr);
}

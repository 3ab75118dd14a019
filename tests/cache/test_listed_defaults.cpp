// The defaults list_methods() prints (kvcodec --help, docs) are the ones the
// factory uses: for every field with a listed default, a cache made with that
// value given explicitly stores and reconstructs exactly what a cache made
// with no settings does. Guards against a default changed in one of its two
// homes (the field table and the reader's call) but not the other.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <string>

#include "kvcodec/cache.hpp"

using namespace kvcodec;

namespace {

constexpr int kHeads = 2, kDim = 64, kTokens = 200;  // > every default min_fit_tokens (2 * D)

Tensor random_kv(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  Tensor t(DType::kF32, {1, kHeads, kTokens, kDim});
  float* x = t.data_as<float>();
  for (int64_t i = 0; i < t.numel(); ++i) x[i] = (0.2f + float(i % kDim) / kDim) * n01(rng);
  return t.to(DType::kF16);
}

struct Result {
  Tensor keys, values;
  uint64_t stored = 0;
};

Result run(const std::string& method, const Settings& settings) {
  CacheConfig c;
  c.layer = 0;
  c.n_layers = 1;
  c.n_kv_heads = kHeads;
  c.head_dim = kDim;
  const Tensor k = random_kv(7), v = random_kv(8);
  auto cache = make_cache(method, c, settings);
  cache->append(k.view().slice_tokens(0, 150), v.view().slice_tokens(0, 150));
  cache->append(k.view().slice_tokens(150, kTokens - 150), v.view().slice_tokens(150, kTokens - 150));
  KVPair out = cache->fetch(DType::kF32);
  return {std::move(out.keys), std::move(out.values), cache->stats().compressed_bytes()};
}

bool same(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

TEST(ListedDefaults, GivingAListedDefaultChangesNothing) {
  int checked = 0;
  for (const MethodInfo& m : list_methods()) {
    // kvtc lists the fields of both its modes; the calibrated-only ones are
    // refused in local mode (tests/cache/test_kvtc_*.cpp check those).
    if (m.name == "kvtc") continue;
    const Result base = run(m.name, {});
    for (const FieldInfo& f : m.fields) {
      // "" is a derived default, "none" an absent one: neither can be given as a value.
      if (f.default_value.empty() || f.default_value == "none") continue;
      SCOPED_TRACE(m.name + "." + f.name + "=" + f.default_value);
      const Result given = run(m.name, {{f.name, f.default_value}});
      EXPECT_EQ(given.stored, base.stored);
      EXPECT_TRUE(same(given.keys, base.keys));
      EXPECT_TRUE(same(given.values, base.values));
      ++checked;
    }
  }
  EXPECT_GE(checked, 13);  // int8/int4 1, kivi2 2, palu 9 (fp16 has no fields)
}

// palu's defaults are the documented choice (docs/eval.md, "palu's defaults").
TEST(ListedDefaults, PaluDefaultsAreTheChosenSetting) {
  for (const MethodInfo& m : list_methods()) {
    if (m.name != "palu") continue;
    std::map<std::string, std::string> d;
    for (const FieldInfo& f : m.fields) d[f.name] = f.default_value;
    EXPECT_EQ(d["energy_threshold"], "0.999");
    EXPECT_EQ(d["hi_bit"], "8");
    EXPECT_EQ(d["lo_bit"], "4");
    EXPECT_EQ(d["hi_fraction"], "0.25");
    return;
  }
  FAIL() << "palu not listed";
}

}  // namespace

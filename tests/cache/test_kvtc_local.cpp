// Local-mode kvtc specifics beyond the generic contract suite.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <random>

#include "cache/kvtc_cache.hpp"
#include "cache/settings.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"

using namespace kvcodec;

namespace {

Tensor correlated(int64_t heads, int64_t tokens, int64_t dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  Tensor t(DType::kF32, {1, heads, tokens, dim});
  float* p = t.data_as<float>();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t s = 0; s < tokens; ++s) {
      const float a = g(rng) * 3.0f, b = g(rng);
      for (int64_t d = 0; d < dim; ++d)
        p[(h * tokens + s) * dim + d] = a * std::sin(0.3f * float(d + h)) + b * std::cos(0.7f * float(d)) + 0.05f * g(rng);
    }
  return t;
}

// Trimming through encoded blocks must never touch the sinks, which sit
// before the blocks: they stay raw and exact.
TEST(KvtcLocal, TrimThroughBlocksKeepsSinks) {
  CacheConfig cfg;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 16;
  auto cache = make_cache("kvtc", cfg, {{"sinks", "4"}, {"block", "8"}, {"min_fit_tokens", "16"}});
  const Tensor k = correlated(2, 44, 16, 1), v = correlated(2, 44, 16, 2);
  cache->append(k.view(), v.view());  // 4 sinks, 5 blocks of 8
  EXPECT_EQ(cache->trim(13), 13);     // the whole tail is gone plus 1 + 8 tokens of blocks
  EXPECT_EQ(cache->offset(), 31);
  const KVPair out = cache->fetch(DType::kF32);
  ASSERT_EQ(out.keys.shape()[2], 31);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t s = 0; s < 4; ++s)
      for (int64_t d = 0; d < 16; ++d)
        EXPECT_EQ(out.keys.view().at(0, h, s, d), f16_to_f32(f32_to_f16(k.view().at(0, h, s, d))));
  const CacheStats st = cache->stats();
  EXPECT_EQ(st.tokens, 31);
  EXPECT_EQ(st.fp16_key_bytes, uint64_t(31 * 2 * 16 * 2));
}

// Tokens [first, first + n) of t [1, H, S, D] as their own tensor.
Tensor tokens(const Tensor& t, int64_t first, int64_t n) {
  const int64_t H = t.shape()[1], S = t.shape()[2], D = t.shape()[3];
  Tensor out(DType::kF32, {1, H, n, D});
  for (int64_t h = 0; h < H; ++h)
    for (int64_t s = 0; s < n; ++s)
      for (int64_t d = 0; d < D; ++d)
        out.data_as<float>()[(h * n + s) * D + d] = t.data_as<float>()[(h * S + first + s) * D + d];
  return out;
}

// A fitted cache with an empty raw tail codes the blocks an f32 append
// completes straight from the input rows: the saved bytes equal those of
// the same tokens appended one at a time (through the raw tail).
TEST(KvtcLocal, DirectBlockEncodeEqualsTokenByToken) {
  CacheConfig cfg;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 16;
  const Settings settings{{"block", "8"}};
  const Tensor k = correlated(2, 90, 16, 5), v = correlated(2, 90, 16, 6);
  auto a = make_cache("kvtc", cfg, settings), b = make_cache("kvtc", cfg, settings);
  for (auto* c : {a.get(), b.get()}) c->append(tokens(k, 0, 40).view(), tokens(v, 0, 40).view());  // fit, 5 blocks
  a->append(tokens(k, 40, 50).view(), tokens(v, 40, 50).view());  // 6 blocks direct, 2 tokens raw
  for (int64_t t = 40; t < 90; ++t) b->append(tokens(k, t, 1).view(), tokens(v, t, 1).view());
  EXPECT_EQ(a->offset(), 90);
  EXPECT_EQ(a->save(), b->save());
  EXPECT_EQ(a->stats().extras.at("key.raw_bytes"), 2.0 * 2 * 16 * 2);
  const KVPair ra = a->fetch(DType::kF32), rb = b->fetch(DType::kF32);
  ASSERT_EQ(ra.keys.numel(), rb.keys.numel());
  for (int64_t i = 0; i < ra.keys.numel(); ++i) {
    ASSERT_EQ(ra.keys.data_as<float>()[i], rb.keys.data_as<float>()[i]) << i;
    ASSERT_EQ(ra.values.data_as<float>()[i], rb.values.data_as<float>()[i]) << i;
  }
}

TEST(KvtcLocal, TargetRelMseNeedsRateAllocator) {
  CacheConfig cfg;
  cfg.n_kv_heads = 1;
  cfg.head_dim = 16;
  EXPECT_THROW(make_cache("kvtc", cfg, {{"target_rel_mse", "0.01"}}), Error);
  // With the rate allocator the reconstruction meets the target on the fit tokens.
  auto cache = make_cache("kvtc", cfg, {{"allocator", "rate"}, {"target_rel_mse", "0.01"}, {"block", "16"},
                                        {"min_fit_tokens", "64"}});
  const Tensor k = correlated(1, 64, 16, 3), v = correlated(1, 64, 16, 4);
  cache->append(k.view(), v.view());
  const KVPair out = cache->fetch(DType::kF32);
  for (const auto& [orig, back] : {std::pair{&k, &out.keys}, std::pair{&v, &out.values}}) {
    double err = 0, ref = 0;
    for (int64_t i = 0; i < orig->numel(); ++i) {
      const double a = f16_to_f32(f32_to_f16(orig->data_as<float>()[i])), b = back->data_as<float>()[i];
      err += (a - b) * (a - b);
      ref += a * a;
    }
    EXPECT_LE(err / ref, 0.01);
    EXPECT_GT(err / ref, 0.002);  // and does not waste bits far below it
  }
}

}  // namespace

namespace {

double rel_mse_f16(const Tensor& orig, const Tensor& back) {
  double err = 0, ref = 0;
  for (int64_t i = 0; i < orig.numel(); ++i) {
    const double a = f16_to_f32(f32_to_f16(orig.data_as<float>()[i])), b = back.data_as<float>()[i];
    err += (a - b) * (a - b);
    ref += a * a;
  }
  return err / ref;
}

// With no rate-control field, local kvtc is the preset chosen within 1%
// perplexity (the rate allocator at kDefaultTargetRelMse, int8 basis); any
// such field brings back every field's own default, and kvcodec calibrate
// (kPerField) never sees the preset.
TEST(KvtcLocal, DefaultsAreTheRatePresetUnlessARateFieldIsGiven) {
  CacheConfig cfg;
  cfg.n_kv_heads = 1;
  cfg.head_dim = 16;
  const KvtcSettings preset = parse_kvtc_settings({}, cfg);
  EXPECT_EQ(preset.codec.allocator, kvtc::Allocator::kRate);
  EXPECT_EQ(preset.codec.target_rel_mse, kDefaultTargetRelMse);
  EXPECT_EQ(preset.codec.basis_bits, 8);
  EXPECT_EQ(parse_kvtc_settings({{"basis_bits", "16"}}, cfg).codec.basis_bits, 16);  // not a rate field
  EXPECT_EQ(parse_kvtc_settings({{"basis_bits", "16"}}, cfg).codec.target_rel_mse, kDefaultTargetRelMse);
  for (const Settings& s : std::vector<Settings>{{{"bit_budget", "32"}},
                                                 {{"allocator", "rate"}},
                                                 {{"allocator", "dp"}},
                                                 {{"target_ratio", "5"}},
                                                 {{"allocator", "rate"}, {"key_target_rel_mse", "0.02"}}}) {
    const KvtcSettings p = parse_kvtc_settings(s, cfg);
    EXPECT_EQ(p.codec.allocator, s.count("allocator") && s.at("allocator") == "rate" ? kvtc::Allocator::kRate
                                                                                    : kvtc::Allocator::kDp)
        << encode_settings(s);
    EXPECT_EQ(p.codec.target_rel_mse, 0.0) << encode_settings(s);
    EXPECT_EQ(p.codec.basis_bits, 16) << encode_settings(s);
    EXPECT_EQ(p.codec.bit_budget, s.count("bit_budget") ? 32 : 4 * 16) << encode_settings(s);
  }
  const KvtcSettings per_field = parse_kvtc_settings({}, cfg, KvtcDefaults::kPerField);
  EXPECT_EQ(per_field.codec.allocator, kvtc::Allocator::kDp);
  EXPECT_EQ(per_field.codec.target_rel_mse, 0.0);
  EXPECT_EQ(per_field.codec.basis_bits, 16);
  // The preset codes as its fields written out do, and meets its target.
  char target[32];
  std::snprintf(target, sizeof target, "%.17g", kDefaultTargetRelMse);
  Settings explicit_fields = {{"allocator", "rate"}, {"target_rel_mse", target}, {"basis_bits", "8"}};
  auto by_default = make_cache("kvtc", cfg, {{"block", "16"}, {"min_fit_tokens", "64"}});
  explicit_fields["block"] = "16";
  explicit_fields["min_fit_tokens"] = "64";
  auto spelled_out = make_cache("kvtc", cfg, explicit_fields);
  const Tensor k = correlated(1, 64, 16, 7), v = correlated(1, 64, 16, 8);
  by_default->append(k.view(), v.view());
  spelled_out->append(k.view(), v.view());
  EXPECT_EQ(by_default->stats().compressed_bytes(), spelled_out->stats().compressed_bytes());
  const KVPair a = by_default->fetch(DType::kF32), b = spelled_out->fetch(DType::kF32);
  EXPECT_EQ(std::memcmp(a.keys.data(), b.keys.data(), size_t(a.keys.numel()) * 4), 0);
  EXPECT_EQ(std::memcmp(a.values.data(), b.values.data(), size_t(a.values.numel()) * 4), 0);
  EXPECT_LE(rel_mse_f16(k, a.keys), kDefaultTargetRelMse);  // the 64 tokens are the fit tokens
  EXPECT_LE(rel_mse_f16(v, a.values), kDefaultTargetRelMse);
}

// Keys and values can be given their own distortion targets.
TEST(KvtcLocal, PerTensorTargets) {
  CacheConfig cfg;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 16;
  auto cache = make_cache("kvtc", cfg, {{"allocator", "rate"}, {"key_target_rel_mse", "0.03"},
                                        {"value_target_rel_mse", "0.004"}, {"block", "16"}, {"min_fit_tokens", "64"}});
  const Tensor k = correlated(2, 64, 16, 5), v = correlated(2, 64, 16, 6);
  cache->append(k.view(), v.view());
  const KVPair out = cache->fetch(DType::kF32);
  const double ek = rel_mse_f16(k, out.keys), ev = rel_mse_f16(v, out.values);
  EXPECT_LE(ek, 0.03) << std::setprecision(12) << ek;
  EXPECT_GT(ek, 0.01);
  EXPECT_LE(ev, 0.004);
  const CacheStats st = cache->stats();
  EXPECT_LT(st.compressed_key_bytes, st.compressed_value_bytes);  // the looser target costs fewer bytes
}

}  // namespace

// Local kvtc holds its parameters as their stored bytes and builds the
// codec's tables per call, so after a one-call prefill it holds about what
// it stores: payloads, parameters, no raw copy of the prefill, no tables.
// Fed one token at a time it keeps its heads (both halves) between calls
// (a block every 64 appends and a fetch every step would rebuild them),
// and counts them: their f32 basis alone is 2 x 64 x 64 x 4 bytes per
// tensor here.
TEST(KvtcLocal, ResidentBytesHoldWhatIsStoredAndCountTheKeptHeads) {
  CacheConfig cfg;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 64;
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const int64_t S = 1024;
  std::vector<float> x(size_t(2 * S * 64));
  for (auto& v : x) v = g(rng);
  const TensorView kv = TensorView::contiguous(x.data(), DType::kF32, {1, 2, S, 64});
  for (const char* coder : {"rans", "fixed"}) {
    auto bulk = make_cache("kvtc", cfg, {{"coder", coder}});
    bulk->append(kv, kv);
    const CacheStats st = bulk->stats();
    EXPECT_GE(st.resident_bytes, st.compressed_bytes()) << coder;
    // Vector headers and the cache object: ~2% of this small cache.
    EXPECT_LE(double(st.resident_bytes), 1.03 * double(st.compressed_bytes())) << coder;
    const std::vector<uint8_t> saved = bulk->save();
    auto loaded = load_cache(saved.data(), saved.size());
    EXPECT_LE(double(loaded->stats().resident_bytes), 1.03 * double(st.compressed_bytes())) << coder;

    // The same tokens one at a time after a 256-token prefill.
    auto streamed = make_cache("kvtc", cfg, {{"coder", coder}});
    streamed->append(kv.slice_tokens(0, 256), kv.slice_tokens(0, 256));
    for (int64_t t = 256; t < S; ++t) streamed->append(kv.slice_tokens(t, 1), kv.slice_tokens(t, 1));
    const CacheStats ss = streamed->stats();
    EXPECT_GE(ss.resident_bytes, ss.compressed_bytes() + 2 * 2 * 64 * 64 * 4) << coder;
    // The kept heads hold both halves: a fetch in that decode loop decodes
    // from them (nothing more held) what a reloaded copy, which opens its
    // heads per call, decodes.
    const KVPair first = streamed->fetch(DType::kF32);
    EXPECT_EQ(streamed->stats().resident_bytes, ss.resident_bytes) << coder;
    const KVPair again = streamed->fetch(DType::kF32);
    const std::vector<uint8_t> streamed_saved = streamed->save();
    const KVPair reloaded = load_cache(streamed_saved.data(), streamed_saved.size())->fetch(DType::kF32);
    for (const KVPair* p : {&first, &again}) {
      ASSERT_EQ(p->keys.nbytes(), reloaded.keys.nbytes());
      EXPECT_EQ(std::memcmp(p->keys.data(), reloaded.keys.data(), reloaded.keys.nbytes()), 0) << coder;
      EXPECT_EQ(std::memcmp(p->values.data(), reloaded.values.data(), reloaded.values.nbytes()), 0) << coder;
    }
    // A bulk append (>= one block) drops the kept heads again.
    streamed->append(kv.slice_tokens(0, 128), kv.slice_tokens(0, 128));
    const CacheStats sb = streamed->stats();
    EXPECT_LE(sb.resident_bytes - sb.compressed_bytes() + 2 * 2 * 64 * 64 * 4,
              ss.resident_bytes - ss.compressed_bytes()) << coder;
  }
}

// A fetch opens its heads into this thread's scratch openers; a fetch of
// another cache from inside the first one's visitor (the same thread, the
// openers leased) must take openers of its own, not parse over the heads
// the outer fetch is still decoding from. Two caches of different
// parameters (other data, other head count), the inner one fetched at every
// outer block: both equal their plain fetches.
TEST(KvtcLocal, FetchInsideAnotherFetchDecodesBoth) {
  CacheConfig cfg;
  cfg.head_dim = 32;
  cfg.n_kv_heads = 2;
  auto outer = make_cache("kvtc", cfg, {{"block", "16"}, {"min_fit_tokens", "64"}});
  const Tensor ko = correlated(2, 200, 32, 11), vo = correlated(2, 200, 32, 12);
  outer->append(ko.view(), vo.view());
  cfg.n_kv_heads = 3;
  auto inner = make_cache("kvtc", cfg, {{"block", "16"}, {"min_fit_tokens", "64"}});
  const Tensor ki = correlated(3, 150, 32, 13), vi = correlated(3, 150, 32, 14);
  inner->append(ki.view(), vi.view());
  // The views are contiguous [B, H, count, D] pieces.
  const auto elems = [](const TensorView& t) { return t.shape[0] * t.shape[1] * t.shape[2] * t.shape[3]; };
  const KVPair plain_outer = outer->fetch(DType::kF32), plain_inner = inner->fetch(DType::kF32);

  const auto collect = [&](const KVCache& c, std::vector<float>& keys, std::vector<float>& values) {
    c.for_each_block([&](int64_t, const TensorView& k, const TensorView& v) {
      keys.insert(keys.end(), static_cast<const float*>(k.data), static_cast<const float*>(k.data) + elems(k));
      values.insert(values.end(), static_cast<const float*>(v.data), static_cast<const float*>(v.data) + elems(v));
    });
  };
  std::vector<float> ok, ov, first_k, first_v;
  collect(*inner, first_k, first_v);
  int visits = 0;
  outer->for_each_block([&](int64_t, const TensorView& k, const TensorView& v) {
    ok.insert(ok.end(), static_cast<const float*>(k.data), static_cast<const float*>(k.data) + elems(k));
    ov.insert(ov.end(), static_cast<const float*>(v.data), static_cast<const float*>(v.data) + elems(v));
    std::vector<float> ik, iv;
    collect(*inner, ik, iv);
    EXPECT_EQ(ik, first_k) << "visit " << visits;
    EXPECT_EQ(iv, first_v) << "visit " << visits;
    ++visits;
  });
  EXPECT_GT(visits, 8);
  // for_each_block emits [B, H, count, D] pieces; fetch lays them out as
  // [B, H, S, D]: compare head by head.
  const auto same_as_fetch = [](const std::vector<float>& pieces, const Tensor& fetched, const KVCache& c) {
    std::vector<int64_t> counts;
    c.for_each_block([&](int64_t, const TensorView& k, const TensorView&) { counts.push_back(k.shape[2]); });
    const int64_t H = fetched.shape()[1], S = fetched.shape()[2], D = fetched.shape()[3];
    size_t at = 0;
    int64_t t0 = 0;
    for (const int64_t n : counts) {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < n; ++t)
          for (int64_t d = 0; d < D; ++d, ++at)
            if (pieces[at] != fetched.data_as<float>()[(h * S + t0 + t) * D + d]) return false;
      t0 += n;
    }
    return at == pieces.size() && t0 == S;
  };
  EXPECT_TRUE(same_as_fetch(ok, plain_outer.keys, *outer));
  EXPECT_TRUE(same_as_fetch(ov, plain_outer.values, *outer));
  EXPECT_TRUE(same_as_fetch(first_k, plain_inner.keys, *inner));
  EXPECT_TRUE(same_as_fetch(first_v, plain_inner.values, *inner));
}

namespace {

// A fetch decodes the keys and values of two heads per call (four rANS
// streams in lockstep, kvtc::decode_blocks), or of two blocks when the
// cache has one head: a cache of 3 heads x batch 2 (pairs and a head
// alone) and of 2 heads gives, head by head, exactly what caches of one of
// its heads give (blocks paired; the fit of a head does not depend on the
// others), for an odd and an even number of blocks; at defaults, at the
// dp allocator's wide alphabets, and with 2 threads (head pairs decoded
// by an OpenMP team).
TEST(KvtcLocal, HeadsDecodeTogetherAsAlone) {
  for (const Settings& extra :
       std::vector<Settings>{{}, {{"allocator", "dp"}, {"bit_budget", "96"}}, {{"threads", "2"}}})
    for (const int64_t heads : {int64_t(2), int64_t(3)})
      for (const int64_t tokens : {int64_t(64 + 5 * 16 + 3), int64_t(64 + 6 * 16)}) {
        CacheConfig cfg;
        cfg.head_dim = 16;
        cfg.n_kv_heads = heads;
        Settings settings{{"block", "16"}, {"min_fit_tokens", "64"}};
        settings.insert(extra.begin(), extra.end());
        const int64_t B = 2;
        Tensor k(DType::kF32, {B, heads, tokens, 16}), v(DType::kF32, {B, heads, tokens, 16});
        for (int64_t b = 0; b < B; ++b) {
          const Tensor kb = correlated(heads, tokens, 16, uint32_t(20 + b)), vb = correlated(heads, tokens, 16, uint32_t(30 + b));
          std::memcpy(k.data_as<float>() + b * heads * tokens * 16, kb.data_as<float>(), size_t(kb.numel()) * 4);
          std::memcpy(v.data_as<float>() + b * heads * tokens * 16, vb.data_as<float>(), size_t(vb.numel()) * 4);
        }
        auto all = make_cache("kvtc", cfg, settings);
        all->append(k.view(), v.view());
        const KVPair together = all->fetch(DType::kF32);
        cfg.n_kv_heads = 1;
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t at = (b * heads + h) * tokens * 16;
            const TensorView kh = TensorView::contiguous(k.data_as<float>() + at, DType::kF32, {1, 1, tokens, 16});
            const TensorView vh = TensorView::contiguous(v.data_as<float>() + at, DType::kF32, {1, 1, tokens, 16});
            auto one = make_cache("kvtc", cfg, settings);
            one->append(kh, vh);
            const KVPair alone = one->fetch(DType::kF32);
            for (int64_t i = 0; i < tokens * 16; ++i) {
              ASSERT_EQ(together.keys.data_as<float>()[at + i], alone.keys.data_as<float>()[i])
                  << "heads " << heads << " row " << b << "," << h << " at " << i;
              ASSERT_EQ(together.values.data_as<float>()[at + i], alone.values.data_as<float>()[i])
                  << "heads " << heads << " row " << b << "," << h << " at " << i;
            }
          }
      }
}

}  // namespace

// Local kvtc codes with the 8-bit kernels by default (docs/kvtc.md "The
// 8-bit kernels"); int8=false brings back the 16-bit ones. Both meet the
// preset's target on the fit tokens (the fit measures with the kernels it
// codes with), their bytes differ, and each decodes what it coded; a bad
// value is refused by name; calibrated mode reads the field too.
TEST(KvtcLocal, Int8KernelsAreTheDefaultAndCanBeTurnedOff) {
  CacheConfig cfg;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 64;
  EXPECT_TRUE(parse_kvtc_settings({}, cfg).codec.int8_kernels);
  EXPECT_FALSE(parse_kvtc_settings({{"int8", "false"}}, cfg).codec.int8_kernels);
  const Tensor k = correlated(2, 256, 64, 21), v = correlated(2, 256, 64, 22);
  std::vector<double> stored;
  std::vector<KVPair> back;
  for (const char* int8 : {"true", "false"}) {
    auto cache = make_cache("kvtc", cfg, {{"int8", int8}, {"min_fit_tokens", "256"}});
    cache->append(k.view(), v.view());
    stored.push_back(double(cache->stats().compressed_bytes()));
    back.push_back(cache->fetch(DType::kF32));
    EXPECT_LE(rel_mse_f16(k, back.back().keys), kDefaultTargetRelMse) << "int8=" << int8;
    EXPECT_LE(rel_mse_f16(v, back.back().values), kDefaultTargetRelMse) << "int8=" << int8;
    EXPECT_GT(rel_mse_f16(k, back.back().keys), 0.5 * kDefaultTargetRelMse) << "int8=" << int8;
  }
  EXPECT_NE(std::memcmp(back[0].keys.data(), back[1].keys.data(), size_t(back[0].keys.numel()) * 4), 0);
  EXPECT_NEAR(stored[0], stored[1], 0.05 * stored[1]);  // the same target, about the same size
  try {
    make_cache("kvtc", cfg, {{"int8", "yes"}});
    ADD_FAILURE() << "int8=yes";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("int8"), std::string::npos) << e.what();
  }
  // Calibrated mode takes it too (its encoder's projection), true by default.
  EXPECT_FALSE(parse_kvtc_settings({{"calibration", "/nonexistent.kvcal"}, {"int8", "false"}}, cfg).codec.int8_kernels);
  EXPECT_TRUE(parse_kvtc_settings({{"calibration", "/nonexistent.kvcal"}}, cfg).codec.int8_kernels);
  EXPECT_THROW(parse_kvtc_settings({{"calibration", "/nonexistent.kvcal"}, {"int8", "no"}}, cfg), Error);
}

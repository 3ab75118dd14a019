// The cache contract (DESIGN 3), run on every method the factory lists (kvtc
// joins automatically), with H_kv = 2, D = 64, B = 1 and 2, on synthetic
// correlated data (low rank + noise, fixed seed).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"
#include "cache/mutant_dumps.hpp"
#include "format/reseal.hpp"
#include "kvcodec/error.hpp"

using namespace kvcodec;

namespace {

constexpr int kHeads = 2;
constexpr int kDim = 64;
constexpr int kPrefill = 160;  // >= every method's default min_fit_tokens (2 * D)

CacheConfig config() {
  CacheConfig c;
  c.layer = 1;
  c.n_layers = 4;
  c.n_kv_heads = kHeads;
  c.head_dim = kDim;
  return c;
}

// [B, H, T, D]: x = W z + noise with z of rank 8 and per-channel scales, so
// low-rank methods have structure to find and quantizers see uneven channels.
Tensor synthetic(int64_t batch, int64_t tokens, uint32_t seed, DType dtype) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  constexpr int kRank = 8;
  Tensor t(DType::kF32, {batch, kHeads, tokens, kDim});
  float* x = t.data_as<float>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < kHeads; ++h) {
      std::vector<float> w(kDim * kRank), scale(kDim), bias(kDim);
      for (auto& v : w) v = n01(rng);
      for (int d = 0; d < kDim; ++d) {
        scale[d] = 0.3f + 2.0f * float(d % 7) / 7.0f;
        bias[d] = 0.5f * n01(rng);
      }
      for (int64_t s = 0; s < tokens; ++s) {
        float z[kRank];
        for (float& v : z) v = n01(rng);
        for (int d = 0; d < kDim; ++d) {
          float acc = bias[d];
          for (int k = 0; k < kRank; ++k) acc += w[d * kRank + k] * z[k];
          x[((b * kHeads + h) * tokens + s) * kDim + d] = scale[d] * (acc + 0.05f * n01(rng));
        }
      }
    }
  return t.to(dtype);
}

struct Data {
  Tensor keys, values;
  TensorView k(int64_t begin, int64_t n) const { return keys.view().slice_tokens(begin, n); }
  TensorView v(int64_t begin, int64_t n) const { return values.view().slice_tokens(begin, n); }
};

Data make_data(int64_t batch, int64_t tokens, DType dtype) {
  return {synthetic(batch, tokens, 1234 + uint32_t(batch), dtype), synthetic(batch, tokens, 999 + uint32_t(batch), dtype)};
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && a.nbytes() == b.nbytes() &&
         std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

void expect_same_stats(const CacheStats& a, const CacheStats& b) {
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.compressed_key_bytes, b.compressed_key_bytes);
  EXPECT_EQ(a.compressed_value_bytes, b.compressed_value_bytes);
  EXPECT_EQ(a.fp16_key_bytes, b.fp16_key_bytes);
  EXPECT_EQ(a.fp16_value_bytes, b.fp16_value_bytes);
  EXPECT_EQ(a.extras, b.extras);
}

void expect_same_cache(const KVCache& a, const KVCache& b, DType dtype) {
  ASSERT_EQ(a.offset(), b.offset());
  const KVPair fa = a.fetch(dtype), fb = b.fetch(dtype);
  EXPECT_TRUE(same_bytes(fa.keys, fb.keys)) << "keys differ";
  EXPECT_TRUE(same_bytes(fa.values, fb.values)) << "values differ";
  expect_same_stats(a.stats(), b.stats());
}

double rel_mse(const Tensor& ref, const Tensor& got) {
  const Tensor r = ref.to(DType::kF32), g = got.to(DType::kF32);
  double num = 0, den = 0;
  for (int64_t i = 0; i < r.numel(); ++i) {
    const double d = double(r.data_as<float>()[i]) - double(g.data_as<float>()[i]);
    num += d * d;
    den += double(r.data_as<float>()[i]) * r.data_as<float>()[i];
  }
  return num / den;
}

// Bytes counted as compressed must be the saved bytes less the container's
// framing and the meta (the cache's configuration). A method may document a
// constant it stores beyond its counted bytes:
//   kvtc: its "state" section, 26 bytes (u64 batch, u64 offset, u8 fitted,
//         u8 raw dtype, u64 block count; see kvtc_cache.cpp "persistence").
//   the stream caches (fp16, int8, int4, kivi2, palu): 0 (shape and token
//         count live in the meta; everything in "key"/"value" is counted).
uint64_t uncounted_constant(const std::string& method) { return method == "kvtc" ? 26 : 0; }

void expect_honest_bytes(const KVCache& c) {
  const std::vector<uint8_t> saved = c.save();
  const ContainerReader r = ContainerReader::parse(saved.data(), saved.size());
  const size_t overhead = container_overhead(r.meta(), r.section_names());
  const CacheStats st = c.stats();
  EXPECT_EQ(st.compressed_bytes() + overhead + uncounted_constant(c.method()), saved.size())
      << c.method() << " at " << c.offset() << " tokens";
}

using Param = std::tuple<std::string, int>;

class Contract : public ::testing::TestWithParam<Param> {
 protected:
  std::string method() const { return std::get<0>(GetParam()); }
  int batch() const { return std::get<1>(GetParam()); }
  std::unique_ptr<KVCache> make() const { return make_cache(method(), config()); }
};

TEST_P(Contract, OneAtATimeEqualsOneCall) {
  const int64_t total = 300;
  const Data d = make_data(batch(), total, DType::kBF16);
  auto a = make(), b = make();
  a->append(d.k(0, kPrefill), d.v(0, kPrefill));
  b->append(d.k(0, kPrefill), d.v(0, kPrefill));
  for (int64_t t = kPrefill; t < total; ++t) a->append(d.k(t, 1), d.v(t, 1));
  b->append(d.k(kPrefill, total - kPrefill), d.v(kPrefill, total - kPrefill));
  EXPECT_EQ(a->offset(), total);
  expect_same_cache(*a, *b, DType::kBF16);
  EXPECT_EQ(a->save(), b->save());
}

TEST_P(Contract, TrimThenAppendEqualsNeverSeen) {
  // 260 tokens; trimming the 4 newest cuts no completed group/block of any
  // method here (groups of 32, blocks of 64, KIVI keys quantized up to 128).
  const int64_t total = 260, cut = 4, more = 20;
  const Data d = make_data(batch(), total + more, DType::kBF16);
  auto a = make(), b = make();
  ASSERT_TRUE(a->is_trimmable());
  a->append(d.k(0, kPrefill), d.v(0, kPrefill));
  a->append(d.k(kPrefill, total - kPrefill), d.v(kPrefill, total - kPrefill));
  const KVPair before = a->fetch(DType::kF32);
  EXPECT_EQ(a->trim(cut), cut);
  EXPECT_EQ(a->offset(), total - cut);
  // Surviving tokens reconstruct exactly as before the trim.
  const KVPair after = a->fetch(DType::kF32);
  const size_t row = kDim * sizeof(float);
  for (int64_t bh = 0; bh < batch() * kHeads; ++bh) {
    EXPECT_EQ(0, std::memcmp(after.keys.data_as<float>() + bh * (total - cut) * kDim,
                             before.keys.data_as<float>() + bh * total * kDim, size_t(total - cut) * row));
    EXPECT_EQ(0, std::memcmp(after.values.data_as<float>() + bh * (total - cut) * kDim,
                             before.values.data_as<float>() + bh * total * kDim, size_t(total - cut) * row));
  }
  expect_honest_bytes(*a);

  b->append(d.k(0, kPrefill), d.v(0, kPrefill));
  b->append(d.k(kPrefill, total - cut - kPrefill), d.v(kPrefill, total - cut - kPrefill));
  // KIVI's raw window slides with every token: after a trim it holds fewer raw
  // tokens than a cache that never saw them (those were quantized when they
  // left the window and cannot be un-quantized), so only the shared parts match.
  const bool window_slides = method() == "kivi2";
  if (!window_slides) expect_same_cache(*a, *b, DType::kF32);
  a->append(d.k(total - cut, more), d.v(total - cut, more));
  b->append(d.k(total - cut, more), d.v(total - cut, more));
  EXPECT_EQ(a->offset(), b->offset());
  if (!window_slides) {
    expect_same_cache(*a, *b, DType::kF32);
    EXPECT_EQ(a->save(), b->save());
  } else {
    EXPECT_LE(a->stats().compressed_bytes(), b->stats().compressed_bytes());
  }
  // Trimming more than held drops everything held.
  // (held is read first: the evaluation order of EXPECT_EQ's two arguments is
  // unspecified, and clang evaluates trim() before offset()).
  const int64_t held = a->offset();
  EXPECT_EQ(held, total - cut + more);
  EXPECT_EQ(a->trim(100000), held);
  EXPECT_EQ(a->offset(), 0);
  EXPECT_EQ(a->stats().fp16_bytes(), 0u);
  EXPECT_EQ(a->trim(0), 0);
  EXPECT_THROW(a->trim(-1), Error);
}

TEST_P(Contract, SaveLoadIsExactAndContinues) {
  const int64_t total = 230, more = 40;
  const Data d = make_data(batch(), total + more, DType::kBF16);
  auto a = make();
  a->append(d.k(0, kPrefill), d.v(0, kPrefill));
  a->append(d.k(kPrefill, total - kPrefill), d.v(kPrefill, total - kPrefill));
  const std::vector<uint8_t> saved = a->save();
  auto b = load_cache(saved.data(), saved.size());
  ASSERT_EQ(b->method(), method());
  EXPECT_EQ(b->config().layer, 1);
  EXPECT_EQ(b->config().n_layers, 4);
  expect_same_cache(*a, *b, DType::kBF16);
  EXPECT_EQ(b->save(), saved);
  a->append(d.k(total, more), d.v(total, more));
  b->append(d.k(total, more), d.v(total, more));
  expect_same_cache(*a, *b, DType::kBF16);
  // Loading into a cache made by make_cache with the same settings works too.
  auto c = make();
  c->load(saved.data(), saved.size());
  EXPECT_EQ(c->offset(), total);
  // An empty cache saves and loads.
  auto e = make();
  const auto es = e->save();
  auto e2 = load_cache(es.data(), es.size());
  EXPECT_EQ(e2->offset(), 0);
}

TEST_P(Contract, DtypeInDtypeOut) {
  for (DType dt : {DType::kBF16, DType::kF16}) {
    const Data d = make_data(batch(), 200, dt);
    auto c = make();
    const KVPair out = c->update_and_fetch(d.k(0, 200), d.v(0, 200));
    EXPECT_EQ(out.keys.dtype(), dt);
    EXPECT_EQ(out.values.dtype(), dt);
    EXPECT_EQ(out.keys.shape(), (Shape4{batch(), kHeads, 200, kDim}));
  }
  // bf16 above the f16 range: never Inf/NaN; exact where the method keeps
  // the token raw (fp16 always, KIVI for the newest tokens).
  Data d = make_data(batch(), 200, DType::kF32);
  float* k = d.keys.data_as<float>();
  for (int64_t i = 0; i < d.keys.numel(); i += 97) k[i] *= 4000.0f;  // some |x| > 65504
  k[199 * kDim + 3] = 1.0e5f;                                         // newest token, head 0
  d.keys = d.keys.to(DType::kBF16);
  d.values = d.values.to(DType::kBF16);
  auto c = make();
  const KVPair out = c->update_and_fetch(d.k(0, 200), d.v(0, 200));
  const Tensor got = out.keys.to(DType::kF32);
  for (int64_t i = 0; i < got.numel(); ++i) ASSERT_TRUE(std::isfinite(got.data_as<float>()[i])) << i;
  if (method() == "fp16") {
    EXPECT_TRUE(same_bytes(out.keys, d.keys));
  }
  if (method() == "fp16" || method() == "kivi2") {
    EXPECT_EQ(got.data_as<float>()[199 * kDim + 3], bf16_to_f32(f32_to_bf16(1.0e5f)));
  }
}

TEST_P(Contract, TelemetryIsHonest) {
  const Data d = make_data(batch(), 300, DType::kBF16);
  auto c = make();
  expect_honest_bytes(*c);
  c->append(d.k(0, 50), d.v(0, 50));  // before any fit
  expect_honest_bytes(*c);
  c->append(d.k(50, 150), d.v(50, 150));
  expect_honest_bytes(*c);
  for (int64_t t = 200; t < 300; ++t) c->append(d.k(t, 1), d.v(t, 1));
  expect_honest_bytes(*c);
  const CacheStats st = c->stats();
  EXPECT_EQ(st.tokens, 300);
  EXPECT_EQ(st.fp16_key_bytes, uint64_t(300) * batch() * kHeads * kDim * 2);
  EXPECT_EQ(st.fp16_value_bytes, st.fp16_key_bytes);
  EXPECT_EQ(st.method, method());
  if (method() == "fp16") {
    EXPECT_DOUBLE_EQ(st.compression_ratio(), 1.0);
  } else {
    EXPECT_GT(st.compression_ratio(), 1.5) << method();
  }
}

// Memory as held (CacheStats::resident_bytes): never below the bytes stored,
// and for fp16, whose stored bytes are its f16 tokens, the f16 size plus the
// objects' own few hundred bytes. No stream cache shares anything.
TEST_P(Contract, ResidentBytesCoverWhatIsStored) {
  const Data d = make_data(batch(), 300, DType::kBF16);
  auto c = make();
  c->append(d.k(0, 200), d.v(0, 200));
  for (int64_t t = 200; t < 300; ++t) c->append(d.k(t, 1), d.v(t, 1));
  const CacheStats st = c->stats();
  EXPECT_GE(st.resident_bytes, st.compressed_bytes()) << method();
  EXPECT_GT(st.resident_ratio(), 0.0);
  EXPECT_EQ(st.shared_bytes(), 0u) << method();
  // One append of everything: vectors sized once, nothing left over from growth.
  auto once = make();
  once->append(d.k(0, 300), d.v(0, 300));
  const CacheStats one = once->stats();
  EXPECT_GE(one.resident_bytes, one.compressed_bytes()) << method();
  if (method() == "fp16") {
    EXPECT_GE(one.resident_bytes, one.fp16_bytes());
    EXPECT_LE(one.resident_bytes, one.fp16_bytes() + 1024);
  }
  // int8 / int4 hold their fixed-size rows and nothing else.
  if (method() == "int8" || method() == "int4") {
    EXPECT_LE(one.resident_bytes, one.compressed_bytes() + 1024) << method();
  }
  // A prefill's raw tokens, once coded, are given back: a compressed method
  // without per-cache parameters holds less than f16 would after a one-call
  // prefill (palu and kvtc also hold fitted projections and tables, which
  // 300 tokens do not pay for).
  if (method() == "int8" || method() == "int4" || method() == "kivi2") {
    EXPECT_LT(one.resident_bytes, one.fp16_bytes()) << method();
  }
}

// A loaded mutant must be usable: every read and a save work (or throw an
// Error), never a crash or an out-of-bounds access (ASan build).
void use_loaded(const KVCache& c) {
  try {
    (void)c.stats();
    (void)c.fetch(DType::kF32);
    (void)c.save();
  } catch (const Error&) {
  }
}

// Every byte flipped, then the container sealed again (format/reseal.hpp), so
// the corruption reaches load() past the checksums: each either loads a
// usable cache or is refused with an Error. The meta and the small state
// sections must be refused more often than not (a loader that checked
// nothing would accept nearly all of them).
TEST_P(Contract, AnyCorruptedByteFailsCleanly) {
  const Data d = make_data(batch(), 140, DType::kBF16);
  auto c = make();
  c->append(d.k(0, 140), d.v(0, 140));
  const std::vector<uint8_t> saved = c->save();
  // Every header byte, then a stride through the payload (keeps ASan runs short).
  const size_t stride = std::max<size_t>(1, saved.size() / 1500);
  size_t refused = 0, tried = 0;
  for (size_t i = 0; i < saved.size(); i += (i < 600 ? 1 : stride)) {
    std::vector<uint8_t> bad = saved;
    bad[i] ^= uint8_t(0x5a);
    if (!testing_reseal::reseal(bad)) {
      EXPECT_THROW(load_cache(bad.data(), bad.size()), Error) << "byte " << i;
      continue;
    }
    ++tried;
    try {
      use_loaded(*load_cache(bad.data(), bad.size()));
    } catch (const Error&) {
      ++refused;
    }
  }
  EXPECT_GT(tried, 0u);
  EXPECT_GT(refused, 0u) << "no resealed corruption was refused by " << method() << "'s load()";
  for (size_t n : {size_t(0), size_t(7), saved.size() / 2, saved.size() - 1}) {
    EXPECT_THROW(load_cache(saved.data(), n), Error) << "truncated to " << n;
  }
}

// Random sealed mutants (format/reseal.hpp) through load_cache: no crash, no
// hang, each loads a usable cache or throws an Error. KVCODEC_MUTANTS sets the
// count (default 300; the campaigns in docs/format.md run 100,000 under ASan).
TEST_P(Contract, SealedMutantsLoadOrFailCleanly) {
  const Data d = make_data(batch(), 140, DType::kBF16);
  auto c = make();
  c->append(d.k(0, 140), d.v(0, 140));
  const std::vector<uint8_t> saved = c->save();
  const char* env = std::getenv("KVCODEC_MUTANTS");
  const long n = env ? std::atol(env) : 300;
  std::mt19937_64 rng(testing_reseal::mutant_seed(77 + uint64_t(batch())));
  long refused = 0;
  for (long i = 0; i < n; ++i) {
    const std::vector<uint8_t> bad = testing_reseal::sealed_mutant(saved, rng);
    try {
      use_loaded(*load_cache(bad.data(), bad.size()));
    } catch (const Error&) {
      ++refused;
    }
  }
  std::printf("%s B=%d: %ld sealed mutants, %ld refused, %ld loaded\n", method().c_str(), batch(), n, refused,
              n - refused);
  if (batch() == 1) {  // files for the kvcodec decompress campaign (a layer-0 cache: the dump's only layer)
    CacheConfig layer0 = config();
    layer0.layer = 0;
    layer0.n_layers = 1;
    auto c0 = make_cache(method(), layer0);
    c0->append(d.k(0, 140), d.v(0, 140));
    testing_reseal::write_dump_mutants(*c0, method(), 99);
  }
  if (n >= 100) {
    EXPECT_GT(refused, 0);
  }
}

// A failed load leaves the cache as it was (strong guarantee).
TEST_P(Contract, FailedLoadLeavesCacheUnchanged) {
  const Data d = make_data(batch(), 140, DType::kBF16);
  auto a = make();
  a->append(d.k(0, 140), d.v(0, 140));
  auto b = make();
  b->append(d.k(0, 90), d.v(0, 90));
  const std::vector<uint8_t> before = b->save();
  // a's bytes, with its token count (or the kvtc state's) one too high.
  std::vector<uint8_t> bad = a->save();
  bad = testing_reseal::edit_container(bad, [](testing_reseal::Meta& meta, testing_reseal::Sections& sections) {
    if (meta.count("tokens")) meta["tokens"] = std::to_string(std::stoll(meta["tokens"]) + 1);
    for (auto& [name, payload] : sections)
      if (name == "state") payload[8] = uint8_t(payload[8] + 1);  // u64 offset, low byte
  });
  EXPECT_THROW(b->load(bad.data(), bad.size()), Error);
  EXPECT_EQ(b->save(), before);
  EXPECT_EQ(b->offset(), 90);
}

TEST_P(Contract, ReconstructionErrorWithinMethodBound) {
  const int64_t total = 600;
  const Data d = make_data(batch(), total, DType::kF32);
  auto c = make();
  c->append(d.k(0, kPrefill), d.v(0, kPrefill));
  c->append(d.k(kPrefill, total - kPrefill), d.v(kPrefill, total - kPrefill));
  const KVPair out = c->fetch(DType::kF32);
  const double ek = rel_mse(d.keys, out.keys), ev = rel_mse(d.values, out.values);
  // Bounds: f16 rounding ~1e-7; q8_0 ~1e-4; q4_0 ~1e-2; 2-bit KIVI (4 levels per group: ~0.16 on Gaussian-like data) and the
  // low-rank + 2/4-bit PALU latents are lossy by design.
  const std::map<std::string, double> bound = {{"fp16", 1e-6}, {"int8", 1e-3}, {"int4", 0.03},
                                               {"kivi2", 0.25}, {"palu", 0.25}, {"kvtc", 0.1}};
  const double b = bound.count(method()) ? bound.at(method()) : 0.2;
  EXPECT_LT(ek, b) << method();
  EXPECT_LT(ev, b) << method();
  EXPECT_GT(ek + ev, 0.0);
  RecordProperty("rel_mse_key", std::to_string(ek));
  std::printf("[%s B=%d] rel_mse key %.3g value %.3g ratio %.2f\n", method().c_str(), batch(), ek, ev,
              c->stats().compression_ratio());
}

TEST_P(Contract, BadConfigNamesFieldAndValue) {
  try {
    make_cache(method(), config(), {{"no_such_field", "3"}});
    FAIL() << "unknown field accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kConfig);
    EXPECT_NE(std::string(e.what()).find("no_such_field"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("3"), std::string::npos) << e.what();
  }
  for (const MethodInfo& m : list_methods()) {
    if (m.name != method()) continue;
    for (const FieldInfo& f : m.fields) {
      if (f.name == "calibration") continue;  // a path: checked when opened
      try {
        make_cache(method(), config(), {{f.name, "@bad@"}});
        ADD_FAILURE() << method() << "." << f.name << " accepted '@bad@'";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kConfig) << f.name;
        EXPECT_NE(std::string(e.what()).find(f.name), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("@bad@"), std::string::npos) << e.what();
      }
    }
  }
  CacheConfig bad = config();
  bad.head_dim = 0;
  EXPECT_THROW(make_cache(method(), bad), Error);
}

TEST_P(Contract, ShapeMismatchIsReported) {
  const Data d = make_data(batch(), 20, DType::kBF16);
  auto c = make();
  c->append(d.k(0, 10), d.v(0, 10));
  const Data other = make_data(batch() + 1, 4, DType::kBF16);
  try {
    c->append(other.k(0, 4), other.v(0, 4));
    FAIL() << "batch change accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kShapeMismatch);
  }
  EXPECT_THROW(c->append(d.k(10, 4), d.v(10, 5)), Error);  // keys and values differ
  // Keys and values in different dtypes (every method: one check, cache/append_checks.hpp).
  const Data f16 = make_data(batch(), 20, DType::kF16);
  try {
    c->append(d.k(10, 4), f16.v(10, 4));
    FAIL() << "keys bf16 with values f16 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kShapeMismatch) << e.what();
  }
  Tensor wrong(DType::kBF16, {batch(), kHeads, 3, kDim / 2});
  EXPECT_THROW(c->append(wrong.view(), wrong.view()), Error);
  EXPECT_EQ(c->offset(), 10);
  c->append(d.k(10, 10), d.v(10, 10));  // still usable
  EXPECT_EQ(c->offset(), 20);
}

std::vector<std::string> method_names() {
  std::vector<std::string> out;
  for (const auto& m : list_methods()) out.push_back(m.name);
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllMethods, Contract,
                         ::testing::Combine(::testing::ValuesIn(method_names()), ::testing::Values(1, 2)),
                         [](const ::testing::TestParamInfo<Param>& p) {
                           return std::get<0>(p.param) + "_B" + std::to_string(std::get<1>(p.param));
                         });

TEST(Factory, ListsEveryMethodWithDefaults) {
  const auto methods = list_methods();
  for (const char* name : {"fp16", "int8", "int4", "kivi2", "palu"}) {
    const auto it = std::find_if(methods.begin(), methods.end(), [&](const MethodInfo& m) { return m.name == name; });
    ASSERT_NE(it, methods.end()) << name;
    EXPECT_FALSE(it->description.empty());
  }
  try {
    make_cache("nope", config());
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("palu"), std::string::npos);
  }
}

TEST(Factory, RangeErrorsNameFieldValueAndRange) {
  auto expect_config = [](const std::string& m, const Settings& s, const std::string& needle) {
    try {
      make_cache(m, config(), s);
      ADD_FAILURE() << m << " accepted " << s.begin()->first << "=" << s.begin()->second;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kConfig);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_config("int8", {{"group_size", "48"}}, "divisor of head_dim = 64");
  expect_config("int4", {{"group_size", "0"}}, "group_size = 0");
  expect_config("kivi2", {{"residual", "-1"}}, "residual = -1");
  expect_config("palu", {{"rank", "65"}}, "[1, 64]");
  expect_config("palu", {{"energy_threshold", "0"}}, "energy_threshold = 0");
  expect_config("palu", {{"group_mode", "diagonal"}}, "shared|joint");
  expect_config("palu", {{"hi_bit", "9"}}, "hi_bit = 9");
  expect_config("palu", {{"hadamard", "maybe"}}, "true or false");
  // Valid non-defaults are taken.
  EXPECT_NO_THROW(make_cache("palu", config(), {{"rank", "none"}, {"group_mode", "joint"}, {"hadamard", "true"}}));
  EXPECT_NO_THROW(make_cache("palu", config(), {{"rank", "100"}, {"group_mode", "joint"}, {"n_head_groups", "1"}}));
}

TEST(Factory, SettingsForMethod) {
  const Settings s = settings_for_method({"palu.rank=16", "kvtc.bit_budget=256", "palu.hadamard=true"}, "palu");
  EXPECT_EQ(s.size(), 2u);
  EXPECT_EQ(s.at("rank"), "16");
  EXPECT_THROW(settings_for_method({"rank16"}, "palu"), Error);
}

TEST(Factory, LoadCacheRejectsForeignBytes) {
  const std::vector<uint8_t> junk(100, 0x41);
  EXPECT_THROW(load_cache(junk.data(), junk.size()), Error);
  EXPECT_THROW(load_cache(nullptr, 0), Error);
  // A cache of another method refuses to load it.
  auto a = make_cache("int8", config());
  const Data d = make_data(1, 10, DType::kBF16);
  a->append(d.k(0, 10), d.v(0, 10));
  const auto saved = a->save();
  auto b = make_cache("int4", config());
  EXPECT_THROW(b->load(saved.data(), saved.size()), Error);
  auto c = make_cache("int8", config(), {{"group_size", "16"}});
  EXPECT_THROW(c->load(saved.data(), saved.size()), Error);
}

}  // namespace

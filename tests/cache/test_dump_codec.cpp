// kvcodec compress / decompress / inspect's library side (src/cache/dump_codec):
// a whole KV dump through each method into one container and back.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <tuple>
#include <unistd.h>

#include "cache/dump_codec.hpp"
#include "kvcodec/error.hpp"

using namespace kvcodec;

namespace {

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() /
           ("kvcodec-dump-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
  static int& counter() {
    static int c = 0;
    return c;
  }
};

Tensor random_tensor(DType dtype, const Shape4& shape, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> x(size_t(numel(shape)));
  // Correlated along D, like real keys: something for PCA to find.
  for (size_t i = 0; i < x.size(); ++i) x[i] = g(rng) + 2.f * std::sin(0.3f * float(i % size_t(shape[3])) + float(i / 997));
  Tensor t(dtype, shape);
  convert(x.data(), DType::kF32, t.data(), dtype, x.size());
  return t;
}

// A dump of `layers` layers [B, H, T, D] written to path; returns the tensors.
std::vector<std::pair<Tensor, Tensor>> write_dump(const std::string& path, int layers, DType dtype, const Shape4& shape) {
  SafetensorsWriter w;
  std::vector<std::pair<Tensor, Tensor>> out;
  for (int i = 0; i < layers; ++i) {
    out.emplace_back(random_tensor(dtype, shape, 10u + uint32_t(i)), random_tensor(dtype, shape, 100u + uint32_t(i)));
    w.add("layers." + std::to_string(i) + ".key", out.back().first.view());
    w.add("layers." + std::to_string(i) + ".value", out.back().second.view());
  }
  w.write(path);
  return out;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return {p, p + t.nbytes()};
}

const Shape4 kShape{1, 2, 200, 32};

}  // namespace

// Every method: the decompressed dump equals what a cache fed the same tensors
// reconstructs, bit for bit, in the dump's dtype and in another one.
TEST(DumpCodec, EveryMethodRoundTripsLikeItsCache) {
  TempDir dir;
  const auto tensors = write_dump(dir.file("kv.safetensors"), 2, DType::kBF16, kShape);
  const dump::KvDump kv = dump::read_kv_dump(dir.file("kv.safetensors"));
  ASSERT_EQ(kv.n_layers(), 2);
  EXPECT_EQ(kv.dtype, DType::kBF16);
  EXPECT_EQ(kv.f16_bytes(), uint64_t(2 * 2 * numel(kShape) * 2));
  const std::vector<std::pair<std::string, Settings>> runs = {
      {"fp16", {}}, {"int8", {}}, {"int4", {}}, {"kivi2", {{"residual", "32"}}},
      {"palu", {{"min_fit_tokens", "32"}, {"group_size", "16"}}},
      {"kvtc", {{"min_fit_tokens", "32"}, {"block", "16"}}}};
  for (const auto& [method, settings] : runs) {
    SCOPED_TRACE(method);
    dump::CompressOptions o;
    o.method = method;
    o.settings = settings;
    o.threads = 2;
    int calls = 0;
    o.progress = [&](int done, int total) {
      ++calls;
      EXPECT_LE(done, total);
    };
    const std::vector<uint8_t> file = dump::compress_dump(kv, o);
    EXPECT_EQ(calls, 2);
    const ContainerReader c = ContainerReader::parse(file.data(), file.size());
    const dump::CompressedDump d = dump::open_compressed_dump(c);
    EXPECT_EQ(d.method, method);
    EXPECT_EQ(d.shape, kShape);
    EXPECT_EQ(d.dtype, DType::kBF16);
    // The file holds the caches' bytes plus framing only.
    EXPECT_GE(file.size(), d.stats().compressed_bytes());
    EXPECT_EQ(d.stats().fp16_bytes(), kv.f16_bytes());
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      const std::vector<uint8_t> st = dump::decompress_dump(d, dtype).to_bytes();
      const SafetensorsFile back = SafetensorsFile::from_bytes(st);
      for (int i = 0; i < 2; ++i) {
        CacheConfig cfg;
        cfg.layer = i;
        cfg.n_layers = 2;
        cfg.n_kv_heads = int(kShape[1]);
        cfg.head_dim = int(kShape[3]);
        auto fresh = make_cache(method, cfg, settings);
        fresh->append(tensors[size_t(i)].first.view(), tensors[size_t(i)].second.view());
        const KVPair want = fresh->fetch(dtype);
        const Tensor k = back.tensor("layers." + std::to_string(i) + ".key", dtype);
        const Tensor v = back.tensor("layers." + std::to_string(i) + ".value", dtype);
        EXPECT_EQ(k.shape(), kShape);
        EXPECT_EQ(bytes_of(k), bytes_of(want.keys));
        EXPECT_EQ(bytes_of(v), bytes_of(want.values));
      }
    }
  }
}

TEST(DumpCodec, Fp16OfAnF16DumpIsLossless) {
  TempDir dir;
  const auto tensors = write_dump(dir.file("kv.safetensors"), 3, DType::kF16, {2, 1, 40, 8});
  dump::CompressOptions o;
  o.method = "fp16";
  const std::vector<uint8_t> file = dump::compress_dump(dump::read_kv_dump(dir.file("kv.safetensors")), o);
  const ContainerReader c = ContainerReader::parse(file.data(), file.size());
  const dump::CompressedDump d = dump::open_compressed_dump(c);
  const SafetensorsFile back = SafetensorsFile::from_bytes(dump::decompress_dump(d, d.dtype).to_bytes());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(bytes_of(back.tensor("layers." + std::to_string(i) + ".key", DType::kF16)), bytes_of(tensors[size_t(i)].first));
    EXPECT_EQ(bytes_of(back.tensor("layers." + std::to_string(i) + ".value", DType::kF16)),
              bytes_of(tensors[size_t(i)].second));
  }
}

TEST(DumpCodec, BadDumpsAreRefusedNamingWhatIsWrong) {
  TempDir dir;
  const Tensor a = random_tensor(DType::kF32, kShape, 1), b = random_tensor(DType::kF32, {1, 2, 100, 32}, 2);
  const Tensor h = random_tensor(DType::kF16, kShape, 3);
  auto expect_error = [&](const std::string& name, const std::vector<std::pair<std::string, const Tensor*>>& ts,
                          const std::string& needle) {
    SafetensorsWriter w;
    for (const auto& [n, t] : ts) w.add(n, t->view());
    w.write(dir.file(name));
    try {
      (void)dump::read_kv_dump(dir.file(name));
      ADD_FAILURE() << name << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error("novalue.safetensors", {{"layers.0.key", &a}}, "layers.0.value");
  expect_error("nolayers.safetensors", {{"weights", &a}}, "not a KV dump");
  expect_error("shape.safetensors", {{"layers.0.key", &a}, {"layers.0.value", &b}}, "[1, 2, 100, 32]");
  expect_error("layer1.safetensors",
               {{"layers.0.key", &a}, {"layers.0.value", &a}, {"layers.1.key", &b}, {"layers.1.value", &b}},
               "differs from layer 0");
  expect_error("dtype.safetensors",
               {{"layers.0.key", &a}, {"layers.0.value", &a}, {"layers.1.key", &h}, {"layers.1.value", &h}},
               "one dtype per dump");
  // A bad method or setting fails before any layer is compressed.
  write_dump(dir.file("ok.safetensors"), 1, DType::kF32, kShape);
  const dump::KvDump kv = dump::read_kv_dump(dir.file("ok.safetensors"));
  dump::CompressOptions o;
  o.method = "nope";
  EXPECT_THROW(dump::compress_dump(kv, o), Error);
  o.method = "int4";
  o.settings = {{"group_size", "-3"}};
  EXPECT_THROW(dump::compress_dump(kv, o), Error);
}

TEST(DumpCodec, DamagedOrLyingContainersAreRefused) {
  TempDir dir;
  write_dump(dir.file("kv.safetensors"), 2, DType::kF32, kShape);
  const dump::KvDump kv = dump::read_kv_dump(dir.file("kv.safetensors"));
  dump::CompressOptions o;
  o.method = "int8";
  const std::vector<uint8_t> good = dump::compress_dump(kv, o);
  // Any flipped byte: the container's checksums catch it.
  for (size_t pos = 0; pos < good.size(); pos += 97) {
    std::vector<uint8_t> bad = good;
    bad[pos] ^= 0x5a;
    EXPECT_THROW(dump::open_compressed_dump(ContainerReader::parse(bad.data(), bad.size())), Error) << pos;
  }
  // Well-formed containers whose metadata disagrees with their sections.
  const ContainerReader c = ContainerReader::parse(good.data(), good.size());
  auto rewrite = [&](const std::string& key, const std::string& value, bool drop_last = false) {
    ContainerWriter w(ContainerKind::kDump);
    for (const auto& [k, v] : c.meta()) w.set_meta(k, v);
    w.set_meta(key, value);
    const auto names = c.section_names();
    for (size_t i = 0; i < names.size() - (drop_last ? 1 : 0); ++i) {
      const auto s = c.section(names[i]);
      w.add_section(names[i], std::vector<uint8_t>(s.begin(), s.end()));
    }
    return w.finish();
  };
  for (const auto& [key, value, drop] : std::vector<std::tuple<std::string, std::string, bool>>{
           {"n_layers", "3", false},  {"n_layers", "2", true},   {"tokens", "201", false},
           {"heads", "4", false},     {"method", "int4", false}, {"format", "other", false},
           {"n_layers", "-1", false}, {"dtype", "f64", false}}) {
    const std::vector<uint8_t> bad = rewrite(key, value, drop);
    EXPECT_THROW(dump::open_compressed_dump(ContainerReader::parse(bad.data(), bad.size())), Error) << key << "=" << value;
  }
  ContainerWriter other(ContainerKind::kCalibration);
  const std::vector<uint8_t> cal = other.finish();
  EXPECT_THROW(dump::open_compressed_dump(ContainerReader::parse(cal.data(), cal.size())), Error);
}

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>

#include "kvcodec/error.hpp"
#include "kvcodec/safetensors.hpp"
#include "kvcodec/tensor.hpp"

using namespace kvcodec;

namespace {

std::string temp_path(const std::string& stem) {
  return ::testing::TempDir() + "kvcodec_st_" + std::to_string(::getpid()) + "_" + stem;
}

bool file_exists(const std::string& p) { return std::ifstream(p).good(); }

// A raw safetensors blob with a hand-written header (for malformed cases).
std::vector<uint8_t> blob(const std::string& header, size_t data_bytes, uint64_t declared_len = UINT64_MAX) {
  const uint64_t n = declared_len == UINT64_MAX ? header.size() : declared_len;
  std::vector<uint8_t> out(8 + header.size() + data_bytes, 0xab);
  for (int i = 0; i < 8; ++i) out[i] = uint8_t(n >> (8 * i));
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

// Expects from_bytes to throw kFormat with `needle` in the message.
void expect_format_error(const std::vector<uint8_t>& bytes, const std::string& needle) {
  try {
    SafetensorsFile::from_bytes(bytes, "bad.safetensors");
    FAIL() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kFormat) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad.safetensors"), std::string::npos) << e.what();
  }
}

Tensor random_tensor(DType dtype, const Shape4& shape, uint32_t seed) {
  Tensor f(DType::kF32, shape);
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  for (int64_t i = 0; i < f.numel(); ++i) f.data_as<float>()[i] = dist(rng);
  return f.to(dtype);
}

}  // namespace

TEST(Safetensors, RoundTripAllFloatDtypesAndMetadata) {
  const Tensor a = random_tensor(DType::kF32, {1, 2, 5, 8}, 1);
  const Tensor b = random_tensor(DType::kF16, {2, 1, 3, 4}, 2);
  const Tensor c = random_tensor(DType::kBF16, {1, 3, 7, 2}, 3);
  SafetensorsWriter w;
  w.add("layers.0.key", a.view());
  w.add("layers.0.value", b.view());
  w.add("layers.1.key", c.view());
  std::vector<uint8_t> ids(3 * 8);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = uint8_t(i);
  w.add("input_ids", "I64", {1, 3}, ids);
  w.add_metadata("model", "tiny");
  w.add_metadata("layout", "[B, H, S, D]");
  const std::string path = temp_path("rt.safetensors");
  w.write(path);

  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.names(), (std::vector<std::string>{"input_ids", "layers.0.key", "layers.0.value", "layers.1.key"}));
  EXPECT_EQ(f.metadata().at("model"), "tiny");
  EXPECT_EQ(f.metadata().at("layout"), "[B, H, S, D]");
  EXPECT_TRUE(f.contains("layers.1.key"));
  EXPECT_FALSE(f.contains("layers.2.key"));

  for (const auto& [name, t] : std::vector<std::pair<std::string, const Tensor*>>{
           {"layers.0.key", &a}, {"layers.0.value", &b}, {"layers.1.key", &c}}) {
    const TensorView v = f.view4(name);
    EXPECT_EQ(v.dtype, t->dtype()) << name;
    EXPECT_EQ(v.shape, t->shape()) << name;
    ASSERT_EQ(std::memcmp(v.data, t->data(), t->nbytes()), 0) << name;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data) % dtype_size(v.dtype), 0u) << name;
    const std::vector<float> as_f32 = f.read_f32(name);
    const Tensor expect = t->to(DType::kF32);
    ASSERT_EQ(as_f32.size(), size_t(expect.numel()));
    EXPECT_EQ(std::memcmp(as_f32.data(), expect.data(), expect.nbytes()), 0) << name;
    EXPECT_EQ(f.info(name).shape.size(), 4u);
  }
  EXPECT_EQ(f.info("input_ids").dtype, "I64");
  EXPECT_EQ(std::memcmp(f.raw("input_ids"), ids.data(), ids.size()), 0);
  // Non-float tensors are listed but refused as KV, with a clear reason.
  try {
    f.view4("input_ids");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("I64"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("input_ids"), std::string::npos) << e.what();
  }
  EXPECT_THROW(f.read_f32("input_ids"), Error);
  try {
    f.info("nope");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_NE(std::string(e.what()).find("nope"), std::string::npos);
  }
  // The atomic writer leaves no temporary file behind.
  std::remove(path.c_str());
}

TEST(Safetensors, LowerRankPaddedAndStridedViewWrittenContiguous) {
  SafetensorsWriter w;
  std::vector<uint8_t> bytes(6 * 4);
  for (int i = 0; i < 6; ++i) {
    const float v = float(i) * 0.5f;
    std::memcpy(bytes.data() + 4 * i, &v, 4);
  }
  w.add("m", "F32", {2, 3}, bytes);
  // A strided view (every other token) must be written as its logical contents.
  const Tensor full = random_tensor(DType::kF32, {1, 1, 6, 4}, 7);
  TensorView strided = full.view();
  strided.shape = {1, 1, 3, 4};
  strided.strides = {24, 24, 8, 1};
  w.add("s", strided);
  const SafetensorsFile f = SafetensorsFile::from_bytes(w.to_bytes());
  const TensorView m = f.view4("m");
  EXPECT_EQ(m.shape, (Shape4{1, 1, 2, 3}));
  EXPECT_FLOAT_EQ(m.at(0, 0, 1, 2), 2.5f);
  const TensorView s = f.view4("s");
  for (int t = 0; t < 3; ++t)
    for (int d = 0; d < 4; ++d) EXPECT_EQ(s.at(0, 0, t, d), full.view().at(0, 0, 2 * t, d));
}

TEST(Safetensors, WriterRejectsBadInput) {
  SafetensorsWriter w;
  EXPECT_THROW(w.add("x", "F32", {2, 2}, std::vector<uint8_t>(15)), Error);
  EXPECT_THROW(w.add("x", "Q4", {1}, std::vector<uint8_t>(1)), Error);
  EXPECT_THROW(w.add("x", "F32", {-1}, {}), Error);
  w.add("x", "U8", {1}, {7});
  EXPECT_THROW(w.add("x", "U8", {1}, {7}), Error);
  EXPECT_THROW(w.write("/nonexistent_dir_kvcodec/x.safetensors"), Error);
}

TEST(Safetensors, MalformedHeadersGiveNamedErrors) {
  const std::string ok_entry = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  // Sanity: the well-formed variant parses.
  EXPECT_EQ(SafetensorsFile::from_bytes(blob("{" + ok_entry + "}", 8)).size(), 1u);

  expect_format_error({1, 2, 3}, "too short");
  expect_format_error(blob("{}", 0, 1000), "past the end");
  expect_format_error(blob("{}", 0, UINT64_MAX - 1), "past the end");
  expect_format_error(blob("{\"t\":", 8), "not valid JSON");
  expect_format_error(blob("[1,2]", 8), "not an object");
  expect_format_error(blob(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8), "out of range");
  expect_format_error(blob(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "begin");
  expect_format_error(
      blob(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
      "overlapping");
  expect_format_error(blob(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "mismatch");
  expect_format_error(blob(R"({"t":{"dtype":"F17","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype 'F17'");
  expect_format_error(blob(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "negative dimension");
  expect_format_error(
      blob(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})", 8), "overflow");
  expect_format_error(blob(R"({"t":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,8]}})", 8),
                      "overflow");
  expect_format_error(blob(R"({"t":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8), "non-negative integer");
  expect_format_error(blob(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8), "data_offsets");
  expect_format_error(blob(R"({"t":{"dtype":"F32","data_offsets":[0,8]}})", 8), "shape");
  expect_format_error(blob(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", 8), "dtype");
  expect_format_error(blob(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[-1,7]}})", 8), "data_offsets");
  expect_format_error(blob(R"({"t":5})", 8), "not an object");
  expect_format_error(
      blob(R"({"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"t":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", 8),
      "defined twice");
  // Nested duplicate keys are not tensors: the last wins, as in JSON at large.
  EXPECT_EQ(SafetensorsFile::from_bytes(blob(R"({"__metadata__":{"a":"1","a":"2"}})", 0)).metadata().at("a"), "2");
  expect_format_error(blob(R"({"__metadata__":{"k":1}})", 0), "__metadata__");
  // The tensor is named in errors about it.
  expect_format_error(blob(R"({"layers.3.key":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                      "layers.3.key");
}

TEST(Safetensors, OpenMissingFileIsIoError) {
  try {
    SafetensorsFile::open("/nonexistent/kv.safetensors");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/kv.safetensors"), std::string::npos);
  }
}

TEST(Safetensors, RealKvDump) {
  const std::string path = std::string(KVCODEC_SHARED_DIR) + "/models/tinycode/kv_dump.safetensors";
  if (!file_exists(path)) GTEST_SKIP() << "shared KV dump not found at " << path;
  const SafetensorsFile f = SafetensorsFile::open(path);
  const TensorView k = f.view4("layers.0.key");
  EXPECT_EQ(k.shape, (Shape4{1, 2, 2048, 64}));
  EXPECT_TRUE(f.contains("layers.5.value"));
  EXPECT_EQ(f.info("input_ids").dtype, "I64");
  EXPECT_THROW(f.view4("input_ids"), Error);
  // Values are finite and not all zero: the view points at real data.
  double sum_sq = 0;
  for (int64_t s = 0; s < 2048; s += 97)
    for (int64_t d = 0; d < 64; ++d) {
      const float x = k.at(0, 1, s, d);
      ASSERT_TRUE(std::isfinite(x));
      sum_sq += double(x) * x;
    }
  EXPECT_GT(sum_sq, 0.0);
  const std::vector<float> flat = f.read_f32("layers.0.key");
  ASSERT_EQ(flat.size(), size_t(2 * 2048 * 64));
  EXPECT_EQ(flat[2048 * 64 + 5 * 64 + 3], k.at(0, 1, 5, 3));
  const Tensor owned = f.tensor("layers.0.key", DType::kF32);
  EXPECT_EQ(owned.shape(), k.shape);
  EXPECT_EQ(std::memcmp(owned.data(), flat.data(), owned.nbytes()), 0);
}

TEST(Safetensors, ShardedModel) {
  const std::string dir = std::string(KVCODEC_SOURCE_DIR) + "/models/tinycode";
  if (!file_exists(dir + "/model.safetensors.index.json")) GTEST_SKIP() << "no sharded model at " << dir;
  const SafetensorsModel m = SafetensorsModel::open(dir);
  EXPECT_EQ(m.shard_count(), 2u);
  EXPECT_TRUE(m.contains("model.embed_tokens.weight"));
  EXPECT_TRUE(m.contains("model.layers.0.input_layernorm.weight"));
  // Every mapped tensor resolves to data of the advertised size.
  size_t total = 0;
  for (const std::string& n : m.names()) total += m.info(n).size;
  EXPECT_EQ(std::to_string(total), m.metadata().at("total_size"));
  const auto& norm = m.info("model.layers.0.input_layernorm.weight");
  EXPECT_EQ(norm.shape.size(), 1u);
  const std::vector<float> w = m.read_f32("model.layers.0.input_layernorm.weight");
  EXPECT_EQ(int64_t(w.size()), norm.shape[0]);
  EXPECT_THROW(m.info("model.nope"), Error);
}

TEST(Safetensors, ShardedModelErrors) {
  const std::string dir = ::testing::TempDir() + "kvcodec_shards_" + std::to_string(::getpid());
  ASSERT_EQ(std::system(("mkdir -p '" + dir + "'").c_str()), 0);
  SafetensorsWriter w;
  w.add("a", "F32", {1}, std::vector<uint8_t>(4));
  w.write(dir + "/s1.safetensors");
  auto write_index = [&](const std::string& text) {
    std::ofstream(dir + "/model.safetensors.index.json") << text;
  };
  write_index(R"({"weight_map":{"a":"s1.safetensors"}})");
  EXPECT_EQ(SafetensorsModel::open(dir).names(), std::vector<std::string>{"a"});

  write_index(R"({"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}})");
  try {
    SafetensorsModel::open(dir);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_NE(std::string(e.what()).find("s2.safetensors"), std::string::npos) << e.what();
  }
  write_index(R"({"weight_map":{"a":"s1.safetensors","c":"s1.safetensors"}})");
  try {
    SafetensorsModel::open(dir);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'c'"), std::string::npos) << e.what();
  }
  write_index(R"({"weight_map":{"a":"../s1.safetensors"}})");
  EXPECT_THROW(SafetensorsModel::open(dir), Error);
  write_index("{not json");
  EXPECT_THROW(SafetensorsModel::open(dir), Error);
  EXPECT_THROW(SafetensorsModel::open(dir + "/empty_subdir"), Error);
  std::system(("rm -rf '" + dir + "'").c_str());
}

// Small deterministic files, checked in as fuzz/corpus/fuzz_safetensors/*:
// the fuzzer's seeds and golden files of the writer's layout.
// KVCODEC_REGENERATE_GOLDEN=1 rewrites them.
TEST(Safetensors, GoldenSeedFiles) {
  std::vector<std::pair<std::string, std::vector<uint8_t>>> goldens;
  {
    SafetensorsWriter w;
    w.add("layers.0.key", random_tensor(DType::kF16, {1, 2, 4, 4}, 11).view());
    w.add("layers.0.value", random_tensor(DType::kBF16, {1, 2, 4, 4}, 12).view());
    w.add("layers.0.query_last256", random_tensor(DType::kF32, {1, 2, 2, 4}, 13).view());
    w.add_metadata("model", "tiny");
    goldens.emplace_back("kv_small.safetensors", w.to_bytes());
  }
  goldens.emplace_back("empty.safetensors", SafetensorsWriter().to_bytes());
  {
    SafetensorsWriter w;
    std::vector<uint8_t> ids(4 * 8);
    for (size_t i = 0; i < ids.size(); i += 8) ids[i] = uint8_t(i);
    w.add("input_ids", "I64", {1, 4}, ids);
    w.add("norm", "F32", {3}, std::vector<uint8_t>(12, 0));
    w.add("scalar", "F64", {}, std::vector<uint8_t>(8, 0));
    w.add("zero", "F16", {0, 5}, {});
    goldens.emplace_back("mixed.safetensors", w.to_bytes());
  }
  const std::string dir = std::string(KVCODEC_SOURCE_DIR) + "/fuzz/corpus/fuzz_safetensors";
  const bool regenerate = std::getenv("KVCODEC_REGENERATE_GOLDEN") != nullptr;
  for (const auto& [file, bytes] : goldens) {
    const std::string path = dir + "/" + file;
    if (regenerate) {
      ASSERT_EQ(std::system(("mkdir -p '" + dir + "'").c_str()), 0);
      std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                                  std::streamsize(bytes.size()));
    }
    std::ifstream in(path, std::ios::binary);
    ASSERT_TRUE(in.good()) << "seed file missing: " << path << " (KVCODEC_REGENERATE_GOLDEN=1 writes it)";
    const std::vector<uint8_t> on_disk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(on_disk, bytes) << file << ": the writer's layout changed";
    const SafetensorsFile f = SafetensorsFile::open(path);
    EXPECT_EQ(f.size(), file == "empty.safetensors" ? 0u : file == "mixed.safetensors" ? 4u : 3u);
  }
  const SafetensorsFile mixed = SafetensorsFile::open(dir + "/mixed.safetensors");
  EXPECT_EQ(mixed.view4("norm").shape, (Shape4{1, 1, 1, 3}));
  EXPECT_THROW(mixed.view4("scalar"), Error);  // F64 is listed, not a KV dtype
  EXPECT_EQ(mixed.view4("zero").shape, (Shape4{1, 1, 0, 5}));
  EXPECT_TRUE(mixed.read_f32("zero").empty());
  EXPECT_EQ(mixed.read_f32("scalar"), std::vector<float>{0.0f});
}

// Deeply nested JSON must fail cleanly (no recursion-depth stack overflow).
TEST(Safetensors, DeeplyNestedHeaderIsRejectedWithoutCrash) {
  const std::string open_only(100000, '[');
  expect_format_error(blob(open_only, 0), "not valid JSON");
  const std::string balanced = std::string(50000, '[') + std::string(50000, ']');
  expect_format_error(blob(balanced, 0), "not an object");
  const std::string in_shape = R"({"t":{"dtype":"F32","shape":)" + balanced + R"(,"data_offsets":[0,0]}})";
  expect_format_error(blob(in_shape, 0), "t");
}

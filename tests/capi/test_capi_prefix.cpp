// The C API's whole-prefix codec on the CPU (KVCODEC_PREFIX_CPU) against the
// kvtc-gpu/4 reference it wraps, on real KV (the shared dump) with the
// shipped calibration; its refusals; and, in a build without CUDA, the
// plain refusal of KVCODEC_PREFIX_CUDA. (The GPU side: tests/gpu for the
// kernels against the same reference, tests/python/test_prefix.py on the
// GPU machine for this API on device memory.)
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <filesystem>

#include "capi_test_util.hpp"
#include "cache/kvtc_calibrated.hpp"
#include "gpu/kvtc_variant.hpp"
#include "kvcodec/safetensors.hpp"

using namespace capi_test;

namespace {

struct PrefixDeleter {
  void operator()(kvcodec_prefix_codec* c) const { kvcodec_prefix_codec_free(c); }
};
using PrefixPtr = std::unique_ptr<kvcodec_prefix_codec, PrefixDeleter>;

const std::string kShippedCalibration = std::string(KVCODEC_SOURCE_DIR) + "/models/tinycode/kvtc.kvcal";

// Layer `layer` of the shared dump's first `tokens` tokens as one buffer
// [2, 1, tokens, H * D] bf16 (keys then values, token-major).
const std::string kSharedDump = std::string(KVCODEC_SHARED_DIR) + "/models/tinycode/kv_dump.safetensors";

// The README's test command runs with nothing beside the clone: without
// ../shared these tests skip, as the other real-dump tests do.
#define SKIP_WITHOUT_SHARED_DUMP() \
  if (!std::filesystem::exists(kSharedDump)) GTEST_SKIP() << "no KV dump at " << kSharedDump << " (shared folder absent)"

std::vector<uint16_t> dump_layer_bf16(int layer, int64_t tokens) {
  const auto dump = kvcodec::SafetensorsFile::open(kSharedDump);
  std::vector<uint16_t> out;
  for (const char* part : {"key", "value"}) {
    const std::string name = "layers." + std::to_string(layer) + "." + part;
    const std::vector<float> x = dump.read_f32(name);  // [1, H, S, D]
    const auto& shape = dump.info(name).shape;
    const int64_t H = shape[1], S = shape[2], D = shape[3];
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) out.push_back(kvcodec::gpu::f32_to_bf16_rne(x[size_t((h * S + t) * D + d)]));
  }
  return out;
}

struct Encoded {
  std::vector<uint8_t> payload;
  std::vector<uint64_t> offsets;
};

Encoded encode(kvcodec_prefix_codec* c, const std::vector<uint16_t>& kv, int64_t tokens) {
  uint64_t bound = 0;
  int64_t n_offsets = 0;
  EXPECT_EQ(kvcodec_prefix_codec_bounds(c, tokens, &bound, &n_offsets), KVCODEC_OK) << kvcodec_last_error();
  Encoded e;
  e.payload.resize(bound);
  e.offsets.resize(size_t(n_offsets));
  uint64_t written = 0;
  EXPECT_EQ(kvcodec_prefix_encode(c, kv.data(), tokens, 0, e.payload.data(), bound, e.offsets.data(), nullptr, &written),
            KVCODEC_OK)
      << kvcodec_last_error();
  e.payload.resize(written);
  return e;
}

}  // namespace

TEST(CapiPrefix, CpuCodesTheReferenceBytesAndDecodesItsOutput) {
  SKIP_WITHOUT_SHARED_DUMP();
  const int layer = 1, sinks = 4, window = 32;
  const int64_t tokens = 300;  // 264 coded: 4 streams of 64 and one of 8 per row
  CalibrationPtr cal;
  {
    kvcodec_calibration* c = nullptr;
    KVC_OK(kvcodec_calibration_load(kShippedCalibration.c_str(), &c));
    cal.reset(c);
  }
  kvcodec_prefix_codec* raw = nullptr;
  KVC_OK(kvcodec_prefix_codec_create(cal.get(), layer, 1, 512, sinks, window, KVCODEC_PREFIX_CPU, &raw));
  PrefixPtr codec(raw);
  const std::vector<uint16_t> kv = dump_layer_bf16(layer, tokens);
  const Encoded e = encode(codec.get(), kv, tokens);
  ASSERT_EQ(e.offsets.size(), size_t(2 * 5 + 1));

  // The reference of src/gpu, called directly.
  const auto params = kvcodec::KvtcCalibration::load_shared(kShippedCalibration);
  const kvcodec::gpu::FlatKvtcTables t = kvcodec::gpu::flatten_calibration(*params, {layer}, 1, 512, sinks, window);
  const kvcodec::gpu::EncodedBatch ref = kvcodec::gpu::encode_batch_reference(t, kv.data(), tokens, 64);
  EXPECT_EQ(e.payload, ref.payload);
  EXPECT_EQ(e.offsets, ref.offsets);

  std::vector<uint16_t> y(kv.size()), y_ref(kv.size());
  KVC_OK(kvcodec_prefix_decode(codec.get(), e.payload.data(), e.payload.size(), e.offsets.data(), tokens, 0, y.data(),
                               nullptr));
  KVC_OK(kvcodec_prefix_check(codec.get(), nullptr));
  kvcodec::gpu::decode_batch_reference(t, ref.payload.data(), ref.payload.size(), ref.offsets.data(), tokens, 64,
                                       y_ref.data());
  EXPECT_EQ(y, y_ref);

  // Sinks and window come back bit for bit; the coded tokens near the input.
  const size_t W = 128;
  double err = 0, energy = 0;
  for (size_t row = 0; row < 2; ++row)
    for (size_t tok = 0; tok < size_t(tokens); ++tok)
      for (size_t d = 0; d < W; ++d) {
        const size_t i = (row * size_t(tokens) + tok) * W + d;
        const float a = kvcodec::gpu::bf16_bits_to_f32(kv[i]), b = kvcodec::gpu::bf16_bits_to_f32(y[i]);
        if (tok < size_t(sinks) || tok >= size_t(tokens - window)) {
          ASSERT_EQ(kv[i], y[i]) << "raw token " << tok;
        } else {
          err += double(a - b) * double(a - b);
          energy += double(a) * double(a);
        }
      }
  EXPECT_LT(err / energy, 0.05) << "relative squared error of the coded tokens";
  EXPECT_GT(err, 0.0) << "the coded tokens are lossy";
}

TEST(CapiPrefix, RefusesBadArgumentsAndDamagedBytesWithTheirNames) {
  SKIP_WITHOUT_SHARED_DUMP();
  kvcodec_calibration* c = nullptr;
  KVC_OK(kvcodec_calibration_load(kShippedCalibration.c_str(), &c));
  CalibrationPtr cal(c);
  kvcodec_prefix_codec* out = reinterpret_cast<kvcodec_prefix_codec*>(&out);
  const auto fails = [](kvcodec_status status, kvcodec_status want, const char* words) {
    EXPECT_EQ(status, want) << kvcodec_last_error();
    EXPECT_NE(std::string(kvcodec_last_error()).find(words), std::string::npos) << kvcodec_last_error();
  };
  fails(kvcodec_prefix_codec_create(nullptr, 0, 1, 64, 4, 8, KVCODEC_PREFIX_CPU, &out), KVCODEC_ERROR_INVALID_ARGUMENT,
        "calibration is NULL");
  EXPECT_EQ(out, nullptr) << "out is cleared on failure";
  fails(kvcodec_prefix_codec_create(cal.get(), 6, 1, 64, 4, 8, KVCODEC_PREFIX_CPU, &out),
        KVCODEC_ERROR_INVALID_ARGUMENT, "layer 6");
  fails(kvcodec_prefix_codec_create(cal.get(), 0, 0, 64, 4, 8, KVCODEC_PREFIX_CPU, &out),
        KVCODEC_ERROR_INVALID_ARGUMENT, "batch 0");
  fails(kvcodec_prefix_codec_create(cal.get(), 0, 1, 0, 4, 8, KVCODEC_PREFIX_CPU, &out),
        KVCODEC_ERROR_INVALID_ARGUMENT, "max_tokens");
  fails(kvcodec_prefix_codec_create(cal.get(), 0, 1, 64, -1, 8, KVCODEC_PREFIX_CPU, &out),
        KVCODEC_ERROR_INVALID_ARGUMENT, "sinks -1");
  fails(kvcodec_prefix_codec_create(cal.get(), 0, 1, 64, 4, 8, 7, &out), KVCODEC_ERROR_INVALID_ARGUMENT, "device 7");
  int compiled = -1;
  const int devices = kvcodec_cuda_device_count(&compiled);
  EXPECT_TRUE(compiled == 0 || compiled == 1);
  if (!compiled) {
    EXPECT_EQ(devices, 0);
    fails(kvcodec_prefix_codec_create(cal.get(), 0, 1, 64, 4, 8, KVCODEC_PREFIX_CUDA, &out),
          KVCODEC_ERROR_UNSUPPORTED, "built without CUDA");
  }

  KVC_OK(kvcodec_prefix_codec_create(cal.get(), 0, 1, 256, 4, 8, KVCODEC_PREFIX_CPU, &out));
  PrefixPtr codec(out);
  KVC_OK(kvcodec_prefix_codec_set_reconstruction(codec.get(), KVCODEC_RECON_EXACT));
  fails(kvcodec_prefix_codec_set_reconstruction(codec.get(), KVCODEC_RECON_TF32), KVCODEC_ERROR_UNSUPPORTED,
        "the CPU reference reconstructs exactly");
  fails(kvcodec_prefix_codec_set_reconstruction(codec.get(), 3), KVCODEC_ERROR_INVALID_ARGUMENT, "mode 3");
  const int64_t tokens = 200;
  const std::vector<uint16_t> kv = dump_layer_bf16(0, tokens);
  uint64_t bound = 0;
  int64_t n_offsets = 0;
  fails(kvcodec_prefix_codec_bounds(codec.get(), 257, &bound, &n_offsets), KVCODEC_ERROR_INVALID_ARGUMENT,
        "tokens 257 outside [1, max_tokens = 256]");
  KVC_OK(kvcodec_prefix_codec_bounds(codec.get(), tokens, &bound, &n_offsets));
  std::vector<uint8_t> payload(bound);
  std::vector<uint64_t> offsets(static_cast<size_t>(n_offsets));
  uint64_t written = 0;
  fails(kvcodec_prefix_encode(codec.get(), kv.data(), tokens, 0, payload.data(), 100, offsets.data(), nullptr, &written),
        KVCODEC_ERROR_BUFFER_TOO_SMALL, "capacity is 100");
  int stream_stand_in = 0;
  fails(kvcodec_prefix_encode(codec.get(), kv.data(), tokens, 0, payload.data(), bound, offsets.data(), &stream_stand_in,
                              &written),
        KVCODEC_ERROR_INVALID_ARGUMENT, "cuda_stream given to a codec on the CPU");
  fails(kvcodec_prefix_encode(codec.get(), nullptr, tokens, 0, payload.data(), bound, offsets.data(), nullptr, &written),
        KVCODEC_ERROR_INVALID_ARGUMENT, "kv is NULL");
  KVC_OK(kvcodec_prefix_encode(codec.get(), kv.data(), tokens, 0, payload.data(), bound, offsets.data(), nullptr,
                               &written));
  ASSERT_LE(written, bound);

  std::vector<uint16_t> y(kv.size());
  // Too few bytes for the raw tokens after the streams.
  fails(kvcodec_prefix_decode(codec.get(), payload.data(), written - 1, offsets.data(), tokens, 0, y.data(), nullptr),
        KVCODEC_ERROR_FORMAT, "raw tokens need");
  // A stream whose end lies past the payload.
  std::vector<uint64_t> bad = offsets;
  bad[1] = written + 1;
  fails(kvcodec_prefix_decode(codec.get(), payload.data(), written, bad.data(), tokens, 0, y.data(), nullptr),
        KVCODEC_ERROR_FORMAT, "stream 0 has bad offsets");
  // A stream cut short by one byte (the next one starts earlier).
  bad = offsets;
  bad[1] -= 1;
  fails(kvcodec_prefix_decode(codec.get(), payload.data(), written, bad.data(), tokens, 0, y.data(), nullptr),
        KVCODEC_ERROR_FORMAT, "");
  KVC_OK(kvcodec_prefix_decode(codec.get(), payload.data(), written, offsets.data(), tokens, 0, y.data(), nullptr));
  // The integer reconstruction of the same payload: the CPU codec's (its
  // equality with kvtc::dequantize_block is tests/gpu's
  // KvtcVariant.IntegerReconstructionIsTheCpuCodecs), near the exact one.
  KVC_OK(kvcodec_prefix_codec_set_reconstruction(codec.get(), KVCODEC_RECON_INTEGER));
  std::vector<uint16_t> y_int(kv.size());
  KVC_OK(kvcodec_prefix_decode(codec.get(), payload.data(), written, offsets.data(), tokens, 0, y_int.data(), nullptr));
  double err = 0.0, norm = 0.0;
  size_t differ = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const double a = std::bit_cast<float>(uint32_t(y[i]) << 16), b = std::bit_cast<float>(uint32_t(y_int[i]) << 16);
    err += (a - b) * (a - b), norm += a * a, differ += y[i] != y_int[i];
  }
  EXPECT_GT(differ, 0u);
  EXPECT_LT(err / norm, 1e-5);
  KVC_OK(kvcodec_prefix_codec_set_reconstruction(codec.get(), KVCODEC_RECON_EXACT));
  kvcodec_prefix_codec_free(nullptr);
}

// A block coded on its own at its position (sinks and window 0) is the very
// stream the whole sequence codes for it: positions reach RoPE as they must.
TEST(CapiPrefix, ABlockCodedAtItsPositionIsTheWholeSequencesStream) {
  SKIP_WITHOUT_SHARED_DUMP();
  kvcodec_calibration* c = nullptr;
  KVC_OK(kvcodec_calibration_load(kShippedCalibration.c_str(), &c));
  CalibrationPtr cal(c);
  kvcodec_prefix_codec* raw = nullptr;
  KVC_OK(kvcodec_prefix_codec_create(cal.get(), 2, 1, 1024, 0, 0, KVCODEC_PREFIX_CPU, &raw));
  PrefixPtr codec(raw);
  const int64_t S = 256, first = 128, n = 64;
  const std::vector<uint16_t> kv = dump_layer_bf16(2, S);
  const Encoded whole = encode(codec.get(), kv, S);
  ASSERT_EQ(whole.offsets.size(), size_t(2 * 4 + 1));
  // Tokens [128, 192) of both rows (keys, values) as their own [2, 1, 64, W] buffer.
  const size_t W = 128;
  std::vector<uint16_t> block;
  for (size_t row = 0; row < 2; ++row)
    block.insert(block.end(), kv.begin() + long((row * size_t(S) + size_t(first)) * W),
                 kv.begin() + long((row * size_t(S) + size_t(first + n)) * W));
  uint64_t bound = 0;
  int64_t n_offsets = 0;
  KVC_OK(kvcodec_prefix_codec_bounds(codec.get(), n, &bound, &n_offsets));
  std::vector<uint8_t> payload(bound);
  std::vector<uint64_t> offsets(static_cast<size_t>(n_offsets));
  uint64_t written = 0;
  KVC_OK(kvcodec_prefix_encode(codec.get(), block.data(), n, first, payload.data(), bound, offsets.data(), nullptr,
                               &written));
  for (size_t row = 0; row < 2; ++row) {
    const size_t w = row * 4 + 2;  // the whole sequence's stream of this row's block 2
    const std::vector<uint8_t> a(payload.begin() + long(offsets[row]), payload.begin() + long(offsets[row + 1]));
    const std::vector<uint8_t> b(whole.payload.begin() + long(whole.offsets[w]),
                                 whole.payload.begin() + long(whole.offsets[w + 1]));
    EXPECT_EQ(a, b) << "row " << row;
  }
  // The same block at position 0 codes the keys' other rotation: other bytes.
  std::vector<uint8_t> at0(bound);
  std::vector<uint64_t> offsets0(static_cast<size_t>(n_offsets));
  KVC_OK(kvcodec_prefix_encode(codec.get(), block.data(), n, 0, at0.data(), bound, offsets0.data(), nullptr, &written));
  EXPECT_NE(std::vector<uint8_t>(at0.begin(), at0.begin() + long(offsets0[1])),
            std::vector<uint8_t>(payload.begin(), payload.begin() + long(offsets[1])));
  // Decoded at its position: the whole sequence's decode of those tokens.
  std::vector<uint16_t> y_block(block.size()), y_whole(kv.size());
  KVC_OK(kvcodec_prefix_decode(codec.get(), payload.data(), offsets.back(), offsets.data(), n, first, y_block.data(),
                               nullptr));
  KVC_OK(kvcodec_prefix_decode(codec.get(), whole.payload.data(), whole.payload.size(), whole.offsets.data(), S, 0,
                               y_whole.data(), nullptr));
  for (size_t row = 0; row < 2; ++row)
    EXPECT_TRUE(std::equal(y_block.begin() + long(row * n * W), y_block.begin() + long((row + 1) * n * W),
                           y_whole.begin() + long((row * size_t(S) + size_t(first)) * W)))
        << "row " << row;
  const auto fails = [](kvcodec_status status, kvcodec_status want, const char* words) {
    EXPECT_EQ(status, want) << kvcodec_last_error();
    EXPECT_NE(std::string(kvcodec_last_error()).find(words), std::string::npos) << kvcodec_last_error();
  };
  fails(kvcodec_prefix_encode(codec.get(), block.data(), n, 1024 - 63, payload.data(), bound, offsets.data(), nullptr,
                              &written),
        KVCODEC_ERROR_INVALID_ARGUMENT, "positions [961, 1025) outside [0, max_tokens = 1024)");
  fails(kvcodec_prefix_decode(codec.get(), payload.data(), offsets.back(), offsets.data(), n, -1, y_block.data(),
                              nullptr),
        KVCODEC_ERROR_INVALID_ARGUMENT, "positions [-1, 63)");
}

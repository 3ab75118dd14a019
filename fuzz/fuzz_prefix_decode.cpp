// libFuzzer target for the whole-prefix codec's decoder on the CPU (the
// kvtc-gpu/4 calibrated format: what kvcodec_prefix_decode runs with
// KVCODEC_PREFIX_CPU, src/gpu/kvtc_variant.cpp). Input: u8 token count
// (1..256), u8 first position, then the stream offsets as u64 little-endian
// (n_streams + 1 of them), then the payload. Any input must end in success
// or kvcodec::Error, never in a crash, an out-of-bounds access or a hang.
// The seed is a valid encoding of 200 tokens.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cache/kvtc_calibrated.hpp"
#include "fuzz_seeds.hpp"
#include "gpu/kvtc_variant.hpp"
#include "kvcodec/error.hpp"
#include "kvtc/codec.hpp"
#include "linalg/pca.hpp"

using namespace kvcodec;

namespace {

constexpr int kHeads = 2, kHeadDim = 32, kWidth = kHeads * kHeadDim, kMaxTokens = 512, kBlock = 64;

// One layer, 2 KV heads of 32 (width 64, the GPU format's narrowest), fitted
// on low-rank vectors; sinks 4, window 8.
const gpu::FlatKvtcTables& tables() {
  static const gpu::FlatKvtcTables t = [] {
    KvtcCalibration cal;
    cal.n_layers = 1;
    cal.n_kv_heads = kHeads;
    cal.head_dim = kHeadDim;
    cal.rope_theta = 10000.0;
    cal.config_hash = "0123456789abcdef";
    kvtc::CodecOptions o;
    o.bit_budget = kWidth;
    for (const bool is_key : {true, false}) {
      const std::vector<float> x = fuzz::low_rank(256, kWidth, is_key ? 21 : 22);
      const linalg::PcaBasis pca = linalg::fit_pca(x.data(), 256, kWidth);
      (is_key ? cal.keys : cal.values)
          .push_back(kvtc::fit_head(x.data(), 256, kWidth, pca.mean, pca.components, pca.eigenvalues, o));
      (is_key ? cal.key_scale : cal.value_scale).push_back(std::vector<float>(kWidth, 1.0f));
    }
    return gpu::flatten_calibration(cal, {0}, 1, kMaxTokens, 4, 8);
  }();
  return t;
}

void write_valid_seed() {
  static bool done = false;
  if (done) return;
  done = true;
  const int64_t tokens = 200;
  const std::vector<float> x = fuzz::low_rank(2 * tokens, kWidth, 5);
  std::vector<uint16_t> kv(x.size());
  for (size_t i = 0; i < x.size(); ++i) kv[i] = gpu::f32_to_bf16_rne(x[i]);
  const gpu::EncodedBatch e = gpu::encode_batch_reference(tables(), kv.data(), tokens, kBlock, 7);
  std::vector<uint8_t> seed = {uint8_t(tokens - 1), 7};
  for (const uint64_t o : e.offsets)
    for (int b = 0; b < 8; ++b) seed.push_back(uint8_t(o >> (8 * b)));
  seed.insert(seed.end(), e.payload.begin(), e.payload.end());
  fuzz::write_seed("prefix_200", seed);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  write_valid_seed();
  if (size < 2) return 0;
  const int64_t tokens = int64_t(data[0]) + 1, first = data[1];
  data += 2, size -= 2;
  const gpu::FlatKvtcTables& t = tables();
  const int64_t n_offsets = int64_t(t.n_heads) * gpu::n_blocks(gpu::coded_tokens(t, tokens), kBlock) + 1;
  if (size < size_t(n_offsets) * 8) return 0;
  std::vector<uint64_t> offsets(static_cast<size_t>(n_offsets));
  for (size_t i = 0; i < offsets.size(); ++i) {
    uint64_t v = 0;
    for (int b = 0; b < 8; ++b) v |= uint64_t(data[i * 8 + size_t(b)]) << (8 * b);
    offsets[i] = v;
  }
  data += offsets.size() * 8, size -= offsets.size() * 8;
  std::vector<uint16_t> y(size_t(t.n_heads) * size_t(tokens) * size_t(t.dim));
  try {
    gpu::decode_batch_reference(t, data, size, offsets.data(), tokens, kBlock, y.data(), first);
  } catch (const Error&) {
  }
  return 0;
}

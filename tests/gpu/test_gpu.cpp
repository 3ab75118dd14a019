// kvtc-gpu/1: the CPU reference of the variant (runs everywhere, CI included)
// and the CUDA kernels against it (skipped without a GPU or without CUDA).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>

#include "gpu/gpu_test_support.hpp"
#include "gpu/kvtc_variant.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/gpu.hpp"
#include "kvcodec/safetensors.hpp"
#include "kvtc/codec.hpp"
#include "linalg/pca.hpp"

#ifdef KVCODEC_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kvcodec::gpu {
namespace {

// A batch: NH heads of `tokens` tokens, each head fitted on its own tokens.
struct Batch {
  int dim = 0;
  int64_t tokens = 0;
  std::vector<kvtc::HeadParams> params;
  std::vector<uint16_t> x;  // [NH, tokens, D]
  std::vector<const kvtc::HeadParams*> ptrs() const {
    std::vector<const kvtc::HeadParams*> p;
    for (const auto& h : params) p.push_back(&h);
    return p;
  }
};

Batch synth_batch(int n_heads, int64_t tokens, int dim, uint32_t seed) {
  Batch b;
  b.dim = dim;
  b.tokens = tokens;
  for (int h = 0; h < n_heads; ++h) {
    std::vector<uint16_t> xh = synth_bf16(tokens, dim, seed + uint32_t(h));
    b.params.push_back(fit(xh.data(), tokens, dim, h % 2 ? 2 * dim : 0));  // two budgets: two K
    b.x.insert(b.x.end(), xh.begin(), xh.end());
  }
  return b;
}

TEST(KvtcVariant, Bf16RoundingIsNearestEven) {
  EXPECT_EQ(f32_to_bf16_rne(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16_rne(bf16_bits_to_f32(0x3f81)), 0x3f81);
  // Halfway between 0x3f80 and 0x3f81 rounds to the even one, just above goes up.
  EXPECT_EQ(f32_to_bf16_rne(std::bit_cast<float>(0x3f808000u)), 0x3f80);
  EXPECT_EQ(f32_to_bf16_rne(std::bit_cast<float>(0x3f818000u)), 0x3f82);
  EXPECT_EQ(f32_to_bf16_rne(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f32_to_bf16_rne(NAN))));
}

TEST(KvtcVariant, CodesAreTheCpuCodecs) {
  const int dim = 64;
  const int64_t n = 512;
  const std::vector<uint16_t> x = synth_bf16(n, dim, 11);
  const kvtc::HeadParams p = fit(x.data(), n, dim);
  ASSERT_TRUE(p.derived().proj_int);
  const FlatKvtcTables t = flatten_heads({&p});
  ASSERT_EQ(t.proj_int[0], 1);
  const int K = p.n_kept();
  ASSERT_GT(K, 8);
  // Row 7 times 2^20 (exact in bf16): longer than the quantizers' cells
  // reach, so too long for the integer projection on both sides.
  std::vector<uint16_t> xw = x;
  for (int d = 0; d < dim; ++d) xw[size_t(7 * dim + d)] = uint16_t(xw[size_t(7 * dim + d)] + (20u << 7));
  std::vector<uint16_t> mine(size_t(n * K)), cpu(size_t(n * K));
  quantize_reference(t, 0, xw.data(), n, mine.data());
  const std::vector<float> xwf = to_f32(xw.data(), xw.size());
  // The integer projection: the CPU codec's default path, code for code
  // (row 7 included: both take a float projection there, and it clamps).
  kvtc::quantize_block_path(p, xwf.data(), n, cpu.data(), kvtc::QuantPath::kInteger);
  for (size_t i = 0; i < mine.size(); ++i) ASSERT_EQ(mine[i], cpu[i]) << "token " << i / size_t(K);
  // Row 7 did take the float projection: the same codes with the integer tables gone.
  FlatKvtcTables tf = t;
  tf.proj_int[0] = 0;
  std::vector<uint16_t> row7(static_cast<size_t>(K));
  quantize_reference(tf, 0, xw.data() + 7 * dim, 1, row7.data());
  EXPECT_TRUE(std::equal(row7.begin(), row7.end(), mine.begin() + 7 * K));
  const std::vector<float> xf = to_f32(x.data(), x.size());

  // A head without the integer tables: the variant's float projection
  // against the CPU codec's float kernel. Different summation orders may
  // put a coefficient on the other side of a quantizer boundary: never
  // more than one step, and rarely.
  quantize_reference(tf, 0, x.data(), n, mine.data());
  kvtc::quantize_block_path(p, xf.data(), n, cpu.data(), kvtc::QuantPath::kFloat);
  size_t differ = 0;
  for (size_t i = 0; i < mine.size(); ++i) {
    ASSERT_LE(std::abs(int(mine[i]) - int(cpu[i])), 1) << "at " << i;
    differ += mine[i] != cpu[i];
  }
  EXPECT_LT(double(differ), 1e-3 * double(mine.size()));

  // Reconstruction: the CPU codec's float result, rounded to bf16.
  std::vector<uint16_t> y(size_t(n * dim));
  std::vector<float> yc(size_t(n * dim));
  dequantize_reference(t, 0, mine.data(), n, y.data());
  kvtc::dequantize_block(p, mine.data(), n, yc.data());
  for (size_t i = 0; i < y.size(); ++i)
    ASSERT_NEAR(bf16_bits_to_f32(y[i]), yc[i], 1e-4f + std::abs(yc[i]) * (1.0f / 128)) << "at " << i;
}

// The integer reconstruction of the variant (what set_reconstruction(
// kInteger) computes on the GPU) is the CPU codec's default decode, float
// for float, on every code of every component's range.
TEST(KvtcVariant, IntegerReconstructionIsTheCpuCodecs) {
  for (int dim : {64, 128}) {
    const int64_t n = 300;
    const std::vector<uint16_t> x = synth_bf16(n, dim, 17 + dim);
    const kvtc::HeadParams p = fit(x.data(), n, dim);
    ASSERT_TRUE(p.derived().recon_int);
    const FlatKvtcTables t = flatten_heads({&p});
    ASSERT_EQ(t.recon_int[0], 1);
    const int K = p.n_kept();
    // Codes of real rows, then the ends of every range and random codes.
    std::vector<uint16_t> codes(size_t(n * K));
    quantize_reference(t, 0, x.data(), n, codes.data());
    std::mt19937 rng(5);
    for (int64_t i = n / 2; i < n; ++i)
      for (int k = 0; k < K; ++k) {
        const uint32_t levels = p.quant[size_t(k)].levels;
        codes[size_t(i * K + k)] = uint16_t(i == n / 2 ? 0 : i == n / 2 + 1 ? levels - 1 : rng() % levels);
      }
    std::vector<float> mine(size_t(n * dim)), cpu(size_t(n * dim)), cpu_int(size_t(n * dim));
    reconstruct_int_f32_reference(t, 0, codes.data(), n, mine.data(), 0);
    kvtc::dequantize_block(p, codes.data(), n, cpu.data());
    kvtc::dequantize_block_path(p, codes.data(), n, cpu_int.data(), kvtc::ReconPath::kInteger);
    for (size_t i = 0; i < mine.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(mine[i]), std::bit_cast<uint32_t>(cpu[i])) << "dim " << dim << " at " << i;
      ASSERT_EQ(std::bit_cast<uint32_t>(mine[i]), std::bit_cast<uint32_t>(cpu_int[i])) << "dim " << dim << " at " << i;
    }
    // And it is the reconstruction: within the float path's reach.
    std::vector<float> exact(size_t(n * dim));
    reconstruct_f32_reference(t, 0, codes.data(), n, exact.data(), 0);
    float peak = 0.0f;
    for (float v : exact) peak = std::max(peak, std::abs(v));
    for (size_t i = 0; i < mine.size(); ++i) ASSERT_NEAR(mine[i], exact[i], 1e-3f * peak) << "at " << i;
    // A head without the tables says so.
    FlatKvtcTables none = t;
    none.recon_int[0] = 0;
    EXPECT_THROW(reconstruct_int_f32_reference(none, 0, codes.data(), 1, mine.data(), 0), Error);
  }
}

TEST(KvtcVariant, StreamRoundTripIsExactForEveryBlockLength) {
  const int dim = 64;
  const std::vector<uint16_t> x = synth_bf16(600, dim, 5);
  const kvtc::HeadParams p = fit(x.data(), 600, dim);
  const FlatKvtcTables t = flatten_heads({&p});
  const int K = p.n_kept();
  for (int64_t n : {1, 2, 7, 31, 64}) {
    std::vector<uint16_t> codes(size_t(n * K)), back(size_t(n * K), 0xffff);
    quantize_reference(t, 0, x.data() + 100 * dim, n, codes.data());
    const std::vector<uint8_t> s = rans_warp_encode(t, 0, codes.data(), n);
    ASSERT_GE(s.size(), kStateBytes);
    EXPECT_EQ(s.size() % 2, 0u) << "the states, then whole 16-bit words";
    rans_warp_decode(t, 0, s.data(), s.size(), n, back.data());
    EXPECT_EQ(back, codes) << "n = " << n;
  }
}

// kvtc-gpu/4 codes each component's table at stream_scale_bits(levels,
// table bits) = min(table bits, max(8, ceil(log2 levels) + 2), 15), so 8-bit
// codes take at most 10 bits and the GPU decoder reads a slot's symbol
// from a 2^bits table. flatten_heads rebuilds a finer table (here 16 bits)
// from its frequencies: every symbol keeps a slot, the cost for the fine
// table's own distribution grows by under 1% over the head (the shipped
// calibration: +0.64%), and streams round-trip.
TEST(KvtcVariant, TablesAreCodedAtTheStreamPrecision) {
  EXPECT_EQ(stream_scale_bits(2, 12), 8u);
  EXPECT_EQ(stream_scale_bits(64, 12), 8u);
  EXPECT_EQ(stream_scale_bits(65, 12), 9u);
  EXPECT_EQ(stream_scale_bits(256, 16), 10u);
  EXPECT_EQ(stream_scale_bits(257, 12), 11u);
  EXPECT_EQ(stream_scale_bits(20, 6), 6u);  // a coarser table is kept as it is
  EXPECT_EQ(stream_scale_bits(9000, 16), kVariantMaxScaleBits);
  const int dim = 64;
  const std::vector<uint16_t> x = synth_bf16(600, dim, 5);
  const kvtc::HeadParams p = with_16_bit_tables(fit(x.data(), 600, dim));
  const FlatKvtcTables t = flatten_heads({&p});
  const int K = p.n_kept();
  ASSERT_GT(K, 0);
  const int64_t n = 64;
  std::vector<uint16_t> codes(size_t(n * K)), back(size_t(n * K), 0xffff);
  quantize_reference(t, 0, x.data() + 200 * dim, n, codes.data());
  double fine_bits = 0, stream_bits = 0;
  for (int k = 0; k < K; ++k) {
    const size_t q = t.idx(0, k);
    const entropy::FrequencyTable& ft = p.rans_tables[size_t(k)];
    ASSERT_EQ(ft.scale_bits, 16u);
    const uint32_t bits = stream_scale_bits(ft.alphabet_size, 16);
    ASSERT_LE(bits, 10u) << "8-bit codes";
    ASSERT_EQ(t.scale_bits[q], bits);
    uint32_t sum = 0;
    std::vector<uint64_t> counts(ft.alphabet_size);
    for (uint32_t s = 0; s < ft.alphabet_size; ++s) {
      const uint32_t f = t.sym_freq[t.sym_base[q] + s];
      EXPECT_GE(f, 1u) << "component " << k << " symbol " << s;
      EXPECT_EQ(t.sym_cum[t.sym_base[q] + s], sum);
      for (uint32_t slot = sum; slot < sum + f; ++slot) ASSERT_EQ(t.slot_symbol[t.slot_base[q] + slot], s);
      sum += f;
      counts[s] = ft.freq[s];
    }
    EXPECT_EQ(sum, 1u << bits);
    // The rebuilt table's cost for the 16-bit table's own distribution.
    std::vector<uint32_t> fs(t.sym_freq.begin() + t.sym_base[q], t.sym_freq.begin() + t.sym_base[q] + ft.alphabet_size);
    fine_bits += ft.cost_bits(counts);
    stream_bits += entropy::FrequencyTable::from_freqs(fs, bits).cost_bits(counts);
  }
  std::printf("16-bit tables rebuilt at 8-10 bits: %.3f%% more bits\n", 100 * (stream_bits / fine_bits - 1));
  EXPECT_LE(stream_bits, fine_bits * 1.01);
  const std::vector<uint8_t> s = rans_warp_encode(t, 0, codes.data(), n);
  rans_warp_decode(t, 0, s.data(), s.size(), n, back.data());
  EXPECT_EQ(back, codes);
}

// The GPU format has no centroid reconstruction: parameters that use it
// are refused by name, not decoded at the lattice's points.
TEST(KvtcVariant, CentroidReconstructionIsRefused) {
  const int dim = 64;
  const std::vector<uint16_t> x = synth_bf16(600, dim, 5);
  kvtc::HeadParams p = fit(x.data(), 600, dim);
  ASSERT_GT(p.n_kept(), 1);
  EXPECT_NO_THROW(flatten_heads({&p}));
  p.quant[1].centroid = {-0.125f, 0.0f, 0.0f};
  try {
    flatten_heads({&p});
    FAIL() << "centroid parameters were flattened";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("centroid"), std::string::npos) << e.what();
  }
}

TEST(KvtcVariant, EntropyCodingIsCloseToTheCpuCoder) {
  const int dim = 128;
  const std::vector<uint16_t> x = synth_bf16(640, dim, 9);
  const kvtc::HeadParams p = fit(x.data(), 640, dim);
  const FlatKvtcTables t = flatten_heads({&p});
  const int K = p.n_kept();
  std::vector<uint16_t> codes(size_t(64 * K));
  quantize_reference(t, 0, x.data() + 64 * dim * 3, 64, codes.data());
  const std::vector<uint8_t> mine = rans_warp_encode(t, 0, codes.data(), 64);
  // The CPU coder with the streams' tables (kvtc-gpu/4 rebuilds them at
  // stream_scale_bits): same models, only the 32 lane states (vs 8) cost more.
  std::vector<entropy::FrequencyTable> stream_tables;
  for (int k = 0; k < K; ++k) {
    const size_t q = t.idx(0, k);
    const auto f0 = t.sym_freq.begin() + t.sym_base[q];
    stream_tables.push_back(entropy::FrequencyTable::from_freqs(
        std::vector<uint32_t>(f0, f0 + p.rans_tables[size_t(k)].alphabet_size), t.scale_bits[q]));
  }
  std::vector<const entropy::FrequencyTable*> tabs;
  for (const auto& ft : stream_tables) tabs.push_back(&ft);
  const std::vector<uint8_t> cpu = entropy::rans_encode(codes.data(), 64, size_t(K), tabs);
  EXPECT_LE(mine.size(), cpu.size() + 24 * 4 + 16);
  EXPECT_GE(mine.size() + 16, cpu.size());
}

TEST(KvtcVariant, BatchRoundTripWithRaggedTailAndEmptyHead) {
  const int dim = 64;
  Batch b = synth_batch(3, 200, dim, 21);  // 200 tokens: blocks of 64, 64, 64, 8
  // Head 2 keeps nothing: its streams are empty and it decodes to its mean.
  b.params[2].kept.clear(), b.params[2].basis.clear(), b.params[2].quant.clear(), b.params[2].rans_tables.clear();
  const FlatKvtcTables t = flatten_heads(b.ptrs());
  const EncodedBatch e = encode_batch_reference(t, b.x.data(), b.tokens, 64);
  ASSERT_EQ(e.offsets.size(), 3u * 4u + 1u);
  for (size_t i = 8; i < 12; ++i) EXPECT_EQ(e.offsets[i + 1], e.offsets[i]);
  std::vector<uint16_t> y(b.x.size());
  decode_batch_reference(t, e.payload.data(), e.payload.size(), e.offsets.data(), b.tokens, 64, y.data());
  for (int h = 0; h < 2; ++h) {
    std::vector<uint16_t> codes(size_t(b.tokens) * size_t(b.params[size_t(h)].n_kept())), yh(size_t(b.tokens * dim));
    quantize_reference(t, h, b.x.data() + size_t(h) * size_t(b.tokens * dim), b.tokens, codes.data());
    dequantize_reference(t, h, codes.data(), b.tokens, yh.data());
    EXPECT_TRUE(std::equal(yh.begin(), yh.end(), y.begin() + long(size_t(h) * size_t(b.tokens * dim))));
  }
  for (int64_t i = 0; i < b.tokens * dim; ++i)
    ASSERT_EQ(y[size_t(2 * b.tokens * dim + i)], f32_to_bf16_rne(b.params[2].mean[size_t(i % dim)]));
}

TEST(KvtcVariant, MalformedStreamsAreRejected) {
  const int dim = 64;
  const std::vector<uint16_t> x = synth_bf16(256, dim, 3);
  const kvtc::HeadParams p = fit(x.data(), 256, dim);
  const FlatKvtcTables t = flatten_heads({&p});
  const int K = p.n_kept();
  std::vector<uint16_t> codes(size_t(64 * K)), back(size_t(64 * K));
  quantize_reference(t, 0, x.data(), 64, codes.data());
  const std::vector<uint8_t> s = rans_warp_encode(t, 0, codes.data(), 64);
  auto decode = [&](const std::vector<uint8_t>& bytes) {
    rans_warp_decode(t, 0, bytes.data(), bytes.size(), 64, back.data());
  };
  std::vector<uint8_t> cut(s.begin(), s.end() - 1);
  EXPECT_THROW(decode(cut), Error);
  std::vector<uint8_t> longer = s;
  longer.push_back(0);
  EXPECT_THROW(decode(longer), Error);
  EXPECT_THROW(decode(std::vector<uint8_t>(s.begin(), s.begin() + 100)), Error);
  std::vector<uint8_t> bad_state = s;
  bad_state[0] = bad_state[1] = bad_state[2] = bad_state[3] = 0;  // lane 0 state below 2^15
  EXPECT_THROW(decode(bad_state), Error);
  bad_state = s;
  bad_state[7] = 0x80;  // lane 1 state at 2^31 or above
  EXPECT_THROW(decode(bad_state), Error);
  // Every single-byte flip either throws a format error or decodes to valid
  // codes (never a crash or out-of-range read: ASan watches).
  int thrown = 0;
  for (size_t i = 0; i < s.size(); i += 3) {
    std::vector<uint8_t> f = s;
    f[i] ^= 0x5a;
    try {
      decode(f);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kFormat);
      ++thrown;
    }
  }
  EXPECT_GT(thrown, 0);
  std::vector<uint64_t> offsets{0, s.size() + 5};
  std::vector<uint16_t> y(64 * dim);
  EXPECT_THROW(decode_batch_reference(t, s.data(), s.size(), offsets.data(), 64, 64, y.data()), Error);
}

TEST(KvtcVariant, RejectsUnsupportedHeads) {
  const std::vector<uint16_t> x = synth_bf16(128, 32, 1);
  const kvtc::HeadParams p32 = fit(x.data(), 128, 32);
  try {
    flatten_heads({&p32});
    FAIL() << "head_dim 32 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("head_dim 32"), std::string::npos);
  }
  EXPECT_THROW(flatten_heads({}), Error);
}

// --- GPU against the CPU reference -------------------------------------------------

#ifdef KVCODEC_HAVE_CUDA
void gpu_matches_cpu(const Batch& b, int chunks_for_decode = 8) {
  const FlatKvtcTables t = flatten_heads(b.ptrs());
  const EncodedBatch ref = encode_batch_reference(t, b.x.data(), b.tokens, 64);
  std::vector<uint16_t> y_ref(b.x.size());
  decode_batch_reference(t, ref.payload.data(), ref.payload.size(), ref.offsets.data(), b.tokens, 64, y_ref.data());

  KvtcGpuCodec codec(b.ptrs(), b.tokens);
  const int64_t ns = codec.n_streams(b.tokens);
  DevBuf<uint16_t> dx(b.x.size()), dy(b.x.size());
  DevBuf<uint8_t> dout(codec.max_encoded_bytes(b.tokens));
  DevBuf<uint64_t> doff(size_t(ns + 1));
  ASSERT_EQ(cudaMemcpy(dx.p, b.x.data(), b.x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  const uint64_t total = codec.encode(dx.p, b.tokens, dout.p, codec.max_encoded_bytes(b.tokens), doff.p);
  ASSERT_EQ(total, ref.payload.size());
  std::vector<uint8_t> payload(total);
  std::vector<uint64_t> offsets(size_t(ns + 1));
  ASSERT_EQ(cudaMemcpy(payload.data(), dout.p, total, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(offsets.data(), doff.p, offsets.size() * 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(offsets, ref.offsets);
  EXPECT_TRUE(payload == ref.payload) << "GPU bytes differ from the CPU reference";

  // Pipelining changes the order of the launches, never the bytes.
  for (int chunks : {1, 3}) {
    codec.set_pipeline_chunks(chunks);
    ASSERT_EQ(cudaMemset(dout.p, 0, total), cudaSuccess);
    ASSERT_EQ(codec.encode(dx.p, b.tokens, dout.p, codec.max_encoded_bytes(b.tokens), doff.p), total);
    std::vector<uint8_t> again(total);
    ASSERT_EQ(cudaMemcpy(again.data(), dout.p, total, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_TRUE(again == ref.payload) << "chunks " << chunks;
    std::vector<uint64_t> offsets_again(offsets.size());
    ASSERT_EQ(cudaMemcpy(offsets_again.data(), doff.p, offsets.size() * 8, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(offsets_again, ref.offsets) << "chunks " << chunks;
  }
  codec.set_pipeline_chunks(chunks_for_decode);
  EXPECT_THROW(codec.set_pipeline_chunks(0), Error);

  // GPU decode of the CPU's bytes equals the CPU decode, bit for bit.
  ASSERT_EQ(cudaMemcpy(dout.p, ref.payload.data(), ref.payload.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(doff.p, ref.offsets.data(), ref.offsets.size() * 8, cudaMemcpyHostToDevice), cudaSuccess);
  codec.decode(dout.p, ref.payload.size(), doff.p, b.tokens, dy.p);
  codec.check_errors();
  std::vector<uint16_t> y(b.x.size());
  ASSERT_EQ(cudaMemcpy(y.data(), dy.p, y.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  size_t bad = 0;
  for (size_t i = 0; i < y.size(); ++i) bad += y[i] != y_ref[i];
  EXPECT_EQ(bad, 0u) << "of " << y.size() << " reconstructed values";

  // Tensor-core reconstruction of the same streams: within the stated bound
  // of the exact values, every output written (poisoned with NaN first).
  codec.set_reconstruction(KvtcGpuCodec::Reconstruction::kTf32TensorCores);
  ASSERT_EQ(cudaMemset(dy.p, 0xff, y.size() * 2), cudaSuccess);
  codec.decode(dout.p, ref.payload.size(), doff.p, b.tokens, dy.p);
  codec.check_errors();
  std::vector<uint16_t> y_tc(b.x.size());
  ASSERT_EQ(cudaMemcpy(y_tc.data(), dy.p, y_tc.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  size_t n_diff = 0;
  EXPECT_EQ(tf32_bound_violations(t, t.n_heads, b.x.data(), b.tokens, y_tc.data(), y_ref.data(), &n_diff), 0u) << "of " << y_tc.size() << " tensor-core outputs";
  std::printf("tensor-core reconstruction: %zu of %zu bf16 outputs differ from the exact path\n",
              n_diff, y_tc.size());

  // Integer reconstruction: a head with the integer tables gives the
  // reference's integer path bit for bit; a head without them, and every
  // head when the codes are 16-bit, the TF32 path's outputs, bit for bit.
  std::vector<uint16_t> y_int_ref(b.x.size()), y_int(b.x.size());
  decode_batch_reference(t, ref.payload.data(), ref.payload.size(), ref.offsets.data(), b.tokens, 64, y_int_ref.data(),
                         0, /*integer_reconstruction=*/true);
  codec.set_reconstruction(KvtcGpuCodec::Reconstruction::kInteger);
  ASSERT_EQ(cudaMemset(dy.p, 0xff, y.size() * 2), cudaSuccess);
  codec.decode(dout.p, ref.payload.size(), doff.p, b.tokens, dy.p);
  codec.check_errors();
  ASSERT_EQ(cudaMemcpy(y_int.data(), dy.p, y_int.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  const bool wide = *std::max_element(t.max_code.begin(), t.max_code.end()) > 255.0f;
  const size_t per_head = size_t(b.tokens) * size_t(t.dim);
  size_t int_heads = 0, int_bad = 0;
  for (int h = 0; h < t.n_heads; ++h) {
    const bool integer = !wide && t.recon_int[size_t(h)];
    int_heads += integer;
    const std::vector<uint16_t>& want = integer ? y_int_ref : y_tc;
    for (size_t i = size_t(h) * per_head; i < size_t(h + 1) * per_head; ++i) int_bad += y_int[i] != want[i];
  }
  EXPECT_EQ(int_bad, 0u) << "of " << y_int.size() << " integer-path outputs (" << int_heads << " integer heads)";
  std::printf("integer reconstruction: %zu of %d heads on the integer path\n", int_heads, t.n_heads);
  // Fused (one kernel where every head has the integer tables and the codes
  // are 8-bit; the two kernels otherwise): the same outputs.
  std::vector<uint16_t> y_int_fused(b.x.size());
  codec.set_fused_decode(true);
  ASSERT_EQ(cudaMemset(dy.p, 0xff, y.size() * 2), cudaSuccess);
  codec.decode(dout.p, ref.payload.size(), doff.p, b.tokens, dy.p);
  codec.check_errors();
  ASSERT_EQ(cudaMemcpy(y_int_fused.data(), dy.p, y_int_fused.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  codec.set_fused_decode(false);
  EXPECT_TRUE(y_int_fused == y_int) << "fused and two-kernel integer decodes differ";
  codec.set_reconstruction(KvtcGpuCodec::Reconstruction::kExactFp32);
  EXPECT_THROW(codec.set_reconstruction(KvtcGpuCodec::Reconstruction(7)), Error);

  // A truncated stream is reported, not decoded.
  expect_truncation_flagged(codec, ref.offsets, doff.p, dout.p, ref.payload.size(), b.tokens, dy.p);
}
#endif

// A build without CUDA (src/gpu/nocuda/without_cuda.cpp) keeps the GPU API and
// answers every call with a clear error.
TEST(KvtcGpu, WithoutCudaEveryCodecSaysSo) {
  if (cuda_compiled()) GTEST_SKIP() << "built with CUDA";
  EXPECT_EQ(device_count(), 0);
  try {
    KvtcGpuCodec codec(std::vector<const kvtc::HeadParams*>{}, 1);
    ADD_FAILURE() << "a codec was made without CUDA";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("without CUDA"), std::string::npos) << e.what();
  }
}

TEST(KvtcGpu, MatchesCpuReferenceOnRandomInput) {
  if (!cuda_compiled()) GTEST_SKIP() << "built without CUDA (-DKVCODEC_CUDA=ON)";
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
#ifdef KVCODEC_HAVE_CUDA
  const uint32_t seed = test_seed(1234);
  std::printf("seed %u\n", seed);
  for (int dim : {64, 128}) {
    gpu_matches_cpu(synth_batch(4, 64 * 5 + 17, dim, seed + uint32_t(dim)));
    gpu_matches_cpu(synth_batch(5, 64 * 3, dim, seed + 7 + uint32_t(dim)), 1);  // decode in order
  }
#endif
}

TEST(KvtcVariant, WideAlphabetsRoundTrip) {
  // 10-bit components: 1024-symbol alphabets (the GPU keeps u16 code slots).
  const int dim = 64;
  const std::vector<uint16_t> x = synth_bf16(256, dim, 17);
  const kvtc::HeadParams p = fit(x.data(), 256, dim, 6 * dim, {0, 2, 10});
  const FlatKvtcTables t = flatten_heads({&p});
  float max_code = 0;
  for (int k = 0; k < p.n_kept(); ++k) max_code = std::max(max_code, t.max_code[t.idx(0, k)]);
  ASSERT_GT(max_code, 255.0f);
  const EncodedBatch e = encode_batch_reference(t, x.data(), 256, 64);
  std::vector<uint16_t> y(x.size());
  decode_batch_reference(t, e.payload.data(), e.payload.size(), e.offsets.data(), 256, 64, y.data());
  std::vector<uint16_t> codes(size_t(256) * size_t(p.n_kept())), yr(x.size());
  quantize_reference(t, 0, x.data(), 256, codes.data());
  dequantize_reference(t, 0, codes.data(), 256, yr.data());
  EXPECT_EQ(y, yr);
}

TEST(KvtcGpu, MatchesCpuReferenceWithWideAlphabets) {
  if (!cuda_compiled()) GTEST_SKIP() << "built without CUDA (-DKVCODEC_CUDA=ON)";
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
#ifdef KVCODEC_HAVE_CUDA
  const uint32_t seed = test_seed(77);
  Batch b;
  b.dim = 128;
  b.tokens = 64 * 3 + 5;
  for (int h = 0; h < 3; ++h) {
    std::vector<uint16_t> xh = synth_bf16(b.tokens, b.dim, seed + 100 + uint32_t(h));
    b.params.push_back(fit(xh.data(), b.tokens, b.dim, 6 * b.dim, {0, 2, 10}));
    b.x.insert(b.x.end(), xh.begin(), xh.end());
  }
  // A head whose tables carry 16 bits: the streams code them rebuilt at 15.
  b.params.push_back(with_16_bit_tables(b.params[0]));
  const std::vector<uint16_t> x0(b.x.begin(), b.x.begin() + long(b.tokens * b.dim));
  b.x.insert(b.x.end(), x0.begin(), x0.end());
  gpu_matches_cpu(b);
#endif
}

TEST(KvtcGpu, MatchesCpuReferenceOnTheKvDump) {
  if (!cuda_compiled()) GTEST_SKIP() << "built without CUDA (-DKVCODEC_CUDA=ON)";
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::string path = kv_dump_path();
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is absent";
#ifdef KVCODEC_HAVE_CUDA
  const SafetensorsFile f = SafetensorsFile::open(path);
  // Layer picked by the seed (a fresh one each bench run); K and V of each
  // kv head, fitted on the first half of the window, coded whole.
  const int layer = int(test_seed(0) % 6);
  Batch b;
  for (const char* kind : {"key", "value"}) {
    const Tensor tt = f.tensor("layers." + std::to_string(layer) + "." + kind, DType::kBF16);
    const Shape4 s = tt.shape();  // [B, H, S, D]
    b.dim = int(s[3]);
    b.tokens = s[2];
    for (int64_t h = 0; h < s[0] * s[1]; ++h) {
      const uint16_t* xh = tt.data_as<uint16_t>() + h * s[2] * s[3];
      b.params.push_back(fit(xh, s[2] / 2, b.dim));
      b.x.insert(b.x.end(), xh, xh + s[2] * s[3]);
    }
  }
  gpu_matches_cpu(b);
#endif
}

}  // namespace
}  // namespace kvcodec::gpu

// kvtc::encode_codes / decode_codes: the entropy-coding half of
// encode_block / decode_block on its own (src/kvtc/block_codes.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kvcodec/error.hpp"
#include "kvtc/block_codes.hpp"
#include "kvtc/codec.hpp"
#include "linalg/pca.hpp"

using namespace kvcodec;
using namespace kvcodec::kvtc;

namespace {

std::vector<float> decaying(int64_t n, int dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(size_t(n * dim));
  for (int64_t i = 0; i < n; ++i)
    for (int d = 0; d < dim; ++d) x[size_t(i * dim + d)] = g(rng) * 3.0f * std::exp(-0.15f * float(d)) + 0.1f * float(d % 3);
  return x;
}

TEST(BlockCodes, SameBytesAsEncodeBlockAndInverse) {
  const int dim = 24;
  const std::vector<float> fit_x = decaying(512, dim, 3), x = decaying(64, dim, 4);
  const linalg::PcaBasis pca = linalg::fit_pca(fit_x.data(), 512, dim);
  for (const CoderChoice coder : {CoderChoice::kRans, CoderChoice::kHuffman, CoderChoice::kFixed}) {
    CodecOptions o;
    o.bit_budget = 3 * dim;
    o.coder = coder;
    const HeadParams p = fit_head(fit_x.data(), 512, dim, pca.mean, pca.components, pca.eigenvalues, o);
    const size_t K = size_t(p.n_kept());
    ASSERT_GT(K, 0u);
    for (const int64_t n : {int64_t(0), int64_t(1), int64_t(17), int64_t(64)}) {
      std::vector<uint16_t> codes(size_t(n) * K);
      quantize_block(p, x.data(), n, codes.data());
      const std::vector<uint8_t> bytes = encode_codes(p, codes.data(), n);
      EXPECT_EQ(bytes, encode_block(p, x.data(), n)) << int(coder) << " n=" << n;
      std::vector<uint16_t> back(size_t(n) * K, 0xffff);
      decode_codes(p, bytes.data(), bytes.size(), n, back.data());
      EXPECT_EQ(back, codes);
      // A block grown by appending codes equals the block coded at once.
      if (n == 64) {
        std::vector<uint16_t> head(codes.begin(), codes.begin() + 17 * int64_t(K));
        const auto part = encode_codes(p, head.data(), 17);
        std::vector<uint16_t> grown(size_t(17) * K);
        decode_codes(p, part.data(), part.size(), 17, grown.data());
        grown.insert(grown.end(), codes.begin() + 17 * int64_t(K), codes.end());
        EXPECT_EQ(encode_codes(p, grown.data(), 64), bytes);
      }
    }
    // A code outside its component's levels is refused, naming it.
    std::vector<uint16_t> bad(K, 0);
    bad[K - 1] = p.quant[K - 1].levels;
    EXPECT_THROW(encode_codes(p, bad.data(), 1), Error);
    // Damaged bytes are refused (or, for fixed-width packing where every bit
    // pattern is a code, at least never read out of bounds).
    std::vector<uint16_t> codes(size_t(64) * K);
    quantize_block(p, x.data(), 64, codes.data());
    const auto bytes = encode_codes(p, codes.data(), 64);
    std::vector<uint16_t> out(size_t(64) * K);
    if (bytes.size() > 1) {
      EXPECT_THROW(decode_codes(p, bytes.data(), bytes.size() - 1, 64, out.data()), Error) << int(coder);
    }
    std::vector<uint8_t> longer = bytes;
    longer.push_back(0);
    EXPECT_THROW(decode_codes(p, longer.data(), longer.size(), 64, out.data()), Error) << int(coder);
  }
}

}  // namespace

// PALU building blocks: bit packing, asymmetric group quantization, head
// groups, projection fit (rank by energy, explicit, Hadamard-rotated) and its
// serialisation.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"
#include "palu/bitpack.hpp"
#include "palu/group_quant.hpp"
#include "palu/projection.hpp"

using namespace kvcodec;

TEST(BitPack, RoundTripsEveryWidth) {
  std::mt19937 rng(7);
  for (int bits = 1; bits <= 16; ++bits) {
    std::vector<uint32_t> codes(1001);
    for (auto& c : codes) c = rng() & ((1u << bits) - 1u);
    std::vector<uint8_t> out;
    {
      detail::BitWriter w(out);
      for (auto c : codes) w.put(c, bits);
    }
    EXPECT_EQ(out.size(), detail::packed_bytes(codes.size(), bits));
    detail::BitReader r(out.data(), out.size());
    for (auto c : codes) ASSERT_EQ(r.get(bits), c) << bits;
    detail::BitReader short_reader(out.data(), out.size() / 2);
    EXPECT_THROW(for (size_t i = 0; i < codes.size(); ++i) short_reader.get(bits), Error);
  }
}

TEST(GroupQuant, ErrorWithinHalfStepAndEndsReachable) {
  std::mt19937 rng(3);
  std::normal_distribution<float> n(1.0f, 3.0f);
  for (int bits : {1, 2, 3, 4, 8}) {
    std::vector<float> x(64);
    for (auto& v : x) v = n(rng);
    const auto p = detail::asym_fit(x.data(), 64, 1, bits);
    std::vector<uint8_t> buf;
    {
      detail::BitWriter w(buf);
      detail::asym_encode(p, x.data(), 64, 1, bits, w);
    }
    std::vector<float> y(64);
    detail::BitReader r(buf.data(), buf.size());
    detail::asym_decode(p, 64, bits, r, y.data(), 1);
    const float step = f16_to_f32(p.scale_f16);
    const float mn = f16_to_f32(p.min_f16);
    for (int i = 0; i < 64; ++i) {
      // f16 rounding of min can put a value up to half an f16 ulp below min.
      EXPECT_LE(std::fabs(x[i] - y[i]), 0.5f * step + std::fabs(mn) * 1e-3f + 1e-6f) << bits << " " << i;
    }
  }
  // A constant group is exact; NaN does not crash and decodes finite.
  std::vector<float> c(8, 2.5f);
  c[3] = NAN;
  const auto p = detail::asym_fit(c.data(), 8, 1, 2);
  std::vector<uint8_t> buf;
  {
    detail::BitWriter w(buf);
    detail::asym_encode(p, c.data(), 8, 1, 2, w);
  }
  std::vector<float> y(8);
  detail::BitReader r(buf.data(), buf.size());
  detail::asym_decode(p, 8, 2, r, y.data(), 1);
  EXPECT_EQ(y[0], 2.5f);
  EXPECT_TRUE(std::isfinite(y[3]));
  EXPECT_EQ(detail::clamp_code(NAN, 3), 0);
  EXPECT_EQ(detail::clamp_code(1e30f, 3), 3);
  EXPECT_EQ(detail::f16_saturate(1e9f), 0x7bffu);
}

TEST(GroupQuant, ChannelGroupMatchesPerChannelReference) {
  // The group codec must equal quantizing each (row, channel) series alone.
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const int rows = 3, ch = 5, tok = 7;
  std::vector<uint8_t> bits{4, 2, 2, 3, 1};
  std::vector<float> x(rows * ch * tok);
  for (auto& v : x) v = n(rng) * 4.0f;
  std::vector<uint8_t> blob;
  detail::encode_channel_group(x.data(), rows, ch, tok, bits.data(), blob);
  ASSERT_EQ(blob.size(), detail::channel_group_bytes(rows, ch, tok, bits.data()));
  std::vector<float> y(x.size());
  detail::decode_channel_group(blob.data(), blob.size(), rows, ch, tok, bits.data(), y.data());
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < ch; ++c) {
      std::vector<float> series(tok), ref(tok);
      for (int t = 0; t < tok; ++t) series[t] = x[(t * rows + r) * ch + c];
      const auto p = detail::asym_fit(series.data(), tok, 1, bits[c]);
      std::vector<uint8_t> b;
      {
        detail::BitWriter w(b);
        detail::asym_encode(p, series.data(), tok, 1, bits[c], w);
      }
      detail::BitReader rd(b.data(), b.size());
      detail::asym_decode(p, tok, bits[c], rd, ref.data(), 1);
      for (int t = 0; t < tok; ++t) ASSERT_EQ(y[(t * rows + r) * ch + c], ref[t]);
    }
  EXPECT_THROW(detail::decode_channel_group(blob.data(), blob.size() - 1, rows, ch, tok, bits.data(), y.data()), Error);
  // Row groups (KIVI values).
  std::vector<uint8_t> rb;
  detail::encode_row_groups(x.data(), 32, 8, 2, rb);
  EXPECT_EQ(rb.size(), detail::row_group_bytes(32, 8, 2));
  std::vector<float> z(32);
  detail::decode_row_groups(rb.data(), rb.size(), 32, 8, 2, z.data());
  for (int i = 0; i < 32; ++i) EXPECT_LT(std::fabs(z[i] - x[i]), 8.0f);
}

TEST(Palu, HeadGroupsSplitContiguouslyFirstGetExtra) {
  using V = std::vector<std::pair<int, int>>;
  EXPECT_EQ(palu::split_head_groups(5, 2), (V{{0, 3}, {3, 2}}));
  EXPECT_EQ(palu::split_head_groups(2, 4), (V{{0, 1}, {1, 1}}));
  EXPECT_EQ(palu::split_head_groups(8, 4), (V{{0, 2}, {2, 2}, {4, 2}, {6, 2}}));
  EXPECT_EQ(palu::split_head_groups(7, 3), (V{{0, 3}, {3, 2}, {5, 2}}));
  EXPECT_EQ(palu::split_head_groups(3, 0), (V{{0, 3}}));
}

static std::vector<float> low_rank(int n, int dim, int rank, uint32_t seed, float noise) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> w(dim * rank), x(size_t(n) * dim);
  for (auto& v : w) v = g(rng);
  for (int i = 0; i < n; ++i) {
    std::vector<float> z(rank);
    for (int k = 0; k < rank; ++k) z[k] = g(rng) * float(rank - k);
    for (int d = 0; d < dim; ++d) {
      float acc = noise * g(rng);
      for (int k = 0; k < rank; ++k) acc += w[d * rank + k] * z[k];
      x[size_t(i) * dim + d] = acc;
    }
  }
  return x;
}

TEST(Palu, FitFindsRankByEnergyAndReconstructs) {
  const int dim = 16, n = 400;
  const auto x = low_rank(n, dim, 3, 5, 0.01f);
  palu::FitOptions opt;
  opt.energy_threshold = 0.999;
  const auto p = palu::fit_projection(x.data(), n, dim, opt);
  EXPECT_EQ(p.rank, 3);
  EXPECT_EQ(std::count(p.bits.begin(), p.bits.end(), uint8_t(4)), 1);  // round(0.25 * 3) = 1
  double num = 0, den = 0;
  std::vector<float> z(p.rank), y(dim);
  for (int i = 0; i < n; ++i) {
    p.project(x.data() + i * dim, z.data());
    p.reconstruct(z.data(), y.data());
    for (int d = 0; d < dim; ++d) {
      num += std::pow(y[d] - x[i * dim + d], 2);
      den += std::pow(x[i * dim + d], 2);
    }
  }
  EXPECT_LT(num / den, 1e-4);  // f16 basis and 1% noise
  // Channel energies descend without rotation; the first channel is hi.
  EXPECT_GE(p.channel_energy[0], p.channel_energy[1]);
  EXPECT_EQ(p.bits[0], 4);

  opt.rank = 5;
  EXPECT_EQ(palu::fit_projection(x.data(), n, dim, opt).rank, 5);
  opt.rank = 0;
  opt.energy_threshold = 0.5;
  EXPECT_LT(palu::fit_projection(x.data(), n, dim, opt).rank, 3);
}

TEST(Palu, HadamardRotationKeepsSubspaceAndOrthonormality) {
  const int dim = 32, n = 300;
  const auto x = low_rank(n, dim, 6, 9, 0.1f);
  palu::FitOptions opt;
  opt.rank = 6;
  const auto plain = palu::fit_projection(x.data(), n, dim, opt);
  opt.hadamard = true;
  const auto rot = palu::fit_projection(x.data(), n, dim, opt);
  // U^T U ~ I (f16 rounding), and both reconstruct the same subspace.
  for (int a = 0; a < 6; ++a)
    for (int b = 0; b < 6; ++b) {
      double dot = 0;
      for (int i = 0; i < dim; ++i) dot += double(rot.basis[i * 6 + a]) * rot.basis[i * 6 + b];
      EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 2e-3);
    }
  std::vector<float> z(6), y1(dim), y2(dim);
  for (int i = 0; i < 10; ++i) {
    plain.project(x.data() + i * dim, z.data());
    plain.reconstruct(z.data(), y1.data());
    rot.project(x.data() + i * dim, z.data());
    rot.reconstruct(z.data(), y2.data());
    for (int d = 0; d < dim; ++d) EXPECT_NEAR(y1[d], y2[d], 0.05);
  }
  // Rotation spreads energy: the max/min channel energy ratio shrinks.
  auto spread = [](const palu::Projection& p) {
    const auto [lo, hi] = std::minmax_element(p.channel_energy.begin(), p.channel_energy.end());
    return *hi / *lo;
  };
  EXPECT_LT(spread(rot), spread(plain));
}

TEST(Palu, ProjectionSerialisesExactlyAndRejectsBadBytes) {
  const auto x = low_rank(100, 8, 2, 1, 0.1f);
  palu::FitOptions opt;
  opt.rank = 3;
  const auto p = palu::fit_projection(x.data(), 100, 8, opt);
  ByteWriter w;
  p.serialize(w);
  const std::vector<uint8_t> bytes = w.take();
  ASSERT_EQ(bytes.size(), p.serialized_size());
  // The stored form (projection.hpp): u16 dim, u16 rank, the widths, the f16 basis, little-endian.
  ASSERT_GE(bytes.size(), 4u + 3u + 2u);
  EXPECT_EQ(bytes[0] | bytes[1] << 8, 8);
  EXPECT_EQ(bytes[2] | bytes[3] << 8, 3);
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin() + 4, bytes.begin() + 7), p.bits);
  EXPECT_EQ(uint16_t(bytes[7] | bytes[8] << 8), p.basis_f16[0]);
  ByteReader in(bytes, "projection");
  const auto q = palu::Projection::deserialize(in, 8);
  EXPECT_TRUE(in.at_end());
  EXPECT_EQ(q.basis, p.basis);
  EXPECT_EQ(q.bits, p.bits);
  ByteReader short_by_one(bytes.data(), bytes.size() - 1, "projection");
  EXPECT_THROW(palu::Projection::deserialize(short_by_one, 8), Error);
  ByteReader other_dim(bytes, "projection");
  EXPECT_THROW(palu::Projection::deserialize(other_dim, 16), Error);
  auto bad = bytes;
  bad[4] = 0;  // a width of 0 bits
  ByteReader zero_width(bad, "projection");
  try {
    palu::Projection::deserialize(zero_width, 8);
    ADD_FAILURE() << "a width of 0 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("PALU latent width 0"), std::string::npos) << e.what();
  }
}

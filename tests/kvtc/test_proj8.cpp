// The 8-bit projection (HeadKernels::proj8, KernelSet::kProjection8): its
// VNNI, AVX2 and plain kernels give the reference's codes; the rows its gate
// refuses take the 16-bit projection, row by row; the noise it adds stays
// within what the gate allows; it runs only where its kernels were built.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "codec_fixtures.hpp"
#include "core/cpu_features.hpp"
#include "kvcodec/error.hpp"
#include "kvtc/codec.hpp"

using namespace kvcodec;
using namespace kvcodec::kvtc;
using namespace kvcodec::kvtc::fixtures;

namespace {

constexpr KernelSet kEncoder8 = KernelSet::kBoth | KernelSet::kProjection8;

HeadParams fit8(const std::vector<float>& x, int64_t n, int dim, const CodecOptions& o) {
  HeadParams p = fit(x, n, dim, o);
  p.build_kernels(kEncoder8);
  return p;
}

std::vector<uint16_t> codes_of(const HeadParams& p, const float* x, int64_t n, QuantPath path) {
  std::vector<uint16_t> c(size_t(n) * size_t(p.n_kept()));
  quantize_block_path(p, x, n, c.data(), path);
  return c;
}

}  // namespace

// quantize_block with kProjection8 kernels == the plain-loop reference, bit
// for bit, by the VNNI tiles (where the CPU has them), the AVX2 tiles and the
// plain loops: dims with ragged groups of 4, 8 and 32; K not a multiple of 8
// or 32; blocks of 1 to fit_n rows (the tiles' row remainders). Its codes are
// not the 16-bit projection's everywhere (so the rows did take it).
TEST(Proj8, CodesEqualThePlainReferenceOnEveryPath) {
  size_t heads = 0, rows_differing = 0, rows = 0;
  for (int dim : {8, 13, 24, 37, 64, 72, 128, 130}) {
    const int64_t fit_n = 4 * dim + 64;
    const auto x = correlated(fit_n, dim, uint32_t(900 + dim));
    for (int setting = 0; setting < 4; ++setting) {
      const HeadParams p = fit8(x, fit_n, dim, setting_options(setting, dim, dim / 2 + 3));
      ASSERT_TRUE(p.derived().proj8) << "dim " << dim << " setting " << setting;
      ++heads;
      const size_t K = size_t(p.n_kept());
      for (int64_t n : {int64_t(1), int64_t(3), int64_t(5), int64_t(7), int64_t(64), fit_n}) {
        std::vector<uint16_t> ref(size_t(n) * K);
        quantize_block_int8_reference(p, x.data(), n, ref.data());
        const std::string at = "dim " + std::to_string(dim) + " setting " + std::to_string(setting) + " n " +
                               std::to_string(n);
        for (int mode = 0; mode < 3; ++mode) {
          ScopedSimd simd(mode < 2);
          ScopedVnni vnni(mode == 0);
          EXPECT_EQ(codes_of(p, x.data(), n, QuantPath::kAuto), ref) << at << " mode " << mode;
          EXPECT_EQ(codes_of(p, x.data(), n, QuantPath::kInteger8), ref) << at << " mode " << mode;
        }
        if (n != fit_n) continue;
        const auto sixteen = codes_of(p, x.data(), n, QuantPath::kInteger);
        for (int64_t t = 0; t < n; ++t) {
          ++rows;
          rows_differing += !std::equal(ref.begin() + t * int64_t(K), ref.begin() + (t + 1) * int64_t(K),
                                        sixteen.begin() + t * int64_t(K));
        }
      }
    }
  }
  EXPECT_EQ(heads, 32u);
  EXPECT_GT(rows_differing, rows / 20) << rows;
}

// Rows the gate refuses (an outlier far past the steps, a NaN, an infinity)
// take the 16-bit projection (then the float one) and the other rows of the
// block keep the codes they have alone: a row's codes depend on that row
// only, in the kernels and the reference alike.
TEST(Proj8, RefusedRowsTakeTheSixteenBitProjection) {
  const int dim = 64;
  const int64_t fit_n = 320;
  const auto x = correlated(fit_n, dim, 77);
  CodecOptions o;
  o.allocator = Allocator::kRate;
  o.target_rel_mse = 0.01;
  const HeadParams p = fit8(x, fit_n, dim, o);
  ASSERT_TRUE(p.derived().proj8);
  const size_t K = size_t(p.n_kept()), D = size_t(dim);
  const int64_t n = 9;
  std::vector<float> block(x.begin(), x.begin() + n * dim);
  // An outlier: the row's largest |c| alone then asks more than the gate gives.
  const float outlier = 4.0f / std::sqrt(p.derived().proj8_gate_m);
  block[2 * D + 5] = p.mean[5] + outlier;
  block[5 * D + 1] = std::nanf("");
  block[7 * D + 3] = std::numeric_limits<float>::infinity();
  const auto got = codes_of(p, block.data(), n, QuantPath::kAuto);
  std::vector<uint16_t> ref(got.size());
  quantize_block_int8_reference(p, block.data(), n, ref.data());
  EXPECT_EQ(got, ref);
  for (int mode = 1; mode < 3; ++mode) {  // the AVX2 tiles and the plain loops (the rows taken gathered)
    ScopedSimd simd(mode < 2);
    ScopedVnni vnni(false);
    EXPECT_EQ(codes_of(p, block.data(), n, QuantPath::kAuto), ref) << "mode " << mode;
  }
  for (int64_t t = 0; t < n; ++t) {
    const bool refused = t == 2 || t == 5 || t == 7;
    const auto alone = codes_of(p, block.data() + t * dim, 1, refused ? QuantPath::kInteger : QuantPath::kInteger8);
    EXPECT_TRUE(std::equal(alone.begin(), alone.end(), got.begin() + t * int64_t(K))) << "row " << t;
  }
}

// The noise the 8-bit roundings add stays within the gate's share, 1/16 of
// the quantisers' (sum_k step_k^2 / 12 per row): on heads of the rate
// allocator at 1% and 5%, the squared error the 8-bit codes add to the
// exact projection's (float path) over the block. A wrong factor or weight
// scale (codes off by more than the roundings) fails it by orders of
// magnitude; measured here, 1e-3 to 1e-2 of the allowance.
TEST(Proj8, AddedErrorStaysWithinTheGatesShare) {
  for (int dim : {64, 128}) {
    const int64_t n = 8 * dim;
    const auto x = correlated(n, dim, uint32_t(1300 + dim));
    for (int setting = 0; setting < 2; ++setting) {
      const HeadParams p = fit8(x, n, dim, setting_options(setting, dim, 0));
      const auto eight = codes_of(p, x.data(), n, QuantPath::kInteger8);
      const auto exact = codes_of(p, x.data(), n, QuantPath::kFloat);
      EXPECT_NE(eight, exact);  // the roundings do move some codes
      std::vector<float> y8(x.size()), yf(x.size());
      dequantize_block(p, eight.data(), n, y8.data());
      dequantize_block(p, exact.data(), n, yf.data());
      double added = 0, noise = 0;
      for (size_t i = 0; i < x.size(); ++i)
        added += double(y8[i] - x[i]) * (y8[i] - x[i]) - double(yf[i] - x[i]) * (yf[i] - x[i]);
      for (const ComponentQuantizer& q : p.quant) noise += double(q.step) * q.step / 12.0 * double(n);
      EXPECT_LE(added, noise / 16.0) << "dim " << dim << " setting " << setting;
      std::printf("dim %d setting %d: added %.4g, 1/16 of the quantisers' noise %.4g\n", dim, setting, added,
                  noise / 16.0);
    }
  }
}

// The gates are their definition (HeadKernels::proj8): proj8_gate_m =
// max_k ||b_k||^2 / (127 step_k / 4)^2 and proj8_gate_ss = max_k
// ||W8[k] / unit8[k] - b_k||^2 / (D (step_k / 4)^2), unit8[k] = 127 /
// max_d |b_k[d]|, W8 = round(b_k * unit8[k]); qscale and bias likewise.
// An 8-bit stored basis (setting 0) is a multiple of 1/unit8 already: its
// weights round exactly, proj8_gate_ss is rounding noise; a 16-bit one
// (setting 3) is not.
TEST(Proj8, TablesAreTheirDefinition) {
  for (int dim : {13, 64, 128})
  for (int setting : {0, 3}) {
    const auto x = correlated(6 * dim, dim, uint32_t(40 + dim));
    const HeadParams p = fit8(x, 6 * dim, dim, setting_options(setting, dim, 0));
    const HeadKernels& k8 = p.derived();
    ASSERT_TRUE(k8.proj8);
    const size_t K = size_t(p.n_kept()), D = size_t(dim), dp4 = (D + 3) / 4;
    double gate_m = 0, gate_ss = 0;
    for (size_t k = 0; k < K; ++k) {
      double bmax = 0, norm2 = 0, err2 = 0;
      for (size_t d = 0; d < D; ++d) bmax = std::max(bmax, std::fabs(double(p.basis[k * D + d])));
      const double unit = 127.0 / bmax, quarter = p.quant[k].step / 4.0;
      int32_t sum = 0;
      for (size_t d = 0; d < D; ++d) {
        const double b = p.basis[k * D + d], w = std::nearbyint(b * unit);
        ASSERT_EQ(int(k8.proj8_w[proj8_w_index(k, d, dp4)]), int(w)) << "k " << k << " d " << d;
        norm2 += b * b, err2 += (w / unit - b) * (w / unit - b), sum += int32_t(w);
      }
      EXPECT_EQ(k8.proj8_bias[k], -128 * sum);
      EXPECT_FLOAT_EQ(k8.proj8_qscale[k], float(1.0 / (unit * p.quant[k].step)));
      gate_m = std::max(gate_m, norm2 / ((127.0 * quarter) * (127.0 * quarter)));
      gate_ss = std::max(gate_ss, err2 / (double(D) * quarter * quarter));
    }
    EXPECT_NEAR(k8.proj8_gate_m, gate_m, 1e-6 * gate_m) << "dim " << dim;
    EXPECT_NEAR(k8.proj8_gate_ss, gate_ss, 1e-6 * gate_ss + 1e-24) << "dim " << dim;
    if (setting == 0) {
      EXPECT_LT(gate_ss, 1e-20);
    } else {
      EXPECT_GT(gate_ss, 1e-12);
    }
    // The row gate: a row as long as allowed passes, a little longer does not.
    const float m_max = float(1.0 / std::sqrt(gate_m));
    EXPECT_TRUE(proj8_row_fits(m_max * 0.999f, 0.0f, k8.proj8_gate_m, k8.proj8_gate_ss));
    EXPECT_FALSE(proj8_row_fits(m_max * 1.001f, 0.0f, k8.proj8_gate_m, k8.proj8_gate_ss));
    EXPECT_FALSE(proj8_row_fits(0.0f, std::numeric_limits<float>::infinity(), k8.proj8_gate_m, k8.proj8_gate_ss));
  }
}

// Without kProjection8 the kernels hold no 8-bit tables and quantize_block
// keeps the 16-bit projection; asking for the 8-bit path there is an error
// naming what is missing.
TEST(Proj8, RunsOnlyWhereItsKernelsWereBuilt) {
  const int dim = 32;
  const auto x = correlated(192, dim, 5);
  const HeadParams p = fit(x, 192, dim, setting_options(0, dim, 0));
  ASSERT_FALSE(p.derived().proj8);
  EXPECT_TRUE(p.derived().proj8_w.empty());
  EXPECT_EQ(codes_of(p, x.data(), 64, QuantPath::kAuto), codes_of(p, x.data(), 64, QuantPath::kInteger));
  try {
    codes_of(p, x.data(), 64, QuantPath::kInteger8);
    ADD_FAILURE() << "kInteger8 without proj8";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("proj8"), std::string::npos) << e.what();
  }
  std::vector<uint16_t> c(64 * size_t(p.n_kept()));
  EXPECT_THROW(quantize_block_int8_reference(p, x.data(), 64, c.data()), Error);
  // Decode-only sets ignore the flag (it is the encoder's).
  HeadParams dec = p;
  dec.build_kernels(KernelSet::kDecode | KernelSet::kProjection8);
  EXPECT_FALSE(dec.derived().proj8);
  // Rebuilt with it, then without: the tables come and go.
  HeadParams q = p;
  q.build_kernels(kEncoder8);
  EXPECT_TRUE(q.derived().proj8);
  EXPECT_GT(q.derived().held_bytes(), p.derived().held_bytes());
}

// The 8-bit kernels (KernelSet::kInt8). The projection (HeadKernels::proj8):
// its VNNI, AVX2 and plain kernels give the reference's codes; the rows its
// gate refuses take the 16-bit projection, row by row; the noise it adds
// stays within what the gate allows; it runs only where its kernels were
// built. The reconstruction (HeadKernels::recon8): the same bits on every
// path, within its rounding bound of the exact values, off where it cannot
// hold.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "codec_fixtures.hpp"
#include "core/cpu_features.hpp"
#include "kvcodec/error.hpp"
#include "kvtc/codec.hpp"

using namespace kvcodec;
using namespace kvcodec::kvtc;
using namespace kvcodec::kvtc::fixtures;

namespace {

constexpr KernelSet kEncoder8 = KernelSet::kBoth | KernelSet::kInt8;

// A head fitted as the local cache fits (its target measured with the 8-bit kernels).
HeadParams fit8(const std::vector<float>& x, int64_t n, int dim, CodecOptions o) {
  o.int8_kernels = true;
  HeadParams p = fit(x, n, dim, o);
  EXPECT_EQ(uint8_t(p.kernel_set()), uint8_t(kEncoder8));
  return p;
}

std::vector<uint16_t> codes_of(const HeadParams& p, const float* x, int64_t n, QuantPath path) {
  std::vector<uint16_t> c(size_t(n) * size_t(p.n_kept()));
  quantize_block_path(p, x, n, c.data(), path);
  return c;
}

}  // namespace

// quantize_block with kInt8 kernels == the plain-loop reference, bit
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

// Without kInt8 the kernels hold no 8-bit tables and quantize_block
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
  dec.build_kernels(KernelSet::kDecode | KernelSet::kInt8);
  EXPECT_FALSE(dec.derived().proj8);
  // Rebuilt with it, then without: the tables come and go.
  HeadParams q = p;
  q.build_kernels(kEncoder8);
  EXPECT_TRUE(q.derived().proj8);
  EXPECT_GT(q.derived().held_bytes(), p.derived().held_bytes());
}

// KernelSet::kProj8 (what a loaded calibration holds): the 8-bit
// projection alone, the 16-bit reconstruction kept; and
// quantize_centred_block on rows centred by the caller gives
// quantize_block_path's codes on every path.
TEST(Proj8, ProjectionAloneAndCentredRowsGiveTheSameCodes) {
  const int dim = 64;
  const int64_t n = 4 * dim + 64;
  const auto x = correlated(n, dim, 17);
  HeadParams p = fit(x, n, dim, setting_options(1, dim, dim / 2 + 3));
  p.build_kernels(KernelSet::kHeld | KernelSet::kProj8);
  ASSERT_TRUE(p.derived().proj8);
  EXPECT_FALSE(p.derived().recon8);
  EXPECT_TRUE(p.derived().recon_int);
  std::vector<float> c(x.size());
  for (int64_t t = 0; t < n; ++t)
    for (int d = 0; d < dim; ++d) c[size_t(t * dim + d)] = x[size_t(t * dim + d)] - p.mean[size_t(d)];
  for (const QuantPath path : {QuantPath::kAuto, QuantPath::kFloat, QuantPath::kInteger, QuantPath::kInteger8}) {
    std::vector<uint16_t> centred(size_t(n) * size_t(p.n_kept()));
    quantize_centred_block(p, c.data(), n, centred.data(), path);
    EXPECT_EQ(centred, codes_of(p, x.data(), n, path)) << int(path);
  }
  EXPECT_NE(codes_of(p, x.data(), n, QuantPath::kAuto), codes_of(p, x.data(), n, QuantPath::kInteger));
}

// dequantize_block with kInt8 kernels == the plain-loop reference, bit for
// bit, by the VNNI tiles (where the CPU has them), the AVX2 tiles and the
// plain loops: dims with ragged groups of 8 and 32, K not a multiple of 4;
// blocks of 1 to 64 rows. Each value stays within the weights' rounding
// bound of the exact reconstruction (double):
//   |x[d] - exact[d]| <= sum_k |code[k] - zero2[k] / 2| * recon8_scale[d] (+ float rounding)
// since |W8[k][d] / unit8[d] - step[k] basis[k][d]| <= 1 / (2 unit8[d]) = recon8_scale[d].
TEST(Recon8, ValuesEqualThePlainReferenceAndStayWithinTheirBound) {
  size_t heads = 0, on = 0;
  for (int dim : {8, 13, 24, 37, 64, 72, 128, 130}) {
    const int64_t fit_n = 4 * dim + 64;
    const auto x = correlated(fit_n, dim, uint32_t(700 + dim));
    for (int setting = 0; setting < 4; ++setting) {
      const HeadParams p = fit8(x, fit_n, dim, setting_options(setting, dim, dim / 2 + 3));
      ++heads;
      if (!p.derived().recon8) continue;
      ++on;
      const size_t K = size_t(p.n_kept()), D = size_t(dim);
      for (int64_t n : {int64_t(1), int64_t(3), int64_t(6), int64_t(64)}) {
        std::vector<uint16_t> codes(size_t(n) * K);
        quantize_block(p, x.data(), n, codes.data());
        std::vector<float> ref(size_t(n) * D), got(ref.size());
        dequantize_block_int8_reference(p, codes.data(), n, ref.data());
        const std::string at = "dim " + std::to_string(dim) + " setting " + std::to_string(setting) + " n " +
                               std::to_string(n);
        for (int mode = 0; mode < 3; ++mode) {
          ScopedSimd simd(mode < 2);
          ScopedVnni vnni(mode == 0);
          dequantize_block(p, codes.data(), n, got.data());
          EXPECT_EQ(0, std::memcmp(got.data(), ref.data(), ref.size() * sizeof(float))) << at << " mode " << mode;
          dequantize_block_path(p, codes.data(), n, got.data(), ReconPath::kInteger8);
          EXPECT_EQ(0, std::memcmp(got.data(), ref.data(), ref.size() * sizeof(float))) << at << " mode " << mode;
        }
        for (int64_t t = 0; t < n; ++t)
          for (size_t d = 0; d < D; ++d) {
            double exact = p.mean[d], spread = 0;
            for (size_t k = 0; k < K; ++k) {
              const ComponentQuantizer& q = p.quant[k];
              const double zero = q.half_offset ? double(q.levels - 1) / 2.0 : double(q.zero);
              const double c = double(codes[size_t(t) * K + k]) - zero;
              exact += c * double(p.quant[k].step) * double(p.basis[k * D + d]);
              spread += std::fabs(c);
            }
            const double bound = spread * double(p.derived().recon8_scale[d]) + 1e-5 * (std::fabs(exact) + 1.0);
            ASSERT_LE(std::fabs(double(ref[size_t(t) * D + d]) - exact), bound) << at << " row " << t << " d " << d;
          }
      }
    }
  }
  EXPECT_EQ(heads, 32u);
  EXPECT_GE(on, 28u);  // the lattice heads of every allocator
}

// recon8 is off (the 16-bit reconstruction runs, and kInteger8 names what
// is missing) where it cannot hold: a level count past 256 (codes would not
// fit a byte), centroid reconstruction, kernels built without kInt8 or for
// encoding only; the fit with int8_kernels measures its target with it.
TEST(Recon8, IsOffWhereItCannotHold) {
  const int dim = 32;
  const auto x = correlated(192, dim, 9);
  const HeadParams base = fit8(x, 192, dim, setting_options(0, dim, 0));
  ASSERT_TRUE(base.derived().recon8);
  const auto refused = [&](const HeadParams& p) {
    std::vector<uint16_t> codes(64 * size_t(p.n_kept()), 0);
    std::vector<float> out(64 * size_t(dim));
    try {
      dequantize_block_path(p, codes.data(), 64, out.data(), ReconPath::kInteger8);
    } catch (const Error& e) {
      return e.code() == ErrorCode::kInvalidArgument && std::string(e.what()).find("recon8") != std::string::npos;
    }
    return false;
  };
  EXPECT_FALSE(refused(base));
  HeadParams wide = base;
  wide.quant[1].levels = 300, wide.quant[1].zero = 150;
  wide.build_kernels(kEncoder8);
  EXPECT_TRUE(wide.derived().recon_int);  // the 16-bit reconstruction instead
  EXPECT_FALSE(wide.derived().recon8);
  EXPECT_FALSE(base.derived().recon_int);  // replaced by recon8, its tables released
  EXPECT_TRUE(base.derived().recon_w.empty());
  EXPECT_TRUE(refused(wide));
  HeadParams centroid = base;
  centroid.quant[0].centroid = {0.1f, 0.0f, 0.0f};
  centroid.build_kernels(kEncoder8);
  EXPECT_FALSE(centroid.derived().recon8);
  HeadParams plain = base;
  plain.build_kernels(KernelSet::kBoth);
  EXPECT_FALSE(plain.derived().recon8);
  EXPECT_TRUE(plain.derived().recon8_w.empty());
  EXPECT_TRUE(refused(plain));
  HeadParams enc = base;
  enc.build_kernels(KernelSet::kEncode | KernelSet::kInt8);
  EXPECT_FALSE(enc.derived().recon8);
  EXPECT_TRUE(enc.derived().proj8);
  std::vector<float> out(64 * size_t(dim));
  std::vector<uint16_t> codes(64 * size_t(base.n_kept()), 0);
  EXPECT_THROW(dequantize_block_int8_reference(plain, codes.data(), 64, out.data()), Error);
  // The fit's target holds with the 8-bit kernels it was measured with.
  std::vector<uint16_t> c(size_t(192) * size_t(base.n_kept()));
  quantize_block(base, x.data(), 192, c.data());
  std::vector<float> y(x.size());
  dequantize_block(base, c.data(), 192, y.data());
  EXPECT_LE(rel_mse(x, y), 0.01);
}

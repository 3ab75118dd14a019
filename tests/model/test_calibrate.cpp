// Calibrated KVTC's pieces on a small random Llama (hidden 48, H_kv 2, D 8):
// the RoPE table against the per-call reference, sample collection, the
// measured-distortion allocation, and the calibrated cache's read path
// against a plain decode of the same blocks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <utility>

#include "alloc/allocator.hpp"
#include "core/cpu_features.hpp"
#include "cache/kvtc_calibrated.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"
#include "linalg/pca.hpp"
#include "model/calibrate.hpp"
#include "model/identity.hpp"
#include "model_fixtures.hpp"

namespace kvcodec::model {
namespace {

using testing::tiny_config;
using testing::tiny_model;

std::vector<int32_t> random_tokens(size_t n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> u(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = u(rng);
  return t;
}

// Correlated data x = z * A + mu with decaying scales, [n, dim].
std::vector<float> correlated(int64_t n, int dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> a(static_cast<size_t>(dim * dim)), mu(static_cast<size_t>(dim));
  for (auto& v : a) v = g(rng);
  for (auto& v : mu) v = g(rng);
  std::vector<float> x(static_cast<size_t>(n * dim), 0.0f), z(static_cast<size_t>(dim));
  for (int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < dim; ++k) z[size_t(k)] = g(rng) * std::pow(0.8f, float(k));
    for (int d = 0; d < dim; ++d) {
      float s = mu[size_t(d)];
      for (int k = 0; k < dim; ++k) s += z[size_t(k)] * a[size_t(k * dim + d)];
      x[size_t(i * dim + d)] = s;
    }
  }
  return x;
}

// Encodes and decodes x [n, dim] with p: the mean squared error per token
// and the coded bits per token.
std::pair<double, double> coded_error_and_bits(const kvtc::HeadParams& p, const std::vector<float>& x, int64_t n) {
  std::vector<float> y(x.size());
  const std::vector<uint8_t> bytes = kvtc::encode_block(p, x.data(), n);
  kvtc::decode_block(p, bytes.data(), bytes.size(), n, y.data());
  double err = 0.0;
  for (size_t i = 0; i < x.size(); ++i) err += double(x[i] - y[i]) * double(x[i] - y[i]);
  return {err / double(n), double(bytes.size()) * 8.0 / double(n)};
}

// correlated() times exponential noise per value (Laplacian-like products):
// heavy tails, as the model's coefficients have.
std::vector<float> heavy_tailed(int64_t n, int dim, uint32_t seed, uint32_t noise_seed) {
  std::vector<float> x = correlated(n, dim, seed);
  std::mt19937 rng(noise_seed);
  std::exponential_distribution<float> e(1.0f);
  for (auto& v : x) v *= e(rng);
  return x;
}

TEST(RopeTable, BitIdenticalToPerCallReference) {
  const int H = 3;
  const double theta = 10000.0;
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.0f, 2.0f);
  // The AVX2 pair loop (4 pairs a step, the rest plain) and the plain one;
  // positions past the table's first size (4096) make it grow.
  for (const bool simd : {true, false}) {
    for (const int D : {6, 16, 64, 128}) {
      for (const int64_t first : {int64_t(0), int64_t(700), int64_t(5000)}) {
        const ScopedSimd scoped(simd);
        const int64_t n = 37;
        std::vector<float> x(size_t(n * H * D));
        for (auto& v : x) v = g(rng);
        const auto table = RopeTable::get(D, theta, first + n);
        ASSERT_GE(table->positions(), first + n);
        for (const bool inverse : {false, true}) {
          std::vector<float> ref = x, fast = x;
          rope_rotate_tokens(ref.data(), n, H, D, first, rope_inv_freq(D, theta), inverse);
          table->rotate(fast.data(), n, H * D, H, first, inverse);
          ASSERT_EQ(0, std::memcmp(ref.data(), fast.data(), ref.size() * sizeof(float)))
              << first << " " << inverse << " D " << D << " simd " << simd;
        }
        // Removal after application gives x back to f32 rounding.
        std::vector<float> y = x;
        table->rotate(y.data(), n, H * D, H, first, false);
        table->rotate(y.data(), n, H * D, H, first, true);
        for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(y[i], x[i], 1e-5f * (1.0f + std::fabs(x[i])));
      }
    }
  }
  // A strided layout rotates only each token's first H * D values.
  const int D = 16;
  const auto table = RopeTable::get(D, theta, 10);
  std::vector<float> s(size_t(2 * (H * D + 5)), 7.0f);
  table->rotate(s.data(), 2, H * D + 5, H, 3, false);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(s[size_t(H * D + i)], 7.0f);
  EXPECT_THROW(table->rotate(s.data(), 2, H * D, H, table->positions() - 1, false), Error);
  EXPECT_THROW(RopeTable::get(7, theta, 10), Error);
}

class CalibrateTiny : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = tiny_config(4, 2);
    model_ = std::make_unique<LlamaModel>(tiny_model(config_));
    tokens_ = random_tokens(8 * 128, config_.vocab_size, 11);
    options_.first_window = 0;
    options_.windows = 4;
    options_.window_length = 128;
    options_.sinks = 2;
  }
  ModelConfig config_;
  std::unique_ptr<LlamaModel> model_;
  std::vector<int32_t> tokens_;
  CalibrateOptions options_;
};

TEST_F(CalibrateTiny, SamplesAreTheCacheKeysWithRopeRemoved) {
  const CalibrationSamples s = collect_calibration_samples(*model_, tokens_, options_);
  const int V = config_.kv_dim(), D = config_.head_dim;
  ASSERT_EQ(s.tokens, 4 * (128 - 2));
  ASSERT_EQ(s.keys.size(), size_t(config_.n_layers));
  // Window 1 through an fp16 cache: its keys at position p equal the samples
  // of that window with RoPE re-applied at p.
  Session session(*model_, method_cache_factory("fp16"));
  std::vector<float> logits;
  session.forward(tokens_.data() + 128, 128, logits, false);
  for (int l = 0; l < config_.n_layers; ++l) {
    const KVPair kv = session.caches()[size_t(l)]->fetch(DType::kF32);
    std::vector<float> k(s.keys[size_t(l)].begin() + 126 * V, s.keys[size_t(l)].begin() + 2 * 126 * V);
    rope_rotate_tokens(k.data(), 126, config_.n_kv_heads, D, 2, rope_inv_freq(D, config_.rope_theta), false);
    for (int64_t t = 0; t < 126; ++t)
      for (int h = 0; h < config_.n_kv_heads; ++h)
        for (int d = 0; d < D; ++d) {
          const float want = kv.keys.view().at(0, h, 2 + t, d);
          ASSERT_NEAR(k[size_t(t * V + h * D + d)], want, 1e-4f * (1.0f + std::fabs(want)));
          ASSERT_EQ(s.values[size_t(l)][size_t((126 + t) * V + h * D + d)], kv.values.view().at(0, h, 2 + t, d));
        }
  }
  CalibrateOptions bad = options_;
  bad.windows = 9;  // 9 * 128 > 8 * 128 tokens
  EXPECT_THROW(collect_calibration_samples(*model_, tokens_, bad), Error);
}

TEST(MeasuredTables, DistortionFallsAndRateRisesWithWidth) {
  const int dim = 12;
  const int64_t n = 3000;
  const std::vector<float> x = correlated(n, dim, 5);
  const linalg::PcaBasis pca = linalg::fit_pca(x.data(), n, dim);
  const std::vector<int> choices = {0, 1, 2, 3, 4, 6, 8};
  const MeasuredTables t = measure_component_tables(x.data(), n, dim, pca.mean, pca.components, choices);
  for (int k = 0; k < dim; ++k) {
    // Width 0 leaves the coefficient's whole energy (about its eigenvalue).
    EXPECT_NEAR(t.distortion[size_t(k)][0], pca.eigenvalues[size_t(k)], 0.02 * pca.eigenvalues[size_t(k)] + 1e-4);
    EXPECT_EQ(t.rate[size_t(k)][0], 0.0);
    for (size_t j = 1; j < choices.size(); ++j) {
      EXPECT_LT(t.distortion[size_t(k)][j], t.distortion[size_t(k)][j - 1]) << k << " " << j;
      EXPECT_GT(t.rate[size_t(k)][j], t.rate[size_t(k)][j - 1]) << k << " " << j;
      EXPECT_LE(t.rate[size_t(k)][j], double(choices[j]) + 1e-9);
    }
    // 8 bits of a near-Gaussian: distortion ~ 1e-4 of the variance or less.
    EXPECT_LT(t.distortion[size_t(k)][6], 1e-3 * pca.eigenvalues[size_t(k)]);
  }
  // The codec built from an allocation reproduces the measured distortion.
  const alloc::AllocationResult a = alloc::allocate_bits_measured(t.rate, t.distortion, choices, 2.5 * dim);
  const kvtc::HeadParams p = build_head_params(t, x.data(), n, dim, pca.eigenvalues, a.bits);
  const auto [err, bits] = coded_error_and_bits(p, x, n);
  EXPECT_NEAR(err, a.distortion, 0.05 * a.distortion);
  // Entropy-coded size close to the measured rate (rANS, tables fitted on x).
  EXPECT_LT(bits, a.rate * 1.03 + 0.1);
  EXPECT_THROW(measure_component_tables(x.data(), n, dim, pca.mean, std::vector<float>(5), choices), Error);
  EXPECT_THROW(build_head_params(t, x.data(), n, dim, pca.eigenvalues, std::vector<int>(size_t(dim), 5)), Error);
}

TEST(MeasuredTables, BeatsTheBetaModelAtTheSameMeasuredRate) {
  // Heavy-tailed coefficients (Laplacian-like products) are where the beta
  // model's Gaussian assumption is wrong; the measured DP must then give no
  // more distortion than the dp allocator at no more coded size.
  const int dim = 16;
  const int64_t n = 4096;
  const std::vector<float> x = heavy_tailed(n, dim, 9, 4);
  const linalg::PcaBasis pca = linalg::fit_pca(x.data(), n, dim);
  kvtc::CodecOptions dp;
  dp.bit_budget = 3 * dim;
  const kvtc::HeadParams beta = kvtc::fit_head(x.data(), n, dim, pca.mean, pca.components, pca.eigenvalues, dp);
  auto measure = [&](const kvtc::HeadParams& p, double* bits) {
    const auto [err, coded_bits] = coded_error_and_bits(p, x, n);
    *bits = coded_bits;
    return err;
  };
  double beta_bits = 0.0;
  const double beta_err = measure(beta, &beta_bits);
  const MeasuredTables t = measure_component_tables(x.data(), n, dim, pca.mean, pca.components, dp.bit_choices);
  // The measured allocation at the entropy-coded rate the beta allocation reached.
  const alloc::AllocationResult a = alloc::allocate_bits_measured(t.rate, t.distortion, dp.bit_choices, beta_bits - 0.2);
  double measured_bits = 0.0;
  const double measured_err = measure(build_head_params(t, x.data(), n, dim, pca.eigenvalues, a.bits), &measured_bits);
  EXPECT_LE(measured_bits, beta_bits);
  EXPECT_LT(measured_err, beta_err);
}

TEST(MeasuredTables, MidtreadGridsAreWhatTheCodecCodes) {
  // Heavy-tailed coefficients, as the model's are.
  const int dim = 12;
  const int64_t n = 4096;
  const std::vector<float> x = heavy_tailed(n, dim, 7, 11);
  const linalg::PcaBasis pca = linalg::fit_pca(x.data(), n, dim);
  const MeasuredTables t =
      measure_component_tables(x.data(), n, dim, pca.mean, pca.components, {}, QuantizerFamily::kMidtread);
  ASSERT_EQ(t.bit_choices.size(), size_t(kMidtreadChoices + 1));
  for (int k = 0; k < dim; ++k) {
    const double sigma = std::sqrt(t.distortion[size_t(k)][0]);
    for (int j = 1; j <= kMidtreadChoices; ++j) {
      // Odd level counts (a zero reconstruction point), the step on the ladder.
      EXPECT_EQ(t.levels[size_t(k)][size_t(j)] % 2, 1);
      EXPECT_NEAR(t.step[size_t(k)][size_t(j)], sigma * midtread_step_ratio(j), 1e-3 * sigma);
      // Finer steps: more rate, less distortion (the ladder is monotone).
      EXPECT_GT(t.rate[size_t(k)][size_t(j)], t.rate[size_t(k)][size_t(j - 1)]) << k << " " << j;
      EXPECT_LT(t.distortion[size_t(k)][size_t(j)], t.distortion[size_t(k)][size_t(j - 1)]) << k << " " << j;
    }
    // The coarsest step codes almost everything as 0: well under a bit.
    EXPECT_LT(t.rate[size_t(k)][1], 0.3);
  }
  // The codec built from an allocation reproduces the measured distortion and rate.
  const alloc::AllocationResult a = alloc::allocate_bits_measured(t.rate, t.distortion, t.bit_choices, 1.5 * dim);
  const kvtc::HeadParams p = build_head_params(t, x.data(), n, dim, pca.eigenvalues, a.bits);
  for (const auto& q : p.quant) EXPECT_FALSE(q.half_offset);
  const auto [err, bits] = coded_error_and_bits(p, x, n);
  EXPECT_NEAR(err, a.distortion, 0.05 * a.distortion);
  EXPECT_LT(bits, a.rate * 1.03 + 0.1);
  EXPECT_THROW(midtread_step_ratio(0), Error);
  EXPECT_THROW(midtread_step_ratio(kMidtreadChoices + 1), Error);
}

// Centroid reconstruction (CalibrateOptions::centroid_reconstruction): the
// same grids and codes, so the same rates and bytes; each cell's offset is
// the mean of its coefficients' distance past the lattice point, and the
// distortion falls to what the codec then decodes.
TEST(MeasuredTables, CentroidReconstructionSameBytesLessError) {
  const int dim = 12;
  const int64_t n = 4096;
  const std::vector<float> x = heavy_tailed(n, dim, 7, 11);
  const linalg::PcaBasis pca = linalg::fit_pca(x.data(), n, dim);
  for (const QuantizerFamily family : {QuantizerFamily::kMidtread, QuantizerFamily::kMidrise}) {
    const std::vector<int> widths = {0, 1, 2, 3, 4, 6};
    const MeasuredTables lat = measure_component_tables(x.data(), n, dim, pca.mean, pca.components, widths, family);
    const MeasuredTables cen =
        measure_component_tables(x.data(), n, dim, pca.mean, pca.components, widths, family, Reconstruction::kCentroid);
    const MeasuredTables alc = measure_component_tables(x.data(), n, dim, pca.mean, pca.components, widths, family,
                                                        Reconstruction::kCentroidAllocated);
    ASSERT_TRUE(lat.centroid.empty());
    ASSERT_EQ(cen.centroid.size(), size_t(dim));
    // kCentroid allocates on the lattice's distortion (to the bit: the same
    // allocation as kLattice); kCentroidAllocated on the centroids'.
    EXPECT_EQ(cen.distortion, lat.distortion);
    EXPECT_EQ(alc.distortion, cen.centroid_distortion);
    EXPECT_EQ(alc.centroid, cen.centroid);
    double lat_sum = 0.0, cen_sum = 0.0;
    for (int k = 0; k < dim; ++k)
      for (size_t j = 0; j < lat.bit_choices.size(); ++j) {
        EXPECT_EQ(cen.rate[size_t(k)][j], lat.rate[size_t(k)][j]);
        EXPECT_EQ(cen.step[size_t(k)][j], lat.step[size_t(k)][j]);
        EXPECT_LE(cen.centroid_distortion[size_t(k)][j], lat.distortion[size_t(k)][j] * (1 + 1e-9) + 1e-12)
            << k << " " << j;
        if (lat.bit_choices[j] > 0)
          lat_sum += lat.distortion[size_t(k)][j], cen_sum += cen.centroid_distortion[size_t(k)][j];
        for (float c : cen.centroid[size_t(k)][j]) EXPECT_LE(std::fabs(c), 0.5f);
      }
    // Midrise steps are MSE-optimal for the lattice already: less to gain
    // there (measured 0.97 and 0.87 of the lattice's on these data).
    const bool tread = family == QuantizerFamily::kMidtread;
    EXPECT_LT(cen_sum, (tread ? 0.92 : 0.985) * lat_sum) << quantizer_family_name(family) << " " << cen_sum / lat_sum;
    // One allocation built both ways: identical bytes; the decoded error is
    // the centroid tables' prediction and below the lattice's.
    const alloc::AllocationResult a = alloc::allocate_bits_measured(lat.rate, lat.distortion, lat.bit_choices, 1.5 * dim);
    const kvtc::HeadParams pl = build_head_params(lat, x.data(), n, dim, pca.eigenvalues, a.bits);
    const kvtc::HeadParams pc = build_head_params(cen, x.data(), n, dim, pca.eigenvalues, a.bits);
    bool any = false;
    for (const auto& q : pc.quant) any |= q.has_centroid();
    EXPECT_TRUE(any);
    EXPECT_EQ(kvtc::encode_block(pl, x.data(), n), kvtc::encode_block(pc, x.data(), n));
    double predicted = 0.0;
    for (int k = 0; k < dim; ++k) {
      const auto it = std::find(cen.bit_choices.begin(), cen.bit_choices.end(), a.bits[size_t(k)]);
      predicted += cen.centroid_distortion[size_t(k)][size_t(it - cen.bit_choices.begin())];
    }
    const double err_l = coded_error_and_bits(pl, x, n).first, err_c = coded_error_and_bits(pc, x, n).first;
    EXPECT_LT(err_c, (tread ? 0.92 : 0.98) * err_l) << quantizer_family_name(family) << " " << err_c / err_l;
    EXPECT_NEAR(err_c, predicted, 0.02 * predicted) << quantizer_family_name(family);
    // The offsets are the classes' mean distances past the lattice point
    // (recomputed here from the codes the codec makes).
    std::vector<uint16_t> codes(size_t(n) * size_t(pc.n_kept()));
    kvtc::quantize_block(pc, x.data(), n, codes.data());
    const size_t K = size_t(pc.n_kept());
    for (size_t k = 0; k < K; ++k) {
      const kvtc::ComponentQuantizer& q = pc.quant[k];
      const int axis = pc.kept[k];
      double sum[3] = {}, cnt[3] = {};
      for (int64_t i = 0; i < n; ++i) {
        double coef = 0.0;
        for (int d = 0; d < dim; ++d)
          coef += double(x[size_t(i * dim + d)] - pc.mean[size_t(d)]) * pc.basis[k * size_t(dim) + size_t(d)];
        const double m = reconstruction_steps(kvtc::ComponentQuantizer{q.step, q.levels, q.zero, q.half_offset, {}},
                                              codes[size_t(i) * K + k]);
        const int c = kvtc::centroid_class(m);
        if (c < 0) continue;
        sum[c] += std::fabs(coef) / q.step - std::fabs(m), cnt[c] += 1;
      }
      for (int c = 0; c < 3; ++c)
        if (cnt[c] >= 50) {
          EXPECT_NEAR(q.centroid[size_t(c)], std::clamp(sum[c] / cnt[c], -0.5, 0.5), 0.01)
              << "axis " << axis << " class " << c;
        }
    }
  }
}

TEST(MeasuredTables, MidtreadBeatsMidriseAtLowRate) {
  // At about one bit per component the midrise grid's smallest kept choice
  // (two levels, one bit) is all it has; entropy-coded midtread grids give
  // less distortion for the same measured rate on heavy-tailed data.
  const int dim = 16;
  const int64_t n = 4096;
  const std::vector<float> x = heavy_tailed(n, dim, 3, 5);
  const linalg::PcaBasis pca = linalg::fit_pca(x.data(), n, dim);
  const std::vector<int> widths = {0, 1, 2, 3, 4, 6, 8};
  const MeasuredTables rise = measure_component_tables(x.data(), n, dim, pca.mean, pca.components, widths);
  const MeasuredTables tread =
      measure_component_tables(x.data(), n, dim, pca.mean, pca.components, widths, QuantizerFamily::kMidtread);
  for (const double budget : {0.75 * dim, 1.0 * dim, 1.5 * dim}) {
    const auto r = alloc::allocate_bits_measured(rise.rate, rise.distortion, rise.bit_choices, budget);
    const auto t = alloc::allocate_bits_measured(tread.rate, tread.distortion, tread.bit_choices, budget);
    EXPECT_LE(t.rate, budget);
    EXPECT_LT(t.distortion, 0.95 * r.distortion) << budget;
  }
}

TEST_F(CalibrateTiny, QueryEnergyIsThePairAveragedMeanSquareOfTheQueries) {
  const CalibrationSamples s = collect_calibration_samples(*model_, tokens_, options_);
  const int H = config_.n_kv_heads, D = config_.head_dim, Hq = config_.n_heads, group = Hq / H;
  // The same windows again, the queries summed here from the observer.
  std::vector<std::vector<double>> sum(size_t(config_.n_layers), std::vector<double>(size_t(H * D), 0.0));
  int calls = 0;
  for (int w = 0; w < 4; ++w) {
    Session session(*model_, method_cache_factory("fp16"));
    session.set_query_observer([&](int layer, const float* q, int64_t n) {
      ++calls;
      ASSERT_EQ(n, 128);
      for (int64_t t = 2; t < n; ++t)
        for (int h = 0; h < Hq; ++h)
          for (int d = 0; d < D; ++d) sum[size_t(layer)][size_t(h / group * D + d)] += double(q[(t * Hq + h) * D + d]) * q[(t * Hq + h) * D + d];
    });
    std::vector<float> logits;
    session.forward(tokens_.data() + w * 128, 128, logits, false);
  }
  EXPECT_EQ(calls, 4 * config_.n_layers);
  for (int l = 0; l < config_.n_layers; ++l)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < D / 2; ++i) {
        const double want = 0.5 * (sum[size_t(l)][size_t(h * D + i)] + sum[size_t(l)][size_t(h * D + i + D / 2)]) /
                            double(s.tokens * group);
        EXPECT_NEAR(s.query_energy[size_t(l)][size_t(h * D + i)], want, 1e-9 * want);
        EXPECT_EQ(s.query_energy[size_t(l)][size_t(h * D + i)], s.query_energy[size_t(l)][size_t(h * D + i + D / 2)]);
        EXPECT_GT(want, 0.0);
      }
  // Weights: keys pair-constant, values from the output projection's columns;
  // both mean square 1 and floored.
  for (int l = 0; l < config_.n_layers; ++l) {
    const auto [kw, vw] = attention_weights(*model_, s, l, 0.01);
    ASSERT_EQ(kw.size(), size_t(H * D));
    double k2 = 0, v2 = 0;
    for (int d = 0; d < H * D; ++d) {
      k2 += double(kw[size_t(d)]) * kw[size_t(d)];
      v2 += double(vw[size_t(d)]) * vw[size_t(d)];
      EXPECT_GE(kw[size_t(d)], 0.1f * 0.999f);
    }
    EXPECT_NEAR(k2 / (H * D), 1.0, 0.02);  // the floor may lift a few
    EXPECT_NEAR(v2 / (H * D), 1.0, 0.02);
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < D / 2; ++i) EXPECT_EQ(kw[size_t(h * D + i)], kw[size_t(h * D + i + D / 2)]);
    // Value weight ratios = ratios of the summed column norms of wo [hidden, Hq * D].
    const auto& wo = model_->weights().layers[size_t(l)].wo;
    auto col = [&](int g, int d) {
      double c = 0;
      for (int j = 0; j < group; ++j)
        for (int r = 0; r < config_.hidden_size; ++r) {
          const double v = wo[size_t(r) * size_t(Hq * D) + size_t((g * group + j) * D + d)];
          c += v * v;
        }
      return c;
    };
    EXPECT_NEAR(double(vw[1]) * vw[1] / (double(vw[0]) * vw[0]), col(0, 1) / col(0, 0), 1e-4);
    EXPECT_NEAR(double(vw[size_t(D + 3)]) * vw[size_t(D + 3)] / (double(vw[0]) * vw[0]), col(1, 3) / col(0, 0), 1e-4);
  }
}

TEST_F(CalibrateTiny, CalibratedCacheReadPathMatchesAPlainDecode) {
  const CalibrationSamples s = collect_calibration_samples(*model_, tokens_, options_);
  // Variants: dp allocator; measured; measured with attention weighting and
  // the sensitivity-weighted global allocation.
  for (const int variant : {0, 1, 2}) {
    const bool measured = variant >= 1;
    CalibrateOptions o = options_;
    o.measured_allocation = measured;
    o.attention_weighting = o.sensitivity_allocation = variant == 2;
    o.target_ratio = 3.0;
    std::vector<TensorSensitivity> sens;
    const KvtcCalibration cal = fit_calibration(config_, "", s, o, {}, model_.get(), &sens);
    ASSERT_EQ(cal.weighted(), variant == 2);
    ASSERT_EQ(sens.size(), variant == 2 ? size_t(2 * config_.n_layers) : size_t(0));
    for (const auto& t : sens) {
      EXPECT_GT(t.kl, 0.0);
      EXPECT_GT(t.distortion, 0.0);
    }
    // Every tensor meets the payload ratio on the calibration tokens (with the
    // global allocation: all tensors together).
    double f16_all = 0, coded_all = 0;
    for (int l = 0; l < config_.n_layers; ++l)
      for (const bool is_key : {true, false}) {
        const auto& p = (is_key ? cal.keys : cal.values)[size_t(l)];
        std::vector<float> x = (is_key ? s.keys : s.values)[size_t(l)];
        if (cal.weighted()) {
          const auto& w = (is_key ? cal.key_scale : cal.value_scale)[size_t(l)];
          for (size_t i = 0; i < x.size(); ++i) x[i] *= w[i % w.size()];
        }
        const int64_t n = (s.tokens / 64) * 64;
        size_t bytes = 0;
        for (int64_t i = 0; i < n; i += 64) bytes += kvtc::encode_block(p, x.data() + i * cal.vector_dim(), 64).size();
        f16_all += double(n) * cal.vector_dim() * 2.0;
        coded_all += double(bytes);
        if (variant < 2) {
          EXPECT_GE(double(n) * cal.vector_dim() * 2.0 / double(bytes), 3.0) << variant << " " << l << " " << is_key;
        }
      }
    EXPECT_GE(f16_all / coded_all, 3.0) << variant;
    if (variant == 2) {
      EXPECT_LT(f16_all / coded_all, 3.0 * 1.05);  // the budget is used, not wasted
    }
    const std::string path =
        (std::filesystem::temp_directory_path() / ("kvcodec_test_calibrate_" + std::to_string(variant) + ".kvcal"))
            .string();
    cal.write_file(path);
    const KvtcCalibration cal_read = KvtcCalibration::read_file(path);

    // 2 rows of batch, 150 tokens appended in pieces: sinks 3, window 5,
    // block 16 -> 142 coded tokens: 8 blocks and a partial one of 14 (grown
    // across appends), then the raw window.
    CacheConfig cc;
    cc.layer = 1;
    cc.n_layers = config_.n_layers;
    cc.n_kv_heads = config_.n_kv_heads;
    cc.head_dim = config_.head_dim;
    cc.rope_theta = config_.rope_theta;
    const int64_t B = 2, S = 150, H = cc.n_kv_heads, D = cc.head_dim, V = H * D;
    std::mt19937 rng(21);
    std::normal_distribution<float> g(0.0f, 1.0f);
    // Row-major [B, H, S, D] keys: calibration-like tokens (the fit data with
    // RoPE applied at their positions) so the codec works in its range.
    std::vector<float> keys(size_t(B * H * S * D)), values(keys.size());
    const auto table = RopeTable::get(int(D), cc.rope_theta, S);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < S; ++t) {
        std::vector<float> k(s.keys[1].begin() + (b * 300 + t) * V, s.keys[1].begin() + (b * 300 + t + 1) * V);
        table->rotate(k.data(), 1, V, int(H), t, false);
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) {
            keys[size_t(((b * H + h) * S + t) * D + d)] = f16_to_f32(f32_to_f16(k[size_t(h * D + d)]));
            values[size_t(((b * H + h) * S + t) * D + d)] =
                f16_to_f32(f32_to_f16(s.values[1][size_t((b * 300 + t) * V + h * D + d)]));
          }
      }
    for (const int threads : {1, 2}) {
      auto cache = make_cache("kvtc", cc,
                              {{"calibration", path}, {"sinks", "3"}, {"window", "5"}, {"block", "16"},
                               {"threads", std::to_string(threads)}});
      for (const auto& [begin, count] : {std::pair<int64_t, int64_t>{0, 40}, {40, 1}, {41, 109}}) {
        Tensor kp(DType::kF16, {B, H, count, D}), vp(DType::kF16, {B, H, count, D});
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t t = 0; t < count; ++t)
              for (int64_t d = 0; d < D; ++d) {
                const size_t src = size_t(((b * H + h) * S + begin + t) * D + d);
                const size_t dst = size_t(((b * H + h) * count + t) * D + d);
                kp.data_as<uint16_t>()[dst] = f32_to_f16(keys[src]);
                vp.data_as<uint16_t>()[dst] = f32_to_f16(values[src]);
              }
        cache->append(kp.view(), vp.view());
      }
      const KVPair got = cache->fetch(DType::kF32);
      // Plain reference: per block, RoPE removed with the per-call reference,
      // weights applied, encode_block of the whole block at once,
      // decode_block, weights undone, RoPE re-applied; raw tokens as given.
      const int64_t coded = S - 3 - 5, n_blocks = (coded + 15) / 16;
      ASSERT_EQ(n_blocks, 9);
      double err = 0.0, energy = 0.0;
      for (int64_t b = 0; b < B; ++b) {
        for (const bool is_key : {true, false}) {
          const std::vector<float>& src = is_key ? keys : values;
          const Tensor& out = is_key ? got.keys : got.values;
          for (int64_t j = 0; j < n_blocks; ++j) {
            const int64_t first = 3 + j * 16, bn = std::min<int64_t>(16, coded - j * 16);
            std::vector<float> x(size_t(bn * V)), y(size_t(bn * V));
            for (int64_t t = 0; t < bn; ++t)
              for (int64_t h = 0; h < H; ++h)
                for (int64_t d = 0; d < D; ++d)
                  x[size_t(t * V + h * D + d)] = src[size_t(((b * H + h) * S + first + t) * D + d)];
            const std::vector<float> orig = x;
            const auto inv = rope_inv_freq(int(D), cc.rope_theta);
            if (is_key) rope_rotate_tokens(x.data(), bn, int(H), int(D), first, inv, true);
            const float* w = cal.weighted() ? (is_key ? cal.key_scale : cal.value_scale)[1].data() : nullptr;
            if (w)
              for (int64_t i = 0; i < bn * V; ++i) x[size_t(i)] *= w[i % V];
            // The parameters as the cache holds them (read from the file,
            // with their 8-bit projection: kvtc.int8's default).
            const auto& p = (is_key ? cal_read.keys : cal_read.values)[1];
            const auto bytes = kvtc::encode_block(p, x.data(), bn);
            kvtc::decode_block(p, bytes.data(), bytes.size(), bn, y.data());
            if (w)
              for (int64_t i = 0; i < bn * V; ++i) y[size_t(i)] *= 1.0f / w[i % V];
            if (is_key) rope_rotate_tokens(y.data(), bn, int(H), int(D), first, inv, false);
            for (int64_t t = 0; t < bn; ++t)
              for (int64_t h = 0; h < H; ++h)
                for (int64_t d = 0; d < D; ++d) {
                  const float want = y[size_t(t * V + h * D + d)];
                  ASSERT_EQ(out.view().at(b, h, first + t, d), want) << b << " " << is_key << " " << j;
                  const double e = want - orig[size_t(t * V + h * D + d)];
                  err += e * e;
                  energy += double(orig[size_t(t * V + h * D + d)]) * orig[size_t(t * V + h * D + d)];
                }
          }
          // Sinks and tail come back exactly.
          for (int64_t h = 0; h < H; ++h)
            for (int64_t d = 0; d < D; ++d) {
              for (int64_t t = 0; t < 3; ++t)
                ASSERT_EQ(out.view().at(b, h, t, d), src[size_t(((b * H + h) * S + t) * D + d)]);
              for (int64_t t = 3 + coded; t < S; ++t)
                ASSERT_EQ(out.view().at(b, h, t, d), src[size_t(((b * H + h) * S + t) * D + d)]);
            }
        }
      }
      // Lossy but close at 3x: relative squared error well under 10%.
      EXPECT_LT(err / energy, 0.1) << variant;
      const CacheStats st = cache->stats();
      EXPECT_EQ(st.tokens, S);
      EXPECT_EQ(st.extras.at("key.side_bytes"), 0.0);
    }
    std::filesystem::remove(path);
  }
}

// Where a calibration meets a model (serve, run, eval call
// check_method_for_model): one made for this model passes, one made for
// another config (hash) or another shape is refused, naming what differs.
TEST_F(CalibrateTiny, CalibrationIsCheckedAgainstTheModelItIsUsedWith) {
  const CalibrationSamples s = collect_calibration_samples(*model_, tokens_, options_);
  CalibrateOptions o = options_;
  o.target_ratio = 3.0;
  const KvtcCalibration cal = fit_calibration(config_, "00000000000000aa", s, o);
  const std::string path =
      (std::filesystem::temp_directory_path() / ("kvcodec_test_identity_" + std::to_string(::getpid()) + ".kvcal")).string();
  cal.write_file(path);
  const Settings settings = {{"calibration", path}};
  EXPECT_NO_THROW(check_method_for_model("kvtc", settings, config_, "00000000000000aa"));
  EXPECT_NO_THROW(check_method_for_model("fp16", {}, config_, "00000000000000bb"));  // no calibration: nothing to check
  try {
    check_method_for_model("kvtc", settings, config_, "00000000000000bb");
    ADD_FAILURE() << "accepted a calibration of another config.json";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kConfig);
    EXPECT_NE(std::string(e.what()).find("00000000000000bb"), std::string::npos) << e.what();
  }
  ModelConfig other = config_;
  other.n_layers += 1;
  try {
    check_method_for_model("kvtc", settings, other, "00000000000000aa");
    ADD_FAILURE() << "accepted a calibration of another shape";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kShapeMismatch);
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace kvcodec::model

// Calibrated PALU (cache/palu_calibration.hpp, issue 21): the calibration
// file round trip and its validation, the cache's reconstruction with RoPE
// removed and re-applied, every stored byte counted, save/load, trim, and
// refusals (another shape, conflicting settings, a save from the other mode).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <unistd.h>

#include "cache/calibrated_fixture.hpp"
#include "cache/palu_calibration.hpp"
#include "core/mmap_file.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"
#include "palu/projection.hpp"

using namespace kvcodec;
using namespace calibrated_fixture;

namespace {

PaluCalibration fit_test_calibration(bool joint) {
  std::vector<std::vector<float>> keys, values;
  for (int l = 0; l < kLayers; ++l) {
    keys.push_back(synthetic_vectors(2048, 77 + l, l, true));  // pre-RoPE, as calibrate collects them
    values.push_back(synthetic_vectors(2048, 77 + l, l, false));
  }
  return fit_palu_calibration(kLayers, kHeads, kDim, kTheta, "test", keys, values, 2048, joint, joint ? 1 : 2);
}

std::string temp_path(const std::string& tag) {
  return (std::filesystem::temp_directory_path() / ("kvcodec_test_palu_" + tag + std::to_string(::getpid()) + ".pcal"))
      .string();
}

const std::string& calibration_file(bool joint) {
  static const std::string shared = [] {
    const std::string p = temp_path("shared");
    fit_test_calibration(false).write_file(p);
    remove_at_exit(p);
    return p;
  }();
  static const std::string joined = [] {
    const std::string p = temp_path("joint");
    fit_test_calibration(true).write_file(p);
    remove_at_exit(p);
    return p;
  }();
  return joint ? joined : shared;
}

Settings palu_settings(bool joint, Settings extra = {}) {
  extra["calibration"] = calibration_file(joint);
  return extra;
}

void expect_format_error(const std::vector<uint8_t>& bytes, const std::string& needle) {
  try {
    PaluCalibration::parse(bytes.data(), bytes.size(), "test");
    ADD_FAILURE() << "accepted a file with " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kFormat) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// bytes with meta `key` set to `value` and, if named, one more (empty) section.
std::vector<uint8_t> with_meta(const std::vector<uint8_t>& bytes, const std::string& key, const std::string& value,
                               const std::string& extra_section = "") {
  const ContainerReader r = ContainerReader::parse(bytes.data(), bytes.size());
  ContainerWriter w(ContainerKind::kCalibration);
  for (const auto& [k, v] : r.meta()) w.set_meta(k, k == key ? value : v);
  for (const auto& n : r.section_names()) {
    const auto sec = r.section(n);
    w.add_section(n, std::vector<uint8_t>(sec.begin(), sec.end()));
  }
  if (!extra_section.empty()) w.add_section(extra_section, {});
  return w.finish();
}

// The f16 a raw token stores for an f32 input.
float f16_rounded(float v) { return f16_to_f32(f32_to_f16(v)); }

}  // namespace

TEST(PaluCalibrationFile, RoundTripsExactly) {
  for (const bool joint : {false, true}) {
    const PaluCalibration cal = fit_test_calibration(joint);
    const std::vector<uint8_t> bytes = cal.serialize();
    const PaluCalibration back = PaluCalibration::parse(bytes.data(), bytes.size());
    EXPECT_EQ(back.joint, joint);
    EXPECT_EQ(back.n_head_groups, joint ? 1 : 2);
    EXPECT_EQ(back.shape_string(), cal.shape_string());
    ASSERT_EQ(back.keys.size(), size_t(kLayers));
    for (int l = 0; l < kLayers; ++l)
      for (size_t g = 0; g < back.keys[size_t(l)].size(); ++g) {
        EXPECT_EQ(back.keys[size_t(l)][g].lambda, cal.keys[size_t(l)][g].lambda);
        for (size_t i = 0; i < cal.keys[size_t(l)][g].vectors.size(); ++i)
          EXPECT_EQ(back.keys[size_t(l)][g].vectors[i], double(float(cal.keys[size_t(l)][g].vectors[i])));
      }
    // Stored as f32: a second round trip is byte-identical.
    EXPECT_EQ(back.serialize(), bytes);
    uint64_t sections = 0;
    const ContainerReader r = ContainerReader::parse(bytes.data(), bytes.size());
    for (const auto& n : r.section_names()) sections += r.section(n).size();
    EXPECT_EQ(back.params_bytes(), sections);
  }
}

TEST(PaluCalibrationFile, MalformedFilesAreRefusedNamingWhatIsWrong) {
  const PaluCalibration good = fit_test_calibration(false);
  const std::vector<uint8_t> bytes = good.serialize();
  {
    PaluCalibration bad = good;
    std::swap(bad.values[1][0].lambda[0], bad.values[1][0].lambda[3]);
    expect_format_error(bad.serialize(), "layer.1.value.0: eigenvalue 1");
  }
  {
    PaluCalibration bad = good;
    bad.keys[0][1].vectors[5] += 0.5;
    expect_format_error(bad.serialize(), "not orthonormal");
  }
  expect_format_error(without_section(bytes, "layer.1.key.1", ContainerKind::kCalibration), "layer.1.key.1 is missing");
  {
    // A section cut short, and one with trailing bytes.
    const ContainerReader r = ContainerReader::parse(bytes.data(), bytes.size());
    const auto sec = r.section("layer.0.value.1");
    std::vector<uint8_t> shorter(sec.begin(), sec.end() - 4), longer(sec.begin(), sec.end());
    longer.push_back(0);
    expect_format_error(with_section(bytes, "layer.0.value.1", shorter, ContainerKind::kCalibration), "bytes, expected");
    expect_format_error(with_section(bytes, "layer.0.value.1", longer, ContainerKind::kCalibration), "bytes, expected");
    std::vector<uint8_t> wrong_dim(sec.begin(), sec.end());
    wrong_dim[0] = 32;
    expect_format_error(with_section(bytes, "layer.0.value.1", wrong_dim, ContainerKind::kCalibration), "dim 32, expected 16");
    expect_format_error(with_meta(bytes, "", "", "layer.0.extra"), "9 sections, expected 8");
  }
  expect_format_error(with_meta(bytes, "version", "2"), "version 2");
  expect_format_error(with_meta(bytes, "format", "kvtc-calibration"), "expected 'palu-calibration'");
  expect_format_error(with_meta(bytes, "group_mode", "mixed"), "group_mode 'mixed'");
  expect_format_error(with_meta(bytes, "head_dim", "15"), "odd");
  expect_format_error(with_meta(bytes, "n_head_groups", "1"), "8 sections, expected 4");
  expect_format_error(with_meta(with_meta(bytes, "n_head_groups", "1"), "group_mode", "joint"), "dim 16, expected 32");
  expect_format_error(with_meta(bytes, "rope_theta", "-1"), "rope_theta");
  // Flipped bytes fail the container's checksum; a truncated file its framing.
  for (size_t i = 0; i < bytes.size(); i += 509) {
    std::vector<uint8_t> bad = bytes;
    bad[i] ^= 0x20;
    EXPECT_THROW(PaluCalibration::parse(bad.data(), bad.size()), Error) << i;
  }
  EXPECT_THROW(PaluCalibration::parse(bytes.data(), bytes.size() / 2), Error);
  // A kvtc calibration is not a PALU one.
  expect_format_error(read_file_bytes(calibration_path(), 1 << 30), "expected 'palu-calibration'");
}

TEST(PaluCalibratedCache, ReconstructsWithRopeReappliedAndCountsEveryByte) {
  for (const bool joint : {false, true})
    for (int layer = 0; layer < kLayers; ++layer) {
      const Sequence seq = make_sequence(2, 200, layer, 900);
      // Full rank at 8 bits: only quantization error, small if and only if
      // RoPE was removed before projecting and put back after decoding.
      auto cache = make_cache("palu", layer_config(layer),
                              palu_settings(joint, {{"energy_threshold", "0.99999"}, {"hi_bit", "8"}, {"lo_bit", "8"}}));
      const KVPair out = cache->update_and_fetch(seq.keys.view(), seq.values.view());
      EXPECT_LT(rel_mse(seq.keys, out.keys), 1e-3) << joint << layer;
      EXPECT_LT(rel_mse(seq.values, out.values), 1e-3);
      // The 4 sinks are raw: exact up to the f16 they are stored in.
      for (int64_t h = 0; h < kHeads; ++h)
        for (int64_t i = 0; i < 4 * kDim; ++i)
          EXPECT_EQ(out.keys.data_as<float>()[h * 200 * kDim + i],
                    f16_rounded(seq.keys.data_as<float>()[h * 200 * kDim + i]));
      // Bytes: 1 mode byte + the raw sinks + per head group its quantized
      // token groups (196 latent tokens = 6 groups of 32 + 4 in the f16 tail).
      const CacheStats st = cache->stats();
      const PaluCalibration& cal = *PaluCalibration::load_shared(calibration_file(joint));
      for (const bool is_key : {true, false}) {
        const std::string prefix = is_key ? "key." : "value.";
        uint64_t expected = 1 + 4 * 2 * kHeads * kDim * 2;
        for (size_t g = 0; g < cal.groups().size(); ++g) {
          palu::FitOptions fo;
          fo.energy_threshold = 0.99999;
          fo.hi_bit = fo.lo_bit = 8;
          const palu::Eigenbasis& e = (is_key ? cal.keys : cal.values)[size_t(layer)][g];
          const palu::Projection p = palu::calibrated_projection(e, fo);
          EXPECT_EQ(st.extras.at(prefix + "rank." + std::to_string(g)), p.rank);
          const int64_t rows = joint ? 2 : 2 * cal.groups()[g].second;
          expected += 6 * palu::latent_group_bytes(p, rows, 32) + 4 * uint64_t(rows) * p.rank * 2;
        }
        EXPECT_EQ(is_key ? st.compressed_key_bytes : st.compressed_value_bytes, expected) << prefix;
        EXPECT_EQ(st.extras.at(prefix + "projection_bytes"), 0.0);  // no per-sequence basis
        EXPECT_EQ(st.extras.at(prefix + "calibration_bytes"), double(cal.layer_bytes(layer, is_key)));
      }
      EXPECT_EQ(cache->save().size() - st.compressed_bytes(),
                container_overhead(ContainerReader::parse(cache->save().data(), cache->save().size()).meta(),
                                   {"key", "value"}));
      // The calibration and the RoPE table are shared, not resident.
      ASSERT_EQ(st.shared.size(), 2u);
      EXPECT_EQ(st.shared.begin()->second > 0, true);
    }
}

TEST(PaluCalibratedCache, LowRankOfPreRopeKeysBeatsPostRope) {
  // The calibration is fitted on pre-RoPE keys of rank ~6: at rank 8 the
  // calibrated cache keeps them; a per-sequence SVD of the post-RoPE keys
  // at the same rank cannot (RoPE spreads them over more dimensions).
  const Sequence seq = make_sequence(1, 512, 0, 31);
  auto cal = make_cache("palu", layer_config(0), palu_settings(false, {{"rank", "8"}, {"hi_bit", "8"}, {"lo_bit", "8"}}));
  auto svd = make_cache("palu", layer_config(0), {{"rank", "8"}, {"hi_bit", "8"}, {"lo_bit", "8"}, {"n_head_groups", "2"}});
  const double e_cal = rel_mse(seq.keys, cal->update_and_fetch(seq.keys.view(), seq.values.view()).keys);
  const double e_svd = rel_mse(seq.keys, svd->update_and_fetch(seq.keys.view(), seq.values.view()).keys);
  EXPECT_LT(e_cal, 2e-3);
  EXPECT_LT(e_cal * 5, e_svd);
}

TEST(PaluCalibratedCache, StreamingEqualsOneShotSaveLoadIsExactAndTrimKeepsThePrefix) {
  for (const bool hadamard : {true, false}) {
    const Settings s = palu_settings(false, {{"rank", "6"}, {"hi_bit", "6"}, {"lo_bit", "3"},
                                             {"hadamard", hadamard ? "true" : "false"}});
    const Sequence seq = make_sequence(2, 300, 1, 4242);
    auto whole = make_cache("palu", layer_config(1), s);
    whole->append(seq.keys.view(), seq.values.view());
    auto steps = make_cache("palu", layer_config(1), s);
    steps->append(slice(seq.keys, 0, 3), slice(seq.values, 0, 3));  // inside the sinks
    for (int64_t t = 3; t < 300; ++t) steps->append(slice(seq.keys, t, 1), slice(seq.values, t, 1));
    const SameReads same = expect_steps_and_reload_read_as_whole(*whole, *steps);
    const KVPair& a = same.whole_read;
    const std::vector<uint8_t>& saved = same.saved;
    // A calibrated save read by a per-sequence cache is refused (its settings differ).
    auto plain = make_cache("palu", layer_config(1), {{"n_head_groups", "2"}});
    EXPECT_THROW(plain->load(saved.data(), saved.size()), Error);

    // Trim into the quantized latents, then into the sinks.
    EXPECT_EQ(whole->trim(150), 150);
    const KVPair cut = whole->fetch(DType::kF32);
    for (int64_t r = 0; r < 2 * kHeads; ++r)
      for (int64_t i = 0; i < 150 * kDim; ++i)
        EXPECT_NEAR(cut.keys.data_as<float>()[r * 150 * kDim + i], a.keys.data_as<float>()[r * 300 * kDim + i], 2e-2);
    whole->append(slice(seq.keys, 150, 150), slice(seq.values, 150, 150));
    EXPECT_EQ(whole->offset(), 300);
    // Tokens 128..149 were quantized twice (their group went back to the f16 tail).
    EXPECT_LT(rel_mse(seq.keys, whole->fetch(DType::kF32).keys), 1.2 * rel_mse(seq.keys, a.keys));
    EXPECT_EQ(whole->trim(298), 298);
    const KVPair sinks = whole->fetch(DType::kF32);
    for (int64_t r = 0; r < 2 * kHeads; ++r)
      for (int64_t i = 0; i < 2 * kDim; ++i)
        EXPECT_EQ(sinks.keys.data_as<float>()[r * 2 * kDim + i], f16_rounded(seq.keys.data_as<float>()[r * 300 * kDim + i]));
    EXPECT_EQ(whole->stats().compressed_key_bytes, 1u + 2 * 2 * kHeads * kDim * 2);
  }
}

TEST(PaluCalibratedCache, RefusesAnotherShapeAndConflictingSettings) {
  CacheConfig other = layer_config(0);
  other.head_dim = 32;
  try {
    make_cache("palu", other, palu_settings(false));
    ADD_FAILURE() << "accepted a calibration for another shape";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kShapeMismatch);
    EXPECT_NE(std::string(e.what()).find("head_dim=16"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("head_dim=32"), std::string::npos) << e.what();
  }
  other = layer_config(0);
  other.rope_theta = 500000.0;
  EXPECT_THROW(make_cache("palu", other, palu_settings(false)), Error);
  EXPECT_THROW(make_cache("palu", layer_config(0), palu_settings(false, {{"group_mode", "joint"}})), Error);
  EXPECT_THROW(make_cache("palu", layer_config(0), palu_settings(false, {{"min_fit_tokens", "8"}})), Error);
  EXPECT_THROW(make_cache("palu", layer_config(0), {{"sinks", "4"}}), Error);
  EXPECT_THROW(make_cache("palu", layer_config(0), {{"calibration", temp_path("missing")}}), Error);
  EXPECT_NO_THROW(make_cache("palu", layer_config(0), palu_settings(false, {{"sinks", "0"}})));
}

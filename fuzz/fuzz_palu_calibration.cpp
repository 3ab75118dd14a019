// libFuzzer target: the calibrated-PALU calibration parser
// (PaluCalibration::parse, .pcal files) and what a cache derives from what
// it accepts: each group's projection (with and without the Walsh-Hadamard
// rotation), a vector projected and rebuilt, latents coded and decoded.
// Success or kvcodec::Error only.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_palu_calibration_fixture.hpp"
#include "kvcodec/error.hpp"
#include "palu/projection.hpp"

using namespace kvcodec;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz::write_seed("palu_calibration_shared", fuzz::small_palu_calibration(false).serialize());
  fuzz::write_seed("palu_calibration_joint", fuzz::small_palu_calibration(true).serialize());
  return 0;
}

namespace {

void use_basis(const palu::Eigenbasis& e, bool hadamard) {
  palu::FitOptions fo;
  fo.hadamard = hadamard;
  const palu::Projection p = palu::calibrated_projection(e, fo);
  if (p.rank <= 0) return;
  std::vector<float> x(size_t(p.dim), 0.5f), z(size_t(p.rank)), y(size_t(p.dim));
  p.project(x.data(), z.data());
  p.reconstruct(z.data(), y.data());
  // Two rows of two tokens of latents through the mixed-bit quantizer.
  std::vector<float> latents(size_t(2 * 2 * p.rank), 0.25f);
  std::vector<uint8_t> blob;
  palu::encode_latent_group(p, latents.data(), 2, 2, blob);
  palu::decode_latent_group(p, blob.data(), blob.size(), 2, 2, latents.data());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const PaluCalibration cal = PaluCalibration::parse(data, size, "fuzz");
    (void)cal.params_bytes();
    (void)cal.held_bytes();
    const std::vector<uint8_t> again = cal.serialize();
    // What parse accepted, serialised, parses again.
    (void)PaluCalibration::parse(again.data(), again.size(), "fuzz (re-serialised)");
    if (!cal.keys.empty() && !cal.keys[0].empty()) {
      use_basis(cal.keys[0][0], false);
      use_basis(cal.values[0].back(), true);
    }
  } catch (const Error&) {
  }
  return 0;
}

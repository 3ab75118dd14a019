// libFuzzer target: the calibration file parser (KvtcCalibration::parse) and
// what a cache does with what it accepts. Success or kvcodec::Error only.
#include <cstddef>
#include <cstdint>

#include "fuzz_calibration_fixture.hpp"
#include "kvcodec/error.hpp"

using namespace kvcodec;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz::write_seed("calibration", fuzz::small_calibration().serialize());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const KvtcCalibration cal = KvtcCalibration::parse(data, size, "fuzz");
    (void)cal.params_bytes();
    (void)cal.shape_string();
    const std::vector<uint8_t> again = cal.serialize();
    // What parse accepted, serialised, parses again.
    (void)KvtcCalibration::parse(again.data(), again.size(), "fuzz (re-serialised)");
    // Its parameters code and decode a block (the first layer's keys).
    if (!cal.keys.empty()) {
      const kvtc::HeadParams& p = cal.keys[0];
      std::vector<float> x(size_t(4 * p.dim), 0.25f), y(x.size());
      const std::vector<uint8_t> block = kvtc::encode_block(p, x.data(), 4);
      kvtc::decode_block(p, block.data(), block.size(), 4, y.data());
    }
  } catch (const Error&) {
  }
  return 0;
}

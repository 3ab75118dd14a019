// libFuzzer target: the safetensors header parser and every accessor on
// whatever it accepts. Success or kvcodec::Error, nothing else.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvcodec/error.hpp"
#include "kvcodec/safetensors.hpp"

using namespace kvcodec;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const SafetensorsFile f = SafetensorsFile::from_bytes(std::vector<uint8_t>(data, data + size), "fuzz");
    float sink = 0.0f;
    for (const std::string& name : f.names()) {
      const auto& info = f.info(name);
      if (info.size > size) __builtin_trap();  // a validated tensor lies inside the input
      f.raw(name);
      try {
        const TensorView v = f.view4(name);
        // Touch the first and last elements through the view.
        if (numel(v.shape) > 0) {
          sink += v.at(0, 0, 0, 0);
          sink += v.at(v.shape[0] - 1, v.shape[1] - 1, v.shape[2] - 1, v.shape[3] - 1);
        }
      } catch (const Error&) {
      }
      try {
        const std::vector<float> x = f.read_f32(name);
        if (!x.empty()) sink += x.back();
      } catch (const Error&) {
      }
    }
    for (const auto& kv : f.metadata()) sink += float(kv.second.size());
    volatile float keep = sink;
    (void)keep;
  } catch (const Error&) {
  }
  return 0;
}

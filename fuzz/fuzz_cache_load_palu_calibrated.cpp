// libFuzzer target: the calibrated PALU cache's load() (small calibrations
// made here, shared and joint head groups), then every read, a save, an
// append and a trim of what it accepts. Success or kvcodec::Error only.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_palu_calibration_fixture.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"

using namespace kvcodec;

namespace {

CacheConfig config() { return fuzz::one_layer_config(fuzz::kPaluHeads, fuzz::kPaluDim); }

// Quantization groups of 4 tokens, so that a few tokens make several; the
// joint calibration with the Walsh-Hadamard rotation, the shared without.
Settings settings(bool joint) {
  return {{"calibration", fuzz::small_palu_calibration_path(joint)},
          {"sinks", "2"},
          {"group_size", "4"},
          {"hadamard", joint ? "true" : "false"}};
}

// [B, 2, S, 8] tokens of the calibration's structure.
Tensor tokens(int64_t B, int64_t S, uint32_t seed) {
  return fuzz::low_rank_tokens(B, fuzz::kPaluHeads, S, fuzz::kPaluDim, seed);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Saved caches of a few token groups, both group modes: batch 1 and 2, a
  // partial newest group.
  for (const bool joint : {false, true})
    for (const auto& [B, S] : {std::pair<int64_t, int64_t>{1, 19}, {2, 13}, {1, 3}}) {
      auto c = make_cache("palu", config(), settings(joint));
      const Tensor k = tokens(B, S, 1), v = tokens(B, S, 2);
      c->append(k.view(), v.view());
      // Led by the mode byte LLVMFuzzerTestOneInput reads.
      std::vector<uint8_t> seed{uint8_t(joint ? 1 : 0)};
      const std::vector<uint8_t> saved = c->save();
      seed.insert(seed.end(), saved.begin(), saved.end());
      fuzz::write_seed(std::string(joint ? "joint" : "shared") + "_B" + std::to_string(B) + "_S" + std::to_string(S),
                       seed);
    }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The first byte picks the group mode, so both calibrations are reached.
  if (size == 0) return 0;
  const bool joint = data[0] & 1;
  try {
    auto c = make_cache("palu", config(), settings(joint));
    c->load(data + 1, size - 1);
    (void)c->stats();
    (void)c->fetch(DType::kF32);
    (void)c->save();
    if (c->offset() > 0) {
      const Tensor k = tokens(c->fetch(DType::kF32).keys.shape()[0], 3, 3);
      c->append(k.view(), k.view());
      c->trim(5);
      (void)c->fetch(DType::kF16);
    }
  } catch (const Error&) {
  }
  return 0;
}

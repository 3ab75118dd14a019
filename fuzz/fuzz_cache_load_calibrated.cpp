// libFuzzer target: the calibrated kvtc cache's load() (a small calibration
// made here, with weights and refinement), then every read, a save, an
// append and a trim of what it accepts. Success or kvcodec::Error only.
#include <cstddef>
#include <cstdint>

#include "fuzz_calibration_fixture.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"

using namespace kvcodec;

namespace {

CacheConfig config() { return fuzz::one_layer_config(fuzz::kCalHeads, fuzz::kCalDim); }

Settings settings() {
  return {{"calibration", fuzz::small_calibration_path()}, {"sinks", "2"}, {"window", "4"}, {"block", "8"},
          {"refine", "8"}};
}

// [B, 2, S, 8] tokens of the calibration's structure.
Tensor tokens(int64_t B, int64_t S, uint32_t seed) {
  return fuzz::low_rank_tokens(B, fuzz::kCalHeads, S, fuzz::kCalDim, seed);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Saved caches of a few blocks: batch 1 and 2, a partial newest block.
  for (const auto& [B, S] : {std::pair<int64_t, int64_t>{1, 29}, {2, 21}, {1, 4}}) {
    auto c = make_cache("kvtc", config(), settings());
    const Tensor k = tokens(B, S, 1), v = tokens(B, S, 2);
    c->append(k.view(), v.view());
    fuzz::write_seed("calibrated_B" + std::to_string(B) + "_S" + std::to_string(S), c->save());
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto c = make_cache("kvtc", config(), settings());
    c->load(data, size);
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

// libFuzzer target: load_cache() on arbitrary bytes must either load or throw
// kvcodec::Error, never crash, hang or allocate without bound. A loaded cache
// is also read back (fetch, stats, save) so the decoders see fuzzed payloads.
#include <cstddef>
#include <cstdint>

#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto cache = kvcodec::load_cache(data, size);
    (void)cache->stats();
    if (cache->offset() <= 4096) (void)cache->fetch(kvcodec::DType::kF32);
    (void)cache->save();
  } catch (const kvcodec::Error&) {
  }
  return 0;
}

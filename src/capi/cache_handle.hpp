// The C API's cache handle, shared by the cache calls (cache.cpp) and the
// PALU latent codec made from a palu cache (palu_codec.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvcodec/cache.hpp"
#include "kvcodec/kvcodec.h"

struct kvcodec_cache {
  std::unique_ptr<kvcodec::KVCache> cache;
  std::string method;
  // B of the history: known from the first append; after a load it is read
  // from the first block the first time it is needed (-1 until then).
  mutable int64_t batch = -1;
  // save_size() serialises here so save() need not do it again; dropped by
  // save() and by any change of the cache.
  std::vector<uint8_t> saved;
  bool saved_current = false;

  void changed() {
    saved_current = false;
    saved.clear();
    saved.shrink_to_fit();
  }
};

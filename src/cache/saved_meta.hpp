// Helpers shared by the caches' save()/load(): reading integer metadata of a
// saved container, and the LEB128 framing of block payloads.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec::cache_impl {

// meta[key] as an integer in [lo, hi]; Error(kFormat) naming the source, key and value otherwise.
inline int64_t meta_int(const ContainerReader& c, const std::string& key, int64_t lo, int64_t hi) {
  const std::string& v = c.meta_or_throw(key);
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || errno != 0 || end != v.c_str() + v.size() || x < lo || x > hi)
    throw Error(ErrorCode::kFormat, c.label() + ": meta " + key + " = '" + v + "' is not an integer in [" +
                                        std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

inline void append_varint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(uint8_t(v | 0x80));
    v >>= 7;
  }
  out.push_back(uint8_t(v));
}

inline size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

}  // namespace kvcodec::cache_impl

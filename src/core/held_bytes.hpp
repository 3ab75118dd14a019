// Heap bytes a container holds, for CacheStats::resident_bytes: what the
// allocator gave it (capacity), not what it uses (size).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvcodec {

template <typename T>
uint64_t held_bytes(const std::vector<T>& v) {
  return uint64_t(v.capacity()) * sizeof(T);
}

// A vector of vectors: the outer array plus every inner one.
template <typename T>
uint64_t held_bytes(const std::vector<std::vector<T>>& v) {
  uint64_t n = uint64_t(v.capacity()) * sizeof(std::vector<T>);
  for (const auto& inner : v) n += held_bytes(inner);
  return n;
}

// Gives back the memory of a vector that a large erase left mostly unused
// (a prefill's raw tokens after they were coded): shrinks it when its
// capacity exceeds twice max(size, floor). floor is the size it regularly
// grows back to (e.g. a block plus the window), so steady appends do not
// reallocate every time.
template <typename T>
void shrink_if_oversized(std::vector<T>& v, size_t floor) {
  if (v.capacity() > 2 * std::max(v.size(), floor)) v.shrink_to_fit();
}

}  // namespace kvcodec

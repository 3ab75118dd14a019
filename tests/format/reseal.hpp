// Test helper: corrupt a container and seal it again, so the corruption gets
// past the XXH3 checksums and reaches the loader behind them (a file whose
// checksums are right but whose content is wrong: a bug in a writer, or a
// hostile file). Used by every corruption test of a saved cache.
#pragma once

#include <xxhash.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec::testing_reseal {

inline void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}

// Recomputes every section checksum and the trailer hash in place. False
// (bytes untouched) when the structure itself no longer parses: then the
// checksums are not what stops the file anyway.
inline bool reseal(std::vector<uint8_t>& bytes) {
  ContainerLimits unchecked;
  unchecked.verify_checksums = false;
  try {
    const ContainerReader r = ContainerReader::parse(bytes.data(), bytes.size(), unchecked);
    for (const std::string& name : r.section_names()) {
      const auto s = r.section(name);
      const size_t at = size_t(s.data() - bytes.data());
      put_u64(bytes.data() + at - 8, XXH3_64bits(bytes.data() + at, s.size()));
    }
  } catch (const Error&) {
    return false;
  }
  const size_t end = bytes.size() - kContainerTrailerBytes;
  put_u64(bytes.data() + end + 8, XXH3_64bits(bytes.data(), end));
  return true;
}

using Meta = std::map<std::string, std::string>;
using Sections = std::vector<std::pair<std::string, std::vector<uint8_t>>>;

// The container rebuilt (and so sealed) after edit() changed its meta and
// sections: for edits that change a section's size.
inline std::vector<uint8_t> edit_container(const std::vector<uint8_t>& bytes,
                                           const std::function<void(Meta&, Sections&)>& edit) {
  const ContainerReader r = ContainerReader::parse(bytes.data(), bytes.size());
  Meta meta = r.meta();
  Sections sections;
  for (const std::string& name : r.section_names()) {
    const auto s = r.section(name);
    sections.emplace_back(name, std::vector<uint8_t>(s.begin(), s.end()));
  }
  edit(meta, sections);
  ContainerWriter w(r.kind());
  for (const auto& [k, v] : meta) w.set_meta(k, v);
  for (auto& [name, payload] : sections) w.add_section(name, std::move(payload));
  return w.finish();
}

// Section `name`'s payload edited in place by edit(), then sealed.
inline std::vector<uint8_t> edit_section(const std::vector<uint8_t>& bytes, const std::string& name,
                                         const std::function<void(std::vector<uint8_t>&)>& edit) {
  return edit_container(bytes, [&](Meta&, Sections& sections) {
    for (auto& [n, payload] : sections)
      if (n == name) edit(payload);
  });
}

// One random sealed mutant: a few bytes of one section (or of a meta value)
// flipped, set to an extreme or overwritten by an extreme little-endian
// integer, or the section cut or extended. Deterministic given rng.
inline std::vector<uint8_t> sealed_mutant(const std::vector<uint8_t>& bytes, std::mt19937_64& rng) {
  return edit_container(bytes, [&](Meta& meta, Sections& sections) {
    const size_t pick = size_t(rng() % (sections.size() + 1));
    std::vector<uint8_t> text;
    std::string* meta_value = nullptr;
    std::vector<uint8_t>* target = nullptr;
    if (pick == sections.size()) {  // a meta value, as bytes
      auto it = meta.begin();
      std::advance(it, long(rng() % meta.size()));
      meta_value = &it->second;
      text.assign(meta_value->begin(), meta_value->end());
      target = &text;
    } else {
      target = &sections[pick].second;
    }
    std::vector<uint8_t>& p = *target;
    const int kind = int(rng() % 6);
    if (p.empty() || kind == 5) {
      // Cut or extend by 1..16 bytes.
      const size_t n = 1 + size_t(rng() % 16);
      if (!p.empty() && rng() % 2) p.resize(p.size() - std::min(n, p.size()));
      else for (size_t i = 0; i < n; ++i) p.push_back(uint8_t(rng()));
    } else if (kind == 4 && p.size() >= 8) {
      static const uint64_t extremes[] = {0, 1, 0xff, 0x7fffffffull, 0xffffffffull, 1ull << 32, 1ull << 40,
                                          0x7fffffffffffffffull, ~0ull};
      const uint64_t v = extremes[rng() % (sizeof extremes / sizeof extremes[0])];
      put_u64(p.data() + rng() % (p.size() - 7), v);
    } else {
      const int n = 1 + int(rng() % 4);
      for (int i = 0; i < n; ++i) {
        uint8_t& b = p[rng() % p.size()];
        if (kind == 0) b ^= uint8_t(1u << (rng() % 8));
        else if (kind == 1) b = uint8_t(rng());
        else if (kind == 2) b = 0;
        else b = 0xff;
      }
    }
    if (meta_value) meta_value->assign(text.begin(), text.end());
  });
}

}  // namespace kvcodec::testing_reseal

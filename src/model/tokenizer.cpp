#include "model/tokenizer.hpp"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvcodec/error.hpp"

namespace kvcodec::model {
namespace {

using nlohmann::json;

[[noreturn]] void fail(ErrorCode code, const std::string& origin, const std::string& what) {
  throw Error(code, origin + ": " + what);
}

// GPT-2's byte <-> printable code point table: printable Latin-1 bytes stand
// for themselves, the other 68 bytes map to U+0100.. in byte order.
std::vector<uint32_t> byte_to_codepoint() {
  std::vector<uint32_t> table(256);
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    table[b] = printable ? b : next++;
  }
  return table;
}

// Decodes one UTF-8 code point at s[i]; returns its length, or 0 when the
// bytes are not valid UTF-8 (then cp is the single byte).
size_t utf8_decode(std::string_view s, size_t i, uint32_t& cp) {
  const auto c = uint8_t(s[i]);
  if (c < 0x80) {
    cp = c;
    return 1;
  }
  size_t len = 0;
  uint32_t min = 0;
  if ((c & 0xE0) == 0xC0) len = 2, cp = c & 0x1F, min = 0x80;
  else if ((c & 0xF0) == 0xE0) len = 3, cp = c & 0x0F, min = 0x800;
  else if ((c & 0xF8) == 0xF0) len = 4, cp = c & 0x07, min = 0x10000;
  else {
    cp = c;
    return 0;
  }
  if (i + len > s.size()) {
    cp = c;
    return 0;
  }
  for (size_t k = 1; k < len; ++k) {
    const auto cc = uint8_t(s[i + k]);
    if ((cc & 0xC0) != 0x80) {
      cp = c;
      return 0;
    }
    cp = (cp << 6) | (cc & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
    cp = c;
    return 0;
  }
  return len;
}

enum class CharClass { kLetter, kNumber, kSpace, kOther };

bool is_unicode_space(uint32_t cp) {
  if (cp == 0x85 || cp == 0xA0 || cp == 0x1680 || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
      cp == 0x205F || cp == 0x3000)
    return true;
  return cp >= 0x2000 && cp <= 0x200A;
}

// Class and byte length of the character at s[i].
CharClass classify(std::string_view s, size_t i, size_t& len) {
  uint32_t cp = 0;
  const size_t n = utf8_decode(s, i, cp);
  len = n == 0 ? 1 : n;
  if (n == 0) return CharClass::kLetter;  // stray byte: documented as a letter
  if (cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return CharClass::kLetter;
    if (cp >= '0' && cp <= '9') return CharClass::kNumber;
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return CharClass::kSpace;
    return CharClass::kOther;
  }
  return is_unicode_space(cp) ? CharClass::kSpace : CharClass::kLetter;
}

}  // namespace

std::vector<std::string_view> Tokenizer::split_long_word(std::string_view word) {
  std::vector<std::string_view> pieces;
  while (word.size() > kMaxWordBytes) {
    // Never cut inside a UTF-8 character: back off to its lead byte (at most
    // 3 steps; a run of stray continuation bytes is cut where it stands).
    size_t cut = kMaxWordBytes;
    for (int back = 0; back < 3 && (uint8_t(word[cut]) & 0xC0) == 0x80; ++back) --cut;
    if ((uint8_t(word[cut]) & 0xC0) == 0x80) cut = kMaxWordBytes;
    pieces.push_back(word.substr(0, cut));
    word.remove_prefix(cut);
  }
  if (!word.empty()) pieces.push_back(word);
  return pieces;
}

std::vector<std::string_view> Tokenizer::pre_tokenize(std::string_view s) {
  std::vector<std::string_view> out;
  size_t i = 0;
  const size_t n = s.size();
  // End of the run of characters of class c starting at j.
  auto run_end = [&](size_t j, CharClass c) {
    while (j < n) {
      size_t len = 0;
      if (classify(s, j, len) != c) break;
      j += len;
    }
    return j;
  };
  // [^\s\p{L}\p{N}]+ : everything of class kOther.
  while (i < n) {
    // 1. contractions 's 't 're 've 'm 'll 'd (case-sensitive, as in GPT-2)
    if (s[i] == '\'' && i + 1 < n) {
      size_t len = 0;
      const char a = s[i + 1];
      const char b = i + 2 < n ? s[i + 2] : '\0';
      if (a == 's' || a == 't' || a == 'm' || a == 'd') len = 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) len = 3;
      if (len) {
        out.push_back(s.substr(i, len));
        i += len;
        continue;
      }
    }
    // 2-4. optional single space, then a run of letters / numbers / other.
    size_t start = i, j = i;
    if (s[j] == ' ' && j + 1 < n) ++j;
    size_t len = 0;
    const CharClass c = classify(s, j, len);
    if (j < n && c != CharClass::kSpace) {
      const size_t end = run_end(j, c);
      out.push_back(s.substr(start, end - start));
      i = end;
      continue;
    }
    // 5-6. whitespace: \s+(?!\S) keeps the last space for the next word when
    // the run is followed by a non-space; a single space before a non-space
    // falls to \s+ and stands alone.
    const size_t end = run_end(i, CharClass::kSpace);
    if (end == i) {  // unreachable: every class is handled above; be safe
      out.push_back(s.substr(i, 1));
      ++i;
      continue;
    }
    size_t stop = end;
    if (end < n) {
      // Back off one character (not one byte) so the lookahead holds.
      size_t last = i, k = i;
      while (k < end) {
        last = k;
        size_t l = 0;
        classify(s, k, l);
        k += l;
      }
      if (last > i) stop = last;
    }
    out.push_back(s.substr(i, stop - i));
    i = stop;
  }
  return out;
}

Tokenizer Tokenizer::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::kIo, "cannot open tokenizer " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path);
}

Tokenizer Tokenizer::parse(const std::string& text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail(ErrorCode::kFormat, origin, std::string("not valid JSON: ") + e.what());
  }
  Tokenizer t;
  try {
    if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
      fail(ErrorCode::kFormat, origin, "missing object \"model\"");
    const json& m = j["model"];
    if (m.value("type", std::string("BPE")) != "BPE")
      fail(ErrorCode::kUnsupported, origin, "model.type = " + m["type"].dump() + " is not supported (only BPE)");
    if (m.value("byte_fallback", false))
      fail(ErrorCode::kUnsupported, origin, "model.byte_fallback = true is not supported");
    if (j.contains("normalizer") && !j["normalizer"].is_null())
      fail(ErrorCode::kUnsupported, origin, "normalizer " + j["normalizer"].dump() + " is not supported");
    const json& pre = j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json();
    if (!pre.is_object() || pre.value("type", std::string()) != "ByteLevel" || !pre.value("use_regex", true) ||
        pre.value("add_prefix_space", false))
      fail(ErrorCode::kUnsupported, origin,
           "pre_tokenizer " + pre.dump() + " is not supported (only ByteLevel with use_regex, no prefix space)");

    // Inverse of the byte table: code point -> byte.
    const std::vector<uint32_t> b2c = byte_to_codepoint();
    std::unordered_map<uint32_t, uint8_t> c2b;
    for (int b = 0; b < 256; ++b) c2b[b2c[b]] = uint8_t(b);
    auto to_bytes = [&](const std::string& tok, std::string& bytes) {
      bytes.clear();
      for (size_t i = 0; i < tok.size();) {
        uint32_t cp = 0;
        const size_t len = utf8_decode(tok, i, cp);
        auto it = c2b.find(cp);
        if (len == 0 || it == c2b.end()) return false;
        bytes.push_back(char(it->second));
        i += len;
      }
      return true;
    };

    if (!m.contains("vocab") || !m["vocab"].is_object()) fail(ErrorCode::kFormat, origin, "missing model.vocab");
    const json& vocab = m["vocab"];
    // Added tokens first: their text is literal, not byte-level.
    std::unordered_map<std::string, int32_t> added_by_content;
    if (j.contains("added_tokens") && j["added_tokens"].is_array())
      for (const json& a : j["added_tokens"]) {
        // Integers only: converting a float id such as 1e58 is undefined (found by fuzz_tokenizer).
        if (!a.at("id").is_number_integer() || a.at("id").get<int64_t>() >= (1 << 24))
          fail(ErrorCode::kFormat, origin, "added token id " + a.at("id").dump() + " is not an integer in [0, 2^24)");
        added_by_content[a.at("content").get<std::string>()] = a.at("id").get<int32_t>();
      }

    int64_t max_id = -1;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_integer())
        fail(ErrorCode::kFormat, origin, "id of token " + json(it.key()).dump() + " is not an integer");
      max_id = std::max<int64_t>(max_id, it.value().get<int64_t>());
    }
    for (const auto& [content, id] : added_by_content) {
      // A negative id would index id_to_bytes_ out of bounds below (found by fuzz_tokenizer).
      if (id < 0) fail(ErrorCode::kFormat, origin, "negative id for added token " + json(content).dump());
      max_id = std::max<int64_t>(max_id, id);
    }
    if (max_id < 0 || max_id >= (1 << 24)) fail(ErrorCode::kFormat, origin, "vocabulary ids out of range [0, 2^24)");
    // The id tables below are sized by the largest id: a file of a few
    // tokens with an id near 2^24 would make them take hundreds of MB. Real
    // vocabularies number their tokens densely, so the largest id must be
    // below the number of tokens the file defines.
    const int64_t n_defined = int64_t(vocab.size() + added_by_content.size());
    if (max_id >= n_defined)
      fail(ErrorCode::kFormat, origin,
           "token id " + std::to_string(max_id) + " is beyond the " + std::to_string(n_defined) +
               " tokens the file defines (ids must be numbered densely from 0)");
    t.id_to_bytes_.assign(size_t(max_id + 1), std::string());
    t.special_.assign(size_t(max_id + 1), false);
    std::vector<bool> seen(size_t(max_id + 1), false);
    std::string bytes;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      const int64_t id = it.value().get<int64_t>();
      if (id < 0) fail(ErrorCode::kFormat, origin, "negative id for token " + json(it.key()).dump());
      if (added_by_content.count(it.key())) continue;
      if (!to_bytes(it.key(), bytes))
        fail(ErrorCode::kFormat, origin, "token " + json(it.key()).dump() + " is not in the byte-level alphabet");
      // Two tokens of one id: decoding could not give back what was encoded.
      if (seen[size_t(id)])
        fail(ErrorCode::kFormat, origin, "token id " + std::to_string(id) + " is given to two tokens, one of them " + json(it.key()).dump());
      t.id_to_bytes_[size_t(id)] = bytes;
      t.bytes_to_id_[bytes] = int32_t(id);
      seen[size_t(id)] = true;
    }
    for (const auto& [content, id] : added_by_content) {
      // (found by fuzz_tokenizer: an added token numbered as a vocabulary token)
      if (seen[size_t(id)])
        fail(ErrorCode::kFormat, origin,
             "added token " + json(content).dump() + " has id " + std::to_string(id) + ", which another token has");
      t.id_to_bytes_[size_t(id)] = content;
      t.special_[size_t(id)] = true;
      seen[size_t(id)] = true;
      t.added_.push_back({content, id});
    }
    std::sort(t.added_.begin(), t.added_.end(),
              [](const Added& a, const Added& b) { return a.content.size() > b.content.size(); });
    for (const std::string& b : t.id_to_bytes_) t.max_token_bytes_ = std::max(t.max_token_bytes_, b.size());
    for (size_t id = 0; id < seen.size(); ++id)
      if (!seen[id]) fail(ErrorCode::kFormat, origin, "vocabulary has no token with id " + std::to_string(id));
    for (int b = 0; b < 256; ++b) {
      auto it = t.bytes_to_id_.find(std::string(1, char(b)));
      if (it == t.bytes_to_id_.end())
        fail(ErrorCode::kUnsupported, origin, "byte " + std::to_string(b) + " has no token (not a byte-level vocabulary)");
      t.byte_id_[b] = it->second;
    }

    if (!m.contains("merges") || !m["merges"].is_array()) fail(ErrorCode::kFormat, origin, "missing model.merges");
    int32_t rank = 0;
    std::string left, right;
    for (const json& mg : m["merges"]) {
      std::string a, b;
      if (mg.is_array() && mg.size() == 2) {  // tokenizers >= 0.20: ["a", "b"]
        a = mg[0].get<std::string>();
        b = mg[1].get<std::string>();
      } else if (mg.is_string()) {  // older: "a b"
        const std::string s = mg.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos) fail(ErrorCode::kFormat, origin, "merge " + mg.dump() + " has no space");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        fail(ErrorCode::kFormat, origin, "merge " + mg.dump() + " is neither [a, b] nor \"a b\"");
      }
      if (!to_bytes(a, left) || !to_bytes(b, right))
        fail(ErrorCode::kFormat, origin, "merge " + mg.dump() + " is not in the byte-level alphabet");
      auto il = t.bytes_to_id_.find(left), ir = t.bytes_to_id_.find(right), im = t.bytes_to_id_.find(left + right);
      if (il == t.bytes_to_id_.end() || ir == t.bytes_to_id_.end() || im == t.bytes_to_id_.end())
        fail(ErrorCode::kFormat, origin, "merge " + mg.dump() + " names a token missing from the vocabulary");
      const uint64_t key = (uint64_t(uint32_t(il->second)) << 32) | uint32_t(ir->second);
      t.merges_.emplace(key, std::make_pair(rank++, im->second));  // first (lowest) rank wins
    }
  } catch (const json::exception& e) {
    fail(ErrorCode::kFormat, origin, std::string("unexpected JSON layout: ") + e.what());
  }
  return t;
}

std::optional<Tokenizer::Merge> Tokenizer::merge(int32_t left, int32_t right) const {
  auto it = merges_.find((uint64_t(uint32_t(left)) << 32) | uint32_t(right));
  if (it == merges_.end()) return std::nullopt;
  return Merge{it->second.first, it->second.second};
}

void Tokenizer::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  // Merges the pair of lowest rank, leftmost among equals, until none is
  // left: the order HF tokenizers applies. The parts form a linked list over
  // the word's bytes (a part keeps the index of its first byte, so list
  // order is byte order); a min-heap holds candidate pairs keyed (rank,
  // first byte of the left part), which is exactly "lowest rank, then
  // leftmost". A popped pair is stale when either part has since merged
  // (parts only grow, so their ids then differ) or they are no longer
  // neighbours; it is skipped. Each merge pushes at most two new pairs:
  // O(n log n) per word instead of the O(n^2) rescan.
  const size_t n = word.size();
  if (n == 0) return;
  std::vector<int32_t> id(n);
  std::vector<int32_t> prev(n), next(n);  // -1: none
  for (size_t i = 0; i < n; ++i) {
    id[i] = byte_id_[uint8_t(word[i])];
    prev[i] = int32_t(i) - 1;
    next[i] = i + 1 < n ? int32_t(i + 1) : -1;
  }
  struct Pair {
    int32_t rank, left, right, left_id, right_id, merged;
  };
  auto later = [](const Pair& a, const Pair& b) { return a.rank != b.rank ? a.rank > b.rank : a.left > b.left; };
  std::vector<Pair> heap;
  auto push = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const std::optional<Merge> m = merge(id[size_t(l)], id[size_t(r)]);
    if (!m) return;
    heap.push_back({m->rank, l, r, id[size_t(l)], id[size_t(r)], m->id});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (size_t i = 0; i + 1 < n; ++i) push(int32_t(i), int32_t(i + 1));
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Pair p = heap.back();
    heap.pop_back();
    const auto l = size_t(p.left), r = size_t(p.right);
    if (id[l] != p.left_id || id[r] != p.right_id || next[l] != p.right) continue;  // stale
    id[l] = p.merged;
    id[r] = -1;  // r is gone; no byte-level id is negative
    next[l] = next[r];
    if (next[r] >= 0) prev[size_t(next[r])] = p.left;
    push(prev[l], p.left);
    push(p.left, next[l]);
  }
  for (int32_t i = 0; i >= 0; i = next[size_t(i)]) out.push_back(id[size_t(i)]);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  std::vector<int32_t> out;
  auto encode_plain = [&](std::string_view part) {
    for (std::string_view word : pre_tokenize(part)) {
      auto it = bytes_to_id_.find(std::string(word));  // whole word is one token: common, fast
      if (it != bytes_to_id_.end() && !special_[size_t(it->second)]) {
        out.push_back(it->second);
        continue;
      }
      for (std::string_view piece : split_long_word(word)) encode_word(piece, out);
    }
  };
  size_t start = 0, i = 0;
  while (parse_special && !added_.empty() && i < text.size()) {
    bool hit = false;
    for (const Added& a : added_) {
      if (!a.content.empty() && text.compare(i, a.content.size(), a.content) == 0) {
        encode_plain(text.substr(start, i - start));
        out.push_back(a.id);
        i += a.content.size();
        start = i;
        hit = true;
        break;
      }
    }
    if (!hit) ++i;
  }
  encode_plain(text.substr(start));
  return out;
}

std::string Tokenizer::decode(const int32_t* ids, size_t n) const {
  std::string out;
  for (size_t i = 0; i < n; ++i) out += token_bytes(ids[i]);
  return out;
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || size_t(id) >= id_to_bytes_.size())
    throw Error(ErrorCode::kInvalidArgument,
                "token id " + std::to_string(id) + " outside the vocabulary [0, " + std::to_string(vocab_size()) + ")");
  return id_to_bytes_[size_t(id)];
}

std::optional<int32_t> Tokenizer::token_id(const std::string& bytes) const {
  auto it = bytes_to_id_.find(bytes);
  if (it != bytes_to_id_.end()) return it->second;
  for (const Added& a : added_)
    if (a.content == bytes) return a.id;
  return std::nullopt;
}

bool Tokenizer::is_special(int32_t id) const { return id >= 0 && size_t(id) < special_.size() && special_[size_t(id)]; }

}  // namespace kvcodec::model

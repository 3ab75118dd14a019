// Byte-level BPE tokenizer read from a HF tokenizer.json (DESIGN 8).
//
// Supported: model.type "BPE" over the GPT-2 byte alphabet (every byte is a
// token), pre_tokenizer "ByteLevel" with use_regex (the GPT-2 split, written
// here as a hand-made state machine, see pre_tokenize()), decoder "ByteLevel",
// and added (special) tokens matched verbatim before the split. Anything else
// (normalizers, byte_fallback, other pre-tokenizers) is refused at load with
// Error(kUnsupported) naming the field.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvcodec::model {

class Tokenizer {
 public:
  static Tokenizer load(const std::string& path);  // tokenizer.json
  static Tokenizer parse(const std::string& json_text, const std::string& origin = "tokenizer.json");

  // Text (UTF-8 bytes) -> ids. Added tokens (e.g. "<|endoftext|>") found in
  // the text become their ids when parse_special is true.
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
  // Ids -> the exact bytes they stand for. Throws Error(kInvalidArgument)
  // for an id outside [0, vocab_size()).
  std::string decode(const int32_t* ids, size_t n) const;
  std::string decode(const std::vector<int32_t>& ids) const { return decode(ids.data(), ids.size()); }
  // The bytes of one token (what decode() emits for it; for streaming).
  const std::string& token_bytes(int32_t id) const;

  int vocab_size() const { return int(id_to_bytes_.size()); }
  std::optional<int32_t> token_id(const std::string& bytes) const;
  bool is_special(int32_t id) const;

  // The GPT-2 split ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)
  // as a state machine. Character classes: ASCII letters/digits/whitespace as
  // usual; non-ASCII code points are letters, except the Unicode White_Space
  // characters (U+0085, U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029,
  // U+202F, U+205F, U+3000), which are whitespace. Non-ASCII digits and
  // punctuation are thus treated as letters (a documented approximation;
  // invalid UTF-8 bytes are letters of one byte).
  static std::vector<std::string_view> pre_tokenize(std::string_view text);

  // A pre-token longer than kMaxWordBytes is merged in pieces of at most
  // that many bytes, cut before a UTF-8 lead byte (deterministic; the ids of
  // a longer word may then differ from HF tokenizers', which has no bound,
  // at the cuts only). Bounds the work and memory of one word; real text
  // has no words this long. split_long_word() gives the pieces.
  static constexpr size_t kMaxWordBytes = 4096;
  static std::vector<std::string_view> split_long_word(std::string_view word);

  // The BPE ids of one pre-token (no length bound, no added tokens), in
  // O(n log n) with a heap over merge ranks. Appends to out.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  // The merge of two adjacent token ids: its rank (lower merges first) and
  // the merged id. For plain reference implementations (tests).
  struct Merge {
    int32_t rank, id;
  };
  std::optional<Merge> merge(int32_t left, int32_t right) const;
  int32_t byte_token(uint8_t byte) const { return byte_id_[byte]; }
  // Longest byte length of any token (added tokens included): a text of B
  // bytes encodes to at least B / max_token_bytes() ids.
  size_t max_token_bytes() const { return max_token_bytes_; }

 private:

  std::vector<std::string> id_to_bytes_;
  std::unordered_map<std::string, int32_t> bytes_to_id_;
  // (left id, right id) -> (rank, merged id), key packed in 64 bits.
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  int32_t byte_id_[256] = {};
  struct Added {
    std::string content;
    int32_t id;
  };
  std::vector<Added> added_;  // longest first, so overlapping specials pick the longest
  std::vector<bool> special_;
  size_t max_token_bytes_ = 1;
  // No word cache: encode() is const and safe to call from several threads.
};

}  // namespace kvcodec::model

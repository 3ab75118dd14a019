// libFuzzer target: tokenizer.json loading (model::Tokenizer::parse), then
// encode and decode with what it accepts. Success or kvcodec::Error only.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "fuzz_seeds.hpp"
#include "kvcodec/error.hpp"
#include "model/tokenizer.hpp"

using namespace kvcodec;

namespace {

// A minimal byte-level BPE tokenizer.json: the 256 byte tokens under the
// GPT-2 byte-to-character map, a few merges and one added token.
std::string tiny_tokenizer_json() {
  std::vector<uint32_t> chars(256);
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    chars[b] = printable ? b : next++;
  }
  auto escaped = [](uint32_t cp) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(cp));
    return std::string(buf);
  };
  std::string vocab;
  for (uint32_t b = 0; b < 256; ++b) vocab += (b ? ",\"" : "\"") + escaped(chars[b]) + "\":" + std::to_string(b);
  const char* merged[] = {"de", "def", "re", "tu", "rn", "retu", "return"};
  for (int i = 0; i < 7; ++i) vocab += ",\"" + std::string(merged[i]) + "\":" + std::to_string(256 + i);
  return std::string("{\"added_tokens\":[{\"id\":263,\"content\":\"<|endoftext|>\",\"special\":true}],") +
         "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true}," +
         "\"decoder\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{" + vocab +
         "},\"merges\":[\"d e\",\"de f\",\"r e\",\"t u\",\"r n\",\"re tu\",\"retu rn\"]}}";
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const std::string json = tiny_tokenizer_json();
  fuzz::write_seed("tiny_tokenizer.json", std::vector<uint8_t>(json.begin(), json.end()));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const model::Tokenizer t = model::Tokenizer::parse(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
    for (const std::string& text : {std::string("def f(x):\n    return x<|endoftext|> \xc3\xa9\xff"),
                                    std::string(reinterpret_cast<const char*>(data), std::min<size_t>(size, 256))}) {
      const std::vector<int32_t> ids = t.encode(text);
      if (t.decode(ids) != text) __builtin_trap();  // byte-level: every text round-trips
    }
  } catch (const Error&) {
  }
  return 0;
}

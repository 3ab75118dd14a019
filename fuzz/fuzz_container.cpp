// libFuzzer target: the container reader and the ByteReader it hands payloads to.
// Every input must end in success or kvcodec::Error: never a crash, a hang,
// an out-of-bounds read or an unbounded allocation.
#include <cstddef>
#include <cstdint>

#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"

using namespace kvcodec;

namespace {

// Reads a payload as a stream of typed fields, the opcode taken from the
// payload itself, as a cache's load() would with corrupted state.
void walk_payload(std::span<const uint8_t> payload) {
  ByteReader r(payload, "fuzz payload");
  try {
    while (!r.at_end()) {
      switch (r.u8() % 10) {
        case 0: r.u32(); break;
        case 1: r.u64(); break;
        case 2: r.varint(); break;
        case 3: r.svarint(); break;
        case 4: r.str(4096); break;
        case 5: r.f32_vec(1u << 16); break;
        case 6: r.f16s_to_f32(size_t(r.varint())); break;
        case 7: r.u8_vec(1u << 16); break;
        case 8: r.boolean(); break;
        case 9: r.bytes(size_t(r.count(1u << 20, "n"))); break;
      }
    }
    r.expect_end();
  } catch (const Error&) {
  }
}

void parse_and_touch(const uint8_t* data, size_t size, bool verify) {
  ContainerLimits limits;
  limits.max_sections = 256;
  limits.max_meta_bytes = 1u << 16;
  limits.verify_checksums = verify;
  try {
    const ContainerReader r = ContainerReader::parse(data, size, limits, "fuzz");
    size_t n = r.meta().size();
    for (const std::string& name : r.section_names()) {
      const auto s = r.section(name);
      n += s.size();
      walk_payload(s);
    }
    if (r.total_bytes() != size || r.overhead() > size || n > size) __builtin_trap();
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  parse_and_touch(data, size, true);
  // Without checksums the fuzzer reaches the structural checks behind them.
  parse_and_touch(data, size, false);
  return 0;
}

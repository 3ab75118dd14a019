// libFuzzer target for the entropy decoders: the first bytes hold a
// serialised frequency table (and, after it, a Huffman table); the rest is
// decoded as a rANS, Huffman and fixed-width stream over a few columns that
// share those tables. Any input must end in success or kvcodec::Error, never
// in a crash, an out-of-bounds access or a hang.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "entropy/entropy.hpp"

using namespace kvcodec;
using namespace kvcodec::entropy;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  // Shape from the first two bytes: up to 64 rows x 5 columns, one skipped.
  const size_t rows = data[0] & 63;
  const size_t cols = 1 + (data[1] % 5);
  const size_t skip = data[1] / 5 % (cols + 1);  // == cols: nothing skipped
  data += 2, size -= 2;

  BitReader header(data, size);
  FrequencyTable ft;
  HuffmanTable ht;
  try {
    ft = FrequencyTable::deserialize(header, 4096);
    ht = HuffmanTable::deserialize(header, 4096);
  } catch (const Error&) {
    return 0;
  }
  const size_t used = header.bytes_consumed();
  const uint8_t* payload = data + used;
  const size_t payload_size = size - used;

  const RansDecodeTable dt(ft);
  std::vector<const RansDecodeTable*> rans_tables(cols, &dt);
  std::vector<const HuffmanTable*> huff_tables(cols, &ht);
  std::vector<uint8_t> widths(cols, uint8_t(1 + ft.alphabet_size % 16));
  if (skip < cols) rans_tables[skip] = nullptr, huff_tables[skip] = nullptr, widths[skip] = 0;

  std::vector<uint16_t> out(rows * cols);
  try {
    rans_decode(payload, payload_size, rows, cols, rans_tables, out.data());
  } catch (const Error&) {
  }
  // The paired decoder (two streams interleaved): the payload's halves.
  {
    std::vector<uint16_t> out_b(rows * cols);
    RansDecodeJob a, b;
    a.data = payload, a.size = payload_size / 2, a.n_rows = rows, a.n_cols = cols, a.tables = &rans_tables;
    a.out = out.data();
    b = a;
    b.data = payload + payload_size / 2, b.size = payload_size - payload_size / 2, b.out = out_b.data();
    try {
      rans_decode_pair(a, b);
    } catch (const Error&) {
    }
  }
  try {
    huffman_decode(payload, payload_size, rows, cols, huff_tables, out.data());
  } catch (const Error&) {
  }
  try {
    unpack_fixed(payload, payload_size, rows, cols, widths, out.data());
  } catch (const Error&) {
  }
  return 0;
}

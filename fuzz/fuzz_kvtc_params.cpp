// libFuzzer target: the KVTC parameter decoder (HeadParams::deserialize) and
// the block decoder on the parameters it accepts.
//   input: u8 (dim - 1), u8 (tokens - 1), serialised HeadParams, block payload
// (seeds: each coder and basis width, and centroid reconstruction)
// Success or kvcodec::Error only; a decoded block re-encodes.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_seeds.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"
#include "kvtc/codec.hpp"
#include "linalg/pca.hpp"

using namespace kvcodec;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const int dim = 16;
  const int64_t n = 64, block = 8;
  const std::vector<float> x = fuzz::low_rank(n, dim, 5);
  const linalg::PcaBasis pca = linalg::fit_pca(x.data(), n, dim);
  const auto write = [&](const kvtc::HeadParams& p, const std::string& name) {
    ByteWriter w;
    w.u8(uint8_t(dim - 1));
    w.u8(uint8_t(block - 1));
    p.serialize(w);
    const std::vector<uint8_t> payload = kvtc::encode_block(p, x.data(), block);
    w.bytes(payload.data(), payload.size());
    fuzz::write_seed(name, w.take());
  };
  for (const kvtc::CoderChoice coder : {kvtc::CoderChoice::kRans, kvtc::CoderChoice::kHuffman, kvtc::CoderChoice::kFixed})
    for (const int basis_bits : {16, 8}) {
      kvtc::CodecOptions o;
      o.coder = coder;
      o.basis_bits = basis_bits;
      write(kvtc::fit_head(x.data(), n, dim, pca.mean, pca.components, pca.eigenvalues, o),
            std::string(kvtc::coder_name(coder)) + "_" + std::to_string(basis_bits));
    }
  // Centroid reconstruction (quantizer flag bit 1 and its offsets).
  kvtc::HeadParams p = kvtc::fit_head(x.data(), n, dim, pca.mean, pca.components, pca.eigenvalues, kvtc::CodecOptions{});
  for (size_t k = 0; k < p.quant.size(); ++k) p.quant[k].centroid = {-0.125f, k % 2 ? 0.0625f : 0.0f, 0.25f};
  p.build_decoders();
  write(p, "rans_16_centroid");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int dim = 1 + data[0] % 64;
  const int64_t n = 1 + data[1] % 64;
  try {
    ByteReader in(data + 2, size - 2, "fuzz params");
    const kvtc::HeadParams p = kvtc::HeadParams::deserialize(in, dim);
    const uint8_t* payload = data + 2 + in.offset();
    const size_t payload_size = in.remaining();
    std::vector<float> x(size_t(n) * size_t(dim)), y(x.size());
    try {
      kvtc::decode_block(p, payload, payload_size, n, x.data());
      // Decoded values code again, and decode to themselves' reconstruction.
      const std::vector<uint8_t> again = kvtc::encode_block(p, x.data(), n);
      kvtc::decode_block(p, again.data(), again.size(), n, y.data());
    } catch (const Error&) {
    }
    kvtc::decode_block_pair(p, payload, payload_size, x.data(), p, payload, payload_size, y.data(), n);
  } catch (const Error&) {
  }
  return 0;
}

// libFuzzer target: the PALU projection decoder (Projection::deserialize) and
// a latent group coded and decoded with what it accepts.
//   input: u8 (dim - 1), serialised Projection, then latent group bytes
// Success or kvcodec::Error only.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_seeds.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"
#include "palu/projection.hpp"

using namespace kvcodec;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  for (const int dim : {8, 32}) {
    const std::vector<float> x = fuzz::low_rank(64, dim, uint32_t(dim));
    palu::FitOptions o;
    const palu::Projection p = palu::fit_projection(x.data(), 64, dim, o);
    ByteWriter w;
    w.u8(uint8_t(dim - 1));
    p.serialize(w);
    std::vector<uint8_t> seed = w.take();
    std::vector<float> z(size_t(4 * 2 * p.rank), 0.5f);
    palu::encode_latent_group(p, z.data(), 2, 4, seed);
    fuzz::write_seed("projection_" + std::to_string(dim), seed);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int dim = 1 + data[0] % 128;
  try {
    ByteReader in(data + 1, size - 1, "fuzz projection");
    const palu::Projection p = palu::Projection::deserialize(in, dim);
    if (p.serialized_size() != in.offset()) __builtin_trap();  // read exactly its stored form
    const size_t pos = 1 + in.offset();
    std::vector<float> x(static_cast<size_t>(dim), 1.0f), z(static_cast<size_t>(p.rank)), back(static_cast<size_t>(dim));
    p.project(x.data(), z.data());
    p.reconstruct(z.data(), back.data());
    const int64_t rows = 2, n_tokens = 4;
    std::vector<float> latents(size_t(rows * n_tokens * p.rank));
    palu::decode_latent_group(p, data + pos, size - pos, rows, n_tokens, latents.data());
  } catch (const Error&) {
  }
  return 0;
}

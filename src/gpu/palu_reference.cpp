#include "gpu/palu_reference.hpp"

#include <string>

#include "gpu/kvtc_variant.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"
#include "palu/group_quant.hpp"
#include "palu/projection.hpp"

namespace kvcodec::gpu {
namespace {
void check_shape(const palu::Projection& p, int rows, int64_t tokens, int group_size) {
  if (rows <= 0 || group_size <= 0 || tokens <= 0 || tokens % group_size != 0 || p.rank <= 0)
    throw Error(ErrorCode::kInvalidArgument, "palu reference: rows " + std::to_string(rows) + ", tokens " +
                                                 std::to_string(tokens) + ", group_size " + std::to_string(group_size) +
                                                 " (tokens must be a positive multiple of group_size)");
}
}  // namespace

std::vector<uint8_t> palu_encode_reference(const palu::Projection& p, const uint16_t* x, int rows, int64_t tokens,
                                           int group_size) {
  check_shape(p, rows, tokens, group_size);
  const int64_t dim = p.dim, r = p.rank;
  std::vector<uint8_t> out;
  std::vector<float> xf(static_cast<size_t>(dim)), z(static_cast<size_t>(group_size * rows * r));
  for (int64_t g = 0; g < tokens / group_size; ++g) {
    for (int64_t t = 0; t < group_size; ++t)
      for (int64_t row = 0; row < rows; ++row) {
        const uint16_t* xt = x + (row * tokens + g * group_size + t) * dim;
        for (int64_t i = 0; i < dim; ++i) xf[size_t(i)] = bf16_bits_to_f32(xt[i]);
        float* zt = z.data() + (t * rows + row) * r;
        p.project(xf.data(), zt);
        // As the cache's tail holds them: f16, saturating.
        for (int64_t j = 0; j < r; ++j) zt[j] = f16_to_f32(detail::f16_saturate(zt[j]));
      }
    palu::encode_latent_group(p, z.data(), rows, group_size, out);
  }
  return out;
}

void palu_decode_reference(const palu::Projection& p, const uint8_t* blob, size_t size, int rows, int64_t tokens,
                           int group_size, uint16_t* y) {
  check_shape(p, rows, tokens, group_size);
  const int64_t dim = p.dim, r = p.rank;
  const size_t gb = palu::latent_group_bytes(p, rows, group_size);
  const int64_t n_groups = tokens / group_size;
  if (size != gb * size_t(n_groups))
    throw Error(ErrorCode::kFormat, "palu reference: " + std::to_string(size) + " bytes for " +
                                        std::to_string(n_groups) + " token groups of " + std::to_string(gb));
  std::vector<float> z(static_cast<size_t>(group_size * rows * r)), xf(static_cast<size_t>(dim));
  for (int64_t g = 0; g < n_groups; ++g) {
    palu::decode_latent_group(p, blob + size_t(g) * gb, gb, rows, group_size, z.data());
    for (int64_t t = 0; t < group_size; ++t)
      for (int64_t row = 0; row < rows; ++row) {
        p.reconstruct(z.data() + (t * rows + row) * r, xf.data());
        uint16_t* yt = y + (row * tokens + g * group_size + t) * dim;
        for (int64_t i = 0; i < dim; ++i) yt[i] = f32_to_bf16_rne(xf[size_t(i)]);
      }
  }
}

}  // namespace kvcodec::gpu

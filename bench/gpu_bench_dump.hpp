// Real KV rows for the calibrated GPU format, tiled from the tinycode dump
// (gpu_bench_calibrated, offload_bench).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cache/kvtc_calibrated.hpp"
#include "gpu/kvtc_variant.hpp"
#include "kvcodec/safetensors.hpp"
#include "kvcodec/tensor.hpp"

namespace kvcodec::bench {

// Calibration layer `layer`'s keys or values of the dump ([1, H, T, Dh]) as
// `rows` rows [S, H * Dh] bf16 written to out ([rows, S, H * Dh]): token p
// of row b is the dump's token (p + 131 b) % T, keys with RoPE removed at
// their own position and applied again at p.
inline void tiled_dump_rows(const SafetensorsFile& f, const KvtcCalibration& cal, int layer, bool is_key, int rows,
                            int64_t S, uint16_t* out) {
  const int H = cal.n_kv_heads, Dh = cal.head_dim, D = cal.vector_dim();
  const Tensor t = f.tensor("layers." + std::to_string(layer) + (is_key ? ".key" : ".value"), DType::kF32);
  const int64_t T = t.shape()[2];
  const auto rope = RopeTable::get(Dh, cal.rope_theta, std::max<int64_t>(S, T) + 1);
  std::vector<float> base(size_t(T) * size_t(D));  // [T, H * Dh], RoPE removed
  for (int64_t i = 0; i < T; ++i)
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < Dh; ++d)
        base[size_t(i) * size_t(D) + size_t(h * Dh + d)] = t.data_as<float>()[(h * T + i) * Dh + d];
  if (is_key) rope->rotate(base.data(), T, D, H, 0, /*inverse=*/true);
#pragma omp parallel for schedule(static)
  for (int64_t bp = 0; bp < int64_t(rows) * S; ++bp) {
    const int64_t b = bp / S, p = bp % S;
    std::vector<float> row(base.begin() + long(((p + 131 * b) % T) * D), base.begin() + long(((p + 131 * b) % T + 1) * D));
    if (is_key) rope->rotate(row.data(), 1, D, H, p, /*inverse=*/false);
    uint16_t* o = out + size_t(bp) * size_t(D);
    for (int d = 0; d < D; ++d) o[d] = gpu::f32_to_bf16_rne(row[size_t(d)]);
  }
}

}  // namespace kvcodec::bench

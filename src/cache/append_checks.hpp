// What every cache checks on append (DESIGN 3), in one place: keys and
// values agree in shape and dtype, H_kv and D are the layer's, the batch is
// in range and that of the tokens already held, data is there; and the
// 16-bit dtype a cache keeps raw tokens in.
#pragma once

#include <cstdint>
#include <string>

#include "kvcodec/cache.hpp"
#include "kvcodec/tensor.hpp"

namespace kvcodec::cache_impl {

// The largest batch a cache takes (and a saved cache may claim).
inline constexpr int64_t kMaxBatch = int64_t(1) << 20;

// keys, values [B, H_kv, S, D] appended to a cache of `config` that holds
// tokens of batch `held_batch` (0: none yet). Error(kShapeMismatch) naming
// `who` and both shapes otherwise; Error(kInvalidArgument) for null data.
void check_append(const TensorView& keys, const TensorView& values, const CacheConfig& config,
                  int64_t held_batch, const std::string& who);

// Raw tokens are kept in bf16 when they come in bf16 (never through f16,
// which overflows past 65504), in f16 otherwise.
inline DType raw_dtype_for(DType input) { return input == DType::kBF16 ? DType::kBF16 : DType::kF16; }

}  // namespace kvcodec::cache_impl

#include "cache/append_checks.hpp"

#include "kvcodec/error.hpp"

namespace kvcodec::cache_impl {

void check_append(const TensorView& keys, const TensorView& values, const CacheConfig& config,
                  int64_t held_batch, const std::string& who) {
  if (keys.shape != values.shape || keys.dtype != values.dtype)
    throw Error(ErrorCode::kShapeMismatch, who + ": keys " + shape_string(keys.shape) + " " +
                                               dtype_name(keys.dtype) + " and values " + shape_string(values.shape) +
                                               " " + dtype_name(values.dtype) + " differ");
  const Shape4& s = keys.shape;
  if (s[0] < 1 || s[0] > kMaxBatch || s[2] < 0 || s[1] != config.n_kv_heads || s[3] != config.head_dim)
    throw Error(ErrorCode::kShapeMismatch, who + " (layer " + std::to_string(config.layer) + "): got " +
                                               shape_string(s) + ", expected [B in 1.." + std::to_string(kMaxBatch) +
                                               ", " + std::to_string(config.n_kv_heads) + ", S, " +
                                               std::to_string(config.head_dim) + "]");
  if (held_batch > 0 && s[0] != held_batch)
    throw Error(ErrorCode::kShapeMismatch, who + ": batch " + std::to_string(s[0]) +
                                               " appended to a cache holding batch " + std::to_string(held_batch));
  if (s[2] > 0 && (keys.data == nullptr || values.data == nullptr))
    throw Error(ErrorCode::kInvalidArgument, who + ": null tensor data");
}

}  // namespace kvcodec::cache_impl

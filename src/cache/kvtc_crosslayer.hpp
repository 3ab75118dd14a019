// Cross-layer KVTC for stored prefixes (issue 21; docs/calibrated.md).
//
// A stored prefix has every layer of every token, so one token's keys of ALL
// layers can be one vector (and its values another): [l][h][d], L * H_kv * D
// values, keys with RoPE removed, each layer's part multiplied by its
// attention weights and divided by its RMS on the calibration tokens (so the
// layers weigh alike in one PCA). One basis then captures what layers share,
// where a per-layer basis codes it once per layer.
//
// The parameters are a KvtcCalibration of ONE "layer" whose "heads" are the
// model's layers x kv heads (n_kv_heads = L * H_kv), with the weights / RMS
// in key_scale / value_scale and meta fit.cross_layers = L: the same file
// format, checks and loader as the per-layer calibration. A per-layer cache
// refuses such a file (its shape names 1 layer).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cache/kvtc_calibrated.hpp"
#include "kvcodec/cache.hpp"

namespace kvcodec {

// L of a cross-layer calibration; 0 for a per-layer one.
int cross_layer_count(const KvtcCalibration& cal);

// Throws Error(kShapeMismatch) naming both shapes unless `cal` is a
// cross-layer calibration for n_layers x n_kv_heads x head_dim at rope_theta.
void check_cross_layer_calibration(const KvtcCalibration& cal, int n_layers, int n_kv_heads, int head_dim,
                                   double rope_theta, const std::string& label);

// One block of n tokens at positions t0.. between the model's layout and the
// codec's: layer_rows[l] is [n, H * D] ([t][h][d]) of layer l, keys
// post-RoPE; x is [n, L * H * D] ([t][l][h][d]), RoPE removed (is_key) and
// times scale (the calibration's key_scale[0] / value_scale[0]). The stored
// prefix and the streaming cache (kvtc_crosslayer_stream.hpp) both code
// through these.
void cross_layer_to_codec(const float* const* layer_rows, int L, int H, int D, int64_t n, int64_t t0, bool is_key,
                          const std::vector<double>& inv_freq, const std::vector<float>& scale, float* x);
void cross_layer_from_codec(const float* x, int L, int H, int D, int64_t n, int64_t t0, bool is_key,
                            const std::vector<double>& inv_freq, const std::vector<float>& scale,
                            float* const* layer_rows);

// One stored prefix: its bytes (what a store keeps) for keys and values.
// Layout of each: varint tokens, varint sinks, varint block, the sinks raw (f16, [l][h][t][d]),
// then per block of up to `block` tokens a varint payload size and the
// kvtc payload of that block's cross-layer vectors.
struct CrossLayerPrefixBytes {
  std::vector<uint8_t> keys, values;
};

// prefix: per layer [1, H_kv, S, D] (any dtype; keys post-RoPE at positions
// 0..S-1). The first `sinks` tokens are stored raw.
CrossLayerPrefixBytes store_prefix_cross_layer(const KvtcCalibration& cal, const std::vector<KVPair>& prefix, int sinks,
                                               int block = 64);

// The prefix back from those bytes: per layer [1, H_kv, S, D] f32. Throws
// Error(kFormat) on malformed bytes.
std::vector<KVPair> restore_prefix_cross_layer(const KvtcCalibration& cal, const CrossLayerPrefixBytes& bytes);

}  // namespace kvcodec

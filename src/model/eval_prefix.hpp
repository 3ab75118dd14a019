// Stored-prefix protocol of `kvcodec eval` (docs/eval.md, issue 21).
//
// A prefix store (server prefix store, GPU offload) receives the keys and
// values of a whole prompt prefix at once, computed exactly, and stores them
// compressed; a later request restores them and runs its new tokens on top.
// A PrefixCoder is what such a store does with one prefix: every layer's
// keys and values [1, H_kv, S, D] in, the reconstruction and the bytes it
// stores out. Coding across layers is allowed here: every layer of every
// token is at hand.
#pragma once

#include <functional>
#include <vector>

#include "cache/kvtc_calibrated.hpp"
#include "kvcodec/cache.hpp"
#include "model/llama.hpp"

namespace kvcodec::model {

struct StoredPrefix {
  std::vector<KVPair> restored;  // per layer, [1, H_kv, S, D] f32
  // compressed_key/value_bytes: EVERY stored byte (payloads, tables and side
  // information of this prefix, raw sinks); fp16_*: what f16 costs for the
  // prefix. Parameters shared by every prefix of a model (a calibration)
  // are reported apart, in `shared`.
  CacheStats stats;
};

// prefix: per layer, [1, H_kv, S, D] f32 (keys post-RoPE, positions 0..S-1).
using PrefixCoder = std::function<StoredPrefix(const ModelConfig& config, const std::vector<KVPair>& prefix)>;

// The per-layer store: each layer's prefix appended in ONE call to a fresh
// cache of `factory` (so a calibrated kvtc with window 0 codes all but its
// sinks), stored bytes = that cache's compressed bytes (everything it holds),
// restored = its fetch().
PrefixCoder per_layer_prefix_coder(CacheFactory factory);

// The cross-layer store (cache/kvtc_crosslayer.hpp): all but `sinks` tokens
// coded across layers in blocks of `block`; stored bytes = the two streams
// (header, raw sinks, block sizes, payloads), restored from those bytes. The
// calibration's held bytes are reported apart (stats.shared). Throws Error(kShapeMismatch) at the first
// prefix when the calibration does not fit the model.
PrefixCoder cross_layer_prefix_coder(std::shared_ptr<const KvtcCalibration> calibration, int sinks, int block = 64);

// Caches of `factory`, one per layer, each first appended `restored[layer]`:
// what the scored tokens run on top of.
CacheFactory prefilled_factory(CacheFactory factory, std::shared_ptr<const std::vector<KVPair>> restored);

}  // namespace kvcodec::model

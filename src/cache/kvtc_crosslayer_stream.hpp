// Streaming cross-layer KVTC (issue 21; docs/calibrated.md): the per-layer
// caches of ONE sequence share one coder, which codes a block of tokens
// across all layers (the cross-layer calibration of kvtc_crosslayer.hpp:
// one vector of L * H_kv * D values per token for keys, one for values)
// once every layer has appended it and it has left the raw window.
//
// Per layer: the first `sinks` tokens stay raw, and so do the tokens after
// the last coded block: the `window` newest plus fewer than `block` waiting
// for their block to fill (so window + block - 1 raw tokens at most, beyond
// the sinks). Raw tokens are held as f16. Appending costs O(1) per token
// (a block is coded once, when its last token's last layer arrives; the raw
// tail is bounded).
//
// Reading (for_each_block) of one layer: with decoded scratch (the
// default) each block is decoded ONCE, when it is coded, and every layer's
// part kept as f32: no decode work per step, at 4 bytes per value held
// (counted in resident_bytes, not in the stored bytes). Without it each
// read decodes every coded block whole (all layers) and visits its layer's
// part: decode work per step = L x the history, nothing held.
//
// Bytes (CacheStats): stored = each block's key and value payloads with a
// varint of their size (counted by layer 0's cache; the other layers'
// report their raw bytes only, so the sum over layers is the sequence's)
// plus every layer's raw sinks and tail in f16. The calibration is shared
// and reported apart (CacheStats::shared). Not savable and not trimmable
// (blocks span every layer): save/load/trim throw Error(kUnsupported).
//
// Recent tier (options.recent > 0): a block is first coded with
// options.recent_calibration (a higher-rate cross-layer calibration), and
// once `recent` newer tokens are coded behind it, it is re-coded with the
// base calibration from its recent-tier reconstruction (the raw rows are
// gone by then: nothing uncompressed is kept for it). Each block is re-coded
// once: O(1) per appended token; the stored bytes count whichever payload a
// block holds. Why: in streaming the error that costs perplexity is in the
// tokens just behind the window, which attention reads most.
//
// Prefill caveat (cross-layer by construction): a block is coded when the
// LAST layer appends it, so during one forward pass layers 0..L-2 read the
// new tokens raw; from the next pass on every layer reads them coded.
//
// The caches of one group are not independent: calls on them must not run
// concurrently (the runtime drives one sequence's layers in turn).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "kvcodec/cache.hpp"

namespace kvcodec {

struct KvtcCalibration;  // cache/kvtc_calibrated.hpp

struct CrossLayerStreamOptions {
  int sinks = 4;
  int window = 16;
  int block = 16;
  bool decoded_scratch = true;
  int recent = 0;  // coded tokens held in the recent tier (0: none)
  std::shared_ptr<const KvtcCalibration> recent_calibration;  // needed when recent > 0
};

// The n_layers caches of one sequence (config.layer is ignored; caches[l]
// serves layer l). Throws Error(kShapeMismatch) unless cal (and the recent
// tier's) is a cross-layer calibration for config's shape, Error(kConfig)
// for bad options.
std::vector<std::unique_ptr<KVCache>> make_cross_layer_stream_caches(std::shared_ptr<const KvtcCalibration> cal,
                                                                     const CacheConfig& config,
                                                                     const CrossLayerStreamOptions& options);

// A per-layer factory (the runtime's CacheFactory) over groups: asking for
// layer 0 starts a new sequence's group, layers 1..L-1 then come from it in
// order. Asking for another layer than the next one throws
// Error(kInvalidArgument).
std::function<std::unique_ptr<KVCache>(const CacheConfig&)> cross_layer_stream_factory(
    std::shared_ptr<const KvtcCalibration> cal, const CrossLayerStreamOptions& options);

}  // namespace kvcodec

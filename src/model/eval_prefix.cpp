#include "model/eval_prefix.hpp"

#include <memory>
#include <string>

#include "cache/kvtc_crosslayer.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec::model {

PrefixCoder per_layer_prefix_coder(CacheFactory factory) {
  return [factory = std::move(factory)](const ModelConfig& c, const std::vector<KVPair>& prefix) {
    if (prefix.size() != size_t(c.n_layers))
      throw Error(ErrorCode::kShapeMismatch, "stored prefix: " + std::to_string(prefix.size()) + " layers, model has " +
                                                 std::to_string(c.n_layers));
    StoredPrefix out;
    for (int l = 0; l < c.n_layers; ++l) {
      std::unique_ptr<KVCache> cache = factory(layer_cache_config(c, l));
      cache->append(prefix[size_t(l)].keys.view(), prefix[size_t(l)].values.view());
      out.stats += cache->stats();
      out.restored.push_back(cache->fetch(DType::kF32));
    }
    return out;
  };
}

PrefixCoder cross_layer_prefix_coder(std::shared_ptr<const KvtcCalibration> cal, int sinks, int block) {
  if (!cal) throw Error(ErrorCode::kInvalidArgument, "cross-layer store: no calibration");
  if (sinks < 0 || block < 1)
    throw Error(ErrorCode::kInvalidArgument, "cross-layer store: sinks " + std::to_string(sinks) + " (>= 0), block " +
                                                 std::to_string(block) + " (>= 1)");
  return [cal, sinks, block](const ModelConfig& c, const std::vector<KVPair>& prefix) {
    check_cross_layer_calibration(*cal, c.n_layers, c.n_kv_heads, c.head_dim, c.rope_theta, "(eval)");
    const CrossLayerPrefixBytes bytes = store_prefix_cross_layer(*cal, prefix, sinks, block);
    StoredPrefix out;
    out.restored = restore_prefix_cross_layer(*cal, bytes);
    CacheStats& st = out.stats;
    st.method = "xkvtc";
    st.tokens = prefix.empty() ? 0 : prefix[0].keys.shape()[2] * int64_t(prefix.size());
    st.compressed_key_bytes = bytes.keys.size();
    st.compressed_value_bytes = bytes.values.size();
    for (const KVPair& kv : prefix) {
      st.fp16_key_bytes += uint64_t(kv.keys.numel()) * 2;
      st.fp16_value_bytes += uint64_t(kv.values.numel()) * 2;
    }
    st.resident_bytes = st.compressed_bytes();
    st.shared["xkvtc:" + std::to_string(reinterpret_cast<uintptr_t>(cal.get()))] = cal->held_bytes();
    return out;
  };
}

CacheFactory prefilled_factory(CacheFactory factory, std::shared_ptr<const std::vector<KVPair>> restored) {
  return [factory = std::move(factory), restored = std::move(restored)](const CacheConfig& cc) {
    if (cc.layer < 0 || size_t(cc.layer) >= restored->size())
      throw Error(ErrorCode::kInternal, "stored prefix: no restored layer " + std::to_string(cc.layer));
    std::unique_ptr<KVCache> cache = factory(cc);
    const KVPair& kv = (*restored)[size_t(cc.layer)];
    cache->append(kv.keys.view(), kv.values.view());
    return cache;
  };
}

}  // namespace kvcodec::model

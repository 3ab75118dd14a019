#include "model/identity.hpp"

#include <xxhash.h>

#include <cstdio>
#include <memory>

#include "cache/kvtc_cache.hpp"
#include "kvcodec/error.hpp"
#include "model/calibrate.hpp"

namespace kvcodec::model {

std::string model_identity(const LlamaModel& model, const std::string& model_dir) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(), &XXH3_freeState);
  if (!st) throw Error(ErrorCode::kInvalidArgument, "model identity: out of memory for a hash state");
  XXH3_64bits_reset(st.get());
  auto add = [&](const std::vector<float>& w) {
    const uint64_t n = w.size();  // lengths too, so moving values between tensors changes the hash
    XXH3_64bits_update(st.get(), &n, sizeof n);
    XXH3_64bits_update(st.get(), w.data(), w.size() * sizeof(float));
  };
  const ModelWeights& w = model.weights();
  add(w.embed);
  add(w.final_norm);
  add(w.lm_head);
  for (const LayerWeights& l : w.layers)
    for (const auto* t : {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.mlp_norm, &l.w_gate, &l.w_up, &l.w_down}) add(*t);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH3_64bits_digest(st.get()));
  return model_config_hash(model_dir) + "-" + hex;
}

void check_method_for_model(const std::string& method, const Settings& settings, const ModelConfig& config,
                            const std::string& config_hash) {
  if (method != "kvtc") return;
  CacheConfig cc;
  cc.n_layers = config.n_layers;
  cc.n_kv_heads = config.n_kv_heads;
  cc.head_dim = config.head_dim;
  cc.rope_theta = config.rope_theta;
  const KvtcSettings s = parse_kvtc_settings(settings, cc);
  if (s.mode != "calibrated") return;
  check_calibration_for_model(*KvtcCalibration::load_shared(s.calibration), config, config_hash);
}

}  // namespace kvcodec::model

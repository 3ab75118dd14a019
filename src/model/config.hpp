// HF config.json of a Llama-family checkpoint (DESIGN 8).
#pragma once

#include <cstdint>
#include <string>

namespace kvcodec::model {

struct ModelConfig {
  std::string architecture;   // e.g. "LlamaForCausalLM"
  int hidden_size = 0;
  int n_layers = 0;
  int n_heads = 0;            // query heads H_q
  int n_kv_heads = 0;         // H_kv (GQA: H_q is a multiple of H_kv)
  int head_dim = 0;           // D
  int intermediate_size = 0;
  int vocab_size = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  int bos_token_id = -1;      // -1 when absent
  int eos_token_id = -1;
  int max_position_embeddings = 0;

  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
};

// Parses config.json text. Accepts rope_theta at the top level or inside
// "rope_parameters" (transformers >= 5) / "rope_scaling" of type "default".
// Throws Error(kUnsupported) for an architecture or feature the runtime does
// not implement (biases, RoPE scaling, non-SiLU activations), Error(kConfig)
// for missing or out-of-range fields; messages name the field and `origin`.
ModelConfig parse_model_config(const std::string& json_text, const std::string& origin = "config.json");
ModelConfig load_model_config(const std::string& path);

}  // namespace kvcodec::model

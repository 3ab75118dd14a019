// LlamaModel::load: config.json + (sharded) safetensors -> f32 weights.
#include <filesystem>

#include "kvcodec/error.hpp"
#include "kvcodec/safetensors.hpp"
#include "model/llama.hpp"

namespace kvcodec::model {
namespace {

// Reads one weight, checking it exists and has exactly the expected shape.
std::vector<float> read_weight(const SafetensorsModel& st, const std::string& dir, const std::string& name,
                               const std::vector<int64_t>& shape) {
  if (!st.contains(name)) throw Error(ErrorCode::kNotFound, "checkpoint " + dir + " has no tensor " + name);
  const auto& info = st.info(name);
  if (info.shape != shape) {
    auto str = [](const std::vector<int64_t>& s) {
      std::string out = "[";
      for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
      return out + "]";
    };
    throw Error(ErrorCode::kShapeMismatch,
                "tensor " + name + " in " + dir + " has shape " + str(info.shape) + ", the config needs " + str(shape));
  }
  if (info.dtype != "F32" && info.dtype != "F16" && info.dtype != "BF16")
    throw Error(ErrorCode::kUnsupported,
                "tensor " + name + " in " + dir + " has dtype " + info.dtype + " (supported: F32, F16, BF16)");
  return st.read_f32(name);
}

}  // namespace

LlamaModel LlamaModel::load(const std::string& dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) throw Error(ErrorCode::kNotFound, "model folder " + dir + " does not exist");
  ModelConfig c = load_model_config((fs::path(dir) / "config.json").string());
  const SafetensorsModel st = SafetensorsModel::open(dir);
  const int64_t hid = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), inter = c.intermediate_size,
                vocab = c.vocab_size;
  ModelWeights w;
  w.embed = read_weight(st, dir, "model.embed_tokens.weight", {vocab, hid});
  w.final_norm = read_weight(st, dir, "model.norm.weight", {hid});
  if (!c.tie_word_embeddings) w.lm_head = read_weight(st, dir, "lm_head.weight", {vocab, hid});
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights lw;
    lw.attn_norm = read_weight(st, dir, p + "input_layernorm.weight", {hid});
    lw.wq = read_weight(st, dir, p + "self_attn.q_proj.weight", {qd, hid});
    lw.wk = read_weight(st, dir, p + "self_attn.k_proj.weight", {kvd, hid});
    lw.wv = read_weight(st, dir, p + "self_attn.v_proj.weight", {kvd, hid});
    lw.wo = read_weight(st, dir, p + "self_attn.o_proj.weight", {hid, qd});
    lw.mlp_norm = read_weight(st, dir, p + "post_attention_layernorm.weight", {hid});
    lw.w_gate = read_weight(st, dir, p + "mlp.gate_proj.weight", {inter, hid});
    lw.w_up = read_weight(st, dir, p + "mlp.up_proj.weight", {inter, hid});
    lw.w_down = read_weight(st, dir, p + "mlp.down_proj.weight", {hid, inter});
    w.layers.push_back(std::move(lw));
  }
  return LlamaModel(std::move(c), std::move(w));
}

}  // namespace kvcodec::model

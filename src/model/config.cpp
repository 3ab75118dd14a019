#include "model/config.hpp"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvcodec/error.hpp"

namespace kvcodec::model {
namespace {

using nlohmann::json;

[[noreturn]] void fail(ErrorCode code, const std::string& origin, const std::string& what) {
  throw Error(code, origin + ": " + what);
}

// Integer field in [lo, hi]; `required` fields throw when absent.
int get_int(const json& j, const char* key, const std::string& origin, int lo, int hi, bool required,
            int fallback) {
  if (!j.contains(key) || j[key].is_null()) {
    if (required) fail(ErrorCode::kConfig, origin, std::string("missing field \"") + key + "\"");
    return fallback;
  }
  const json& v = j[key];
  if (!v.is_number_integer())
    fail(ErrorCode::kConfig, origin, std::string("field \"") + key + "\" must be an integer, got " + v.dump());
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi)
    throw_config_error(origin + ": " + key, std::to_string(x),
                       "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return int(x);
}

double get_number(const json& j, const char* key, const std::string& origin, double fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_number())
    fail(ErrorCode::kConfig, origin, std::string("field \"") + key + "\" must be a number, got " + j[key].dump());
  return j[key].get<double>();
}

// eos_token_id may be a list in some configs; the first entry is the one used.
int get_token_id(const json& j, const char* key) {
  if (!j.contains(key) || j[key].is_null()) return -1;
  const json& v = j[key];
  if (v.is_number_integer()) return int(v.get<int64_t>());
  if (v.is_array() && !v.empty() && v[0].is_number_integer()) return int(v[0].get<int64_t>());
  return -1;
}

// The RoPE block: "rope_parameters" (transformers >= 5) or "rope_scaling".
// Only the default (unscaled) RoPE is implemented; anything else is refused
// rather than silently computed wrongly.
void read_rope(const json& j, const std::string& origin, ModelConfig& c) {
  c.rope_theta = get_number(j, "rope_theta", origin, c.rope_theta);
  for (const char* block : {"rope_parameters", "rope_scaling"}) {
    if (!j.contains(block) || j[block].is_null()) continue;
    const json& r = j[block];
    if (!r.is_object()) fail(ErrorCode::kConfig, origin, std::string("\"") + block + "\" must be an object");
    std::string type = "default";
    if (r.contains("rope_type") && r["rope_type"].is_string()) type = r["rope_type"].get<std::string>();
    else if (r.contains("type") && r["type"].is_string()) type = r["type"].get<std::string>();
    if (type != "default")
      fail(ErrorCode::kUnsupported, origin,
           std::string(block) + ".rope_type = \"" + type + "\" is not supported (only \"default\")");
    c.rope_theta = get_number(r, "rope_theta", origin, c.rope_theta);
  }
  if (!(c.rope_theta > 1.0) || c.rope_theta > 1e12)
    throw_config_error(origin + ": rope_theta", std::to_string(c.rope_theta), "(1, 1e12]");
}

ModelConfig parse_object(const json& j, const std::string& origin) {
  ModelConfig c;
  std::string model_type = j.value("model_type", std::string());
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string())
    c.architecture = j["architectures"][0].get<std::string>();
  // Llama-family checkpoints that share the exact Llama computation.
  const bool llama_arch = c.architecture == "LlamaForCausalLM" || c.architecture == "MistralForCausalLM";
  const bool llama_type = model_type == "llama" || model_type == "mistral";
  if (!llama_arch && !(c.architecture.empty() && llama_type))
    fail(ErrorCode::kUnsupported, origin,
         "architecture \"" + c.architecture + "\" (model_type \"" + model_type +
             "\") is not supported; expected LlamaForCausalLM or MistralForCausalLM");
  if (j.value("attention_bias", false)) fail(ErrorCode::kUnsupported, origin, "attention_bias = true is not supported");
  if (j.value("mlp_bias", false)) fail(ErrorCode::kUnsupported, origin, "mlp_bias = true is not supported");
  const std::string act = j.value("hidden_act", std::string("silu"));
  if (act != "silu") fail(ErrorCode::kUnsupported, origin, "hidden_act = \"" + act + "\" is not supported (only silu)");
  if (j.contains("sliding_window") && !j["sliding_window"].is_null())
    fail(ErrorCode::kUnsupported, origin, "sliding_window attention is not supported");
  if (j.contains("pretraining_tp") && j["pretraining_tp"].is_number_integer() && j["pretraining_tp"].get<int>() != 1)
    fail(ErrorCode::kUnsupported, origin, "pretraining_tp != 1 is not supported");

  constexpr int kBig = 1 << 20;
  c.hidden_size = get_int(j, "hidden_size", origin, 1, kBig, true, 0);
  c.n_layers = get_int(j, "num_hidden_layers", origin, 1, 4096, true, 0);
  c.n_heads = get_int(j, "num_attention_heads", origin, 1, 4096, true, 0);
  c.n_kv_heads = get_int(j, "num_key_value_heads", origin, 1, c.n_heads, false, c.n_heads);
  if (c.n_heads % c.n_kv_heads != 0)
    throw_config_error(origin + ": num_key_value_heads", std::to_string(c.n_kv_heads),
                       "a divisor of num_attention_heads = " + std::to_string(c.n_heads));
  const int derived_head_dim = c.hidden_size % c.n_heads == 0 ? c.hidden_size / c.n_heads : 0;
  c.head_dim = get_int(j, "head_dim", origin, 2, 4096, derived_head_dim == 0, derived_head_dim);
  if (c.head_dim % 2 != 0)
    throw_config_error(origin + ": head_dim", std::to_string(c.head_dim), "an even number (RoPE rotates pairs)");
  c.intermediate_size = get_int(j, "intermediate_size", origin, 1, kBig, true, 0);
  c.vocab_size = get_int(j, "vocab_size", origin, 1, 1 << 24, true, 0);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", origin, 0, 1 << 30, false, 0);
  c.rms_norm_eps = get_number(j, "rms_norm_eps", origin, 1e-6);
  if (!(c.rms_norm_eps > 0.0) || c.rms_norm_eps > 1.0)
    throw_config_error(origin + ": rms_norm_eps", std::to_string(c.rms_norm_eps), "(0, 1]");
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.bos_token_id = get_token_id(j, "bos_token_id");
  c.eos_token_id = get_token_id(j, "eos_token_id");
  read_rope(j, origin, c);
  return c;
}

}  // namespace

ModelConfig parse_model_config(const std::string& text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail(ErrorCode::kFormat, origin, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) fail(ErrorCode::kFormat, origin, "expected a JSON object");
  try {
    return parse_object(j, origin);
  } catch (const json::exception& e) {
    // A field of the wrong JSON type (e.g. "attention_bias": "yes").
    fail(ErrorCode::kConfig, origin, std::string("field of the wrong type: ") + e.what());
  }
}

ModelConfig load_model_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::kIo, "cannot open model config " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return parse_model_config(ss.str(), path);
}

}  // namespace kvcodec::model

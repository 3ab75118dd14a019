// config.json parsing: both RoPE forms, GQA, and clear refusals.
#include <gtest/gtest.h>

#include "kvcodec/error.hpp"
#include "model/config.hpp"
#include "model_fixtures.hpp"

namespace kvcodec::model {
namespace {

std::string llama(const std::string& extra) {
  return R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
    "intermediate_size": 512, "vocab_size": 1000, "rms_norm_eps": 1e-6)" + extra + "}";
}

ErrorCode code_of(const std::string& json, std::string* message = nullptr) {
  try {
    parse_model_config(json);
  } catch (const Error& e) {
    if (message) *message = e.what();
    return e.code();
  }
  return ErrorCode::kInternal;  // "no error"
}

TEST(Config, ShippedModel) {
  const ModelConfig c = load_model_config(testing::shipped_model_dir() + "/config.json");
  EXPECT_EQ(c.hidden_size, 384);
  EXPECT_EQ(c.n_layers, 6);
  EXPECT_EQ(c.n_heads, 6);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.intermediate_size, 1024);
  EXPECT_EQ(c.vocab_size, 4096);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.eos_token_id, 0);
}

TEST(Config, RopeThetaEitherPlace) {
  EXPECT_DOUBLE_EQ(parse_model_config(llama(R"(, "rope_theta": 500000.0)")).rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(
      parse_model_config(llama(R"(, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6})")).rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(parse_model_config(llama("")).rope_theta, 10000.0);
  const ModelConfig c = parse_model_config(llama(""));
  EXPECT_EQ(c.head_dim, 32);  // derived: hidden / heads
  EXPECT_FALSE(c.tie_word_embeddings);
}

TEST(Config, RefusesWhatItCannotRun) {
  std::string msg;
  EXPECT_EQ(code_of(R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})", &msg), ErrorCode::kUnsupported);
  EXPECT_NE(msg.find("GPT2LMHeadModel"), std::string::npos) << msg;
  EXPECT_EQ(code_of(llama(R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4.0})"), &msg), ErrorCode::kUnsupported);
  EXPECT_NE(msg.find("yarn"), std::string::npos) << msg;
  EXPECT_EQ(code_of(llama(R"(, "attention_bias": true)")), ErrorCode::kUnsupported);
  EXPECT_EQ(code_of(llama(R"(, "hidden_act": "gelu")")), ErrorCode::kUnsupported);
  EXPECT_EQ(code_of(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 8})", &msg), ErrorCode::kConfig);
  EXPECT_NE(msg.find("num_hidden_layers"), std::string::npos) << msg;
  EXPECT_EQ(code_of(llama(R"(, "num_key_value_heads": 3)").replace(llama("").find("\"num_key_value_heads\": 2,"), 25, ""), &msg),
            ErrorCode::kConfig);
  EXPECT_EQ(code_of(llama(R"(, "head_dim": 7)")), ErrorCode::kConfig);
  EXPECT_EQ(code_of(llama(R"(, "rms_norm_eps": -1)").replace(llama("").find("\"rms_norm_eps\": 1e-6"), 20, "\"x\": 0")),
            ErrorCode::kConfig);
  EXPECT_EQ(code_of(llama(R"(, "tie_word_embeddings": "yes")")), ErrorCode::kConfig);
  EXPECT_EQ(code_of("[1, 2]"), ErrorCode::kFormat);
  EXPECT_EQ(code_of("{"), ErrorCode::kFormat);
  EXPECT_THROW(load_model_config("/nonexistent/config.json"), Error);
}

}  // namespace
}  // namespace kvcodec::model

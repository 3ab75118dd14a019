// libFuzzer target: the server's request parsing, without HTTP or a model
// thread. Each input is one request body, given to all three parsers the
// endpoints use: POST /v1/completions and /v1/chat/completions
// (parse_body -> parse_request, with the logprobs and sampling fields) and
// POST /tokenize (parse_tokenize). Each must accept the body or throw the
// server's HttpError (400, or 404 for another model's name); anything else
// escaping (a JSON type_error, say, which the server would answer with a 500)
// is a finding. An accepted job is checked against the limits it was parsed
// under. The model is the shipped tinycode (config.json and tokenizer.json,
// found as `kvcodec serve` finds it: KVCODEC_MODEL or models/tinycode); its
// weights are not read: zeros of the right shapes stand in for them.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_seeds.hpp"
#include "model/config.hpp"
#include "model/paths.hpp"
#include "server/server_state.hpp"

using namespace kvcodec;
using namespace kvcodec::server;

namespace {

model::ModelWeights zero_weights(const model::ModelConfig& c) {
  const size_t hid = size_t(c.hidden_size), qd = size_t(c.q_dim()), kvd = size_t(c.kv_dim()),
               inter = size_t(c.intermediate_size), vocab = size_t(c.vocab_size);
  model::ModelWeights w;
  w.embed.assign(vocab * hid, 0.0f);
  w.final_norm.assign(hid, 1.0f);
  if (!c.tie_word_embeddings) w.lm_head.assign(vocab * hid, 0.0f);
  w.layers.resize(size_t(c.n_layers));
  for (model::LayerWeights& l : w.layers) {
    l.attn_norm.assign(hid, 1.0f);
    l.wq.assign(qd * hid, 0.0f);
    l.wk.assign(kvd * hid, 0.0f);
    l.wv.assign(kvd * hid, 0.0f);
    l.wo.assign(hid * qd, 0.0f);
    l.mlp_norm.assign(hid, 1.0f);
    l.w_gate.assign(inter * hid, 0.0f);
    l.w_up.assign(inter * hid, 0.0f);
    l.w_down.assign(hid * inter, 0.0f);
  }
  return w;
}

ServerState* state = nullptr;

// The state run_server() builds for the default options (no prefix store).
ServerState* make_state() {
  const std::string dir = model::default_model_dir();
  auto* s = new ServerState;
  model::ModelConfig config = model::load_model_config(dir + "/config.json");
  s->model_name = "tinycode";
  s->model = std::make_unique<model::LlamaModel>(config, zero_weights(config));
  s->tok = std::make_unique<model::Tokenizer>(model::Tokenizer::load(dir + "/tokenizer.json"));
  const int64_t context = config.max_position_embeddings > 0 ? config.max_position_embeddings : 2048;
  s->max_prompt = context - 1;
  s->max_prompt_bytes = uint64_t(s->max_prompt) * s->tok->max_token_bytes();
  return s;
}

void seed(const std::string& name, const std::string& body) {
  fuzz::write_seed(name + ".json", std::vector<uint8_t>(body.begin(), body.end()));
}

// What an accepted job must satisfy whatever the body said.
void check_job(const ServerState& s, const Job& job, bool chat) {
  const auto& c = s.model->config();
  if (job.chat != chat || job.prompt.empty() || int64_t(job.prompt.size()) > s.max_prompt) __builtin_trap();
  for (int32_t t : job.prompt)
    if (t < 0 || t >= c.vocab_size) __builtin_trap();
  if (job.gen.max_tokens < 0 || job.gen.max_tokens > s.opt.max_tokens_limit) __builtin_trap();
  if (int64_t(job.prompt.size()) + job.gen.max_tokens > c.max_position_embeddings) __builtin_trap();
  const auto& sp = job.gen.sampling;
  if (!(sp.temperature >= 0.0 && sp.temperature <= 100.0) || !(sp.top_p > 0.0 && sp.top_p <= 1.0)) __builtin_trap();
  if (job.stop.size() > 4) __builtin_trap();
  for (const std::string& st : job.stop)
    if (st.empty()) __builtin_trap();
  if (job.logprobs.top < 0 || job.logprobs.top > (chat ? 20 : 5) || (job.logprobs.top > 0 && !job.logprobs.enabled))
    __builtin_trap();
  if (chat && job.logprobs.echo) __builtin_trap();
}

void check_refusal(const HttpError& e) {
  if ((e.status != 400 && e.status != 404) || e.message.empty()) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  state = make_state();
  seed("completion", R"({"model":"tinycode","prompt":"def add(a, b):\n    return","max_tokens":8,"temperature":0.7,"top_p":0.9,"seed":3,"stop":["\n\n"]})");
  seed("completion_ids", R"({"prompt":[1,2,3,4095],"max_tokens":2,"logprobs":2,"echo":true})");
  seed("completion_stream", R"({"prompt":"x = ","stream":true,"stream_options":{"include_usage":true},"stop":"\n","n":1,"user":"u"})");
  seed("chat", R"({"model":"tinycode","messages":[{"role":"system","content":"You write Python."},{"role":"user","content":"def f(x):"}],"max_completion_tokens":4,"logprobs":true,"top_logprobs":3})");
  seed("chat_parts", R"({"messages":[{"role":"user","content":[{"type":"text","text":"import "},{"type":"text","text":"os"}]},{"role":"assistant","content":" sys"}],"temperature":0})");
  seed("tokenize", R"({"prompt":"for i in range(10):\n    print(i)<|endoftext|>"})");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  json j;
  try {
    j = parse_body(body);
  } catch (const HttpError& e) {
    check_refusal(e);
    return 0;
  }
  for (const bool chat : {false, true}) {
    try {
      const std::shared_ptr<Job> job = parse_request(*state, j, chat);
      check_job(*state, *job, chat);
    } catch (const HttpError& e) {
      check_refusal(e);
    }
  }
  try {
    for (int32_t t : parse_tokenize(*state, j))
      if (t < 0 || t >= state->model->config().vocab_size) __builtin_trap();
  } catch (const HttpError& e) {
    check_refusal(e);
  }
  return 0;
}

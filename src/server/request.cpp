// Request bodies of the generation endpoints -> Jobs (DESIGN 10): every
// field checked, named in the 400 when wrong, before any model work.
#include <set>

#include "kvcodec/error.hpp"

#include "server/server_state.hpp"

namespace kvcodec::server {
namespace {

double number_field(const json& j, const char* name, double def, double lo, double hi) {
  if (!j.contains(name) || j[name].is_null()) return def;
  if (!j[name].is_number()) throw HttpError{400, std::string("field '") + name + "' must be a number"};
  const double v = j[name].get<double>();
  if (!(v >= lo && v <= hi))
    throw HttpError{400, std::string("field '") + name + "' = " + std::to_string(v) + " is outside [" +
                             std::to_string(lo) + ", " + std::to_string(hi) + "]"};
  return v;
}

int64_t int_field(const json& j, const char* name, int64_t def, int64_t lo, int64_t hi) {
  if (!j.contains(name) || j[name].is_null()) return def;
  if (!j[name].is_number_integer() && !j[name].is_number_unsigned())
    throw HttpError{400, std::string("field '") + name + "' must be an integer"};
  // An unsigned value past INT64_MAX would wrap to a negative one.
  const int64_t v = j[name].is_number_unsigned() && j[name].get<uint64_t>() > uint64_t(INT64_MAX)
                        ? INT64_MAX
                        : j[name].get<int64_t>();
  if (v < lo || v > hi)
    throw HttpError{400, std::string("field '") + name + "' = " + std::to_string(v) + " is outside [" +
                             std::to_string(lo) + ", " + std::to_string(hi) + "]"};
  return v;
}

std::string text_of(const json& v, const std::string& what) {
  if (v.is_string()) return v.get<std::string>();
  // OpenAI content parts: [{"type": "text", "text": "..."}]
  if (v.is_array()) {
    std::string out;
    for (const auto& part : v) {
      // Each member's type is checked before it is read: json::value() throws
      // a type_error (a 500, not a 400) on a "type" that is not a string.
      if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
          !part["text"].is_string())
        throw HttpError{400, what + ": only text content parts are supported"};
      out += part["text"].get<std::string>();
    }
    return out;
  }
  throw HttpError{400, what + " must be a string"};
}

}  // namespace

json parse_body(const std::string& body) {
  if (body.empty()) throw HttpError{400, "request body is empty; expected a JSON object"};
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers such as 1e400
    throw HttpError{400, std::string("invalid JSON: ") + e.what()};
  }
  if (!j.is_object()) throw HttpError{400, std::string("request body must be a JSON object, got ") + j.type_name()};
  return j;
}


// A plain transcript of body["messages"]: the shipped model has no chat
// template. Each turn is "<role>: <content>\n" (no added space when the
// content starts with whitespace); it ends with "assistant:" for the reply.
// Throws HttpError naming the bad message.
std::string chat_transcript(const json& j) {
  if (!j.contains("messages") || !j["messages"].is_array() || j["messages"].empty())
    throw HttpError{400, "field 'messages' must be a non-empty array"};
  std::string text;
  for (size_t i = 0; i < j["messages"].size(); ++i) {
    const json& m = j["messages"][i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content"))
      throw HttpError{400, where + " must be an object with 'role' and 'content'"};
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant")
      throw HttpError{400, where + ".role '" + role + "' is not one of system, user, assistant"};
    // The separating space is left out when the content already starts
    // with whitespace: the model's replies usually do (the prompt ends with
    // "assistant:"), and a reply sent back must re-tokenize to the tokens
    // it was generated as, or the prefix store cannot reuse them.
    const std::string content = text_of(m["content"], where + ".content");
    const bool spaced = !content.empty() && (content[0] == ' ' || content[0] == '\n' || content[0] == '\t');
    text += role + ":" + (spaced ? "" : " ") + content + "\n";
  }
  return text + "assistant:";
}

// Refuses, before any tokenizing, a prompt text that cannot fit: its bytes
// exceed max_prompt tokens of the longest token each.
void check_prompt_bytes(const ServerState& s, size_t bytes) {
  if (bytes > s.max_prompt_bytes)
    throw HttpError{400, "prompt is " + std::to_string(bytes) + " bytes; this server takes at most " +
                             std::to_string(s.max_prompt_bytes) + " bytes (max prompt tokens " +
                             std::to_string(s.max_prompt) + " x the longest token, " +
                             std::to_string(s.tok->max_token_bytes()) + " bytes)"};
}

namespace {

void check_prompt_tokens(const ServerState& s, size_t n) {
  if (int64_t(n) > s.max_prompt)
    throw HttpError{400, "prompt is " + std::to_string(n) + " tokens; this server takes at most " +
                             std::to_string(s.max_prompt)};
}

}  // namespace

// The token ids of a /tokenize body: a prompt string or a chat's messages.
std::vector<int32_t> parse_tokenize(const ServerState& s, const json& j) {
  for (const auto& [key, value] : j.items()) {
    (void)value;
    if (key != "prompt" && key != "messages" && key != "model")
      throw HttpError{400, "unknown or unsupported field '" + key + "'"};
  }
  if (j.contains("prompt") == j.contains("messages"))
    throw HttpError{400, "give exactly one of 'prompt' (a string) and 'messages'"};
  std::string text;
  if (j.contains("messages")) text = chat_transcript(j);
  else if (j["prompt"].is_string()) text = j["prompt"].get<std::string>();
  else throw HttpError{400, "field 'prompt' must be a string"};
  check_prompt_bytes(s, text.size());
  return s.tok->encode(text);
}

// Builds the job from an OpenAI request body; throws HttpError for anything wrong.
std::shared_ptr<Job> parse_request(ServerState& s, const json& j, bool chat) {
  static const std::set<std::string> common = {"model", "max_tokens", "max_completion_tokens", "temperature",
                                               "top_p", "seed", "stream", "stream_options", "stop", "n", "user",
                                               "logprobs", "top_logprobs", "echo"};
  for (const auto& [key, value] : j.items()) {
    (void)value;
    if (common.count(key)) continue;
    if (chat && key == "messages") continue;
    if (!chat && key == "prompt") continue;
    throw HttpError{400, "unknown or unsupported field '" + key + "'"};
  }
  if (j.contains("model") && !j["model"].is_null()) {
    if (!j["model"].is_string()) throw HttpError{400, "field 'model' must be a string"};
    const std::string m = j["model"].get<std::string>();
    if (m != s.model_name) throw HttpError{404, "model '" + m + "' is not served here (this server serves '" + s.model_name + "')", "model_not_found"};
  }
  if (int_field(j, "n", 1, 1, 1) != 1) throw HttpError{400, "field 'n' must be 1"};
  auto job = std::make_shared<Job>();
  job->chat = chat;
  try {
    job->logprobs = parse_logprobs(j, chat);
  } catch (const Error& e) {
    throw HttpError{400, e.what()};
  }
  std::string text;
  if (chat) {
    text = chat_transcript(j);
  } else {
    if (!j.contains("prompt")) throw HttpError{400, "field 'prompt' is required"};
    const json& p = j["prompt"];
    if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
      // Token ids, as OpenAI allows.
      check_prompt_tokens(s, p.size());
      for (const auto& t : p) {
        if (!t.is_number_integer()) throw HttpError{400, "field 'prompt': a token array must hold only integers"};
        const int64_t id = t.get<int64_t>();
        if (id < 0 || id >= s.model->config().vocab_size)
          throw HttpError{400, "field 'prompt': token " + std::to_string(id) + " is outside the vocabulary [0, " +
                                   std::to_string(s.model->config().vocab_size) + ")"};
        job->prompt.push_back(int32_t(id));
      }
    } else if (p.is_string()) {
      text = p.get<std::string>();
    } else {
      throw HttpError{400, "field 'prompt' must be a string or an array of token ids"};
    }
  }
  if (job->prompt.empty()) {
    check_prompt_bytes(s, text.size());
    job->prompt = s.tok->encode(text);
  }
  if (job->prompt.empty()) {
    const auto& c = s.model->config();
    job->prompt.push_back(c.bos_token_id >= 0 ? c.bos_token_id : std::max(0, c.eos_token_id));
  }
  check_prompt_tokens(s, job->prompt.size());
  if (job->logprobs.echo)
    for (int32_t t : job->prompt) job->echo_text += s.tok->token_bytes(t);
  const char* max_name = j.contains("max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  job->gen.max_tokens = int_field(j, max_name, s.opt.default_max_tokens, 0, s.opt.max_tokens_limit);
  const int64_t context = s.model->config().max_position_embeddings;
  if (context > 0 && int64_t(job->prompt.size()) + job->gen.max_tokens > context)
    job->gen.max_tokens = std::max<int64_t>(0, context - int64_t(job->prompt.size()));
  job->gen.sampling.temperature = number_field(j, "temperature", 0.0, 0.0, 100.0);
  job->gen.sampling.top_p = number_field(j, "top_p", 1.0, 1e-9, 1.0);
  job->gen.sampling.seed = uint64_t(int_field(j, "seed", 0, 0, INT64_MAX));
  job->gen.eos_token = s.model->config().eos_token_id;
  if (j.contains("stream") && !j["stream"].is_null()) {
    if (!j["stream"].is_boolean()) throw HttpError{400, "field 'stream' must be a boolean"};
    job->stream = j["stream"].get<bool>();
  }
  if (j.contains("stream_options") && !j["stream_options"].is_null()) {
    const json& so = j["stream_options"];
    if (!so.is_object()) throw HttpError{400, "field 'stream_options' must be an object"};
    if (so.contains("include_usage") && !so["include_usage"].is_null()) {
      if (!so["include_usage"].is_boolean())
        throw HttpError{400, "field 'stream_options.include_usage' must be a boolean"};
      job->include_usage = so["include_usage"].get<bool>();
    }
  }
  if (j.contains("stop") && !j["stop"].is_null()) {
    const json& st = j["stop"];
    if (st.is_string()) job->stop.push_back(st.get<std::string>());
    else if (st.is_array() && st.size() <= 4) {
      for (const auto& x : st) {
        if (!x.is_string()) throw HttpError{400, "field 'stop' must hold strings"};
        job->stop.push_back(x.get<std::string>());
      }
    } else {
      throw HttpError{400, "field 'stop' must be a string or an array of at most 4 strings"};
    }
    for (const auto& x : job->stop)
      if (x.empty()) throw HttpError{400, "field 'stop' must not hold an empty string"};
  }
  return job;
}

}  // namespace kvcodec::server

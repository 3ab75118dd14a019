#include "server/logprobs.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "kvcodec/error.hpp"
#include "model/eval.hpp"

namespace kvcodec::server {
namespace {

using json = nlohmann::json;

constexpr int kMaxCompletionTop = 5;  // OpenAI's limits
constexpr int kMaxChatTop = 20;

[[noreturn]] void bad(const std::string& message) { throw Error(ErrorCode::kInvalidArgument, message); }

bool present(const json& j, const char* name) { return j.contains(name) && !j[name].is_null(); }

int top_count(const json& j, const char* name, int hi) {
  const json& v = j[name];
  if (!v.is_number_integer() && !v.is_number_unsigned()) bad(std::string("field '") + name + "' must be an integer");
  const int64_t n = v.get<int64_t>();
  if (n < 0 || n > hi)
    bad(std::string("field '") + name + "' = " + std::to_string(n) + " is outside [0, " + std::to_string(hi) + "]");
  return int(n);
}

// Best first; lower id among equal logprobs, so results do not depend on the sort.
bool better(const std::pair<int32_t, double>& a, const std::pair<int32_t, double>& b) {
  return a.second != b.second ? a.second > b.second : a.first < b.first;
}

json bytes_of(const std::string& s) {
  json out = json::array();
  for (unsigned char c : s) out.push_back(int(c));
  return out;
}

}  // namespace

LogprobRequest parse_logprobs(const json& j, bool chat) {
  LogprobRequest r;
  if (chat) {
    if (present(j, "echo")) bad("field 'echo' is not supported on chat completions");
    if (present(j, "logprobs")) {
      if (!j["logprobs"].is_boolean()) bad("field 'logprobs' must be a boolean on chat completions");
      r.enabled = j["logprobs"].get<bool>();
    }
    if (present(j, "top_logprobs")) {
      r.top = top_count(j, "top_logprobs", kMaxChatTop);
      if (!r.enabled) bad("field 'top_logprobs' needs 'logprobs': true");
    }
    return r;
  }
  if (present(j, "top_logprobs")) bad("field 'top_logprobs' is a chat field; completions take 'logprobs' (0..5)");
  if (present(j, "logprobs")) {
    r.enabled = true;
    r.top = top_count(j, "logprobs", kMaxCompletionTop);
  }
  if (present(j, "echo")) {
    if (!j["echo"].is_boolean()) bad("field 'echo' must be a boolean");
    r.echo = j["echo"].get<bool>();
  }
  return r;
}

TokenLogprob token_logprob(const float* logits, int vocab, int32_t token, int top) {
  double mx = logits[0];
  for (int i = 1; i < vocab; ++i) mx = std::max(mx, double(logits[i]));
  double sum = 0.0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(double(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  TokenLogprob r;
  r.token = token;
  r.logprob = double(logits[token]) - lse;
  if (top <= 0) return r;
  // Candidates by raw logit (the order log_softmax keeps), then the best `top`.
  std::vector<std::pair<int32_t, double>> all(static_cast<size_t>(vocab));
  for (int i = 0; i < vocab; ++i) all[size_t(i)] = {i, double(logits[i])};
  const size_t k = std::min(size_t(top), all.size());
  std::partial_sort(all.begin(), all.begin() + k, all.end(), better);
  for (size_t i = 0; i < k; ++i) r.top.push_back({all[i].first, all[i].second - lse});
  return r;
}

TokenLogprob token_logprob_reference(const float* logits, int vocab, int32_t token, int top) {
  std::vector<double> lp;
  model::log_softmax(logits, vocab, lp);
  TokenLogprob r;
  r.token = token;
  r.logprob = lp[size_t(token)];
  std::vector<std::pair<int32_t, double>> all;
  for (int i = 0; i < vocab; ++i) all.push_back({i, lp[size_t(i)]});
  std::stable_sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  for (int i = 0; i < std::min(top, vocab); ++i) r.top.push_back(all[size_t(i)]);
  return r;
}

json completion_logprobs(const model::Tokenizer& tok, const std::vector<TokenLogprob>& entries) {
  json tokens = json::array(), values = json::array(), tops = json::array(), offsets = json::array();
  for (const TokenLogprob& e : entries) {
    tokens.push_back(tok.token_bytes(e.token));
    offsets.push_back(e.text_offset);
    if (!e.logprob) {
      values.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    values.push_back(*e.logprob);
    json alternatives = json::object();
    for (const auto& [id, lp] : e.top) alternatives[tok.token_bytes(id)] = lp;
    tops.push_back(alternatives);
  }
  return {{"tokens", tokens}, {"token_logprobs", values}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

json chat_logprobs(const model::Tokenizer& tok, const std::vector<TokenLogprob>& entries) {
  json content = json::array();
  for (const TokenLogprob& e : entries) {
    json alternatives = json::array();
    for (const auto& [id, lp] : e.top)
      alternatives.push_back({{"token", tok.token_bytes(id)}, {"logprob", lp}, {"bytes", bytes_of(tok.token_bytes(id))}});
    const std::string& text = tok.token_bytes(e.token);
    content.push_back({{"token", text}, {"logprob", e.logprob ? json(*e.logprob) : json(nullptr)},
                       {"bytes", bytes_of(text)}, {"top_logprobs", alternatives}});
  }
  return {{"content", content}};
}

}  // namespace kvcodec::server

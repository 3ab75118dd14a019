// Per-token log-probabilities for scoring through the server: the
// `logprobs` / `top_logprobs` / `echo` fields of the OpenAI completions and
// chat APIs (docs/server.md, "Logprobs").
//
// A log-probability is log_softmax of the model's raw logits (temperature
// 1, no sampling penalty) in double precision, the quantity `kvcodec eval`
// scores (model::log_softmax), so a harness summing echoed prompt
// logprobs gets the log-likelihood eval reports for the same tokens.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>
#include <vector>

#include "model/tokenizer.hpp"

namespace kvcodec::server {

// What a request asked for; parsed (and range-checked) by parse_logprobs().
struct LogprobRequest {
  bool enabled = false;  // completions: `logprobs` given; chat: `logprobs: true`
  int top = 0;           // alternatives per token: completions `logprobs`, chat `top_logprobs`
  bool echo = false;     // completions: the prompt is returned (text, and logprobs when enabled)
};

struct TokenLogprob {
  int32_t token = 0;
  std::optional<double> logprob;                 // empty for the first echoed prompt token (nothing predicts it)
  std::vector<std::pair<int32_t, double>> top;   // the most likely tokens, best first (lower id among equals)
  size_t text_offset = 0;                        // byte offset of the token's text in the choice's text
};

// Reads `logprobs`, `top_logprobs` and `echo` of a request body. Completions:
// logprobs an integer 0..5, echo a boolean; chat: logprobs a boolean,
// top_logprobs 0..20 (only with logprobs: true), no echo. Throws
// Error(kInvalidArgument) naming the field; the caller answers 400.
LogprobRequest parse_logprobs(const nlohmann::json& body, bool chat);

// The log-probability of `token` under one logits row [vocab], and the `top`
// most likely tokens. Fast path: one log-sum-exp pass and a partial sort.
TokenLogprob token_logprob(const float* logits, int vocab, int32_t token, int top);
// The same by the plain definition (full log_softmax, full stable sort), for tests.
TokenLogprob token_logprob_reference(const float* logits, int vocab, int32_t token, int top);

// choices[].logprobs of the legacy completions API:
// {tokens, token_logprobs, top_logprobs, text_offset}; a first echoed token
// has null token_logprobs and top_logprobs entries.
nlohmann::json completion_logprobs(const model::Tokenizer& tok, const std::vector<TokenLogprob>& entries);
// choices[].logprobs of the chat API: {content: [{token, logprob, bytes, top_logprobs}]}.
nlohmann::json chat_logprobs(const model::Tokenizer& tok, const std::vector<TokenLogprob>& entries);

}  // namespace kvcodec::server

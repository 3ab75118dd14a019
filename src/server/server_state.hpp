// The state the server's parts share (internal to src/server): the
// process-wide ServerState, one Job per generation request, the HTTP error
// type and the JSON helpers. The parts: request.cpp (bodies -> jobs),
// completions.cpp (the /v1/completions and chat handlers and their
// responses), logprobs.cpp, auth.cpp, server.cpp (the model thread, stats,
// start-up).
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "kvcodec/cache.hpp"
#include "model/generate.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"
#include "server/logprobs.hpp"
#include "server/prefix_store.hpp"
#include "server/server.hpp"

namespace kvcodec::server {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

inline std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// A request the client got wrong: answered with `status` and a JSON error.
struct HttpError {
  int status;
  std::string message;
  std::string type = "invalid_request_error";
};

inline json error_body(const std::string& message, const std::string& type, int status) {
  return {{"error", {{"message", message}, {"type", type}, {"code", status}}}};
}

inline void send_error(httplib::Response& res, int status, const std::string& message,
                const std::string& type = "invalid_request_error") {
  res.status = status;
  res.set_content(dump(error_body(message, type, status)), "application/json");
}

// Thrown from the token callback to end generation early.
struct StopGeneration {};

// One generation request, shared by the HTTP thread that owns the client
// and the model thread.
struct Job {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;
  std::vector<int32_t> prompt;
  model::GenerateOptions gen;
  std::vector<std::string> stop;
  std::string id;
  int64_t created = 0;
  Clock::time_point arrived = Clock::now();

  std::mutex mu;
  std::condition_variable cv;
  LogprobRequest logprobs;
  std::string echo_text;           // echo: the prompt's text, returned before the reply

  // Text not yet sent (streaming), with the logprobs of the tokens whose
  // text it ends (a token's text may be held back across pieces).
  struct Piece {
    std::string text;
    std::vector<TokenLogprob> logprobs;
  };
  std::deque<Piece> pieces;
  std::string text;                // all text so far
  std::vector<TokenLogprob> prompt_logprobs;  // echo + logprobs: one per prompt token
  std::vector<TokenLogprob> reply_logprobs;   // logprobs: one per token whose text is in the reply
  bool done = false;
  std::optional<std::string> error;
  std::string finish_reason = "length";
  int64_t completion_tokens = 0;
  int64_t reused_tokens = 0;
  double prefix_load_ms = 0.0;  // looking up, decoding and trimming the stored caches
  double ttft_ms = 0.0;
  std::atomic<bool> cancelled{false};
};

struct ServerState {
  ServeOptions opt;
  std::string model_name;
  std::string model_identity;  // model::model_identity(): part of the prefix-store scope
  std::unique_ptr<model::LlamaModel> model;
  std::unique_ptr<model::Tokenizer> tok;
  Settings settings;
  std::string scope;
  std::unique_ptr<PrefixStore> store;
  std::ostream* log = nullptr;
  std::mutex log_mu;          // the model and signal threads both write the log
  uint64_t store_failures_logged = 0;  // model thread only
  int64_t max_prompt = 0;
  // A text longer than this cannot fit in max_prompt tokens (no token is
  // longer than the tokenizer's longest), so it is refused before tokenizing.
  uint64_t max_prompt_bytes = 0;
  Clock::time_point started = Clock::now();
  std::atomic<int> model_threads{0};  // OpenMP threads the model thread uses (stats)

  std::mutex mu;  // guards everything below
  std::condition_variable cv;
  std::deque<std::shared_ptr<Job>> queue;
  bool busy = false;
  bool draining = false;
  bool stopping = false;
  uint64_t served = 0, rejected_full = 0, cancelled = 0, failed = 0, next_id = 1;
  uint64_t tokens_seen = 0;
  CacheStats last;  // caches of the last finished request, summed over layers
  std::vector<CacheStats> last_layers;  // the same, one per layer
  struct Finished {
    double at_s;       // since start-up, when it finished
    double ttft_ms;
    int64_t reused_tokens;
  };
  std::deque<Finished> recent;  // the last kRecent requests served, newest last
  static constexpr size_t kRecent = 64;
};

// Request parsing (request.cpp); each throws HttpError naming what is wrong.
json parse_body(const std::string& body);
std::string chat_transcript(const json& body);
void check_prompt_bytes(const ServerState& s, size_t bytes);
std::shared_ptr<Job> parse_request(ServerState& s, const json& body, bool chat);
// The body of POST /tokenize -> the prompt's token ids (runs on an HTTP thread).
std::vector<int32_t> parse_tokenize(const ServerState& s, const json& body);

// The generation endpoints (completions.cpp): parse, queue, answer (JSON or SSE).
void handle_generate(ServerState& s, const httplib::Request& req, httplib::Response& res, bool chat);

// One "kvcodec serve: ..." line on the server's log (server.cpp).
void log_line(ServerState& s, const std::string& line);

}  // namespace kvcodec::server

// The /v1/completions and /v1/chat/completions handlers: a parsed Job is
// queued for the model thread; the handler answers with one JSON response or
// streams server-sent events in the OpenAI chunk format.
#include "server/connection.hpp"
#include "server/server_state.hpp"

namespace kvcodec::server {
namespace {

json usage_of(const Job& job) {
  return {{"prompt_tokens", job.prompt.size()},
          {"completion_tokens", job.completion_tokens},
          {"total_tokens", int64_t(job.prompt.size()) + job.completion_tokens}};
}

json kvcodec_extra(const Job& job) {
  return {{"reused_prompt_tokens", job.reused_tokens}, {"ttft_ms", job.ttft_ms}, {"prefix_load_ms", job.prefix_load_ms}};
}

// choices[].logprobs for these entries: null unless the request asked.
json logprobs_json(const ServerState& s, const Job& job, const std::vector<TokenLogprob>& entries) {
  if (!job.logprobs.enabled) return nullptr;
  return job.chat ? chat_logprobs(*s.tok, entries) : completion_logprobs(*s.tok, entries);
}

json final_response(const ServerState& s, const Job& job) {
  json choice = {{"index", 0}, {"finish_reason", job.finish_reason}};
  std::vector<TokenLogprob> entries = job.prompt_logprobs;
  entries.insert(entries.end(), job.reply_logprobs.begin(), job.reply_logprobs.end());
  choice["logprobs"] = logprobs_json(s, job, entries);
  if (job.chat) choice["message"] = {{"role", "assistant"}, {"content", job.text}};
  else choice["text"] = job.logprobs.echo ? job.echo_text + job.text : job.text;
  return {{"id", job.id},
          {"object", job.chat ? "chat.completion" : "text_completion"},
          {"created", job.created},
          {"model", s.model_name},
          {"choices", json::array({choice})},
          {"usage", usage_of(job)},
          {"kvcodec", kvcodec_extra(job)}};
}

std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }

json chunk(const ServerState& s, const Job& job, const json& delta_or_text, const json& finish,
           const json& logprobs = nullptr) {
  json choice = {{"index", 0}, {"finish_reason", finish}, {"logprobs", logprobs}};
  if (job.chat) choice["delta"] = delta_or_text;
  else choice["text"] = delta_or_text;
  return {{"id", job.id},
          {"object", job.chat ? "chat.completion.chunk" : "text_completion"},
          {"created", job.created},
          {"model", s.model_name},
          {"choices", json::array({choice})}};
}

// Queues the job, or throws HttpError 503 when the queue is full or the server drains.
void enqueue(ServerState& s, const std::shared_ptr<Job>& job, bool chat) {
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.draining) throw HttpError{503, "server is shutting down", "unavailable"};
  if (s.queue.size() >= s.opt.max_queue) {
    ++s.rejected_full;
    throw HttpError{503, "request queue is full (" + std::to_string(s.opt.max_queue) + " waiting); retry later",
                    "overloaded"};
  }
  job->id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(s.next_id++);
  job->created = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  s.queue.push_back(job);
  s.cv.notify_all();
}

}  // namespace

void handle_generate(ServerState& s, const httplib::Request& req, httplib::Response& res, bool chat) {
  std::shared_ptr<Job> job;
  try {
    job = parse_request(s, parse_body(req.body), chat);
    enqueue(s, job, chat);
  } catch (const HttpError& e) {
    // Queue full or draining: tell well-behaved clients when to come back
    // (one model request takes about a second or more on this model).
    if (e.status == 503) res.set_header("Retry-After", "1");
    send_error(res, e.status, e.message, e.type);
    return;
  }
  if (!job->stream) {
    // Check on the client every 200 ms while the job waits or runs: when it
    // has gone, the model thread stops at the next token (or skips the job).
    const int fd = find_connection_fd(req.remote_addr, req.remote_port, req.local_port);
    std::unique_lock<std::mutex> lock(job->mu);
    while (!job->cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return job->done; }))
      if (fd >= 0 && !job->cancelled.load() && peer_closed(fd)) job->cancelled = true;
    if (job->error) {
      lock.unlock();
      send_error(res, 500, *job->error, "server_error");
      return;
    }
    lock.unlock();
    res.set_content(dump(final_response(s, *job)), "application/json");
    return;
  }
  res.set_header("Cache-Control", "no-cache");
  ServerState* sp = &s;
  res.set_chunked_content_provider(
      "text/event-stream",
      [sp, job, sent_role = false](size_t, httplib::DataSink& sink) mutable {
        auto write = [&](const std::string& text) {
          if (!sink.is_writable() || !sink.write(text.data(), text.size())) {
            job->cancelled = true;  // the client went away: the model thread stops at the next token
            return false;
          }
          return true;
        };
        if (job->chat && !sent_role) {
          sent_role = true;
          if (!write(sse(chunk(*sp, *job, {{"role", "assistant"}, {"content", ""}}, nullptr)))) return false;
        }
        std::unique_lock<std::mutex> lock(job->mu);
        job->cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return job->done || !job->pieces.empty(); });
        std::deque<Job::Piece> pieces;
        pieces.swap(job->pieces);
        const bool done = job->done;
        lock.unlock();
        for (const auto& p : pieces) {
          const json body = job->chat ? json{{"content", p.text}} : json(p.text);
          if (!write(sse(chunk(*sp, *job, body, nullptr, logprobs_json(*sp, *job, p.logprobs))))) return false;
        }
        if (!done) {
          // Nothing new: probe the connection so a vanished client is noticed.
          if (pieces.empty() && !sink.is_writable()) {
            job->cancelled = true;
            return false;
          }
          return true;
        }
        if (job->error) {
          if (!write(sse(error_body(*job->error, "server_error", 500)))) return false;
        } else {
          if (!write(sse(chunk(*sp, *job, job->chat ? json::object() : json(""), job->finish_reason)))) return false;
          if (job->include_usage) {
            json u = chunk(*sp, *job, job->chat ? json::object() : json(""), nullptr);
            u["choices"] = json::array();
            u["usage"] = usage_of(*job);
            u["kvcodec"] = kvcodec_extra(*job);
            if (!write(sse(u))) return false;
          }
        }
        if (!write("data: [DONE]\n\n")) return false;
        sink.done();
        return true;
      },
      [job](bool success) {
        if (!success) job->cancelled = true;
      });
}

}  // namespace kvcodec::server

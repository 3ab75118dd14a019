#include "server/server.hpp"

#include <httplib.h>
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"
#include "model/calibrate.hpp"
#include "model/generate.hpp"
#include "model/identity.hpp"
#include "model/llama.hpp"
#include "model/paths.hpp"
#include "model/tokenizer.hpp"
#include "server/auth.hpp"
#include "server/prefix_store.hpp"
#include "server/server_state.hpp"

namespace kvcodec::server {

void log_line(ServerState& s, const std::string& line) {
  std::lock_guard<std::mutex> lock(s.log_mu);
  if (s.log) *s.log << "kvcodec serve: " << line << std::endl;
}

namespace {

// Connections the kernel queues for the accept thread (see run_server).
constexpr int kListenBacklog = 512;

const char kDashboardHtml[] =
#include "dashboard_html.inc"
    ;

// --- the model thread ------------------------------------------------------------

// Logs store failures counted since the last call (the counters are in the
// stats; the log says what happened). Model thread only.
void log_store_failures(ServerState& s) {
  const PrefixStoreStats st = s.store->stats();
  if (st.failures() == s.store_failures_logged) return;
  log_line(s, "prefix store: " + std::to_string(st.failures() - s.store_failures_logged) +
                  " failure(s) (request answered without the store): " + st.last_failure);
  s.store_failures_logged = st.failures();
}

// Streaming: hands a piece of text, with the logprobs of the tokens it
// completes, to the HTTP thread.
void push_piece(Job& job, Job::Piece piece) {
  if (piece.text.empty() && piece.logprobs.empty()) return;
  std::lock_guard<std::mutex> lock(job.mu);
  job.pieces.push_back(std::move(piece));
  job.cv.notify_all();
}

// Echo with logprobs: the prompt's tokens with the logprob of each given
// the ones before (the first has none). Feeds all but the last prompt token
// (generation feeds that one; its logits give the first reply token), in
// chunks so the logits held stay [chunk, vocab].
void score_prompt(ServerState& s, model::Session& session, Job& job) {
  constexpr int64_t kChunk = 256;
  const int vocab = s.model->config().vocab_size;
  const int64_t n = int64_t(job.prompt.size());
  size_t offset = 0;
  job.prompt_logprobs.push_back({job.prompt[0], std::nullopt, {}, 0});
  offset += s.tok->token_bytes(job.prompt[0]).size();
  std::vector<float> logits;
  for (int64_t start = 0; start + 1 < n; start += kChunk) {
    const int64_t m = std::min(kChunk, n - 1 - start);
    session.forward(job.prompt.data() + start, m, logits, true);
    for (int64_t i = 0; i < m; ++i) {
      const int32_t t = job.prompt[size_t(start + i + 1)];
      TokenLogprob e = token_logprob(logits.data() + i * vocab, vocab, t, job.logprobs.top);
      e.text_offset = offset;
      offset += s.tok->token_bytes(t).size();
      job.prompt_logprobs.push_back(std::move(e));
    }
  }
}

void run_job(ServerState& s, Job& job) {
  const auto& cfg = s.model->config();
  const int64_t n = int64_t(job.prompt.size());
  // Reuse: the longest stored prefix, leaving at least one prompt token to
  // prefill (its logits give the first generated token).
  // Echo with logprobs needs the logits of every prompt position, which a
  // reused prefix does not have: such a request computes its whole prompt.
  const bool score = job.logprobs.echo && job.logprobs.enabled;
  const Clock::time_point load_start = Clock::now();
  std::optional<PrefixMatch> match;
  if (s.store && !score) {
    try {
      match = s.store->lookup(job.prompt.data(), n, n - 1);
    } catch (const std::exception& e) {  // a store problem is a miss, never a failed request
      log_line(s, std::string("prefix store: lookup failed: ") + e.what());
    }
    log_store_failures(s);
  }
  model::CacheFactory factory;
  if (match) {
    const auto& entry = match->entry;
    if (int64_t(entry.layers.size()) != cfg.n_layers) match.reset();
  }
  if (match) {
    const PrefixEntry* entry = &match->entry;
    const int64_t drop = int64_t(entry->tokens.size()) - match->matched_tokens;
    factory = [entry, drop](const CacheConfig& cc) {
      const auto& bytes = entry->layers[size_t(cc.layer)];
      std::unique_ptr<KVCache> cache = load_cache(bytes.data(), bytes.size());
      if (cache->config().n_kv_heads != cc.n_kv_heads || cache->config().head_dim != cc.head_dim)
        throw Error(ErrorCode::kShapeMismatch, "prefix entry layer " + std::to_string(cc.layer) + " has another shape");
      if (drop > 0 && cache->trim(drop) != drop)
        throw Error(ErrorCode::kFormat, "prefix entry layer " + std::to_string(cc.layer) + " could not be trimmed");
      return cache;
    };
  } else {
    factory = model::method_cache_factory(s.opt.method, s.settings);
  }
  std::unique_ptr<model::Session> session;
  try {
    session = std::make_unique<model::Session>(*s.model, factory);
  } catch (const Error&) {
    if (!match) throw;
    // A stored entry that does not load is not served: start from scratch.
    match.reset();
    session = std::make_unique<model::Session>(*s.model, model::method_cache_factory(s.opt.method, s.settings));
  }
  const int64_t reused = session->position();
  job.reused_tokens = reused;
  job.prefix_load_ms = match ? ms_since(load_start) : 0.0;
  std::vector<int32_t> rest(job.prompt.begin() + reused, job.prompt.end());
  if (score) {
    score_prompt(s, *session, job);
    rest.assign(1, job.prompt.back());
  }
  if (job.stream && job.logprobs.echo) push_piece(job, {job.echo_text, job.prompt_logprobs});
  const int vocab = cfg.vocab_size;
  size_t offset = job.logprobs.echo ? job.echo_text.size() : 0;  // of the next reply token in the choice's text
  std::vector<TokenLogprob> pending;  // streaming: logprobs of tokens whose text is not yet sent

  std::string held;  // bytes waiting for the rest of a UTF-8 character or a possible stop string
  size_t max_stop = 0;
  for (const auto& x : job.stop) max_stop = std::max(max_stop, x.size());
  std::vector<int32_t> generated;
  auto emit = [&](bool final) {
    // Hold back what could still become a stop string, and partial characters.
    size_t keep = final ? 0 : std::min(held.size(), max_stop > 0 ? max_stop - 1 : 0);
    size_t cut = held.size() - keep;
    cut = utf8_complete_prefix(held.substr(0, cut));
    if (final) cut = held.size();
    const std::string piece = held.substr(0, cut);
    held.erase(0, cut);
    {
      std::lock_guard<std::mutex> lock(job.mu);
      job.text += piece;
    }
    if (job.stream && (!piece.empty() || final)) {
      push_piece(job, {piece, std::move(pending)});
      pending.clear();
    }
  };
  bool stopped = false;
  try {
    model::generate_with_logits(*session, rest, job.gen, [&](int32_t t, const float* logits) {
      if (generated.empty()) job.ttft_ms = ms_since(job.arrived);
      generated.push_back(t);
      if (job.cancelled.load()) throw StopGeneration{};
      if (t == job.gen.eos_token) return;
      held += s.tok->token_bytes(t);
      for (const auto& x : job.stop) {
        const size_t at = held.find(x);
        if (at != std::string::npos) {
          held.erase(at);
          stopped = true;
          throw StopGeneration{};
        }
      }
      // Logprobs of the tokens whose text is in the reply (not EOS, not the one completing a stop string).
      if (job.logprobs.enabled) {
        TokenLogprob e = token_logprob(logits, vocab, t, job.logprobs.top);
        e.text_offset = offset;
        if (job.stream) pending.push_back(e);
        job.reply_logprobs.push_back(std::move(e));
      }
      offset += s.tok->token_bytes(t).size();
      emit(false);
    });
  } catch (const StopGeneration&) {
  }
  emit(true);
  if (generated.empty()) job.ttft_ms = ms_since(job.arrived);  // max_tokens 0: the answer is ready after the prefill
  job.completion_tokens = int64_t(generated.size());
  if (stopped || (!generated.empty() && generated.back() == job.gen.eos_token)) job.finish_reason = "stop";

  // Telemetry of this request's caches, then keep them in the store.
  const CacheStats st = session->cache_stats();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.last = st;
    s.last_layers.clear();
    for (const auto& c : session->caches()) s.last_layers.push_back(c->stats());
    s.tokens_seen += uint64_t(session->position());
  }
  if (s.store && !job.cancelled.load()) {
    // Keep the caches as they are after generation, reply tokens included
    // (the last generated token was never fed, so it is not in them), keyed
    // by the token ids actually in the caches. The next turn of a
    // conversation sends the reply back as text; where its re-tokenization
    // or the new message diverges, lookup() extends the match token by
    // token, so everything shared is reused, not just whole blocks.
    const int64_t pos = session->position();
    if (pos >= s.store->block() && pos > reused) {
      std::vector<int32_t> fed(job.prompt);
      fed.insert(fed.end(), generated.begin(), generated.end());
      fed.resize(size_t(pos));
      PrefixEntry e;
      e.scope = s.scope;
      e.tokens = std::move(fed);
      e.bytes = {st.compressed_key_bytes, st.compressed_value_bytes, st.fp16_key_bytes, st.fp16_value_bytes};
      try {
        for (const auto& c : session->caches()) e.layers.push_back(c->save());
        s.store->put(e);
      } catch (const std::exception& ex) {  // the answer is ready: a store problem must not turn it into a 500
        log_line(s, std::string("prefix store: storing failed: ") + ex.what());
      }
      log_store_failures(s);
    }
  }
}

void worker_loop(ServerState& s) {
  // OpenMP's thread count is per thread: set on the main thread it would not
  // reach this one, and the model would fork a team of every core (measured:
  // with --threads 1 ignored, half the CPU time went to libgomp barrier
  // spinning on the loaded 2-core machine, and TTFT of a 5-token prefill over
  // 1441 cached tokens was ~1.2 s).
  if (s.opt.threads > 0) omp_set_num_threads(s.opt.threads);
  s.model_threads = omp_get_max_threads();
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(s.mu);
      s.cv.wait(lock, [&] { return s.stopping || !s.queue.empty(); });
      if (s.queue.empty()) return;  // stopping and nothing left
      job = s.queue.front();
      s.queue.pop_front();
      s.busy = true;
    }
    bool ok = false;
    if (!job->cancelled.load()) {
      try {
        run_job(s, *job);
        ok = true;
      } catch (const Error& e) {
        std::lock_guard<std::mutex> lock(job->mu);
        job->error = std::string(e.what());
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(job->mu);
        job->error = std::string("internal error: ") + e.what();
      }
    }
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.busy = false;
      if (job->cancelled.load()) ++s.cancelled;
      else if (ok) {
        ++s.served;
        const double at_s = std::chrono::duration<double>(Clock::now() - s.started).count();
        s.recent.push_back({at_s, job->ttft_ms, job->reused_tokens});
        if (s.recent.size() > ServerState::kRecent) s.recent.pop_front();
      } else {
        ++s.failed;
      }
      s.cv.notify_all();
    }
    {
      std::lock_guard<std::mutex> lock(job->mu);
      job->done = true;
      job->cv.notify_all();
    }
  }
}

json cache_stats_json(uint64_t ck, uint64_t cv, uint64_t fk, uint64_t fv) {
  auto part = [](uint64_t c, uint64_t f) {
    return json{{"compressed_bytes", c}, {"fp16_bytes", f}, {"ratio", c ? double(f) / double(c) : 0.0}};
  };
  return {{"key", part(ck, fk)}, {"value", part(cv, fv)}, {"total", part(ck + cv, fk + fv)}};
}

json stats_json(ServerState& s) {
  const PrefixStoreStats ps = s.store ? s.store->stats() : PrefixStoreStats{};
  json j;
  j["model"] = s.model_name;
  j["model_identity"] = s.model_identity;
  j["method"] = s.opt.method;
  json settings = json::object();
  for (const auto& [k, v] : s.settings) settings[k] = v;
  j["settings"] = settings;
  const auto& cfg = s.model->config();
  // Every layer's K and V go through the method's cache (no layer is left uncompressed).
  j["coverage"] = {{"layers", cfg.n_layers}, {"compressed_layers", cfg.n_layers}, {"keys", true}, {"values", true},
                   {"kv_heads", cfg.n_kv_heads}, {"head_dim", cfg.head_dim}};
  std::lock_guard<std::mutex> lock(s.mu);
  j["retained"] = cache_stats_json(ps.cache_bytes.compressed_key, ps.cache_bytes.compressed_value,
                                   ps.cache_bytes.fp16_key, ps.cache_bytes.fp16_value);
  j["last_request"] = cache_stats_json(s.last.compressed_key_bytes, s.last.compressed_value_bytes,
                                       s.last.fp16_key_bytes, s.last.fp16_value_bytes);
  j["last_request"]["tokens"] = cfg.n_layers > 0 ? s.last.tokens / cfg.n_layers : 0;  // stats sum the layers
  // Memory held by the request's caches (shared calibration apart), beside the stored ratio.
  j["last_request"]["resident_bytes"] = s.last.resident_bytes;
  j["last_request"]["shared_bytes"] = s.last.shared_bytes();
  j["last_request"]["resident_ratio"] = s.last.resident_ratio();
  json layers = json::array();
  for (const CacheStats& l : s.last_layers)
    layers.push_back(cache_stats_json(l.compressed_key_bytes, l.compressed_value_bytes, l.fp16_key_bytes, l.fp16_value_bytes));
  j["last_request"]["layers"] = layers;
  j["tokens"] = {{"seen", s.tokens_seen}, {"retained", ps.tokens}};
  j["prefix_store"] = {{"kind", s.store ? ps.kind : "off"}, {"entries", ps.entries}, {"bytes", ps.bytes},
                       {"budget_bytes", ps.budget_bytes}, {"block_tokens", s.opt.prefix_block},
                       {"lookups", ps.lookups}, {"hits", ps.hits}, {"hit_rate", ps.hit_rate()},
                       {"reused_tokens", ps.reused_tokens}, {"stores", ps.stores}, {"evictions", ps.evictions},
                       {"rejected_too_large", ps.rejected_too_large}, {"corrupt_dropped", ps.corrupt_dropped},
                       {"superseded", ps.superseded}, {"write_failures", ps.write_failures},
                       {"read_failures", ps.read_failures}, {"erase_failures", ps.erase_failures},
                       {"last_failure", ps.last_failure},
                       // The shape every back end shares (the dashboard reads it).
                       {"backend", s.store ? ps.kind : "off"}, {"healthy", s.store ? ps.healthy : false},
                       {"misses", ps.misses()}, {"corrupt", ps.corrupt_dropped}, {"foreign", ps.foreign},
                       {"bytes_stored", ps.bytes}, {"rtt_ms", ps.rtt_ms}, {"reconnects", ps.reconnects},
                       {"chunk_tokens", s.store ? s.store->block() : 0}};
  j["requests"] = {{"served", s.served}, {"queued", s.queue.size()}, {"running", s.busy ? 1 : 0},
                   {"max_queue", s.opt.max_queue}, {"rejected_queue_full", s.rejected_full},
                   {"cancelled", s.cancelled}, {"failed", s.failed}, {"model_threads", s.model_threads.load()},
                   {"note", "one request at a time on the model; others wait in a bounded queue"}};
  json recent = json::array();
  double sum = 0;
  for (const auto& r : s.recent) {
    recent.push_back({{"ttft_ms", r.ttft_ms}, {"reused_tokens", r.reused_tokens}, {"at_s", r.at_s}});
    sum += r.ttft_ms;
  }
  j["ttft"] = {{"recent", recent}, {"mean_ms", s.recent.empty() ? 0.0 : sum / double(s.recent.size())}};
  j["memory"] = {{"rss_bytes", process_rss_bytes()}, {"peak_rss_bytes", process_peak_rss_bytes()}};
  j["uptime_s"] = std::chrono::duration<double>(Clock::now() - s.started).count();
  j["draining"] = s.draining;
  return j;
}

// Prometheus text format of the stats' counters and gauges: the request
// counts and the prefix store's (failures included), one "kvcodec_" metric each.
std::string metrics_text(const json& stats) {
  std::string out;
  auto emit = [&](const std::string& name, const json& v, const char* type) {
    out += "# TYPE kvcodec_" + name + " " + type + "\nkvcodec_" + name + " " + v.dump() + "\n";
  };
  for (const char* k : {"served", "rejected_queue_full", "cancelled", "failed"})
    emit(std::string("requests_") + k + "_total", stats["requests"][k], "counter");
  for (const char* k : {"queued", "running"}) emit(std::string("requests_") + k, stats["requests"][k], "gauge");
  const json& ps = stats["prefix_store"];
  for (const char* k : {"lookups", "hits", "reused_tokens", "stores", "evictions", "superseded", "rejected_too_large",
                        "corrupt_dropped", "write_failures", "read_failures", "erase_failures", "misses", "corrupt",
                        "foreign", "reconnects"})
    emit(std::string("prefix_store_") + k + "_total", ps[k], "counter");
  for (const char* k : {"entries", "bytes", "budget_bytes", "bytes_stored", "rtt_ms"})
    emit(std::string("prefix_store_") + k, ps[k], "gauge");
  emit("prefix_store_healthy", ps["healthy"].get<bool>() ? 1 : 0, "gauge");
  emit("tokens_seen_total", stats["tokens"]["seen"], "counter");
  emit("rss_bytes", stats["memory"]["rss_bytes"], "gauge");
  return out;
}

// What a stored prefix must have been made with to be served: the model
// (config and weights, model_identity()) and the method with its settings.
std::string scope_of(const std::string& method, const Settings& settings, const std::string& model_identity) {
  std::string s = "model=" + model_identity + ";" + method;
  for (const auto& [k, v] : settings) s += ";" + k + "=" + v;
  return s;
}

}  // namespace

size_t utf8_complete_prefix(const std::string& text) {
  // Walk back over at most 3 continuation bytes to the last lead byte and
  // check whether its sequence is complete.
  const size_t n = text.size();
  size_t i = n;
  int back = 0;
  while (i > 0 && back < 4) {
    const unsigned char c = static_cast<unsigned char>(text[i - 1]);
    if ((c & 0xC0) != 0x80) {
      size_t need = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
      return (n - (i - 1)) >= need ? n : i - 1;
    }
    --i;
    ++back;
  }
  return n;  // only continuation bytes: invalid anyway, send as is (replaced in JSON)
}

uint64_t process_rss_bytes() {
  std::ifstream f("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  if (!(f >> size >> resident)) return 0;
  return resident * uint64_t(sysconf(_SC_PAGESIZE));
}

uint64_t process_peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream in(line.substr(6));
      uint64_t kb = 0;
      in >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

int run_server(const ServeOptions& opt, std::ostream& log, const std::function<bool()>& stop_requested) {
  if (opt.port < 0 || opt.port > 65535) throw_config_error("--port", std::to_string(opt.port), "[0, 65535]");
  if (opt.max_queue == 0 || opt.max_queue > 4096) throw_config_error("--max-queue", std::to_string(opt.max_queue), "[1, 4096]");
  if (opt.max_body_bytes < 64 || opt.max_body_bytes > (256u << 20))
    throw_config_error("--max-body-bytes", std::to_string(opt.max_body_bytes), "[64, 268435456]");
  if (opt.prefix_block < 1 || opt.prefix_block > 4096)
    throw_config_error("--prefix-block", std::to_string(opt.prefix_block), "[1, 4096]");
  if (opt.redis_timeout_ms < 1 || opt.redis_timeout_ms > 60000)
    throw_config_error("--redis-timeout-ms", std::to_string(opt.redis_timeout_ms), "[1, 60000]");
  if (opt.default_max_tokens < 0 || opt.max_tokens_limit < 1)
    throw_config_error("--max-tokens-limit", std::to_string(opt.max_tokens_limit), ">= 1");
  check_bind_policy(opt.host, opt.api_key, opt.insecure_no_api_key);
  check_set_methods(opt.sets, {opt.method});  // before the model loads: a typo fails at once
  if (opt.threads > 0) omp_set_num_threads(opt.threads);

  ServerState s;
  s.opt = opt;
  s.log = &log;
  const std::string dir = opt.model_dir.empty() ? model::default_model_dir() : opt.model_dir;
  s.model_name = std::filesystem::path(dir).lexically_normal().filename().string();
  if (s.model_name.empty()) s.model_name = std::filesystem::path(dir).parent_path().filename().string();
  s.model = std::make_unique<model::LlamaModel>(model::LlamaModel::load(dir));
  s.tok = std::make_unique<model::Tokenizer>(model::Tokenizer::load(dir + "/tokenizer.json"));
  s.settings = settings_for_method(opt.sets, opt.method);
  {
    // Validate the method and settings now, not at the first request.
    CacheConfig cc;
    cc.n_layers = s.model->config().n_layers;
    cc.n_kv_heads = s.model->config().n_kv_heads;
    cc.head_dim = s.model->config().head_dim;
    cc.rope_theta = s.model->config().rope_theta;
    (void)make_cache(opt.method, cc, s.settings);
  }
  s.model_identity = model::model_identity(*s.model, dir);
  model::check_method_for_model(opt.method, s.settings, s.model->config(), model::model_config_hash(dir));
  s.scope = scope_of(opt.method, s.settings, s.model_identity);
  PrefixStoreOptions store_opt;
  store_opt.budget_bytes = opt.prefix_store_bytes;
  store_opt.dir = opt.prefix_store_dir;
  store_opt.url = opt.prefix_store;
  store_opt.block = opt.prefix_block;
  store_opt.chunk_tokens = opt.prefix_chunk;
  store_opt.redis_timeout_ms = opt.redis_timeout_ms;
  s.store = make_prefix_store(s.scope, store_opt);
  const int64_t context = s.model->config().max_position_embeddings > 0 ? s.model->config().max_position_embeddings : 2048;
  s.max_prompt = opt.max_prompt_tokens > 0 ? std::min<int64_t>(opt.max_prompt_tokens, context - 1) : context - 1;
  s.max_prompt_bytes = uint64_t(s.max_prompt) * s.tok->max_token_bytes();

  // Signals go to one thread (sigwait below), never into the HTTP or model threads.
  sigset_t sigs, old;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, &old);
  signal(SIGPIPE, SIG_IGN);  // a client closing its socket must not kill the server

  httplib::Server http;
  const size_t pool = opt.max_queue + 8;  // waiting requests hold a thread each; leave room for /health and stats
  http.new_task_queue = [pool] { return new httplib::ThreadPool(pool); };
  http.set_payload_max_length(opt.max_body_bytes);
  http.set_read_timeout(30, 0);
  http.set_write_timeout(30, 0);
  http.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return;
    const std::string msg = res.status == 413 ? "request body is larger than the server's limit"
                            : res.status == 404 ? "no such endpoint"
                            : res.status == 405 ? "method not allowed on this endpoint"
                                                : "request failed";
    send_error(res, res.status, msg, res.status == 404 ? "not_found" : "invalid_request_error");
  });
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string msg = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      msg = std::string("internal error: ") + e.what();
    } catch (...) {
    }
    send_error(res, 500, msg, "server_error");
  });

  if (!opt.api_key.empty()) {
    http.set_pre_routing_handler([&s](const httplib::Request& req, httplib::Response& res) {
      if (!path_needs_key(req.path)) return httplib::Server::HandlerResponse::Unhandled;
      const std::optional<std::string> refusal = bearer_refusal(req.get_header_value("Authorization"), s.opt.api_key);
      if (!refusal) return httplib::Server::HandlerResponse::Unhandled;
      res.set_header("WWW-Authenticate", "Bearer");
      send_error(res, 401, *refusal, "authentication_error");
      return httplib::Server::HandlerResponse::Handled;
    });
  }
  http.Get("/health", [&s](const httplib::Request&, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(s.mu);
    res.set_content(dump({{"status", s.draining ? "draining" : "ok"}}), "application/json");
  });
  http.Get("/v1/models", [&s](const httplib::Request&, httplib::Response& res) {
    json m = {{"id", s.model_name}, {"object", "model"}, {"created", 0}, {"owned_by", "kvcodec"},
              {"kvcodec", {{"method", s.opt.method}, {"context", s.model->config().max_position_embeddings}}}};
    res.set_content(dump({{"object", "list"}, {"data", json::array({m})}}), "application/json");
  });
  http.Get("/v1/kv/stats", [&s](const httplib::Request&, httplib::Response& res) {
    res.set_content(dump(stats_json(s)), "application/json");
  });
  http.Get("/metrics", [&s](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(stats_json(s)), "text/plain; version=0.0.4");
  });
  http.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(kDashboardHtml, sizeof(kDashboardHtml) - 1, "text/html; charset=utf-8");
  });
  http.Post("/tokenize", [&s](const httplib::Request& req, httplib::Response& res) {
    // Token count of a prompt or a chat, as a request would see it (vLLM's
    // /tokenize shape), so a client can size prompts to the context without
    // guessing characters per token. Runs on the HTTP thread: encode() is const.
    try {
      const std::vector<int32_t> ids = parse_tokenize(s, parse_body(req.body));
      res.set_content(dump({{"count", ids.size()}, {"max_model_len", s.model->config().max_position_embeddings},
                            {"max_prompt_tokens", s.max_prompt}, {"tokens", ids}}),
                      "application/json");
    } catch (const HttpError& e) {
      send_error(res, e.status, e.message, e.type);
    }
  });
  http.Post("/v1/completions", [&s](const httplib::Request& req, httplib::Response& res) {
    handle_generate(s, req, res, false);
  });
  http.Post("/v1/chat/completions", [&s](const httplib::Request& req, httplib::Response& res) {
    handle_generate(s, req, res, true);
  });

  // Debian's cpp-httplib (a compiled 0.11) listens with a backlog of 5
  // (CPPHTTPLIB_LISTEN_BACKLOG, fixed inside its library): a burst of more
  // clients than that, arriving while the accept thread is slow (a loaded
  // machine), overflowed the kernel's accept queue and lost requests. Calling
  // listen() again on the bound socket raises its backlog (Linux updates it).
  int listen_fd = -1;
  http.set_socket_options([&listen_fd](socket_t sock) {
    httplib::default_socket_options(sock);
    listen_fd = sock;
  });
  int port = opt.port;
  if (port == 0) {
    port = http.bind_to_any_port(opt.host);
    if (port <= 0) throw Error(ErrorCode::kIo, "cannot bind a port on " + opt.host);
  } else if (!http.bind_to_port(opt.host, port)) {
    throw Error(ErrorCode::kIo, "cannot bind " + opt.host + ":" + std::to_string(port) + " (in use, or not an address of this machine)");
  }
  if (listen_fd >= 0 && ::listen(listen_fd, kListenBacklog) != 0)
    throw Error(ErrorCode::kIo, std::string("cannot raise the listen backlog: ") + std::strerror(errno));

  std::thread worker([&s] { worker_loop(s); });
  std::atomic<bool> http_done{false};
  std::thread signals([&] {
    // Waits for SIGTERM/SIGINT (or the test hook), then drains: no new
    // requests, the queue and the running request finish, then HTTP stops.
    timespec tick{0, 50 * 1000 * 1000};
    bool stop = false;
    while (!stop && !http_done.load()) {
      const int sig = sigtimedwait(&sigs, nullptr, &tick);
      stop = sig == SIGTERM || sig == SIGINT || (stop_requested && stop_requested());
    }
    if (!stop) return;
    log_line(s, "draining");
    std::unique_lock<std::mutex> lock(s.mu);
    s.draining = true;
    s.cv.wait_for(lock, std::chrono::seconds(60), [&] { return s.queue.empty() && !s.busy; });
    lock.unlock();
    // Give streaming responses a moment to send their last events.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    http.stop();
  });

  const auto& c = s.model->config();
  log << "kvcodec serve: model " << s.model_name << " (" << c.n_layers << " layers, " << c.n_kv_heads << " kv heads, head_dim "
      << c.head_dim << ", context " << context << ") from " << dir << ", identity " << s.model_identity << "\n";
  log << "kvcodec serve: method " << opt.method << ", settings {";
  bool first = true;
  for (const auto& [k, v] : s.settings) {
    log << (first ? "" : ", ") << k << "=" << v;
    first = false;
  }
  log << "}\n";
  if (s.store && !opt.prefix_store.empty()) {
    const PrefixStoreStats ps = s.store->stats();
    log << "kvcodec serve: prefix store redis " << opt.prefix_store << ", chunks of " << opt.prefix_chunk << " tokens, "
        << (ps.healthy ? "connected" : "NOT reachable (" + ps.last_failure + "): serving without it, reconnecting with backoff")
        << "\n";
  } else if (s.store)
    log << "kvcodec serve: prefix store " << s.store->stats().kind << ", " << opt.prefix_store_bytes << " bytes, block "
        << opt.prefix_block << " tokens" << (opt.prefix_store_dir.empty() ? "" : ", dir " + opt.prefix_store_dir)
        << ", " << s.store->stats().entries << " entries found\n";
  else
    log << "kvcodec serve: prefix store off\n";
  log << "kvcodec serve: max body " << opt.max_body_bytes << " bytes, max prompt " << s.max_prompt << " tokens ("
      << s.max_prompt_bytes << " bytes before tokenizing), queue " << opt.max_queue << "\n";
  log << "kvcodec serve: api key " << (opt.api_key.empty() ? "off" : "required (Authorization: Bearer)") << "\n";
  log << "kvcodec serve: ready on http://" << opt.host << ":" << port << std::endl;

  const bool listened = http.listen_after_bind();
  http_done = true;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stopping = true;
    s.draining = true;
    for (auto& j : s.queue) j->cancelled = true;
    s.cv.notify_all();
  }
  worker.join();
  signals.join();
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  log << "kvcodec serve: stopped (" << s.served << " requests served)" << std::endl;
  return listened ? 0 : 1;
}

}  // namespace kvcodec::server

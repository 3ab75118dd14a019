// kvcodec serve (DESIGN 10): an OpenAI-compatible HTTP server over the model
// runtime with a compressed KV cache, KV statistics, a compressed prefix
// store and a dashboard.
//
// Threads: cpp-httplib answers HTTP on its own pool; one model thread runs
// generation requests one at a time from a bounded queue (a full queue gets
// 503), so /health, /v1/kv/stats and the dashboard stay responsive while the
// model works. A streaming request reads its tokens from a per-request
// channel; when the client goes away the request is cancelled at the next
// token and its resources are released.
//
// SIGTERM / SIGINT: stop taking new requests (503), finish the queue, stop
// the HTTP server, print "kvcodec serve: stopped" and return 0.
#pragma once

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

namespace kvcodec::server {

struct ServeOptions {
  std::string model_dir;                 // empty: model::default_model_dir()
  std::string method = "fp16";
  std::vector<std::string> sets;         // "<method>.<field>=<value>"
  std::string host = "127.0.0.1";
  int port = 8000;                       // 0: any free port (printed on the ready line)
  uint64_t prefix_store_bytes = 256ull << 20;  // 0 disables prefix reuse
  std::string prefix_store_dir;          // empty: in memory
  int64_t prefix_block = 64;             // prefix index spacing, tokens
  std::string prefix_store;              // "redis://HOST:PORT": the shared Redis chunk store (wins over the dir)
  int64_t prefix_chunk = 256;            // Redis chunk size, tokens
  int redis_timeout_ms = 500;            // bound of every Redis call
  size_t max_body_bytes = 1u << 20;
  int64_t max_prompt_tokens = 0;         // 0: the model's context minus 1
  int64_t max_tokens_limit = 1024;       // largest max_tokens a request may ask
  int64_t default_max_tokens = 16;
  size_t max_queue = 16;                 // waiting requests beyond the running one
  int threads = 0;                       // OpenMP threads of the model (0: all)
  std::string api_key;                   // non-empty: requests need "Authorization: Bearer <api_key>"
  bool insecure_no_api_key = false;      // allow a non-loopback host without a key
};

// Runs until SIGTERM/SIGINT (or until stop_requested() returns true, polled;
// for tests). Prints the settings and then the ready line
//   "kvcodec serve: ready on http://HOST:PORT"
// to `log`, flushed. Returns the process exit status. Throws kvcodec::Error
// for bad options (unknown method, bad setting, port in use, a non-loopback
// host without an API key: kConfig).
int run_server(const ServeOptions& options, std::ostream& log,
               const std::function<bool()>& stop_requested = {});

// Resident and peak resident set size of this process, bytes (Linux /proc;
// 0 where unavailable).
uint64_t process_rss_bytes();
uint64_t process_peak_rss_bytes();

// The longest prefix of `text` that ends on a whole UTF-8 sequence (so a
// streamed chunk never splits a character); the rest waits for more bytes.
size_t utf8_complete_prefix(const std::string& text);

}  // namespace kvcodec::server

// kvcodec serve: the OpenAI-compatible HTTP server (src/server, DESIGN 10).
#include <cstdlib>
#include <iostream>

#include "commands.hpp"
#include "kvcodec/error.hpp"
#include "server/server.hpp"

namespace kvcodec::cli {

void register_serve(CLI::App& app) {
  auto o = std::make_shared<server::ServeOptions>();
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server with a compressed KV cache and prefix reuse");
  cmd->add_option("--model", o->model_dir, "HF Llama checkpoint folder (default: the shipped models/tinycode)");
  cmd->add_option("--method", o->method, "Cache method, fixed for the process (fp16, int8, int4, kivi2, kvtc, palu)")
      ->capture_default_str();
  cmd->add_option("--set", o->sets, "Method setting <method>.<field>=<value> (repeatable)");
  cmd->add_option("--host", o->host, "Address to bind (loopback by default)")->capture_default_str();
  cmd->add_option("--port", o->port, "Port (0: any free port, printed on the ready line)")->capture_default_str();
  cmd->add_option("--prefix-store-bytes", o->prefix_store_bytes, "Byte budget of the compressed prefix store (0: off)")
      ->capture_default_str();
  cmd->add_option("--prefix-store-dir", o->prefix_store_dir, "Keep prefix entries in this folder (survives a restart)");
  cmd->add_option("--prefix-block", o->prefix_block, "Prefix index spacing in tokens")->capture_default_str();
  cmd->add_option("--prefix-store", o->prefix_store,
                  "redis://HOST:PORT: keep prefixes in chunks in this Redis, shared with other servers");
  cmd->add_option("--prefix-chunk", o->prefix_chunk, "Tokens per Redis chunk")->capture_default_str();
  cmd->add_option("--redis-timeout-ms", o->redis_timeout_ms, "Bound of every Redis call")->capture_default_str();
  cmd->add_option("--max-body-bytes", o->max_body_bytes, "Largest request body")->capture_default_str();
  cmd->add_option("--max-prompt-tokens", o->max_prompt_tokens, "Longest prompt (0: model context - 1)")->capture_default_str();
  cmd->add_option("--max-tokens-limit", o->max_tokens_limit, "Largest max_tokens a request may ask")->capture_default_str();
  cmd->add_option("--default-max-tokens", o->default_max_tokens, "max_tokens when a request gives none")->capture_default_str();
  cmd->add_option("--max-queue", o->max_queue, "Requests that may wait for the model (more get 503)")->capture_default_str();
  cmd->add_option("--threads", o->threads, "OpenMP threads of the model (0: all cores)")->capture_default_str();
  cmd->add_option("--api-key", o->api_key,
                  "Require 'Authorization: Bearer KEY' on every request but /health and / (default: $KVCODEC_API_KEY)");
  cmd->add_flag("--insecure-no-api-key", o->insecure_no_api_key,
                "Allow a non-loopback --host without an API key (anyone who reaches it can use it)");
  cmd->callback([o] {
    if (o->api_key.empty())
      if (const char* env = std::getenv("KVCODEC_API_KEY"); env && *env) o->api_key = env;
    const int rc = server::run_server(*o, std::cout);
    if (rc != 0) throw Error(ErrorCode::kIo, "server stopped with status " + std::to_string(rc));
  });
}

}  // namespace kvcodec::cli

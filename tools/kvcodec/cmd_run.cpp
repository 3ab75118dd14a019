// kvcodec run: generate text with the model, every layer's KV going through
// the chosen cache method; then report the cache's bytes and the speed.
#include <chrono>
#include <omp.h>

#include <cstdio>
#include <fmt/format.h>

#include "commands.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"
#include "model/calibrate.hpp"
#include "model/generate.hpp"
#include "model/identity.hpp"
#include "model/llama.hpp"
#include "model/paths.hpp"
#include "model/tokenizer.hpp"

namespace kvcodec::cli {
namespace {

struct RunArgs {
  std::string model_dir;
  std::string prompt;
  int64_t max_tokens = 128;
  std::string method = "fp16";
  std::vector<std::string> sets;
  // Sampling defaults: greedy decoding of the shipped 11M model repeats one
  // line; these give varied, still on-topic code (README main job).
  double temperature = 0.7;
  double top_p = 0.9;
  double repetition_penalty = 1.2;
  int repetition_window = 256;
  uint64_t seed = 0;
  bool reference = false;
  int64_t compare_reference = 0;
  int threads = 0;
};

std::string mib(uint64_t bytes) { return fmt::format("{:.2f} MiB", double(bytes) / (1024.0 * 1024.0)); }

// Greedy decode of `steps` tokens after the prompt with the fast and the
// plain-loop paths, same method: tokens/s of each, measured in this run.
void compare_with_reference(const model::LlamaModel& m, const model::CacheFactory& factory,
                            const std::vector<int32_t>& prompt, int64_t steps) {
  double tps[2] = {0, 0};
  std::vector<int32_t> out[2];
  for (int ref = 0; ref < 2; ++ref) {
    model::Session s(m, factory);
    model::GenerateOptions g;
    g.max_tokens = steps + 1;  // steps decode steps after the first sampled token
    g.reference = ref == 1;
    const auto r = model::generate(s, prompt, g);
    out[ref] = r.tokens;
    tps[ref] = r.decode_seconds > 0 ? double(r.decode_steps) / r.decode_seconds : 0.0;
  }
  std::printf("decode speed (greedy, %lld steps after a %zu-token prompt): fast %.1f tok/s, plain-loop reference "
              "%.1f tok/s, speedup %.1fx; same tokens: %s\n",
              (long long)steps, prompt.size(), tps[0], tps[1], tps[1] > 0 ? tps[0] / tps[1] : 0.0,
              out[0] == out[1] ? "yes" : "no");
}

void run(const RunArgs& a) {
  check_set_methods(a.sets, {a.method});  // before the model loads: a typo fails at once
  const std::string dir = a.model_dir.empty() ? model::default_model_dir() : a.model_dir;
  const model::LlamaModel m = model::LlamaModel::load(dir);
  const model::Tokenizer tok = model::Tokenizer::load(dir + "/tokenizer.json");
  const Settings settings = model::with_model_defaults(dir, a.method, settings_for_method(a.sets, a.method));
  model::check_method_for_model(a.method, settings, m.config(), model::model_config_hash(dir));
  const model::CacheFactory factory = model::method_cache_factory(a.method, settings);

  std::vector<int32_t> prompt = tok.encode(a.prompt);
  if (prompt.empty()) {
    // Nothing to condition on: start from BOS (the EOS of models that share it).
    const int32_t start = m.config().bos_token_id >= 0 ? m.config().bos_token_id : m.config().eos_token_id;
    if (start < 0) throw Error(ErrorCode::kInvalidArgument, "--prompt is empty and the model has no bos_token_id");
    prompt.push_back(start);
  }
  if (a.max_tokens < 0) throw_config_error("--max-tokens", std::to_string(a.max_tokens), ">= 0");
  if (a.compare_reference < 0) throw_config_error("--compare-reference", std::to_string(a.compare_reference), ">= 0");

  model::Session session(m, factory);
  model::GenerateOptions g;
  g.max_tokens = a.max_tokens;
  g.sampling = {a.temperature, a.top_p, a.seed, a.repetition_penalty, a.repetition_window};
  g.eos_token = m.config().eos_token_id;
  g.reference = a.reference;
  std::fwrite(a.prompt.data(), 1, a.prompt.size(), stdout);
  std::fflush(stdout);
  const auto r = model::generate(session, prompt, g, [&](int32_t t) {
    if (t == g.eos_token) return;
    const std::string& bytes = tok.token_bytes(t);
    std::fwrite(bytes.data(), 1, bytes.size(), stdout);
    std::fflush(stdout);
  });
  std::printf("\n");
  const CacheStats st = session.cache_stats();
  const double prefill_tps = r.prefill_seconds > 0 ? double(r.prompt_tokens) / r.prefill_seconds : 0.0;
  const double decode_tps = r.decode_seconds > 0 ? double(r.decode_steps) / r.decode_seconds : 0.0;
  std::printf("[%s] %lld prompt + %zu generated tokens%s; cache %s compressed (K %s, V %s) vs %s fp16 = %.2fx; "
              "prefill %.1f tok/s, decode %.1f tok/s%s\n",
              a.method.c_str(), (long long)r.prompt_tokens, r.tokens.size(), r.stopped_at_eos ? " (stopped at EOS)" : "",
              mib(st.compressed_bytes()).c_str(), mib(st.compressed_key_bytes).c_str(),
              mib(st.compressed_value_bytes).c_str(), mib(st.fp16_bytes()).c_str(), st.compression_ratio(),
              prefill_tps, decode_tps, a.reference ? " (plain-loop reference path)" : "");
  if (a.compare_reference > 0) compare_with_reference(m, factory, prompt, a.compare_reference);
}

}  // namespace

void register_run(CLI::App& app) {
  auto args = std::make_shared<RunArgs>();
  auto* cmd = app.add_subcommand("run", "Generate text with the model through a (compressed) KV cache");
  cmd->add_option("--model", args->model_dir, "HF Llama checkpoint folder (default: the shipped models/tinycode)");
  cmd->add_option("--prompt", args->prompt, "Prompt text (empty: start from BOS)");
  cmd->add_option("--max-tokens", args->max_tokens, "Most tokens to generate")->capture_default_str();
  cmd->add_option("--method", args->method, "Cache method (fp16, int8, int4, kivi2, kvtc, palu)")->capture_default_str();
  cmd->add_option("--set", args->sets, "Method setting <method>.<field>=<value> (repeatable)");
  cmd->add_option("--temperature", args->temperature, "Sampling temperature (0 = greedy)")->capture_default_str();
  cmd->add_option("--top-p", args->top_p, "Nucleus sampling mass in (0, 1]")->capture_default_str();
  cmd->add_option("--repetition-penalty", args->repetition_penalty,
                  "Divide positive (multiply negative) logits of recent tokens by this (1 = off)")
      ->capture_default_str();
  cmd->add_option("--repetition-window", args->repetition_window, "Recent tokens the penalty looks at")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "Sampling seed")->capture_default_str();
  cmd->add_flag("--reference", args->reference, "Use the plain-loop reference forward pass (slow; for checking)");
  cmd->add_option("--compare-reference", args->compare_reference,
                  "Afterwards, time N greedy decode steps with the fast and the plain-loop path and print both");
  cmd->add_option("--threads", args->threads, "OpenMP threads (0: the cores not busy now, from the load average)")->capture_default_str();
  cmd->callback([args] {
    if (args->threads < 0) throw_config_error("--threads", std::to_string(args->threads), ">= 0 (0: automatic)");
    omp_set_num_threads(args->threads > 0 ? args->threads : model::auto_thread_count());
    run(*args);
  });
}

}  // namespace kvcodec::cli

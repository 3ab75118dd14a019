// kvcodec eval: perplexity, KL and top-1 agreement of cache methods against
// the fp16 cache on held-out token windows (DESIGN 8 protocol), with each
// method's compression ratio and speed. Tokens come from --tokens, --text or
// the default corpus (model/corpus.hpp).
#include <unistd.h>

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.hpp"
#include "kvcodec/cache.hpp"
#include "kvcodec/error.hpp"
#include "cache/kvtc_crosslayer.hpp"
#include "cache/kvtc_crosslayer_stream.hpp"
#include "model/calibrate.hpp"
#include "model/corpus.hpp"
#include "model/eval.hpp"
#include "model/identity.hpp"
#include "model/llama.hpp"
#include "model/paths.hpp"
#include "model/tokenizer.hpp"

namespace kvcodec::cli {
namespace {

struct EvalArgs {
  std::string model_dir;
  std::string tokens;
  std::string text;
  bool window_length_given = false;
  std::string methods = "fp16";
  std::string baseline = "fp16";
  std::vector<std::string> sets;
  model::EvalOptions options;
  std::string protocol = "streaming";
  bool json = false;
  int threads = 0;
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

// A bar redrawn in place on stderr, only when stderr is a terminal.
class ProgressBar {
 public:
  explicit ProgressBar(bool enabled) : enabled_(enabled) {}
  ~ProgressBar() {
    if (enabled_ && drawn_) std::fprintf(stderr, "\r%*s\r", 72, "");
  }
  void update(int64_t done, int64_t total) {
    if (!enabled_ || total <= 0) return;
    const int permille = int(1000 * done / total);
    if (permille == last_ && done != total) return;
    last_ = permille;
    drawn_ = true;
    constexpr int kWidth = 50;
    const int filled = int(kWidth * done / total);
    std::fprintf(stderr, "\r[%s%s] %5.1f%% (%lld/%lld)", std::string(size_t(filled), '#').c_str(),
                 std::string(size_t(kWidth - filled), '.').c_str(), permille / 10.0, (long long)done, (long long)total);
    std::fflush(stderr);
  }

 private:
  bool enabled_;
  bool drawn_ = false;
  int last_ = -1;
};

struct Corpus {
  std::vector<int32_t> tokens;
  std::string source;  // what the header line calls it
};

// --tokens as they are; --text or the default corpus through the model's
// tokenizer. A text corpus's windows are context + score long unless
// --window-length says otherwise (no tokens left unread between windows).
Corpus read_corpus(const EvalArgs& a, const std::string& dir, model::EvalOptions& o) {
  if (!a.tokens.empty()) return {model::load_u16_tokens(a.tokens), a.tokens};
  const model::Tokenizer tok = model::Tokenizer::load(dir + "/tokenizer.json");
  const model::TextCorpus c = a.text.empty() ? model::read_default_corpus(tok) : model::read_text_corpus(a.text, tok);
  if (!a.window_length_given && !o.whole_window) o.window_length = o.context + o.score;
  const std::string what = a.text.empty() ? "the default corpus" : a.text;
  if (a.text.empty() && c.content_hash != model::kDefaultCorpusHash)
    std::fprintf(stderr,
                 "warning: the default corpus here has hash %016llx, not %016llx (Debian 12's python3-minimal "
                 "3.11.2-1+b1): figures will differ from the documented ones\n",
                 (unsigned long long)c.content_hash, (unsigned long long)model::kDefaultCorpusHash);
  return {c.tokens, fmt::format("{} ({} files, {} tokens, hash {:016x})", what, c.files.size(), c.tokens.size(),
                                c.content_hash)};
}

// xkvtc: cross-layer kvtc (docs/calibrated.md), calibration=FILE (from
// kvcodec calibrate --cross-layer). With --protocol prefix the store of whole
// prefixes (fields sinks [4], block [64]); streaming, the per-layer caches of
// a sequence sharing one coder (cache/kvtc_crosslayer_stream.hpp: sinks [4],
// window [16], block [16], scratch decoded|none [decoded], recent [0] with
// recent_calibration=FILE: the recent tier, coded tokens first coded with
// that calibration and re-coded with the base one once `recent` newer tokens
// are coded).
model::MethodSpec cross_layer_spec(const std::string& name, const Settings& settings, const model::EvalOptions& o,
                                   const model::ModelConfig& config) {
  const std::vector<std::string> fields =
      o.stored_prefix ? std::vector<std::string>{"calibration", "sinks", "block"}
                      : std::vector<std::string>{"calibration", "sinks", "window", "block", "scratch", "recent",
                                                 "recent_calibration"};
  std::string allowed;
  for (const std::string& f : fields) allowed += (allowed.empty() ? "" : ", ") + f;
  for (const auto& [field, value] : settings)
    if (std::find(fields.begin(), fields.end(), field) == fields.end())
      throw_config_error("xkvtc." + field, value,
                         "one of " + allowed + (o.stored_prefix ? " (with --protocol prefix)" : " (streaming)"));
  auto int_field = [&](const char* field, int fallback, int lo) {
    if (!settings.count(field)) return fallback;
    const std::string& v = settings.at(field);
    char* end = nullptr;
    const long x = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || x < lo || x > 1 << 20)
      throw_config_error(std::string("xkvtc.") + field, v, "an integer >= " + std::to_string(lo));
    return int(x);
  };
  if (!settings.count("calibration"))
    throw_config_error("xkvtc.calibration", "(unset)", "a cross-layer calibration file (kvcodec calibrate --cross-layer)");
  auto cal = KvtcCalibration::load_shared(settings.at("calibration"));
  check_cross_layer_calibration(*cal, config.n_layers, config.n_kv_heads, config.head_dim, config.rope_theta,
                                settings.at("calibration"));
  if (!o.stored_prefix) {
    CrossLayerStreamOptions so;
    so.sinks = int_field("sinks", so.sinks, 0);
    so.window = int_field("window", so.window, 0);
    so.block = int_field("block", so.block, 1);
    const std::string scratch = settings.count("scratch") ? settings.at("scratch") : "decoded";
    if (scratch != "decoded" && scratch != "none") throw_config_error("xkvtc.scratch", scratch, "decoded or none");
    so.decoded_scratch = scratch == "decoded";
    so.recent = int_field("recent", 0, 0);
    if (settings.count("recent_calibration")) {
      so.recent_calibration = KvtcCalibration::load_shared(settings.at("recent_calibration"));
      check_cross_layer_calibration(*so.recent_calibration, config.n_layers, config.n_kv_heads, config.head_dim,
                                    config.rope_theta, settings.at("recent_calibration"));
    }
    return {name, cross_layer_stream_factory(std::move(cal), so)};
  }
  model::MethodSpec s{name, model::method_cache_factory("fp16")};
  s.prefix_coder = model::cross_layer_prefix_coder(cal, int_field("sinks", 4, 0), int_field("block", 64, 1));
  return s;
}

void run(const EvalArgs& a) {
  const std::string dir = a.model_dir.empty() ? model::default_model_dir() : a.model_dir;
  const model::LlamaModel m = model::LlamaModel::load(dir);
  model::EvalOptions options = a.options;
  const Corpus corpus = read_corpus(a, dir, options);
  model::require_corpus_tokens(options, int64_t(corpus.tokens.size()), corpus.source);

  const std::vector<std::string> names = split_list(a.methods);
  if (names.empty()) throw_config_error("--methods", a.methods, "a comma-separated list of methods, e.g. fp16,int4,kvtc");
  std::vector<model::MethodSpec> methods;
  {
    // Every --set names a method run here (a listed name, its base method, or the baseline).
    std::vector<std::string> runs = names;
    runs.push_back(a.baseline);
    for (const auto& n : std::vector<std::string>(runs)) runs.push_back(n.substr(0, n.find(':')));
    check_set_methods(a.sets, runs);
  }
  CacheConfig probe;
  probe.n_layers = m.config().n_layers;
  probe.n_kv_heads = m.config().n_kv_heads;
  probe.head_dim = m.config().head_dim;
  probe.rope_theta = m.config().rope_theta;
  // "method:label" is a variant of method with its own settings
  // (--set method:label.field=value, on top of method.field=value), so one
  // run can sweep several settings of a method against one baseline run.
  std::vector<std::string> notes;  // model-folder defaults each method took
  auto spec = [&](const std::string& name) {
    const size_t colon = name.find(':');
    const std::string base = name.substr(0, colon);
    if (base.empty() || (colon != std::string::npos && colon + 1 == name.size()) ||
        name.find('.') != std::string::npos)
      throw_config_error("--methods", name,
                         "a method name, or <method>:<label> with a non-empty label without '.' "
                         "(--set <method>:<label>.<field>=<value> ends the name at its first '.')");
    Settings settings = settings_for_method(a.sets, base);
    if (colon != std::string::npos)
      for (const auto& [field, value] : settings_for_method(a.sets, name)) settings[field] = value;
    if (base == "xkvtc") return cross_layer_spec(name, settings, options, m.config());
    if (Settings with = model::with_model_defaults(dir, base, settings); with != settings) {
      std::string used;
      for (const auto& [field, value] : with)
        if (!settings.count(field)) used += fmt::format(" {}={}", field, value);
      notes.push_back(fmt::format("{}: the model folder's {}.settings:{}", name, base, used));
      settings = std::move(with);
    }
    model::check_method_for_model(base, settings, m.config(), model::model_config_hash(dir));
    model::MethodSpec s{name, model::method_cache_factory(base, settings)};
    s.factory(probe);  // a bad method or setting fails now, not after the baseline has run
    return s;
  };
  for (const auto& n : names) methods.push_back(spec(n));
  const model::MethodSpec baseline = spec(a.baseline);

  ProgressBar bar(isatty(fileno(stderr)) != 0);
  const auto results =
      model::evaluate(m, corpus.tokens, methods, baseline, options, [&](int64_t d, int64_t t) { bar.update(d, t); });
  bar.update(1, 1);

  if (a.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : results)
      out.push_back({{"method", r.method},
                     {"compression_ratio", r.compression_ratio},
                     {"ppl", r.ppl},
                     {"ppl_change_pct", 100.0 * r.ppl_change},
                     {"ppl_change_se_pct", 100.0 * r.ppl_change_se},
                     {"nll", r.nll},
                     {"kl", r.kl},
                     {"top1_agreement", r.top1},
                     {"tokens_per_s", r.tokens_per_s},
                     {"scored", r.scored},
                     {"compressed_bytes", r.stats.compressed_bytes()},
                     {"fp16_bytes", r.stats.fp16_bytes()},
                     {"resident_bytes", r.stats.resident_bytes},
                     {"shared_bytes", r.stats.shared_bytes()},
                     {"resident_ratio", r.stats.resident_ratio()}});
    std::printf("%s\n", out.dump(2).c_str());
    return;
  }
  const auto& o = options;
  std::printf("%s; %lld windows of %lld from %lld of %s; %s; baseline %s\n", dir.c_str(), (long long)o.windows,
              (long long)o.window_length, (long long)o.first_window, corpus.source.c_str(),
              o.whole_window ? fmt::format("whole window ({} predictions each)", o.window_length - 1).c_str()
              : o.stored_prefix
                  ? fmt::format("stored prefix of {} tokens, score {}", o.context - 1, o.score).c_str()
                  : fmt::format("context {}, score {}", o.context, o.score).c_str(),
              a.baseline.c_str());
  for (const std::string& note : notes) std::printf("%s\n", note.c_str());
  // held: f16 / bytes held in memory (shared calibration apart), beside the stored ratio.
  // se: standard error of the per-window ppl change across windows ("-" for one window).
  std::printf("%-12s %8s %8s %9s %8s %6s %8s %10s %7s %10s\n", "method", "ratio", "held", "ppl", "ppl +%", "se",
              "nll", "kl", "top1", "tokens/s");
  for (const auto& r : results) {
    const std::string se = o.windows > 1 ? fmt::format("{:.2f}%", 100.0 * r.ppl_change_se) : "-";
    std::printf("%-12s %7.2fx %7.2fx %9.4f %+7.2f%% %6s %8.4f %10.3e %7.4f %10.1f\n", r.method.c_str(),
                r.compression_ratio, r.stats.resident_ratio(), r.ppl, 100.0 * r.ppl_change, se.c_str(), r.nll, r.kl,
                r.top1, r.tokens_per_s);
  }
}

}  // namespace

void register_eval(CLI::App& app) {
  auto args = std::make_shared<EvalArgs>();
  auto* cmd = app.add_subcommand("eval", "Perplexity, KL and top-1 agreement of cache methods vs the fp16 cache");
  cmd->add_option("--model", args->model_dir, "HF Llama checkpoint folder (default: the shipped models/tinycode)");
  auto* tokens = cmd->add_option("--tokens", args->tokens, "uint16 token windows (default: the default corpus, docs/eval.md)");
  cmd->add_option("--text", args->text, "Text FILE, or every file of a DIR in sorted order, tokenized with the model's tokenizer")
      ->excludes(tokens);
  cmd->add_option("--methods", args->methods,
                  "Comma-separated cache methods; <method>:<label> is a variant with its own --set <method>:<label>.<field>=<value>")->capture_default_str();
  cmd->add_option("--baseline", args->baseline, "Method the KL and top-1 agreement are measured against")
      ->capture_default_str();
  cmd->add_option("--context", args->options.context, "Tokens prefilled per window")->capture_default_str();
  cmd->add_option("--score", args->options.score, "Tokens scored per window, one decode step each")
      ->capture_default_str();
  cmd->add_option("--windows", args->options.windows, "Windows to evaluate")->capture_default_str();
  cmd->add_option("--first-window", args->options.first_window, "First window")->capture_default_str();
  cmd->add_option("--window-length", args->options.window_length, "Tokens per window (default 2048 with --tokens, context + score with text)");
  cmd->add_flag("--whole-window", args->options.whole_window,
                "Score every position of each window from one prefill through the cache (W-1 predictions)");
  cmd->add_option("--protocol", args->protocol,
                  "streaming: the context and scored tokens go through the method's caches; prefix: the first "
                  "context-1 tokens are stored by the method as a whole (ratio of the stored prefix), the scored "
                  "tokens run on top in baseline caches (docs/eval.md)")
      ->capture_default_str();
  cmd->add_option("--set", args->sets, "Method setting <method>.<field>=<value> (repeatable)");
  cmd->add_flag("--json", args->json, "One JSON array on stdout");
  cmd->add_option("--threads", args->threads, "OpenMP threads (0: the cores not busy now, from the load average)")->capture_default_str();
  cmd->callback([args, cmd] {
    args->window_length_given = cmd->count("--window-length") > 0;
    if (args->protocol != "streaming" && args->protocol != "prefix")
      throw_config_error("--protocol", args->protocol, "streaming or prefix");
    args->options.stored_prefix = args->protocol == "prefix";
    if (args->threads < 0) throw_config_error("--threads", std::to_string(args->threads), ">= 0 (0: automatic)");
    omp_set_num_threads(args->threads > 0 ? args->threads : model::auto_thread_count());
    run(*args);
  });
}

}  // namespace kvcodec::cli

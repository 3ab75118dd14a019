// Model runtime speed: one decode step with a method's cache at a given
// context, timed against the fp16 cache and against the plain-loop reference
// in the same run (shared machines are noisy; ratios travel, absolute times
// do not).
//
//   bench_model                      # all
//   bench_model --benchmark_filter=DecodeStep/kvtc
// Counters: ms_per_step (this method), fp16_ms_per_step (fp16 cache, same
// context, interleaved with it), ratio_to_fp16.
#include <benchmark/benchmark.h>

#include <chrono>
#include <filesystem>
#include <random>

#include "kvcodec/cache.hpp"
#include "model/llama.hpp"

namespace {

using namespace kvcodec;
using Clock = std::chrono::steady_clock;

const model::LlamaModel& shipped_model() {
  static const model::LlamaModel m = model::LlamaModel::load(std::string(KVCODEC_SOURCE_DIR) + "/models/tinycode");
  return m;
}

std::vector<int32_t> prompt_tokens(int64_t n, int vocab) {
  std::mt19937 rng(1234);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % uint32_t(vocab));
  return t;
}

double step_ms(model::Session& s, int32_t token, bool reference, std::vector<float>& logits) {
  const auto t0 = Clock::now();
  if (reference) s.forward_reference(&token, 1, logits, false);
  else s.forward(&token, 1, logits, false);
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Decode steps with `method` at `context` tokens of history, each
// interleaved with a step of an fp16 session at the same context.
void decode_step(benchmark::State& state, const std::string& method, bool reference) {
  const model::LlamaModel& m = shipped_model();
  const int64_t context = state.range(0);
  const auto prompt = prompt_tokens(context, m.config().vocab_size);
  model::Session subject(m, model::method_cache_factory(method));
  model::Session fp16(m, model::method_cache_factory("fp16"));
  std::vector<float> logits;
  subject.forward(prompt.data(), context, logits, false);
  fp16.forward(prompt.data(), context, logits, false);
  double ms = 0, ms_fp16 = 0;
  int32_t token = 7;
  for (auto _ : state) {
    const double a = step_ms(subject, token, reference, logits);
    ms += a;
    ms_fp16 += step_ms(fp16, token, false, logits);
    state.SetIterationTime(a / 1000.0);
    token = int32_t((token * 31 + 17) % m.config().vocab_size);
  }
  const double n = double(state.iterations());
  state.counters["ms_per_step"] = ms / n;
  state.counters["fp16_ms_per_step"] = ms_fp16 / n;
  state.counters["ratio_to_fp16"] = ms / ms_fp16;
  state.counters["tokens_per_s"] = 1000.0 * n / ms;
}

void BM_DecodeStep_fp16(benchmark::State& s) { decode_step(s, "fp16", false); }
void BM_DecodeStep_int4(benchmark::State& s) { decode_step(s, "int4", false); }
void BM_DecodeStep_kvtc(benchmark::State& s) { decode_step(s, "kvtc", false); }
void BM_DecodeStep_palu(benchmark::State& s) { decode_step(s, "palu", false); }
// The plain-loop reference path, fp16 cache: the speed baseline of the runtime.
void BM_DecodeStepReference_fp16(benchmark::State& s) { decode_step(s, "fp16", true); }

BENCHMARK(BM_DecodeStep_fp16)->Arg(128)->Arg(2048)->Iterations(64)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DecodeStepReference_fp16)->Arg(128)->Arg(2048)->Iterations(16)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DecodeStep_int4)->Arg(2048)->Iterations(64)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DecodeStep_kvtc)->Arg(2048)->Iterations(64)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DecodeStep_palu)->Arg(2048)->Iterations(64)->UseManualTime()->Unit(benchmark::kMillisecond);

// Prefill throughput (tokens/s) of a 2048-token window, fp16 cache.
void BM_Prefill_fp16(benchmark::State& state) {
  const model::LlamaModel& m = shipped_model();
  const auto prompt = prompt_tokens(state.range(0), m.config().vocab_size);
  std::vector<float> logits;
  for (auto _ : state) {
    model::Session s(m, model::method_cache_factory("fp16"));
    s.forward(prompt.data(), int64_t(prompt.size()), logits, false);
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(double(prompt.size()) * double(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Prefill_fp16)->Arg(2048)->Iterations(2)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();

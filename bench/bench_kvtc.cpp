// KVTC codec throughput on one real head of the shared KV dump: encode and
// decode of 64-token blocks through frozen parameters, beside memcpy of the
// same f16 bytes measured in the same run. KVCODEC_BENCH_KV names another
// dump (e.g. scripts/make_hd128_dump.py's head_dim-128 one).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kvcodec/cache.hpp"
#include "kvcodec/safetensors.hpp"
#include "core/cpu_features.hpp"
#include "entropy/entropy.hpp"
#include "kvtc/block_codes.hpp"
#include "kvtc/codec.hpp"
#include "linalg/pca.hpp"

using namespace kvcodec;

namespace {

std::string bench_dump_path() {
  const char* other = std::getenv("KVCODEC_BENCH_KV");
  return other && *other ? other : std::string(KVCODEC_SHARED_DIR) + "/models/tinycode/kv_dump.safetensors";
}

struct Fixture {
  std::vector<float> x;  // [T, D] of layer 2's key head 0
  int64_t n = 0;
  int dim = 0;
};

const Fixture& fixture() {
  static Fixture f = [] {
    Fixture out;
    const std::string path = bench_dump_path();
    const SafetensorsFile file = SafetensorsFile::open(path);
    TensorView v = file.view4("layers.2.key");
    v.shape[0] = 1;  // batch 0, head 0: [1, 1, T, D]
    v.shape[1] = 1;
    out.n = v.shape[2];
    out.dim = int(v.shape[3]);
    out.x.resize(size_t(out.n * out.dim));
    copy_to_contiguous(v, out.x.data(), DType::kF32);
    return out;
  }();
  return f;
}

// Arg > 0: dp allocator at that bit budget; Arg < 0: the rate allocator at
// target_rel_mse = -Arg / 1000 with an int8 basis (the issue-2 settings).
kvtc::HeadParams fitted(int arg) {
  const Fixture& f = fixture();
  const linalg::PcaBasis pca = linalg::fit_pca(f.x.data(), f.n, f.dim);
  kvtc::CodecOptions o;
  if (arg > 0) {
    o.bit_budget = arg;
  } else {
    o.allocator = kvtc::Allocator::kRate;
    o.target_rel_mse = -arg / 1000.0;
    o.basis_bits = 8;
  }
  return kvtc::fit_head(f.x.data(), f.n, f.dim, pca.mean, pca.components, pca.eigenvalues, o);
}

// An A/B bench's per-iteration ratios as counters: speedup (the median),
// q1 and q3 (its quartiles).
void report_ratios(benchmark::State& state, std::vector<double>& ratios) {
  if (ratios.empty()) return;
  std::sort(ratios.begin(), ratios.end());
  state.counters["speedup"] = ratios[ratios.size() / 2];
  state.counters["q1"] = ratios[ratios.size() / 4];
  state.counters["q3"] = ratios[ratios.size() * 3 / 4];
}

// A head's opening as a local-mode cache does it for every fetch: its
// serialized parameters parsed and the decoder half built
// (HeadParams::deserialize with KernelSet::kDecode).
void BM_OpenHeadDecode(benchmark::State& state) {
  std::vector<uint8_t> bytes;
  {
    ByteWriter w;
    fitted(int(state.range(0))).serialize(w);
    bytes = w.take();
  }
  for (auto _ : state) {
    ByteReader in(bytes.data(), bytes.size(), "bench head");
    kvtc::HeadParams h = kvtc::HeadParams::deserialize(in, fixture().dim, kvtc::KernelSet::kDecode);
    benchmark::DoNotOptimize(h.mean.data());
  }
}

void BM_Memcpy(benchmark::State& state) {
  const Fixture& f = fixture();
  std::vector<uint16_t> src(f.x.size()), dst(f.x.size());
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), src.size() * 2);
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(src.size() * 2));
}

void BM_Encode(benchmark::State& state) {
  const Fixture& f = fixture();
  const kvtc::HeadParams p = fitted(int(state.range(0)));
  for (auto _ : state)
    for (int64_t t = 0; t + 64 <= f.n; t += 64) benchmark::DoNotOptimize(kvtc::encode_block(p, &f.x[size_t(t * f.dim)], 64));
  state.SetBytesProcessed(int64_t(state.iterations()) * f.n * f.dim * 2);  // f16 bytes of input
}

void BM_Decode(benchmark::State& state) {
  const Fixture& f = fixture();
  const kvtc::HeadParams p = fitted(int(state.range(0)));
  std::vector<std::vector<uint8_t>> blocks;
  for (int64_t t = 0; t + 64 <= f.n; t += 64) blocks.push_back(kvtc::encode_block(p, &f.x[size_t(t * f.dim)], 64));
  std::vector<float> out(size_t(64 * f.dim));
  for (auto _ : state)
    for (const auto& b : blocks) {
      kvtc::decode_block(p, b.data(), b.size(), 64, out.data());
      benchmark::DoNotOptimize(out.data());
    }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(blocks.size()) * 64 * f.dim * 2);
}

// The codes of the fixture head's whole 64-token blocks under p, block after
// block ([blocks * 64, K]).
std::vector<uint16_t> block_codes(const Fixture& f, const kvtc::HeadParams& p) {
  const size_t K = size_t(p.n_kept());
  std::vector<uint16_t> codes;
  for (int64_t t = 0; t + 64 <= f.n; t += 64) {
    codes.resize(codes.size() + 64 * K);
    kvtc::quantize_block(p, &f.x[size_t(t * f.dim)], 64, codes.data() + codes.size() - 64 * K);
  }
  return codes;
}

// The encoder's two stages alone, on the same blocks as BM_Encode: the
// projection and quantisation (quantize_block) and the entropy coding of
// the codes (entropy_encode_codes), to see where encode time goes.
void BM_Quantize(benchmark::State& state) {
  const Fixture& f = fixture();
  const kvtc::HeadParams p = fitted(int(state.range(0)));
  std::vector<uint16_t> codes(size_t(64) * size_t(p.n_kept()));
  for (auto _ : state)
    for (int64_t t = 0; t + 64 <= f.n; t += 64) {
      kvtc::quantize_block(p, &f.x[size_t(t * f.dim)], 64, codes.data());
      benchmark::DoNotOptimize(codes.data());
    }
  state.SetBytesProcessed(int64_t(state.iterations()) * f.n * f.dim * 2);
  state.counters["kept"] = p.n_kept();
  state.counters["tokens"] = double(f.n);
}

// The float projection kernel against the integer one (quantize_block's
// default), alternating within each iteration; counter speedup = median
// float time / integer time (q1, q3 its quartiles).
void BM_QuantizeAB(benchmark::State& state) {
  const Fixture& f = fixture();
  const kvtc::HeadParams p = fitted(int(state.range(0)));
  const size_t per_block = size_t(64) * size_t(p.n_kept());
  std::vector<uint16_t> codes(size_t(f.n / 64) * per_block), codes2(codes.size());
  std::vector<double> ratios;
  for (auto _ : state) {
    double t[2];
    for (int v : {0, 1}) {
      const auto path = v ? kvtc::QuantPath::kInteger : kvtc::QuantPath::kFloat;
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t b = 0; b + 64 <= f.n; b += 64) {
        kvtc::quantize_block_path(p, &f.x[size_t(b * f.dim)], 64, (v ? codes2.data() : codes.data()) + size_t(b / 64) * per_block,
                                  path);
      }
      t[v] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    ratios.push_back(t[0] / t[1]);
  }
  size_t differ = 0;
  for (size_t i = 0; i < codes.size(); ++i) differ += codes[i] != codes2[i];
  state.counters["codes_differ"] = double(differ) / double(codes.size());
  report_ratios(state, ratios);
}

// The rANS group encoder's two forms of the state update (entropy.hpp,
// rans_encode_other_chain): this build's default against the other,
// alternating within each iteration over the head's blocks; counter
// speedup = median default time / other time (q1, q3 its quartiles): below
// 1 the default is the faster here.
void BM_EntropyChainAB(benchmark::State& state) {
  const Fixture& f = fixture();
  const kvtc::HeadParams p = fitted(int(state.range(0)));
  const std::vector<uint16_t> codes = block_codes(f, p);
  const size_t K = size_t(p.n_kept()), per_block = 64 * K;
  std::vector<const entropy::RansEncodeTable*> tables;
  for (const auto& t : p.derived().rans_encode) tables.push_back(&t);
  std::vector<double> ratios;
  for (auto _ : state) {
    double t[2];
    for (int v : {0, 1}) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int rep = 0; rep < 4; ++rep)
        for (size_t b = 0; b + per_block <= codes.size(); b += per_block)
          benchmark::DoNotOptimize(v ? entropy::rans_encode_other_chain(codes.data() + b, 64, K, tables)
                                     : entropy::rans_encode(codes.data() + b, 64, K, tables));
      t[v] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    ratios.push_back(t[0] / t[1]);
  }
  report_ratios(state, ratios);
}

void BM_EntropyEncode(benchmark::State& state) {
  const Fixture& f = fixture();
  const kvtc::HeadParams p = fitted(int(state.range(0)));
  const std::vector<uint16_t> codes = block_codes(f, p);
  const size_t per_block = size_t(64) * size_t(p.n_kept());
  for (auto _ : state)
    for (size_t b = 0; b + per_block <= codes.size(); b += per_block)
      benchmark::DoNotOptimize(kvtc::entropy_encode_codes(p, codes.data() + b, 64));
  state.SetBytesProcessed(int64_t(state.iterations()) * f.n * f.dim * 2);
}

// BM_EntropyEncode's blocks two at a time through rans_encode_pair.
void BM_EntropyEncodePair(benchmark::State& state) {
  const Fixture& f = fixture();
  const kvtc::HeadParams p = fitted(int(state.range(0)));
  const std::vector<uint16_t> codes = block_codes(f, p);
  const size_t K = size_t(p.n_kept()), per_block = size_t(64) * K;
  std::vector<const entropy::RansEncodeTable*> tables;
  for (const auto& t : p.derived().rans_encode) tables.push_back(&t);
  for (auto _ : state)
    for (size_t b = 0; b + 2 * per_block <= codes.size(); b += 2 * per_block) {
      auto two = entropy::rans_encode_pair({codes.data() + b, 64, K, &tables},
                                           {codes.data() + b + per_block, 64, K, &tables});
      benchmark::DoNotOptimize(two.first.data());
      benchmark::DoNotOptimize(two.second.data());
    }
  state.SetBytesProcessed(int64_t(state.iterations()) * f.n * f.dim * 2);
}

// The reconstruction alone (codes -> f32 block) of the head's blocks at the
// rate-allocator settings (Arg as BM_Encode's; range(1) = ReconPath: 0
// dequantize_block (auto: the integer reconstruction), 1 the float product
// with every term multiplied (the reference the float paths equal bit for
// bit), 2 zero coefficients always skipped, 3 the integer reconstruction).
// Run with --benchmark_repetitions for same-run ratios.
void BM_Reconstruct(benchmark::State& state) {
  const Fixture& f = fixture();
  const kvtc::HeadParams p = fitted(int(state.range(0)));
  const size_t K = size_t(p.n_kept());
  const std::vector<uint16_t> codes = block_codes(f, p);
  const size_t blocks = codes.size() / (64 * K);
  std::vector<float> out(size_t(64 * f.dim));
  for (auto _ : state)
    for (size_t b = 0; b < blocks; ++b) {
      kvtc::dequantize_block_path(p, codes.data() + b * 64 * K, 64, out.data(), kvtc::ReconPath(state.range(1)));
      benchmark::DoNotOptimize(out.data());
    }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(blocks) * 64 * f.dim * 2);
}

// Two reconstruction paths on the same codes (range(1) the baseline,
// range(2) the contender, both ReconPath values as in BM_Reconstruct),
// alternating block sweeps within each iteration so that machine-speed
// drift hits both: counter speedup = the median over iterations of
// (baseline time / contender time).
void BM_ReconstructAB(benchmark::State& state) {
  const Fixture& f = fixture();
  const kvtc::HeadParams p = fitted(int(state.range(0)));
  const size_t K = size_t(p.n_kept());
  const std::vector<uint16_t> codes = block_codes(f, p);
  const size_t blocks = codes.size() / (64 * K);
  std::vector<float> out(size_t(64 * f.dim));
  const auto base = kvtc::ReconPath(state.range(1)), contender = kvtc::ReconPath(state.range(2));
  std::vector<double> ratios;
  const auto sweep = [&](kvtc::ReconPath path) {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t b = 0; b < blocks; ++b) {
      kvtc::dequantize_block_path(p, codes.data() + b * 64 * K, 64, out.data(), path);
      benchmark::DoNotOptimize(out.data());
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (auto _ : state) {
    const bool base_first = ratios.size() % 2 == 0;
    const double a = sweep(base_first ? base : contender);
    const double b = sweep(base_first ? contender : base);
    ratios.push_back(base_first ? a / b : b / a);
  }
  report_ratios(state, ratios);
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(blocks) * 64 * f.dim * 2 * 2);
}

// The whole dump through the local-mode cache, as `kvcodec bench` drives it
// (issue-2 settings: rate allocator, 1% target, int8 basis; Arg = target in
// thousandths, 0 = default settings, < 0: the dp allocator at -Arg bits per
// token, the defaults before 5a44a2f that issue 16's speed item compares at): steady-state append of every layer to
// fitted caches, and for_each_block over them.
struct CacheFixture {
  std::vector<Tensor> keys, values;
  std::vector<std::unique_ptr<KVCache>> fitted;
  CacheConfig config;
  Settings settings;
  double f16_bytes = 0;
};

CacheFixture make_cache_fixture(int arg) {
  CacheFixture f;
  const std::string path = bench_dump_path();
  const SafetensorsFile file = SafetensorsFile::open(path);
  for (int i = 0; file.contains("layers." + std::to_string(i) + ".key"); ++i) {
    f.keys.push_back(Tensor::from_view(file.view4("layers." + std::to_string(i) + ".key"), DType::kF32));
    f.values.push_back(Tensor::from_view(file.view4("layers." + std::to_string(i) + ".value"), DType::kF32));
    f.f16_bytes += 2.0 * double(f.keys.back().numel()) * 2.0;
  }
  f.config.n_layers = int(f.keys.size());
  f.config.n_kv_heads = int(f.keys[0].shape()[1]);
  f.config.head_dim = int(f.keys[0].shape()[3]);
  if (arg > 0)
    f.settings = {{"allocator", "rate"}, {"target_rel_mse", std::to_string(arg / 1000.0)}, {"basis_bits", "8"}};
  if (arg < 0) f.settings = {{"allocator", "dp"}, {"bit_budget", std::to_string(-arg)}};
  for (size_t i = 0; i < f.keys.size(); ++i) {
    f.config.layer = int(i);
    f.fitted.push_back(make_cache("kvtc", f.config, f.settings));
    f.fitted.back()->append(f.keys[i].view(), f.values[i].view());
  }
  return f;
}

void BM_CacheAppendSteady(benchmark::State& state) {
  CacheFixture f = make_cache_fixture(int(state.range(0)));
  for (auto _ : state) {
    state.PauseTiming();
    // Back to the fitted first append (untimed): trim cuts the previous
    // iteration's blocks, leaving the raw tail empty as after the first append.
    for (size_t i = 0; i < f.fitted.size(); ++i) f.fitted[i]->trim(f.fitted[i]->offset() - int64_t(f.keys[i].shape()[2]));
    state.ResumeTiming();
    for (size_t i = 0; i < f.fitted.size(); ++i) f.fitted[i]->append(f.keys[i].view(), f.values[i].view());
  }
  state.SetBytesProcessed(int64_t(double(state.iterations()) * f.f16_bytes));
}

// The steady encode alone, as `kvcodec bench` times it (every layer's dump
// appended through frozen parameters), without BM_CacheAppendSteady's
// untimed trim (which re-decodes every block, most of a profile of it):
// each iteration appends to caches loaded (untimed) from the fitted caches
// saved with only their sinks. For profiling the encoder.
void BM_CacheAppendFresh(benchmark::State& state) {
  CacheFixture f = make_cache_fixture(int(state.range(0)));
  std::vector<std::vector<uint8_t>> emptied;
  for (size_t i = 0; i < f.fitted.size(); ++i) {
    f.fitted[i]->trim(f.fitted[i]->offset() - std::min<int64_t>(f.fitted[i]->offset(), 4));
    emptied.push_back(f.fitted[i]->save());
  }
  for (auto _ : state) {
    state.PauseTiming();
    for (size_t i = 0; i < f.fitted.size(); ++i) f.fitted[i] = load_cache(emptied[i].data(), emptied[i].size());
    state.ResumeTiming();
    for (size_t i = 0; i < f.fitted.size(); ++i) f.fitted[i]->append(f.keys[i].view(), f.values[i].view());
  }
  state.SetBytesProcessed(int64_t(double(state.iterations()) * f.f16_bytes));
}

void BM_CacheDecode(benchmark::State& state) {
  CacheFixture f = make_cache_fixture(int(state.range(0)));
  double sink = 0;
  for (auto _ : state)
    for (const auto& c : f.fitted)
      c->for_each_block([&](int64_t, const TensorView& k, const TensorView&) { sink += static_cast<const float*>(k.data)[0]; });
  benchmark::DoNotOptimize(sink);
  state.SetBytesProcessed(int64_t(double(state.iterations()) * f.f16_bytes));
}

// sweep(vnni) (the seconds of one pass with the VNNI tiles on or off)
// both ways per iteration, the order alternating: counter speedup = the
// median of off time / on time.
template <class Sweep>
void vnni_off_on(benchmark::State& state, const Sweep& sweep) {
  std::vector<double> ratios;
  for (auto _ : state) {
    const bool off_first = ratios.size() % 2 == 0;
    const double a = sweep(!off_first), b = sweep(off_first);
    ratios.push_back(off_first ? a / b : b / a);
  }
  report_ratios(state, ratios);
}

// The cache decode of BM_CacheDecode with the AVX512-VNNI tiles off
// (baseline: AVX2's madd then add) and on (contender), alternating within
// each iteration: counter speedup = median of off time / on time. Same
// bits either way (Codec.AvxAndPlainPathsGiveTheSameBits); on a noisy
// machine a same-process ratio is what separates a few percent.
void BM_CacheDecodeVnniAB(benchmark::State& state) {
  if (!cpu_has_vnni_paths()) {
    state.SkipWithError("this CPU has no AVX512-VNNI");
    return;
  }
  CacheFixture f = make_cache_fixture(int(state.range(0)));
  double sink = 0;
  const auto sweep = [&](bool vnni) {
    ScopedVnni mode(vnni);
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& c : f.fitted)
      c->for_each_block([&](int64_t, const TensorView& k, const TensorView&) { sink += static_cast<const float*>(k.data)[0]; });
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  vnni_off_on(state, sweep);
  benchmark::DoNotOptimize(sink);
  state.SetBytesProcessed(int64_t(double(state.iterations()) * 2 * f.f16_bytes));
}

// BM_CacheAppendFresh's steady encode with the VNNI tiles off and on, as
// BM_CacheDecodeVnniAB.
void BM_CacheAppendVnniAB(benchmark::State& state) {
  if (!cpu_has_vnni_paths()) {
    state.SkipWithError("this CPU has no AVX512-VNNI");
    return;
  }
  CacheFixture f = make_cache_fixture(int(state.range(0)));
  std::vector<std::vector<uint8_t>> emptied;
  for (size_t i = 0; i < f.fitted.size(); ++i) {
    f.fitted[i]->trim(f.fitted[i]->offset() - std::min<int64_t>(f.fitted[i]->offset(), 4));
    emptied.push_back(f.fitted[i]->save());
  }
  const auto sweep = [&](bool vnni) {
    for (size_t i = 0; i < f.fitted.size(); ++i) f.fitted[i] = load_cache(emptied[i].data(), emptied[i].size());
    ScopedVnni mode(vnni);
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < f.fitted.size(); ++i) f.fitted[i]->append(f.keys[i].view(), f.values[i].view());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  vnni_off_on(state, sweep);
  state.SetBytesProcessed(int64_t(double(state.iterations()) * 2 * f.f16_bytes));
}

}  // namespace

BENCHMARK(BM_Memcpy);
BENCHMARK(BM_OpenHeadDecode)->Arg(256)->Arg(-10);
BENCHMARK(BM_Encode)->Arg(128)->Arg(256)->Arg(-10)->Arg(-50);
BENCHMARK(BM_Decode)->Arg(128)->Arg(256)->Arg(-10)->Arg(-50);
BENCHMARK(BM_EntropyChainAB)->Arg(-10)->Arg(-50)->Arg(256);
BENCHMARK(BM_QuantizeAB)->Arg(-10)->Arg(-50)->Arg(256);
BENCHMARK(BM_Quantize)->Arg(256)->Arg(-10)->Arg(-50);
BENCHMARK(BM_EntropyEncode)->Arg(256)->Arg(-10)->Arg(-50);
BENCHMARK(BM_EntropyEncodePair)->Arg(256)->Arg(-10)->Arg(-50);
BENCHMARK(BM_Reconstruct)->ArgsProduct({{-10, -50, 256}, {0, 1, 2, 3}});
// The integer reconstruction against the float product, dense and with
// zero terms skipped.
BENCHMARK(BM_ReconstructAB)->ArgsProduct({{-10, -50, 256}, {1, 2}, {3}});
BENCHMARK(BM_CacheAppendSteady)->Arg(10)->Arg(50)->Arg(0)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CacheAppendFresh)->Arg(0)->Arg(-256)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CacheDecode)->Arg(10)->Arg(50)->Arg(0)->Arg(-256)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CacheDecodeVnniAB)->Arg(0)->Arg(-256)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CacheAppendVnniAB)->Arg(0)->Arg(-256)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();

// Entropy coder throughput on KVTC-like data: 64 tokens x 64 components per
// block, each component a discretized Gaussian with its own frozen table.
// Reported as symbols/s and (uint16) bytes/s, next to memcpy measured in the
// same run, since the shared machines are noisy: compare ratios.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "entropy/entropy.hpp"

using namespace kvcodec::entropy;

namespace {

struct Data {
  size_t rows = 0, cols = 0;
  std::vector<uint16_t> symbols;
  std::vector<FrequencyTable> ft;
  std::vector<RansDecodeTable> dt;
  std::vector<HuffmanTable> ht;
  std::vector<uint8_t> widths;
  std::vector<const FrequencyTable*> fp;
  std::vector<const RansDecodeTable*> dp;
  std::vector<const HuffmanTable*> hp;
};

// rows x cols symbols; component c has alphabet 2^bits with a spread that
// falls with c (as PCA variances do).
const Data& data(unsigned bits) {
  static std::unique_ptr<Data> cache[17];
  if (cache[bits]) return *cache[bits];
  auto d = std::make_unique<Data>();
  d->rows = 16384, d->cols = 64;
  const uint32_t alphabet = 1u << bits;
  std::mt19937_64 rng(42);
  d->symbols.resize(d->rows * d->cols);
  for (size_t c = 0; c < d->cols; ++c) {
    const double sigma = std::max(0.3, alphabet / 6.0 * std::exp(-double(c) / 40));
    std::normal_distribution<double> g(0, sigma);
    std::vector<uint64_t> counts(alphabet, 0);
    for (size_t r = 0; r < d->rows; ++r) {
      const long v = std::lround(g(rng) + (alphabet - 1) / 2.0);
      const uint16_t s = uint16_t(std::clamp<long>(v, 0, alphabet - 1));
      d->symbols[r * d->cols + c] = s;
      ++counts[s];
    }
    d->ft.push_back(FrequencyTable::from_counts(counts));
    d->ht.push_back(huffman_build(counts));
    d->widths.push_back(uint8_t(bits));
  }
  for (auto& t : d->ft) d->dt.emplace_back(t);
  for (size_t c = 0; c < d->cols; ++c) {
    d->fp.push_back(&d->ft[c]);
    d->dp.push_back(&d->dt[c]);
    d->hp.push_back(&d->ht[c]);
  }
  cache[bits] = std::move(d);
  return *cache[bits];
}

void report(benchmark::State& state, const Data& d, size_t payload) {
  const size_t n = d.rows * d.cols;
  state.SetItemsProcessed(int64_t(state.iterations() * n));
  state.SetBytesProcessed(int64_t(state.iterations() * n * sizeof(uint16_t)));
  state.counters["bits_per_sym"] = 8.0 * double(payload) / double(n);
}

void BM_Memcpy(benchmark::State& state) {
  const Data& d = data(4);
  std::vector<uint16_t> out(d.symbols.size());
  for (auto _ : state) {
    std::memcpy(out.data(), d.symbols.data(), d.symbols.size() * 2);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report(state, d, d.symbols.size() * 2);
}

void BM_RansEncode(benchmark::State& state) {
  const Data& d = data(unsigned(state.range(0)));
  size_t size = 0;
  for (auto _ : state) {
    auto bytes = rans_encode(d.symbols.data(), d.rows, d.cols, d.fp);
    size = bytes.size();
    benchmark::DoNotOptimize(bytes.data());
  }
  report(state, d, size);
}

void BM_RansDecode(benchmark::State& state) {
  const Data& d = data(unsigned(state.range(0)));
  const auto bytes = rans_encode(d.symbols.data(), d.rows, d.cols, d.fp);
  std::vector<uint16_t> out(d.symbols.size());
  for (auto _ : state) {
    rans_decode(bytes.data(), bytes.size(), d.rows, d.cols, d.dp, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  if (out != d.symbols) state.SkipWithError("rANS round trip mismatch");
  report(state, d, bytes.size());
}

// A kvtc cache's decode: blocks of 64 tokens x 64 columns, decoded
// range(1) streams per call (rans_decode_streams: 1, 2 or 4 in lockstep),
// with the group tables built once, as a cache's opened heads hold them.
void BM_RansDecodeStreams(benchmark::State& state) {
  const Data& d = data(unsigned(state.range(0)));
  const size_t per_call = size_t(state.range(1)), block = 64, n_blocks = d.rows / block;
  std::vector<std::vector<uint8_t>> blocks;
  for (size_t b = 0; b < n_blocks; ++b)
    blocks.push_back(rans_encode(d.symbols.data() + b * block * d.cols, block, d.cols, d.fp));
  const RansGroupTables groups = rans_group_tables(d.dp);
  std::vector<uint16_t> out(d.symbols.size());
  for (auto _ : state) {
    for (size_t b = 0; b < n_blocks; b += per_call) {
      RansDecodeJob jobs[kRansMaxStreams];
      for (size_t j = 0; j < per_call; ++j)
        jobs[j] = RansDecodeJob{blocks[b + j].data(), blocks[b + j].size(), block, d.cols, &d.dp,
                                out.data() + (b + j) * block * d.cols, &groups};
      rans_decode_streams(jobs, per_call);
    }
    benchmark::DoNotOptimize(out.data());
  }
  if (out != d.symbols) state.SkipWithError("rANS round trip mismatch");
  report(state, d, 0);
}

void BM_RansDecodeReference(benchmark::State& state) {
  const Data& d = data(unsigned(state.range(0)));
  const auto bytes = rans_encode_reference(d.symbols.data(), d.rows, d.cols, d.fp);
  std::vector<uint16_t> out(d.symbols.size());
  for (auto _ : state) {
    rans_decode_reference(bytes.data(), bytes.size(), d.rows, d.cols, d.fp, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  report(state, d, bytes.size());
}

void BM_HuffmanEncode(benchmark::State& state) {
  const Data& d = data(unsigned(state.range(0)));
  size_t size = 0;
  for (auto _ : state) {
    auto bytes = huffman_encode(d.symbols.data(), d.rows, d.cols, d.hp);
    size = bytes.size();
    benchmark::DoNotOptimize(bytes.data());
  }
  report(state, d, size);
}

void BM_HuffmanDecode(benchmark::State& state) {
  const Data& d = data(unsigned(state.range(0)));
  const auto bytes = huffman_encode(d.symbols.data(), d.rows, d.cols, d.hp);
  std::vector<uint16_t> out(d.symbols.size());
  for (auto _ : state) {
    huffman_decode(bytes.data(), bytes.size(), d.rows, d.cols, d.hp, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  if (out != d.symbols) state.SkipWithError("Huffman round trip mismatch");
  report(state, d, bytes.size());
}

void BM_FixedUnpack(benchmark::State& state) {
  const Data& d = data(unsigned(state.range(0)));
  const auto bytes = pack_fixed(d.symbols.data(), d.rows, d.cols, d.widths);
  std::vector<uint16_t> out(d.symbols.size());
  for (auto _ : state) {
    unpack_fixed(bytes.data(), bytes.size(), d.rows, d.cols, d.widths, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  if (out != d.symbols) state.SkipWithError("fixed round trip mismatch");
  report(state, d, bytes.size());
}

}  // namespace

BENCHMARK(BM_Memcpy);
BENCHMARK(BM_RansEncode)->Arg(4)->Arg(8);
BENCHMARK(BM_RansDecode)->Arg(4)->Arg(8);
BENCHMARK(BM_RansDecodeReference)->Arg(4);
BENCHMARK(BM_RansDecodeStreams)->ArgsProduct({{4, 5}, {1, 2, 4}});
BENCHMARK(BM_HuffmanEncode)->Arg(4)->Arg(8);
BENCHMARK(BM_HuffmanDecode)->Arg(4)->Arg(8);
BENCHMARK(BM_FixedUnpack)->Arg(4);
BENCHMARK_MAIN();

// The compressed KV offload tier (KvOffloadTier) against an uncompressed
// pinned host copy, for a model of LAYERS layers x ROWS KV heads of D =
// the calibration's n_kv_heads * head_dim (Llama-3-8B: 32 x 8 x 128 with
// tinycode's 2 x 64 calibration), bf16, TOKENS tokens.
//
// The KV is real: model layer l holds calibration layer l % n_layers of the
// tinycode dump, each KV head a row tiled from the dump
// (bench::tiled_dump_rows: row b starts 131 b tokens further on; keys
// re-rotated at their new positions). So layers l and l + 6 carry the same
// values; each layer is still coded, copied and decoded on its own.
//
// Times (median of REPS, wall clock until the stream is done, and GPU time
// between events): restore from the compressed host copy (TF32 and exact
// reconstruction, 4 decode lanes; TF32 with 1 lane), its parts alone (the H2D copies of the compressed bytes;
// the decodes from device-resident payloads), the restore from an
// uncompressed pinned host copy (one cudaMemcpyAsync per layer), and a
// device-to-device copy of the KV. Checks the last layer of the restore
// against the CPU reference decode of its host bytes (exact: equal; TF32:
// within the stated bound). One JSON line per token count.
// Usage: offload_bench CAL.kvcal KV_DUMP TOKENS[,TOKENS...] [LAYERS=32] [ROWS=8] [SINKS=4] [WINDOW=8] [REPS=11]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cache/kvtc_calibrated.hpp"
#include "gpu/kvtc_variant.hpp"
#include "gpu_bench_dump.hpp"
#include "gpu_bench_util.hpp"
#include "kvcodec/gpu.hpp"
#include "kvcodec/safetensors.hpp"

using namespace kvcodec;
using Recon = gpu::KvtcGpuCodec::Reconstruction;

namespace {

struct Run {
  int layers, rows, sinks, window, reps;
};

// One token count; returns false when a check failed.
bool run(const KvtcCalibration& cal, const SafetensorsFile& f, int64_t S, const Run& r) {
  const int Lc = cal.n_layers, D = cal.vector_dim();
  const size_t layer_elems = size_t(2) * size_t(r.rows) * size_t(S) * size_t(D), layer_bytes = layer_elems * 2;
  // Host KV of each calibration layer [2, rows, S, D] and its device copy.
  std::vector<std::vector<uint16_t>> host(static_cast<size_t>(Lc), std::vector<uint16_t>(layer_elems));
  std::vector<uint16_t*> src(static_cast<size_t>(Lc));
  for (int c = 0; c < Lc; ++c) {
    for (const bool key : {true, false})
      bench::tiled_dump_rows(f, cal, c, key, r.rows, S, host[size_t(c)].data() + (key ? 0 : layer_elems / 2));
    CK(cudaMalloc(&src[size_t(c)], layer_bytes));
    CK(cudaMemcpy(src[size_t(c)], host[size_t(c)].data(), layer_bytes, cudaMemcpyHostToDevice));
  }
  std::vector<int> cal_layers;
  std::vector<const uint16_t*> in;
  std::vector<uint16_t*> out(size_t(r.layers));
  for (int l = 0; l < r.layers; ++l) {
    cal_layers.push_back(l % Lc);
    in.push_back(src[size_t(l % Lc)]);
    CK(cudaMalloc(&out[size_t(l)], layer_bytes));
  }
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  gpu::KvOffloadTier tier(cal, cal_layers, r.rows, S, r.sinks, r.window);

  const auto t0 = std::chrono::steady_clock::now();
  const gpu::OffloadedKv h = tier.offload(in, S, s);
  const double offload_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const uint64_t kv_bytes = uint64_t(r.layers) * layer_bytes;

  // Exact restore of the last layer against the CPU reference decode of its host bytes.
  const int last = r.layers - 1;
  const gpu::FlatKvtcTables t = gpu::flatten_calibration(cal, {cal_layers[size_t(last)]}, r.rows, S, r.sinks, r.window);
  std::vector<uint16_t> y_ref(layer_elems), y(layer_elems);
  gpu::decode_batch_reference(t, h.payload(last), h.payload_size(last), h.offsets(last), S, 64, y_ref.data());
  tier.set_reconstruction(Recon::kExactFp32);
  const bench::StreamTimes exact = bench::median_stream_ms(s, [&] { tier.restore(h, out, s); }, r.reps);
  tier.check_errors(s);
  CK(cudaMemcpy(y.data(), out[size_t(last)], layer_bytes, cudaMemcpyDeviceToHost));
  const bool exact_equal = y == y_ref;
  tier.set_reconstruction(Recon::kTf32TensorCores);
  CK(cudaMemset(out[size_t(last)], 0xff, layer_bytes));
  const bench::StreamTimes tc = bench::median_stream_ms(s, [&] { tier.restore(h, out, s); }, r.reps);
  tier.check_errors(s);
  CK(cudaMemcpy(y.data(), out[size_t(last)], layer_bytes, cudaMemcpyDeviceToHost));
  size_t tc_diff = 0;
  const size_t tc_viol = gpu::tf32_bound_violations(t, t.n_heads, host[size_t(cal_layers[size_t(last)])].data(), S,
                                                    y.data(), y_ref.data(), &tc_diff);
  const double rel_mse = bench::rel_mse(host[size_t(cal_layers[size_t(last)])].data(), y.data(), layer_elems);
  // The integer reconstruction (kInteger): the reference's integer path, bit for bit.
  std::vector<uint16_t> y_int_ref(layer_elems);
  gpu::decode_batch_reference(t, h.payload(last), h.payload_size(last), h.offsets(last), S, 64, y_int_ref.data(), 0,
                              /*integer_reconstruction=*/true);
  tier.set_reconstruction(Recon::kInteger);
  CK(cudaMemset(out[size_t(last)], 0xff, layer_bytes));
  const bench::StreamTimes integer = bench::median_stream_ms(s, [&] { tier.restore(h, out, s); }, r.reps);
  tier.check_errors(s);
  std::vector<uint16_t> y_int(layer_elems);
  CK(cudaMemcpy(y_int.data(), out[size_t(last)], layer_bytes, cudaMemcpyDeviceToHost));
  const bool int_equal = y_int == y_int_ref;
  tier.set_reconstruction(Recon::kTf32TensorCores);
  // The same restore with one decode lane (layers strictly one after another).
  tier.set_decode_lanes(1);
  const bench::StreamTimes tc_1lane = bench::median_stream_ms(s, [&] { tier.restore(h, out, s); }, r.reps);
  tier.check_errors(s);
  tier.set_decode_lanes(4);

  // The parts alone: every layer's compressed block copied H2D into one
  // device buffer; the decodes (TF32) from device-resident blocks.
  const uint64_t host_total = h.host_bytes();
  std::vector<uint8_t*> dev_payload(size_t(r.layers));
  std::vector<uint64_t*> dev_off(size_t(r.layers));
  for (int l = 0; l < r.layers; ++l) {
    CK(cudaMalloc(&dev_payload[size_t(l)], h.payload_size(l)));
    CK(cudaMalloc(&dev_off[size_t(l)], size_t(h.n_offsets(l)) * 8));
    CK(cudaMemcpy(dev_payload[size_t(l)], h.payload(l), h.payload_size(l), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dev_off[size_t(l)], h.offsets(l), size_t(h.n_offsets(l)) * 8, cudaMemcpyHostToDevice));
  }
  const bench::StreamTimes h2d_compressed = bench::median_stream_ms(s, [&] {
    for (int l = 0; l < r.layers; ++l)
      CK(cudaMemcpyAsync(dev_payload[size_t(l)], h.payload(l), h.payload_size(l), cudaMemcpyHostToDevice, s));
  }, r.reps);
  // One codec per calibration layer, as the tier holds them.
  std::vector<std::unique_ptr<gpu::KvtcGpuCodec>> codecs;
  for (int c = 0; c < Lc; ++c) {
    codecs.push_back(std::make_unique<gpu::KvtcGpuCodec>(cal, gpu::CalibratedLayout{{c}, r.rows, S, r.sinks, r.window}));
    codecs.back()->set_reconstruction(Recon::kTf32TensorCores);
  }
  const bench::StreamTimes decode_only = bench::median_stream_ms(s, [&] {
    for (int l = 0; l < r.layers; ++l)
      codecs[size_t(l % Lc)]->decode(dev_payload[size_t(l)], h.payload_size(l), dev_off[size_t(l)], S, out[size_t(l)], s);
  }, r.reps);
  for (auto& c : codecs) c->check_errors(s);

  // Uncompressed offload: one pinned host copy per layer, one H2D copy each.
  std::vector<uint16_t*> raw(size_t(r.layers));
  for (int l = 0; l < r.layers; ++l) {
    CK(cudaHostAlloc(reinterpret_cast<void**>(&raw[size_t(l)]), layer_bytes, cudaHostAllocDefault));
    std::copy(host[size_t(l % Lc)].begin(), host[size_t(l % Lc)].end(), raw[size_t(l)]);
  }
  const bench::StreamTimes uncompressed = bench::median_stream_ms(s, [&] {
    for (int l = 0; l < r.layers; ++l)
      CK(cudaMemcpyAsync(out[size_t(l)], raw[size_t(l)], layer_bytes, cudaMemcpyHostToDevice, s));
  }, r.reps);
  const bench::StreamTimes d2d = bench::median_stream_ms(s, [&] {
    for (int l = 0; l < r.layers; ++l)
      CK(cudaMemcpyAsync(out[size_t(l)], src[size_t(l % Lc)], layer_bytes, cudaMemcpyDeviceToDevice, s));
  }, r.reps);
  CK(cudaMemcpy(y.data(), out[size_t(last)], layer_bytes, cudaMemcpyDeviceToHost));
  const bool raw_equal = y == host[size_t(cal_layers[size_t(last)])];

  const double gb = 1e-6;  // bytes per ms -> GB/s
  std::printf(
      "{\"tokens\": %lld, \"layers\": %d, \"kv_heads\": %d, \"dim\": %d, \"sinks\": %d, \"window\": %d, "
      "\"kv_bytes\": %llu, \"host_compressed_bytes\": %llu, \"ratio\": %.3f, \"rel_mse_last_layer\": %.4g, "
      "\"offload_wall_ms\": %.2f, "
      "\"restore_compressed_tf32_ms\": %.3f, \"restore_compressed_tf32_gpu_ms\": %.3f, "
      "\"restore_compressed_tf32_1lane_ms\": %.3f, "
      "\"restore_compressed_exact_ms\": %.3f, \"restore_compressed_exact_gpu_ms\": %.3f, "
      "\"h2d_compressed_only_ms\": %.3f, \"decode_only_tf32_ms\": %.3f, "
      "\"restore_uncompressed_ms\": %.3f, \"restore_uncompressed_gpu_ms\": %.3f, \"h2d_gb_s\": %.1f, "
      "\"d2d_copy_ms\": %.3f, \"speedup_vs_uncompressed\": %.2f, \"kv_restored_gb_s\": %.1f, "
      "\"check_exact_equal_cpu\": %s, \"check_tf32_bound_violations\": %zu, \"check_tf32_outputs\": %zu, "
      "\"check_tf32_differ\": %zu, \"check_uncompressed_equal\": %s, \"restore_compressed_int_ms\": %.3f, "
      "\"restore_compressed_int_gpu_ms\": %.3f, \"speedup_int_vs_uncompressed\": %.2f, \"check_int_equal_cpu\": %s}\n",
      (long long)S, r.layers, r.rows, D, r.sinks, r.window, (unsigned long long)kv_bytes,
      (unsigned long long)host_total, double(kv_bytes) / double(host_total), rel_mse, offload_ms, tc.wall_ms, tc.gpu_ms,
      tc_1lane.wall_ms, exact.wall_ms, exact.gpu_ms, h2d_compressed.wall_ms, decode_only.wall_ms, uncompressed.wall_ms,
      uncompressed.gpu_ms, double(kv_bytes) * gb / uncompressed.gpu_ms, d2d.wall_ms, uncompressed.wall_ms / tc.wall_ms,
      double(kv_bytes) * gb / tc.wall_ms, exact_equal ? "true" : "false", tc_viol, layer_elems, tc_diff,
      raw_equal ? "true" : "false", integer.wall_ms, integer.gpu_ms, uncompressed.wall_ms / integer.wall_ms,
      int_equal ? "true" : "false");
  std::fflush(stdout);
  for (auto* p : raw) CK(cudaFreeHost(p));
  for (auto* p : dev_payload) CK(cudaFree(p));
  for (auto* p : dev_off) CK(cudaFree(p));
  for (auto* p : out) CK(cudaFree(p));
  for (auto* p : src) CK(cudaFree(p));
  CK(cudaStreamDestroy(s));
  return exact_equal && tc_viol == 0 && raw_equal && int_equal;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s CAL.kvcal KV_DUMP TOKENS[,TOKENS...] [LAYERS] [ROWS] [SINKS] [WINDOW] [REPS]\n",
                 argv[0]);
    return 1;
  }
  const KvtcCalibration cal = KvtcCalibration::read_file(argv[1]);
  const SafetensorsFile f = SafetensorsFile::open(argv[2]);
  if (bench::dump_layers(f) < cal.n_layers) {
    std::fprintf(stderr, "the dump has %d layers, the calibration %d\n", bench::dump_layers(f), cal.n_layers);
    return 1;
  }
  const auto arg = [&](int i, int fallback) { return argc > i ? std::atoi(argv[i]) : fallback; };
  const Run r{arg(4, 32), arg(5, 8), arg(6, 4), arg(7, 8), arg(8, 11)};
  bool ok = true;
  std::stringstream list(argv[3]);
  for (std::string tok; std::getline(list, tok, ',');) ok = run(cal, f, std::atoll(tok.c_str()), r) && ok;
  return ok ? 0 : 2;
}

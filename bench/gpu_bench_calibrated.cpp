// The calibrated format on the GPU at a calibration's settings: every layer
// of the calibration x {K, V} x BATCH rows x S tokens of real KV (the dump's
// tokens, RoPE removed at their own positions, tiled along the sequence with
// a per-row offset and rotated again at their new positions), bf16
// [S, H * D] per head. Times encode, exact decode, fused TF32 decode, the
// two-kernel TF32 decode and the integer decode (both also pipelined over
// 2, 4 and 8 head ranges) against a device-to-device copy in the same run; checks two heads (layer 0's key and value of row 0) against the CPU
// reference: bytes, exact reconstruction, TF32 bound; the fused integer
// decode against the two-kernel one. Prints one JSON line.
// Usage: gpu_bench_calibrated CAL.kvcal KV_DUMP [BATCH=21] [S=16384] [SINKS=4] [WINDOW=128]
// (KVCODEC_BENCH_ONLY=int: encode, then one integer decode, for profilers.)
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cache/kvtc_calibrated.hpp"
#include "gpu/kvtc_variant.hpp"
#include "gpu_bench_dump.hpp"
#include "gpu_bench_util.hpp"
#include "kvcodec/gpu.hpp"
#include "kvcodec/safetensors.hpp"
#include "kvcodec/tensor.hpp"

using namespace kvcodec;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s CAL.kvcal KV_DUMP [BATCH] [S] [SINKS] [WINDOW]\n", argv[0]);
    return 1;
  }
  const KvtcCalibration cal = KvtcCalibration::read_file(argv[1]);
  const SafetensorsFile f = SafetensorsFile::open(argv[2]);
  const int B = argc > 3 ? std::atoi(argv[3]) : 21;
  const int64_t S = argc > 4 ? std::atoll(argv[4]) : 16384;
  const int sinks = argc > 5 ? std::atoi(argv[5]) : 4, window = argc > 6 ? std::atoi(argv[6]) : 128;
  const int L = cal.n_layers, D = cal.vector_dim();
  if (bench::dump_layers(f) < L) {
    std::fprintf(stderr, "the dump has %d layers, the calibration %d\n", bench::dump_layers(f), L);
    return 1;
  }
  const int NH = L * 2 * B;
  const size_t elems = size_t(NH) * size_t(S) * size_t(D), bytes = elems * 2;
  std::vector<uint16_t> x(elems);
  for (int l = 0; l < L; ++l)
    for (const bool is_key : {true, false})
      bench::tiled_dump_rows(f, cal, l, is_key, B, S, x.data() + size_t((l * 2 + (is_key ? 0 : 1)) * B) * size_t(S) * size_t(D));
  std::vector<int> layers;
  for (int l = 0; l < L; ++l) layers.push_back(l);
  gpu::KvtcGpuCodec codec(cal, gpu::CalibratedLayout{layers, B, S, sinks, window});
  const uint64_t cap = codec.max_encoded_bytes(S);
  const int64_t ns = codec.n_streams(S);
  uint16_t *dx, *dy, *dcopy;
  uint8_t* dout;
  uint64_t* doff;
  CK(cudaMalloc(&dx, bytes));
  CK(cudaMalloc(&dy, bytes));
  CK(cudaMalloc(&dcopy, bytes));
  CK(cudaMalloc(&dout, cap));
  CK(cudaMalloc(&doff, size_t(ns + 1) * 8));
  CK(cudaMemcpy(dx, x.data(), bytes, cudaMemcpyHostToDevice));
  using Recon = gpu::KvtcGpuCodec::Reconstruction;
  uint64_t total = 0;
  const double copy_ms = bench::median_ms([&] { CK(cudaMemcpyAsync(dcopy, dx, bytes, cudaMemcpyDeviceToDevice)); }, 10);
  const double enc_ms = bench::median_ms([&] { total = codec.encode(dx, S, dout, cap, doff); }, 7);
  // The median of 11 decodes in the codec's current mode; its output into `out`.
  const auto timed_decode = [&](std::vector<uint16_t>& out) {
    const double ms = bench::median_ms([&] { codec.decode(dout, total, doff, S, dy); }, 11);
    codec.check_errors();
    out.resize(elems);
    CK(cudaMemcpy(out.data(), dy, bytes, cudaMemcpyDeviceToHost));
    return ms;
  };
  if (const char* only = std::getenv("KVCODEC_BENCH_ONLY"); only && std::string(only) == "int") {
    // One integer split decode and nothing else: a profiler's first launch
    // of each decode kernel is then this path's (ncu --launch-count 1).
    codec.set_reconstruction(Recon::kInteger);
    codec.decode(dout, total, doff, S, dy);
    codec.check_errors();
    std::printf("{\"only\": \"int\", \"encode_ms\": %.3f}\n", enc_ms);
    return 0;
  }
  std::vector<uint16_t> y, y_tc, y_split, y_int, y_int_fused;
  const double dec_ms = timed_decode(y);
  codec.set_reconstruction(Recon::kTf32TensorCores);
  codec.set_fused_decode(true);
  const double dec_tc_ms = timed_decode(y_tc);
  codec.set_fused_decode(false);
  const double dec_split_ms = timed_decode(y_split);
  // The current decode pipelined over head ranges (set_pipeline_chunks: the
  // rANS decode of range c + 1 beside the reconstruction of range c):
  // "chunks, ms" pairs, each output checked equal to `plain`.
  bool piped_equal = true;
  const auto pipelined = [&](const std::vector<uint16_t>& plain) {
    std::string json;
    std::vector<uint16_t> y_piped;
    for (const int chunks : {2, 4, 8}) {
      codec.set_pipeline_chunks(chunks);
      const double ms = timed_decode(y_piped);
      piped_equal = piped_equal && y_piped == plain;
      json += (json.empty() ? "" : ", ") + std::to_string(chunks) + ", " + std::to_string(ms);
    }
    codec.set_pipeline_chunks(1);
    return json;
  };
  const std::string piped_json = pipelined(y_split);
  // The integer reconstruction (the CPU codec's dequantize_block on tensor cores).
  codec.set_reconstruction(Recon::kInteger);
  const double dec_int_ms = timed_decode(y_int);
  // Fused: rANS decode into shared memory, reconstruction from there.
  codec.set_fused_decode(true);
  const double dec_int_fused_ms = timed_decode(y_int_fused);
  codec.set_fused_decode(false);
  const bool int_fused_equal = y_int_fused == y_int;
  // Pipelined too: its rANS decode (issue-bound) and integer MMAs use
  // different units, so ranges side by side might overlap where TF32's did not.
  const std::string int_piped_json = pipelined(y_int);
  codec.set_phase_timing(true);
  codec.decode(dout, total, doff, S, dy);
  const std::vector<double> int_ph = codec.last_phase_ms();
  codec.set_reconstruction(Recon::kTf32TensorCores);
  codec.decode(dout, total, doff, S, dy);
  const std::vector<double> split_ph = codec.last_phase_ms();
  codec.set_reconstruction(Recon::kExactFp32);
  codec.encode(dx, S, dout, cap, doff);
  const std::vector<double> enc_ph = codec.last_phase_ms();
  codec.set_phase_timing(false);
  codec.check_errors();

  // Check layer 0's key and value heads of row 0 (heads 0 and B).
  const gpu::FlatKvtcTables t = gpu::flatten_calibration(cal, {0}, 1, S, sinks, window);
  std::vector<uint16_t> x2(size_t(2) * size_t(S) * size_t(D));
  const size_t head = size_t(S) * size_t(D);
  std::copy_n(x.data(), head, x2.data());
  std::copy_n(x.data() + size_t(B) * head, head, x2.data() + head);
  const gpu::EncodedBatch ref = gpu::encode_batch_reference(t, x2.data(), S, 64);
  std::vector<uint64_t> off(size_t(ns + 1));
  CK(cudaMemcpy(off.data(), doff, off.size() * 8, cudaMemcpyDeviceToHost));
  const int64_t nb = ns / NH;
  bool bytes_equal = true;
  for (const int64_t g : {int64_t(0), int64_t(B)}) {  // GPU head -> reference head 0 / 1
    const int64_t r = g == 0 ? 0 : 1;
    for (int64_t i = 0; i < nb; ++i) {
      const uint64_t a = off[size_t(g * nb + i)], e = off[size_t(g * nb + i + 1)];
      const uint64_t ra = ref.offsets[size_t(r * nb + i)], re = ref.offsets[size_t(r * nb + i + 1)];
      std::vector<uint8_t> got(e - a);
      CK(cudaMemcpy(got.data(), dout + a, got.size(), cudaMemcpyDeviceToHost));
      bytes_equal = bytes_equal && e - a == re - ra && std::equal(got.begin(), got.end(), ref.payload.begin() + long(ra));
    }
  }
  std::vector<uint16_t> y_ref(x2.size()), y2(x2.size()), y2_tc(x2.size());
  gpu::decode_batch_reference(t, ref.payload.data(), ref.payload.size(), ref.offsets.data(), S, 64, y_ref.data());
  std::copy_n(y.data(), head, y2.data());
  std::copy_n(y.data() + size_t(B) * head, head, y2.data() + head);
  std::copy_n(y_tc.data(), head, y2_tc.data());
  std::copy_n(y_tc.data() + size_t(B) * head, head, y2_tc.data() + head);
  const bool recon_equal = y2 == y_ref;
  std::vector<uint16_t> y_int_ref(x2.size()), y2_int(x2.size());
  gpu::decode_batch_reference(t, ref.payload.data(), ref.payload.size(), ref.offsets.data(), S, 64, y_int_ref.data(), 0,
                              /*integer_reconstruction=*/true);
  std::copy_n(y_int.data(), head, y2_int.data());
  std::copy_n(y_int.data() + size_t(B) * head, head, y2_int.data() + head);
  const bool int_equal = y2_int == y_int_ref && t.recon_int[0] && t.recon_int[1];
  size_t tc_diff = 0;
  const size_t tc_viol = gpu::tf32_bound_violations(t, 2, x2.data(), S, y2_tc.data(), y_ref.data(), &tc_diff);
  const bool fused_equals_split = y_tc == y_split;
  const double gbs = 1e-6;  // bytes per ms -> GB/s
  std::printf(
      "{\"calibration\": \"%s\", \"layers\": %d, \"batch\": %d, \"tokens\": %lld, \"dim\": %d, \"sinks\": %d, "
      "\"window\": %d, \"bf16_bytes\": %zu, \"compressed_bytes\": %llu, \"ratio\": %.3f, \"rel_mse\": %.3g, "
      "\"copy_ms\": %.3f, \"copy_gb_s\": %.1f, \"encode_ms\": %.3f, \"encode_gb_s\": %.1f, \"encode_frac_copy\": %.3f, "
      "\"decode_exact_ms\": %.3f, \"decode_exact_gb_s\": %.1f, \"decode_exact_frac_copy\": %.3f, "
      "\"decode_tc_fused_ms\": %.3f, \"decode_tc_fused_gb_s\": %.1f, \"decode_tc_fused_frac_copy\": %.3f, "
      "\"decode_tc_split_ms\": %.3f, \"decode_tc_split_phases_ms\": [%.3f, %.3f], "
      "\"decode_tc_split_pipelined_chunks_ms\": [%s], \"pipelined_equals_split\": %s, "
      "\"encode_phases_ms\": [%.3f, %.3f, %.3f], \"bytes_equal_cpu\": %s, \"recon_equal_cpu\": %s, "
      "\"fused_equals_split\": %s, \"tc_checked_outputs\": %zu, \"tc_outputs_differ\": %zu, "
      "\"tc_bound_violations\": %zu, \"decode_int_ms\": %.3f, \"decode_int_gb_s\": %.1f, \"decode_int_frac_copy\": %.3f, "
      "\"decode_int_phases_ms\": [%.3f, %.3f], \"decode_int_pipelined_chunks_ms\": [%s], \"int_equal_cpu\": %s, "
      "\"rel_mse_int\": %.3g, \"decode_int_fused_ms\": %.3f, \"decode_int_fused_frac_copy\": %.3f, "
      "\"int_fused_equals_split\": %s}\n",
      argv[1], L, B, (long long)S, D, sinks, window, bytes, (unsigned long long)total, double(bytes) / double(total),
      bench::rel_mse(x.data(), y.data(), elems), copy_ms, bytes * gbs / copy_ms, enc_ms, bytes * gbs / enc_ms, copy_ms / enc_ms, dec_ms,
      bytes * gbs / dec_ms, copy_ms / dec_ms, dec_tc_ms, bytes * gbs / dec_tc_ms, copy_ms / dec_tc_ms, dec_split_ms,
      split_ph.size() > 1 ? split_ph[0] : -1.0, split_ph.size() > 1 ? split_ph[1] : -1.0, piped_json.c_str(),
      piped_equal ? "true" : "false",
      enc_ph.size() > 2 ? enc_ph[0] : -1.0, enc_ph.size() > 2 ? enc_ph[1] : -1.0, enc_ph.size() > 2 ? enc_ph[2] : -1.0,
      bytes_equal ? "true" : "false", recon_equal ? "true" : "false", fused_equals_split ? "true" : "false",
      y2_tc.size(), tc_diff, tc_viol, dec_int_ms, bytes * gbs / dec_int_ms, copy_ms / dec_int_ms,
      int_ph.size() > 1 ? int_ph[0] : -1.0, int_ph.size() > 1 ? int_ph[1] : -1.0, int_piped_json.c_str(), int_equal ? "true" : "false",
      bench::rel_mse(x.data(), y_int.data(), elems), dec_int_fused_ms, copy_ms / dec_int_fused_ms,
      int_fused_equal ? "true" : "false");
  return bytes_equal && recon_equal && fused_equals_split && piped_equal && tc_viol == 0 && int_equal && int_fused_equal
             ? 0
             : 2;
}

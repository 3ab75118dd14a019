// GPU kvtc-gpu/1 throughput on a realistic batch: NH heads x S tokens x D
// bf16 on the device, encode and decode timed with CUDA events, against the
// device-to-device copy bandwidth measured in the same run. Checks the GPU
// bytes against the CPU reference on a slice first. Prints one JSON line.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gpu_bench_util.hpp"
#include "gpu/kvtc_variant.hpp"
#include "gpu/palu_reference.hpp"
#include "kvcodec/gpu.hpp"
#include "kvcodec/safetensors.hpp"
#include "kvcodec/tensor.hpp"
#include "kvtc/codec.hpp"
#include "linalg/pca.hpp"
#include "palu/projection.hpp"

using namespace kvcodec;

int main(int argc, char** argv) {
  const int layers = argc > 1 ? std::atoi(argv[1]) : 32;
  const int kv_heads = argc > 2 ? std::atoi(argv[2]) : 8;
  const int64_t S = argc > 3 ? std::atoll(argv[3]) : 16384;
  const char* dump = argc > 4 ? argv[4] : nullptr;
  const int D = 128;
  const int NH = layers * kv_heads;
  // Base heads: real KV rows (the dump's head_dim 64 tiled twice along D, so
  // the spectrum is the dump's) when a dump is given, else correlated Gaussian.
  const int n_base = 8;
  const int64_t base_tokens = 2048;
  std::vector<std::vector<uint16_t>> base(n_base);
  std::mt19937 rng(7);
  std::normal_distribution<float> g;
  if (dump) {
    const SafetensorsFile f = SafetensorsFile::open(dump);
    const int n_layers = bench::dump_layers(f);  // any depth (was: 6, tinycode's)
    if (n_layers == 0) {
      std::fprintf(stderr, "%s holds no tensor 'layers.0.key'\n", dump);
      return 1;
    }
    for (int b = 0; b < n_base; ++b) {
      const Tensor t = f.tensor("layers." + std::to_string(b % n_layers) + (b % 2 ? ".value" : ".key"), DType::kF32);
      const Shape4 s = t.shape();
      const float* p = t.data_as<float>() + (b / n_layers % s[1]) * s[2] * s[3];
      for (int64_t i = 0; i < base_tokens; ++i)
        for (int d = 0; d < D; ++d)
          base[size_t(b)].push_back(gpu::f32_to_bf16_rne(p[(i % s[2]) * s[3] + d % s[3]] * (d < s[3] ? 1.0f : -0.5f) +
                                                         0.01f * g(rng)));
    }
  } else {
    for (int b = 0; b < n_base; ++b) {
      std::vector<float> mix(size_t(D * D));
      for (auto& m : mix) m = g(rng) / std::sqrt(float(D));
      std::vector<float> z(static_cast<size_t>(D));
      for (int64_t i = 0; i < base_tokens; ++i) {
        for (int k = 0; k < D; ++k) z[size_t(k)] = g(rng) * 4.0f * std::exp(-0.05f * float(k));
        for (int d = 0; d < D; ++d) {
          float acc = 0.2f * float(d % 5);
          for (int k = 0; k < D; ++k) acc += mix[size_t(d * D + k)] * z[size_t(k)];
          base[size_t(b)].push_back(gpu::f32_to_bf16_rne(acc));
        }
      }
    }
  }
  std::vector<kvtc::HeadParams> params;
  for (int b = 0; b < n_base; ++b) {
    std::vector<float> xf(base[size_t(b)].size());
    for (size_t i = 0; i < xf.size(); ++i) xf[i] = gpu::bf16_bits_to_f32(base[size_t(b)][i]);
    const linalg::PcaBasis pca = linalg::fit_pca(xf.data(), base_tokens, D);
    kvtc::CodecOptions o;  // default budget 4*D bits per token, rANS
    params.push_back(kvtc::fit_head(xf.data(), base_tokens, D, pca.mean, pca.components, pca.eigenvalues, o));
  }
  std::vector<const kvtc::HeadParams*> ptrs;
  for (int h = 0; h < NH; ++h) ptrs.push_back(&params[size_t(h % n_base)]);

  const size_t elems = size_t(NH) * size_t(S) * D, bytes = elems * 2;
  std::vector<uint16_t> x(elems);
  for (int h = 0; h < NH; ++h)
    for (int64_t t = 0; t < S; ++t)
      std::copy_n(base[size_t(h % n_base)].data() + size_t((t + 131 * h) % base_tokens) * D, D,
                  x.data() + (size_t(h) * size_t(S) + size_t(t)) * D);

  gpu::KvtcGpuCodec codec(ptrs, S);
  uint16_t *dx, *dy, *dcopy;
  uint8_t* dout;
  uint64_t* doff;
  const uint64_t cap = codec.max_encoded_bytes(S);
  const int64_t ns = codec.n_streams(S);
  CK(cudaMalloc(&dx, bytes));
  CK(cudaMalloc(&dy, bytes));
  CK(cudaMalloc(&dcopy, bytes));
  CK(cudaMalloc(&dout, cap));
  CK(cudaMalloc(&doff, size_t(ns + 1) * 8));
  CK(cudaMemcpy(dx, x.data(), bytes, cudaMemcpyHostToDevice));
  auto time_ms = [](auto&& fn, int reps) { return bench::median_ms(fn, reps); };
  const double copy_ms = time_ms([&] { CK(cudaMemcpyAsync(dcopy, dx, bytes, cudaMemcpyDeviceToDevice)); }, 10);
  uint64_t total = 0;
  const double enc_ms = time_ms([&] { total = codec.encode(dx, S, dout, cap, doff); }, 7);
  const double dec_ms = time_ms([&] { codec.decode(dout, total, doff, S, dy); }, 11);
  codec.check_errors();
  // The same with pipelining (8 head ranges, two streams).
  codec.set_pipeline_chunks(8);
  const double enc_seq_ms = time_ms([&] { total = codec.encode(dx, S, dout, cap, doff); }, 5);
  const double dec_seq_ms = time_ms([&] { codec.decode(dout, total, doff, S, dy); }, 5);
  codec.check_errors();
  codec.set_pipeline_chunks(1);
  // Decode with the tensor-core (TF32) reconstruction, same streams.
  using Recon = gpu::KvtcGpuCodec::Reconstruction;
  codec.set_reconstruction(Recon::kTf32TensorCores);
  const double dec_tc_ms = time_ms([&] { codec.decode(dout, total, doff, S, dy); }, 11);
  codec.check_errors();
  codec.set_fused_decode(true);  // one kernel (codes in shared memory only)
  const double dec_tc_fused_ms = time_ms([&] { codec.decode(dout, total, doff, S, dy); }, 11);
  codec.check_errors();
  codec.set_fused_decode(false);
  codec.set_pipeline_chunks(8);
  const double dec_tc_pipe_ms = time_ms([&] { codec.decode(dout, total, doff, S, dy); }, 5);
  codec.check_errors();
  codec.set_pipeline_chunks(1);
  codec.set_phase_timing(true);
  codec.decode(dout, total, doff, S, dy);
  const std::vector<double> dec_tc_ph = codec.last_phase_ms();
  codec.check_errors();
  codec.set_phase_timing(false);
  const int check_heads_tc = 4;
  std::vector<uint16_t> y_tc(size_t(check_heads_tc) * size_t(S) * D);
  CK(cudaMemcpy(y_tc.data(), dy, y_tc.size() * 2, cudaMemcpyDeviceToHost));
  codec.set_reconstruction(Recon::kExactFp32);
  // Where the time goes: one more call of each with events between kernels.
  codec.set_phase_timing(true);
  codec.encode(dx, S, dout, cap, doff);
  const std::vector<double> enc_ph = codec.last_phase_ms();
  codec.decode(dout, total, doff, S, dy);
  const std::vector<double> dec_ph = codec.last_phase_ms();
  codec.check_errors();
  codec.set_phase_timing(false);

  // Check: the first 4 heads' bytes and reconstructions against the CPU reference.
  const int check_heads = 4;
  const gpu::FlatKvtcTables t = gpu::flatten_heads(std::vector<const kvtc::HeadParams*>(ptrs.begin(), ptrs.begin() + check_heads));
  const gpu::EncodedBatch ref = gpu::encode_batch_reference(t, x.data(), S, 64);
  std::vector<uint64_t> off(size_t(ns + 1));
  CK(cudaMemcpy(off.data(), doff, off.size() * 8, cudaMemcpyDeviceToHost));
  std::vector<uint8_t> got(ref.payload.size());
  CK(cudaMemcpy(got.data(), dout, got.size(), cudaMemcpyDeviceToHost));
  const bool bytes_equal = got == ref.payload && std::equal(ref.offsets.begin(), ref.offsets.end(), off.begin());
  std::vector<uint16_t> yref(size_t(check_heads) * size_t(S) * D), y(yref.size());
  gpu::decode_batch_reference(t, ref.payload.data(), ref.payload.size(), ref.offsets.data(), S, 64, yref.data());
  CK(cudaMemcpy(y.data(), dy, y.size() * 2, cudaMemcpyDeviceToHost));
  const bool recon_equal = y == yref;
  // Tensor-core outputs against the bound of include/kvcodec/gpu.hpp.
  size_t tc_diff = 0;
  const size_t tc_viol = gpu::tf32_bound_violations(t, check_heads_tc, x.data(), S, y_tc.data(), yref.data(), &tc_diff);
  const double gbs = 1e-6;  // bytes per ms -> GB/s
  std::printf(
      "{\"layers\": %d, \"kv_heads\": %d, \"tokens\": %lld, \"head_dim\": %d, \"bf16_bytes\": %zu, "
      "\"compressed_bytes\": %llu, \"ratio\": %.3f, \"rel_mse\": %.3g, \"copy_ms\": %.3f, \"copy_gb_s\": %.1f, "
      "\"encode_ms\": %.3f, \"encode_gb_s\": %.1f, \"encode_frac_copy\": %.3f, \"decode_ms\": %.3f, "
      "\"decode_gb_s\": %.1f, \"decode_frac_copy\": %.3f, \"encode_pipelined_ms\": %.3f, \"decode_pipelined_ms\": %.3f, "
      "\"encode_phases_ms\": [%.3f, %.3f, %.3f], "
      "\"decode_phases_ms\": [%.3f, %.3f], \"bytes_equal_cpu\": %s, \"recon_equal_cpu\": %s, "
      "\"decode_tc_ms\": %.3f, \"decode_tc_gb_s\": %.1f, \"decode_tc_frac_copy\": %.3f, \"decode_tc_fused_ms\": %.3f, "
      "\"decode_tc_pipelined_ms\": %.3f, \"decode_tc_phases_ms\": [%.3f, %.3f], "
      "\"tc_checked_outputs\": %zu, \"tc_outputs_differ\": %zu, \"tc_bound_violations\": %zu}\n",
      layers, kv_heads, (long long)S, D, bytes, (unsigned long long)total, double(bytes) / double(total),
      bench::rel_mse(x.data(), y.data(), y.size()),
      copy_ms, bytes * gbs / copy_ms, enc_ms, bytes * gbs / enc_ms, copy_ms / enc_ms, dec_ms, bytes * gbs / dec_ms,
      copy_ms / dec_ms, enc_seq_ms, dec_seq_ms, enc_ph.size() > 2 ? enc_ph[0] : -1.0, enc_ph.size() > 2 ? enc_ph[1] : -1.0,
      enc_ph.size() > 2 ? enc_ph[2] : -1.0, dec_ph.size() > 1 ? dec_ph[0] : -1.0, dec_ph.size() > 1 ? dec_ph[1] : -1.0,
      bytes_equal ? "true" : "false", recon_equal ? "true" : "false", dec_tc_ms, bytes * gbs / dec_tc_ms,
      copy_ms / dec_tc_ms, dec_tc_fused_ms, dec_tc_pipe_ms, dec_tc_ph.size() > 1 ? dec_tc_ph[0] : -1.0,
      dec_tc_ph.size() > 1 ? dec_tc_ph[1] : -1.0, y_tc.size(), tc_diff, tc_viol);
  std::fflush(stdout);

  // PALU on the same bf16 KV: one projection (fitted on base head 0, default
  // energy 0.90, 4/2 bits, token groups of 32) over every head as rows, so
  // the kernels see the whole batch at once; checked on the first 4 heads.
  std::vector<float> xf0(base[0].size());
  for (size_t i = 0; i < xf0.size(); ++i) xf0[i] = gpu::bf16_bits_to_f32(base[0][i]);
  const palu::Projection proj = palu::fit_projection(xf0.data(), base_tokens, D, palu::FitOptions{});
  const int gs = 32;
  const int64_t Sp = S / gs * gs;
  bool palu_bytes_equal = false, palu_recon_equal = false;
  {
    const int rows = 4;
    std::vector<uint16_t> xs(size_t(rows) * size_t(Sp) * D);
    for (int r = 0; r < rows; ++r)
      std::copy_n(x.data() + size_t(r) * size_t(S) * D, size_t(Sp) * D, xs.data() + size_t(r) * size_t(Sp) * D);
    const std::vector<uint8_t> pref = gpu::palu_encode_reference(proj, xs.data(), rows, Sp, gs);
    std::vector<uint16_t> yref(xs.size()), yg(xs.size());
    gpu::palu_decode_reference(proj, pref.data(), pref.size(), rows, Sp, gs, yref.data());
    gpu::PaluGpuCodec small(proj, rows, gs, Sp);
    CK(cudaMemcpy(dx, xs.data(), xs.size() * 2, cudaMemcpyHostToDevice));
    small.encode(dx, Sp, dout);
    std::vector<uint8_t> pg(pref.size());
    CK(cudaMemcpy(pg.data(), dout, pg.size(), cudaMemcpyDeviceToHost));
    palu_bytes_equal = pg == pref;
    small.decode(dout, Sp, dy);
    CK(cudaMemcpy(yg.data(), dy, yg.size() * 2, cudaMemcpyDeviceToHost));
    palu_recon_equal = yg == yref;
    CK(cudaMemcpy(dx, x.data(), bytes, cudaMemcpyHostToDevice));  // restore the batch
  }
  gpu::PaluGpuCodec pc(proj, NH, gs, Sp);
  const uint64_t palu_total = pc.group_bytes() * uint64_t(Sp / gs);
  if (palu_total > cap) {
    std::fprintf(stderr, "palu output %llu > buffer %llu\n", (unsigned long long)palu_total, (unsigned long long)cap);
    return 3;
  }
  const size_t pbytes = size_t(NH) * size_t(Sp) * D * 2;
  const double penc_ms = time_ms([&] { pc.encode(dx, Sp, dout); }, 7);
  const double pdec_ms = time_ms([&] { pc.decode(dout, Sp, dy); }, 7);
  std::printf(
      "{\"palu_rank\": %d, \"palu_avg_bits\": %.2f, \"palu_ratio\": %.3f, \"palu_encode_ms\": %.3f, "
      "\"palu_encode_gb_s\": %.1f, \"palu_encode_frac_copy\": %.3f, \"palu_decode_ms\": %.3f, "
      "\"palu_decode_gb_s\": %.1f, \"palu_decode_frac_copy\": %.3f, \"palu_bytes_equal_cpu\": %s, "
      "\"palu_recon_equal_cpu\": %s}\n",
      proj.rank, proj.average_bits(), double(pbytes) / double(palu_total), penc_ms, pbytes * gbs / penc_ms,
      copy_ms / penc_ms, pdec_ms, pbytes * gbs / pdec_ms, copy_ms / pdec_ms, palu_bytes_equal ? "true" : "false",
      palu_recon_equal ? "true" : "false");
  return bytes_equal && recon_equal && tc_viol == 0 && palu_bytes_equal && palu_recon_equal ? 0 : 2;
}

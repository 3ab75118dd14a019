// CUDA kernels of the kvtc-gpu/1 variant (contract: src/gpu/kvtc_variant.hpp).
//
// encode: one CTA of 128 threads per stream (head h, block of 64 tokens):
//   load x [64, D] bf16 -> shared (transposed, fp32, mean removed);
//   projection + quantization, each thread an 8x8 tile of [64, K] with its
//   accumulators in registers, d ascending (the reference's order);
//   warp 0 rANS-encodes the codes, 32 lanes, backwards into a per-stream
//   scratch slot; then an inclusive scan of the sizes gives the offsets and a
//   copy kernel packs the streams.
// decode: one CTA per stream; warp 0 rANS-decodes into shared (dequantized,
//   transposed), then all threads reconstruct [64, D] as 8x8 tiles, k
//   ascending, and store bf16.
#include <cuda_runtime.h>

#include <cub/device/device_scan.cuh>
#include <string>

#include "gpu/kvtc_variant.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/gpu.hpp"

namespace kvcodec::gpu {
namespace {

constexpr int kT = KvtcGpuCodec::kBlockTokens;  // tokens per stream
constexpr int kThreads = 128;
constexpr int kTPad = kT + 4;  // row stride of transposed tiles (16-byte aligned rows)

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::kInternal, std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

struct DeviceTables {
  int n_heads, dim, k_pad;
  const int32_t* kept;
  const float* mean;
  const float* basis;
  const float* basis_t;
  const float* inv_step;
  const float* code_offset;
  const float* max_code;
  const float* step;
  const float* recon_offset;
  const uint32_t* scale_bits;
  const uint32_t* sym_base;
  const uint32_t* sym_freq;
  const uint32_t* sym_cum;
  const uint64_t* slot_base;
  const uint16_t* slot_symbol;
};

__device__ __forceinline__ float bf16_to_f32_dev(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

__device__ __forceinline__ uint16_t f32_to_bf16_dev(float v) {
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

template <int D>
__global__ void __launch_bounds__(kThreads) encode_kernel(DeviceTables tb, const uint16_t* __restrict__ x,
                                                          int64_t tokens, int64_t nb, uint8_t* __restrict__ scratch,
                                                          uint64_t cap, uint64_t* __restrict__ sizes) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* xs = reinterpret_cast<float*>(smem);                   // [D][kTPad], xs[d][t]
  uint16_t* cs = reinterpret_cast<uint16_t*>(xs + D * kTPad);   // [n * K] token-major codes
  const int64_t stream = blockIdx.x;
  const int h = int(stream / nb);
  const int64_t t0 = (stream % nb) * kT;
  const int n = tokens - t0 < kT ? int(tokens - t0) : kT;
  const int K = tb.kept[h];
  const int KP = tb.k_pad;
  if (K == 0) {
    if (threadIdx.x == 0) sizes[stream] = 0;
    return;
  }
  const float* mean = tb.mean + size_t(h) * D;
  const uint16_t* xh = x + (size_t(h) * size_t(tokens) + size_t(t0)) * D;
  // Load: thread v takes 8 dims of one token; consecutive threads consecutive
  // tokens, so the transposed shared stores do not conflict.
  for (int v = threadIdx.x; v < kT * (D / 8); v += kThreads) {
    const int t = v % kT, d0 = (v / kT) * 8;
    float vals[8];
    if (t < n) {
      const uint4 raw = *reinterpret_cast<const uint4*>(xh + size_t(t) * D + d0);
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        vals[2 * e] = bf16_to_f32_dev(uint16_t(w[e] & 0xffffu)) - mean[d0 + 2 * e];
        vals[2 * e + 1] = bf16_to_f32_dev(uint16_t(w[e] >> 16)) - mean[d0 + 2 * e + 1];
      }
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) vals[e] = 0.0f;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) xs[(d0 + e) * kTPad + t] = vals[e];
  }
  __syncthreads();

  const float* bt = tb.basis_t + size_t(h) * D * KP;
  const int kgroups = (K + 7) / 8;
  for (int g = threadIdx.x; g < (kT / 8) * kgroups; g += kThreads) {
    const int tg = g / kgroups, kg = g % kgroups;
    if (tg * 8 >= n) continue;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < D; ++d) {
      const float4 xa = *reinterpret_cast<const float4*>(xs + d * kTPad + tg * 8);
      const float4 xb = *reinterpret_cast<const float4*>(xs + d * kTPad + tg * 8 + 4);
      const float4 ba = __ldg(reinterpret_cast<const float4*>(bt + size_t(d) * KP + kg * 8));
      const float4 bb = __ldg(reinterpret_cast<const float4*>(bt + size_t(d) * KP + kg * 8 + 4));
      const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
      const float bv[8] = {ba.x, ba.y, ba.z, ba.w, bb.x, bb.y, bb.z, bb.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = __fmaf_rn(xv[i], bv[j], acc[i][j]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int k = kg * 8 + j;
      if (k >= K) continue;
      const size_t q = size_t(h) * KP + k;
      const float inv = tb.inv_step[q], off = tb.code_offset[q], mx = tb.max_code[q];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int t = tg * 8 + i;
        if (t < n) {
          const float v = floorf(__fmaf_rn(acc[i][j], inv, off));
          cs[t * K + k] = uint16_t(fminf(fmaxf(v, 0.0f), mx));
        }
      }
    }
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;

  // rANS, 32 lanes, steps in reverse; bytes written backwards from the slot's end.
  const int lane = threadIdx.x;
  const unsigned lt_mask = (1u << lane) - 1u;
  uint8_t* slot_end = scratch + size_t(stream) * cap + cap;
  uint8_t* p = slot_end;
  uint32_t st = kVariantRansLow;
  const int64_t nsym = int64_t(n) * K;
  const int64_t steps = (nsym + 31) / 32;
  for (int64_t s = steps - 1; s >= 0; --s) {
    const int64_t i = s * 32 + lane;
    int ne = 0;
    uint32_t f = 1, c = 0, scale = 0;
    if (i < nsym) {
      const size_t q = size_t(h) * KP + size_t(i % K);
      const uint32_t sym = cs[i];
      f = tb.sym_freq[tb.sym_base[q] + sym];
      c = tb.sym_cum[tb.sym_base[q] + sym];
      scale = tb.scale_bits[q];
      const uint32_t x_max = ((kVariantRansLow >> scale) << 8) * f;
      ne = st >= x_max ? ((st >> 8) >= x_max ? 2 : 1) : 0;
    }
    const unsigned b1 = __ballot_sync(0xffffffffu, ne >= 1), b2 = __ballot_sync(0xffffffffu, ne >= 2);
    const int total = __popc(b1) + __popc(b2);
    const int pre = __popc(b1 & lt_mask) + __popc(b2 & lt_mask);
    uint8_t* base = p - total + pre;
    if (ne == 1) {
      base[0] = uint8_t(st);
      st >>= 8;
    } else if (ne == 2) {
      base[0] = uint8_t(st >> 8);  // decoder reads the last emitted (higher) byte first
      base[1] = uint8_t(st);
      st >>= 16;
    }
    p -= total;
    if (i < nsym) st = ((st / f) << scale) + (st % f) + c;
  }
  p -= kStateBytes;
  p[4 * lane] = uint8_t(st);
  p[4 * lane + 1] = uint8_t(st >> 8);
  p[4 * lane + 2] = uint8_t(st >> 16);
  p[4 * lane + 3] = uint8_t(st >> 24);
  if (lane == 0) sizes[stream] = uint64_t(slot_end - p);
}

__global__ void pack_kernel(const uint8_t* __restrict__ scratch, uint64_t cap, const uint64_t* __restrict__ sizes,
                            const uint64_t* __restrict__ offsets, uint8_t* __restrict__ out) {
  const int64_t stream = blockIdx.x;
  const uint64_t size = sizes[stream];
  const uint8_t* src = scratch + size_t(stream) * cap + cap - size;
  uint8_t* dst = out + offsets[stream];  // offsets[stream] = inclusive sum up to stream - 1
  for (uint64_t i = threadIdx.x; i < size; i += blockDim.x) dst[i] = src[i];
}

template <int D>
__global__ void __launch_bounds__(kThreads) decode_kernel(DeviceTables tb, const uint8_t* __restrict__ in,
                                                          uint64_t in_size, const uint64_t* __restrict__ offsets,
                                                          int64_t tokens, int64_t nb, uint16_t* __restrict__ y,
                                                          int* __restrict__ err) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* vs = reinterpret_cast<float*>(smem);  // [KP][kTPad], vs[k][t] dequantized coefficients
  __shared__ int bad;
  const int64_t stream = blockIdx.x;
  const int h = int(stream / nb);
  const int64_t t0 = (stream % nb) * kT;
  const int n = tokens - t0 < kT ? int(tokens - t0) : kT;
  const int K = tb.kept[h];
  const int KP = tb.k_pad;
  if (threadIdx.x == 0) bad = 0;
  const uint64_t start = offsets[stream], end = offsets[stream + 1];
  const bool range_ok = start <= end && end <= in_size;
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const unsigned lt_mask = (1u << lane) - 1u;
    int fail = 0;
    if (!range_ok) {
      fail = 1;
    } else if (K == 0) {
      fail = end != start;
    } else if (end - start < kStateBytes) {
      fail = 1;
    } else {
      const uint8_t* data = in + start;
      const uint64_t size = end - start;
      uint32_t st = uint32_t(data[4 * lane]) | uint32_t(data[4 * lane + 1]) << 8 |
                    uint32_t(data[4 * lane + 2]) << 16 | uint32_t(data[4 * lane + 3]) << 24;
      if (st < kVariantRansLow) fail = 1;
      uint64_t pos = kStateBytes;
      const int64_t nsym = int64_t(n) * K;
      const int64_t steps = (nsym + 31) / 32;
      // (t, k) of symbol i = s*32 + lane, advanced by 32 per step.
      int k = lane % K, t = lane / K;
      for (int64_t s = 0; s < steps && !__any_sync(0xffffffffu, fail); ++s) {
        const int64_t i = s * 32 + lane;
        int ne = 0;
        if (i < nsym) {
          const size_t q = size_t(h) * KP + k;
          const uint32_t scale = tb.scale_bits[q];
          const uint32_t slot = st & ((1u << scale) - 1u);
          const uint32_t sym = tb.slot_symbol[tb.slot_base[q] + slot];
          const uint32_t f = tb.sym_freq[tb.sym_base[q] + sym], c = tb.sym_cum[tb.sym_base[q] + sym];
          st = f * (st >> scale) + slot - c;
          ne = st >= kVariantRansLow ? 0 : ((st << 8) >= kVariantRansLow ? 1 : 2);
          vs[k * kTPad + t] = (float(sym) - tb.recon_offset[q]) * tb.step[q];
        }
        const unsigned b1 = __ballot_sync(0xffffffffu, ne >= 1), b2 = __ballot_sync(0xffffffffu, ne >= 2);
        const uint64_t pre = pos + __popc(b1 & lt_mask) + __popc(b2 & lt_mask);
        pos += __popc(b1) + __popc(b2);
        if (pos > size) {
          fail = 1;  // truncated (every lane sees it)
        } else if (ne >= 1) {
          st = st << 8 | data[pre];
          if (ne == 2) st = st << 8 | data[pre + 1];
        }
        k += 32;
        while (k >= K) k -= K, ++t;
      }
      if (!fail && (pos != size || st != kVariantRansLow)) fail = 1;
    }
    if (__any_sync(0xffffffffu, fail) && lane == 0) {
      bad = 1;
      atomicExch(err, 1);
      atomicMin(err + 1, stream < 0x7fffffff ? int(stream) : 0x7fffffff);
    }
  }
  __syncthreads();
  if (bad) return;
  const float* mean = tb.mean + size_t(h) * D;
  const float* bs = tb.basis + size_t(h) * KP * D;
  uint16_t* yh = y + (size_t(h) * size_t(tokens) + size_t(t0)) * D;
  for (int g = threadIdx.x; g < (kT / 8) * (D / 8); g += kThreads) {
    const int tg = g / (D / 8), dg = g % (D / 8);
    if (tg * 8 >= n) continue;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
#pragma unroll 4
    for (int k = 0; k < K; ++k) {
      const float4 va = *reinterpret_cast<const float4*>(vs + k * kTPad + tg * 8);
      const float4 vb = *reinterpret_cast<const float4*>(vs + k * kTPad + tg * 8 + 4);
      const float4 ba = __ldg(reinterpret_cast<const float4*>(bs + size_t(k) * D + dg * 8));
      const float4 bb = __ldg(reinterpret_cast<const float4*>(bs + size_t(k) * D + dg * 8 + 4));
      const float vv[8] = {va.x, va.y, va.z, va.w, vb.x, vb.y, vb.z, vb.w};
      const float bv[8] = {ba.x, ba.y, ba.z, ba.w, bb.x, bb.y, bb.z, bb.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = __fmaf_rn(vv[i], bv[j], acc[i][j]);
    }
    float mu[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) mu[j] = mean[dg * 8 + j];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (tg * 8 + i >= n) break;
      uint32_t w[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        w[e] = uint32_t(f32_to_bf16_dev(__fadd_rn(acc[i][2 * e], mu[2 * e]))) |
               uint32_t(f32_to_bf16_dev(__fadd_rn(acc[i][2 * e + 1], mu[2 * e + 1]))) << 16;
      *reinterpret_cast<uint4*>(yh + size_t(tg * 8 + i) * D + dg * 8) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

template <typename T>
T* upload(const std::vector<T>& v, std::vector<void*>& owned) {
  void* p = nullptr;
  const size_t bytes = std::max<size_t>(sizeof(T), v.size() * sizeof(T));
  check_cuda(cudaMalloc(&p, bytes), "cudaMalloc (tables)");
  owned.push_back(p);
  if (!v.empty()) check_cuda(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return static_cast<T*>(p);
}

}  // namespace

bool cuda_compiled() noexcept { return true; }

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

struct KvtcGpuCodec::Impl {
  FlatKvtcTables flat;
  DeviceTables dev{};
  std::vector<void*> owned;
  int64_t max_tokens = 0;
  uint64_t cap = 0;  // scratch bytes per stream: states + at most 2 bytes per symbol
  uint8_t* scratch = nullptr;
  uint64_t* sizes = nullptr;
  uint64_t* scan_out = nullptr;  // [n_streams + 1]
  void* cub_temp = nullptr;
  size_t cub_temp_bytes = 0;
  int* err = nullptr;    // device [2]: flag, first bad stream
  uint64_t* total_host = nullptr;  // pinned

  ~Impl() {
    for (void* p : owned) cudaFree(p);
    if (total_host) cudaFreeHost(total_host);
  }
};

KvtcGpuCodec::KvtcGpuCodec(const std::vector<const kvtc::HeadParams*>& heads, int64_t max_tokens)
    : impl_(std::make_unique<Impl>()) {
  if (device_count() == 0) throw Error(ErrorCode::kUnsupported, "kvtc-gpu: no CUDA device");
  if (max_tokens <= 0) throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: max_tokens must be positive");
  Impl& m = *impl_;
  m.flat = flatten_heads(heads);
  const FlatKvtcTables& f = m.flat;
  m.dev.n_heads = f.n_heads;
  m.dev.dim = f.dim;
  m.dev.k_pad = f.k_pad;
  m.dev.kept = upload(f.kept, m.owned);
  m.dev.mean = upload(f.mean, m.owned);
  m.dev.basis = upload(f.basis, m.owned);
  m.dev.basis_t = upload(f.basis_t, m.owned);
  m.dev.inv_step = upload(f.inv_step, m.owned);
  m.dev.code_offset = upload(f.code_offset, m.owned);
  m.dev.max_code = upload(f.max_code, m.owned);
  m.dev.step = upload(f.step, m.owned);
  m.dev.recon_offset = upload(f.recon_offset, m.owned);
  m.dev.scale_bits = upload(f.scale_bits, m.owned);
  m.dev.sym_base = upload(f.sym_base, m.owned);
  m.dev.sym_freq = upload(f.sym_freq, m.owned);
  m.dev.sym_cum = upload(f.sym_cum, m.owned);
  m.dev.slot_base = upload(f.slot_base, m.owned);
  m.dev.slot_symbol = upload(f.slot_symbol, m.owned);
  m.max_tokens = max_tokens;
  m.cap = (kStateBytes + 2ull * kT * uint64_t(f.k_pad) + 15) / 16 * 16;
  const int64_t ns = n_streams(max_tokens);
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, size_t(ns) * m.cap), "cudaMalloc (scratch)");
  m.owned.push_back(p);
  m.scratch = static_cast<uint8_t*>(p);
  check_cuda(cudaMalloc(&p, size_t(ns) * 8), "cudaMalloc (sizes)");
  m.owned.push_back(p);
  m.sizes = static_cast<uint64_t*>(p);
  check_cuda(cudaMalloc(&p, size_t(ns + 1) * 8), "cudaMalloc (offsets)");
  m.owned.push_back(p);
  m.scan_out = static_cast<uint64_t*>(p);
  check_cuda(cub::DeviceScan::InclusiveSum(nullptr, m.cub_temp_bytes, m.sizes, m.scan_out + 1, int(ns)), "cub size");
  check_cuda(cudaMalloc(&m.cub_temp, std::max<size_t>(m.cub_temp_bytes, 16)), "cudaMalloc (scan)");
  m.owned.push_back(m.cub_temp);
  check_cuda(cudaMalloc(&p, 8), "cudaMalloc (errors)");
  m.owned.push_back(p);
  m.err = static_cast<int*>(p);
  check_cuda(cudaMallocHost(&p, 8), "cudaMallocHost");
  m.total_host = static_cast<uint64_t*>(p);
  const size_t enc_smem = size_t(f.dim) * kTPad * 4 + size_t(kT) * f.k_pad * 2;
  const size_t dec_smem = size_t(f.k_pad) * kTPad * 4;
  if (f.dim == 64) {
    check_cuda(cudaFuncSetAttribute(encode_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(enc_smem)), "attr");
    check_cuda(cudaFuncSetAttribute(decode_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dec_smem)), "attr");
  } else {
    check_cuda(cudaFuncSetAttribute(encode_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(enc_smem)), "attr");
    check_cuda(cudaFuncSetAttribute(decode_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dec_smem)), "attr");
  }
}

KvtcGpuCodec::~KvtcGpuCodec() = default;

int KvtcGpuCodec::n_heads() const { return impl_->flat.n_heads; }
int KvtcGpuCodec::head_dim() const { return impl_->flat.dim; }
int64_t KvtcGpuCodec::n_streams(int64_t tokens) const { return int64_t(impl_->flat.n_heads) * n_blocks(tokens, kT); }
uint64_t KvtcGpuCodec::max_encoded_bytes(int64_t tokens) const { return uint64_t(n_streams(tokens)) * impl_->cap; }

namespace {
void check_tokens(int64_t tokens, int64_t max_tokens) {
  if (tokens <= 0 || tokens > max_tokens)
    throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: tokens = " + std::to_string(tokens) + " outside [1, " +
                                                 std::to_string(max_tokens) + "] (max_tokens of the codec)");
}
void check_aligned(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
    throw Error(ErrorCode::kInvalidArgument, std::string("kvtc-gpu: ") + what + " is not 16-byte aligned");
}
}  // namespace

uint64_t KvtcGpuCodec::encode(const uint16_t* x, int64_t tokens, uint8_t* out, uint64_t capacity, uint64_t* offsets,
                              void* stream_ptr) {
  Impl& m = *impl_;
  check_tokens(tokens, m.max_tokens);
  check_aligned(x, "input x");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t nb = n_blocks(tokens, kT);
  const int64_t ns = n_streams(tokens);
  const size_t smem = size_t(m.flat.dim) * kTPad * 4 + size_t(kT) * m.flat.k_pad * 2;
  if (m.flat.dim == 64)
    encode_kernel<64><<<unsigned(ns), kThreads, smem, stream>>>(m.dev, x, tokens, nb, m.scratch, m.cap, m.sizes);
  else
    encode_kernel<128><<<unsigned(ns), kThreads, smem, stream>>>(m.dev, x, tokens, nb, m.scratch, m.cap, m.sizes);
  check_cuda(cudaGetLastError(), "encode_kernel launch");
  check_cuda(cudaMemsetAsync(m.scan_out, 0, 8, stream), "memset");
  size_t tb = m.cub_temp_bytes;
  check_cuda(cub::DeviceScan::InclusiveSum(m.cub_temp, tb, m.sizes, m.scan_out + 1, int(ns), stream), "scan");
  check_cuda(cudaMemcpyAsync(m.total_host, m.scan_out + ns, 8, cudaMemcpyDeviceToHost, stream), "total");
  check_cuda(cudaStreamSynchronize(stream), "encode (sizes)");
  const uint64_t total = *m.total_host;
  if (total > capacity)
    throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu encode: output needs " + std::to_string(total) +
                                                 " bytes, capacity is " + std::to_string(capacity));
  pack_kernel<<<unsigned(ns), 256, 0, stream>>>(m.scratch, m.cap, m.sizes, m.scan_out, out);
  check_cuda(cudaGetLastError(), "pack_kernel launch");
  check_cuda(cudaMemcpyAsync(offsets, m.scan_out, size_t(ns + 1) * 8, cudaMemcpyDefault, stream), "offsets");
  return total;
}

void KvtcGpuCodec::decode(const uint8_t* in, uint64_t in_size, const uint64_t* offsets, int64_t tokens, uint16_t* y,
                          void* stream_ptr) {
  Impl& m = *impl_;
  check_tokens(tokens, m.max_tokens);
  check_aligned(y, "output y");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t nb = n_blocks(tokens, kT);
  const int64_t ns = n_streams(tokens);
  const int init[2] = {0, 0x7fffffff};
  check_cuda(cudaMemcpyAsync(m.err, init, 8, cudaMemcpyHostToDevice, stream), "reset errors");
  const size_t smem = size_t(m.flat.k_pad) * kTPad * 4;
  if (m.flat.dim == 64)
    decode_kernel<64><<<unsigned(ns), kThreads, smem, stream>>>(m.dev, in, in_size, offsets, tokens, nb, y, m.err);
  else
    decode_kernel<128><<<unsigned(ns), kThreads, smem, stream>>>(m.dev, in, in_size, offsets, tokens, nb, y, m.err);
  check_cuda(cudaGetLastError(), "decode_kernel launch");
}

void KvtcGpuCodec::check_errors(void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  int h[2] = {0, 0};
  check_cuda(cudaMemcpyAsync(h, impl_->err, 8, cudaMemcpyDeviceToHost, stream), "read errors");
  check_cuda(cudaStreamSynchronize(stream), "decode");
  if (h[0]) throw Error(ErrorCode::kFormat, "kvtc-gpu decode: stream " + std::to_string(h[1]) + " is malformed");
}

}  // namespace kvcodec::gpu

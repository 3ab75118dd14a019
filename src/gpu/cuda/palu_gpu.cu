// CUDA kernels of the PALU latent codec (contract: PaluGpuCodec in
// include/kvcodec/gpu.hpp; CPU reference: src/gpu/palu_reference.cpp, which
// calls the cache's own functions). Every float operation is the CPU's, in
// the CPU's order, without contraction (explicit __fmul_rn/__fadd_rn; built
// with --fmad=false too), so codes and bytes are identical.
//
// encode: one CTA (256 threads) per (token group, row): x [gs, dim] bf16 ->
//   shared fp32; each warp takes latent channels c = warp, warp + 8, ...:
//   lane l owns tokens [l*m, l*m + m) (m = gs / 32), computes z (i
//   ascending), rounds it through f16, reduces min/max in token order (the
//   CPU keeps the first of equal values: -0 vs +0 matters), lane 0 fits the
//   f16 min/scale, every lane quantizes its tokens into shared, then the
//   channel's run of gs * bits bits (a whole number of 32-bit words, since gs
//   % 32 == 0) is assembled word by word and stored.
// decode: one CTA per (token group, row): warps unpack channels into z
//   [gs, rank] in shared; then x_hat[t][i] = sum_j U[i][j] z[t][j] (j
//   ascending), one output per thread per step, rounded to bf16.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "gpu/cuda/cuda_check.cuh"
#include "kvcodec/error.hpp"
#include "kvcodec/gpu.hpp"
#include "palu/projection.hpp"

namespace kvcodec::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The CPU's f32 -> f16 (core/tensor.cpp f32_to_f16), bit for bit, including
// its NaN payload handling.
__device__ __forceinline__ uint16_t f32_to_f16_dev(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {
    if (abs == 0x7f800000u) return sign | 0x7c00u;
    return sign | 0x7e00u | uint16_t((abs >> 13) & 0x3ffu);
  }
  // Finite: IEEE round to nearest even, overflow to Inf (as the CPU).
  return __half_as_ushort(__float2half_rn(f));
}

__device__ __forceinline__ float f16_to_f32_dev(uint16_t h) { return __half2float(__ushort_as_half(h)); }

__device__ __forceinline__ uint16_t f16_saturate_dev(float v) {
  constexpr float kMax = 65504.0f;
  if (v > kMax) v = kMax;
  if (v < -kMax) v = -kMax;
  return f32_to_f16_dev(v);
}

__device__ __forceinline__ float bf16_to_f32(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

__device__ __forceinline__ uint16_t f32_to_bf16(float v) {
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

struct PaluDev {
  int dim, rank, rows, gs;
  const float* basis_t;     // [rank, dim]
  const uint8_t* bits;      // [rank]
  const uint32_t* cprefix;  // [rank] sum of bits of the channels before c
  uint32_t sum_bits;
  uint64_t group_bytes;
};

__global__ void __launch_bounds__(kThreads) palu_encode_kernel(PaluDev pd, const uint16_t* __restrict__ x,
                                                               int64_t tokens, uint8_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int dim = pd.dim, gs = pd.gs, xstride = dim + 1;  // +1: lanes read different tokens' rows
  float* xs = reinterpret_cast<float*>(smem);                                   // [gs][dim + 1]
  uint16_t* stage = reinterpret_cast<uint16_t*>(xs + size_t(gs) * xstride);     // [kWarps][gs]
  const int64_t g = blockIdx.x / pd.rows;
  const int row = int(blockIdx.x % pd.rows);
  const uint16_t* xg = x + (size_t(row) * size_t(tokens) + size_t(g) * gs) * dim;
  for (int v = threadIdx.x; v < gs * dim; v += kThreads) xs[(v / dim) * xstride + v % dim] = bf16_to_f32(xg[v]);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int m = gs / 32;
  uint16_t* st = stage + warp * gs;
  uint8_t* blob = out + size_t(g) * pd.group_bytes;
  uint32_t* words = reinterpret_cast<uint32_t*>(blob + size_t(pd.rows) * pd.rank * 4);
  for (int c = warp; c < pd.rank; c += kWarps) {
    const float* u = pd.basis_t + size_t(c) * dim;
    const int bits = pd.bits[c];
    float lo = INFINITY, hi = -INFINITY;
    float zv[32];  // m <= 32
    for (int e = 0; e < m; ++e) {
      const float* xt = xs + (lane * m + e) * xstride;
      float acc = 0.0f;
      for (int i = 0; i < dim; ++i) acc = __fadd_rn(acc, __fmul_rn(__ldg(u + i), xt[i]));
      const float z = f16_to_f32_dev(f16_saturate_dev(acc));
      zv[e] = z;
      if (z < lo) lo = z;
      if (z > hi) hi = z;
    }
    // Ordered tree: lane l holds tokens before lane l + off's; the later value
    // wins only when strictly smaller (larger), as in the CPU's scan.
    for (int off = 1; off < 32; off <<= 1) {
      const float olo = __shfl_down_sync(0xffffffffu, lo, off), ohi = __shfl_down_sync(0xffffffffu, hi, off);
      if (lane + off < 32) {
        if (olo < lo) lo = olo;
        if (ohi > hi) hi = ohi;
      }
    }
    lo = __shfl_sync(0xffffffffu, lo, 0);
    hi = __shfl_sync(0xffffffffu, hi, 0);
    // asym_fit
    if (!(lo <= hi)) lo = hi = 0.0f;
    const uint16_t min_f16 = f16_saturate_dev(lo);
    const float mn = f16_to_f32_dev(min_f16);
    const int max_code = (1 << bits) - 1;
    const float scale = __fdiv_rn(__fsub_rn(hi, mn), float(max_code));
    uint16_t scale_f16 = f16_saturate_dev(scale);
    if (__fadd_rn(__fmul_rn(f16_to_f32_dev(scale_f16), float(max_code)), mn) < hi && scale_f16 < 0x7bffu) ++scale_f16;
    if (!(scale > 0.0f)) scale_f16 = 0;
    if (lane == 0) {
      uint16_t* prm = reinterpret_cast<uint16_t*>(blob + (size_t(row) * pd.rank + c) * 4);
      prm[0] = min_f16;
      prm[1] = scale_f16;
    }
    // asym_encode
    const float sc = f16_to_f32_dev(scale_f16);
    const float inv = sc > 0.0f ? __fdiv_rn(1.0f, sc) : 0.0f;
    for (int e = 0; e < m; ++e) {
      const float v = __fmul_rn(__fsub_rn(zv[e], mn), inv);
      int code;
      if (!(v > 0.0f))
        code = 0;
      else if (v >= float(max_code))
        code = max_code;
      else
        code = int(floorf(__fadd_rn(v, 0.5f)));
      st[lane * m + e] = uint16_t(code);
    }
    __syncwarp();
    // The run of (row, c): gs * bits bits from bit row * sum_bits * gs +
    // cprefix[c] * gs of the code area, i.e. whole words.
    const size_t w0 = (size_t(row) * pd.sum_bits * gs + size_t(pd.cprefix[c]) * gs) / 32;
    const int n_words = gs * bits / 32;
    for (int w = lane; w < n_words; w += 32) {
      uint32_t word = 0;
      const int t_first = (32 * w) / bits, t_last = (32 * w + 31) / bits;
      for (int t = t_first; t <= t_last; ++t) {
        const int pos = t * bits - 32 * w;
        const uint32_t val = st[t];
        word |= pos >= 0 ? val << pos : val >> (-pos);
      }
      words[w0 + w] = word;
    }
    __syncwarp();
  }
}

__global__ void __launch_bounds__(kThreads) palu_decode_kernel(PaluDev pd, const uint8_t* __restrict__ in,
                                                               int64_t tokens, uint16_t* __restrict__ y) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int dim = pd.dim, gs = pd.gs, rank = pd.rank, zstride = rank + 1;
  float* zs = reinterpret_cast<float*>(smem);  // [gs][rank + 1]
  const int64_t g = blockIdx.x / pd.rows;
  const int row = int(blockIdx.x % pd.rows);
  const uint8_t* blob = in + size_t(g) * pd.group_bytes;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(blob + size_t(pd.rows) * rank * 4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int c = warp; c < rank; c += kWarps) {
    const uint16_t* prm = reinterpret_cast<const uint16_t*>(blob + (size_t(row) * rank + c) * 4);
    const float mn = f16_to_f32_dev(prm[0]), sc = f16_to_f32_dev(prm[1]);
    const int bits = pd.bits[c];
    const size_t b0 = size_t(row) * pd.sum_bits * gs + size_t(pd.cprefix[c]) * gs;
    for (int t = lane; t < gs; t += 32) {
      const size_t b = b0 + size_t(t) * bits;
      const int sh = int(b % 32);
      uint64_t v = words[b / 32];
      if (sh + bits > 32) v |= uint64_t(words[b / 32 + 1]) << 32;  // only when the code spans two words
      const uint32_t code = uint32_t(v >> sh) & ((1u << bits) - 1u);
      zs[t * zstride + c] = __fadd_rn(mn, __fmul_rn(float(code), sc));
    }
  }
  __syncthreads();
  uint16_t* yg = y + (size_t(row) * size_t(tokens) + size_t(g) * gs) * dim;
  for (int v = threadIdx.x; v < gs * dim; v += kThreads) {
    const int t = v / dim, i = v % dim;
    const float* z = zs + t * zstride;
    float acc = 0.0f;
    for (int j = 0; j < rank; ++j) acc = __fadd_rn(acc, __fmul_rn(__ldg(pd.basis_t + size_t(j) * dim + i), z[j]));
    yg[v] = f32_to_bf16(acc);
  }
}

}  // namespace

struct PaluGpuCodec::Impl {
  PaluDev dev{};
  int64_t max_tokens = 0;
  size_t enc_smem = 0, dec_smem = 0;
  std::vector<void*> owned;
  ~Impl() {
    for (void* p : owned) cudaFree(p);
  }
  template <typename T>
  T* upload(const std::vector<T>& v) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, std::max<size_t>(1, v.size()) * sizeof(T)), "cudaMalloc (palu tables)");
    owned.push_back(p);
    check_cuda(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload (palu tables)");
    return static_cast<T*>(p);
  }
};

PaluGpuCodec::PaluGpuCodec(const palu::Projection& p, int rows, int group_size, int64_t max_tokens)
    : impl_(std::make_unique<Impl>()) {
  if (device_count() == 0) throw Error(ErrorCode::kUnsupported, "palu-gpu: no CUDA device");
  const std::string who = "palu-gpu: ";
  if (p.dim < 1 || p.rank < 1 || p.rank > 256 || p.bits.size() != size_t(p.rank) ||
      p.basis_t.size() != size_t(p.dim) * size_t(p.rank))
    throw Error(ErrorCode::kInvalidArgument, who + "projection dim " + std::to_string(p.dim) + ", rank " +
                                                 std::to_string(p.rank) + " (rank 1..256 with widths and a decoded basis)");
  for (int c = 0; c < p.rank; ++c)
    if (p.bits[size_t(c)] < 1 || p.bits[size_t(c)] > 16)
      throw Error(ErrorCode::kInvalidArgument, who + "channel " + std::to_string(c) + " has width " +
                                                   std::to_string(p.bits[size_t(c)]) + " (allowed 1..16)");
  if (rows < 1) throw Error(ErrorCode::kInvalidArgument, who + "rows = " + std::to_string(rows) + " (must be >= 1)");
  if (group_size < 32 || group_size > 1024 || group_size % 32 != 0)
    throw Error(ErrorCode::kUnsupported, who + "group_size = " + std::to_string(group_size) +
                                             " (the kernels take multiples of 32 up to 1024)");
  if (max_tokens <= 0) throw Error(ErrorCode::kInvalidArgument, who + "max_tokens must be positive");
  Impl& m = *impl_;
  m.max_tokens = max_tokens;
  m.enc_smem = size_t(group_size) * size_t(p.dim + 1) * 4 + size_t(kWarps) * size_t(group_size) * 2;
  m.dec_smem = size_t(group_size) * size_t(p.rank + 1) * 4;
  int dev = 0, limit = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "shared memory limit");
  if (m.enc_smem > size_t(limit) || m.dec_smem > size_t(limit))
    throw Error(ErrorCode::kUnsupported, who + "group_size " + std::to_string(group_size) + " x dim " +
                                             std::to_string(p.dim) + " needs " + std::to_string(m.enc_smem) +
                                             " bytes of shared memory, the device has " + std::to_string(limit));
  std::vector<uint32_t> cprefix(size_t(p.rank));
  uint32_t sum = 0;
  for (int c = 0; c < p.rank; ++c) cprefix[size_t(c)] = sum, sum += p.bits[size_t(c)];
  m.dev.dim = p.dim;
  m.dev.rank = p.rank;
  m.dev.rows = rows;
  m.dev.gs = group_size;
  m.dev.sum_bits = sum;
  m.dev.group_bytes = palu::latent_group_bytes(p, rows, group_size);
  m.dev.basis_t = m.upload(p.basis_t);
  m.dev.bits = m.upload(p.bits);
  m.dev.cprefix = m.upload(cprefix);
  raise_dynamic_smem_limit(reinterpret_cast<const void*>(palu_encode_kernel), int(m.enc_smem));
  raise_dynamic_smem_limit(reinterpret_cast<const void*>(palu_decode_kernel), int(m.dec_smem));
}

PaluGpuCodec::~PaluGpuCodec() = default;

uint64_t PaluGpuCodec::group_bytes() const { return impl_->dev.group_bytes; }

namespace {
void check_palu_call(int64_t tokens, int gs, int64_t max_tokens, const void* a, const void* b) {
  if (tokens <= 0 || tokens % gs != 0 || tokens > max_tokens)
    throw Error(ErrorCode::kInvalidArgument, "palu-gpu: tokens = " + std::to_string(tokens) +
                                                 " (a positive multiple of group_size " + std::to_string(gs) +
                                                 ", at most max_tokens " + std::to_string(max_tokens) + ")");
  if (reinterpret_cast<uintptr_t>(a) % 4 != 0 || reinterpret_cast<uintptr_t>(b) % 4 != 0)
    throw Error(ErrorCode::kInvalidArgument, "palu-gpu: device buffers must be 4-byte aligned");
}
}  // namespace

void PaluGpuCodec::encode(const uint16_t* x, int64_t tokens, uint8_t* out, void* stream) {
  Impl& m = *impl_;
  check_palu_call(tokens, m.dev.gs, m.max_tokens, x, out);
  const unsigned grid = unsigned((tokens / m.dev.gs) * m.dev.rows);
  palu_encode_kernel<<<grid, kThreads, m.enc_smem, static_cast<cudaStream_t>(stream)>>>(m.dev, x, tokens, out);
  check_cuda(cudaGetLastError(), "palu_encode_kernel launch");
}

void PaluGpuCodec::decode(const uint8_t* in, int64_t tokens, uint16_t* y, void* stream) {
  Impl& m = *impl_;
  check_palu_call(tokens, m.dev.gs, m.max_tokens, in, y);
  const unsigned grid = unsigned((tokens / m.dev.gs) * m.dev.rows);
  palu_decode_kernel<<<grid, kThreads, m.dec_smem, static_cast<cudaStream_t>(stream)>>>(m.dev, in, tokens, y);
  check_cuda(cudaGetLastError(), "palu_decode_kernel launch");
}

}  // namespace kvcodec::gpu

// Compressed KV offload tier (kvcodec/gpu.hpp: KvOffloadTier, docs/gpu.md).
//
// offload: per model layer, KvtcGpuCodec::encode into device scratch (one
// wait for the payload size), then the offsets and payload copied into one
// pinned host block of exactly that size.
//
// restore, on a copy stream and `lanes` decode streams, with 2 x lanes
// device staging buffers (slots) used round robin:
//   copy stream: H2D block l -> slot l % slots, once the decode of layer
//                l - slots has freed it (copies in layer order)
//   lane of l:   wait copied[slot], decode layer l from the slot into the
//                caller's buffer, record freed[slot]
// so copies run while earlier layers decode, and at short sequences (a
// layer's launch too small to fill the GPU) layers of different codecs
// decode side by side. Layers sharing a codec share its scratch, so a
// codec's layers always go to the same lane (codec index % lanes). The
// caller's stream is forked at the start and joined at the end. Copies of
// the first `slots` layers are queued before any decode, so a decode call
// that waited on the host would not hold them back.
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <string>

#include "gpu/cuda/cuda_check.cuh"
#include "gpu/offloaded_kv.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/gpu.hpp"

namespace kvcodec::gpu {

struct KvOffloadTier::Impl {
  std::vector<std::unique_ptr<KvtcGpuCodec>> codecs;  // one per distinct calibration layer
  std::vector<int> calibration_layer;                 // [codec]
  std::vector<int> codec_of;                          // [model layer] -> codec
  int batch = 0, dim = 0;
  int64_t max_tokens = 0;
  uint64_t encode_cap = 0;  // bytes of enc_out: the largest max_encoded_bytes(max_tokens)
  int64_t max_offsets = 0;
  uint8_t* enc_out = nullptr;
  uint64_t* enc_off = nullptr;
  static constexpr int kMaxLanes = 8, kMaxSlots = 2 * kMaxLanes;
  int lanes = 4;
  uint8_t* stage[kMaxSlots] = {};
  int stage_count = 0;  // slots allocated, each stage_bytes
  uint64_t stage_bytes = 0;
  cudaStream_t copy = nullptr, lane[kMaxLanes] = {};
  cudaEvent_t begin = nullptr, copied[kMaxSlots] = {}, freed[kMaxSlots] = {}, lane_done[kMaxLanes] = {};

  ~Impl() {
    if (copy) cudaStreamSynchronize(copy);
    for (cudaStream_t l : lane)
      if (l) cudaStreamSynchronize(l);  // a restore still reading the staging buffers
    for (void* p : {static_cast<void*>(enc_out), static_cast<void*>(enc_off)})
      if (p) cudaFree(p);
    for (uint8_t* p : stage)
      if (p) cudaFree(p);
    for (cudaEvent_t e : copied)
      if (e) cudaEventDestroy(e);
    for (cudaEvent_t e : freed)
      if (e) cudaEventDestroy(e);
    for (cudaEvent_t e : lane_done)
      if (e) cudaEventDestroy(e);
    if (begin) cudaEventDestroy(begin);
    for (cudaStream_t l : lane)
      if (l) cudaStreamDestroy(l);
    if (copy) cudaStreamDestroy(copy);
  }

  KvtcGpuCodec& codec(int layer) const { return *codecs[size_t(codec_of[size_t(layer)])]; }

  void check_tokens(int64_t tokens, const char* what) const {
    if (tokens <= 0 || tokens > max_tokens)
      throw Error(ErrorCode::kInvalidArgument, std::string("kv offload ") + what + ": tokens = " +
                                                   std::to_string(tokens) + " outside [1, " +
                                                   std::to_string(max_tokens) + "] (max_tokens of the tier)");
  }

  template <typename P>
  void check_buffers(const std::vector<P>& layers, const char* what) const {
    if (layers.size() != codec_of.size())
      throw Error(ErrorCode::kInvalidArgument, std::string("kv offload ") + what + ": " +
                                                   std::to_string(layers.size()) + " layer buffers for " +
                                                   std::to_string(codec_of.size()) + " layers");
    for (size_t l = 0; l < layers.size(); ++l)
      if (!layers[l])
        throw Error(ErrorCode::kInvalidArgument,
                    std::string("kv offload ") + what + ": layer " + std::to_string(l) + "'s buffer is null");
  }

  // A handle that this tier did not make, or whose offsets do not fit its
  // payload, is refused before anything reaches the device.
  void check_handle(const OffloadedKv::Layers& h) const {
    if (h.blocks.size() != codec_of.size())
      throw Error(ErrorCode::kInvalidArgument, "kv restore: the handle has " + std::to_string(h.blocks.size()) +
                                                   " layers, the tier " + std::to_string(codec_of.size()));
    check_tokens(h.tokens, "restore");
    for (size_t l = 0; l < h.blocks.size(); ++l) {
      const auto& b = h.blocks[l];
      const std::string where = "kv restore: layer " + std::to_string(l) + ": ";
      if (b.n_offsets != codec(int(l)).n_streams(h.tokens) + 1)
        throw Error(ErrorCode::kInvalidArgument, where + std::to_string(b.n_offsets) +
                                                     " stream offsets, the tier's layout has " +
                                                     std::to_string(codec(int(l)).n_streams(h.tokens) + 1));
      if (!b.mem || b.payload_at != offload_payload_at(b.n_offsets) || b.bytes != b.payload_at + b.payload_size)
        throw Error(ErrorCode::kInvalidArgument, where + "block sizes do not add up");
      const uint64_t* off = reinterpret_cast<const uint64_t*>(b.mem.get());
      if (off[0] != 0 || !std::is_sorted(off, off + b.n_offsets) || off[b.n_offsets - 1] > b.payload_size)
        throw Error(ErrorCode::kInvalidArgument, where + "stream offsets are not ascending within the payload");
    }
  }

  // At least `slots` staging buffers of at least `bytes` each.
  void grow_staging(uint64_t bytes, int slots) {
    if (bytes <= stage_bytes && slots <= stage_count) return;
    const int n = std::max(slots, stage_count);
    for (int s = 0; s < stage_count; ++s) {
      check_cuda(cudaEventSynchronize(freed[s]), "staging release");
      check_cuda(cudaFree(stage[s]), "cudaFree (staging)");
      stage[s] = nullptr;
    }
    stage_count = 0;
    stage_bytes = std::max(stage_bytes, bytes);
    for (; stage_count < n; ++stage_count)
      check_cuda(cudaMalloc(&stage[stage_count], stage_bytes), "cudaMalloc (staging)");
  }
};

KvOffloadTier::KvOffloadTier(const KvtcCalibration& cal, const std::vector<int>& calibration_layers, int batch,
                             int64_t max_tokens, int sinks, int window)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  if (calibration_layers.empty()) throw Error(ErrorCode::kInvalidArgument, "kv offload: no layers");
  if (batch < 1) throw Error(ErrorCode::kInvalidArgument, "kv offload: batch = " + std::to_string(batch));
  if (max_tokens < 1)
    throw Error(ErrorCode::kInvalidArgument, "kv offload: max_tokens = " + std::to_string(max_tokens));
  std::map<int, int> index;  // calibration layer -> codec
  for (const int c : calibration_layers) {
    // A layer the calibration lacks: the codec's flatten_calibration says so (kInvalidArgument).
    auto [it, fresh] = index.emplace(c, int(m.codecs.size()));
    if (fresh) {
      m.codecs.push_back(std::make_unique<KvtcGpuCodec>(cal, CalibratedLayout{{c}, batch, max_tokens, sinks, window}));
      m.calibration_layer.push_back(c);
    }
    m.codec_of.push_back(it->second);
  }
  m.batch = batch;
  m.dim = m.codecs[0]->head_dim();
  m.max_tokens = max_tokens;
  for (const auto& c : m.codecs) {
    m.encode_cap = std::max(m.encode_cap, c->max_encoded_bytes(max_tokens));
    m.max_offsets = std::max(m.max_offsets, c->n_streams(max_tokens) + 1);
  }
  check_cuda(cudaMalloc(&m.enc_out, m.encode_cap), "cudaMalloc (offload scratch)");
  check_cuda(cudaMalloc(&m.enc_off, size_t(m.max_offsets) * 8), "cudaMalloc (offload offsets)");
  check_cuda(cudaStreamCreateWithFlags(&m.copy, cudaStreamNonBlocking), "copy stream");
  check_cuda(cudaEventCreateWithFlags(&m.begin, cudaEventDisableTiming), "event");
  for (int s = 0; s < Impl::kMaxSlots; ++s) {
    check_cuda(cudaEventCreateWithFlags(&m.copied[s], cudaEventDisableTiming), "event");
    check_cuda(cudaEventCreateWithFlags(&m.freed[s], cudaEventDisableTiming), "event");
    check_cuda(cudaEventRecord(m.freed[s], m.copy), "event");  // the staging buffers start free
  }
  for (int i = 0; i < Impl::kMaxLanes; ++i) {
    check_cuda(cudaStreamCreateWithFlags(&m.lane[i], cudaStreamNonBlocking), "decode lane");
    check_cuda(cudaEventCreateWithFlags(&m.lane_done[i], cudaEventDisableTiming), "event");
  }
}

void KvOffloadTier::set_decode_lanes(int lanes) {
  if (lanes < 1 || lanes > Impl::kMaxLanes)
    throw Error(ErrorCode::kInvalidArgument, "kv offload: decode lanes = " + std::to_string(lanes) + " (allowed 1.." +
                                                 std::to_string(Impl::kMaxLanes) + ")");
  impl_->lanes = lanes;
}

KvOffloadTier::~KvOffloadTier() = default;

int KvOffloadTier::n_layers() const { return int(impl_->codec_of.size()); }

uint64_t KvOffloadTier::layer_bytes(int64_t tokens) const {
  return 2ull * uint64_t(impl_->batch) * uint64_t(std::max<int64_t>(tokens, 0)) * uint64_t(impl_->dim) * 2ull;
}

void KvOffloadTier::set_reconstruction(KvtcGpuCodec::Reconstruction r) {
  for (auto& c : impl_->codecs) c->set_reconstruction(r);
}

OffloadedKv KvOffloadTier::offload(const std::vector<const uint16_t*>& layers, int64_t tokens, void* stream_ptr) {
  Impl& m = *impl_;
  m.check_buffers(layers, "offload");
  m.check_tokens(tokens, "offload");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  OffloadedKv out;
  out.layers_->tokens = tokens;
  for (size_t l = 0; l < layers.size(); ++l) {
    KvtcGpuCodec& c = m.codec(int(l));
    // encode waits for the stream (the payload size), so the previous
    // layer's copies out of the scratch have finished before it is rewritten.
    const uint64_t size = c.encode(layers[l], tokens, m.enc_out, m.encode_cap, m.enc_off, stream);
    OffloadedKv::Layers::Block b;
    b.n_offsets = c.n_streams(tokens) + 1;
    b.payload_at = offload_payload_at(b.n_offsets);
    b.payload_size = size;
    b.bytes = b.payload_at + size;
    void* p = nullptr;
    check_cuda(cudaHostAlloc(&p, b.bytes, cudaHostAllocDefault), "cudaHostAlloc (offloaded layer)");
    b.mem = std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [](uint8_t* q) { cudaFreeHost(q); });
    check_cuda(cudaMemcpyAsync(p, m.enc_off, size_t(b.n_offsets) * 8, cudaMemcpyDeviceToHost, stream), "offsets D2H");
    check_cuda(cudaMemcpyAsync(b.mem.get() + b.payload_at, m.enc_out, size, cudaMemcpyDeviceToHost, stream),
               "payload D2H");
    out.layers_->blocks.push_back(std::move(b));
  }
  check_cuda(cudaStreamSynchronize(stream), "offload");
  return out;
}

void KvOffloadTier::restore(const OffloadedKv& kv, const std::vector<uint16_t*>& layers, void* stream_ptr) {
  Impl& m = *impl_;
  if (!kv.layers_) throw Error(ErrorCode::kInvalidArgument, "kv restore: the handle was moved from");
  const OffloadedKv::Layers& h = *kv.layers_;
  m.check_buffers(layers, "restore");
  m.check_handle(h);
  uint64_t most = 0;
  for (const auto& b : h.blocks) most = std::max(most, b.bytes);
  const int lanes = m.lanes, slots = 2 * lanes;
  m.grow_staging(most, slots);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  // Everything starts after the caller's earlier work on the stream (and
  // the copies after an earlier restore's decodes released the slots).
  check_cuda(cudaEventRecord(m.begin, stream), "event");
  check_cuda(cudaStreamWaitEvent(m.copy, m.begin, 0), "wait");
  for (int i = 0; i < lanes; ++i) check_cuda(cudaStreamWaitEvent(m.lane[i], m.begin, 0), "wait");
  auto issue_copy = [&](size_t l) {
    const int s = int(l % size_t(slots));
    check_cuda(cudaStreamWaitEvent(m.copy, m.freed[s], 0), "wait");
    const auto& b = h.blocks[l];
    check_cuda(cudaMemcpyAsync(m.stage[s], b.mem.get(), b.bytes, cudaMemcpyHostToDevice, m.copy), "restore H2D");
    check_cuda(cudaEventRecord(m.copied[s], m.copy), "event");
  };
  const size_t L = h.blocks.size();
  for (size_t l = 0; l < std::min<size_t>(size_t(slots), L); ++l) issue_copy(l);
  for (size_t l = 0; l < L; ++l) {
    const int s = int(l % size_t(slots));
    cudaStream_t lane = m.lane[m.codec_of[l] % lanes];
    const auto& b = h.blocks[l];
    check_cuda(cudaStreamWaitEvent(lane, m.copied[s], 0), "wait");
    m.codec(int(l)).decode(m.stage[s] + b.payload_at, b.payload_size, reinterpret_cast<const uint64_t*>(m.stage[s]),
                           h.tokens, layers[l], lane);
    check_cuda(cudaEventRecord(m.freed[s], lane), "event");
    if (l + size_t(slots) < L) issue_copy(l + size_t(slots));
  }
  for (int i = 0; i < lanes; ++i) {
    check_cuda(cudaEventRecord(m.lane_done[i], m.lane[i]), "event");
    check_cuda(cudaStreamWaitEvent(stream, m.lane_done[i], 0), "join");
  }
}

void KvOffloadTier::check_errors(void* stream) {
  Impl& m = *impl_;
  for (size_t i = 0; i < m.codecs.size(); ++i) {
    try {
      m.codecs[i]->check_errors(stream);
    } catch (const Error& e) {
      throw Error(e.code(), "kv restore: a layer coded with calibration layer " +
                                std::to_string(m.calibration_layer[i]) + ": " + e.what());
    }
  }
}

}  // namespace kvcodec::gpu

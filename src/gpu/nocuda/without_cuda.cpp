// CPU-only build: the GPU API exists and says plainly that it is absent.
#include "kvcodec/error.hpp"
#include "kvcodec/gpu.hpp"

namespace kvcodec::gpu {

bool cuda_compiled() noexcept { return false; }
int device_count() noexcept { return 0; }

struct KvtcGpuCodec::Impl {};

namespace {
[[noreturn]] void absent() {
  throw Error(ErrorCode::kUnsupported, "kvcodec was built without CUDA (configure with -DKVCODEC_CUDA=ON)");
}
}  // namespace

KvtcGpuCodec::KvtcGpuCodec(const std::vector<const kvtc::HeadParams*>&, int64_t) { absent(); }
KvtcGpuCodec::KvtcGpuCodec(const KvtcCalibration&, const CalibratedLayout&) { absent(); }
KvtcGpuCodec::~KvtcGpuCodec() = default;
int KvtcGpuCodec::n_heads() const { absent(); }
int KvtcGpuCodec::sinks() const { absent(); }
int KvtcGpuCodec::window() const { absent(); }
void KvtcGpuCodec::set_fused_decode(bool) { absent(); }
int KvtcGpuCodec::head_dim() const { absent(); }
int64_t KvtcGpuCodec::n_streams(int64_t) const { absent(); }
uint64_t KvtcGpuCodec::max_encoded_bytes(int64_t) const { absent(); }
uint64_t KvtcGpuCodec::encode(const uint16_t*, int64_t, uint8_t*, uint64_t, uint64_t*, void*, int64_t) { absent(); }
void KvtcGpuCodec::decode(const uint8_t*, uint64_t, const uint64_t*, int64_t, uint16_t*, void*, int64_t) { absent(); }
void KvtcGpuCodec::check_errors(void*) { absent(); }
void KvtcGpuCodec::set_phase_timing(bool) { absent(); }
void KvtcGpuCodec::set_pipeline_chunks(int) { absent(); }
void KvtcGpuCodec::set_reconstruction(Reconstruction) { absent(); }
std::vector<double> KvtcGpuCodec::last_phase_ms() const { absent(); }

struct KvOffloadTier::Impl {};
KvOffloadTier::KvOffloadTier(const KvtcCalibration&, const std::vector<int>&, int, int64_t, int, int) { absent(); }
KvOffloadTier::~KvOffloadTier() = default;
int KvOffloadTier::n_layers() const { absent(); }
uint64_t KvOffloadTier::layer_bytes(int64_t) const { absent(); }
OffloadedKv KvOffloadTier::offload(const std::vector<const uint16_t*>&, int64_t, void*) { absent(); }
void KvOffloadTier::restore(const OffloadedKv&, const std::vector<uint16_t*>&, void*) { absent(); }
void KvOffloadTier::check_errors(void*) { absent(); }
void KvOffloadTier::set_reconstruction(KvtcGpuCodec::Reconstruction) { absent(); }
void KvOffloadTier::set_decode_lanes(int) { absent(); }

struct PaluGpuCodec::Impl {};
PaluGpuCodec::PaluGpuCodec(const palu::Projection&, int, int, int64_t) { absent(); }
PaluGpuCodec::~PaluGpuCodec() = default;
uint64_t PaluGpuCodec::group_bytes() const { absent(); }
void PaluGpuCodec::encode(const uint16_t*, int64_t, uint8_t*, void*) { absent(); }
void PaluGpuCodec::decode(const uint8_t*, int64_t, uint16_t*, void*) { absent(); }

}  // namespace kvcodec::gpu

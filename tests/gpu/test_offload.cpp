// The compressed KV offload tier (kvcodec/gpu.hpp: KvOffloadTier): the host
// bytes are the CPU reference encoder's, and a restore (copies overlapped
// with decoding on 1, 4 and 8 lanes, staging slots reused, codecs shared by
// layers) equals the CPU
// reference decode of those host bytes element by element. GPU tests skip
// without a device; KVCODEC_GPU_TEST_SEED draws fresh inputs.
#include <gtest/gtest.h>

#include <cstdio>
#include <utility>
#include <vector>

#include "gpu/calibrated_test_support.hpp"
#include "gpu/gpu_test_support.hpp"
#include "gpu/kvtc_variant.hpp"
#include "gpu/offloaded_kv.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/gpu.hpp"

namespace kvcodec::gpu {
namespace {

template <typename F>
void expect_error(ErrorCode code, F&& f, const char* what) {
  try {
    f();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << what << ": " << e.what();
  }
}

TEST(KvOffloadTier, AnEmptyHandleHoldsNothingAndNamesABadLayer) {
  const OffloadedKv h;
  EXPECT_EQ(h.n_layers(), 0);
  EXPECT_EQ(h.tokens(), 0);
  EXPECT_EQ(h.host_bytes(), 0u);
  expect_error(ErrorCode::kInvalidArgument, [&] { (void)h.payload(0); }, "payload of layer 0");
  EXPECT_EQ(offload_payload_at(1), 256u);
  EXPECT_EQ(offload_payload_at(32), 256u);
  EXPECT_EQ(offload_payload_at(33), 512u);
}

TEST(KvOffloadTier, WithoutAGpuItSaysSo) {
  if (have_gpu()) GTEST_SKIP() << "a CUDA device is present";
  const Synthetic s = synthetic(1, 128, 3);
  expect_error(ErrorCode::kUnsupported, [&] { KvOffloadTier t(s.cal, {0}, 1, 128); }, "tier without a GPU");
}

#ifdef KVCODEC_HAVE_CUDA
constexpr int kBatch = 2, kSinks = 4, kWindow = 8;

// Model layer l's KV [2, B, S, D] from the synthetic rows: keys of rows
// a, b then their values, the rows' order swapped on odd layers.
std::vector<uint16_t> layer_kv(const Synthetic& a, const Synthetic& b, int cal_layer, int model_layer) {
  const Synthetic* rows[2] = {&a, &b};
  if (model_layer % 2) std::swap(rows[0], rows[1]);
  std::vector<uint16_t> x;
  for (const bool key : {true, false})
    for (const Synthetic* r : rows) {
      const auto& v = (key ? r->keys : r->values)[size_t(cal_layer)];
      x.insert(x.end(), v.begin(), v.end());
    }
  return x;
}

struct Model {
  std::vector<int> cal_layers;
  std::vector<std::vector<uint16_t>> x;        // [layer][2 * B * S * D]
  std::vector<std::unique_ptr<DevBuf<uint16_t>>> dx, dy;
  std::vector<const uint16_t*> in() const {
    std::vector<const uint16_t*> p;
    for (const auto& d : dx) p.push_back(d->p);
    return p;
  }
  std::vector<uint16_t*> out() const {
    std::vector<uint16_t*> p;
    for (const auto& d : dy) p.push_back(d->p);
    return p;
  }
};

Model model(const Synthetic& a, const Synthetic& b, const std::vector<int>& cal_layers) {
  Model m;
  m.cal_layers = cal_layers;
  for (size_t l = 0; l < cal_layers.size(); ++l) {
    m.x.push_back(layer_kv(a, b, cal_layers[l], int(l)));
    m.dx.push_back(std::make_unique<DevBuf<uint16_t>>(m.x.back().size()));
    m.dy.push_back(std::make_unique<DevBuf<uint16_t>>(m.x.back().size()));
    EXPECT_EQ(cudaMemcpy(m.dx.back()->p, m.x.back().data(), m.x.back().size() * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  return m;
}

std::vector<uint16_t> fetch(const uint16_t* d, size_t n) {
  std::vector<uint16_t> y(n);
  EXPECT_EQ(cudaMemcpy(y.data(), d, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  return y;
}

TEST(KvOffloadTier, RestoreEqualsTheCpuReferenceDecodeOfTheHostBytes) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const uint32_t seed = test_seed(777);
  std::printf("seed %u\n", seed);
  const int64_t max_tokens = 4 + 64 * 6 + 8;
  const Synthetic a = synthetic(2, max_tokens, seed), b = synthetic(2, max_tokens, seed + 1000);
  // Eleven layers over two calibration layers: the staging slots (2 per
  // decode lane) reused within a restore, each codec decoding several layers.
  const Model m = model(a, b, {0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 1});
  const int L = int(m.cal_layers.size());
  KvOffloadTier tier(a.cal, m.cal_layers, kBatch, max_tokens, kSinks, kWindow);
  ASSERT_EQ(tier.n_layers(), L);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  // A ragged sequence (17 tokens in the last stream), then one only a stream long.
  for (const int64_t S : {int64_t(4 + 64 * 5 + 17 + 8), int64_t(4 + 64 + 8)}) {
    // The layers' first S tokens: the rows of a [2, B, S, D] buffer of S tokens.
    std::vector<std::vector<uint16_t>> xs;
    for (size_t l = 0; l < m.x.size(); ++l) {
      std::vector<uint16_t> x;
      for (int r = 0; r < 2 * kBatch; ++r) {
        const uint16_t* row = m.x[l].data() + size_t(r) * size_t(max_tokens) * kDim;
        x.insert(x.end(), row, row + S * kDim);
      }
      ASSERT_EQ(cudaMemcpy(m.dx[l]->p, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      xs.push_back(std::move(x));
    }
    const OffloadedKv h = tier.offload(m.in(), S, stream);
    ASSERT_EQ(h.n_layers(), L);
    ASSERT_EQ(h.tokens(), S);
    uint64_t held = 0;
    std::vector<std::vector<uint16_t>> y_ref;
    std::vector<FlatKvtcTables> tables;
    for (int l = 0; l < L; ++l) {
      tables.push_back(flatten_calibration(a.cal, {m.cal_layers[size_t(l)]}, kBatch, max_tokens, kSinks, kWindow));
      const EncodedBatch ref = encode_batch_reference(tables.back(), xs[size_t(l)].data(), S, 64);
      ASSERT_EQ(h.payload_size(l), ref.payload.size()) << "layer " << l;
      ASSERT_EQ(size_t(h.n_offsets(l)), ref.offsets.size());
      EXPECT_TRUE(std::equal(ref.payload.begin(), ref.payload.end(), h.payload(l))) << "layer " << l << " bytes";
      EXPECT_TRUE(std::equal(ref.offsets.begin(), ref.offsets.end(), h.offsets(l))) << "layer " << l << " offsets";
      held += offload_payload_at(h.n_offsets(l)) + h.payload_size(l);
      // The reference decode of the HOST bytes, as the restore reads them.
      y_ref.emplace_back(xs[size_t(l)].size());
      decode_batch_reference(tables.back(), h.payload(l), h.payload_size(l), h.offsets(l), S, 64,
                             y_ref.back().data());
    }
    EXPECT_EQ(h.host_bytes(), held);
    EXPECT_LT(h.host_bytes(), uint64_t(L) * tier.layer_bytes(S));
    std::printf("S = %lld: %llu host bytes for %llu of bf16 KV\n", (long long)S, (unsigned long long)h.host_bytes(),
                (unsigned long long)(uint64_t(L) * tier.layer_bytes(S)));

    auto restore_and_fetch = [&](int times) {
      for (const auto& d : m.dy) EXPECT_EQ(cudaMemset(d->p, 0xff, xs[0].size() * 2), cudaSuccess);  // NaN
      for (int i = 0; i < times; ++i) tier.restore(h, m.out(), stream);  // back to back: staging reuse
      tier.check_errors(stream);
      std::vector<std::vector<uint16_t>> y;
      for (int l = 0; l < L; ++l) y.push_back(fetch(m.dy[size_t(l)]->p, xs[size_t(l)].size()));
      return y;
    };
    tier.set_reconstruction(KvtcGpuCodec::Reconstruction::kExactFp32);
    for (const int lanes : {1, 4, 8}) {
      tier.set_decode_lanes(lanes);
      const auto y = restore_and_fetch(1);
      for (int l = 0; l < L; ++l) {
        size_t bad = 0;
        for (size_t i = 0; i < y[size_t(l)].size(); ++i) bad += y[size_t(l)][i] != y_ref[size_t(l)][i];
        EXPECT_EQ(bad, 0u) << "layer " << l << ", lanes " << lanes << ", of " << y[size_t(l)].size()
                           << " exact-path outputs";
      }
    }
    tier.set_reconstruction(KvtcGpuCodec::Reconstruction::kTf32TensorCores);
    tier.set_decode_lanes(4);
    const auto y_tc = restore_and_fetch(2);
    for (int l = 0; l < L; ++l) {
      size_t n_diff = 0;
      EXPECT_EQ(tf32_bound_violations(tables[size_t(l)], tables[size_t(l)].n_heads, xs[size_t(l)].data(), S,
                                      y_tc[size_t(l)].data(), y_ref[size_t(l)].data(), &n_diff),
                0u)
          << "layer " << l;
    }
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST(KvOffloadTier, RefusesWhatItCannotRestore) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t S = 4 + 64 * 3 + 8;
  const Synthetic a = synthetic(2, S, test_seed(99)), b = synthetic(2, S, test_seed(99) + 7);
  const Model m = model(a, b, {0, 1, 0});
  expect_error(ErrorCode::kInvalidArgument, [&] { KvOffloadTier t(a.cal, {0, 2}, kBatch, S); }, "layer 2 of 2");
  expect_error(ErrorCode::kInvalidArgument, [&] { KvOffloadTier t(a.cal, {}, kBatch, S); }, "no layers");
  expect_error(ErrorCode::kInvalidArgument, [&] { KvOffloadTier t(a.cal, {0}, 0, S); }, "batch 0");
  KvOffloadTier tier(a.cal, m.cal_layers, kBatch, S, kSinks, kWindow);
  expect_error(ErrorCode::kInvalidArgument, [&] { tier.set_decode_lanes(0); }, "0 decode lanes");
  expect_error(ErrorCode::kInvalidArgument, [&] { tier.set_decode_lanes(9); }, "9 decode lanes");
  expect_error(ErrorCode::kInvalidArgument, [&] { (void)tier.offload(m.in(), S + 1, nullptr); }, "tokens > max");
  expect_error(ErrorCode::kInvalidArgument, [&] { (void)tier.offload(m.in(), 0, nullptr); }, "0 tokens");
  auto two = m.in();
  two.pop_back();
  expect_error(ErrorCode::kInvalidArgument, [&] { (void)tier.offload(two, S, nullptr); }, "2 buffers for 3");
  auto with_null = m.in();
  with_null[1] = nullptr;
  expect_error(ErrorCode::kInvalidArgument, [&] { (void)tier.offload(with_null, S, nullptr); }, "null buffer");

  OffloadedKv h = tier.offload(m.in(), S, nullptr);
  auto out = m.out();
  out.pop_back();
  expect_error(ErrorCode::kInvalidArgument, [&] { tier.restore(h, out, nullptr); }, "restore into 2 buffers");
  KvOffloadTier other(a.cal, {0, 1}, kBatch, S, kSinks, kWindow);
  expect_error(ErrorCode::kInvalidArgument, [&] { other.restore(h, {m.dy[0]->p, m.dy[1]->p}, nullptr); },
               "a 3-layer handle into a 2-layer tier");
  KvOffloadTier one_row(a.cal, m.cal_layers, 1, S, kSinks, kWindow);
  expect_error(ErrorCode::kInvalidArgument, [&] { one_row.restore(h, m.out(), nullptr); },
               "a handle of batch 2 into a tier of batch 1");

  // Offsets past the payload are refused on the host; a stream cut short
  // (still ascending) is flagged by the decode, and the flag of layer 0
  // survives the later decode of layer 2 by the same codec.
  uint64_t* off = const_cast<uint64_t*>(h.offsets(0));
  const uint64_t keep = off[1];
  off[1] = h.payload_size(0) + 1;
  expect_error(ErrorCode::kInvalidArgument, [&] { tier.restore(h, m.out(), nullptr); }, "offsets past the payload");
  off[1] = keep;
  if (off[2] > off[1] + 1) {
    off[1] -= 1;
    tier.restore(h, m.out(), nullptr);
    expect_error(ErrorCode::kFormat, [&] { tier.check_errors(nullptr); }, "a stream cut short");
    off[1] += 1;
  }
  tier.restore(h, m.out(), nullptr);
  tier.check_errors(nullptr);  // reported once, then clear

  OffloadedKv moved = std::move(h);
  expect_error(ErrorCode::kInvalidArgument, [&] { tier.restore(h, m.out(), nullptr); }, "a moved-from handle");
  tier.restore(moved, m.out(), nullptr);
  tier.check_errors(nullptr);
}
#endif

}  // namespace
}  // namespace kvcodec::gpu

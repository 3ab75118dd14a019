// KVTC: transform coding of one head's vectors (DESIGN 4).
//
// Pipeline per head and tensor (K or V): centre -> project on a PCA basis ->
// allocate bits per principal component -> quantize -> entropy-code.
// fit_head() freezes every parameter from the fit tokens; encode_block() and
// decode_block() are stateless given those parameters, so a token's codes
// never change after it is written.
//
// Shapes: one head's tokens are [n, D] row-major (D = head_dim); a block's
// codes are [n, K] with K = kept components (those with a nonzero width).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "entropy/entropy.hpp"
#include "kvcodec/container.hpp"
#include "kvcodec/tensor.hpp"

namespace kvcodec::kvtc {

enum class Allocator : uint8_t {
  kDp = 0,    // exact DP over bit_choices on the beta distortion model (the seeds')
  kRate = 1,  // one quantizer step for every component, chosen on measured entropy
};

enum class CoderChoice : uint8_t { kRans = 0, kHuffman = 1, kFixed = 2, kAuto = 3 };

const char* allocator_name(Allocator a);
const char* coder_name(CoderChoice c);

// The widest component code: 4096 levels, the most a serialised quantizer
// holds (HeadParams::deserialize refuses more), so bit_choices lie in
// [0, kMaxComponentBits].
inline constexpr int kMaxComponentBits = 12;

struct CodecOptions {
  int bit_budget = 0;                          // payload bits per token; 0 -> 4 * D
  std::vector<int> bit_choices{0, 1, 2, 3, 4, 6, 8};  // each in [0, kMaxComponentBits]
  double beta = 3.5;                           // distortion model d(v, b) = v * beta^-b
  Allocator allocator = Allocator::kDp;
  CoderChoice coder = CoderChoice::kRans;
  int basis_bits = 16;                         // 16: f16 basis; 8: int8 rows with an f16 scale
  // rate allocator only: > 0 picks the step by the relative squared error it
  // reaches on the fit tokens (||x - x_hat||^2 / ||x||^2) instead of the budget.
  double target_rel_mse = 0.0;
  // The fitted parameters' kernels include the 8-bit projection
  // (KernelSet::kInt8), and the fit measures its error (the target,
  // the coder's tables) with it: for an encoder that codes with them.
  bool int8_kernels = false;
};

// One kept principal component: its uniform quantizer. code = clamp(round(c /
// step) + zero, 0, levels - 1); reconstruction (code - zero) * step.
struct ComponentQuantizer {
  float step = 1.0f;
  uint16_t levels = 1;
  uint16_t zero = 0;  // code of the reconstruction point nearest to 0 (may be fractional: see half_offset)
  bool half_offset = false;  // midrise grid: reconstruction points at (code - zero + 0.5) * step
  // Centroid reconstruction (issue 21; docs/history/calibrated-sessions.md): the coefficients
  // of a cell are not spread evenly over it (a peaked, Laplacian-like
  // distribution leans toward 0), so the cell's centroid reconstructs them
  // with less error than its lattice point, at the same codes and bits.
  // With m = code - recon offset (integer midtread, half-integer midrise)
  // the value is sign(m) * (|m| + centroid[c]) * step for the cells |m| = 1,
  // 2, >= 3 (midtread) or 1/2, 3/2, >= 5/2 (midrise): c = 0, 1, 2; the zero
  // cell stays 0. Offsets in steps, in [-1/2, 1/2], f16 as stored. All 0:
  // the lattice (what fit_head gives; serialised as before, without them).
  std::array<float, 3> centroid{};
  bool has_centroid() const { return centroid[0] != 0.0f || centroid[1] != 0.0f || centroid[2] != 0.0f; }
};

// The reconstruction of `code` in steps (times q.step: the coefficient):
// m = code - recon offset on the lattice, moved by q.centroid. The one
// definition every decode path (float, integer, reference) follows.
double reconstruction_steps(const ComponentQuantizer& q, uint32_t code);
// Centroid class (index into ComponentQuantizer::centroid) of the cell whose
// lattice point is m steps from 0, or -1 for the zero cell.
int centroid_class(double m);

// Which kernels derived from the parameters (HeadKernels::build) a
// HeadParams holds: a decoder needs the decode tables and the integer
// reconstruction, an encoder the encode constants and the integer
// projection. A cache that holds its parameters as bytes builds one set per
// call (src/cache/kvtc_cache.cpp).
// kHeld: both, plus the float projection's transposed basis
// (HeadKernels::basis_t), for parameters held for many calls (a
// calibration), whose rows past the integer projection's range would
// otherwise transpose the basis again in every block.
// kInt8, added to a set: the 8-bit kernels as well (with kEncode the
// projection, HeadKernels::proj8; with kDecode the reconstruction,
// HeadKernels::recon8), which quantize_block and dequantize_block then
// prefer. The local kvtc cache opts in.
// kProj8, added to a set: the 8-bit projection alone (no recon8). The
// calibrations hold it (KvtcCalibration::parse): the calibrated caches
// encode with it (their kvtc.int8) and decode with the 16-bit kernels, the
// values the GPU format's decoder reproduces.
enum class KernelSet : uint8_t { kNone = 0, kDecode = 1, kEncode = 2, kBoth = 3, kHeld = 7, kInt8 = 8, kProj8 = 16 };
constexpr KernelSet operator|(KernelSet a, KernelSet b) { return KernelSet(uint8_t(a) | uint8_t(b)); }

struct HeadParams;

// Index of W[k][d] in HeadKernels::proj_w ([ceil(K/8)][Dp/2][8][2]; dp2 = Dp / 2).
inline size_t proj_w_index(size_t k, size_t d, size_t dp2) { return ((k / 8) * dp2 + d / 2) * 16 + (k % 8) * 2 + d % 2; }
// Index of W[k][d] in HeadKernels::recon_w ([ceil(D/8)][Kp/2][8][2]; kp2 = Kp / 2).
inline size_t recon_w_index(size_t k, size_t d, size_t kp2) { return ((d / 8) * kp2 + k / 2) * 16 + (d % 8) * 2 + k % 2; }
// Index of W8[k][d] in HeadKernels::recon8_w ([ceil(D/8)][Kp4/4][8][4]; kq = Kp4 / 4, Kp4 = K rounded up to 4).
inline size_t recon8_w_index(size_t k, size_t d, size_t kq) { return ((d / 8) * kq + k / 4) * 32 + (d % 8) * 4 + k % 4; }
// Index of W8[k][d] in HeadKernels::proj8_w ([ceil(K/8)][Dp4/4][8][4]; dp4 = Dp4 / 4, Dp4 = D rounded up to 4).
inline size_t proj8_w_index(size_t k, size_t d, size_t dp4) { return ((k / 8) * dp4 + d / 4) * 32 + (k % 8) * 4 + d % 4; }

// The integer projection's two scalar steps, shared by the codec's kernels
// and the kvtc-gpu reference (src/gpu), so the two cannot drift:
// Whether a centred row times sc fits the integer projection, from its
// largest |c| m and its square-sum lanes [8] (lane l: the c[d]^2 of
// d = l mod 8, summed in order by fmas; a fixed tree adds the lanes).
// The square sum of a row's lanes [8], by the one fixed tree every path adds them in.
inline float lane_square_sum(const float* lane) {
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}
inline bool scaled_row_fits(float m, const float* lane, float sc, float max_abs, float max_sq) {
  const float ss = lane_square_sum(lane);
  return std::fabs(ss) < std::numeric_limits<float>::infinity() && m * sc <= max_abs && ss * (sc * sc) <= max_sq;
}
// One code from the integer projection's exact sum: quantize's floor and
// clamp as the AVX2 epilogue computes them (min(max_code, y); truncation,
// which is the floor for y >= 0; negative and NaN y give 0).
inline uint16_t proj_code(int32_t acc, float qscale, float offset, float max_code) {
  const float y = std::fma(float(acc), qscale, offset);
  const float v = max_code < y ? max_code : y;
  return v >= 0.0f ? uint16_t(int32_t(v)) : uint16_t(0);
}
// Where a quantizer's codes start: code = floor(c / step + code_offset).
inline float code_offset(const ComponentQuantizer& q) {
  return q.half_offset ? float(q.levels / 2) : float(q.zero) + 0.5f;
}
// The 8-bit projection's steps (HeadKernels::proj8), shared by its kernels
// and the plain loops: whether a centred row takes it, from its largest |c|
// m and its square sum ss (lane_square_sum of scaled_row_fits' lanes) ...
inline bool proj8_row_fits(float m, float ss, float gate_m, float gate_ss) {
  return std::fabs(ss) < std::numeric_limits<float>::infinity() && m * m * gate_m + ss * gate_ss <= 1.0f;
}
// ... the row's scale to [-127, 127] (0 for a zero row) and the factor its
// sums take back ...
inline float proj8_row_scale(float m) { return m > 0.0f ? 127.0f / m : 0.0f; }
inline float proj8_row_factor(float m) { return m / 127.0f; }
// ... and one code from the exact sum acc = sum_d x[d] * W8[k][d]: as
// proj_code, from fma(float(acc) * factor, qscale, offset).
inline uint16_t proj8_code(int32_t acc, float factor, float qscale, float offset, float max_code) {
  const float y = std::fma(float(acc) * factor, qscale, offset);
  const float v = max_code < y ? max_code : y;
  return v >= 0.0f ? uint16_t(int32_t(v)) : uint16_t(0);
}
// The integer reconstruction's centred code c = 2 code - zero2 as int16
// (modulo 2^16 for codes past a component's levels, which decoders reject
// before); shared by the codec's loops and the kvtc-gpu reference.
inline int16_t doubled_code(uint16_t code, int16_t zero2) { return int16_t(uint16_t(2u * code - uint16_t(zero2))); }

// The kernels derived from one HeadParams (not serialised): coder tables and
// the integer kernels' weights. Immutable once built (rans_groups points into
// rans_decode, so it is never copied or moved), held by shared_ptr: every
// copy of the parameters, and every cache using them, shares one.
struct HeadKernels {
  KernelSet set = KernelSet::kNone;
  // The decoder's slot tables and the encoder's division-free constants.
  // encode_block/decode_block build them on the fly (slowly) when missing.
  std::vector<entropy::RansDecodeTable> rans_decode;
  std::vector<entropy::RansEncodeTable> rans_encode;
  // The rANS group decoder's tables for rans_decode (see entropy.hpp).
  entropy::RansGroupTables rans_groups;
  // The reconstruction may skip a component whose coefficient in a row is
  // exactly 0 (dequantize_block): fma(0, b, acc) is acc bit for bit when
  // b is finite (0 * b is a zero) and acc is not -0. An accumulator starts
  // at the mean (so: no -0, NaN or infinity there) and an FMA returns -0
  // only from -0 + -0 or when its nonzero exact result rounds to zero;
  // with every nonzero |coefficient| and |basis value| >= 2^-40 (steps
  // >= 2^-39) the exact results are multiples of 2^-149, so that cannot
  // happen. Set by build() when those hold; false (every term
  // multiplied) otherwise or when it was not run.
  bool recon_skip_zeros = false;
  // The integer reconstruction (dequantize_block's default when set):
  // x[d] = fma(float(acc[d]), recon_scale[d], mean[d]) with the exact int32
  // sum acc[d] = sum_k c[k] * W[k][d] of the doubled centred codes
  // c[k] = 2 * code[k] - recon_zero2[k] (int16) and the weights
  // W[k][d] = round(step[k] * basis[k][d] / 2 / recon_scale[d]) (int16,
  // |W| <= 32767, sum_k max|c[k]| * |W[k][d]| < 2^31: no valid code can
  // overflow). An integer sum has one value whatever the order, so the
  // AVX2 kernel (_mm256_madd_epi16: 16 products per instruction, an FMA's
  // 8; bench_kvtc BM_ReconstructAB: ~1.1-1.3x the float kernel at the 1%
  // target on Zen 3), the plain loops and any build give the same bits. Its
  // distance to the float product is bounded by the weights' rounding:
  // |x - exact| <= recon_scale[d] * sum_k |c[k]| / 2 (+ float rounding), at
  // 15 bits of the column's largest weight far below the quantisation error.
  // recon_w is laid out [ceil(D/8)][Kp/2][8][2] (Kp = K rounded up to even:
  // a pair of components' weights interleaved per output column, the
  // operand layout of madd). Set by build() when every level count
  // keeps |c| <= 32767 and the parameters are finite; false otherwise (the
  // float reconstruction runs).
  // With centroid reconstruction (some ComponentQuantizer::centroid set)
  // the centred codes are not 2 code - zero2 but a table's: c[k] =
  // recon_lut[recon_lut_base[k] + code] = round(u * reconstruction_steps(q_k,
  // code)) and W[k][d] = round(step[k] * basis[k][d] / u / recon_scale[d]),
  // with one power of two u for the head (<= 2^12, the largest keeping
  // every |c| <= 32767: the weights keep the precision of the lattice's,
  // and the reconstruction moves by at most 1 / (2 u) steps). Empty for
  // lattice heads (u = 2).
  std::vector<int16_t> recon_lut;        // [sum of levels]
  std::vector<uint32_t> recon_lut_base;  // [K]
  std::vector<int16_t> recon_zero2;  // [K]
  std::vector<float> recon_scale;    // [D]
  std::vector<int16_t> recon_w;      // [ceil(D/8)][Kp/2][8][2]
  bool recon_int = false;
  // The integer projection (quantize_block's default when set). A centred
  // row c [D] becomes x = nearbyint(c * proj_scale) (int16); the weights
  // are W[k][d] = round(basis[k][d] * proj_unit) (int16); the code is the
  // floor, clamped, of fma(float(acc[k]), proj_qscale[k], offset[k]) with
  // the exact int32 sum acc[k] = sum_d x[d] * W[k][d] and proj_qscale[k] =
  // 1 / (proj_unit * proj_scale * step[k]). A row takes it when its largest
  // |c| * proj_scale <= proj_max_abs (< 32767) and ||c||^2 * proj_scale^2
  // <= proj_max_sq, which keeps ||x||_2 * max_k ||W[k]||_2 < 2^31, so acc
  // and every partial sum of it fit (Cauchy-Schwarz); other rows (a
  // non-finite value, or longer than the quantizers' cells reach) take the
  // float kernel, row by row: a row's codes depend on that row alone. One
  // scale for all rows (a row as long as the cells reach fills the int16
  // range) keeps the epilogue one fma per code, as the float kernel's.
  // As with the integer reconstruction, an integer sum has one value in
  // any order: the AVX2 madd tiles (bench_kvtc BM_QuantizeAB: ~1.1x the
  // float kernel on Zen 3, the scaling included) and the plain loops give
  // the same codes. Its distance to the exact coefficient is bounded by the
  // two roundings, 0.5 per x and per W: ||W[k]||_1 / 2 / proj_scale +
  // ||c||_1 / 2, over proj_unit (~1e-4 of the cells' reach at worst, far
  // below the steps of the rate targets): a code differs from the exact
  // projection's only for a coefficient that close to a cell edge.
  // proj_w is laid out [ceil(K/8)][Dp/2][8][2] (Dp = D rounded up to even).
  // Set by build() when the basis and the steps are finite and the
  // steps nonzero; false otherwise (the float kernel runs).
  std::vector<int16_t> proj_w;       // [ceil(K/8)][Dp/2][8][2]: W[k][d] at proj_w_index(k, d, Dp / 2)
  std::vector<float> proj_qscale;    // [K8]
  // The basis transposed [D][K8] (K8 = K rounded up to 8, padded with 0),
  // the float projection's operand; only in kHeld sets (empty: transposed
  // per call into scratch).
  std::vector<float> basis_t;
  float proj_unit = 0.0f;
  float proj_scale = 0.0f;
  float proj_max_abs = 0.0f;
  float proj_max_sq = 0.0f;
  bool proj_int = false;
  // The 8-bit projection (kInt8 sets; quantize_block's choice where
  // set, before proj_int): twice the products per VNNI instruction
  // (vpdpbusd: 32 per 256 bits, vpdpwssd's 16), at 7 bits of each row and
  // weight. A centred row c [D] with largest |c| m becomes x[d] =
  // nearbyint(c[d] * 127 / m) (int8, |x| <= 127); the weights are W8[k][d]
  // = round(basis[k][d] * 127 / max_d |basis[k][d]|) (int8); the code is
  // proj8_code of the exact int32 sum acc[k] = sum_d x[d] * W8[k][d] with
  // factor m / 127 and proj8_qscale[k] = 1 / (unit8[k] * step[k]). The two
  // roundings add noise of variance (m / 127)^2 ||b_k||^2 / 12 + ||c||^2
  // ||W8[k] / unit8[k] - b_k||^2 / (12 D) (the second for a row spread over
  // its D values) to a coefficient whose quantisation noise is step[k]^2 /
  // 12. A row takes it when m^2 proj8_gate_m + ||c||^2 proj8_gate_ss <= 1
  // (proj8_row_fits), which keeps that added noise at most 1/16 of every
  // kept component's (proj8_gate_m = max_k ||b_k||^2 / (127 step_k / 4)^2,
  // proj8_gate_ss = max_k ||W8[k] / unit8[k] - b_k||^2 / (D (step_k / 4)^2));
  // other rows take proj_int (then the float kernel) row by row, so a row's
  // codes still depend on that row alone. Only with proj_int, for D up to
  // 65536 (|acc| <= 255 * 127 * D < 2^31 with the kernels' +128 offset).
  // The VNNI kernel takes u8 rows x + 128 and adds proj8_bias[k] = -128
  // sum_d W8[k][d]; the AVX2 one multiplies |x| by W8 with x's sign
  // (vpmaddubsw, no saturation at |x|, |W8| <= 127): the same sums as the
  // plain loops, so the same codes on every CPU.
  // The 8-bit reconstruction (kInt8 sets with kDecode; dequantize_block's
  // choice where set, before recon_int): vpdpbusd's 32 products per
  // instruction on the codes themselves (u8: every level count <= 256)
  // and weights W8[k][d] = round(step[k] * basis[k][d] * unit8[d]) (int8,
  // unit8[d] = 127 / max_k |step[k] * basis[k][d]|): x[d] =
  // fma(float(2 acc[d] - recon8_bias2[d]), recon8_scale[d], mean[d]) with
  // the exact int32 sum acc[d] = sum_k code[k] * W8[k][d], recon8_bias2[d]
  // = sum_k recon_zero2[k] * W8[k][d] (the doubled codes' zeros) and
  // recon8_scale[d] = 1 / (2 unit8[d]). Its distance to the exact
  // reconstruction is that of the weights' rounding, |x - exact| <= sum_k
  // |code[k] - zero2[k] / 2| / (2 unit8[d]) (+ float rounding); ~1e-4 of
  // ||x||^2 as a squared error at the 1% target on the head_dim-128 dump, which
  // the fit measures (CodecOptions::int8_kernels). Built from recon_int's
  // tables, for lattice heads (no centroids) of K <= 16384, which it then
  // replaces (recon_int false, its tables released: they would only be
  // held). VNNI tiles, AVX2 tiles and plain loops give the same bits.
  std::vector<int8_t> recon8_w;       // [ceil(D/8)][Kp4/4][8][4]: W8[k][d] at recon8_w_index(k, d, Kp4 / 4)
  std::vector<int32_t> recon8_bias2;  // [D8]
  std::vector<float> recon8_scale;    // [D8]
  bool recon8 = false;
  std::vector<int8_t> proj8_w;        // [ceil(K/8)][Dp4/4][8][4]: W8[k][d] at proj8_w_index(k, d, Dp4 / 4)
  std::vector<int32_t> proj8_bias;    // [K8]
  std::vector<float> proj8_qscale;    // [K8]
  float proj8_gate_m = 0.0f;
  float proj8_gate_ss = 0.0f;
  bool proj8 = false;

  // Builds `which` from p (kNone: none, the plain paths).
  static std::shared_ptr<const HeadKernels> build(const HeadParams& p, KernelSet which);
  // The same kernels by plain loops (value checks one by one, the rounding
  // with its range test, the window search's reference): what build's
  // branch-free loops are tested against, field by field.
  static std::shared_ptr<const HeadKernels> build_reference(const HeadParams& p, KernelSet which);
  // Heap bytes held (capacities), the object itself included.
  uint64_t held_bytes() const;

  HeadKernels() = default;
  HeadKernels(const HeadKernels&) = delete;
  HeadKernels& operator=(const HeadKernels&) = delete;
};

// Frozen parameters of one head for one tensor: what is serialised (a value
// type), plus the kernels derived from them (shared, see HeadKernels).
struct HeadParams {
  int dim = 0;
  CoderChoice coder = CoderChoice::kFixed;  // never kAuto once fitted
  int basis_bits = 16;
  std::vector<float> mean;                  // [D], as stored (f16-rounded)
  std::vector<uint16_t> kept;               // indices of kept components, ascending
  std::vector<float> basis;                 // [K, D] rows of kept axes, as stored
  std::vector<float> row_scale;             // [K] f16 scale of each int8 row (basis_bits == 8)
  std::vector<ComponentQuantizer> quant;    // [K]
  std::vector<entropy::FrequencyTable> rans_tables;   // [K] when coder == kRans
  std::vector<entropy::HuffmanTable> huffman_tables;  // [K] when coder == kHuffman
  std::vector<uint8_t> fixed_widths;                  // [K] when coder == kFixed

  // Not stored: what the fit saw, for telemetry and bounds.
  std::vector<double> eigenvalues;          // [D] descending
  std::vector<int> bits;                    // [D] allocated width (dp) or ceil(log2 levels)

  int n_kept() const { return int(kept.size()); }

  // Side information exactly as serialised.
  void serialize(ByteWriter& out) const;
  // Parses and validates, then builds `kernels`.
  static HeadParams deserialize(ByteReader& in, int expected_dim, KernelSet kernels = KernelSet::kBoth);
  size_t serialized_size() const;

  // The kernels built from the parameters above (null: none, as for
  // parameters assembled by hand: the plain float paths, tables built per
  // call). Derived, so a change to the parameters needs build_kernels()
  // again. An encode entry point given kDecode kernels, or a decode one
  // given kEncode, throws Error(kInvalidArgument) rather than take a path
  // of other codes or bits.
  std::shared_ptr<const HeadKernels> kernels;
  KernelSet kernel_set() const { return kernels ? kernels->set : KernelSet::kNone; }
  // *kernels, or an empty set when none are built. Inline: the encoder's
  // row loops read the kernels' scales through it once per row.
  const HeadKernels& derived() const { return kernels ? *kernels : no_kernels(); }
  void build_kernels(KernelSet which) { kernels = HeadKernels::build(*this, which); }
  void build_decoders() { build_kernels(KernelSet::kBoth); }

  // Heap bytes held (capacities): the parameters above (mean, kept, basis,
  // scales, quantizers, coder tables, fit telemetry) and, apart, the
  // kernels derived from them (HeadKernels::held_bytes; shared by copies).
  // For CacheStats::resident_bytes.
  uint64_t params_held_bytes() const;
  uint64_t derived_held_bytes() const { return kernels ? kernels->held_bytes() : 0; }

 private:
  static const HeadKernels& no_kernels();  // the empty set derived() returns
};

// One head's parameters parsed and its kernels built again and again into
// the same storage: open() gives what HeadParams::deserialize gives (every
// field, table and kernel equal), without the ~200 heap allocations a head
// costs there once the storage has grown to the largest head it opened. For
// a cache that holds its parameters as bytes and opens each head for one
// encode call (src/cache/kvtc_cache.cpp keeps one per thread): scratch, not
// a cache of heads (each open() parses and builds everything again).
// Test: Codec.HeadOpenerEqualsDeserialize.
class HeadOpener {
 public:
  // Valid until the next open() (or this opener's end). A copy of the
  // result shares its kernels, which the next open() then leaves to it.
  // Errors as deserialize's.
  const HeadParams& open(ByteReader& in, int expected_dim, KernelSet kernels);

 private:
  HeadParams params_;
  std::shared_ptr<HeadKernels> kernels_;
};

// Fits one head from x [n, D] (row-major) given its PCA (eigen-sorted axes).
// components is [D, D] row-major, row k = k-th axis; mean [D]; eigenvalues [D].
HeadParams fit_head(const float* x, int64_t n, int dim, const std::vector<float>& mean,
                    const std::vector<float>& components, const std::vector<double>& eigenvalues,
                    const CodecOptions& options);

// Encodes n tokens x [n, D] into bytes (payload only; the caller frames it).
std::vector<uint8_t> encode_block(const HeadParams& p, const float* x, int64_t n);

// The same bytes as encode_block of the n rows x + t * row_stride (t < n,
// each D floats), first rounded to the raw dtype (f16 or bf16) and back as a
// kvtc cache's raw tail stores them (kvtc::f32_to_raw, kvtc::raw_to_f32):
// the rounding is fused into the centring pass, without the round trip
// through a raw buffer. raw other than f16/bf16: Error(kInvalidArgument).
std::vector<uint8_t> encode_block_rows(const HeadParams& p, const float* x, int64_t row_stride, int64_t n,
                                       DType raw);

// Two blocks of n tokens, x_a and x_b, each into the bytes encode_block /
// encode_block_rows gives it; their rANS streams are coded side by side
// (entropy::rans_encode_pair: one stream's state chain leaves the core
// waiting; two overlap).
std::pair<std::vector<uint8_t>, std::vector<uint8_t>> encode_block_pair(const HeadParams& p, const float* x_a,
                                                                        const float* x_b, int64_t n);
std::pair<std::vector<uint8_t>, std::vector<uint8_t>> encode_block_rows_pair(const HeadParams& p, const float* x_a,
                                                                             const float* x_b, int64_t row_stride,
                                                                             int64_t n, DType raw);

// Decodes bytes of n tokens into out [n, D]. Throws Error(kFormat) on bad bytes.
void decode_block(const HeadParams& p, const uint8_t* data, size_t size, int64_t n, float* out);

// Up to kMaxBlocksTogether blocks of n tokens each decoded together (a
// block's keys and values, of one or two heads): the same outputs and
// errors as decode_block of each in order; with rANS on all of them their
// streams are decoded in one interleaved loop, whose dependency chains the
// core overlaps (entropy::rans_decode_streams). More blocks:
// Error(kInvalidArgument).
struct BlockDecode {
  const HeadParams* params = nullptr;
  const uint8_t* data = nullptr;
  size_t size = 0;
  float* out = nullptr;  // [n, D]
};
inline constexpr size_t kMaxBlocksTogether = entropy::kRansMaxStreams;
void decode_blocks(const BlockDecode* blocks, size_t count, int64_t n);
// decode_blocks of {pa, ...} and {pb, ...}.
void decode_block_pair(const HeadParams& pa, const uint8_t* data_a, size_t size_a, float* out_a,
                       const HeadParams& pb, const uint8_t* data_b, size_t size_b, float* out_b, int64_t n);

// The integer codes of a block, before entropy coding ([n, K] row-major), and
// back: the two halves of encode/decode, exposed for tests and rate studies.
void quantize_block(const HeadParams& p, const float* x, int64_t n, uint16_t* codes);
void dequantize_block(const HeadParams& p, const uint16_t* codes, int64_t n, float* out);
// How the reconstruction runs, for tests and benches: kAuto is
// dequantize_block (the integer reconstruction when p.kernels->recon_int; otherwise
// the float product, zero coefficients skipped when at least 40% of the
// block's are zero and p.kernels->recon_skip_zeros); kDense is the float product
// multiplying every term (the reference the float paths equal bit for
// bit); kSkipZeros skips zero terms whenever p.kernels->recon_skip_zeros (and the
// AVX2 kernels are built); kInteger is the integer reconstruction
// (Error(kInvalidArgument) without p.kernels->recon_int).
// kInteger8 the 8-bit reconstruction (Error(kInvalidArgument) without
// p.kernels->recon8); kAuto takes it where set.
enum class ReconPath { kAuto, kDense, kSkipZeros, kInteger, kInteger8 };
void dequantize_block_path(const HeadParams& p, const uint16_t* codes, int64_t n, float* out, ReconPath path);

// How the projection runs, for tests and benches: kAuto is quantize_block
// (the integer projection when p.kernels->proj_int, else the float kernel); kFloat
// the float kernel (same codes as the plain float loops); kInteger the
// integer projection (Error(kInvalidArgument) without p.kernels->proj_int; rows
// that do not fit it still take the float kernel, as in kAuto).
// kInteger8 the 8-bit projection (Error(kInvalidArgument) without
// p.kernels->proj8), the rows it refuses by kInteger's paths; kAuto takes
// it too where p.kernels->proj8.
enum class QuantPath { kAuto, kFloat, kInteger, kInteger8 };
void quantize_block_path(const HeadParams& p, const float* x, int64_t n, uint16_t* codes, QuantPath path);
// quantize_block_path of rows the caller has centred, c [n, D] = x - p.mean
// (one IEEE subtraction per value, as quantize_block_path's own: the same
// codes), for callers that centre in a pass they make anyway.
void quantize_centred_block(const HeadParams& p, const float* c, int64_t n, uint16_t* codes, QuantPath path);

// Plain-loop reference of quantize_block + dequantize_block (projection and
// reconstruction by naive loops in double), for testing the fast path.
void quantize_block_reference(const HeadParams& p, const float* x, int64_t n, uint16_t* codes);
void dequantize_block_reference(const HeadParams& p, const uint16_t* codes, int64_t n, float* out);
// Plain loops of the integer reconstruction (see HeadKernels::recon_int),
// which the AVX2 tiles equal bit for bit; also what dequantize_block runs
// without them (no AVX2, or D % 8 != 0). Error(kInvalidArgument) without
// p.kernels->recon_int.
void dequantize_block_integer_reference(const HeadParams& p, const uint16_t* codes, int64_t n, float* out);
// Plain loops of the integer projection (see HeadKernels::proj_int), which
// the AVX2 tiles equal bit for bit, rows that do not fit it included
// (those take quantize_block_path's kFloat, row by row, in both).
// Error(kInvalidArgument) without p.kernels->proj_int.
void quantize_block_integer_reference(const HeadParams& p, const float* x, int64_t n, uint16_t* codes);
// Plain loops of the 8-bit projection (see HeadKernels::proj8), which the
// VNNI and AVX2 tiles equal bit for bit; rows it refuses take
// quantize_block_integer_reference's paths. Error(kInvalidArgument) without
// p.kernels->proj8.
void quantize_block_int8_reference(const HeadParams& p, const float* x, int64_t n, uint16_t* codes);
// Plain loops of the 8-bit reconstruction (see HeadKernels::recon8), which
// the VNNI and AVX2 tiles equal bit for bit. Error(kInvalidArgument)
// without p.kernels->recon8.
void dequantize_block_int8_reference(const HeadParams& p, const uint16_t* codes, int64_t n, float* out);

}  // namespace kvcodec::kvtc

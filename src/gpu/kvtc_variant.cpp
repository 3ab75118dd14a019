#include "gpu/kvtc_variant.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>

#include "kvcodec/error.hpp"
#include "cache/kvtc_calibrated.hpp"
#include "entropy/entropy.hpp"
#include "kvtc/codec.hpp"
#include "kvtc/proj8.hpp"

namespace kvcodec::gpu {
namespace {

[[noreturn]] void bad_stream(int h, const std::string& what) {
  throw Error(ErrorCode::kFormat, "kvtc-gpu stream of head " + std::to_string(h) + ": " + what);
}

void check_head(const FlatKvtcTables& t, int h) {
  if (h < 0 || h >= t.n_heads)
    throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: head " + std::to_string(h) + " outside [0, " +
                                                 std::to_string(t.n_heads) + ")");
}

}  // namespace

uint16_t f32_to_bf16_rne(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float bf16_bits_to_f32(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

namespace {
// Head h's integer reconstruction tables, as the CPU codec builds them
// (none when it builds none, or uses a centroid table: the head keeps the
// float reconstruction).
void flatten_integer_reconstruction(const kvtc::HeadParams& p, const kvtc::HeadKernels& kern, int h,
                                    FlatKvtcTables& t) {
  if (!kern.recon_int || !kern.recon_lut.empty()) return;
  const size_t D = size_t(t.dim), KP = size_t(t.k_pad), K = size_t(p.n_kept()), kp2 = (K + 1) / 2;
  for (size_t d = 0; d < D; ++d) {
    int64_t z = 0;
    for (size_t k = 0; k < K; ++k) {
      const int16_t w = kern.recon_w[kvtc::recon_w_index(k, d, kp2)];
      t.recon_w[(size_t(h) * KP + k) * D + d] = w;
      z += int64_t(kern.recon_zero2[k]) * w;
    }
    t.recon_z[size_t(h) * D + d] = int32_t(uint32_t(uint64_t(z)));  // mod 2^32
    t.recon_scale[size_t(h) * D + d] = kern.recon_scale[d];
  }
  for (size_t k = 0; k < K; ++k) t.recon_zero2[t.idx(h, int(k))] = kern.recon_zero2[k];
  t.recon_int[size_t(h)] = 1;
}

// Head h's integer projection and reconstruction tables, as the CPU codec
// builds them for p (none when it builds none: the head keeps the float
// projection / reconstruction); built once per parameter set (the
// calibrated format repeats a layer's per batch row).
void flatten_integer_kernels(const kvtc::HeadParams& p, int h, FlatKvtcTables& t,
                             std::map<const kvtc::HeadParams*, std::shared_ptr<const kvtc::HeadKernels>>& built,
                             bool eight_bit) {
  std::shared_ptr<const kvtc::HeadKernels>& kern = built[&p];
  if (!kern)
    kern = kvtc::HeadKernels::build(p, eight_bit ? kvtc::KernelSet::kBoth | kvtc::KernelSet::kProj8
                                                 : kvtc::KernelSet::kBoth);
  flatten_integer_reconstruction(p, *kern, h, t);
  if (!kern->proj_int) return;
  const size_t D = size_t(t.dim), KP = size_t(t.k_pad), K = size_t(p.n_kept()), dp2 = (D + 1) / 2;
  for (size_t k = 0; k < K; ++k) {
    t.proj_qscale[t.idx(h, int(k))] = kern->proj_qscale[k];
    for (size_t d = 0; d < D; ++d)
      t.proj_w[(size_t(h) * KP + k) * D + d] = kern->proj_w[kvtc::proj_w_index(k, d, dp2)];
  }
  t.proj_scale[size_t(h)] = kern->proj_scale;
  t.proj_max_abs[size_t(h)] = kern->proj_max_abs;
  t.proj_max_sq[size_t(h)] = kern->proj_max_sq;
  t.proj_int[size_t(h)] = 1;
  if (!eight_bit || !kern->proj8) return;
  const size_t dp4 = kvtc::proj8_row_len(D) / 4;
  for (size_t k = 0; k < K; ++k) {
    t.proj8_qscale[t.idx(h, int(k))] = kern->proj8_qscale[k];
    for (size_t d = 0; d < D; ++d)
      t.proj8_w[(size_t(h) * KP + k) * D + d] = kern->proj8_w[kvtc::proj8_w_index(k, d, dp4)];
  }
  t.proj8_gate_m[size_t(h)] = kern->proj8_gate_m;
  t.proj8_gate_ss[size_t(h)] = kern->proj8_gate_ss;
  t.proj8[size_t(h)] = 1;
}

// Component k's table as the streams code it: the calibration's, or, where
// it has more than stream_scale_bits of precision, the optimal table of that
// precision for its frequencies (every symbol keeps a slot).
entropy::FrequencyTable stream_table(const entropy::FrequencyTable& ft, size_t h, int k) {
  const uint32_t bits = stream_scale_bits(ft.alphabet_size, ft.scale_bits);
  if (ft.scale_bits <= bits) return ft;
  if (ft.alphabet_size > (1u << bits))  // only past 2^15 levels: below, bits >= log2(levels) + 2
    throw Error(ErrorCode::kUnsupported, "kvtc-gpu: head " + std::to_string(h) + " component " + std::to_string(k) +
                                             " has " + std::to_string(ft.alphabet_size) +
                                             " levels; the GPU streams code at most 2^15");
  return entropy::FrequencyTable::from_counts(std::vector<uint64_t>(ft.freq.begin(), ft.freq.end()), bits,
                                              /*precision_loss=*/0.0);
}
}  // namespace

// The lane states hold 31 bits and take 16 at a time, so a slot may take at
// most 15; below that, ceil(log2 levels) + 2 bits (at least 8) keep the
// decoder's slot table small (kvtc_variant.hpp).
uint32_t stream_scale_bits(uint32_t levels, uint32_t table_bits) {
  uint32_t lg = 0;
  while (lg < 31 && (1u << lg) < levels) ++lg;
  return std::min({table_bits, std::max(kVariantMinScaleBits, lg + 2), kVariantMaxScaleBits});
}

FlatKvtcTables flatten_heads(const std::vector<const kvtc::HeadParams*>& heads, bool eight_bit) {
  FlatKvtcTables t;
  if (heads.empty()) throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: no heads given");
  t.n_heads = int(heads.size());
  t.dim = heads[0]->dim;
  if (t.dim != 64 && t.dim != 128)
    throw Error(ErrorCode::kUnsupported, "kvtc-gpu: head_dim " + std::to_string(t.dim) + " (supported: 64, 128)");
  int kmax = 0;
  for (size_t h = 0; h < heads.size(); ++h) {
    const kvtc::HeadParams& p = *heads[h];
    const std::string who = "kvtc-gpu: head " + std::to_string(h);
    if (p.dim != t.dim)
      throw Error(ErrorCode::kShapeMismatch, who + " has head_dim " + std::to_string(p.dim) + ", head 0 has " +
                                                 std::to_string(t.dim));
    if (p.n_kept() > 0 && p.coder != kvtc::CoderChoice::kRans)
      throw Error(ErrorCode::kUnsupported, who + " uses coder " + kvtc::coder_name(p.coder) + " (the GPU variant needs rans)");
    if (p.basis.size() != size_t(p.n_kept()) * size_t(p.dim) || p.mean.size() != size_t(p.dim) ||
        p.quant.size() != size_t(p.n_kept()) || (p.n_kept() > 0 && p.rans_tables.size() != size_t(p.n_kept())))
      throw Error(ErrorCode::kInvalidArgument, who + ": inconsistent parameter sizes");
    kmax = std::max(kmax, p.n_kept());
  }
  t.k_pad = std::max(8, (kmax + 7) / 8 * 8);
  const size_t NH = heads.size(), D = size_t(t.dim), KP = size_t(t.k_pad);
  t.kept.resize(NH);
  t.mean.assign(NH * D, 0.0f);
  t.basis.assign(NH * KP * D, 0.0f);
  t.basis_t.assign(NH * D * KP, 0.0f);
  t.inv_step.assign(NH * KP, 1.0f);
  t.code_offset.assign(NH * KP, 0.0f);
  t.max_code.assign(NH * KP, 0.0f);
  t.step.assign(NH * KP, 0.0f);
  t.recon_offset.assign(NH * KP, 0.0f);
  t.scale_bits.assign(NH * KP, 0);
  t.sym_base.assign(NH * KP, 0);
  t.slot_base.assign(NH * KP, 0);
  t.scale.assign(NH * D, 1.0f);
  t.inv_scale.assign(NH * D, 1.0f);
  t.rope.assign(NH, 0);
  t.rope_dim = t.dim;
  t.proj_int.assign(NH, 0);
  t.proj_w.assign(NH * KP * D, 0);
  t.proj_qscale.assign(NH * KP, 0.0f);
  t.proj_scale.assign(NH, 0.0f);
  t.proj_max_abs.assign(NH, 0.0f);
  t.proj_max_sq.assign(NH, 0.0f);
  t.proj8.assign(NH, 0);
  t.proj8_w.assign(NH * KP * D, 0);
  t.proj8_qscale.assign(NH * KP, 0.0f);
  t.proj8_gate_m.assign(NH, 0.0f);
  t.proj8_gate_ss.assign(NH, 0.0f);
  t.recon_int.assign(NH, 0);
  t.recon_w.assign(NH * KP * D, 0);
  t.recon_zero2.assign(NH * KP, 0);
  t.recon_z.assign(NH * D, 0);
  t.recon_scale.assign(NH * D, 0.0f);
  std::map<const kvtc::HeadParams*, std::shared_ptr<const kvtc::HeadKernels>> built;
  for (size_t h = 0; h < NH; ++h) {
    const kvtc::HeadParams& p = *heads[h];
    const int K = p.n_kept();
    t.kept[h] = K;
    std::copy(p.mean.begin(), p.mean.end(), t.mean.begin() + long(h * D));
    for (int k = 0; k < K; ++k) {
      const size_t i = t.idx(int(h), k);
      for (size_t d = 0; d < D; ++d) {
        const float b = p.basis[size_t(k) * D + d];
        t.basis[(h * KP + size_t(k)) * D + d] = b;
        t.basis_t[(h * D + d) * KP + size_t(k)] = b;
      }
      const kvtc::ComponentQuantizer& q = p.quant[size_t(k)];
      const entropy::FrequencyTable& ft = p.rans_tables[size_t(k)];
      if (q.has_centroid())
        throw Error(ErrorCode::kUnsupported, "kvtc-gpu: head " + std::to_string(h) + " component " +
                                                 std::to_string(k) +
                                                 " uses centroid reconstruction, which the GPU codec does not "
                                                 "implement (calibrate with kvtc.reconstruction=lattice)");
      if (!(q.step > 0.0f) || q.levels == 0 || ft.alphabet_size != q.levels || ft.freq.size() != q.levels ||
          ft.cum.size() != size_t(q.levels) + 1 || ft.scale_bits < 1 || ft.scale_bits > 16 ||
          ft.cum[q.levels] != (1u << ft.scale_bits))
        throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: head " + std::to_string(h) + " component " +
                                                     std::to_string(k) + ": quantizer and rANS table disagree");
      const entropy::FrequencyTable table = stream_table(ft, h, k);
      // Same formulas as the CPU codec (code_offset / recon_offset there).
      t.inv_step[i] = 1.0f / q.step;
      t.code_offset[i] = q.half_offset ? float(q.levels / 2) : float(q.zero) + 0.5f;
      t.recon_offset[i] = q.half_offset ? float(q.levels / 2) - 0.5f : float(q.zero);
      t.max_code[i] = float(q.levels - 1);
      t.step[i] = q.step;
      t.scale_bits[i] = table.scale_bits;
      t.sym_base[i] = uint32_t(t.sym_freq.size());
      for (uint32_t s = 0; s < q.levels; ++s) {
        t.sym_freq.push_back(table.freq[s]);
        t.sym_cum.push_back(table.cum[s]);
      }
      t.slot_base[i] = t.slot_symbol.size();
      for (uint32_t s = 0; s < q.levels; ++s) t.slot_symbol.insert(t.slot_symbol.end(), table.freq[s], uint16_t(s));
    }
    if (K > 0) flatten_integer_kernels(p, int(h), t, built, eight_bit);
  }
  return t;
}

FlatKvtcTables flatten_calibration(const KvtcCalibration& cal, const std::vector<int>& layers, int batch,
                                   int64_t max_positions, int sinks, int window) {
  if (layers.empty() || batch <= 0)
    throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu calibrated: needs at least one layer and one batch row");
  if (cal.head_dim % 32 != 0)
    throw Error(ErrorCode::kUnsupported, "kvtc-gpu calibrated: head_dim " + std::to_string(cal.head_dim) +
                                             " is not a multiple of 32");
  if (max_positions <= 0 || max_positions > (int64_t(1) << 24) || sinks < 0 || window < 0)
    throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu calibrated: max_positions " + std::to_string(max_positions) +
                                                 ", sinks " + std::to_string(sinks) + ", window " +
                                                 std::to_string(window));
  std::vector<const kvtc::HeadParams*> heads;
  for (const int l : layers) {
    if (l < 0 || l >= cal.n_layers)
      throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu calibrated: layer " + std::to_string(l) +
                                                   " outside the calibration's " + std::to_string(cal.n_layers));
    for (const bool is_key : {true, false})
      for (int b = 0; b < batch; ++b) heads.push_back(&(is_key ? cal.keys : cal.values)[size_t(l)]);
  }
  FlatKvtcTables t = flatten_heads(heads, /*eight_bit=*/true);  // the calibrated cache's default (kvtc.int8)
  const size_t D = size_t(t.dim);
  for (size_t i = 0; i < layers.size(); ++i)
    for (const bool is_key : {true, false})
      for (int b = 0; b < batch; ++b) {
        const size_t h = (i * 2 + (is_key ? 0 : 1)) * size_t(batch) + size_t(b);
        t.rope[h] = is_key ? 1 : 0;
        if (!cal.weighted()) continue;
        const std::vector<float>& w = (is_key ? cal.key_scale : cal.value_scale)[size_t(layers[i])];
        for (size_t d = 0; d < D; ++d) {
          t.scale[h * D + d] = w[d];
          t.inv_scale[h * D + d] = 1.0f / w[d];  // as the CPU cache's inverse_scale
        }
      }
  t.rope_dim = cal.head_dim;
  t.rope_positions = max_positions;
  const std::vector<double> inv_freq = rope_inv_freq(cal.head_dim, cal.rope_theta);
  const size_t half = size_t(cal.head_dim / 2);
  t.rope_cos.resize(size_t(max_positions) * half);
  t.rope_sin.resize(size_t(max_positions) * half);
  for (int64_t p = 0; p < max_positions; ++p)
    for (size_t i = 0; i < half; ++i) {
      // f32-rounded as the model and RopeTable round them.
      const double a = double(p) * inv_freq[i];
      t.rope_cos[size_t(p) * half + i] = float(std::cos(a));
      t.rope_sin[size_t(p) * half + i] = float(std::sin(a));
    }
  t.sinks = sinks;
  t.window = window;
  return t;
}

namespace {

// RoPE on the pairs of one token vector (kvtc_variant.hpp: the op order).
void rope_token(const FlatKvtcTables& t, float* v, int64_t position, bool remove) {
  const int half = t.rope_dim / 2;
  if (position < 0 || position >= t.rope_positions)
    throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: position " + std::to_string(position) +
                                                 " outside the RoPE table's " + std::to_string(t.rope_positions));
  const float* cs = t.rope_cos.data() + size_t(position) * size_t(half);
  const float* sn = t.rope_sin.data() + size_t(position) * size_t(half);
  for (int j = 0; j < t.dim / t.rope_dim; ++j)
    for (int i = 0; i < half; ++i) {
      float& a = v[j * t.rope_dim + i];
      float& b = v[j * t.rope_dim + i + half];
      const float c = cs[i], s = sn[i], a0 = a, b0 = b;
      if (remove) {
        a = std::fma(a0, c, b0 * s);
        b = std::fma(b0, c, -(a0 * s));
      } else {
        a = std::fma(a0, c, -(b0 * s));
        b = std::fma(b0, c, a0 * s);
      }
    }
}

}  // namespace

void weighted_rows_reference(const FlatKvtcTables& t, int h, const uint16_t* x, int64_t n, float* out,
                             int64_t position0) {
  check_head(t, h);
  const int D = t.dim;
  const float* scale = t.scale.data() + size_t(h) * size_t(D);
  for (int64_t i = 0; i < n; ++i) {
    float* xr = out + i * D;
    for (int d = 0; d < D; ++d) xr[d] = bf16_bits_to_f32(x[i * D + d]);
    if (t.rope[size_t(h)]) rope_token(t, xr, position0 + i, /*remove=*/true);
    for (int d = 0; d < D; ++d) xr[d] = xr[d] * scale[d];
  }
}

namespace {
// The 8-bit or else the integer projection's codes [K] of one centred row
// xc [D] (kvtc_variant.hpp); false, writing nothing, when the row fits
// neither.
bool integer_codes(const FlatKvtcTables& t, int h, const float* xc, uint16_t* codes) {
  const int D = t.dim, K = t.kept[size_t(h)];
  const float ps = t.proj_scale[size_t(h)];
  float m = 0.0f, lane[8] = {};
  for (int d = 0; d < D; ++d) {
    m = std::max(m, std::fabs(xc[d]));
    lane[d % 8] = std::fma(xc[d], xc[d], lane[d % 8]);
  }
  int32_t xi[128];  // D is 64 or 128 (flatten_heads); no allocation per row
  if (t.proj8[size_t(h)] &&
      kvtc::proj8_row_fits(m, kvtc::lane_square_sum(lane), t.proj8_gate_m[size_t(h)], t.proj8_gate_ss[size_t(h)])) {
    const float s = kvtc::proj8_row_scale(m), factor = kvtc::proj8_row_factor(m);
    for (int d = 0; d < D; ++d) xi[d] = int32_t(std::nearbyint(xc[d] * s));  // |xi| <= 127
    for (int k = 0; k < K; ++k) {
      const int8_t* w = t.proj8_w.data() + (size_t(h) * size_t(t.k_pad) + size_t(k)) * size_t(D);
      int32_t acc = 0;
      for (int d = 0; d < D; ++d) acc += xi[d] * int32_t(w[d]);
      const size_t q = t.idx(h, k);
      codes[k] = kvtc::proj8_code(acc, factor, t.proj8_qscale[q], t.code_offset[q], t.max_code[q]);
    }
    return true;
  }
  if (!kvtc::scaled_row_fits(m, lane, ps, t.proj_max_abs[size_t(h)], t.proj_max_sq[size_t(h)])) return false;
  for (int d = 0; d < D; ++d) xi[d] = int32_t(std::nearbyint(xc[d] * ps));
  for (int k = 0; k < K; ++k) {
    const int16_t* w = t.proj_w.data() + (size_t(h) * size_t(t.k_pad) + size_t(k)) * size_t(D);
    int32_t acc = 0;  // a fitting row keeps every partial sum below 2^31
    for (int d = 0; d < D; ++d) acc += xi[d] * int32_t(w[d]);
    const size_t q = t.idx(h, k);
    codes[k] = kvtc::proj_code(acc, t.proj_qscale[q], t.code_offset[q], t.max_code[q]);
  }
  return true;
}
}  // namespace

void quantize_reference(const FlatKvtcTables& t, int h, const uint16_t* x, int64_t n, uint16_t* codes,
                        int64_t position0) {
  check_head(t, h);
  const int D = t.dim, K = t.kept[size_t(h)];
  const float* mean = t.mean.data() + size_t(h) * size_t(D);
  std::vector<float> xc(static_cast<size_t>(D));
  for (int64_t i = 0; i < n; ++i) {
    weighted_rows_reference(t, h, x + i * D, 1, xc.data(), position0 + i);
    for (int d = 0; d < D; ++d) xc[size_t(d)] = xc[size_t(d)] - mean[d];
    if (t.proj_int[size_t(h)] && integer_codes(t, h, xc.data(), codes + i * K)) continue;
    for (int k = 0; k < K; ++k) {
      const float* b = t.basis.data() + (size_t(h) * size_t(t.k_pad) + size_t(k)) * size_t(D);
      float acc = 0.0f;
      for (int d = 0; d < D; ++d) acc = std::fma(xc[size_t(d)], b[d], acc);
      const size_t q = t.idx(h, k);
      const float v = std::floor(std::fma(acc, t.inv_step[q], t.code_offset[q]));
      // fmax first: a NaN input lands on code 0 instead of an undefined cast.
      codes[i * K + k] = uint16_t(std::fmin(std::fmax(v, 0.0f), t.max_code[q]));
    }
  }
}

void reconstruct_f32_reference(const FlatKvtcTables& t, int h, const uint16_t* codes, int64_t n, float* y,
                               int64_t position0) {
  check_head(t, h);
  const int D = t.dim, K = t.kept[size_t(h)];
  const float* mean = t.mean.data() + size_t(h) * size_t(D);
  const float* inv_scale = t.inv_scale.data() + size_t(h) * size_t(D);
  std::vector<float> v(size_t(std::max(K, 1)));
  for (int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < K; ++k) {
      const size_t q = t.idx(h, k);
      v[size_t(k)] = (float(codes[i * K + k]) - t.recon_offset[q]) * t.step[q];
    }
    float* yi = y + i * D;
    for (int d = 0; d < D; ++d) {
      float acc = 0.0f;
      for (int k = 0; k < K; ++k)
        acc = std::fma(v[size_t(k)], t.basis[(size_t(h) * size_t(t.k_pad) + size_t(k)) * size_t(D) + size_t(d)], acc);
      yi[d] = (acc + mean[d]) * inv_scale[d];
    }
    if (t.rope[size_t(h)]) rope_token(t, yi, position0 + i, /*remove=*/false);
  }
}

namespace {
// y [n, D] bf16 of a reconstruction's f32 rows (reconstruct_f32_reference's signature).
template <typename Reconstruct>
void reconstruct_bf16(const Reconstruct& reconstruct, const FlatKvtcTables& t, int h, const uint16_t* codes, int64_t n,
                      uint16_t* y, int64_t position0) {
  std::vector<float> f(size_t(std::max<int64_t>(n, 0)) * size_t(t.dim));
  reconstruct(t, h, codes, n, f.data(), position0);
  for (size_t i = 0; i < f.size(); ++i) y[i] = f32_to_bf16_rne(f[i]);
}
}  // namespace

void dequantize_reference(const FlatKvtcTables& t, int h, const uint16_t* codes, int64_t n, uint16_t* y,
                          int64_t position0) {
  reconstruct_bf16(reconstruct_f32_reference, t, h, codes, n, y, position0);
}

void reconstruct_int_f32_reference(const FlatKvtcTables& t, int h, const uint16_t* codes, int64_t n, float* y,
                                   int64_t position0) {
  check_head(t, h);
  if (!t.recon_int[size_t(h)])
    throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: head " + std::to_string(h) + " has no integer reconstruction");
  const int D = t.dim, K = t.kept[size_t(h)];
  const size_t hd = size_t(h) * size_t(D);
  for (int64_t i = 0; i < n; ++i) {
    float* yi = y + i * D;
    for (int d = 0; d < D; ++d) {
      uint32_t acc = 0;  // int32 sums modulo 2^32, as the madd and the MMA accumulate them
      for (int k = 0; k < K; ++k) {
        const size_t q = t.idx(h, k);
        const int16_t c = kvtc::doubled_code(codes[i * K + k], t.recon_zero2[q]);
        acc += uint32_t(int32_t(c) * int32_t(t.recon_w[q * size_t(D) + size_t(d)]));
      }
      const float x = std::fma(float(int32_t(acc)), t.recon_scale[hd + size_t(d)], t.mean[hd + size_t(d)]);
      yi[d] = x * t.inv_scale[hd + size_t(d)];
    }
    if (t.rope[size_t(h)]) rope_token(t, yi, position0 + i, /*remove=*/false);
  }
}

void dequantize_int_reference(const FlatKvtcTables& t, int h, const uint16_t* codes, int64_t n, uint16_t* y,
                              int64_t position0) {
  reconstruct_bf16(reconstruct_int_f32_reference, t, h, codes, n, y, position0);
}

std::vector<uint8_t> rans_warp_encode(const FlatKvtcTables& t, int h, const uint16_t* codes, int64_t n) {
  check_head(t, h);
  const int K = t.kept[size_t(h)];
  if (K == 0 || n <= 0) return {};
  const int64_t passes = (n + kWarpLanes - 1) / kWarpLanes;  // steps per component
  const int64_t steps = int64_t(K) * passes;
  uint32_t x[kWarpLanes];
  std::fill(x, x + kWarpLanes, kVariantRansLow);
  // Built backwards: step s's words (in decoder order) are prepended.
  std::vector<uint8_t> rev;  // reversed output: reversed chunks, last step first
  for (int64_t s = steps - 1; s >= 0; --s) {
    const int k = int(s / passes);
    const size_t q = t.idx(h, k);
    std::vector<uint8_t> chunk;
    for (int j = 0; j < kWarpLanes; ++j) {
      const int64_t tok = (s % passes) * kWarpLanes + j;
      if (tok >= n) break;
      const uint16_t sym = codes[tok * K + k];
      if (float(sym) > t.max_code[q])
        throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu encode: code " + std::to_string(sym) + " of component " +
                                                     std::to_string(k) + " is outside its alphabet");
      const uint32_t f = t.sym_freq[t.sym_base[q] + sym], c = t.sym_cum[t.sym_base[q] + sym];
      const uint32_t scale = t.scale_bits[q];
      // One 16-bit word out (low bits; a state < 2^31 needs one at most),
      // then the state is in [f 2^(15 - scale), f 2^(31 - scale)).
      const uint32_t x_max = (kVariantRansLow >> scale << 16) * f;
      if (x[j] >= x_max) {
        chunk.push_back(uint8_t(x[j]));  // little-endian word
        chunk.push_back(uint8_t(x[j] >> 8));
        x[j] >>= 16;
      }
      x[j] = ((x[j] / f) << scale) + (x[j] % f) + c;
    }
    rev.insert(rev.end(), chunk.rbegin(), chunk.rend());
  }
  std::vector<uint8_t> out(kStateBytes + rev.size());
  for (int j = 0; j < kWarpLanes; ++j)
    for (int b = 0; b < 4; ++b) out[size_t(4 * j + b)] = uint8_t(x[j] >> (8 * b));
  std::copy(rev.rbegin(), rev.rend(), out.begin() + long(kStateBytes));
  return out;
}

void rans_warp_decode(const FlatKvtcTables& t, int h, const uint8_t* data, size_t size, int64_t n, uint16_t* codes) {
  check_head(t, h);
  const int K = t.kept[size_t(h)];
  if (K == 0 || n <= 0) {
    if (size != 0) bad_stream(h, std::to_string(size) + " bytes where nothing is coded");
    return;
  }
  if (size < kStateBytes) bad_stream(h, "truncated: " + std::to_string(size) + " bytes, the lane states need 128");
  uint32_t x[kWarpLanes];
  for (int j = 0; j < kWarpLanes; ++j) {
    x[j] = uint32_t(data[4 * j]) | uint32_t(data[4 * j + 1]) << 8 | uint32_t(data[4 * j + 2]) << 16 |
           uint32_t(data[4 * j + 3]) << 24;
    if (x[j] < kVariantRansLow || x[j] >= kVariantRansHigh)
      bad_stream(h, "lane " + std::to_string(j) + " starts in an invalid state");
  }
  size_t pos = kStateBytes;
  const int64_t passes = (n + kWarpLanes - 1) / kWarpLanes;
  for (int64_t s = 0; s < int64_t(K) * passes; ++s) {
    const int k = int(s / passes);
    const size_t q = t.idx(h, k);
    const uint32_t scale = t.scale_bits[q];
    for (int j = 0; j < kWarpLanes; ++j) {
      const int64_t tok = (s % passes) * kWarpLanes + j;
      if (tok >= n) break;
      const uint32_t slot = x[j] & ((1u << scale) - 1u);
      const uint16_t sym = t.slot_symbol[t.slot_base[q] + slot];
      const uint32_t f = t.sym_freq[t.sym_base[q] + sym], c = t.sym_cum[t.sym_base[q] + sym];
      x[j] = f * (x[j] >> scale) + slot - c;
      if (x[j] < kVariantRansLow) {  // one word brings it back to [2^15, 2^31)
        if (size - pos < 2) bad_stream(h, "truncated at step " + std::to_string(s));
        x[j] = x[j] << 16 | uint32_t(data[pos + 1]) << 8 | data[pos];
        pos += 2;
      }
      codes[tok * K + k] = sym;
    }
  }
  if (pos != size) bad_stream(h, std::to_string(size - pos) + " trailing bytes");
  for (int j = 0; j < kWarpLanes; ++j)
    if (x[j] != kVariantRansLow) bad_stream(h, "lane " + std::to_string(j) + " does not end in the initial state");
}

int64_t n_blocks(int64_t tokens, int block_tokens) {
  if (block_tokens <= 0) throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: block_tokens must be positive");
  if (tokens < 0) throw Error(ErrorCode::kInvalidArgument, "kvtc-gpu: negative token count");
  return (tokens + block_tokens - 1) / block_tokens;
}

int64_t coded_tokens(const FlatKvtcTables& t, int64_t seq) {
  return std::max<int64_t>(0, seq - t.sinks - t.window);
}

uint64_t raw_bytes(const FlatKvtcTables& t, int64_t tokens) {
  const int64_t raw = tokens - coded_tokens(t, tokens);
  return uint64_t(t.n_heads) * uint64_t(raw) * uint64_t(t.dim) * 2;
}

namespace {

// The raw tokens of head h (the first min(S, sinks), then the last ones up
// to S - window... S): their [from, to) ranges in the head's sequence.
struct RawRanges {
  int64_t sink_end, tail_begin, n;
};
RawRanges raw_ranges(const FlatKvtcTables& t, int64_t S) {
  const int64_t coded = coded_tokens(t, S);
  const int64_t sink_end = std::min<int64_t>(S, t.sinks);
  return {sink_end, sink_end + coded, S - coded};
}

}  // namespace

EncodedBatch encode_batch_reference(const FlatKvtcTables& t, const uint16_t* x, int64_t tokens, int block_tokens,
                                    int64_t first_position) {
  const int64_t coded = coded_tokens(t, tokens), nb = n_blocks(coded, block_tokens);
  const RawRanges rr = raw_ranges(t, tokens);
  EncodedBatch out;
  out.offsets.push_back(0);
  std::vector<uint16_t> codes(size_t(block_tokens) * size_t(t.k_pad));
  const size_t D = size_t(t.dim);
  for (int h = 0; h < t.n_heads; ++h)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t t0 = rr.sink_end + b * block_tokens, n = std::min<int64_t>(block_tokens, rr.tail_begin - t0);
      quantize_reference(t, h, x + (size_t(h) * size_t(tokens) + size_t(t0)) * D, n, codes.data(), first_position + t0);
      const std::vector<uint8_t> s = rans_warp_encode(t, h, codes.data(), n);
      out.payload.insert(out.payload.end(), s.begin(), s.end());
      out.offsets.push_back(out.payload.size());
    }
  if (rr.n > 0) {
    out.payload.resize(raw_offset(out.payload.size()));
    for (int h = 0; h < t.n_heads; ++h) {
      const uint16_t* xh = x + size_t(h) * size_t(tokens) * D;
      for (const auto& [a, e] : {std::pair{int64_t(0), rr.sink_end}, std::pair{rr.tail_begin, tokens}}) {
        const auto* p = reinterpret_cast<const uint8_t*>(xh + size_t(a) * D);
        out.payload.insert(out.payload.end(), p, p + size_t(e - a) * D * 2);
      }
    }
  }
  return out;
}

void decode_batch_reference(const FlatKvtcTables& t, const uint8_t* payload, size_t payload_size,
                            const uint64_t* offsets, int64_t tokens, int block_tokens, uint16_t* y,
                            int64_t first_position, bool integer_reconstruction) {
  const int64_t coded = coded_tokens(t, tokens), nb = n_blocks(coded, block_tokens);
  const RawRanges rr = raw_ranges(t, tokens);
  const size_t D = size_t(t.dim);
  std::vector<uint16_t> codes(size_t(block_tokens) * size_t(t.k_pad));
  if (offsets[0] != 0) throw Error(ErrorCode::kFormat, "kvtc-gpu batch: offsets[0] is not 0");
  for (int h = 0; h < t.n_heads; ++h)
    for (int64_t b = 0; b < nb; ++b) {
      const size_t i = size_t(h) * size_t(nb) + size_t(b);
      if (offsets[i + 1] < offsets[i] || offsets[i + 1] > payload_size)
        throw Error(ErrorCode::kFormat, "kvtc-gpu batch: stream " + std::to_string(i) + " has bad offsets");
      const int64_t t0 = rr.sink_end + b * block_tokens, n = std::min<int64_t>(block_tokens, rr.tail_begin - t0);
      rans_warp_decode(t, h, payload + offsets[i], size_t(offsets[i + 1] - offsets[i]), n, codes.data());
      uint16_t* yb = y + (size_t(h) * size_t(tokens) + size_t(t0)) * D;
      if (integer_reconstruction && t.recon_int[size_t(h)])
        dequantize_int_reference(t, h, codes.data(), n, yb, first_position + t0);
      else
        dequantize_reference(t, h, codes.data(), n, yb, first_position + t0);
    }
  if (rr.n == 0) return;
  const uint64_t raw0 = raw_offset(offsets[size_t(t.n_heads) * size_t(nb)]);
  if (raw0 > payload_size || payload_size - raw0 < raw_bytes(t, tokens))
    throw Error(ErrorCode::kFormat, "kvtc-gpu batch: " + std::to_string(payload_size) + " bytes, the raw tokens need " +
                                        std::to_string(raw0 + raw_bytes(t, tokens)));
  const uint8_t* p = payload + raw0;
  for (int h = 0; h < t.n_heads; ++h) {
    uint16_t* yh = y + size_t(h) * size_t(tokens) * D;
    for (const auto& [a, e] : {std::pair{int64_t(0), rr.sink_end}, std::pair{rr.tail_begin, tokens}}) {
      std::memcpy(yh + size_t(a) * D, p, size_t(e - a) * D * 2);
      p += size_t(e - a) * D * 2;
    }
  }
}

size_t tf32_bound_violations(const FlatKvtcTables& t, int heads, const uint16_t* x, int64_t tokens,
                             const uint16_t* y_tc, const uint16_t* y_exact, size_t* n_diff) {
  const int D = t.dim, half = t.rope_dim / 2;
  const RawRanges rr = raw_ranges(t, tokens);
  size_t bad = 0;
  *n_diff = 0;
  for (int h = 0; h < heads; ++h) {
    const int K = t.kept[size_t(h)];
    const size_t base = size_t(h) * size_t(tokens) * size_t(D);
    const int64_t n = rr.tail_begin - rr.sink_end;
    std::vector<uint16_t> codes(size_t(std::max<int64_t>(n, 1)) * size_t(std::max(K, 1)));
    quantize_reference(t, h, x + base + size_t(rr.sink_end) * size_t(D), n, codes.data(), rr.sink_end);
    std::vector<double> v(size_t(std::max(K, 1)));
    std::vector<double> bound(static_cast<size_t>(D));
    for (int64_t i = 0; i < tokens; ++i) {
      const bool coded = i >= rr.sink_end && i < rr.tail_begin;
      // Before RoPE: 2^-9 * sum_k |v_k b_kd|, scaled by the weight undone.
      for (int k = 0; coded && k < K; ++k) {
        const size_t q = t.idx(h, k);
        v[size_t(k)] = double((float(codes[size_t(i - rr.sink_end) * size_t(K) + size_t(k)]) - t.recon_offset[q]) *
                              t.step[q]);
      }
      for (int d = 0; d < D; ++d) {
        double sum = 0;
        for (int k = 0; coded && k < K; ++k)
          sum += std::abs(v[size_t(k)] * double(t.basis[(size_t(h) * size_t(t.k_pad) + size_t(k)) * size_t(D) + size_t(d)]));
        bound[size_t(d)] = std::ldexp(sum, -9) * double(t.inv_scale[size_t(h) * size_t(D) + size_t(d)]);
      }
      for (int d = 0; d < D; ++d) {
        double b = bound[size_t(d)];
        if (coded && t.rope[size_t(h)]) {
          // A rotated output mixes its pair's two errors: |c| e_a + |s| e_b.
          const int i2 = d % t.rope_dim, pd = i2 < half ? d + half : d - half, f = i2 % half;
          const size_t r = size_t(i) * size_t(half) + size_t(f);
          b = std::abs(double(t.rope_cos[r])) * bound[size_t(d)] + std::abs(double(t.rope_sin[r])) * bound[size_t(pd)];
        }
        const size_t e = base + size_t(i) * size_t(D) + size_t(d);
        const double a = bf16_bits_to_f32(y_tc[e]), r = bf16_bits_to_f32(y_exact[e]);
        const double mag = std::max({std::abs(a), std::abs(r), 1e-30});
        const double limit = coded ? b + std::ldexp(1.0, std::ilogb(mag) - 7) : 0.0;  // raw tokens: equal
        *n_diff += y_tc[e] != y_exact[e];
        if (!(std::abs(a - r) <= limit)) ++bad;
      }
    }
  }
  return bad;
}

}  // namespace kvcodec::gpu

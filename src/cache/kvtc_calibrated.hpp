// Calibrated KVTC (DESIGN 4, the KVTC paper's mode).
//
// A calibration holds, per transformer layer, one kvtc::HeadParams for keys
// and one for values over the layer's heads concatenated: a token of layer l
// is ONE vector of H_kv * D values ([h][d] order), keys with RoPE removed.
// The parameters are fitted offline over many sequences (src/model/calibrate)
// and shared by every sequence, so a calibrated cache stores no per-sequence
// side information: its bytes are encoded blocks plus the raw sinks and
// window, and the coded tokens that wait raw until a whole block of them can
// be coded (fewer than one block). The calibration file itself is reported
// as the extra `calibration_bytes` (once per model, not per sequence) and
// never counted in compressed_*_bytes; in memory, the parsed calibration and
// the RoPE table are CacheStats::shared, not resident_bytes.
//
// Calibration file (container kind "calibration"):
//   meta   format=kvtc-calibration, n_layers, n_kv_heads, head_dim,
//          rope_theta, config_hash (XXH3-64 hex of config.json), plus the
//          fitting settings as free text (fit.*)
//   sections layer.<i>.key / layer.<i>.value: serialised HeadParams with
//          dim = n_kv_heads * head_dim.
//          layer.<i>.key_scale / layer.<i>.value_scale (optional, both or
//          neither for a layer): n_kv_heads * head_dim little-endian f32,
//          each finite and > 0. The codec then works on x * scale (keys after
//          RoPE removal) and the reconstruction is divided by it, so the
//          PCA, the allocation and the quantizers minimise a WEIGHTED squared
//          error: the weights say how much an error in each dimension costs
//          the attention output (src/model/calibrate: query energy for keys,
//          output-projection column norms for values).
//          layer.<i>.key_refine / layer.<i>.value_refine (optional, every
//          layer or none): serialised HeadParams (same dim) of the
//          REFINEMENT code: it codes a token's residual after the base code
//          (x*scale minus the base reconstruction, in the same weighted,
//          RoPE-removed space), so a cache with kvtc.refine = N keeps the
//          N newest coded tokens at base + refinement quality and drops the
//          refinement as they age (the base codes never change).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cache/calibration_shape.hpp"
#include "cache/kvtc_cache.hpp"
#include "kvcodec/cache.hpp"
#include "kvtc/codec.hpp"

namespace kvcodec {

// The model's shape, config hash and fit notes: cache_impl::CalibrationShape.
struct KvtcCalibration : cache_impl::CalibrationShape {
  std::vector<kvtc::HeadParams> keys;        // [n_layers], dim = n_kv_heads * head_dim
  std::vector<kvtc::HeadParams> values;      // [n_layers]
  // Per-dimension weights [n_layers][n_kv_heads * head_dim]; empty = none.
  std::vector<std::vector<float>> key_scale, value_scale;
  // Refinement parameters [n_layers]; empty = none.
  std::vector<kvtc::HeadParams> key_refine, value_refine;

  int vector_dim() const { return n_kv_heads * head_dim; }
  bool weighted() const { return !key_scale.empty(); }
  bool refined() const { return !key_refine.empty(); }

  std::vector<uint8_t> serialize() const;
  void write_file(const std::string& path) const;  // atomic (temporary file + rename)
  // Throws Error(kFormat / kChecksum) for malformed or corrupted bytes.
  static KvtcCalibration parse(const uint8_t* data, size_t size, const std::string& label = "<memory>");
  static KvtcCalibration read_file(const std::string& path);
  // read_file() shared by every cache of a process (one copy per file path,
  // reloaded when the file's size or modification time changes).
  static std::shared_ptr<const KvtcCalibration> load_shared(const std::string& path);
  // Bytes of the parameters as serialised (sum of the sections).
  uint64_t params_bytes() const;
  // Bytes held in memory: every layer's parameters, the tables derived from
  // them and the weights (what the caches sharing it report in
  // CacheStats::shared).
  uint64_t held_bytes() const;
};

// XXH3-64 of bytes, as 16 lowercase hex digits (the model identity hash).
std::string hash_hex(const void* data, size_t size);

// RoPE (HF rotate-half convention, as the model runtime applies it) on one
// token vector of n_heads * head_dim values ([h][d]) at `position`.
// inverse = true undoes it (rotation by the negative angle). Angles and
// products in double so apply(remove(x)) reproduces x to f32 rounding.
void rope_rotate_token(float* x, int n_heads, int head_dim, int64_t position, double theta, bool inverse);

// Same over n tokens [n, n_heads * head_dim] at positions first_position + i,
// using precomputed inverse frequencies (inv_freq [head_dim / 2]).
void rope_rotate_tokens(float* x, int64_t n, int n_heads, int head_dim, int64_t first_position,
                        const std::vector<double>& inv_freq, bool inverse);
std::vector<double> rope_inv_freq(int head_dim, double theta);

// Keys rows [n, head_dim] (each RoPE-rotated at its own position p) moved
// `positions` on: rotated by that many positions more, so each becomes the
// key of the same pre-RoPE vector at p + positions (R(p + T) = R(T) R(p),
// to f32 rounding). kvcodec bench's steady pass appends the dump this way.
void rope_advance_rows(float* x, int64_t n, int head_dim, int64_t positions, double theta);

// cos/sin of every (position, frequency) pair, f32-rounded as the model uses
// them, computed once per process for each (head_dim, theta) and shared: the
// calibrated cache's read path re-applies RoPE to every decoded key at every
// decode step, and computing the trigonometry there dominated it.
class RopeTable {
 public:
  // A table covering at least `positions` positions (shared; thread-safe).
  static std::shared_ptr<const RopeTable> get(int head_dim, double theta, int64_t positions);
  int64_t positions() const { return positions_; }
  uint64_t held_bytes() const { return uint64_t(cos_.capacity() + sin_.capacity()) * sizeof(float); }
  // rope_rotate_tokens() on n tokens of n_heads * head_dim values whose
  // starts are token_stride floats apart, bit-identical to it.
  void rotate(float* x, int64_t n, int64_t token_stride, int n_heads, int64_t first_position, bool inverse) const;

 private:
  int half_ = 0;
  int64_t positions_ = 0;
  std::vector<float> cos_, sin_;  // [positions][head_dim / 2]
};

// Checks that the calibration fits a cache of this shape; throws
// Error(kShapeMismatch) naming both shapes.
void check_calibration_matches(const KvtcCalibration& cal, const CacheConfig& config, double rope_theta,
                               const std::string& path);

// The calibrated cache (settings already parsed: mode == "calibrated").
std::unique_ptr<KVCache> make_kvtc_calibrated_cache(const CacheConfig& config, const Settings& settings,
                                                    const KvtcSettings& options);

}  // namespace kvcodec

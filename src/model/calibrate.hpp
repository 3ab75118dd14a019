// Offline calibration of KVTC's calibrated mode (DESIGN 4; issue 5).
//
// collect_calibration_samples() runs the model over calibration windows with
// an fp16 cache and gathers, per layer, every non-sink token as ONE vector of
// H_kv * D values (heads concatenated, [h][d]): keys with RoPE removed (exact
// inverse rotation at the token's position), values as they are.
// fit_calibration() fits, per layer and tensor, the mean and PCA basis over
// those vectors and the codec parameters (bit allocation, quantizer ranges,
// entropy models) with kvtc::fit_head, either for a fixed bit budget or for a
// target compression ratio of the encoded tokens, and returns a
// KvtcCalibration (write it with KvtcCalibration::write_file).
#pragma once

#include <array>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cache/kvtc_calibrated.hpp"
#include "kvtc/codec.hpp"
#include "model/llama.hpp"

namespace kvcodec::model {

// The quantizers the measured allocator chooses from, per component:
//   kMidrise  the codec's midrise grid with 2^b levels for each width b of
//             bit_choices, the step MSE-optimal for that many levels (a
//             fixed-rate design: a 1-bit component always costs ~1 bit);
//   kMidtread a midtread grid (a reconstruction point at 0) whose step is
//             sigma * midtread_step_ratio(j) for choice label j >= 1
//             (0: dropped), with enough levels to cover the calibration's
//             largest coefficient: entropy-coded uniform quantization, whose
//             rate falls continuously towards 0 as the step grows (most
//             codes become the zero code), where a midrise grid cannot go
//             below one bit per kept component.
enum class QuantizerFamily : uint8_t { kMidrise = 0, kMidtread = 1 };
const char* quantizer_family_name(QuantizerFamily f);
// How the measured quantizers reconstruct (kvtc::ComponentQuantizer::centroid):
//   kLattice            at the grid's points;
//   kCentroid           each cell at its centroid on the calibration tokens,
//                       the allocation made on the lattice's distortion: the
//                       same allocation, codes and bytes as kLattice, less
//                       error;
//   kCentroidAllocated  the same offsets, the allocation made on the
//                       distortion with them (it then keeps more components
//                       at coarse steps, where centroids gain most).
// The GPU codec refuses centroid parameters.
enum class Reconstruction : uint8_t { kLattice = 0, kCentroid = 1, kCentroidAllocated = 2 };
const char* reconstruction_name(Reconstruction r);
// step / sigma of midtread choice label j (1-based): a geometric ladder
// (ratio 0.76) from 5 sigma (a few percent of codes nonzero: ~0.1-0.3 bit
// per component) to 0.08 sigma (~6 bits).
inline constexpr int kMidtreadChoices = 16;
double midtread_step_ratio(int label);

struct CalibrateOptions {
  int64_t first_window = 16;      // windows of window_length tokens in the token file
  int64_t windows = 16;
  int64_t window_length = 2048;
  int64_t tokens_per_window = 0;  // 0: the whole window
  int sinks = 4;                  // first tokens of each window left out of the fit (kept raw by the cache)
  kvtc::CodecOptions codec;       // bit_budget 0 -> 4 * H_kv * D bits per token vector
  // > 0: per layer and tensor, the largest bit budget whose entropy-coded
  // payload on the calibration tokens is at most f16 / target_ratio (raw
  // sinks and window come on top at run time).
  double target_ratio = 0.0;
  // > 0: the same for keys / values only (overrides target_ratio for them).
  double key_target_ratio = 0.0, value_target_ratio = 0.0;
  // Bit allocation by the exact DP on MEASURED per-component distortion and
  // entropy-coded rate (measure_component_tables + alloc::
  // allocate_bits_measured) instead of kvtc::fit_head's allocators. The
  // budget (bit_budget, or the one bisected for target_ratio) is then in
  // entropy-coded bits per token vector.
  bool measured_allocation = false;
  QuantizerFamily quantizers = QuantizerFamily::kMidrise;  // measured allocator only
  // Centroid reconstruction (measured allocator only; Reconstruction).
  Reconstruction reconstruction = Reconstruction::kLattice;
  // Weighted distortion (issue 5, build item 3): the codec works on x * w
  // per dimension, so what PCA, allocation and quantizers minimise is the
  // squared error weighted by how much each dimension matters downstream:
  //   keys   w_d^2 ~ mean query energy of the dimension's RoPE pair over the
  //          query heads that read this KV head (the expected squared error
  //          of attention scores q . dk over relative positions: RoPE turns
  //          each pair, so only the pair's energy survives the average);
  //   values w_d^2 ~ squared norm of the output-projection column that the
  //          dimension feeds, summed over those query heads.
  // Normalised to mean w^2 = 1, floored at weight_floor (so no dimension is
  // ignored outright when the evaluation data differs from the calibration).
  bool attention_weighting = false;
  double weight_floor = 0.01;
  // Sensitivity-weighted allocation across layers and K/V (measured
  // allocator only). With equal ratios for every tensor, a bit costs the
  // same everywhere, but an error does not: it matters more in some layers,
  // or in values than keys. So after a first fit at equal ratios, each of
  // the 2 * n_layers tensors is compressed ALONE (the others exact) over
  // `sensitivity_windows` calibration windows (whole window, logits at every
  // position) and its sensitivity = mean KL(clean || perturbed) / its
  // predicted distortion. Then ONE Lagrangian allocation over all tensors'
  // components minimises sum_t sensitivity_t * distortion_t under the total
  // payload of target_ratio (per-tensor ratios then differ).
  bool sensitivity_allocation = false;
  int sensitivity_windows = 2;
  // > 0: the sensitivity runs measure as a streaming cache codes (issue 21's
  // lever "sensitivities with the window in place"): the window is run in
  // chunks of sensitivity_block tokens, and a token is coded only once it
  // has left a raw window of sensitivity_window tokens behind the chunk's
  // first query (block-aligned, as the streaming caches code whole blocks).
  // A layer whose attention is mostly local then reads less sensitive. 0:
  // every non-sink token coded (the whole-prefix measurement).
  int sensitivity_window = 0;
  int sensitivity_block = 16;
  // > 0: also fit REFINEMENT parameters (KvtcCalibration::key_refine /
  // value_refine) per layer and tensor: the codec fitted (same quantizer
  // family, measured allocation) on the calibration tokens' residuals after
  // the final base code, at this payload ratio (f16 bytes / refinement
  // bytes). A cache with kvtc.refine = N codes the N newest coded tokens'
  // residuals with them.
  double refine_ratio = 0.0;
};

struct CalibrationSamples {
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
  int64_t tokens = 0;                      // vectors per layer
  std::vector<std::vector<float>> keys;    // [n_layers][tokens, H_kv * D], RoPE removed
  std::vector<std::vector<float>> values;  // [n_layers][tokens, H_kv * D]
  // Mean squared query of each key dimension over the sampled tokens and the
  // query heads of its KV head, pair-averaged ([n_layers][H_kv * D]).
  std::vector<std::vector<double>> query_energy;
  // The token ids run, [windows][per_window] (sensitivity runs reuse them).
  std::vector<std::vector<int32_t>> window_tokens;
};

// Weights of CalibrateOptions::attention_weighting for layer `layer`:
// {key weights, value weights}, each [H_kv * D], mean square 1, floored.
std::pair<std::vector<float>, std::vector<float>> attention_weights(const LlamaModel& model,
                                                                    const CalibrationSamples& samples, int layer,
                                                                    double floor);

// (done, total, what) for progress output.
using CalibrationProgress = std::function<void(int64_t done, int64_t total, const std::string& what)>;

// KL sensitivities found by fit_calibration with sensitivity_allocation, in
// tensor order (layer 0 key, layer 0 value, layer 1 key, ...): the mean KL of
// the next-token distribution when that tensor alone is compressed with the
// equal-ratio fit, and that fit's predicted distortion per token vector.
struct TensorSensitivity {
  double kl = 0.0;
  double distortion = 0.0;
  double per_distortion() const { return kl / std::max(distortion, 1e-30); }
};

// The sensitivity runs' pieces (fit_calibration with sensitivity_allocation).
// An fp16 cache in which one tensor (keys or values) of the layer it is made
// for carries its coding error through `params` (and the calibration's
// per-dimension `scale`, or none): non-sink tokens are replaced by their
// reconstruction as they are appended (stream_window 0) or once they have
// left a raw window of stream_window tokens, block by block of stream_block
// (CalibrateOptions::sensitivity_window; batch 1). `params` and `scale` must
// outlive it.
std::unique_ptr<KVCache> make_reconstructing_cache(const CacheConfig& config, const kvtc::HeadParams& params,
                                                   const std::vector<float>* scale, bool is_key, int sinks,
                                                   int stream_window = 0, int stream_block = 1);
// Mean KL(clean || one tensor coded) per tensor (layer 0 key, layer 0 value,
// layer 1 key, ...) over the non-sink positions of the first `windows` of
// s.window_tokens, each tensor coded by `cal` through a reconstructing cache.
std::vector<double> measure_tensor_kl(const LlamaModel& model, const CalibrationSamples& s,
                                      const KvtcCalibration& cal, int windows, int sinks, int stream_window,
                                      int stream_block, const CalibrationProgress& progress = {});

// Throws Error(kConfig) naming the window range when it does not fit the tokens.
CalibrationSamples collect_calibration_samples(const LlamaModel& model, const std::vector<int32_t>& tokens,
                                               const CalibrateOptions& options,
                                               const CalibrationProgress& progress = {});

// `model` is needed only with options.attention_weighting (value weights come
// from its output projections) or sensitivity_allocation (it runs the model);
// may be null otherwise. `sensitivities`, when given, receives what
// sensitivity_allocation measured (empty otherwise).
KvtcCalibration fit_calibration(const ModelConfig& config, const std::string& config_hash,
                                const CalibrationSamples& samples, const CalibrateOptions& options,
                                const CalibrationProgress& progress = {}, const LlamaModel* model = nullptr,
                                std::vector<TensorSensitivity>* sensitivities = nullptr);

// What the measured allocator works from, for one tensor of one layer:
// per principal component k and choice label bit_choices[j], a quantizer
// (step[k][j], levels[k][j]), the squared error per token it leaves
// (distortion[k][j]; label 0: dropped, the coefficient's energy) and the
// empirical entropy of its codes in bits per token (rate[k][j]).
// kMidrise: labels are widths b, levels 2^b, the MSE-optimal step on the
// calibration coefficients (golden-section search). kMidtread: labels are
// 0..kMidtreadChoices, step sigma_k * midtread_step_ratio(label).
struct MeasuredTables {
  QuantizerFamily family = QuantizerFamily::kMidrise;
  std::vector<int> bit_choices;
  int64_t tokens = 0;
  std::vector<float> mean;                      // [D], f16-rounded as stored
  std::vector<float> axes;                      // [D, D], f16-rounded rows as stored
  std::vector<float> coeffs;                    // [tokens, D] on the stored axes
  std::vector<std::vector<double>> rate;        // [D][choices]
  std::vector<std::vector<double>> distortion;  // [D][choices]
  std::vector<std::vector<double>> step;        // [D][choices] (0 for width 0)
  std::vector<std::vector<int>> levels;         // [D][choices] (1 for width 0)
  // [D][choices] centroid offsets (kvtc::ComponentQuantizer::centroid) and
  // the distortion with them; empty for Reconstruction::kLattice. (distortion
  // above is what the allocation minimises: the lattice's, or this one for
  // kCentroidAllocated.)
  std::vector<std::vector<std::array<float, 3>>> centroid;
  std::vector<std::vector<double>> centroid_distortion;
};

// x [n, dim]; mean [dim]; components [dim, dim] (PCA rows). Throws
// Error(kInvalidArgument) on mismatched sizes or widths outside [0, 12]
// (kMidrise). kMidtread ignores bit_choices (its labels are fixed).
// reconstruction: see Reconstruction (offsets in .centroid).
MeasuredTables measure_component_tables(const float* x, int64_t n, int dim, const std::vector<float>& mean,
                                        const std::vector<float>& components, const std::vector<int>& bit_choices,
                                        QuantizerFamily family = QuantizerFamily::kMidrise,
                                        Reconstruction reconstruction = Reconstruction::kLattice);

// Codec parameters for choice labels `bits` [dim] (each 0 or a measured
// label): the measured quantizers, rANS models from x's codes.
kvtc::HeadParams build_head_params(const MeasuredTables& tables, const float* x, int64_t n, int dim,
                                   const std::vector<double>& eigenvalues, const std::vector<int>& bits);

// The codec of one tensor fitted on x [n, dim] (n >= 64) at each payload
// ratio of `targets` (f16 bytes / entropy-coded bytes on x's whole blocks of
// 64), as fit_calibration fits one layer's tensor: the measured allocator
// with o.quantizers when o.measured_allocation (one PCA and one set of
// measured tables for all targets), kvtc::fit_head's otherwise. `achieved`
// receives each fit's payload ratio on x.
std::vector<kvtc::HeadParams> fit_tensor_at_ratios(const std::vector<float>& x, int64_t n, int dim,
                                                   const CalibrateOptions& o, const std::vector<double>& targets,
                                                   std::vector<double>* achieved = nullptr);

// One cross-layer calibration (cache/kvtc_crosslayer.hpp) per payload target
// of `targets` (keys and values alike, or o.key_target_ratio /
// o.value_target_ratio when set, which then override every target), from
// per-layer samples: each token's keys of every layer (RoPE removed) times
// the layer's attention weights (o.attention_weighting) and divided by that
// layer's RMS on the samples form one vector of L * H_kv * D values; its
// values likewise. With o.sensitivity_allocation each layer is scaled by
// sqrt(its tensor's KL per distortion) instead of to unit RMS (measured on a
// per-layer fit at the middle target; the tensor then at unit RMS overall),
// so the one allocation weighs each layer's error by what it costs in KL.
// Refinement does not apply. `model` is needed with attention weighting or
// the sensitivity.
std::vector<KvtcCalibration> fit_cross_layer_calibrations(const ModelConfig& config, const std::string& config_hash,
                                                          const CalibrationSamples& samples, const CalibrateOptions& o,
                                                          const std::vector<double>& targets,
                                                          const CalibrationProgress& progress = {},
                                                          const LlamaModel* model = nullptr);

// Hex XXH3-64 of DIR/config.json: the model identity stored in calibrations.
std::string model_config_hash(const std::string& model_dir);

// Refuses a calibration made for another model: Error(kShapeMismatch) naming
// both shapes, or Error(kConfig) when the config hashes differ.
void check_calibration_for_model(const KvtcCalibration& calibration, const ModelConfig& config,
                                 const std::string& config_hash);

}  // namespace kvcodec::model

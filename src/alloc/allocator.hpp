// kvcodec::alloc: bit allocation over principal components (DESIGN 4).
//
// Three allocators (docs/allocation.md explains the maths and choices):
//   allocate_bits_dp        exact DP under the model d(v, b) = v * beta^-b;
//   allocate_bits_measured  the same exact DP on measured rates/distortions;
//   allocate_equal_step     one quantizer step for every kept component,
//                           bisected so the predicted entropy-coded rate
//                           meets the budget (reverse water-filling's shape).
//
// Exactness: distortions are summed as exact fixed-point integers (256 bits,
// scaled to the largest possible total), so comparisons between candidate
// allocations are exact and independent of summation order; ties are broken
// by a lexicographic key, never by an epsilon:
//   1. smaller total distortion;
//   2. then fewer total bits (for the measured allocator: smaller quantised
//      rate);
//   3. then the lexicographically LARGER bits vector (earlier components,
//      which are the higher-variance ones in PCA order, get more bits).
#pragma once

#include <functional>
#include <vector>

namespace kvcodec::alloc {

struct AllocationResult {
  std::vector<int> bits;  // per component, one of the choices
  double distortion = 0;  // total distortion (model or measured), summed in component order
  int total_bits = 0;     // sum of bits
  double rate = 0;        // allocate_bits_measured: sum of the chosen measured rates; else total_bits
};

inline const std::vector<int>& default_bit_choices() {
  static const std::vector<int> choices = {0, 1, 2, 3, 4, 6, 8};
  return choices;
}

// Exact DP: minimise sum_i d(variances[i], bits[i]) subject to
// sum_i bits[i] <= budget_bits, bits[i] in bit_choices. d(v, 0) = v,
// d(v, b) = v * beta^-b. O(n * budget * |choices|) time, O(n * budget) bytes.
// Throws Error(kInvalidArgument) for empty or negative/non-finite variances,
// negative budget, empty choices, choices without 0, negative, duplicate or
// > 16 widths, beta not finite and > 0, or a DP table over 2^27 cells
// (checked before anything is sized by it).
AllocationResult allocate_bits_dp(const std::vector<double>& variances, int budget_bits,
                                  const std::vector<int>& bit_choices = default_bit_choices(),
                                  double beta = 3.5);

// Same contract, by enumerating every assignment (|choices|^n <= 2^24). For tests.
AllocationResult allocate_bits_brute_force(const std::vector<double>& variances, int budget_bits,
                                           const std::vector<int>& bit_choices = default_bit_choices(),
                                           double beta = 3.5);

// Measured-rate DP. rate_bits[i][j], distortion[i][j]: measured bits per
// token and distortion of component i coded with bit_choices[j] (finite,
// >= 0). Rates are rounded UP to a grid of 1/rate_grid bit (default 16) and
// the budget DOWN, so the chosen allocation's true measured rate never
// exceeds budget_bits (it may fall short by at most n / rate_grid bits).
// Throws Error(kInvalidArgument) for mismatched table shapes, bad values, or
// a budget below the cheapest allocation's rate.
AllocationResult allocate_bits_measured(const std::vector<std::vector<double>>& rate_bits,
                                        const std::vector<std::vector<double>>& distortion,
                                        const std::vector<int>& bit_choices, double budget_bits,
                                        int rate_grid = 16);
// allocate_bits_measured for many budgets of one problem (a rate target's
// search): the DP runs once, for max_budget_bits, and at(b) for any b in
// [0, max_budget_bits] returns what allocate_bits_measured(.., b,
// rate_grid) returns, bit for bit, by walking the same table back from b.
// The constructor throws as allocate_bits_measured does for max_budget_bits
// (a table over 2^27 cells included); at() throws Error(kInvalidArgument)
// for a budget outside [0, max_budget_bits] or below the cheapest allocation.
class MeasuredAllocator {
 public:
  MeasuredAllocator(const std::vector<std::vector<double>>& rate_bits,
                    const std::vector<std::vector<double>>& distortion, const std::vector<int>& bit_choices,
                    double max_budget_bits, int rate_grid = 16);
  AllocationResult at(double budget_bits) const;

 private:
  std::function<AllocationResult(double)> at_;  // over the problem and its DP table
};

// Brute-force twin of allocate_bits_measured (same grid and tie rules). For tests.
AllocationResult allocate_bits_measured_brute_force(const std::vector<std::vector<double>>& rate_bits,
                                                    const std::vector<std::vector<double>>& distortion,
                                                    const std::vector<int>& bit_choices,
                                                    double budget_bits, int rate_grid = 16);

// --- equal-step allocation (entropy-coded uniform quantizers) -------------

// Differential entropy of a Gaussian of that variance, in bits:
// 0.5 * log2(2 pi e v); -inf for v == 0.
double gaussian_entropy_bits(double variance);

// Predicted bits per token of component `component` quantized with `step`;
// must be >= 0 and non-increasing in step.
using RateModel = std::function<double(int component, double step)>;

struct StepAllocation {
  double step = 0;          // one quantizer step for all kept components
  std::vector<bool> keep;   // components whose predicted rate at step is > 0
  double predicted_bits = 0;  // sum of predicted rates (<= budget)
  double predicted_mse = 0;   // sum over kept of min(v, step^2/12), plus v of dropped ones
};

// Finds (by bisection on log2 step, 100 iterations) the smallest step whose
// predicted total rate is <= budget_bits. Default rate model (rate empty):
// max(0, gaussian_entropy_bits(v_i) - log2 step), the high-rate rate of an
// entropy-coded uniform quantizer. Throws Error(kInvalidArgument) for empty
// or bad variances, a negative/non-finite budget, or a rate model returning
// a negative or non-finite value.
StepAllocation allocate_equal_step(const std::vector<double>& variances, double budget_bits,
                                   const RateModel& rate = {});

}  // namespace kvcodec::alloc

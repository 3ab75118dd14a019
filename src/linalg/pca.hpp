// kvcodec::linalg: principal component analysis for transform coding (DESIGN 4).
//
// A PcaBasis is fitted once (per head at prefill, or per layer offline) and
// then frozen: every later token is centred and projected on the same axes,
// so the encoder and decoder agree bit for bit. Fitting is deterministic:
// the same data always gives the same basis, signs included.
//
// No Eigen in this header: the codec includes it and only needs plain,
// row-major float arrays.
#pragma once

#include <cstdint>
#include <vector>

namespace kvcodec::linalg {

struct PcaBasis {
  int dim = 0;
  std::vector<float> mean;         // [dim]
  // [dim x dim] row-major: row k is the k-th principal axis (unit norm),
  // sorted by eigenvalue descending. Sign convention: the entry of largest
  // magnitude in each row is positive (the first such entry on exact ties).
  std::vector<float> components;
  // [dim], descending, >= 0: variance of the data along each axis, with the
  // population normalisation 1/n (the mean squared coefficient on the fit
  // data, which is what the bit allocator needs).
  std::vector<double> eigenvalues;
};

// x: [n, dim] row-major. Mean and covariance are accumulated in double and
// diagonalised with a self-adjoint eigensolver. n < dim is fine (the trailing
// eigenvalues are 0). Throws Error(kInvalidArgument) for n < 1, dim < 1,
// a null pointer or a non-finite input value.
PcaBasis fit_pca(const float* x, int64_t n, int dim);

// x: [batch, n, dim] row-major (e.g. batch = B*H heads of n tokens each).
// One call fits every slice, in parallel over batch with OpenMP on
// `threads` threads (0: OpenMP's default, every core; 1: the calling thread
// alone, no team); the result is identical, bit for bit, to calling
// fit_pca on each slice in turn.
std::vector<PcaBasis> fit_pca_batched(const float* x, int64_t batch, int64_t n, int dim, int threads = 0);

// coeffs[i, k] = sum_d (x[i, d] - mean[d]) * components[k, d] for k < n_keep.
// x: [n, dim], coeffs: [n, n_keep], both row-major. 0 <= n_keep <= dim.
// Fast path: blocked Eigen matrix product over a small per-thread scratch
// buffer (no allocation per call after the first on a thread).
void project(const PcaBasis& basis, const float* x, int64_t n, int n_keep, float* coeffs);
// x_out[i, d] = mean[d] + sum_{k < n_keep} coeffs[i, k] * components[k, d].
// coeffs: [n, n_keep], x_out: [n, dim], both row-major.
void reconstruct(const PcaBasis& basis, const float* coeffs, int64_t n, int n_keep, float* x_out);

// Plain-loop references of project/reconstruct (float products, double
// accumulation), for tests of the fast paths.
void project_reference(const PcaBasis& basis, const float* x, int64_t n, int n_keep, float* coeffs);
void reconstruct_reference(const PcaBasis& basis, const float* coeffs, int64_t n, int n_keep,
                           float* x_out);

// Reverse water-filling (Gaussian rate-distortion of independent components).
// eigenvalues: component variances (>= 0, any order). target_mse_total: the
// total squared error per vector (sum over components). Returns the fewest
// bits per vector any transform coder can spend for that error on Gaussian
// data: the water level theta solves sum_i min(theta, lambda_i) = D and
// rate = sum_{lambda_i > theta} 0.5 * log2(lambda_i / theta). Solved exactly
// (sorted, piecewise linear), no iteration. Returns 0 when D >= sum lambda
// and +inf when D == 0 with some lambda > 0. Throws Error(kInvalidArgument)
// for negative or non-finite inputs.
double reverse_water_filling_bits(const std::vector<double>& eigenvalues, double target_mse_total);
// The inverse: the least total squared error reachable with `bits` bits per
// vector (bits >= 0, finite). Returns sum lambda for bits == 0.
double reverse_water_filling_mse(const std::vector<double>& eigenvalues, double bits);

}  // namespace kvcodec::linalg

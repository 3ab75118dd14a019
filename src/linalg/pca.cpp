// PCA fitting, projection and the reverse water-filling bound.
//
// Eigen is told not to parallelise its products in this file: fit_pca must
// give the same bits whether it runs alone or inside fit_pca_batched's
// OpenMP loop, and project/reconstruct run inside callers' threads.
#ifndef EIGEN_DONT_PARALLELIZE
#define EIGEN_DONT_PARALLELIZE
#endif
#include "linalg/pca.hpp"

#include <omp.h>

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/first_exception.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec::linalg {
namespace {

using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic>;
using RowMatF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, what);
}

void check_fit_args(const float* x, int64_t batch, int64_t n, int dim, const char* fn) {
  if (dim < 1) invalid(std::string(fn) + ": dim = " + std::to_string(dim) + ", must be >= 1");
  if (n < 1) invalid(std::string(fn) + ": n = " + std::to_string(n) + " tokens, need at least 1");
  if (batch < 0) invalid(std::string(fn) + ": batch = " + std::to_string(batch) + ", must be >= 0");
  const int64_t limit = std::numeric_limits<int64_t>::max() / dim / std::max<int64_t>(batch, 1);
  if (n > limit) invalid(std::string(fn) + ": batch * n * dim overflows");
  if (x == nullptr && batch > 0) invalid(std::string(fn) + ": null data pointer");
  const int64_t total = batch * n * dim;
  for (int64_t i = 0; i < total; ++i) {
    if (!std::isfinite(x[i])) {
      invalid(std::string(fn) + ": non-finite input value at element " + std::to_string(i) +
              " (batch " + std::to_string(i / (n * dim)) + ", row " + std::to_string((i / dim) % n) +
              ", column " + std::to_string(i % dim) + ")");
    }
  }
}

// Rows per chunk when accumulating the covariance: bounds the double copy
// of the data to kChunk * dim values whatever n is.
constexpr int64_t kChunk = 1024;

PcaBasis fit_unchecked(const float* x, int64_t n, int dim) {
  PcaBasis basis;
  basis.dim = dim;

  // Two passes (mean, then centred covariance) in double: one-pass
  // E[x x^T] - m m^T loses the small eigenvalues when the mean is large,
  // and KV keys have channels with large offsets.
  std::vector<double> mean(dim, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * dim;
    for (int d = 0; d < dim; ++d) mean[d] += row[d];
  }
  for (int d = 0; d < dim; ++d) mean[d] /= static_cast<double>(n);

  MatD cov = MatD::Zero(dim, dim);
  MatD chunk(std::min(n, kChunk), dim);
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t rows = std::min(kChunk, n - start);
    if (rows != chunk.rows()) chunk.resize(rows, dim);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = x + (start + r) * dim;
      for (int d = 0; d < dim; ++d) chunk(r, d) = static_cast<double>(row[d]) - mean[d];
    }
    cov.noalias() += chunk.transpose() * chunk;
  }
  cov /= static_cast<double>(n);

  Eigen::SelfAdjointEigenSolver<MatD> solver(cov);
  if (solver.info() != Eigen::Success) {
    throw Error(ErrorCode::kInternal, "fit_pca: eigensolver did not converge (dim " +
                                          std::to_string(dim) + ")");
  }
  const auto& values = solver.eigenvalues();   // ascending
  const auto& vectors = solver.eigenvectors();  // columns

  basis.mean.resize(dim);
  for (int d = 0; d < dim; ++d) basis.mean[d] = static_cast<float>(mean[d]);
  basis.eigenvalues.resize(dim);
  basis.components.resize(static_cast<size_t>(dim) * dim);
  for (int k = 0; k < dim; ++k) {
    const int col = dim - 1 - k;
    // Rounding makes eigenvalues of a rank-deficient covariance slightly
    // negative; a variance cannot be.
    basis.eigenvalues[k] = std::max(0.0, values(col));
    // Deterministic sign: the largest-magnitude entry (first on ties) > 0.
    int arg = 0;
    double best = -1.0;
    for (int d = 0; d < dim; ++d) {
      const double a = std::abs(vectors(d, col));
      if (a > best) {
        best = a;
        arg = d;
      }
    }
    const double sign = vectors(arg, col) < 0.0 ? -1.0 : 1.0;
    float* out = basis.components.data() + static_cast<size_t>(k) * dim;
    for (int d = 0; d < dim; ++d) out[d] = static_cast<float>(sign * vectors(d, col));
  }
  // The solver sorts ascending and max(0, .) is monotone, so the reversed,
  // clamped sequence is descending.
  return basis;
}

void check_basis(const PcaBasis& b, int64_t n, int n_keep, const void* in, const void* out,
                 const char* fn) {
  if (b.dim < 1 || b.mean.size() != static_cast<size_t>(b.dim) ||
      b.components.size() != static_cast<size_t>(b.dim) * b.dim) {
    invalid(std::string(fn) + ": malformed basis (dim " + std::to_string(b.dim) + ", mean size " +
            std::to_string(b.mean.size()) + ", components size " +
            std::to_string(b.components.size()) + ")");
  }
  if (n < 0) invalid(std::string(fn) + ": n = " + std::to_string(n) + ", must be >= 0");
  if (n_keep < 0 || n_keep > b.dim) {
    invalid(std::string(fn) + ": n_keep = " + std::to_string(n_keep) + ", must be in [0, " +
            std::to_string(b.dim) + "]");
  }
  if (n > 0 && (in == nullptr || out == nullptr)) invalid(std::string(fn) + ": null pointer");
}

// Rows per block in project(): the centred block [kRows, dim] lives in a
// per-thread scratch buffer that stays in L1/L2.
constexpr int64_t kRows = 128;

}  // namespace

PcaBasis fit_pca(const float* x, int64_t n, int dim) {
  check_fit_args(x, 1, n, dim, "fit_pca");
  return fit_unchecked(x, n, dim);
}

std::vector<PcaBasis> fit_pca_batched(const float* x, int64_t batch, int64_t n, int dim, int threads) {
  // Validate everything before the parallel loop: an exception must not
  // escape an OpenMP region.
  check_fit_args(x, batch, n, dim, "fit_pca_batched");
  if (threads < 0) throw Error(ErrorCode::kInvalidArgument, "fit_pca_batched: threads must be >= 0");
  std::vector<PcaBasis> out(static_cast<size_t>(batch));
  const int64_t stride = n * dim;
  // threads == 1: no team at all (the if clause), since its idle workers
  // would spin on the other cores for a while after the loop, beside
  // whatever single-threaded work comes next.
  const int team = threads > 0 ? threads : omp_get_max_threads();
  FirstException failure;
#pragma omp parallel for schedule(dynamic, 1) num_threads(team) if (team > 1)
  for (int64_t b = 0; b < batch; ++b) failure.capture([&] { out[b] = fit_unchecked(x + b * stride, n, dim); });
  failure.rethrow();
  return out;
}

void project(const PcaBasis& basis, const float* x, int64_t n, int n_keep, float* coeffs) {
  check_basis(basis, n, n_keep, x, coeffs, "project");
  if (n == 0 || n_keep == 0) return;
  const int dim = basis.dim;
  thread_local std::vector<float> scratch;
  if (scratch.size() < static_cast<size_t>(kRows * dim)) scratch.resize(kRows * dim);
  Eigen::Map<const RowMatF> axes(basis.components.data(), n_keep, dim);
  const float* mean = basis.mean.data();
  for (int64_t start = 0; start < n; start += kRows) {
    const int64_t rows = std::min(kRows, n - start);
    // Centre first (rather than subtracting mean . axis afterwards): keeps
    // precision when a channel's offset dwarfs its spread.
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = x + (start + r) * dim;
      float* dst = scratch.data() + r * dim;
      for (int d = 0; d < dim; ++d) dst[d] = src[d] - mean[d];
    }
    Eigen::Map<const RowMatF> centred(scratch.data(), rows, dim);
    Eigen::Map<RowMatF> out(coeffs + start * n_keep, rows, n_keep);
    out.noalias() = centred * axes.transpose();
  }
}

void reconstruct(const PcaBasis& basis, const float* coeffs, int64_t n, int n_keep, float* x_out) {
  check_basis(basis, n, n_keep, coeffs == nullptr && n_keep == 0 ? x_out : coeffs, x_out,
              "reconstruct");
  if (n == 0) return;
  const int dim = basis.dim;
  Eigen::Map<RowMatF> out(x_out, n, dim);
  Eigen::Map<const Eigen::RowVectorXf> mean(basis.mean.data(), dim);
  if (n_keep == 0) {
    out.rowwise() = mean;
    return;
  }
  Eigen::Map<const RowMatF> axes(basis.components.data(), n_keep, dim);
  for (int64_t start = 0; start < n; start += kRows) {
    const int64_t rows = std::min(kRows, n - start);
    Eigen::Map<const RowMatF> c(coeffs + start * n_keep, rows, n_keep);
    auto block = out.middleRows(start, rows);
    block.noalias() = c * axes;
    block.rowwise() += mean;
  }
}

void project_reference(const PcaBasis& basis, const float* x, int64_t n, int n_keep,
                       float* coeffs) {
  check_basis(basis, n, n_keep, x, coeffs, "project_reference");
  const int dim = basis.dim;
  for (int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < n_keep; ++k) {
      double acc = 0.0;
      for (int d = 0; d < dim; ++d) {
        acc += static_cast<double>(x[i * dim + d] - basis.mean[d]) *
               basis.components[static_cast<size_t>(k) * dim + d];
      }
      coeffs[i * n_keep + k] = static_cast<float>(acc);
    }
  }
}

void reconstruct_reference(const PcaBasis& basis, const float* coeffs, int64_t n, int n_keep,
                           float* x_out) {
  check_basis(basis, n, n_keep, coeffs == nullptr && n_keep == 0 ? x_out : coeffs, x_out,
              "reconstruct_reference");
  const int dim = basis.dim;
  for (int64_t i = 0; i < n; ++i) {
    for (int d = 0; d < dim; ++d) {
      double acc = basis.mean[d];
      for (int k = 0; k < n_keep; ++k) {
        acc += static_cast<double>(coeffs[i * n_keep + k]) *
               basis.components[static_cast<size_t>(k) * dim + d];
      }
      x_out[i * dim + d] = static_cast<float>(acc);
    }
  }
}

namespace {
void check_eigenvalues(const std::vector<double>& ev, const char* fn) {
  for (size_t i = 0; i < ev.size(); ++i) {
    if (!std::isfinite(ev[i]) || ev[i] < 0.0) {
      invalid(std::string(fn) + ": eigenvalue[" + std::to_string(i) + "] = " +
              std::to_string(ev[i]) + ", must be finite and >= 0");
    }
  }
}
}  // namespace

double reverse_water_filling_bits(const std::vector<double>& eigenvalues, double target_mse_total) {
  check_eigenvalues(eigenvalues, "reverse_water_filling_bits");
  if (!std::isfinite(target_mse_total) || target_mse_total < 0.0) {
    invalid("reverse_water_filling_bits: target_mse_total = " + std::to_string(target_mse_total) +
            ", must be finite and >= 0");
  }
  std::vector<double> lam(eigenvalues);
  std::sort(lam.begin(), lam.end());  // ascending
  double total = 0.0;
  for (double l : lam) total += l;
  if (target_mse_total >= total) return 0.0;
  if (target_mse_total == 0.0) return std::numeric_limits<double>::infinity();
  // sum_i min(theta, lambda_i) is piecewise linear in theta. With the k
  // smallest fully "under water" (lambda_i <= theta), theta = (D - S_k)/(m-k).
  const size_t m = lam.size();
  double prefix = 0.0;
  double theta = 0.0;
  for (size_t k = 0; k < m; ++k) {
    theta = (target_mse_total - prefix) / static_cast<double>(m - k);
    if (theta <= lam[k]) break;
    prefix += lam[k];
  }
  double bits = 0.0;
  for (double l : lam) {
    if (l > theta) bits += 0.5 * std::log2(l / theta);
  }
  return bits;
}

double reverse_water_filling_mse(const std::vector<double>& eigenvalues, double bits) {
  check_eigenvalues(eigenvalues, "reverse_water_filling_mse");
  if (!std::isfinite(bits) || bits < 0.0) {
    invalid("reverse_water_filling_mse: bits = " + std::to_string(bits) +
            ", must be finite and >= 0");
  }
  std::vector<double> lam;
  double total = 0.0;
  for (double l : eigenvalues) {
    total += l;
    if (l > 0.0) lam.push_back(l);
  }
  if (bits == 0.0 || lam.empty()) return total;
  std::sort(lam.begin(), lam.end(), [](double a, double b) { return a > b; });  // descending
  // With the k largest active: bits = 0.5 * sum_{i<k} log2(lambda_i / theta),
  // so log2 theta = (sum_{i<k} log2 lambda_i - 2 bits) / k; valid when
  // lambda_k <= theta <= lambda_{k-1}.
  const size_t m = lam.size();
  double log_sum = 0.0;
  double theta = 0.0;
  size_t k = 0;
  for (k = 1; k <= m; ++k) {
    log_sum += std::log2(lam[k - 1]);
    theta = std::exp2((log_sum - 2.0 * bits) / static_cast<double>(k));
    if (k == m || theta >= lam[k]) break;
  }
  double mse = static_cast<double>(k) * theta;
  for (size_t i = k; i < m; ++i) mse += lam[i];
  return mse;
}

}  // namespace kvcodec::linalg

#include "palu/projection.hpp"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <numeric>

#include "kvcodec/container.hpp"
#include "kvcodec/error.hpp"
#include "kvcodec/tensor.hpp"
#include "palu/group_quant.hpp"
#include "palu/hadamard.hpp"

namespace kvcodec::palu {

std::vector<std::pair<int, int>> split_head_groups(int n_heads, int n_groups) {
  const int g = std::clamp(n_groups, 1, std::max(1, n_heads));
  std::vector<std::pair<int, int>> out;
  int first = 0;
  for (int i = 0; i < g; ++i) {
    const int count = n_heads / g + (i < n_heads % g ? 1 : 0);
    out.emplace_back(first, count);
    first += count;
  }
  return out;
}

void Projection::project(const float* x, float* z) const {
  for (int j = 0; j < rank; ++j) {
    const float* u = basis_t.data() + size_t(j) * dim;
    float acc = 0.0f;
    for (int i = 0; i < dim; ++i) acc += u[i] * x[i];
    z[j] = acc;
  }
}

void Projection::reconstruct(const float* z, float* x) const {
  for (int i = 0; i < dim; ++i) {
    const float* u = basis.data() + size_t(i) * rank;
    float acc = 0.0f;
    for (int j = 0; j < rank; ++j) acc += u[j] * z[j];
    x[i] = acc;
  }
}

double Projection::average_bits() const {
  if (rank == 0) return 0.0;
  return std::accumulate(bits.begin(), bits.end(), 0.0) / rank;
}

void Projection::build_decoded() {
  basis.resize(basis_f16.size());
  basis_t.resize(basis_f16.size());
  for (int i = 0; i < dim; ++i)
    for (int j = 0; j < rank; ++j) {
      const float v = f16_to_f32(basis_f16[size_t(i) * rank + j]);
      basis[size_t(i) * rank + j] = v;
      basis_t[size_t(j) * dim + i] = v;
    }
}

void Projection::serialize(ByteWriter& out) const {
  out.u16(uint16_t(dim));
  out.u16(uint16_t(rank));
  out.bytes(bits.data(), bits.size());
  out.u16s(basis_f16.data(), basis_f16.size());
}

Projection Projection::deserialize(ByteReader& in, int expected_dim) {
  Projection p;
  p.dim = in.u16();
  p.rank = in.u16();
  if (p.dim != expected_dim)
    in.fail("PALU projection has dim " + std::to_string(p.dim) + ", expected " + std::to_string(expected_dim));
  if (p.rank < 1 || p.rank > p.dim)
    in.fail("PALU projection rank " + std::to_string(p.rank) + " outside [1, " + std::to_string(p.dim) + "]");
  const auto widths = in.bytes(size_t(p.rank));
  p.bits.assign(widths.begin(), widths.end());
  for (uint8_t b : p.bits)
    if (b < 1 || b > 8) in.fail("PALU latent width " + std::to_string(b) + " outside [1, 8]");
  // Checked against the bytes left before the basis is allocated.
  p.basis_f16 = in.u16s(size_t(p.dim) * size_t(p.rank));
  p.build_decoded();
  return p;
}

// A Haar-random orthogonal r x r matrix from a fixed seed: QR of a Gaussian
// matrix with the signs of R's diagonal folded into Q. Deterministic (own
// splitmix64 + Box-Muller), so it never needs to be stored.
static Eigen::MatrixXd seeded_orthogonal(int r) {
  uint64_t state = 0x9e3779b97f4a7c15ull ^ uint64_t(r);
  auto next = [&]() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  auto uniform = [&]() { return (double(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); };
  Eigen::MatrixXd g(r, r);
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < r; ++j)
      g(i, j) = std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform());
  Eigen::HouseholderQR<Eigen::MatrixXd> qr(g);
  Eigen::MatrixXd q = qr.householderQ();
  const Eigen::MatrixXd rr = qr.matrixQR().triangularView<Eigen::Upper>();
  for (int j = 0; j < r; ++j)
    if (rr(j, j) < 0) q.col(j) = -q.col(j);
  return q;
}

Eigenbasis gram_eigenbasis(const float* samples, int64_t n, int dim) {
  if (dim < 1 || dim > 65535) throw Error(ErrorCode::kInvalidArgument, "PALU dim out of range");
  // Gram matrix X^T X in double: eigenvalues are the squared singular values of X.
  Eigen::MatrixXd gram = Eigen::MatrixXd::Zero(dim, dim);
  {
    Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> chunk;
    const int64_t step = 256;
    for (int64_t s = 0; s < n; s += step) {
      const int64_t m = std::min(step, n - s);
      chunk.resize(m, dim);
      for (int64_t i = 0; i < m; ++i)
        for (int d = 0; d < dim; ++d) {
          const double v = samples[(s + i) * dim + d];
          chunk(i, d) = std::isfinite(v) ? v : 0.0;  // a non-finite sample must not poison the fit
        }
      gram.noalias() += chunk.transpose() * chunk;
    }
  }
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> eig(gram);
  const double denom = n > 0 ? double(n) : 1.0;
  Eigenbasis e;
  e.dim = dim;
  e.lambda.resize(size_t(dim));
  e.vectors.resize(size_t(dim) * dim);
  for (int k = 0; k < dim; ++k) {  // ascending -> descending
    e.lambda[size_t(k)] = std::max(0.0, eig.eigenvalues()(dim - 1 - k)) / denom;
    Eigen::VectorXd v = eig.eigenvectors().col(dim - 1 - k);
    Eigen::Index arg = 0;
    v.cwiseAbs().maxCoeff(&arg);
    if (v(arg) < 0) v = -v;
    for (int i = 0; i < dim; ++i) e.vectors[size_t(i) * dim + k] = v(i);
  }
  return e;
}

int choose_rank(const std::vector<double>& lambda, const FitOptions& opt) {
  const int dim = int(lambda.size());
  int r = opt.rank;
  if (r <= 0) {
    const double total = std::accumulate(lambda.begin(), lambda.end(), 0.0);
    double acc = 0.0;
    r = dim;
    for (int k = 0; k < dim; ++k) {
      acc += lambda[size_t(k)];
      if (total <= 0.0 || acc >= opt.energy_threshold * total) {
        r = k + 1;
        break;
      }
    }
  }
  return std::clamp(r, 1, dim);
}

// Mixed bits: the n_hi highest-energy channels (ties by index) get hi_bit;
// u [dim, r] is rounded to the stored f16 basis.
static Projection make_projection(const Eigen::MatrixXd& u, std::vector<double> energy, int n_hi,
                                  const FitOptions& opt) {
  const int dim = int(u.rows()), r = int(u.cols());
  Projection p;
  p.dim = dim;
  p.rank = r;
  std::vector<int> order(r);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return energy[a] > energy[b]; });
  p.bits.assign(r, uint8_t(opt.lo_bit));
  for (int i = 0; i < n_hi; ++i) p.bits[order[i]] = uint8_t(opt.hi_bit);
  p.channel_energy = std::move(energy);
  p.basis_f16.resize(size_t(dim) * r);
  for (int i = 0; i < dim; ++i)
    for (int j = 0; j < r; ++j) p.basis_f16[size_t(i) * r + j] = f32_to_f16(float(u(i, j)));
  p.build_decoded();
  return p;
}

static int hi_channels(const FitOptions& opt, int r) { return std::clamp(int(std::lround(opt.hi_fraction * r)), 1, r); }

Projection fit_projection(const float* samples, int64_t n, int dim, const FitOptions& opt) {
  const Eigenbasis e = gram_eigenbasis(samples, n, dim);
  const int r = choose_rank(e.lambda, opt);
  Eigen::MatrixXd u(dim, r);
  for (int i = 0; i < dim; ++i)
    for (int j = 0; j < r; ++j) u(i, j) = e.vectors[size_t(i) * dim + j];
  std::vector<double> energy(e.lambda.begin(), e.lambda.begin() + r);
  if (opt.hadamard) {
    // Rotating the latents spreads outlier channels over all channels, so a
    // fixed quantizer range wastes fewer levels. Folded into the basis (U Q),
    // it costs nothing at encode or decode time.
    const Eigen::MatrixXd q = seeded_orthogonal(r);
    u = u * q;
    for (int j = 0; j < r; ++j) {
      double en = 0.0;
      for (int k = 0; k < r; ++k) en += q(k, j) * q(k, j) * e.lambda[size_t(k)];
      energy[size_t(j)] = en;
    }
  }
  return make_projection(u, std::move(energy), hi_channels(opt, r), opt);
}

Projection calibrated_projection(const Eigenbasis& e, const FitOptions& opt) {
  const int dim = e.dim, r = choose_rank(e.lambda, opt);
  const int n_hi = hi_channels(opt, r);
  // Channels in eigenvalue order: [0, n_hi) are the hi_bit class.
  Eigen::MatrixXd u(dim, r);
  std::vector<double> energy(e.lambda.begin(), e.lambda.begin() + r);
  const std::vector<int> blocks = hadamard_blocks(n_hi, r);
  std::vector<double> row(static_cast<size_t>(r));
  for (int i = 0; i < dim; ++i) {
    for (int j = 0; j < r; ++j) row[size_t(j)] = e.vectors[size_t(i) * dim + j];
    // Row i of U H is H applied to row i of U (H is symmetric).
    if (opt.hadamard) rotate_blocks(row.data(), blocks);
    for (int j = 0; j < r; ++j) u(i, j) = row[size_t(j)];
  }
  if (opt.hadamard) {
    // A block's channels share its energy equally (H has entries +-1/sqrt(b)).
    size_t first = 0;
    for (int b : blocks) {
      double sum = 0.0;
      for (int j = 0; j < b; ++j) sum += e.lambda[first + size_t(j)];
      for (int j = 0; j < b; ++j) energy[first + size_t(j)] = sum / b;
      first += size_t(b);
    }
  }
  // The hi class is the first n_hi channels whatever their energies after rotation.
  Projection p = make_projection(u, energy, 0, opt);
  std::fill(p.bits.begin(), p.bits.begin() + n_hi, uint8_t(opt.hi_bit));
  return p;
}

size_t latent_group_bytes(const Projection& p, int64_t rows, int64_t n_tokens) {
  return detail::channel_group_bytes(rows, p.rank, n_tokens, p.bits.data());
}

void encode_latent_group(const Projection& p, const float* z, int64_t rows, int64_t n_tokens,
                         std::vector<uint8_t>& out) {
  detail::encode_channel_group(z, rows, p.rank, n_tokens, p.bits.data(), out);
}

void decode_latent_group(const Projection& p, const uint8_t* blob, size_t size, int64_t rows,
                         int64_t n_tokens, float* z) {
  detail::decode_channel_group(blob, size, rows, p.rank, n_tokens, p.bits.data(), z);
}

}  // namespace kvcodec::palu

// PALU: low-rank latent projections and their mixed-bit latent quantizer (DESIGN 5).
//
// A projection maps a vector x of `dim` values (one head in `shared` mode, the
// concatenated heads of a group in `joint` mode) to `rank` latents z = U^T x and
// back x_hat = U z, with U [dim, rank] orthonormal columns fitted by SVD.
//
// No centring: Palu factorises the key/value projection weights themselves, so
// the latent map is purely linear (x_hat = U U^T x); a mean offset in the data is
// captured by the leading singular vector instead of a stored mean. The SVD is
// taken through the eigendecomposition of the Gram matrix X^T X (in double),
// whose eigenvalues are sigma^2.
//
// The basis is stored as f16 and every projection uses the f16-rounded values,
// so a saved and reloaded cache reconstructs bit for bit.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "palu/bitpack.hpp"

// Declared, not included: this header is also read by nvcc (src/gpu/cuda),
// which compiles C++17, and kvcodec/container.hpp needs C++20's std::span.
namespace kvcodec {
class ByteReader;
class ByteWriter;
}  // namespace kvcodec

namespace kvcodec::palu {

// Contiguous head groups: G = clamp(n_groups, 1, H); the first H mod G groups
// get one extra head. Returns (first head, head count) per group.
std::vector<std::pair<int, int>> split_head_groups(int n_heads, int n_groups);

struct FitOptions {
  int rank = 0;                   // explicit rank; 0: pick by energy_threshold
  double energy_threshold = 0.90; // smallest r with sum sigma^2 share >= this
  // Rotate the latents before quantizing: fit_projection by a seeded random
  // orthogonal matrix, calibrated_projection by Walsh-Hadamard blocks inside
  // each bit class (palu/hadamard.hpp).
  bool hadamard = false;
  double hi_fraction = 0.25;      // share of latent channels at hi_bit (at least one)
  int hi_bit = 4;
  int lo_bit = 2;
};

struct Projection {
  int dim = 0;
  int rank = 0;
  std::vector<uint16_t> basis_f16;  // [dim, rank] row-major, as stored
  std::vector<uint8_t> bits;        // [rank] code width of each latent channel, as stored
  std::vector<float> basis;         // [dim, rank] decoded from basis_f16
  std::vector<float> basis_t;       // [rank, dim] transpose, for projecting

  // Not stored: telemetry of the fit.
  std::vector<double> channel_energy;  // [rank] mean square of each latent channel

  void project(const float* x, float* z) const;      // z[rank] = U^T x
  void reconstruct(const float* z, float* x) const;  // x[dim] = U z
  double average_bits() const;

  // Stored form: u16 dim, u16 rank, rank bytes of widths, dim*rank f16.
  size_t serialized_size() const { return 4 + size_t(rank) + 2 * size_t(dim) * size_t(rank); }
  void serialize(ByteWriter& out) const;
  // Reads one projection from in (consuming exactly serialized_size()
  // bytes); checks dim, rank and widths: Error(kFormat) naming the offset.
  static Projection deserialize(ByteReader& in, int expected_dim);
  void build_decoded();  // fills basis/basis_t from basis_f16
};

// Fits from samples [n, dim] row-major. n may be smaller than dim.
Projection fit_projection(const float* samples, int64_t n, int dim, const FitOptions& opt);

// The eigenbasis of the Gram matrix X^T X / n of samples X [n, dim], in
// double: eigenvalues descending (mean squared singular values), vectors
// [dim, dim] row-major with column k the k-th eigenvector (its
// largest-magnitude entry positive, so fits are stable across runs).
// Non-finite samples count as 0.
struct Eigenbasis {
  int dim = 0;
  std::vector<double> lambda;   // [dim]
  std::vector<double> vectors;  // [dim, dim]
};
Eigenbasis gram_eigenbasis(const float* samples, int64_t n, int dim);

// The rank FitOptions asks for on eigenvalues lambda (descending): opt.rank
// clamped to [1, dim], or the smallest rank whose share of the sum reaches
// opt.energy_threshold.
int choose_rank(const std::vector<double>& lambda, const FitOptions& opt);

// PALU's calibrated projection from an eigenbasis fitted offline: the
// leading choose_rank() eigenvectors, the first round(hi_fraction * r) (at
// least one) at hi_bit and the rest at lo_bit; with opt.hadamard each bit
// class is rotated by Walsh-Hadamard blocks (hadamard_blocks), folded into
// the basis (U H), so projecting and reconstructing cost the same.
Projection calibrated_projection(const Eigenbasis& e, const FitOptions& opt);

// Quantizes a token group of latents z [n_tokens, rows, rank] (token-major):
// per (row, channel) an f16 min and scale over the n_tokens, then codes of
// bits[channel] bits. Appends exactly latent_group_bytes() bytes.
size_t latent_group_bytes(const Projection& p, int64_t rows, int64_t n_tokens);
void encode_latent_group(const Projection& p, const float* z, int64_t rows, int64_t n_tokens,
                         std::vector<uint8_t>& out);
void decode_latent_group(const Projection& p, const uint8_t* blob, size_t size, int64_t rows,
                         int64_t n_tokens, float* z);

}  // namespace kvcodec::palu

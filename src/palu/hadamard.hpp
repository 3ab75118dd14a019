// Walsh-Hadamard rotations of latent channels (PALU's calibrated mode).
//
// PALU rotates its latents by a Hadamard matrix before quantizing them: an
// orthonormal rotation with entries +-1/sqrt(n) spreads a channel's outlier
// over all n channels, so a per-channel quantizer range wastes fewer levels.
// Latent channels are ordered by energy and split into bit classes (hi_bit
// channels first, then lo_bit ones); each class is rotated on its own, so a
// rotation never moves energy between widths. A class of any size is
// covered by consecutive power-of-two blocks, largest first (24 = 16 + 8).
#pragma once

#include <vector>

namespace kvcodec::palu {

// Block sizes (powers of two) covering channels [0, n_hi) then [n_hi, rank).
std::vector<int> hadamard_blocks(int n_hi, int rank);

// In place: x[0..n) <- H_n x / sqrt(n), n a power of two (the fast transform,
// n log2 n additions). Throws Error(kInvalidArgument) for another n.
void fwht(double* x, int n);

// The same through the plain matrix: y = H x / sqrt(n) with
// H[i][j] = (-1)^popcount(i & j) (Sylvester's construction). For tests.
void fwht_reference(const double* x, int n, double* y);

// fwht() on each block of x, consecutive from x[0].
void rotate_blocks(double* x, const std::vector<int>& blocks);

}  // namespace kvcodec::palu

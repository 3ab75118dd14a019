#include "palu/hadamard.hpp"

#include <bit>
#include <cmath>

#include "kvcodec/error.hpp"

namespace kvcodec::palu {

static void check_power_of_two(int n) {
  if (n < 1 || !std::has_single_bit(unsigned(n)))
    throw Error(ErrorCode::kInvalidArgument, "Hadamard size " + std::to_string(n) + " is not a power of two");
}

std::vector<int> hadamard_blocks(int n_hi, int rank) {
  std::vector<int> blocks;
  for (int left : {n_hi, rank - n_hi})
    while (left > 0) {
      const int b = int(std::bit_floor(unsigned(left)));
      blocks.push_back(b);
      left -= b;
    }
  return blocks;
}

void fwht(double* x, int n) {
  check_power_of_two(n);
  for (int h = 1; h < n; h *= 2)
    for (int i = 0; i < n; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const double a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const double s = 1.0 / std::sqrt(double(n));
  for (int i = 0; i < n; ++i) x[i] *= s;
}

void fwht_reference(const double* x, int n, double* y) {
  check_power_of_two(n);
  const double s = 1.0 / std::sqrt(double(n));
  for (int i = 0; i < n; ++i) {
    double acc = 0.0;
    for (int j = 0; j < n; ++j) acc += (std::popcount(unsigned(i & j)) % 2 ? -x[j] : x[j]);
    y[i] = acc * s;
  }
}

void rotate_blocks(double* x, const std::vector<int>& blocks) {
  for (int b : blocks) {
    fwht(x, b);
    x += b;
  }
}

}  // namespace kvcodec::palu

// The rate allocator's distortion measure (fit_head, allocator=rate with a
// distortion target): the squared error of rounding coefficients to a
// uniform step, summed. The step search bisects log2(step) 40 times per
// round over every fit coefficient, so this sum was most of local kvtc's
// encode (82% at head_dim 128) while it ran as one dependent chain of
// divisions; here it is eight interleaved sums of products, by AVX2 or
// plain loops that give the same bits.
#pragma once

#include <cstdint>

namespace kvcodec::kvtc {

// sum_i (c[i] - step * floor(c[i] * (1 / step) + 0.5))^2 over c [count],
// in doubles: lane l = i mod 8 sums its terms in order (mul then add, no
// FMA), then the tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
// simd: the AVX2 loop where the CPU has it (same value).
double step_rounding_error(const float* c, int64_t count, double step, bool simd);

}  // namespace kvcodec::kvtc

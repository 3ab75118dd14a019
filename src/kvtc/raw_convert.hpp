// Conversions between the raw 16-bit token storage (f16 or bf16) and f32, the
// hot loops of the kvtc caches' append (f32 -> raw) and block encode/fetch
// (raw -> f32). Results are bit-identical to kvcodec::convert() (core) for
// every input, NaNs included; F16C does the f16 work when the build has it
// (-march=native), with the core's scalar routine as the reference and the
// fallback (tests/kvtc/test_raw_convert.cpp compares them exhaustively).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvcodec/tensor.hpp"

namespace kvcodec::kvtc {

// raw is DType::kF16 or DType::kBF16 (anything else: Error(kInvalidArgument)).
void raw_to_f32(const uint16_t* src, DType raw, float* dst, size_t n);
void f32_to_raw(const float* src, uint16_t* dst, DType raw, size_t n);

// raw_to_f32(f32_to_raw(src)) without the raw buffer: src [n] rounded to
// the raw dtype's values, as f32 (the same bits).
void round_through_raw(const float* src, DType raw, float* dst, size_t n);

// Whether the SIMD path is compiled in (for the tests' report).
bool raw_convert_has_simd();

}  // namespace kvcodec::kvtc

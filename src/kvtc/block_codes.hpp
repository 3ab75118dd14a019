// The entropy-coding half of kvtc::encode_block / decode_block on its own:
// a block's integer codes [n, K] (token-major, K = kept components) to bytes
// and back, with the same coder and tables, so
//   encode_codes(p, codes_of(x), n) == encode_block(p, x, n)
// byte for byte. The calibrated cache uses it to grow its newest, partial
// block token by token without re-quantizing what is already coded (a
// token's codes never change once written: DESIGN 4).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "kvtc/codec.hpp"

namespace kvcodec::kvtc {

// codes [n, K]; every code must be < its component's levels
// (Error(kInvalidArgument) otherwise).
std::vector<uint8_t> encode_codes(const HeadParams& p, const uint16_t* codes, int64_t n);

// Inverse of encode_codes into codes [n, K]. Throws Error(kFormat) on bad or
// truncated bytes or a code outside its component's levels.
void decode_codes(const HeadParams& p, const uint8_t* data, size_t size, int64_t n, uint16_t* codes);

// Whether some code of codes [n, K] is >= its component's levels: one flag
// over the codes against a dense copy of the levels (a loop GCC
// vectorises; a branch per code through p.quant was 9.5% of calibrated
// kvtc's encode). Callers look for the offending code only when it is set.
bool any_code_past_levels(const HeadParams& p, const uint16_t* codes, int64_t n);

// Whether p's entropy coder bounds the codes by itself: rANS or Huffman
// with no table's alphabet larger than its quantizer's levels (never after
// fit_head / deserialize). Their encoders reject a symbol outside the
// alphabet and their decoders return none, so no code past the levels gets
// through; fixed-width codes need any_code_past_levels.
bool coder_bounds_codes(const HeadParams& p);

// The coder switch alone, shared with kvtc::encode_block / decode_block
// (which do their own range handling): no check of the codes against the
// quantizers' levels (the coders still reject symbols outside their tables
// and bad streams). n >= 0.
std::vector<uint8_t> entropy_encode_codes(const HeadParams& p, const uint16_t* codes, int64_t n);
// Two blocks' entropy_encode_codes, the same bytes each; rANS blocks of
// both go through entropy::rans_encode_pair (their streams side by side).
std::pair<std::vector<uint8_t>, std::vector<uint8_t>> entropy_encode_codes_pair(const HeadParams& pa,
                                                                                const uint16_t* codes_a,
                                                                                int64_t n_a, const HeadParams& pb,
                                                                                const uint16_t* codes_b, int64_t n_b);
void entropy_decode_codes(const HeadParams& p, const uint8_t* data, size_t size, int64_t n, uint16_t* codes);

}  // namespace kvcodec::kvtc

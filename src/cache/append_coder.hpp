// The calibrated cache's block payloads. While a block (or refinement group)
// fills, its run of tokens' kvtc codes [n, K] (token-major, K = kept
// components) is entropy-coded so that it grows at its end with work
// proportional to the new tokens alone, paying for one coder flush as a
// block coded whole does. When the run is whole it is coded once more into
// the codec's own bytes (kvtc::encode_codes), which the fast decoder reads:
// two codings per token whatever the block size, not the ~block/2 of
// decoding and re-coding the run on every append (DESIGN 3).
//
// How: rANS run in stack order (ryg_rans's encoder run forwards). The
// encoder takes symbols in token order from the stored lane states and
// appends its renormalisation bytes; the decoder starts from the final
// states and takes the symbols newest first, reading those bytes backwards.
// Symbol i of the run (i = t * K + k) belongs to lane i % kRansLanes, so the
// lanes are independent chains, as in entropy::rans_encode. Same models
// (the parameters' frequency tables), same renormalisation, so the same
// rate as the forward coder's payload to a few bytes.
//
// Bytes: the renormalisation bytes in emission order, then the states of the
// lanes that hold a symbol (min(n * K, kRansLanes) of them; u32 little
// endian, lane 0 first). No symbols: no bytes.
//
// Only for rANS parameters (coder == kRans); others are refused with
// Error(kInvalidArgument) (grow_block_payload re-codes those).
#pragma once

#include <cstdint>
#include <vector>

#include "kvtc/codec.hpp"

namespace kvcodec::cache_impl {

// Appends m tokens' codes [m, K] to payload, which holds `held` tokens' (as
// this function wrote them). Every code must be < its component's levels
// (Error(kInvalidArgument) otherwise, payload unchanged).
void append_stacked_codes(const kvtc::HeadParams& p, std::vector<uint8_t>& payload, int64_t held,
                          const uint16_t* codes, int64_t m);

// The codes [n, K] of a payload of n tokens. Error(kFormat) for bytes that
// are not exactly such a payload (truncated, trailing bytes, a state out of
// range, or lanes that do not end in the initial state).
void decode_stacked_codes(const kvtc::HeadParams& p, const uint8_t* data, size_t size, int64_t n,
                          uint16_t* codes);

// A calibrated block payload for any coder. Open (still filling): stacked
// rANS (above) for rANS parameters; closed, and open for other coders: the
// codec's own bytes (kvtc::encode_codes; those coders grow by decoding the
// run and coding it again). grow_block_payload appends m tokens' codes to a
// payload of `held` tokens, open unless held == 0; `close` makes it closed.
// Returns the symbols entropy-coded (CacheStats::coded_symbols).
uint64_t grow_block_payload(const kvtc::HeadParams& p, std::vector<uint8_t>& payload, int64_t held,
                            const uint16_t* codes, int64_t m, bool close);
// The reconstruction [n, D] of a payload of n tokens (kvtc::decode_block when
// closed); Error(kFormat) for bad bytes.
void decode_block_payload(const kvtc::HeadParams& p, const uint8_t* data, size_t size, int64_t n, bool open,
                          float* out);
// An open payload of n tokens as saved layout 1 wrote it (kvtc::encode_codes
// bytes for every coder) in the current form; Error(kFormat) for bad bytes.
std::vector<uint8_t> open_payload_from_layout1(const kvtc::HeadParams& p, const std::vector<uint8_t>& old,
                                               int64_t n);

}  // namespace kvcodec::cache_impl

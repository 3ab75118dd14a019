#include "cache/append_coder.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <string>

#include "entropy/entropy.hpp"
#include "kvtc/block_codes.hpp"
#include "kvcodec/error.hpp"

namespace kvcodec::cache_impl {
namespace {

using entropy::kRansLanes;
using entropy::kRansLow;
using States = std::array<uint32_t, kRansLanes>;

size_t lanes_used(int64_t n, size_t kept) {
  return size_t(std::min<uint64_t>(uint64_t(n) * kept, kRansLanes));
}

// Payloads of these parameters are stacked rANS.
bool stacked(const kvtc::HeadParams& p) {
  return p.coder == kvtc::CoderChoice::kRans && p.rans_tables.size() == size_t(p.n_kept());
}

void require_rans(const kvtc::HeadParams& p, const char* who) {
  if (!stacked(p))
    throw Error(ErrorCode::kInvalidArgument, std::string(who) + ": parameters are not rANS-coded");
}

// The stored states of a payload's used lanes (the rest at the initial state).
States read_states(const uint8_t* data, size_t size, size_t lanes, const char* who) {
  States x;
  x.fill(kRansLow);
  if (size < 4 * lanes)
    throw Error(ErrorCode::kFormat, std::string(who) + ": " + std::to_string(size) + " bytes cannot hold " +
                                        std::to_string(lanes) + " lane states");
  const uint8_t* s = data + size - 4 * lanes;
  for (size_t j = 0; j < lanes; ++j) {
    x[j] = uint32_t(s[4 * j]) | uint32_t(s[4 * j + 1]) << 8 | uint32_t(s[4 * j + 2]) << 16 |
           uint32_t(s[4 * j + 3]) << 24;
    if (x[j] < kRansLow || x[j] >= (kRansLow << 8))
      throw Error(ErrorCode::kFormat, std::string(who) + ": lane state outside [2^23, 2^31)");
  }
  return x;
}


// Stack-order rANS encode of m tokens' codes [m, K] onto lane states x,
// symbol index i onwards, appending the renormalisation bytes to out:
// ryg_rans's step with a division (the reference).
void push_symbols_plain(const kvtc::HeadParams& p, States& x, uint64_t i, const uint16_t* codes, int64_t m,
                        std::vector<uint8_t>& out) {
  const size_t kept = size_t(p.n_kept());
  for (int64_t t = 0; t < m; ++t)
    for (size_t k = 0; k < kept; ++k, ++i) {
      const entropy::FrequencyTable& table = p.rans_tables[k];
      const uint16_t s = codes[size_t(t) * kept + k];
      const uint32_t freq = table.freq[s], scale = table.scale_bits;
      uint32_t& state = x[i % kRansLanes];
      // Renormalise so the step below stays in [2^23, 2^31) (ryg_rans).
      const uint32_t x_max = ((kRansLow >> scale) << 8) * freq;
      while (state >= x_max) {
        out.push_back(uint8_t(state & 0xff));
        state >>= 8;
      }
      state = ((state / freq) << scale) + state % freq + table.cum[s];
    }
}

// The same bytes and states with the encoder's division-free constants
// (the kernels' RansEncodeTable: x / freq by its reciprocal, as
// entropy::rans_encode) and a branchless renormalisation: a state below
// 2^31 against x_max >= 2^15 emits 0, 1 or 2 bytes, low byte first. The
// bytes go to per-thread scratch with room for two a symbol, then onto out
// (which grows as by push_back: an open payload is resident bytes, and two
// bytes of room a symbol there would hold far more than its size).
void push_symbols_fast(const kvtc::HeadParams& p, States& x, uint64_t i, const uint16_t* codes, int64_t m,
                       std::vector<uint8_t>& out) {
  const size_t kept = size_t(p.n_kept());
  const auto& enc = p.derived().rans_encode;
  thread_local std::vector<uint8_t> scratch;
  scratch.resize(2 * size_t(m) * kept);
  uint8_t* bytes = scratch.data();
  size_t at = 0;
  for (int64_t t = 0; t < m; ++t)
    for (size_t k = 0; k < kept; ++k, ++i) {
      const entropy::RansEncodeTable::Sym& e = enc[k].syms[codes[size_t(t) * kept + k]];
      uint32_t& state = x[i % kRansLanes];
      const uint32_t n = uint32_t(state >= e.x_max) + uint32_t(uint64_t(state) >= (uint64_t(e.x_max) << 8));
      bytes[at] = uint8_t(state);
      bytes[at + 1] = uint8_t(state >> 8);  // in the room of this symbol's two bytes
      at += n;
      state >>= 8 * n;
      const uint32_t q = uint32_t((uint64_t(state) * e.rcp) >> 32) >> e.shift;
      state = state + e.bias + q * e.cmpl_freq;
    }
  out.insert(out.end(), bytes, bytes + at);
}

}  // namespace

void append_stacked_codes(const kvtc::HeadParams& p, std::vector<uint8_t>& payload, int64_t held,
                          const uint16_t* codes, int64_t m) {
  require_rans(p, "append_stacked_codes");
  const size_t kept = size_t(p.n_kept());
  if (held < 0 || m < 0) throw Error(ErrorCode::kInvalidArgument, "append_stacked_codes: negative token count");
  for (int64_t t = 0; t < m; ++t)
    for (size_t k = 0; k < kept; ++k)
      if (codes[size_t(t) * kept + k] >= std::min<uint32_t>(p.quant[k].levels, p.rans_tables[k].alphabet_size))
        throw Error(ErrorCode::kInvalidArgument, "append_stacked_codes: code " +
                                                     std::to_string(codes[size_t(t) * kept + k]) + " of component " +
                                                     std::to_string(k) + " is outside its alphabet");
  if (m == 0 || kept == 0) return;
  const size_t old_lanes = lanes_used(held, kept);
  States x = read_states(payload.data(), payload.size(), old_lanes, "append_stacked_codes");
  payload.resize(payload.size() - 4 * old_lanes);
  uint64_t i = uint64_t(held) * kept;  // index of the next symbol of the run
  if (p.derived().rans_encode.size() == kept)
    push_symbols_fast(p, x, i, codes, m, payload);
  else
    push_symbols_plain(p, x, i, codes, m, payload);
  for (size_t j = 0; j < lanes_used(held + m, kept); ++j)
    for (int b = 0; b < 4; ++b) payload.push_back(uint8_t(x[j] >> (8 * b)));
}

void decode_stacked_codes(const kvtc::HeadParams& p, const uint8_t* data, size_t size, int64_t n,
                          uint16_t* codes) {
  require_rans(p, "decode_stacked_codes");
  const size_t kept = size_t(p.n_kept());
  if (n < 0) throw Error(ErrorCode::kInvalidArgument, "decode_stacked_codes: n = " + std::to_string(n));
  if (n == 0 || kept == 0) {
    if (size != 0) throw Error(ErrorCode::kFormat, "kvtc block: bytes where no symbols are coded");
    return;
  }
  // The decoder's slot tables, built once with the parameters (or here
  // for parameters assembled by hand).
  thread_local std::vector<entropy::RansDecodeTable> built;
  const std::vector<entropy::RansDecodeTable>* tables = &p.derived().rans_decode;
  if (p.derived().rans_decode.size() != kept) {
    built.clear();
    for (const auto& t : p.rans_tables) built.emplace_back(t);
    tables = &built;
  }
  const size_t lanes = lanes_used(n, kept);
  States x = read_states(data, size, lanes, "kvtc block");
  size_t pos = size - 4 * lanes;  // renormalisation bytes left, read backwards
  uint64_t i = uint64_t(n) * kept;  // symbols left: the next is i - 1
  // Groups of kRansLanes symbols while 2 bytes per symbol are left, with a
  // branchless renormalisation: a step leaves a state >= 2^(23 - scale) >=
  // 2^7 (it was >= 2^23, scale <= 16), so at most two bytes bring it back
  // to [2^23, 2^31), and the bytes it takes follow from the state alone:
  // the lanes' only serial dependency is one subtract per symbol, where the
  // loop below branches per byte. The same symbols, states and errors.
  size_t k = size_t((i + kept - 1) % kept);
  bool out_of_range = false;
  while (i >= kRansLanes && pos >= 2 * kRansLanes) {
    // The group's 8 symbols use the 8 lanes once each, so all their slots
    // are known now: the symbol searches run side by side (the tables
    // without a slot or search table, <= kRansGroupMaxAlphabet symbols,
    // bisect in lockstep from one step size: independent loads, not eight
    // dependent chains one after the other).
    std::array<const entropy::RansDecodeTable*, kRansLanes> tab;
    std::array<uint32_t, kRansLanes> slot, sym;
    for (size_t j = 0, kj = k; j < kRansLanes; ++j, kj = kj == 0 ? kept - 1 : kj - 1) {
      tab[j] = &(*tables)[kj];
      slot[j] = x[(i - 1 - j) % kRansLanes] & ((1u << tab[j]->scale_bits) - 1);
      sym[j] = 0;
    }
    for (uint32_t step = std::bit_floor(entropy::kRansGroupMaxAlphabet - 1); step != 0; step >>= 1)
      for (size_t j = 0; j < kRansLanes; ++j) {
        const uint32_t last = tab[j]->alphabet_size - 1, m = std::min(sym[j] + step, last);
        sym[j] = tab[j]->syms[m].cum <= slot[j] ? m : sym[j];
      }
    for (size_t j = 0; j < kRansLanes; ++j) {
      --i;
      const entropy::RansDecodeTable& table = *tab[j];
      uint32_t& state = x[i % kRansLanes];
      const bool bisected = table.slot_symbol.empty() && table.search.empty() &&
                            table.alphabet_size <= entropy::kRansGroupMaxAlphabet;
      const uint32_t s = bisected ? sym[j] : table.symbol_of(slot[j]);
      state = table.syms[s].freq * (state >> table.scale_bits) + slot[j] - table.syms[s].cum;
      const uint32_t take = uint32_t(state < kRansLow) + uint32_t(state < (kRansLow >> 8));
      const uint32_t v = uint32_t(data[pos - 1]) << 8 | data[pos - 2];  // in bounds: pos >= 2 per symbol left
      state = (state << (8 * take)) | (v >> (16 - 8 * take));           // take = 0: v >> 16 == 0
      pos -= take;
      out_of_range |= s >= p.quant[k].levels;
      codes[i] = uint16_t(s);
      k = k == 0 ? kept - 1 : k - 1;
    }
    if (out_of_range) throw Error(ErrorCode::kFormat, "kvtc block: code out of range");
  }
  while (i-- > 0) {
    const size_t k = size_t(i % kept);
    const entropy::RansDecodeTable& table = (*tables)[k];
    uint32_t& state = x[i % kRansLanes];
    const uint32_t slot = state & ((1u << table.scale_bits) - 1);
    const uint32_t s = table.symbol_of(slot);
    state = table.syms[s].freq * (state >> table.scale_bits) + slot - table.syms[s].cum;
    while (state < kRansLow) {
      if (pos == 0) throw Error(ErrorCode::kFormat, "kvtc block: truncated stream");
      state = state << 8 | data[--pos];
    }
    if (s >= p.quant[k].levels) throw Error(ErrorCode::kFormat, "kvtc block: code out of range");
    codes[i] = uint16_t(s);
  }
  if (pos != 0) throw Error(ErrorCode::kFormat, "kvtc block: trailing bytes");
  for (size_t j = 0; j < lanes; ++j)
    if (x[j] != kRansLow) throw Error(ErrorCode::kFormat, "kvtc block: a lane does not end in its initial state");
}

uint64_t grow_block_payload(const kvtc::HeadParams& p, std::vector<uint8_t>& payload, int64_t held,
                            const uint16_t* codes, int64_t m, bool close) {
  const size_t kept = size_t(p.n_kept());
  if (stacked(p) && !close) {
    append_stacked_codes(p, payload, held, codes, m);
    return uint64_t(m) * kept;
  }
  if (held == 0) {
    payload = kvtc::encode_codes(p, codes, m);
    return uint64_t(m) * kept;
  }
  std::vector<uint16_t> run(size_t(held + m) * kept);
  if (stacked(p))
    decode_stacked_codes(p, payload.data(), payload.size(), held, run.data());
  else
    kvtc::decode_codes(p, payload.data(), payload.size(), held, run.data());
  std::copy(codes, codes + size_t(m) * kept, run.begin() + std::ptrdiff_t(size_t(held) * kept));
  payload = kvtc::encode_codes(p, run.data(), held + m);
  return uint64_t(held + m) * kept;
}

void decode_block_payload(const kvtc::HeadParams& p, const uint8_t* data, size_t size, int64_t n, bool open,
                          float* out) {
  if (!open || !stacked(p)) return kvtc::decode_block(p, data, size, n, out);
  thread_local std::vector<uint16_t> codes;
  codes.resize(size_t(n) * size_t(p.n_kept()));
  decode_stacked_codes(p, data, size, n, codes.data());
  kvtc::dequantize_block(p, codes.data(), n, out);
}

std::vector<uint8_t> open_payload_from_layout1(const kvtc::HeadParams& p, const std::vector<uint8_t>& old,
                                               int64_t n) {
  if (!stacked(p)) return old;
  std::vector<uint16_t> codes(size_t(n) * size_t(p.n_kept()));
  kvtc::decode_codes(p, old.data(), old.size(), n, codes.data());
  std::vector<uint8_t> payload;
  append_stacked_codes(p, payload, 0, codes.data(), n);
  return payload;
}

}  // namespace kvcodec::cache_impl

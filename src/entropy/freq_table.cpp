// Frequency tables for rANS: normalisation, compact serialisation, cost.
#include <algorithm>
#include <bit>
#include <cmath>
#include <queue>
#include <string>

#include "entropy/entropy.hpp"

namespace kvcodec::entropy {
namespace {

[[noreturn]] void invalid(const std::string& what) { throw Error(ErrorCode::kInvalidArgument, "FrequencyTable: " + what); }
[[noreturn]] void bad_format(const std::string& what) { throw Error(ErrorCode::kFormat, "frequency table: " + what); }
// The parse loop's errors, out of line: their message building kept the
// loop's per-symbol step from inlining (a kvtc cache parses every table of a
// head on every call).
[[noreturn, gnu::cold, gnu::noinline]] void bad_sum(uint64_t total, uint32_t s) {
  bad_format("frequencies exceed the total " + std::to_string(total) + " at symbol " + std::to_string(s));
}
[[noreturn, gnu::cold, gnu::noinline]] void bad_exponent(uint32_t s, int e, uint32_t scale) {
  bad_format("symbol " + std::to_string(s) + ": frequency exponent " + std::to_string(e) + " outside 1.." +
             std::to_string(scale));
}
[[noreturn, gnu::cold, gnu::noinline]] void bad_run() {
  bad_format("run of unit frequencies runs past the alphabet end");
}

void fill_cum(FrequencyTable& t) {
  t.cum.resize(size_t(t.alphabet_size) + 1);  // every entry written below
  uint32_t c = 0;
  t.cum[0] = 0;
  for (uint32_t s = 0; s < t.alphabet_size; ++s) t.cum[s + 1] = c += t.freq[s];
}

// The table of frequencies already known valid (each >= 1, summing to
// 2^scale_bits, scale and alphabet in range).
FrequencyTable valid_table(std::vector<uint32_t> freq, uint32_t scale_bits) {
  FrequencyTable t;
  t.alphabet_size = uint32_t(freq.size());
  t.scale_bits = scale_bits;
  t.freq = std::move(freq);
  fill_cum(t);
  return t;
}

// Change in cost (bits) of giving symbol with count c one more slot / one
// fewer slot. Convex in f, which makes the greedy allocation optimal.
double gain_up(uint64_t c, uint32_t f) { return c == 0 ? 0.0 : double(c) * std::log2(double(f + 1) / double(f)); }
double loss_down(uint64_t c, uint32_t f) {
  if (f <= 1) return INFINITY;
  return c == 0 ? 0.0 : double(c) * std::log2(double(f) / double(f - 1));
}

// Serialised frequencies are floating point: exponent e = bit_width(f)
// (delta-coded against the previous symbol's, zigzag + gamma: neighbours in
// a quantized Gaussian have similar magnitudes) and the top p-1 bits below
// the leading one, p being the table's precision (the fewest significant
// bits that represent every stored frequency exactly). from_counts rounds
// frequencies to a low precision when that costs < precision_loss of rate,
// which roughly halves the table. Runs of frequency-1 symbols (flat tails)
// are gamma-coded run lengths.

unsigned significant_bits(uint32_t f) { return unsigned(std::bit_width(f)) - unsigned(std::countr_zero(f)); }

// f rounded to p significant bits (nearest; never below 1).
uint32_t round_to_precision(uint32_t f, unsigned p) {
  const unsigned e = unsigned(std::bit_width(f));
  if (e <= p) return f;
  const unsigned drop = e - p;
  const uint32_t r = ((f + (1u << (drop - 1))) >> drop) << drop;
  return std::max<uint32_t>(1, r);
}

uint32_t zigzag(int v) { return v >= 0 ? uint32_t(2 * v) : uint32_t(-2 * v - 1); }
int unzigzag(uint64_t z) { return (z & 1) ? -int((z + 1) / 2) : int(z / 2); }

unsigned index_bits(uint32_t alphabet) { return alphabet <= 1 ? 0 : unsigned(std::bit_width(alphabet - 1)); }

}  // namespace

uint32_t FrequencyTable::default_scale_bits(uint32_t alphabet_size) {
  const uint32_t need = alphabet_size <= 1 ? 0 : uint32_t(std::bit_width(alphabet_size - 1));
  return std::min<uint32_t>(kMaxScaleBits, std::max<uint32_t>(12, need + 2));
}

FrequencyTable FrequencyTable::from_freqs(std::vector<uint32_t> freq, uint32_t scale_bits) {
  if (freq.empty() || freq.size() > kMaxAlphabet)
    invalid("alphabet size " + std::to_string(freq.size()) + " not in [1, " + std::to_string(kMaxAlphabet) + "]");
  if (scale_bits < 1 || scale_bits > kMaxScaleBits)
    invalid("scale_bits = " + std::to_string(scale_bits) + ", allowed 1.." + std::to_string(kMaxScaleBits));
  uint64_t sum = 0;
  for (size_t s = 0; s < freq.size(); ++s) {
    if (freq[s] == 0) invalid("symbol " + std::to_string(s) + " has frequency 0 (every symbol needs >= 1)");
    sum += freq[s];
  }
  if (sum != (uint64_t(1) << scale_bits))
    invalid("frequencies sum to " + std::to_string(sum) + ", expected " + std::to_string(1u << scale_bits));
  return valid_table(std::move(freq), scale_bits);
}

FrequencyTable FrequencyTable::from_counts(const std::vector<uint64_t>& counts_in, uint32_t scale_bits,
                                           double precision_loss) {
  const size_t n = counts_in.size();
  if (n == 0 || n > kMaxAlphabet)
    invalid("alphabet size " + std::to_string(n) + " not in [1, " + std::to_string(kMaxAlphabet) + "]");
  if (scale_bits == 0) {
    // Adaptive: start at the default and add precision while the table loses
    // more than kMaxRateLoss against the empirical entropy of the counts
    // (many never-seen symbols each holding a forced slot is the usual cause).
    constexpr double kMaxRateLoss = 0.005;
    double ideal = 0, n_total = 0;
    for (uint64_t c : counts_in) n_total += double(c);
    for (uint64_t c : counts_in)
      if (c) ideal -= double(c) * std::log2(double(c) / n_total);
    uint32_t scale = default_scale_bits(uint32_t(n));
    for (;; ++scale) {
      FrequencyTable t = from_counts(counts_in, scale, precision_loss);
      if (scale >= kMaxScaleBits || t.cost_bits(counts_in) <= ideal * (1 + kMaxRateLoss) + 1e-9) return t;
    }
  }
  if (scale_bits > kMaxScaleBits || (uint64_t(1) << scale_bits) < n)
    invalid("scale_bits = " + std::to_string(scale_bits) + " cannot give each of " + std::to_string(n) +
            " symbols a slot (allowed ceil(log2 alphabet)..16)");
  const uint32_t total = 1u << scale_bits;

  std::vector<uint64_t> counts = counts_in;
  long double sum = 0;
  for (uint64_t c : counts) sum += (long double)c;
  if (sum == 0) {
    std::fill(counts.begin(), counts.end(), 1);
    sum = (long double)n;
  }

  // Start from the proportional share rounded down (at least 1), then move
  // single slots greedily; the cost is a sum of convex functions of each
  // frequency, so balancing with best marginal moves and then swapping until
  // no swap helps reaches the optimum.
  std::vector<uint32_t> f(n);
  int64_t assigned = 0;
  for (size_t s = 0; s < n; ++s) {
    const long double share = (long double)counts[s] * total / sum;
    f[s] = std::max<uint32_t>(1, uint32_t(std::min<long double>(share, total)));
    assigned += f[s];
  }
  using Item = std::pair<double, uint32_t>;
  if (assigned < total) {
    std::priority_queue<Item> heap;  // largest gain first
    for (size_t s = 0; s < n; ++s) heap.push({gain_up(counts[s], f[s]), uint32_t(s)});
    while (assigned < total) {
      auto [g, s] = heap.top();
      heap.pop();
      const double now = gain_up(counts[s], f[s]);
      if (now != g) {
        heap.push({now, s});
        continue;
      }
      ++f[s];
      ++assigned;
      heap.push({gain_up(counts[s], f[s]), s});
    }
  } else if (assigned > total) {
    std::priority_queue<Item, std::vector<Item>, std::greater<Item>> heap;  // smallest loss first
    for (size_t s = 0; s < n; ++s) heap.push({loss_down(counts[s], f[s]), uint32_t(s)});
    while (assigned > total) {
      auto [l, s] = heap.top();
      heap.pop();
      const double now = loss_down(counts[s], f[s]);
      if (now != l) {
        heap.push({now, s});
        continue;
      }
      --f[s];
      --assigned;
      heap.push({loss_down(counts[s], f[s]), s});
    }
  }
  // Swap phase: move a slot from the cheapest donor to the best receiver
  // while that strictly lowers the cost. Bounded for safety; it normally
  // stops after a handful of moves.
  for (size_t iter = 0; iter < 4 * n + 64; ++iter) {
    size_t up = 0, down = 0;
    double best_gain = -1, best_loss = INFINITY;
    for (size_t s = 0; s < n; ++s) {
      const double g = gain_up(counts[s], f[s]);
      if (g > best_gain) best_gain = g, up = s;
      const double l = loss_down(counts[s], f[s]);
      if (l < best_loss) best_loss = l, down = s;
    }
    if (up == down || !(best_gain > best_loss * (1 + 1e-12) + 1e-12)) break;
    ++f[up];
    --f[down];
  }
  FrequencyTable exact = from_freqs(std::move(f), scale_bits);
  // Lower the precision of all but the largest frequency (which absorbs the
  // rounding, being implied by the sum) while the rate stays within
  // precision_loss of the exact optimum.
  if (n < 3 || !(precision_loss > 0)) return exact;
  const double exact_cost = exact.cost_bits(counts);
  const uint32_t top = uint32_t(std::max_element(exact.freq.begin(), exact.freq.end()) - exact.freq.begin());
  for (unsigned p = 2; p < scale_bits; ++p) {
    std::vector<uint32_t> g = exact.freq;
    uint64_t others = 0;
    for (size_t s = 0; s < n; ++s)
      if (s != top) others += (g[s] = round_to_precision(g[s], p));
    if (others >= total) continue;
    g[top] = uint32_t(total - others);
    FrequencyTable t = from_freqs(std::move(g), scale_bits);
    if (t.cost_bits(counts) <= exact_cost * (1 + precision_loss) + 1e-9) return t;
  }
  return exact;
}

void FrequencyTable::serialize(BitWriter& out) const {
  out.put_gamma(alphabet_size);
  out.put(scale_bits - 1, 4);
  if (alphabet_size == 1) return;
  const uint32_t top = uint32_t(std::max_element(freq.begin(), freq.end()) - freq.begin());
  out.put(top, index_bits(alphabet_size));
  unsigned precision = 1;
  for (uint32_t s = 0; s < alphabet_size; ++s)
    if (s != top) precision = std::max(precision, significant_bits(freq[s]));
  out.put(precision - 1, 4);  // freq < 2^16 for every non-top symbol, so p <= 16
  int prev_e = 1;
  for (uint32_t s = 0; s < alphabet_size; ++s) {
    if (s == top) continue;
    const int e = int(std::bit_width(freq[s]));
    out.put_gamma(uint64_t(zigzag(e - prev_e)) + 1);
    prev_e = e;
    const unsigned m = std::min<unsigned>(unsigned(e) - 1, precision - 1);
    out.put((freq[s] >> (unsigned(e) - 1 - m)) & ((1u << m) - 1), m);
    if (e == 1) {
      // Run of further frequency-1 symbols (the top symbol is not counted).
      uint32_t run = 0;
      for (uint32_t t = s + 1; t < alphabet_size && (t == top || freq[t] == 1); ++t)
        if (t != top) ++run;
      out.put_gamma(uint64_t(run) + 1);
      for (uint32_t skipped = 0; skipped < run;)
        if (++s != top) ++skipped;
    }
  }
}

size_t FrequencyTable::serialized_bits() const {
  BitWriter w;
  serialize(w);
  return w.bit_count();
}

FrequencyTable FrequencyTable::deserialize(BitReader& in, uint32_t max_alphabet) {
  FrequencyTable t;
  deserialize_into(in, max_alphabet, t);
  return t;
}

void FrequencyTable::deserialize_into(BitReader& in, uint32_t max_alphabet, FrequencyTable& out) {
  const uint64_t alphabet = in.get_gamma(17);
  const uint64_t limit = std::min<uint64_t>(max_alphabet, kMaxAlphabet);
  if (alphabet > limit)
    bad_format("alphabet size " + std::to_string(alphabet) + " exceeds the limit " + std::to_string(limit));
  const uint32_t scale = in.get(4) + 1;
  const uint64_t total = uint64_t(1) << scale;
  if (alphabet > total)
    bad_format("alphabet size " + std::to_string(alphabet) + " exceeds 2^scale_bits = " + std::to_string(total));
  const uint32_t a = uint32_t(alphabet);
  // Valid as parsed (every other frequency >= 1, theirs summing below the
  // total: top's >= 1; scale 1..16, alphabet 1..limit): from_freqs' checks
  // would only repeat them, on every kvtc head opening.
  const auto finish = [&] {
    out.alphabet_size = a;
    out.scale_bits = scale;
    fill_cum(out);
  };
  std::vector<uint32_t>& f = out.freq;
  f.assign(a, 0);
  if (a == 1) {
    f[0] = uint32_t(total);
    return finish();
  }
  const uint32_t top = in.get(index_bits(a));
  if (top >= a) bad_format("largest-symbol index " + std::to_string(top) + " >= alphabet size " + std::to_string(a));
  const unsigned precision = in.get(4) + 1;
  uint64_t sum = 0;
  // Slots left for the implied 'top' must stay >= 1 after each symbol.
  auto add = [&](uint32_t s, uint64_t v) {
    sum += v;
    if (sum >= total) [[unlikely]] bad_sum(total, s);
    f[s] = uint32_t(v);
  };
  int prev_e = 1;
  for (uint32_t s = 0; s < a; ++s) {
    if (s == top) continue;
    const int e = prev_e + unzigzag(in.get_gamma(6) - 1);
    if (e < 1 || e > int(scale)) [[unlikely]] bad_exponent(s, e, scale);
    prev_e = e;
    const unsigned m = std::min<unsigned>(unsigned(e) - 1, precision - 1);
    const uint32_t mant = in.get(m);
    add(s, ((uint64_t(1) << m) | mant) << (unsigned(e) - 1 - m));
    if (e == 1) {
      const uint64_t run = in.get_gamma(17) - 1;
      for (uint64_t done = 0; done < run;) {
        if (++s >= a) [[unlikely]] bad_run();
        if (s == top) continue;
        add(s, 1);
        ++done;
      }
    }
  }
  f[top] = uint32_t(total - sum);
  finish();
}

double FrequencyTable::cost_bits(const std::vector<uint64_t>& counts) const {
  if (counts.size() > alphabet_size)
    invalid("cost_bits: " + std::to_string(counts.size()) + " counts for an alphabet of " + std::to_string(alphabet_size));
  double bits = 0;
  for (size_t s = 0; s < counts.size(); ++s)
    if (counts[s]) bits += double(counts[s]) * (double(scale_bits) - std::log2(double(freq[s])));
  return bits;
}

}  // namespace kvcodec::entropy

namespace kvcodec::entropy {

uint64_t FrequencyTable::held_bytes() const {
  return uint64_t(freq.capacity() + cum.capacity()) * sizeof(uint32_t);
}

}  // namespace kvcodec::entropy

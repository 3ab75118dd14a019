// Exact bit allocation by dynamic programming; equal-step allocation.
// See allocator.hpp for contracts and docs/allocation.md for the reasoning.
#include "alloc/allocator.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numbers>
#include <string>

#include "kvcodec/error.hpp"

namespace kvcodec::alloc {
namespace {

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, what);
}

// --- exact sums ------------------------------------------------------------
//
// A non-negative 256-bit fixed-point number: value = sum w[i] * 2^(64 i + e_low).
// Each per-component distortion (a double) is converted once; sums of these
// integers are exact and associative, so the DP and the brute force compare
// the very same numbers whatever the order of additions. e_low is chosen from
// the largest term so the largest possible total fits; terms more than ~2^190
// times smaller than the largest are truncated toward zero (identically in
// every candidate), far beyond the 1e-12..1e12 variance range we promise.
struct Exact {
  std::array<uint64_t, 4> w{};  // w[3] is the most significant word
};

inline Exact add(const Exact& a, const Exact& b) {
  Exact r;
  unsigned __int128 carry = 0;
  for (int i = 0; i < 4; ++i) {
    carry += static_cast<unsigned __int128>(a.w[i]) + b.w[i];
    r.w[i] = static_cast<uint64_t>(carry);
    carry >>= 64;
  }
  return r;
}

inline int compare(const Exact& a, const Exact& b) {
  for (int i = 3; i >= 0; --i) {
    if (a.w[i] != b.w[i]) return a.w[i] < b.w[i] ? -1 : 1;
  }
  return 0;
}

Exact to_exact(double t, int e_low) {
  Exact r;
  if (t <= 0.0) return r;
  int e = 0;
  const double f = std::frexp(t, &e);  // t = f * 2^e, f in [0.5, 1)
  uint64_t m = static_cast<uint64_t>(std::ldexp(f, 53));  // exact 53-bit integer
  int p = e - 53 - e_low;  // bit position of m's least significant bit
  if (p < 0) {
    if (-p >= 64) return r;
    m >>= -p;
    p = 0;
  }
  const int word = p / 64, off = p % 64;
  if (word < 4) r.w[word] |= m << off;
  if (off > 0 && word + 1 < 4) r.w[word + 1] |= m >> (64 - off);
  return r;
}

// Largest DP table (one byte per cell) we agree to build.
constexpr int64_t kMaxCells = int64_t{1} << 27;

// --- the DP problem, shared by the model and measured allocators -----------

struct Problem {
  int n = 0;
  int nc = 0;
  std::vector<int> values;     // bit widths, strictly ascending, [nc]
  std::vector<double> dist;    // [n * nc], as doubles (for reporting)
  std::vector<Exact> term;     // [n * nc], exact
  std::vector<int64_t> cost;   // [n * nc], integer budget units
  std::vector<double> rate;    // [n * nc], rate reported for each choice
  int64_t budget = 0;          // in cost units
};

void make_exact_terms(Problem& p) {
  double max_term = 0.0;
  for (double d : p.dist) max_term = std::max(max_term, d);
  int e_low = 0;
  if (max_term > 0.0) {
    int e = 0;
    std::frexp(max_term, &e);  // every term < 2^e
    int log2n = 0;
    while ((int64_t{1} << log2n) < p.n) ++log2n;
    // A total of n terms is < 2^(e + log2n): keep that many bits above e_low.
    e_low = e + log2n - 255;
  }
  p.term.resize(p.dist.size());
  for (size_t i = 0; i < p.dist.size(); ++i) p.term[i] = to_exact(p.dist[i], e_low);
}

// The DP's choice table over budgets 0..B (B = min(budget, max_useful)):
// choice[i * width + b] is the best choice of component i for the suffix
// i..n-1 given at most b units; row0_ok[b] whether any allocation of the
// whole fits in b. Row i at budget b depends only on row i+1 at budgets
// <= b, never on the table's width, so one table answers every budget up to
// B with the allocation a table built for that budget alone would give.
struct DpTable {
  int64_t width = 0;            // B + 1
  int64_t min_needed = 0;       // the cheapest allocation's units
  std::vector<uint8_t> choice;  // [n * width]
  std::vector<uint8_t> row0_ok; // [width]
};

DpTable solve_dp_table(const Problem& p) {
  int64_t max_useful = 0;
  int64_t min_needed = 0;
  for (int i = 0; i < p.n; ++i) {
    int64_t hi = 0, lo = std::numeric_limits<int64_t>::max();
    for (int j = 0; j < p.nc; ++j) {
      hi = std::max(hi, p.cost[i * p.nc + j]);
      lo = std::min(lo, p.cost[i * p.nc + j]);
    }
    max_useful += hi;
    min_needed += lo;
  }
  if (min_needed > p.budget) {
    invalid("bit allocation: budget of " + std::to_string(p.budget) +
            " units is below the cheapest allocation (" + std::to_string(min_needed) + " units)");
  }
  // A budget beyond what every component at its widest needs changes nothing.
  const int64_t B = std::min(p.budget, max_useful);
  const int64_t width = B + 1;
  if (width > kMaxCells / std::max(p.n, 1)) {
    invalid("bit allocation: DP table of " + std::to_string(p.n) + " components x " +
            std::to_string(width) + " budget states exceeds 2^27 cells; lower the budget or the rate grid");
  }
  DpTable t;
  t.width = width;
  t.min_needed = min_needed;
  t.choice.assign(static_cast<size_t>(p.n) * width, 0);
  // Rows for the suffix i+1..n-1 (next) and i..n-1 (cur): best exact
  // distortion and its cost using at most b units.
  std::vector<Exact> next_d(width), cur_d(width);
  std::vector<int64_t> next_c(width, 0), cur_c(width, 0);
  std::vector<uint8_t> next_ok(width, 1), cur_ok(width, 0);
  for (int i = p.n - 1; i >= 0; --i) {
    const Exact* term = p.term.data() + static_cast<size_t>(i) * p.nc;
    const int64_t* cost = p.cost.data() + static_cast<size_t>(i) * p.nc;
    uint8_t* ch = t.choice.data() + static_cast<size_t>(i) * width;
    for (int64_t b = 0; b < width; ++b) {
      bool found = false;
      Exact best_d;
      int64_t best_c = 0;
      int best_j = 0;
      // j ascends, so bit widths ascend: on a full tie the later j wins.
      for (int j = 0; j < p.nc; ++j) {
        const int64_t c = cost[j];
        if (c > b) continue;
        const int64_t s = b - c;
        if (!next_ok[s]) continue;
        const Exact d = add(term[j], next_d[s]);
        const int64_t total = c + next_c[s];
        bool better = !found;
        if (found) {
          const int cmp = compare(d, best_d);
          better = cmp < 0 || (cmp == 0 && total <= best_c);
        }
        if (better) {
          found = true;
          best_d = d;
          best_c = total;
          best_j = j;
        }
      }
      cur_ok[b] = found;
      cur_d[b] = best_d;
      cur_c[b] = best_c;
      ch[b] = static_cast<uint8_t>(best_j);
    }
    std::swap(next_d, cur_d);
    std::swap(next_c, cur_c);
    std::swap(next_ok, cur_ok);
  }
  t.row0_ok = std::move(next_ok);
  return t;
}

// The choice index per component for a budget of `budget` units (<= the
// table's budget; clamped to its width as solve_dp_table clamps).
std::vector<int> backtrack(const Problem& p, const DpTable& t, int64_t budget) {
  if (t.min_needed > budget) {
    invalid("bit allocation: budget of " + std::to_string(budget) +
            " units is below the cheapest allocation (" + std::to_string(t.min_needed) + " units)");
  }
  int64_t b = std::min(budget, t.width - 1);
  if (!t.row0_ok[static_cast<size_t>(b)])
    throw Error(ErrorCode::kInternal, "bit allocation: DP found no feasible allocation");
  std::vector<int> idx(p.n);
  for (int i = 0; i < p.n; ++i) {
    const int j = t.choice[static_cast<size_t>(i) * t.width + b];
    idx[i] = j;
    b -= p.cost[static_cast<size_t>(i) * p.nc + j];
  }
  return idx;
}

// Returns the choice index per component. Tie rule: smaller exact
// distortion, then smaller cost, then larger bit width for the earliest
// component where candidates differ.
std::vector<int> solve_dp(const Problem& p) { return backtrack(p, solve_dp_table(p), p.budget); }

std::vector<int> solve_brute_force(const Problem& p) {
  double combos = std::pow(static_cast<double>(p.nc), p.n);
  if (combos > static_cast<double>(1 << 24)) {
    invalid("brute-force allocation: " + std::to_string(p.nc) + "^" + std::to_string(p.n) +
            " assignments is too many (limit 2^24)");
  }
  std::vector<int> idx(p.n, 0), best;
  Exact best_d;
  int64_t best_c = 0;
  while (true) {
    int64_t c = 0;
    Exact d;
    for (int i = 0; i < p.n; ++i) {
      c += p.cost[static_cast<size_t>(i) * p.nc + idx[i]];
      d = add(d, p.term[static_cast<size_t>(i) * p.nc + idx[i]]);
    }
    if (c <= p.budget) {
      bool better = best.empty();
      if (!better) {
        const int cmp = compare(d, best_d);
        if (cmp != 0) {
          better = cmp < 0;
        } else if (c != best_c) {
          better = c < best_c;
        } else {
          // Lexicographically larger widths (indices ascend with widths).
          better = std::lexicographical_compare(best.begin(), best.end(), idx.begin(), idx.end());
        }
      }
      if (better) {
        best = idx;
        best_d = d;
        best_c = c;
      }
    }
    int i = p.n - 1;
    while (i >= 0 && ++idx[i] == p.nc) idx[i--] = 0;
    if (i < 0) break;
  }
  if (best.empty()) {
    invalid("bit allocation: budget of " + std::to_string(p.budget) +
            " units is below the cheapest allocation");
  }
  return best;
}

AllocationResult make_result(const Problem& p, const std::vector<int>& idx) {
  AllocationResult r;
  r.bits.resize(p.n);
  for (int i = 0; i < p.n; ++i) {
    const size_t k = static_cast<size_t>(i) * p.nc + idx[i];
    r.bits[i] = p.values[idx[i]];
    r.distortion += p.dist[k];
    r.total_bits += r.bits[i];
    r.rate += p.rate[k];
  }
  return r;
}

// Validates choices; returns the permutation that sorts them ascending.
std::vector<int> sorted_choice_order(const std::vector<int>& choices) {
  if (choices.empty()) invalid("bit_choices is empty; it must hold 0 and at least one width");
  if (choices.size() > 64) invalid("bit_choices has " + std::to_string(choices.size()) + " entries, at most 64");
  bool has_zero = false;
  for (int c : choices) {
    if (c < 0 || c > 16) {
      invalid("bit_choices holds " + std::to_string(c) + ": widths must be in [0, 16]");
    }
    has_zero |= c == 0;
  }
  if (!has_zero) invalid("bit_choices must contain 0 (dropping a component)");
  std::vector<int> order(choices.size());
  for (size_t j = 0; j < order.size(); ++j) order[j] = static_cast<int>(j);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return choices[a] < choices[b]; });
  for (size_t j = 1; j < order.size(); ++j) {
    if (choices[order[j]] == choices[order[j - 1]]) {
      invalid("bit_choices holds " + std::to_string(choices[order[j]]) + " twice");
    }
  }
  return order;
}

Problem model_problem(const std::vector<double>& variances, int budget_bits,
                      const std::vector<int>& bit_choices, double beta) {
  if (variances.empty()) invalid("bit allocation: no components (variances is empty)");
  for (size_t i = 0; i < variances.size(); ++i) {
    if (!std::isfinite(variances[i]) || variances[i] < 0.0) {
      invalid("bit allocation: variances[" + std::to_string(i) + "] = " +
              std::to_string(variances[i]) + ", must be finite and >= 0");
    }
  }
  if (budget_bits < 0) invalid("bit allocation: budget_bits = " + std::to_string(budget_bits) + ", must be >= 0");
  if (!std::isfinite(beta) || beta <= 0.0) {
    invalid("bit allocation: beta = " + std::to_string(beta) + ", must be finite and > 0");
  }
  if (variances.size() > static_cast<size_t>(std::numeric_limits<int>::max() / 64)) {
    invalid("bit allocation: too many components");
  }
  const std::vector<int> order = sorted_choice_order(bit_choices);
  // Refuse an oversized DP before sizing anything by it.
  const int64_t useful = std::min<int64_t>(budget_bits, static_cast<int64_t>(variances.size()) *
                                                            bit_choices[order.back()]);
  if (static_cast<int64_t>(variances.size()) > kMaxCells / (useful + 1)) {
    invalid("bit allocation: DP table of " + std::to_string(variances.size()) + " components x " +
            std::to_string(useful + 1) + " budget states exceeds 2^27 cells; lower the budget");
  }
  Problem p;
  p.n = static_cast<int>(variances.size());
  p.nc = static_cast<int>(order.size());
  for (int j : order) p.values.push_back(bit_choices[j]);
  p.dist.resize(static_cast<size_t>(p.n) * p.nc);
  p.cost.resize(p.dist.size());
  p.rate.resize(p.dist.size());
  for (int i = 0; i < p.n; ++i) {
    for (int j = 0; j < p.nc; ++j) {
      const size_t k = static_cast<size_t>(i) * p.nc + j;
      const int b = p.values[j];
      p.dist[k] = b == 0 ? variances[i] : variances[i] * std::pow(beta, -static_cast<double>(b));
      p.cost[k] = b;
      p.rate[k] = b;
    }
  }
  p.budget = budget_bits;
  make_exact_terms(p);
  return p;
}

Problem measured_problem(const std::vector<std::vector<double>>& rate_bits,
                         const std::vector<std::vector<double>>& distortion,
                         const std::vector<int>& bit_choices, double budget_bits, int rate_grid) {
  if (rate_bits.empty()) invalid("measured allocation: no components (rate_bits is empty)");
  if (distortion.size() != rate_bits.size()) {
    invalid("measured allocation: rate_bits has " + std::to_string(rate_bits.size()) +
            " components but distortion has " + std::to_string(distortion.size()));
  }
  if (rate_grid < 1 || rate_grid > 1024) {
    invalid("measured allocation: rate_grid = " + std::to_string(rate_grid) + ", must be in [1, 1024]");
  }
  if (!std::isfinite(budget_bits) || budget_bits < 0.0 || budget_bits > 1e7) {
    invalid("measured allocation: budget_bits = " + std::to_string(budget_bits) +
            ", must be finite and in [0, 1e7]");
  }
  const std::vector<int> order = sorted_choice_order(bit_choices);
  Problem p;
  p.n = static_cast<int>(rate_bits.size());
  p.nc = static_cast<int>(order.size());
  for (int j : order) p.values.push_back(bit_choices[j]);
  p.dist.resize(static_cast<size_t>(p.n) * p.nc);
  p.cost.resize(p.dist.size());
  p.rate.resize(p.dist.size());
  for (int i = 0; i < p.n; ++i) {
    if (rate_bits[i].size() != bit_choices.size() || distortion[i].size() != bit_choices.size()) {
      invalid("measured allocation: component " + std::to_string(i) + " has " +
              std::to_string(rate_bits[i].size()) + " rates and " +
              std::to_string(distortion[i].size()) + " distortions, expected " +
              std::to_string(bit_choices.size()) + " (one per bit choice)");
    }
    for (int j = 0; j < p.nc; ++j) {
      const double r = rate_bits[i][order[j]];
      const double d = distortion[i][order[j]];
      if (!std::isfinite(r) || r < 0.0 || r > 1e6) {
        invalid("measured allocation: rate_bits[" + std::to_string(i) + "][" + std::to_string(order[j]) +
                "] = " + std::to_string(r) + ", must be finite and in [0, 1e6]");
      }
      if (!std::isfinite(d) || d < 0.0) {
        invalid("measured allocation: distortion[" + std::to_string(i) + "][" +
                std::to_string(order[j]) + "] = " + std::to_string(d) + ", must be finite and >= 0");
      }
      const size_t k = static_cast<size_t>(i) * p.nc + j;
      p.dist[k] = d;
      p.rate[k] = r;
      // Round rates up, the budget down: the measured total stays within budget.
      p.cost[k] = static_cast<int64_t>(std::ceil(r * rate_grid));
    }
  }
  p.budget = static_cast<int64_t>(std::floor(budget_bits * rate_grid));
  make_exact_terms(p);
  return p;
}

}  // namespace

AllocationResult allocate_bits_dp(const std::vector<double>& variances, int budget_bits,
                                  const std::vector<int>& bit_choices, double beta) {
  const Problem p = model_problem(variances, budget_bits, bit_choices, beta);
  return make_result(p, solve_dp(p));
}

AllocationResult allocate_bits_brute_force(const std::vector<double>& variances, int budget_bits,
                                           const std::vector<int>& bit_choices, double beta) {
  const Problem p = model_problem(variances, budget_bits, bit_choices, beta);
  return make_result(p, solve_brute_force(p));
}

AllocationResult allocate_bits_measured(const std::vector<std::vector<double>>& rate_bits,
                                        const std::vector<std::vector<double>>& distortion,
                                        const std::vector<int>& bit_choices, double budget_bits,
                                        int rate_grid) {
  const Problem p = measured_problem(rate_bits, distortion, bit_choices, budget_bits, rate_grid);
  return make_result(p, solve_dp(p));
}

MeasuredAllocator::MeasuredAllocator(const std::vector<std::vector<double>>& rate_bits,
                                     const std::vector<std::vector<double>>& distortion,
                                     const std::vector<int>& bit_choices, double max_budget_bits, int rate_grid) {
  // The problem and its table live in the closure (their types are this
  // file's own).
  auto problem = std::make_shared<const Problem>(
      measured_problem(rate_bits, distortion, bit_choices, max_budget_bits, rate_grid));
  auto table = std::make_shared<const DpTable>(solve_dp_table(*problem));
  at_ = [problem, table, rate_grid, max_budget_bits](double budget_bits) {
    // Compared on the grid, as the budget is used: a budget that rounds to
    // the table's own units is inside it.
    const double units = std::floor(budget_bits * rate_grid);
    if (!std::isfinite(budget_bits) || budget_bits < 0.0 || units > double(problem->budget)) {
      invalid("measured allocation: budget_bits = " + std::to_string(budget_bits) + ", must be in [0, " +
              std::to_string(max_budget_bits) + "] (the allocator's largest budget)");
    }
    return make_result(*problem, backtrack(*problem, *table, static_cast<int64_t>(units)));
  };
}

AllocationResult MeasuredAllocator::at(double budget_bits) const { return at_(budget_bits); }

AllocationResult allocate_bits_measured_brute_force(const std::vector<std::vector<double>>& rate_bits,
                                                    const std::vector<std::vector<double>>& distortion,
                                                    const std::vector<int>& bit_choices,
                                                    double budget_bits, int rate_grid) {
  const Problem p = measured_problem(rate_bits, distortion, bit_choices, budget_bits, rate_grid);
  return make_result(p, solve_brute_force(p));
}

double gaussian_entropy_bits(double variance) {
  if (variance <= 0.0) return -std::numeric_limits<double>::infinity();
  return 0.5 * std::log2(2.0 * std::numbers::pi * std::numbers::e * variance);
}

StepAllocation allocate_equal_step(const std::vector<double>& variances, double budget_bits,
                                   const RateModel& rate) {
  if (variances.empty()) invalid("equal-step allocation: no components (variances is empty)");
  double max_v = 0.0;
  for (size_t i = 0; i < variances.size(); ++i) {
    if (!std::isfinite(variances[i]) || variances[i] < 0.0) {
      invalid("equal-step allocation: variances[" + std::to_string(i) + "] = " +
              std::to_string(variances[i]) + ", must be finite and >= 0");
    }
    max_v = std::max(max_v, variances[i]);
  }
  if (!std::isfinite(budget_bits) || budget_bits < 0.0) {
    invalid("equal-step allocation: budget_bits = " + std::to_string(budget_bits) +
            ", must be finite and >= 0");
  }
  const int n = static_cast<int>(variances.size());
  std::vector<double> h(n);
  for (int i = 0; i < n; ++i) h[i] = gaussian_entropy_bits(variances[i]);
  auto component_rate = [&](int i, double step) {
    double r;
    if (rate) {
      r = rate(i, step);
      if (!std::isfinite(r) || r < 0.0) {
        invalid("equal-step allocation: rate model returned " + std::to_string(r) + " for component " +
                std::to_string(i) + " at step " + std::to_string(step) + "; must be finite and >= 0");
      }
    } else {
      r = std::max(0.0, h[i] - std::log2(step));
    }
    return r;
  };
  auto total_rate = [&](double step) {
    double t = 0.0;
    for (int i = 0; i < n; ++i) t += component_rate(i, step);
    return t;
  };
  auto finish = [&](double step) {
    StepAllocation a;
    a.step = step;
    a.keep.resize(n);
    for (int i = 0; i < n; ++i) {
      const double r = component_rate(i, step);
      a.keep[i] = r > 0.0;
      a.predicted_bits += r;
      a.predicted_mse += a.keep[i] ? std::min(variances[i], step * step / 12.0) : variances[i];
    }
    return a;
  };
  // Bracket in log2(step): hi meets the budget, lo exceeds it. Start where
  // the default model spends nothing (step > sqrt(2 pi e v) for every v).
  double hi = max_v > 0.0 ? 8.0 * std::sqrt(max_v) : 1.0;
  for (int t = 0; total_rate(hi) > budget_bits; ++t) {
    if (t == 200) invalid("equal-step allocation: the rate model exceeds the budget at every step tried");
    hi *= 2.0;
  }
  double lo = hi;
  for (int t = 0;; ++t) {
    if (t == 400) return finish(lo);  // any step meets this budget: the finest tried
    const double next = lo * 0.5;
    if (total_rate(next) > budget_bits) {
      lo = next;
      break;
    }
    hi = next;
    lo = next;
  }
  for (int it = 0; it < 100; ++it) {
    const double mid = std::sqrt(lo * hi);  // geometric: bisection on log2(step)
    if (mid <= lo || mid >= hi) break;
    if (total_rate(mid) <= budget_bits) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return finish(hi);
}

}  // namespace kvcodec::alloc

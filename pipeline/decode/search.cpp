// The policy's search over a round's candidates (see search.py): `Policy.best` for more than
// one row, as `policy._Candidates` weighs them in numpy (the reference, and the path where this
// cannot be built). Every candidate, every row, every sum and product in the same order and by
// the same float operations (no contraction into fused multiply-adds), so the choice is the
// same bit for bit (tests compare on random rounds).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

namespace {

constexpr double INF = std::numeric_limits<double>::infinity();

typedef double (*PassSeconds)(int64_t key);

// A round's copies, laid out by `policy._Copies`: per row and offer column, the drafts
// offered up to gamma_cap, the expected tokens of the first k, the survival, how many of
// its chances are known, and whether the column holds an offer at all.
struct Copies {
    int64_t rows, width, depth;  // depth: gamma_cap + 1
    const int64_t* tokens;
    const double* expected;
    const double* survivals;
    const int64_t* survival_lengths;
    const uint8_t* held;

    int64_t at(int64_t r, int64_t c) const { return r * width + c; }
    double expected_of(int64_t r, int64_t c, int64_t k) const { return expected[at(r, c) * depth + k]; }
    double survival_of(int64_t r, int64_t c, int64_t k) const { return survivals[at(r, c) * depth + k]; }
};

// `_Candidates._drain_advance` for one candidate: the chance that every row gets within k of
// its limit, a product in row order, summed over k in order up to the first k some row
// cannot reach.
double drain_advance(const Copies& copies, const std::vector<int64_t>& chosen, const std::vector<int64_t>& lengths,
                     int64_t gamma, const int64_t* leads, const double* from_model, int64_t depth) {
    const int64_t rows = copies.rows;
    std::vector<int64_t> offer(rows), known(rows);
    for (int64_t r = 0; r < rows; ++r) {
        offer[r] = std::clamp<int64_t>(chosen[r] - 2, 0, copies.width - 1);
        known[r] = chosen[r] == 1   ? gamma + 1
                   : chosen[r] >= 2 ? std::min(lengths[r], copies.survival_lengths[copies.at(r, offer[r])])
                                    : 1;
    }
    double total = 0.0;
    bool reached = true;
    for (int64_t k = 1; k <= depth + 1; ++k) {
        double p = 1.0;
        bool beyond_any = false;
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t need = k - leads[r];
            const bool counted = need > 1;
            const int64_t at = std::clamp<int64_t>(need - 1, 0, depth - 1);
            const double chance = chosen[r] == 1   ? from_model[at]
                                  : chosen[r] >= 2 ? copies.survival_of(r, offer[r], at)
                                                   : 1.0;
            const bool beyond = counted && need > known[r];
            beyond_any = beyond_any || beyond;
            const double factor = counted && !beyond ? chance : 1.0;
            p = r == 0 ? factor : p * factor;
        }
        reached = reached && !beyond_any;
        const double term = reached ? p : 0.0;
        total = k == 1 ? term : total + term;
    }
    return total;
}

}  // namespace

extern "C" {

// `policy._Copies`' arrays from its places, as its numpy lays them out (the reference): every
// cell written, so the caller's arrays need no filling. `places`: each offer's row, column,
// group and drafts; `chances`: each group's survival, `depth` a group, `known` of them read
// (ones past them). A group's sums run in order, as numpy's cumsum adds.
void lay_out(int64_t rows, int64_t width, int64_t depth, int64_t count, const int64_t* places, int64_t groups,
             const double* chances, const int64_t* known, int64_t* tokens, double* expected, double* survivals,
             int64_t* survival_lengths, uint8_t* held) {
    std::fill(tokens, tokens + rows * width, 0);
    std::fill(expected, expected + rows * width * depth, 1.0);
    std::fill(survivals, survivals + rows * width * depth, 1.0);
    std::fill(survival_lengths, survival_lengths + rows * width, 1);
    std::fill(held, held + rows * width, 0);
    std::vector<double> sums(groups * depth);
    for (int64_t g = 0; g < groups; ++g) {
        for (int64_t k = 0; k < depth; ++k) {
            const double c = chances[g * depth + k];
            sums[g * depth + k] = k == 0 ? c : sums[g * depth + k - 1] + c;
        }
    }
    for (int64_t p = 0; p < count; ++p) {
        const int64_t* place = places + 4 * p;
        const int64_t cell = place[0] * width + place[1], g = place[2], drafts = place[3];
        const int64_t most = known[g], reads = std::min(drafts + 1, most);
        for (int64_t k = 0; k < depth; ++k) {
            expected[cell * depth + k] = sums[g * depth + std::min(k, reads - 1)];
            survivals[cell * depth + k] = k < reads ? chances[g * depth + std::min(k, most - 1)] : 1.0;
        }
        tokens[cell] = drafts;
        survival_lengths[cell] = reads;
        held[cell] = 1;
    }
}

// `Policy.best` for `copies.rows` > 1 rows: the candidates (cap, gamma), caps 0..caps-1 each
// with gammas 0..gammas-1, tried in that order; one replaces the best so far only where its
// rate beats `best_rate` by the margin. Returns 1 and writes the best's cap, gamma and each
// row's choice (0 plain, 1 the draft model, 2 + c its copy in column c) where one does, else 0.
// `seconds(key)`: a target pass's seconds by its packed tokens where `pack`, else by its widest
// row (the caller prices it as the runner counts it: rows x the widest, or a static runner's
// every slot at its graph's width).
int64_t best_candidate(int64_t rows, int64_t width, int64_t depth, const int64_t* tokens, const double* expected,
                       const double* survivals, const int64_t* survival_lengths, const uint8_t* held, int64_t caps,
                       int64_t gammas, const double* model_sums, const double* from_model, int64_t from_depth,
                       int64_t draining, double to_limit, const int64_t* leads, double draft_time, double catch_up,
                       int64_t remaining, double best_rate, double per_token, int64_t pack, PassSeconds seconds,
                       int64_t* out_chosen, int64_t* out_cap_gamma, double* out_rate) {
    const Copies copies{rows, width, depth, tokens, expected, survivals, survival_lengths, held};
    std::unordered_map<int64_t, double> known;  // a pass's seconds by its key
    std::vector<double> weight(rows), row_tokens(rows);
    std::vector<int64_t> chosen(rows), lengths(rows);
    bool found = false;
    double price = best_rate * per_token;
    // The bar a drain's bound was held to: the one when the candidates were last weighed at
    // this price (`_Candidates.first_better` weighs again only where the price moved).
    double weighed_bar = best_rate * 1.0001;
    const double spare = 1.0 - to_limit;
    const double limit_rows = to_limit * static_cast<double>(rows);
    for (int64_t n = 0; n < caps * gammas; ++n) {
        const int64_t cap = n / gammas, gamma = n % gammas;
        const double bar = best_rate * 1.0001;
        if (draining) {
            const int64_t reach = std::max(cap, gamma);
            int64_t near = 0;
            for (int64_t r = 0; r < rows; ++r) near += leads[r] < reach;
            near = std::max<int64_t>(near, 1);
            const double share = limit_rows / static_cast<double>(near);
            for (int64_t r = 0; r < rows; ++r) weight[r] = spare + (leads[r] < reach ? share : 0.0);
        } else {
            std::fill(weight.begin(), weight.end(), 1.0);
        }
        const double model_tokens = model_sums[gamma];
        bool by_model_any = false;
        double total = 0.0, furthest = INF;
        int64_t widest = 0, packed = 0;
        for (int64_t r = 0; r < rows; ++r) {
            const double w = weight[r];
            // the row's copies truncated at the cap: the first worth most
            double copy_value = -INF, copy_tokens = 0.0;
            int64_t column = -1, copy_drafts = 0;
            for (int64_t c = 0; c < width; ++c) {
                const int64_t d = std::min(copies.tokens[copies.at(r, c)], cap);
                const double e = copies.expected_of(r, c, d);
                const bool copyable = copies.held[copies.at(r, c)] && cap > 0;
                const double value = copyable ? w * e - price * static_cast<double>(d) : -INF;
                if (column < 0 || value > copy_value) {
                    column = c, copy_value = value, copy_drafts = d, copy_tokens = e;
                }
            }
            const double model_value =
                gamma == 0 ? -INF : w * model_tokens - price * static_cast<double>(gamma);
            const bool picked = copy_value > std::max(w, model_value);
            const bool by_model = model_value > w && !picked;
            by_model_any = by_model_any || by_model;
            chosen[r] = picked ? 2 + column : by_model ? 1 : 0;
            const int64_t drafts = by_model ? gamma : picked ? copy_drafts : 0;
            row_tokens[r] = by_model ? model_tokens : picked ? copy_tokens : 1.0;
            total = r == 0 ? row_tokens[r] : total + row_tokens[r];
            lengths[r] = drafts + 1;
            widest = std::max(widest, lengths[r]);
            packed += lengths[r];
            if (leads[r] == 0) furthest = std::min(furthest, row_tokens[r]);
        }
        if (gamma != 0 && !by_model_any) continue;  // the draft model would run for nobody
        const int64_t key = pack ? packed : widest;
        auto it = known.find(key);
        const double pass = it != known.end() ? it->second : (known[key] = seconds(key));
        double round_seconds = static_cast<double>(gamma) * draft_time + pass;
        if (gamma > 0) {
            const double share = total / static_cast<double>(std::max<int64_t>(remaining, 1));
            round_seconds = round_seconds + catch_up * std::min(share, 1.0);
        }
        double rate;
        if (draining) {
            const double bound = (spare * total + limit_rows * furthest) / round_seconds;
            if (!(bound > weighed_bar)) continue;
            const double advance = drain_advance(copies, chosen, lengths, gamma, leads, from_model, from_depth);
            rate = (spare * total + limit_rows * advance) / round_seconds;
        } else {
            rate = total / round_seconds;
        }
        if (!(rate > bar)) continue;
        found = true;
        best_rate = rate;
        std::copy(chosen.begin(), chosen.end(), out_chosen);
        out_cap_gamma[0] = cap, out_cap_gamma[1] = gamma;
        *out_rate = rate;
        const double moved = best_rate * per_token;
        if (moved != price) {  // weighed again from the next candidate on, at the new price and bar
            price = moved;
            weighed_bar = best_rate * 1.0001;
        }
    }
    return found;
}

}  // extern "C"

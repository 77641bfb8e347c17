// The copying drafters' per-round work (see lookups.py): the suffix drafter's corpus automata
// and lookups as `suffix.py` has them in Python, and prompt lookup's matches as `drafters.py`
// has them (the references, and the paths where this cannot be built): the same states,
// counts, edge order, float operations and ties, so every proposal is the same (tests compare).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr int32_t NO_EDGE = -1, MANY = -2;
constexpr double MIN_CHANCE = 0.1;
constexpr size_t INDEXED = 8;  // a branching state's edges past this many are found by a map

// A branching state's edges in the order they were added (a Python dict's order), which
// decides ties between continuations.
struct Branch {
    std::vector<std::pair<int32_t, int32_t>> edges;
    std::unordered_map<int32_t, int32_t> at;  // token -> index in edges, once there are many

    int32_t find(int32_t token) const {
        if (edges.size() > INDEXED) {
            auto it = at.find(token);
            return it == at.end() ? -1 : edges[it->second].second;
        }
        for (const auto& e : edges)
            if (e.first == token) return e.second;
        return -1;
    }

    void set(int32_t token, int32_t target) {
        if (edges.size() > INDEXED) {
            auto it = at.find(token);
            if (it != at.end()) {
                edges[it->second].second = target;
                return;
            }
        } else {
            for (auto& e : edges)
                if (e.first == token) {
                    e.second = target;
                    return;
                }
        }
        edges.emplace_back(token, target);
        if (edges.size() > INDEXED) {
            if (at.empty())
                for (size_t i = 0; i < edges.size(); ++i) at[edges[i].first] = (int32_t)i;
            else
                at[token] = (int32_t)(edges.size() - 1);
        }
    }
};

// every automaton's own number (a row's remembered match names its block); atomic, since ctypes
// lets go of Python's lock while a call runs
std::atomic<int64_t> next_serial{1};

struct Automaton {
    std::vector<int32_t> link{-1}, length{0}, count{0}, edge_token{NO_EDGE}, edge_target{0};
    std::unordered_map<int32_t, Branch> branches;
    int32_t last = 0;
    int64_t tokens = 0;
    const int64_t serial = next_serial.fetch_add(1);

    int32_t step(int32_t state, int32_t token) const {
        int32_t edge = edge_token[state];
        if (edge == token) return edge_target[state];
        if (edge == MANY) return branches.at(state).find(token);
        return -1;
    }

    int32_t make(int32_t len, int32_t lnk, int32_t cnt, int32_t like = -1) {
        const int32_t s = (int32_t)length.size();
        const int32_t token = like >= 0 ? edge_token[like] : NO_EDGE;
        const int32_t target = like >= 0 ? edge_target[like] : 0;
        length.push_back(len);
        link.push_back(lnk);
        count.push_back(cnt);
        edge_token.push_back(token);
        edge_target.push_back(target);
        if (like >= 0 && edge_token[like] == MANY) {
            Branch copy = branches.at(like);
            branches.emplace(s, std::move(copy));
        }
        return s;
    }

    void set(int32_t state, int32_t token, int32_t target) {
        int32_t edge = edge_token[state];
        if (edge == NO_EDGE || edge == token) {
            edge_token[state] = token;
            edge_target[state] = target;
        } else if (edge == MANY) {
            branches.at(state).set(token, target);
        } else {
            Branch b;
            b.set(edge, edge_target[state]);
            b.set(token, target);
            branches.emplace(state, std::move(b));
            edge_token[state] = MANY;
        }
    }

    int32_t clone(int32_t p, int32_t q, int32_t token) {
        int32_t c = make(length[p] + 1, link[q], count[q], q);
        while (p != -1 && step(p, token) == q) {
            set(p, token, c);
            p = link[p];
        }
        link[q] = c;
        return c;
    }

    void extend(int32_t token) {
        int32_t p = last, cur;
        int32_t q = step(p, token);
        if (q >= 0) {
            cur = length[p] + 1 == length[q] ? q : clone(p, q, token);
        } else {
            cur = make(length[p] + 1, 0, 0);
            while (p != -1 && step(p, token) < 0) {
                set(p, token, cur);
                p = link[p];
            }
            if (p != -1) {
                q = step(p, token);
                int32_t to = length[p] + 1 == length[q] ? q : clone(p, q, token);
                link[cur] = to;
            }
        }
        last = cur;
        tokens += 1;
        for (int32_t s = cur; s > 0; s = link[s]) count[s] += 1;
    }

    // The state of the longest suffix of `context` that occurs here, and its length.
    std::pair<int32_t, int32_t> match(const int64_t* context, int64_t n) const {
        return walk(0, 0, context, n);
    }

    // From the match (`state`, `matched`) of a text, the match of that text followed by `n`
    // more tokens: the longest suffix of it that occurs here.
    std::pair<int32_t, int32_t> walk(int32_t state, int32_t matched, const int64_t* more, int64_t n) const {
        for (int64_t i = 0; i < n; ++i) {
            int32_t token = (int32_t)more[i];
            while (true) {
                int32_t next = step(state, token);
                if (next >= 0) {
                    state = next;
                    matched += 1;
                    break;
                }
                if (state == 0) {
                    matched = 0;
                    break;
                }
                state = link[state];
                matched = length[state];
            }
        }
        return {state, matched};
    }

    // The match no longer than `most`: the state holding the match's last `most` tokens.
    std::pair<int32_t, int32_t> within(std::pair<int32_t, int32_t> found, int32_t most) const {
        if (found.second <= most) return found;
        int32_t state = found.first;
        while (length[link[state]] >= most) state = link[state];
        return {state, most};
    }
};

// What a row remembers of its last match in a block (`suffix_lookup`'s `memo`): the block's
// serial and size then, the match, the row's size then and the window it was cut to.
struct Remembered {
    int64_t serial, tokens, state, matched, size, context;
};

// A row's match of its last `context` tokens in `a` (as `a.match` finds it), from what the row
// remembers where the block is unchanged and the row has only grown since: the longest suffix
// of the row's text that occurs in the block, cut to `context` tokens, is the longest suffix of
// those tokens that occurs, so the tokens since are walked alone rather than the whole window
// again (most of a 64-row round's lookups, on a CPU). A match cut to a window reaches `k`
// tokens further after `k` more, so it serves a window at most that much wider.
std::pair<int32_t, int32_t> remembered_match(const Automaton& a, const int64_t* text, int64_t size,
                                             int64_t context, Remembered* memo) {
    std::pair<int32_t, int32_t> found;
    const int64_t since = memo ? size - memo->size : 0;
    if (memo && memo->serial == a.serial && memo->tokens == a.tokens && since >= 0 && since <= context &&
        (memo->matched < memo->context || context <= memo->context + since)) {
        found = a.walk((int32_t)memo->state, (int32_t)memo->matched, text + memo->size, since);
    } else {
        found = a.match(text + size - context, context);
    }
    found = a.within(found, (int32_t)context);
    if (memo) *memo = {a.serial, a.tokens, found.first, found.second, size, context};
    return found;
}

// How many of the tokens up to `at` agree with those up to `last`, going back (at most `bound`):
// the match length of an occurrence of the text's last token, as `drafters.texts_matches` has it.
int64_t matched_back(const int64_t* text, int64_t at, int64_t last, int64_t bound) {
    int64_t len = 1;
    while (len < bound && at - len >= 0 && text[at - len] == text[last - len]) ++len;
    return len;
}

struct Found {
    std::vector<int64_t> tokens;
    double score = 0.0;
    int64_t depth = 0;
    bool any = false;

    // `max(found, key=(score, depth))`: a later one replaces only a strictly greater one.
    void offer(std::vector<int64_t>& drafted, double score_, int64_t depth_) {
        if (!any || score_ > score || (score_ == score && depth_ > depth)) {
            tokens.swap(drafted);
            score = score_;
            depth = depth_;
            any = true;
        }
    }
};

// `own_continuations` from the row's text (`suffix.own_continuations`, `drafters.texts_matches`),
// each offered to `found`; returns the deepest match depth offered (0: none). Stops after a
// continuation scoring `limit` or more, as `SuffixDrafter.lookup` does.
int64_t own_continuations(const int64_t* text, int64_t size, int64_t fed, int64_t limit, int64_t min_match,
                          int64_t deepest, int64_t separator, Found& found) {
    if (fed <= 0 || size < 1) return 0;
    const int64_t last = size - 1, bound = std::min(deepest, fed);
    std::vector<int64_t> ends, lengths;
    for (int64_t at = 0; at < last; ++at) {
        if (text[at] != text[last]) continue;
        ends.push_back(at + 1);
        lengths.push_back(matched_back(text, at, last, bound));
    }
    int64_t deepest_offered = 0, depth = std::numeric_limits<int64_t>::max();
    std::vector<int64_t> at, drafted;
    std::vector<std::pair<int64_t, int64_t>> counts;  // token, count: in order of first occurrence
    while (true) {
        int64_t next = 0;  // the next distinct depth below `depth`
        for (int64_t len : lengths)
            if (len < depth && len > next) next = len;
        depth = next;
        if (depth < min_match || depth == 0) break;
        at.clear();
        for (size_t i = 0; i < ends.size(); ++i)
            if (lengths[i] >= depth) at.push_back(ends[i]);
        drafted.clear();
        double chance = 1.0, score = 0.0;
        if (at.size() == 1) {
            for (int64_t e = at[0]; e < std::min(size, at[0] + limit) && text[e] != separator; ++e)
                drafted.push_back(text[e]);
            score = (double)drafted.size();
        } else {
            while ((int64_t)drafted.size() < limit) {
                counts.clear();
                int64_t total = 0;
                for (int64_t e : at) {
                    if (e >= size || text[e] == separator) continue;
                    auto it = std::find_if(counts.begin(), counts.end(),
                                           [&](const auto& c) { return c.first == text[e]; });
                    if (it == counts.end())
                        counts.emplace_back(text[e], 1);
                    else
                        it->second += 1;
                    total += 1;
                }
                if (counts.empty()) break;
                auto best = counts.begin();
                for (auto it = counts.begin(); it != counts.end(); ++it)
                    if (it->second > best->second) best = it;
                chance *= (double)best->second / (double)total;
                drafted.push_back(best->first);
                score += chance >= MIN_CHANCE ? chance : 0.0;
                const int64_t token = best->first;
                size_t kept = 0;
                for (int64_t e : at)
                    if (e < size && text[e] == token) at[kept++] = e + 1;
                at.resize(kept);
                if (at.size() == 1) {
                    const int64_t room = limit - (int64_t)drafted.size();
                    for (int64_t e = at[0]; e < std::min(size, at[0] + room) && text[e] != separator; ++e) {
                        drafted.push_back(text[e]);
                        score += chance >= MIN_CHANCE ? chance : 0.0;
                    }
                    break;
                }
            }
        }
        if (!drafted.empty()) {
            deepest_offered = std::max(deepest_offered, depth);
            found.offer(drafted, score, depth);
            if (score >= (double)limit) break;
        }
    }
    return deepest_offered;
}

// `continuations` of one block from its match, each offered to `found`, stopping after one
// scoring `limit` or more.
void continuations(const Automaton& a, int32_t state, int64_t matched, int64_t limit, int64_t min_match,
                   Found& found) {
    std::vector<int64_t> drafted;
    while (state > 0 && matched >= min_match) {
        drafted.clear();
        double chance = 1.0, score = 0.0;
        int32_t at = state;
        while ((int64_t)drafted.size() < limit) {
            int32_t edge = a.edge_token[at];
            if (edge == NO_EDGE) break;
            int64_t going = 0, best_count = 0;
            int32_t best = -1, best_state = 0;
            if (edge != MANY) {
                best = edge;
                best_state = a.edge_target[at];
                best_count = going = a.count[best_state];
            } else {
                for (const auto& e : a.branches.at(at).edges) {
                    going += a.count[e.second];
                    if (a.count[e.second] > best_count) {
                        best = e.first;
                        best_count = a.count[e.second];
                        best_state = e.second;
                    }
                }
            }
            if (!going) break;
            chance *= (double)best_count / (double)going;
            drafted.push_back(best);
            score += chance >= MIN_CHANCE ? chance : 0.0;
            at = best_state;
        }
        if (!drafted.empty()) {
            const double s = score;
            found.offer(drafted, s, matched);
            if (s >= (double)limit) return;
        }
        state = a.link[state];
        matched = a.length[state];
    }
}

}  // namespace

extern "C" {

void* suffix_automaton_new() { return new Automaton(); }

void suffix_automaton_free(void* a) { delete static_cast<Automaton*>(a); }

void suffix_automaton_add(void* handle, const int64_t* tokens, int64_t n) {
    auto* a = static_cast<Automaton*>(handle);
    a->last = 0;
    for (int64_t i = 0; i < n; ++i) a->extend((int32_t)tokens[i]);
}

int64_t suffix_automaton_tokens(void* a) { return static_cast<Automaton*>(a)->tokens; }

int64_t suffix_automaton_states(void* a) { return (int64_t) static_cast<Automaton*>(a)->length.size(); }

int64_t suffix_automaton_nbytes(void* handle) {
    auto* a = static_cast<Automaton*>(handle);
    int64_t bytes = 5 * (int64_t)a->length.capacity() * (int64_t)sizeof(int32_t);
    for (const auto& b : a->branches)
        bytes += 64 + (int64_t)b.second.edges.capacity() * 8 + (int64_t)b.second.at.size() * 32;
    return bytes;
}

// The state of the longest suffix of `context` found, and its length in `matched`.
int64_t suffix_automaton_match(void* a, const int64_t* context, int64_t n, int64_t* matched) {
    auto found = static_cast<Automaton*>(a)->match(context, n);
    *matched = found.second;
    return found.first;
}

// A row's match as `suffix_lookup` finds it (`remembered_match`), its length in `matched`:
// what the tests hold to the match found afresh.
int64_t suffix_automaton_remembered_match(void* a, const int64_t* text, int64_t size, int64_t context,
                                          int64_t* memo, int64_t* matched) {
    auto found = remembered_match(*static_cast<Automaton*>(a), text, size, context,
                                  reinterpret_cast<Remembered*>(memo));
    *matched = found.second;
    return found.first;
}

// `SuffixDrafter.lookup` for every row of a round: row r's text is texts[r][0:sizes[r]], its
// own part from starts[r] on; its best continuation goes to out_tokens[r * limit ...], its
// length to out_lengths[r] (0: none) and its match depth to out_depths[r]. `memo`: each row's
// `Remembered` match in each of the first `memo_blocks` blocks (zeros: none), read and
// rewritten here (null: none kept).
void suffix_lookup(int64_t rows, const int64_t* const* texts, const int64_t* sizes, const int64_t* starts,
                   int64_t limit, int64_t min_match, int64_t max_depth, int64_t separator,
                   void* const* blocks, int64_t n_blocks, int64_t* memo, int64_t memo_blocks,
                   int64_t* out_tokens, int64_t* out_lengths, int64_t* out_depths) {
    auto* remembered = reinterpret_cast<Remembered*>(memo);
    for (int64_t r = 0; r < rows; ++r) {
        Found found;
        const int64_t* text = texts[r];
        const int64_t size = sizes[r], fed = size - starts[r];
        int64_t deeper;
        if (limit > 0) {
            deeper = own_continuations(text, size, fed, limit, min_match, max_depth, separator, found) + 1;
            deeper = std::max(min_match, deeper);
            const int64_t context = std::min(fed, max_depth);
            if (deeper <= context) {
                for (int64_t b = 0; b < n_blocks; ++b) {
                    const auto& a = *static_cast<const Automaton*>(blocks[b]);
                    Remembered* mine = remembered && b < memo_blocks ? remembered + r * memo_blocks + b : nullptr;
                    auto m = remembered_match(a, text, size, context, mine);
                    continuations(a, m.first, m.second, limit, deeper, found);
                }
            }
        }
        out_lengths[r] = found.any ? (int64_t)found.tokens.size() : 0;
        out_depths[r] = found.any ? found.depth : 0;
        for (size_t i = 0; i < found.tokens.size(); ++i) out_tokens[r * limit + i] = found.tokens[i];
    }
}

// Prompt lookup's matches (`drafters.texts_matches`, then the longest, most recent): for each
// row the earlier occurrence of its last token that matches its end furthest back (at most
// `deepest` tokens, never past the row's own text), the most recent of equals; its length to
// out_lengths[r] (0: none) and the index after it to out_ends[r].
void longest_matches(int64_t rows, const int64_t* const* texts, const int64_t* sizes, const int64_t* starts,
                     int64_t deepest, int64_t* out_lengths, int64_t* out_ends) {
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t* text = texts[r];
        const int64_t size = sizes[r], fed = size - starts[r], last = size - 1;
        const int64_t bound = std::min(deepest, fed);
        int64_t best = 0, end = 0;
        for (int64_t at = fed > 0 ? last - 1 : -1; at >= 0; --at) {  // most recent first
            if (text[at] != text[last]) continue;
            const int64_t len = matched_back(text, at, last, bound);
            if (len > best) {
                best = len;
                end = at + 1;
            }
        }
        out_lengths[r] = best;
        out_ends[r] = end;
    }
}
}

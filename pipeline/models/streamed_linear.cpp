// y = x W^T + b for float32 activations, the weights streamed from memory once per call: a pass
// of up to 6 token rows costs about what a pass of 1 does, wider ones a little more per tile.
//
// Why not torch's kernel: on CPUs without AVX512-BF16 the matrix-matrix kernel repacks the whole
// weight for every call, so a pass of 8 tokens cost 3x a pass of 1 (see docs/engine.md). Here a
// block of weight rows small enough to stay in L2 is loaded once, and every tile of up to 6 token
// rows passes over it while it is there (the first as it streams in).
//
// Bitwise row invariance is by construction: every output y[t][o] is one fixed chain of
// operations on W[o] and x[t] alone (8 float lanes of fused multiply-adds over k in order, a
// fixed horizontal sum, the bias), whatever the number of rows, the tile a row falls in or the
// thread that computes it. The input width must be a multiple of 8 (no k tail). Compiled with -ffp-contract=off and without
// -ffast-math so that the compiler keeps that chain as written.
//
// Weights are float32, or bfloat16 widened to float32 in registers (exact: a bf16 is the top
// half of a float32), which halves the bytes a memory-bound pass reads, or a GGUF file's own
// Q4_K / Q6_K blocks (see "GGUF blocks" below), a third of the bf16 bytes.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int TILE = 6;     // token rows a micro-kernel keeps in registers
constexpr int MAX_RB = 64;  // most rows in a block (the accumulators of a tile live on the stack)

// A pair of weight rows' next 8 k values as two float vectors. float32 weights are packed as
// w[o][k..k+8], w[o+1][k..k+8]; bfloat16 ones as 32-bit lanes holding w[o+1][k] in the top
// half and w[o][k] in the bottom half, so one load gives both rows (a bf16 is the top half of
// its float32, so both widenings are exact).
inline void load_pair(const float* p, __m256& w0, __m256& w1) {
    w0 = _mm256_loadu_ps(p);
    w1 = _mm256_loadu_ps(p + 8);
}
inline void load_pair(const uint16_t* p, __m256& w0, __m256& w1) {
    const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
    w1 = _mm256_castsi256_ps(_mm256_and_si256(both, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// int8 (a draft's weights, one float scale per row applied after the sum): 8 of row o, 8 of
// row o+1, widened exactly.
inline void load_pair(const int8_t* p, __m256& w0, __m256& w1) {
    const __m128i both = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(both));
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(both, both)));
}
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// The weights are packed once (see `pack`): for each block of RB output rows (an even number),
// for each slice of KB k values, for each pair of rows, the pair's slice as `load_pair` reads
// it, 16 values per step of 8 k. A pass then reads them as one stream.
// One pair of weight rows against N token rows (from x, row stride K) over one k slice of
// `len` values, continuing the accumulators in acc[2][N] (the same chain as one long loop).
template <int N, typename W>
inline void micro(const W* w, const float* x, int64_t K, int64_t len, __m256* acc, bool first) {
    __m256 a0[N], a1[N];
    for (int n = 0; n < N; ++n) {
        a0[n] = first ? _mm256_setzero_ps() : acc[n];
        a1[n] = first ? _mm256_setzero_ps() : acc[N + n];
    }
    for (int64_t k = 0; k < len; k += 8, w += 16) {
        __m256 w0, w1;
        load_pair(w, w0, w1);
        for (int n = 0; n < N; ++n) {
            __m256 xv = _mm256_loadu_ps(x + n * K + k);
            asm("" : "+x"(xv));
            a0[n] = _mm256_fmadd_ps(w0, xv, a0[n]);
            a1[n] = _mm256_fmadd_ps(w1, xv, a1[n]);
        }
    }
    for (int n = 0; n < N; ++n) {
        acc[n] = a0[n];
        acc[N + n] = a1[n];
    }
}

template <typename W>
inline void micro_n(int n, const W* w, const float* x, int64_t K, int64_t len, __m256* acc, bool first) {
    switch (n) {
        case 1: micro<1>(w, x, K, len, acc, first); break;
        case 2: micro<2>(w, x, K, len, acc, first); break;
        case 3: micro<3>(w, x, K, len, acc, first); break;
        case 4: micro<4>(w, x, K, len, acc, first); break;
        case 5: micro<5>(w, x, K, len, acc, first); break;
        default: micro<6>(w, x, K, len, acc, first); break;
    }
}

template <typename W>
void pack(const W* w, int64_t O, int64_t K, int64_t RB, int64_t KB, W* out) {
    for (int64_t o0 = 0; o0 < O; o0 += RB) {
        const int64_t rows = std::min(RB, (O + 1) / 2 * 2 - o0);
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
            const int64_t len = std::min(KB, K - k0);
            W* dst = out + o0 * K + rows * k0;
            for (int64_t p = 0; p < rows; p += 2)
                for (int64_t k = k0; k < k0 + len; k += 8)
                    for (int i = 0; i < 16; ++i) {
                        // float32, int8: 8 of row o, then 8 of row o+1; bf16: alternating rows
                        const int row = sizeof(W) != 2 ? i / 8 : i % 2, col = sizeof(W) != 2 ? i % 8 : i / 2;
                        const int64_t o = o0 + p + row;
                        *dst++ = o < O ? w[o * K + k + col] : W(0);
                    }
        }
    }
}

template <typename W>
void linear(const float* x, int64_t T, int64_t K, const W* w, int64_t O, const float* scale, const float* bias, float* y,
            int64_t RB, int64_t KB, int threads) {
    const int64_t padded = (O + 1) / 2 * 2, blocks = (padded + RB - 1) / RB;
    const int64_t tiles = (T + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t o0 = b * RB, rows = std::min(RB, padded - o0);
        __m256 acc[MAX_RB * TILE];
        for (int64_t tile = 0, t = 0; tile < tiles; ++tile) {
            // tiles as even as can be (8 rows: 4 + 4, not 6 + 2): more independent chains each
            const int n = static_cast<int>(T / tiles + (tile < T % tiles));
            for (int64_t k0 = 0; k0 < K; k0 += KB) {
                const int64_t len = std::min(KB, K - k0);
                const W* wk = w + o0 * K + rows * k0;
                for (int64_t p = 0; p < rows; p += 2)
                    micro_n(n, wk + p * len, x + t * K + k0, K, len, acc + p * n, k0 == 0);
            }
            for (int64_t p = 0; p < rows; ++p) {
                const int64_t o = o0 + p;
                if (o >= O) break;
                const __m256* a = acc + p * n;  // row p's accumulators (see `micro`)
                for (int i = 0; i < n; ++i) {
                    float s = hsum(a[i]);
                    if (scale) s *= scale[o];
                    if (bias) s += bias[o];
                    y[(t + i) * O + o] = s;
                }
            }
            t += n;
        }
    }
}


// ---------------------------------------------------------------------------------------------
// GGUF blocks. A Q4_K super-block holds 256 weights of a row as 4-bit codes q with, per
// sub-block j of 32, a 6-bit scale sc_j and min m_j, and two fp16 factors d and dmin: its
// weights are d*sc_j * q - dmin*m_j. A Q6_K super-block: 6-bit codes, an int8 scale per 16
// weights and one fp16 d: d*sc_j * (q - 32).
//
// The numbers of the block path are the blocks' own, in float32: a = d*sc_j is exact (11 + 8
// bits), and so is a*q for Q4_K (+ 4 bits), so a Q4_K product is sum_k fma(a*q, x) in the chain
// above, minus sum_j dmin*m_j * X_j, where X_j is the sum of x over sub-block j (computed once
// per token row and call). Q6_K's a*q rounds as gguf's own dequantization rounds it. Either way
// a row's chain does not depend on the pass, so the path is row-invariant.
//
// Packed (by `pack_q4k` / `pack_q6k`) per block of rows, k slice and strip of 8 rows (4 pairs),
// one super-block after another. A strip's super-block:
//   Q4_K: 4 headers (float d[2]; uint8 sc[2][8]: 24 bytes, one per pair), then per sub-block of
//         32 k the 4 pairs' 32 bytes, each byte the codes of a pair's two rows at one k (row o
//         low nibble, o+1 high) in the order `nibble_k` gives, so that one byte shuffle per 8 k
//         puts them into float lanes in k order: 1120 bytes (4.375 bits a weight; the mins
//         live apart, `dmin[o][K/256]` and `m[o][K/32]`, read by the epilogue only).
//   Q6_K: 4 headers (float d[2]; int8 sc[2][16]: 40 bytes), then per group of 8 k the 4 pairs'
//         16 bytes, 8 codes (q - 32, as int8) of row o and 8 of row o+1: 2208 bytes (8 bits a
//         weight rather than 6.56, for one widening per 8 weights).
// A pass of one token row reads a strip as one stream with its 8 outputs' chains in flight
// together (with 2, the core would mostly wait on their latency); wider passes read it again
// from L1, a pair at a time. Wide passes (prefills) decode a group of rows once into float32
// pairs (the `f32` layout) in a per-thread scratch and run `micro` over it, tile after tile: the
// same values in the same chain, so a row's bits do not depend on which way its pass went.

constexpr int64_t QK = 256, STRIP = 8;
constexpr int64_t GGUF_Q4K = 144, GGUF_Q6K = 210;  // a super-block of one row, in the file
constexpr int DIRECT_MAX = 4, STRIPWISE_MAX = 24;  // the paths through a block, by width (`linear_blocks`)
constexpr int64_t SCRATCH_BYTES = 256 * 1024, ACC_BYTES = 128 * 1024;  // L2: 512 KB

// byte b of a packed Q4_K sub-block holds the codes of k = nibble_k(b) (0..31): the byte
// shuffle of group g takes bytes 4g..4g+3 of each 128-bit lane into its 8 float lanes
inline int nibble_k(int b) { return 8 * ((b % 16) / 4) + 4 * (b / 16) + b % 4; }

#define GROUP_LANE(g) 4 * g, -128, -128, -128, 4 * g + 1, -128, -128, -128, 4 * g + 2, -128, -128, -128, 4 * g + 3, -128, -128, -128
alignas(32) const int8_t GROUP_MASKS[4][32] = {{GROUP_LANE(0), GROUP_LANE(0)}, {GROUP_LANE(1), GROUP_LANE(1)},
                                               {GROUP_LANE(2), GROUP_LANE(2)}, {GROUP_LANE(3), GROUP_LANE(3)}};
#undef GROUP_LANE

float half_to_float(uint16_t h) {  // exact; for packing only
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) {  // subnormal: renormalise
        int shift = 0;
        uint32_t m = man;
        while ((m & 0x400) == 0) {
            m <<= 1;
            ++shift;
        }
        bits = sign | ((127 - 15 + 1 - shift) << 23) | ((m & 0x3FF) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// The codes, scales and mins of one Q4_K super-block of one row, as ggml's get_scale_min_k4.
void q4k_fields(const uint8_t* blk, float& d, float& dmin, uint8_t sc[8], uint8_t m[8], uint8_t q[256]) {
    d = half_to_float(static_cast<uint16_t>(blk[0] | blk[1] << 8));
    dmin = half_to_float(static_cast<uint16_t>(blk[2] | blk[3] << 8));
    const uint8_t* s = blk + 4;
    for (int j = 0; j < 8; ++j) {
        sc[j] = j < 4 ? s[j] & 63 : (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m[j] = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    const uint8_t* qs = blk + 16;
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
            q[64 * c + l] = qs[32 * c + l] & 0xF;
            q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
}

void q6k_fields(const uint8_t* blk, float& d, int8_t sc[16], int8_t q[256]) {
    const uint8_t *ql = blk, *qh = blk + 128;
    std::memcpy(sc, blk + 192, 16);
    d = half_to_float(static_cast<uint16_t>(blk[208] | blk[209] << 8));
    for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 64; ++l) {
            const int lo = ql[64 * h + l], hi = qh[32 * h + l % 32];
            q[128 * h + l] = static_cast<int8_t>(((lo & 0xF) | (((hi >> (l < 32 ? 0 : 2)) & 3) << 4)) - 32);
            q[128 * h + 64 + l] = static_cast<int8_t>(((lo >> 4) | (((hi >> (l < 32 ? 4 : 6)) & 3) << 4)) - 32);
        }
}

// How each kind's stream turns into float weights: per super-block a pair's sub-block scales
// a = d*sc, per sub-block what its groups share, per group of 8 k the pair's weights a*q.
struct Q4K {
    static constexpr int64_t bytes = 4 * 24 + 8 * 128;  // a strip's super-block
    static constexpr int SUBS = 8, GROUPS = 4;          // sub-blocks of 32 k, groups of 8 k in each
    static void pack(const uint8_t* const rows[8], uint8_t* dst) {  // one strip's super-block
        for (int p = 0; p < 4; ++p) {
            float d[2] = {0, 0}, dmin;
            uint8_t sc[2][8] = {}, m[8], q[2][256] = {};
            for (int r = 0; r < 2; ++r)
                if (rows[2 * p + r]) q4k_fields(rows[2 * p + r], d[r], dmin, sc[r], m, q[r]);
            std::memcpy(dst + 24 * p, d, 8);
            std::memcpy(dst + 24 * p + 8, sc, 16);
            for (int j = 0; j < 8; ++j)
                for (int b = 0; b < 32; ++b) {
                    const int k = 32 * j + nibble_k(b);
                    dst[96 + 128 * j + 32 * p + b] = static_cast<uint8_t>(q[0][k] | q[1][k] << 4);
                }
        }
    }
    static inline void scales(const uint8_t* sb, int p, float* a0, float* a1) {
        const uint8_t* h = sb + 24 * p;
        for (int r = 0; r < 2; ++r) {
            const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h + 8 + 8 * r));
            _mm256_store_ps(r ? a1 : a0, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)),
                                                       _mm256_broadcast_ss(reinterpret_cast<const float*>(h) + r)));
        }
    }
    struct Sub {
        __m256i lo, hi;  // the sub-block's codes of row o and of row o+1, one a byte
    };
    static inline Sub sub(const uint8_t* sb, int p, int j) {
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 96 + 128 * j + 32 * p));
        return {_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)};
    }
    static inline void weights(const Sub& u, int g, __m256 a0, __m256 a1, __m256& w0, __m256& w1) {
        const __m256i sel = _mm256_load_si256(reinterpret_cast<const __m256i*>(GROUP_MASKS[g]));
        w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(u.lo, sel)), a0);
        w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(u.hi, sel)), a1);
    }
};
struct Q6K {
    static constexpr int64_t bytes = 4 * 40 + 32 * 64;
    static constexpr int SUBS = 16, GROUPS = 2;  // sub-blocks of 16 k
    static void pack(const uint8_t* const rows[8], uint8_t* dst) {
        for (int p = 0; p < 4; ++p) {
            float d[2] = {0, 0};
            int8_t sc[2][16] = {}, q[2][256] = {};
            for (int r = 0; r < 2; ++r)
                if (rows[2 * p + r]) q6k_fields(rows[2 * p + r], d[r], sc[r], q[r]);
            std::memcpy(dst + 40 * p, d, 8);
            std::memcpy(dst + 40 * p + 8, sc, 32);
            for (int g = 0; g < 32; ++g)
                for (int r = 0; r < 2; ++r) std::memcpy(dst + 160 + 64 * g + 16 * p + 8 * r, q[r] + 8 * g, 8);
        }
    }
    static inline void scales(const uint8_t* sb, int p, float* a0, float* a1) {
        const uint8_t* h = sb + 40 * p;
        for (int r = 0; r < 2; ++r) {
            float* a = r ? a1 : a0;
            const __m256 d = _mm256_broadcast_ss(reinterpret_cast<const float*>(h) + r);
            const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8 + 16 * r));
            _mm256_store_ps(a, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d));
            _mm256_store_ps(a + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc))), d));
        }
    }
    struct Sub {
        const uint8_t* q;
    };
    static inline Sub sub(const uint8_t* sb, int p, int j) { return {sb + 160 + 128 * j + 16 * p}; }
    static inline void weights(const Sub& u, int g, __m256 a0, __m256 a1, __m256& w0, __m256& w1) {
        const uint8_t* q = u.q + 64 * g;
        w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)))), a0);
        w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)))), a1);
    }
};

// Repack a row-major array of GGUF blocks (O rows of K/256 super-blocks of `in_bytes`) into the
// kernel's stream (see above); rows past O (padding to a whole strip) are zeros.
template <typename B>
void pack_blocks(const uint8_t* src, int64_t in_bytes, int64_t O, int64_t K, int64_t RB, int64_t KB, uint8_t* out) {
    const int64_t per_row = K / QK, padded = (O + STRIP - 1) / STRIP * STRIP;
    for (int64_t o0 = 0; o0 < padded; o0 += RB) {
        const int64_t rows = std::min(RB, padded - o0);
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
            const int64_t len = std::min(KB, K - k0);
            uint8_t* dst = out + (o0 / STRIP) * per_row * B::bytes + (rows / STRIP) * (k0 / QK) * B::bytes;
            for (int64_t i = 0; i < rows; i += STRIP)
                for (int64_t s = k0 / QK; s < (k0 + len) / QK; ++s, dst += B::bytes) {
                    const uint8_t* from[8];
                    for (int r = 0; r < 8; ++r) {
                        const int64_t o = o0 + i + r;
                        from[r] = o < O ? src + (o * per_row + s) * in_bytes : nullptr;
                    }
                    B::pack(from, dst);
                }
        }
    }
}

// The Q4_K mins of every row, apart: dmin[o][K/256] and m[o][K/32].
void pack_q4k_mins(const uint8_t* src, int64_t O, int64_t K, float* dmin, uint8_t* m) {
    const int64_t per_row = K / QK;
    for (int64_t i = 0; i < O * per_row; ++i) {
        float d;
        uint8_t sc[8], q[256];
        q4k_fields(src + i * GGUF_Q4K, d, dmin[i], sc, m + 8 * i, q);
    }
}

// P pairs of a strip's slice (from pair p0) against N token rows, each output the chain of
// `micro`. Enough chains in flight (2*P*N, 8 here) that the core does not wait on the latency
// of their fused multiply-adds; a pair's groups go one after another so that few registers are
// live (the compiler kept a version that decoded every pair at once in memory).
template <int N, int P, typename B>
inline void micro_pairs(const uint8_t* w, int p0, const float* x, int64_t K, int64_t len, __m256* acc, bool first) {
    __m256 c[2 * P * N];
    for (int i = 0; i < 2 * P * N; ++i) c[i] = first ? _mm256_setzero_ps() : acc[i];
    constexpr int SUB_K = QK / B::SUBS;
    for (int64_t s = 0; s < len; s += QK, w += B::bytes) {
        alignas(32) float sc[P][2][B::SUBS];
        for (int p = 0; p < P; ++p) B::scales(w, p0 + p, sc[p][0], sc[p][1]);
        for (int j = 0; j < B::SUBS; ++j)
            for (int p = 0; p < P; ++p) {
                const typename B::Sub u = B::sub(w, p0 + p, j);
                const __m256 s0 = _mm256_broadcast_ss(&sc[p][0][j]), s1 = _mm256_broadcast_ss(&sc[p][1][j]);
                for (int g = 0; g < B::GROUPS; ++g) {
                    __m256 w0, w1;
                    B::weights(u, g, s0, s1, w0, w1);
                    const int64_t k = s + SUB_K * j + 8 * g;
                    for (int n = 0; n < N; ++n) {
                        const __m256 xv = _mm256_loadu_ps(x + n * K + k);
                        c[(2 * p) * N + n] = _mm256_fmadd_ps(w0, xv, c[(2 * p) * N + n]);
                        c[(2 * p + 1) * N + n] = _mm256_fmadd_ps(w1, xv, c[(2 * p + 1) * N + n]);
                    }
                }
            }
    }
    for (int i = 0; i < 2 * P * N; ++i) acc[i] = c[i];
}

// A strip's slice against a tile of n token rows (1 to DIRECT_MAX); acc holds the strip's 8
// rows' accumulators, row by row (`acc[row * n + token]`).
template <typename B>
inline void micro_direct(int n, const uint8_t* w, const float* x, int64_t K, int64_t len, __m256* acc, bool first) {
    switch (n) {
        case 1: micro_pairs<1, 4, B>(w, 0, x, K, len, acc, first); break;
        case 2:
            for (int p = 0; p < 4; p += 2) micro_pairs<2, 2, B>(w, p, x, K, len, acc + 2 * p * 2, first);
            break;
        case 3:
            for (int p = 0; p < 4; ++p) micro_pairs<3, 1, B>(w, p, x, K, len, acc + 2 * p * 3, first);
            break;
        default:
            for (int p = 0; p < 4; ++p) micro_pairs<4, 1, B>(w, p, x, K, len, acc + 2 * p * 4, first);
            break;
    }
}

// A strip's slice decoded into float32 pairs (the `f32` layout, a pair's 2 * len values
// `pair_stride` floats after the last pair's): the weights `micro_pairs` uses.
template <typename B>
inline void decode_strip(const uint8_t* w, int64_t len, float* dst, int64_t pair_stride) {
    for (int p = 0; p < 4; ++p) {
        float* out = dst + p * pair_stride;
        const uint8_t* sb = w;
        for (int64_t s = 0; s < len; s += QK, sb += B::bytes) {
            alignas(32) float sc[2][B::SUBS];
            B::scales(sb, p, sc[0], sc[1]);
            for (int j = 0; j < B::SUBS; ++j) {
                const typename B::Sub u = B::sub(sb, p, j);
                const __m256 s0 = _mm256_broadcast_ss(&sc[0][j]), s1 = _mm256_broadcast_ss(&sc[1][j]);
                for (int g = 0; g < B::GROUPS; ++g, out += 16) {
                    __m256 w0, w1;
                    B::weights(u, g, s0, s1, w0, w1);
                    _mm256_store_ps(out, w0);
                    _mm256_store_ps(out + 8, w1);
                }
            }
        }
    }
}

// A strip's slice decoded into bfloat16 pairs (the `bf16` layout: per k one 32-bit lane with
// row o's value in the low half, row o+1's in the high half): the blocks' values as gguf
// dequantizes them (a*q, less the Q4_K min) rounded to bfloat16, which is what the install's
// bf16 weights hold. For prefills (see `linear_blocks`). `mins`: the strip's rows' min
// factors (row r at r * subs), from sub-block `sub0` of the slice on; nullptr for Q6_K.
template <typename B>
inline void decode_strip_bf16(const uint8_t* w, int64_t len, uint16_t* dst, int64_t pair_stride, const float* mins,
                              int64_t subs, int64_t sub0) {
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF);
    auto rounded = [&](__m256 v) {  // to bfloat16, to nearest even (finite values), in the low half
        const __m256i bits = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
        return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(half, lsb)), 16);
    };
    for (int p = 0; p < 4; ++p) {
        uint16_t* out = dst + p * pair_stride;
        const uint8_t* sb = w;
        for (int64_t s = 0; s < len; s += QK, sb += B::bytes) {
            alignas(32) float sc[2][B::SUBS];
            B::scales(sb, p, sc[0], sc[1]);
            for (int j = 0; j < B::SUBS; ++j) {
                const typename B::Sub u = B::sub(sb, p, j);
                const __m256 s0 = _mm256_broadcast_ss(&sc[0][j]), s1 = _mm256_broadcast_ss(&sc[1][j]);
                __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
                if (mins) {
                    const int64_t sub = sub0 + s / 32 + j;
                    b0 = _mm256_broadcast_ss(mins + (2 * p) * subs + sub);
                    b1 = _mm256_broadcast_ss(mins + (2 * p + 1) * subs + sub);
                }
                for (int g = 0; g < B::GROUPS; ++g, out += 16) {
                    __m256 w0, w1;
                    B::weights(u, g, s0, s1, w0, w1);
                    if (mins) {  // a*q is exact: one rounding, as gguf's d*q - dm
                        w0 = _mm256_sub_ps(w0, b0);
                        w1 = _mm256_sub_ps(w1, b1);
                    }
                    const __m256i both = _mm256_or_si256(rounded(w0), _mm256_slli_epi32(rounded(w1), 16));
                    _mm256_store_si256(reinterpret_cast<__m256i*>(out), both);
                }
            }
        }
    }
}

// Sum of each token row's x over every sub-block of 32 (the Q4_K mins' partner): one fixed
// chain per sub-block (4 vectors added in order, then `hsum`).
void sub_block_sums(const float* x, int64_t T, int64_t K, float* sums) {
    for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < K / 32; ++j) {
            const float* p = x + t * K + 32 * j;
            __m256 v = _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
            v = _mm256_add_ps(v, _mm256_loadu_ps(p + 16));
            v = _mm256_add_ps(v, _mm256_loadu_ps(p + 24));
            sums[t * (K / 32) + j] = hsum(v);
        }
}

// A row's Q4_K min factors b_j = dmin*m_j (exact: 11 + 6 bits), K/32 of them, for `finish`.
inline void min_factors(const float* dmin, const uint8_t* m, int64_t K, float* b) {
    for (int64_t s = 0; s < K / QK; ++s) {
        const __m128i ms = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m + 8 * s));
        _mm256_storeu_ps(b + 8 * s, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ms)), _mm256_broadcast_ss(dmin + s)));
    }
}

// The Q4_K mins of one row as `finish` reads them: its min factors computed once (`b`, for
// many token rows), or from its dmin and m as it goes (a few). The same values either way.
struct RowMins {
    const float* b;
    const float* dmin;
    const uint8_t* m;
    inline __m256 factors(int64_t s) const {  // those of super-block s
        if (b) return _mm256_loadu_ps(b + 8 * s);
        const __m128i ms = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m + 8 * s));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ms)), _mm256_broadcast_ss(dmin + s));
    }
};

// Row o's outputs for token rows t..t+n from its accumulators: the horizontal sum, less the
// Q4_K mins' term sum_j b_j * X_j (one fixed chain), plus the bias.
inline void finish(const __m256* a, int n, int64_t o, int64_t t, int64_t O, int64_t K, const RowMins* mins,
                   const float* sums, const float* bias, float* y) {
    for (int i = 0; i < n; ++i) {
        float s = hsum(a[i]);
        if (mins) {
            const float* x = sums + (t + i) * (K / 32);
            __m256 acc = _mm256_setzero_ps();
            for (int64_t j = 0; j < K / QK; ++j) acc = _mm256_fmadd_ps(mins->factors(j), _mm256_loadu_ps(x + 8 * j), acc);
            s -= hsum(acc);
        }
        if (bias) s += bias[o];
        y[(t + i) * O + o] = s;
    }
}

// Three ways through a block of rows, by the width of the pass (the same chain each way):
// up to DIRECT_MAX token rows decode the blocks in registers, once per tile; up to STRIPWISE_MAX
// decode each strip's slice once into L1 and run `micro` over it for every tile; wider passes
// (prefills) decode the block's rows over a range of k into L2 and run every tile over that,
// every tile's accumulators kept in memory between ranges: the token rows are then read once
// per block of rows, not once per few rows (a prefill's rows of a 8960-wide input are 14 MB).
template <typename B>
void linear_blocks(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t O, const float* dmin,
                   const uint8_t* m, const float* bias, float* y, int64_t RB, int64_t KB, int threads, bool prefill) {
    const int64_t padded = (O + STRIP - 1) / STRIP * STRIP, blocks = (padded + RB - 1) / RB, per_row = K / QK;
    float* sums = nullptr;
    if (dmin) {
        sums = static_cast<float*>(std::aligned_alloc(32, (T * (K / 32) * 4 + 31) / 32 * 32));
        sub_block_sums(x, T, K, sums);
    }
    enum { DIRECT, STRIPWISE, GROUPED };
    const int path = prefill ? GROUPED : T <= DIRECT_MAX ? DIRECT : T <= STRIPWISE_MAX ? STRIPWISE : GROUPED;
    const int64_t unit = prefill ? 2 : 4;  // bytes of a decoded weight on the grouped path
    const int64_t tile_max = path == DIRECT ? DIRECT_MAX : TILE, tiles = (T + tile_max - 1) / tile_max;
    // the k values of a block's rows decoded into L2 at a time on the grouped path: whole slices
    const int64_t range = std::max<int64_t>(KB, SCRATCH_BYTES / (RB * unit) / KB * KB);
    // tiles whose accumulators the grouped path keeps at once (in L2 beside the decoded range):
    // a group of tiles goes through every block before the next group starts
    // (one range that covers every k needs no tile's accumulators kept: each tile finishes at once)
    const bool whole = range >= K;
    const int64_t group_tiles =
        path == GROUPED && !whole ? std::max<int64_t>(1, ACC_BYTES / (RB * TILE * int64_t(sizeof(__m256))))
                                  : tiles;
    auto tile_rows = [&](int64_t tile) { return static_cast<int>(T / tiles + (tile < T % tiles)); };
    auto tile_start = [&](int64_t tile) { return tile * (T / tiles) + std::min(tile, T % tiles); };
    auto slice = [&](const uint8_t* wb, int64_t rows, int64_t k0, int64_t len, int64_t i) {
        return wb + (rows / STRIP) * (k0 / QK) * B::bytes + (i / STRIP) * (len / QK) * B::bytes;
    };
#pragma omp parallel num_threads(threads)
    {
        const int64_t scratch_bytes = path == GROUPED ? RB * range * unit : path == STRIPWISE ? STRIP * KB * 4 : 0;
        float* scratch = scratch_bytes ? static_cast<float*>(std::aligned_alloc(32, scratch_bytes)) : nullptr;
        uint16_t* halves = reinterpret_cast<uint16_t*>(scratch);  // the prefill's bf16 pairs
        const int64_t acc_tiles = path == DIRECT || (path == GROUPED && whole) ? 1 : group_tiles;
        float* mins = dmin && path == GROUPED ? static_cast<float*>(std::aligned_alloc(32, MAX_RB * (K / 32) * 4)) : nullptr;
        __m256* acc = static_cast<__m256*>(std::aligned_alloc(32, acc_tiles * MAX_RB * TILE * sizeof(__m256)));
        for (int64_t tg0 = 0; tg0 < tiles; tg0 += group_tiles) {
        const int64_t tg1 = std::min(tiles, tg0 + group_tiles);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t o0 = b * RB, rows = std::min(RB, padded - o0);
            const uint8_t* wb = w + (o0 / STRIP) * per_row * B::bytes;
            if (mins && path == GROUPED)  // many token rows: the factors once per block (0 past O)
                for (int64_t r = 0; r < rows; ++r) {
                    if (o0 + r < O)
                        min_factors(dmin + (o0 + r) * per_row, m + (o0 + r) * per_row * 8, K, mins + r * (K / 32));
                    else
                        std::memset(mins + r * (K / 32), 0, (K / 32) * 4);
                }
            RowMins row_mins_at;
            auto row_mins = [&](int64_t r) -> const RowMins* {
                if (!dmin) return nullptr;
                const int64_t o = o0 + r;
                row_mins_at = {path == GROUPED ? mins + r * (K / 32) : nullptr, dmin + o * per_row, m + o * per_row * 8};
                return &row_mins_at;
            };
            if (path == DIRECT) {
                for (int64_t tile = 0, t = 0; tile < tiles; t += tile_rows(tile++)) {
                    const int n = tile_rows(tile);
                    for (int64_t k0 = 0; k0 < K; k0 += KB) {
                        const int64_t len = std::min(KB, K - k0);
                        for (int64_t i = 0; i < rows; i += STRIP)
                            micro_direct<B>(n, slice(wb, rows, k0, len, i), x + t * K + k0, K, len, acc + i * n, k0 == 0);
                    }
                    for (int64_t r = 0; r < rows && o0 + r < O; ++r)
                        finish(acc + r * n, n, o0 + r, t, O, K, row_mins(r), sums, bias, y);
                }
            } else if (path == STRIPWISE) {
                for (int64_t k0 = 0; k0 < K; k0 += KB) {
                    const int64_t len = std::min(KB, K - k0);
                    for (int64_t i = 0; i < rows; i += STRIP) {
                        decode_strip<B>(slice(wb, rows, k0, len, i), len, scratch, 2 * len);
                        for (int64_t tile = 0, t = 0; tile < tiles; t += tile_rows(tile++))
                            for (int64_t p = 0; p < STRIP; p += 2)
                                micro_n(tile_rows(tile), scratch + p * len, x + t * K + k0, K, len,
                                        acc + tile * MAX_RB * TILE + (i + p) * tile_rows(tile), k0 == 0);
                    }
                }
                for (int64_t tile = 0, t = 0; tile < tiles; t += tile_rows(tile++))
                    for (int64_t r = 0; r < rows && o0 + r < O; ++r)
                        finish(acc + tile * MAX_RB * TILE + r * tile_rows(tile), tile_rows(tile), o0 + r, t, O, K,
                               row_mins(r), sums, bias, y);
            } else {
                for (int64_t kr0 = 0; kr0 < K; kr0 += range) {  // the block's rows over a range of k
                    const int64_t kr1 = std::min(K, kr0 + range);
                    for (int64_t k0 = kr0; k0 < kr1; k0 += KB) {  // ... decoded into pairs, each pair's
                        const int64_t len = std::min(KB, K - k0);    // range contiguous
                        for (int64_t i = 0; i < rows; i += STRIP) {
                            const int64_t at = i * range + 2 * (k0 - kr0);
                            if (prefill)
                                decode_strip_bf16<B>(slice(wb, rows, k0, len, i), len, halves + at, 2 * range,
                                                     mins ? mins + i * (K / 32) : nullptr, K / 32, k0 / 32);
                            else
                                decode_strip<B>(slice(wb, rows, k0, len, i), len, scratch + at, 2 * range);
                        }
                    }
                    for (int64_t tile = tg0; tile < tg1; ++tile) {
                        __m256* at = acc + (whole ? 0 : (tile - tg0) * MAX_RB * TILE);
                        const int n = tile_rows(tile);
                        for (int64_t p = 0; p < rows; p += 2) {  // a pair's whole range in one call
                            const float* xt = x + tile_start(tile) * K + kr0;
                            if (prefill)
                                micro_n(n, halves + p * range, xt, K, kr1 - kr0, at + p * n, kr0 == 0);
                            else
                                micro_n(n, scratch + p * range, xt, K, kr1 - kr0, at + p * n, kr0 == 0);
                        }
                        if (whole)  // a prefill's mins are in its weights
                            for (int64_t r = 0; r < rows && o0 + r < O; ++r)
                                finish(at + r * n, n, o0 + r, tile_start(tile), O, K,
                                       prefill ? nullptr : row_mins(r), sums, bias, y);
                    }
                }
                if (!whole)
                    for (int64_t tile = tg0; tile < tg1; ++tile)
                        for (int64_t r = 0; r < rows && o0 + r < O; ++r)
                            finish(acc + (tile - tg0) * MAX_RB * TILE + r * tile_rows(tile), tile_rows(tile), o0 + r,
                                   tile_start(tile), O, K, prefill ? nullptr : row_mins(r), sums, bias, y);
            }
        }
        }
        std::free(mins);
        std::free(acc);
        std::free(scratch);
    }
    std::free(sums);
}

}  // namespace

extern "C" {

void pack_f32(const float* w, int64_t O, int64_t K, int64_t RB, int64_t KB, float* out) { pack(w, O, K, RB, KB, out); }
void pack_bf16(const uint16_t* w, int64_t O, int64_t K, int64_t RB, int64_t KB, uint16_t* out) {
    pack(w, O, K, RB, KB, out);
}
void pack_i8(const int8_t* w, int64_t O, int64_t K, int64_t RB, int64_t KB, int8_t* out) { pack(w, O, K, RB, KB, out); }
void linear_f32(const float* x, int64_t T, int64_t K, const float* w, int64_t O, const float* scale, const float* bias,
                float* y, int64_t RB, int64_t KB, int threads) {
    linear(x, T, K, w, O, scale, bias, y, RB, KB, threads);
}
void linear_bf16(const float* x, int64_t T, int64_t K, const uint16_t* w, int64_t O, const float* scale,
                 const float* bias, float* y, int64_t RB, int64_t KB, int threads) {
    linear(x, T, K, w, O, scale, bias, y, RB, KB, threads);
}
void pack_q4k(const uint8_t* src, int64_t O, int64_t K, int64_t RB, int64_t KB, uint8_t* out, float* dmin, uint8_t* m) {
    pack_blocks<Q4K>(src, GGUF_Q4K, O, K, RB, KB, out);
    pack_q4k_mins(src, O, K, dmin, m);
}
void pack_q6k(const uint8_t* src, int64_t O, int64_t K, int64_t RB, int64_t KB, uint8_t* out) {
    pack_blocks<Q6K>(src, GGUF_Q6K, O, K, RB, KB, out);
}
int64_t packed_bytes_q4k(int64_t O, int64_t K) { return (O + STRIP - 1) / STRIP * (K / QK) * Q4K::bytes; }
int64_t packed_bytes_q6k(int64_t O, int64_t K) { return (O + STRIP - 1) / STRIP * (K / QK) * Q6K::bytes; }
void linear_q4k(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t O, const float* dmin, const uint8_t* m,
                const float* bias, float* y, int64_t RB, int64_t KB, int threads, int prefill) {
    linear_blocks<Q4K>(x, T, K, w, O, dmin, m, bias, y, RB, KB, threads, prefill != 0);
}
void linear_q6k(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t O, const float* bias, float* y,
                int64_t RB, int64_t KB, int threads, int prefill) {
    linear_blocks<Q6K>(x, T, K, w, O, nullptr, nullptr, bias, y, RB, KB, threads, prefill != 0);
}
void linear_i8(const float* x, int64_t T, int64_t K, const int8_t* w, int64_t O, const float* scale, const float* bias,
               float* y, int64_t RB, int64_t KB, int threads) {
    linear(x, T, K, w, O, scale, bias, y, RB, KB, threads);
}
}

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
// half of a float32), which halves the bytes a memory-bound pass reads.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

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
void linear_i8(const float* x, int64_t T, int64_t K, const int8_t* w, int64_t O, const float* scale, const float* bias,
               float* y, int64_t RB, int64_t KB, int threads) {
    linear(x, T, K, w, O, scale, bias, y, RB, KB, threads);
}
}

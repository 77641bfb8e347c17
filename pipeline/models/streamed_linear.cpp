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
// The kernel is AVX2 code. Where the CPU also has AVX-512, the products of prefills and of tiles
// of 4 or more token rows run 16 lanes at a time (`micro_512`), each lane the same operations on
// the same values as the AVX2 chain, so the outputs are the same bits on either kind of CPU.
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
#include <type_traits>

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

// The same chain on CPUs with AVX-512, for wide passes (prefills above all): one 16-lane
// register holds both rows' 8 lanes (row o low, row o+1 high) against the token row's 8 k values
// in both halves, so one fused multiply-add does what two do in `micro`, lane for lane the same
// operation on the same values: the outputs are bitwise those of `micro`. Q pairs at a time
// (acc: the first pair's 2N accumulators, then the next's), `pair_stride` values apart, so that
// each token row's x is loaded once for all of them: with one pair the loads, not the
// multiply-adds, set the pace. Compiled for AVX-512 alone (`target`), called only where the CPU
// has it (`wide_fma`).
#define AVX512 __attribute__((target("avx512f,avx512dq")))
AVX512 inline __m512 load_pair_512(const float* p) { return _mm512_loadu_ps(p); }
AVX512 inline __m512 load_pair_512(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
AVX512 inline __m512 load_pair_512(const uint16_t* p) {
    // low half: the pair's lanes shifted up 16 bits (row o); high half: their top 16 bits (row o+1)
    const __m512i shift = _mm512_setr_epi32(16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i keep = _mm512_setr_epi32(-1, -1, -1, -1, -1, -1, -1, -1, static_cast<int>(0xFFFF0000u),
                                           static_cast<int>(0xFFFF0000u), static_cast<int>(0xFFFF0000u),
                                           static_cast<int>(0xFFFF0000u), static_cast<int>(0xFFFF0000u),
                                           static_cast<int>(0xFFFF0000u), static_cast<int>(0xFFFF0000u),
                                           static_cast<int>(0xFFFF0000u));
    const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_sllv_epi32(_mm512_broadcast_i64x4(both), shift), keep));
}

constexpr int PAIRS_512 = 4;  // 4 pairs x 6 token rows: 24 of the 32 registers accumulate
constexpr int WIDE_FMA_ROWS = 4;  // tiles of fewer token rows are bound by the weights' stream

// The accumulators of PAIRS_512 pairs x N token rows in 16 lanes (row o low, row o+1 high), from
// and to the 8-lane layout the other kernels keep (`acc`: a pair's 2N, row o's N first).
template <int N>
AVX512 inline void load_pairs_512(const __m256* acc, bool first, __m512 (&a)[PAIRS_512][N]) {
    for (int q = 0; q < PAIRS_512; ++q)
        for (int n = 0; n < N; ++n)
            a[q][n] = first ? _mm512_setzero_ps()
                            : _mm512_insertf32x8(_mm512_castps256_ps512(acc[2 * N * q + n]), acc[2 * N * q + N + n], 1);
}
template <int N>
AVX512 inline void store_pairs_512(const __m512 (&a)[PAIRS_512][N], __m256* acc) {
    for (int q = 0; q < PAIRS_512; ++q)
        for (int n = 0; n < N; ++n) {
            acc[2 * N * q + n] = _mm512_castps512_ps256(a[q][n]);
            acc[2 * N * q + N + n] = _mm512_extractf32x8_ps(a[q][n], 1);
        }
}

template <int N, typename W>
AVX512 void micro_512(const W* w, int64_t pair_stride, const float* x, int64_t K, int64_t len, __m256* acc,
                      bool first) {
    constexpr int Q = PAIRS_512;
    __m512 a[Q][N];
    load_pairs_512<N>(acc, first, a);
    for (int64_t k = 0; k < len; k += 8, w += 16) {
        __m512 wv[Q];
        for (int q = 0; q < Q; ++q) wv[q] = load_pair_512(w + q * pair_stride);
        for (int n = 0; n < N; ++n) {
            const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + n * K + k));
            for (int q = 0; q < Q; ++q) a[q][n] = _mm512_fmadd_ps(wv[q], xv, a[q][n]);
        }
    }
    store_pairs_512<N>(a, acc);
}

template <typename W>
AVX512 void micro_512_n(int n, const W* w, int64_t pair_stride, const float* x, int64_t K, int64_t len,
                        __m256* acc, bool first) {
    switch (n) {
        case 1: micro_512<1>(w, pair_stride, x, K, len, acc, first); break;
        case 2: micro_512<2>(w, pair_stride, x, K, len, acc, first); break;
        case 3: micro_512<3>(w, pair_stride, x, K, len, acc, first); break;
        case 4: micro_512<4>(w, pair_stride, x, K, len, acc, first); break;
        case 5: micro_512<5>(w, pair_stride, x, K, len, acc, first); break;
        default: micro_512<6>(w, pair_stride, x, K, len, acc, first); break;
    }
}

// Does this CPU run `micro_512`? (PIPELINE_KERNEL_AVX512=0 says no, to compare the paths.)
bool wide_fma() {
    static const bool yes = [] {
        const char* off = std::getenv("PIPELINE_KERNEL_AVX512");
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && !(off && off[0] == '0');
    }();
    return yes;
}

// Prefills on CPUs with AVX512_BF16: the token rows rounded to bfloat16 (`round_rows_bf16`) and
// the weights' bf16 rounding multiplied in pairs of k by `vdpbf16ps`, 32 products an instruction
// where `micro_512` does 16: a prefill is bound by arithmetic, and this halves it. The chain of
// an output: lane i of its row accumulates, per 16 k, the products at k + 2i and k + 2i + 1 (the
// instruction's own fixed order, float32 sums, round to nearest even), then `hsum` over the 8
// lanes as everywhere. A row's bits depend on its x and W alone, so the path is row-invariant
// like the others; its numbers are bf16 activations', not float32's. The decoded pairs are laid
// out for it by `decode_strip_dot`: per 16 k, row o's 16 values, then row o + 1's.
#define AVX512BF16 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16")))

template <int N>
AVX512BF16 void micro_dot_512(const uint16_t* w, int64_t pair_stride, const uint16_t* x, int64_t K, int64_t len,
                              __m256* acc, bool first) {
    constexpr int Q = PAIRS_512;
    __m512 a[Q][N];
    load_pairs_512<N>(acc, first, a);
    for (int64_t k = 0; k < len; k += 16, w += 32) {
        __m512bh wv[Q];
        for (int q = 0; q < Q; ++q) wv[q] = (__m512bh)_mm512_loadu_si512(w + q * pair_stride);
        for (int n = 0; n < N; ++n) {
            const __m512bh xv =
                (__m512bh)_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + n * K + k)));
            for (int q = 0; q < Q; ++q) a[q][n] = _mm512_dpbf16_ps(a[q][n], wv[q], xv);
        }
    }
    store_pairs_512<N>(a, acc);
}

AVX512BF16 void micro_dot_512_n(int n, const uint16_t* w, int64_t pair_stride, const uint16_t* x, int64_t K,
                                int64_t len, __m256* acc, bool first) {
    switch (n) {
        case 1: micro_dot_512<1>(w, pair_stride, x, K, len, acc, first); break;
        case 2: micro_dot_512<2>(w, pair_stride, x, K, len, acc, first); break;
        case 3: micro_dot_512<3>(w, pair_stride, x, K, len, acc, first); break;
        case 4: micro_dot_512<4>(w, pair_stride, x, K, len, acc, first); break;
        case 5: micro_dot_512<5>(w, pair_stride, x, K, len, acc, first); break;
        default: micro_dot_512<6>(w, pair_stride, x, K, len, acc, first); break;
    }
}

// x [T][K] to bfloat16, to nearest even (the instruction's rounding: denormals become zeros).
AVX512BF16 void round_rows_bf16(const float* x, int64_t T, int64_t K, uint16_t* out, int threads) {
#pragma omp parallel for num_threads(static_cast<int>(std::min<int64_t>(threads, T))) schedule(static)
    for (int64_t t = 0; t < T; ++t)
        for (int64_t k = 0; k < K; k += 16) {
            const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + t * K + k));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * K + k), (__m256i)h);
        }
}

// Do this CPU's prefills take `micro_dot_512`? (PIPELINE_KERNEL_BF16DOT=0 or
// PIPELINE_KERNEL_AVX512=0 say no: the float32 chain, the same bits as on an AVX2 CPU.)
bool dot_bf16() {
    static const bool yes = [] {
        const char* off = std::getenv("PIPELINE_KERNEL_BF16DOT");
        return wide_fma() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bf16") && !(off && off[0] == '0');
    }();
    return yes;
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
                int64_t p = 0;
                if (n >= WIDE_FMA_ROWS && wide_fma())  // PAIRS_512 pairs at a time, then the rest
                    for (; p + 2 * PAIRS_512 <= rows; p += 2 * PAIRS_512)
                        micro_512_n(n, wk + p * len, 2 * len, x + t * K + k0, K, len, acc + p * n, k0 == 0);
                for (; p < rows; p += 2)
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
// bits). A Q4_K product is sum_j fma(a_j, t_j, .) over its sub-blocks j, t_j = sum of q*x over
// the sub-block's 32 k (the scale applied once per sub-block, as llama.cpp does, but with float
// activations; see `micro_pairs`), minus sum_j dmin*m_j * X_j, where X_j is the sum of x over
// sub-block j (computed once per token row and call). A Q6_K product is sum_k fma(a*q, x) in the
// chain above, a*q rounded as gguf's own dequantization rounds it. Either way a row's chain does
// not depend on the pass, so the path is row-invariant.
//
// Packed (by `pack_q4k` / `pack_q6k`) per block of rows, k slice and strip of 8 rows, one
// super-block after another, the strip's 8 rows side by side so that one vector holds their
// codes at 4 k (llama.cpp's repacked layout, the same idea): one `maddubs` against a token row's
// 4 x8 then gives the 8 rows' partial sums, and a sub-block's add up in int16 before its scales
// multiply them (`micro_q8_rows`). A strip's super-block:
//   Q4_K: the rows' d (float[8]), their scales sc[j][r] (uint8, sub-block after sub-block), then
//         per sub-block of 32 k four vectors, vector v's bytes 4r .. 4r + 4 row r's codes at
//         k = 4v .. 4v + 4 of the sub-block in the low nibbles and at 16 + 4v .. in the high:
//         1120 bytes (4.375 bits a weight; the mins live apart, strip by strip, read by the
//         epilogue only: see `strip_entry`).
//   Q6_K: the rows' d (float[8]), their int8 scales by pairs of sub-blocks (per pair i, row r's
//         sc[2i] and sc[2i + 1] in bytes 2r, 2r + 1: what u's offset multiplies), the low 4 bits
//         of the codes u = q + 32 as Q4_K's, then per chunk of 32 k two vectors of their top 2
//         bits, one per nibble half, group v's at bits 2v of the same bytes (`Q6K::group`):
//         1696 bytes (6.6 bits a weight).
// Until 2026-12-02 a vector held two rows' 32 codes (a pair), and each sub-block of each row took
// its own `madd` by its scale: twice the multiplies of a pass at 4 token rows, on AVX2 cores that
// run them on one port. Decoding passes on rounded rows read the stream in registers at every
// width (`micro_q8_direct`; from GEMM_DECODING_FROM rows the GEMM). On float rows, a pass of 1-4
// token rows reads a pair's codes from the stream (`Q4K::sub`, `micro_pairs`); wider passes
// decode a strip (5-24 token rows) or a group of rows (more) once into float32 pairs in a
// per-thread scratch (Q4_K: the codes and the scales apart, for `micro_scaled`; Q6_K: a*q, for
// `micro`) and run every tile over it: the same values in the same chain, so a row's bits do
// not depend on which way its pass went. Prefills decode to bf16 instead (`decode_strip_bf16`),
// or on rounded rows to int8 codes, a byte each (`micro_q8_gemm`), in a chain of their own
// (prompt tokens are always prefilled).

constexpr int64_t QK = 256, STRIP = 8;
constexpr int64_t GGUF_Q4K = 144, GGUF_Q6K = 210;  // a super-block of one row, in the file
constexpr int DIRECT_MAX = 4, STRIPWISE_MAX = 24;  // the paths through a block, by width (`linear_blocks`)
constexpr int Q8_TILE = 4;                         // token rows a tile on rounded rows (2 or 3 vectors each)
static_assert(DIRECT_MAX <= TILE && Q8_TILE <= TILE);
constexpr int64_t SCRATCH_BYTES = 256 * 1024, ACC_BYTES = 128 * 1024;  // L2: 512 KB

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
    static constexpr int64_t D = 0, SCALES = 32, CODES = 96;  // where a strip's super-block's parts begin
    static constexpr int64_t bytes = CODES + 8 * 128;           // a strip's super-block
    static constexpr int SUBS = 8, GROUPS = 4;                  // sub-blocks of 32 k, groups of 8 k in each
    static constexpr bool FACTORED = true;                      // the scale once per sub-block (see `micro_pairs`)
    static void pack(const uint8_t* const rows[8], uint8_t* dst) {  // one strip's super-block
        std::memset(dst, 0, bytes);
        for (int r = 0; r < 8; ++r) {
            if (!rows[r]) continue;
            float d, dmin;
            uint8_t sc[8], m[8], q[256];
            q4k_fields(rows[r], d, dmin, sc, m, q);
            std::memcpy(dst + D + 4 * r, &d, 4);
            for (int j = 0; j < 8; ++j) {
                dst[SCALES + 8 * j + r] = sc[j];
                for (int b = 0; b < 16; ++b)  // k = 32j + b in the low nibble, 32j + 16 + b in the high
                    dst[CODES + 128 * j + 32 * (b / 4) + 4 * r + b % 4] =
                        static_cast<uint8_t>(q[32 * j + b] | q[32 * j + 16 + b] << 4);
            }
        }
    }
    static inline void scales(const uint8_t* sb, int p, float* a0, float* a1) {
        for (int r = 0; r < 2; ++r) {
            alignas(8) uint8_t sc[8];
            for (int j = 0; j < 8; ++j) sc[j] = sb[SCALES + 8 * j + 2 * p + r];
            _mm256_store_ps(r ? a1 : a0, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)))),
                                                       _mm256_broadcast_ss(reinterpret_cast<const float*>(sb + D) + 2 * p + r)));
        }
    }
    struct Sub {
        const uint8_t* q;  // the sub-block's codes, at the pair's first row (8 bytes a group of 4 k)
    };
    static inline Sub sub(const uint8_t* sb, int p, int j) { return {sb + CODES + 128 * j + 8 * p}; }
    // group g's 8 k are groups of 4 k 2g and 2g + 1: vectors 2g % 4 and the next, the low nibbles
    // for g < 2, the high ones after; a vector's bytes 8p .. 8p + 8 hold the pair's rows' 4 codes
    static inline void codes(const Sub& u, int g, __m256& w0, __m256& w1) {  // widened to 8 lanes a row
        const int v = 2 * g % 4;
        const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u.q + 32 * v));
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u.q + 32 * (v + 1)));
        __m128i both = _mm_unpacklo_epi32(a, b);  // row o's 8 codes, then row o+1's
        both = _mm_and_si128(g < 2 ? both : _mm_srli_epi16(both, 4), _mm_set1_epi8(15));
        w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(both));
        w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(both, both)));
    }
    static inline void weights(const Sub& u, int g, __m256 a0, __m256 a1, __m256& w0, __m256& w1) {
        codes(u, g, w0, w1);
        w0 = _mm256_mul_ps(w0, a0);
        w1 = _mm256_mul_ps(w1, a1);
    }
};
struct Q6K {
    static constexpr int64_t D = 0, SCALES = 32, LOW = 160, HIGH = LOW + 8 * 128;  // where the parts begin
    static constexpr int64_t bytes = HIGH + 8 * 64;
    static constexpr int SUBS = 16, GROUPS = 2;  // sub-blocks of 16 k
    static constexpr bool FACTORED = false;      // each weight a*q, then one fma per weight
    static void pack(const uint8_t* const rows[8], uint8_t* dst) {
        std::memset(dst, 0, bytes);
        for (int r = 0; r < 8; ++r) {
            if (!rows[r]) continue;
            float d;
            int8_t sc[16], q[256];
            q6k_fields(rows[r], d, sc, q);
            std::memcpy(dst + D + 4 * r, &d, 4);
            for (int j = 0; j < 16; ++j) dst[SCALES + 16 * (j / 2) + 2 * r + j % 2] = static_cast<uint8_t>(sc[j]);
            for (int c = 0; c < 8; ++c)
                for (int b = 0; b < 32; ++b) {  // k = 32c + b: group (b / 4) % 4 of half b / 16
                    const int u = q[32 * c + b] + 32, h = b / 16, v = b % 16 / 4, at = 4 * r + b % 4;
                    dst[LOW + 128 * c + 32 * v + at] |= static_cast<uint8_t>((u & 15) << (4 * h));
                    dst[HIGH + 64 * c + 32 * h + at] |= static_cast<uint8_t>((u >> 4) << (2 * v));
                }
        }
    }
    static inline void scales(const uint8_t* sb, int p, float* a0, float* a1) {
        for (int r = 0; r < 2; ++r) {
            float* a = r ? a1 : a0;
            alignas(16) int8_t sc[16];
            for (int j = 0; j < 16; ++j) sc[j] = static_cast<int8_t>(sb[SCALES + 16 * (j / 2) + 2 * (2 * p + r) + j % 2]);
            const __m256 d = _mm256_broadcast_ss(reinterpret_cast<const float*>(sb + D) + 2 * p + r);
            const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(sc));
            _mm256_store_ps(a, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d));
            _mm256_store_ps(a + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v))), d));
        }
    }
    struct Sub {
        __m128i q0, q1;  // the sub-block's 16 codes q = u - 32 of either row, as int8
    };
    static inline Sub sub(const uint8_t* sb, int p, int j) {  // decoded once, for its two groups
        const int c = j / 2, h = j % 2;
        const uint8_t* low = sb + LOW + 128 * c + 8 * p;
        auto two = [&](int v) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(low + 32 * v)); };
        // groups 0-3 of the half: rows o and o+1's 4 bytes each, row o's 16 first
        const __m128i t01 = _mm_unpacklo_epi32(two(0), two(1)), t23 = _mm_unpacklo_epi32(two(2), two(3));
        __m128i l0 = _mm_unpacklo_epi64(t01, t23), l1 = _mm_unpackhi_epi64(t01, t23);
        const __m128i nibble = _mm_set1_epi8(15);
        l0 = _mm_and_si128(h ? _mm_srli_epi16(l0, 4) : l0, nibble);
        l1 = _mm_and_si128(h ? _mm_srli_epi16(l1, 4) : l1, nibble);
        // the high 2 bits of group v at bits 2v of the row's 4 bytes: each group's copy shifted
        const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + HIGH + 64 * c + 32 * h + 8 * p));
        const __m128i by_group = _mm_setr_epi32(0, 2, 4, 6), two_bits = _mm_set1_epi8(3);
        auto high = [&](int row) {
            const __m128i v = _mm_srlv_epi32(_mm_shuffle_epi32(hi, row ? 0x55 : 0x00), by_group);
            return _mm_slli_epi16(_mm_and_si128(v, two_bits), 4);
        };
        const __m128i bias = _mm_set1_epi8(32);
        return {_mm_sub_epi8(_mm_or_si128(l0, high(0)), bias), _mm_sub_epi8(_mm_or_si128(l1, high(1)), bias)};
    }
    static inline void codes(const Sub& u, int g, __m256& w0, __m256& w1) {  // group g's 8, widened
        w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(g ? _mm_unpackhi_epi64(u.q0, u.q0) : u.q0));
        w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(g ? _mm_unpackhi_epi64(u.q1, u.q1) : u.q1));
    }
    static inline void weights(const Sub& u, int g, __m256 a0, __m256 a1, __m256& w0, __m256& w1) {
        codes(u, g, w0, w1);
        w0 = _mm256_mul_ps(w0, a0);
        w1 = _mm256_mul_ps(w1, a1);
    }
    // the 8 rows' codes u (0..63) of group v (4 k) of half h of a chunk, from its vectors
    static inline __m256i group(__m256i low, __m256i high, int v, int h) {
        const __m256i nibble = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
        const __m256i l = _mm256_and_si256(h ? _mm256_srli_epi16(low, 4) : low, nibble);
        const __m256i t = v == 0 ? _mm256_slli_epi16(high, 4) : v == 1 ? _mm256_slli_epi16(high, 2)
                        : v == 2 ? high : _mm256_srli_epi16(high, 2);
        return _mm256_or_si256(l, _mm256_and_si256(t, top));
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

// The Q4_K mins, apart from the stream, strip by strip, so that the epilogue of a decoding pass
// reads a strip's in one run (`strip_mins_q8`): per strip of 8 rows and super-block (entry
// `strip_entry`), the rows' 8 dmin (floats, row after row), and their sub-block mins m, 64 bytes:
// per pair of sub-blocks (2q, 2q + 1), row after row, the row's m_2q and m_2q+1. Rows past O
// are zeros.
inline int64_t strip_entry(int64_t o, int64_t s, int64_t per_row) { return o / STRIP * per_row + s; }
inline int64_t min_at(int64_t o, int j) { return 16 * (j / 2) + 2 * (o % STRIP) + j % 2; }  // m in its entry

void pack_q4k_mins(const uint8_t* src, int64_t O, int64_t K, float* dmin, uint8_t* m) {
    const int64_t per_row = K / QK, padded = (O + STRIP - 1) / STRIP * STRIP;
    std::memset(dmin, 0, padded * per_row * sizeof(float));
    std::memset(m, 0, padded * per_row * 8);
    for (int64_t o = 0; o < O; ++o)
        for (int64_t s = 0; s < per_row; ++s) {
            float d;
            uint8_t sc[8], mins[8], q[256];
            const int64_t at = strip_entry(o, s, per_row);
            q4k_fields(src + (o * per_row + s) * GGUF_Q4K, d, dmin[STRIP * at + o % STRIP], sc, mins, q);
            for (int j = 0; j < 8; ++j) m[8 * STRIP * at + min_at(o, j)] = mins[j];
        }
}

// P pairs of a strip's slice (from pair p0) against N token rows. The chain of each output:
// - FACTORED kinds (Q4_K): per sub-block, t = sum of q*x over its groups of 8 k (a product, then
//   fused multiply-adds), then acc = fma(a, t, acc): one multiply by the scale per sub-block
//   rather than per weight, which made a 1-token pass of the 1.5B target's Q4_K layers 1.2x
//   faster on one core (the widening and the multiply were the cost, not the memory).
// - others (Q6_K, 16 k a sub-block, where a scale per sub-block saves less than it costs in
//   wider passes): acc = fma(a*q, x, acc) weight after weight.
// Each group's x is loaded once for every pair, and 2*P*N chains are in flight (8 here), so
// that the core waits neither on loads nor on the latency of its fused multiply-adds.
template <int N, int P, typename B>
inline void micro_pairs(const uint8_t* w, int p0, const float* x, int64_t K, int64_t len, __m256* acc, bool first) {
    __m256 c[2 * P * N];
    for (int i = 0; i < 2 * P * N; ++i) c[i] = first ? _mm256_setzero_ps() : acc[i];
    constexpr int SUB_K = QK / B::SUBS;
    for (int64_t s = 0; s < len; s += QK, w += B::bytes) {
        alignas(32) float sc[P][2][B::SUBS];
        for (int p = 0; p < P; ++p) B::scales(w, p0 + p, sc[p][0], sc[p][1]);
        for (int j = 0; j < B::SUBS; ++j) {
            typename B::Sub u[P];
            __m256 s0[P], s1[P];
            for (int p = 0; p < P; ++p) {
                u[p] = B::sub(w, p0 + p, j);
                s0[p] = _mm256_broadcast_ss(&sc[p][0][j]);
                s1[p] = _mm256_broadcast_ss(&sc[p][1][j]);
            }
            __m256 t[2 * P * N];  // FACTORED: the sub-block's sums
            for (int g = 0; g < B::GROUPS; ++g)
                for (int n = 0; n < N; ++n) {
                    const __m256 xv = _mm256_loadu_ps(x + n * K + s + SUB_K * j + 8 * g);
                    for (int p = 0; p < P; ++p) {
                        __m256 w0, w1;
                        __m256 &c0 = c[(2 * p) * N + n], &c1 = c[(2 * p + 1) * N + n];
                        if constexpr (B::FACTORED) {
                            B::codes(u[p], g, w0, w1);
                            __m256 &t0 = t[(2 * p) * N + n], &t1 = t[(2 * p + 1) * N + n];
                            t0 = g ? _mm256_fmadd_ps(w0, xv, t0) : _mm256_mul_ps(w0, xv);
                            t1 = g ? _mm256_fmadd_ps(w1, xv, t1) : _mm256_mul_ps(w1, xv);
                        } else {
                            B::weights(u[p], g, s0[p], s1[p], w0, w1);
                            c0 = _mm256_fmadd_ps(w0, xv, c0);
                            c1 = _mm256_fmadd_ps(w1, xv, c1);
                        }
                    }
                }
            if constexpr (B::FACTORED)
                for (int p = 0; p < P; ++p)
                    for (int n = 0; n < N; ++n) {
                        c[(2 * p) * N + n] = _mm256_fmadd_ps(s0[p], t[(2 * p) * N + n], c[(2 * p) * N + n]);
                        c[(2 * p + 1) * N + n] = _mm256_fmadd_ps(s1[p], t[(2 * p + 1) * N + n], c[(2 * p + 1) * N + n]);
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

// A strip's slice decoded into float32 weights a*q in pairs (the `f32` layout, a pair's 2 * len
// values `pair_stride` floats after the last pair's): what `micro` reads for wider passes of the
// kinds that are not FACTORED.
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

// The same for FACTORED kinds: float32 codes q in pairs, and each pair's sub-block scales a = d*sc
// (`scale_stride` floats after the last pair's; row o's from `sc`, row o+1's `half` floats on):
// what `micro_scaled` reads.
template <typename B>
inline void decode_codes(const uint8_t* w, int64_t len, float* dst, int64_t pair_stride, float* sc,
                         int64_t scale_stride, int64_t half) {
    for (int p = 0; p < 4; ++p) {
        float* out = dst + p * pair_stride;
        float *a0 = sc + p * scale_stride, *a1 = a0 + half;
        const uint8_t* sb = w;
        for (int64_t s = 0; s < len; s += QK, sb += B::bytes, a0 += B::SUBS, a1 += B::SUBS) {
            B::scales(sb, p, a0, a1);
            for (int j = 0; j < B::SUBS; ++j) {
                const typename B::Sub u = B::sub(sb, p, j);
                for (int g = 0; g < B::GROUPS; ++g, out += 16) {
                    __m256 w0, w1;
                    B::codes(u, g, w0, w1);
                    _mm256_store_ps(out, w0);
                    _mm256_store_ps(out + 8, w1);
                }
            }
        }
    }
}

// One pair of decoded rows (`decode_codes`) against N token rows over `len` k, in the chain of
// `micro_pairs`: per sub-block of SUB_K, t = sum of code*x (a product, then fused multiply-adds
// in k order), then acc = fma(a, t, acc). One row of the pair after the other: the N sums t and
// N accumulators of one row fit the registers, those of both did not.
template <int N, int SUB_K>
inline void micro_scaled(const float* w, const float* a0, const float* a1, const float* x, int64_t K, int64_t len,
                         __m256* acc, bool first) {
    for (int r = 0; r < 2; ++r) {
        const float* a = r ? a1 : a0;
        __m256 c[N];
        for (int n = 0; n < N; ++n) c[n] = first ? _mm256_setzero_ps() : acc[r * N + n];
        const float* wr = w + 8 * r;
        for (int64_t k = 0, j = 0; k < len; k += SUB_K, ++j) {
            __m256 t[N];
            for (int g = 0; g < SUB_K / 8; ++g, wr += 16) {
                const __m256 wv = _mm256_load_ps(wr);
                for (int n = 0; n < N; ++n) {
                    const __m256 xv = _mm256_loadu_ps(x + n * K + k + 8 * g);
                    t[n] = g ? _mm256_fmadd_ps(wv, xv, t[n]) : _mm256_mul_ps(wv, xv);
                }
            }
            const __m256 s = _mm256_broadcast_ss(a + j);
            for (int n = 0; n < N; ++n) c[n] = _mm256_fmadd_ps(s, t[n], c[n]);
        }
        for (int n = 0; n < N; ++n) acc[r * N + n] = c[n];
    }
}

template <int SUB_K>
inline void micro_scaled_n(int n, const float* w, const float* a0, const float* a1, const float* x, int64_t K,
                           int64_t len, __m256* acc, bool first) {
    switch (n) {
        case 1: micro_scaled<1, SUB_K>(w, a0, a1, x, K, len, acc, first); break;
        case 2: micro_scaled<2, SUB_K>(w, a0, a1, x, K, len, acc, first); break;
        case 3: micro_scaled<3, SUB_K>(w, a0, a1, x, K, len, acc, first); break;
        case 4: micro_scaled<4, SUB_K>(w, a0, a1, x, K, len, acc, first); break;
        case 5: micro_scaled<5, SUB_K>(w, a0, a1, x, K, len, acc, first); break;
        default: micro_scaled<6, SUB_K>(w, a0, a1, x, K, len, acc, first); break;
    }
}

// A strip's slice decoded into bfloat16 pairs: the blocks' values as gguf dequantizes them (a*q,
// less the Q4_K min) rounded to bfloat16, which is what the install's bf16 weights hold. For
// prefills (see `linear_blocks`). Laid out for `micro_512` / `micro` (the `bf16` layout: per k
// one 32-bit lane with row o's value in the low half, row o+1's in the high half; for
// `micro_dot_512`, see `decode_strip_dot`). `mins`: the strip's rows' min factors (row r at
// r * subs), from sub-block `sub0` of the slice on; nullptr for Q6_K.
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

// The same `DOT` layout on CPUs with AVX512_BF16 (the only ones that read it), rounded by the
// instruction (`vcvtneps2bf16`: to nearest even, as `decode_strip_bf16`'s arithmetic; it would
// flush denormals, and a block's value is 0 or at least 2^-24, so there are none): a prefill of
// a wide layer decodes its blocks once per group of tiles, and the rounding was most of that.
// A loop of its own, `decode_strip_bf16`'s but for the store: the instruction needs this
// function's target, and GCC will not inline it into a loop compiled for AVX2.
template <typename B>
AVX512BF16 void decode_strip_dot(const uint8_t* w, int64_t len, uint16_t* dst, int64_t pair_stride, const float* mins,
                                 int64_t subs, int64_t sub0) {
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
                    // a 16-k chunk is two groups of one sub-block: row o's 16 values, then row o+1's
                    uint16_t* chunk = out - 16 * (g % 2);
                    _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk + 8 * (g % 2)), (__m128i)_mm256_cvtneps_pbh(w0));
                    _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk + 16 + 8 * (g % 2)), (__m128i)_mm256_cvtneps_pbh(w1));
                }
            }
        }
    }
}

// Sum of each token row's x over every sub-block of 32 (the Q4_K mins' partner): one fixed
// chain per sub-block (4 vectors added in order, then `hsum`).
void sub_block_sums(const float* x, int64_t T, int64_t K, float* sums, int threads) {
#pragma omp parallel for num_threads(static_cast<int>(std::min<int64_t>(threads, T))) schedule(static)
    for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < K / 32; ++j) {
            const float* p = x + t * K + 32 * j;
            __m256 v = _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
            v = _mm256_add_ps(v, _mm256_loadu_ps(p + 16));
            v = _mm256_add_ps(v, _mm256_loadu_ps(p + 24));
            sums[t * (K / 32) + j] = hsum(v);
        }
}

// Row o's Q4_K min factors of super-block s, b_j = dmin*m_j (exact: 11 + 6 bits).
inline __m256 min_factors(const float* dmin, const uint8_t* m, int64_t o, int64_t s, int64_t per_row) {
    const int64_t at = strip_entry(o, s, per_row);
    const uint8_t* entry = m + 8 * STRIP * at;
    const __m256i ms = _mm256_setr_epi32(entry[min_at(o, 0)], entry[min_at(o, 1)], entry[min_at(o, 2)], entry[min_at(o, 3)],
                                         entry[min_at(o, 4)], entry[min_at(o, 5)], entry[min_at(o, 6)], entry[min_at(o, 7)]);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(ms), _mm256_broadcast_ss(dmin + STRIP * at + o % STRIP));
}

// ... all K/32 of each row of the strip from row o (a multiple of 8), row r's at b + r * K/32,
// for prefills and wide passes. The strip's mins of a super-block turned row by row: as 16-bit
// pairs, rows in order for each pair of sub-blocks, then transposed 4 x 8.
inline void strip_min_factors(const float* dmin, const uint8_t* m, int64_t o, int64_t K, float* b) {
    const int64_t per_row = K / QK;
    for (int64_t s = 0; s < per_row; ++s) {
        const int64_t at = strip_entry(o, s, per_row);
        const uint8_t* e = m + 8 * STRIP * at;
        auto pairs = [&](int q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(e + 16 * q)); };
        const __m128i p0 = pairs(0), p1 = pairs(1), p2 = pairs(2), p3 = pairs(3);
        // [sub-block pair 0 and 1 of rows 0-3], [of rows 4-7], then the same for pairs 2 and 3
        const __m128i a = _mm_unpacklo_epi16(p0, p1), b4 = _mm_unpackhi_epi16(p0, p1);
        const __m128i c = _mm_unpacklo_epi16(p2, p3), d4 = _mm_unpackhi_epi16(p2, p3);
        const __m128i rows[4] = {_mm_unpacklo_epi32(a, c), _mm_unpackhi_epi32(a, c), _mm_unpacklo_epi32(b4, d4),
                                 _mm_unpackhi_epi32(b4, d4)};  // two rows' 8 mins each, in order
        for (int r = 0; r < STRIP; ++r) {
            const __m128i ms = r % 2 ? _mm_unpackhi_epi64(rows[r / 2], rows[r / 2]) : rows[r / 2];
            _mm256_storeu_ps(b + r * (K / 32) + 8 * s, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ms)),
                                                                   _mm256_broadcast_ss(dmin + STRIP * at + r)));
        }
    }
}

// The Q4_K mins of one row as `finish` reads them: its min factors computed once (`b`, for
// many token rows), or from its dmin and m as it goes (a few). The same values either way.
struct RowMins {
    const float* b;
    const float* dmin;
    const uint8_t* m;
    int64_t o, per_row;
    inline __m256 factors(int64_t s) const {  // those of super-block s
        return b ? _mm256_loadu_ps(b + 8 * s) : min_factors(dmin, m, o, s, per_row);
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

// ---------------------------------------------------------------------------------------------
// Q4_K against activations rounded to 8 bits (`linear_q4k(..., q8)`), as llama.cpp's Q8_K:
// each token row's every super-block of 256 k becomes 256 int8 values x8 and one float scale
// dx = max|x| / 127. A pair's codes (0..15) and x8 then multiply as integers, 32 at a time
// (`maddubs`), times the sub-block's 6-bit scale (`madd`), summed over the super-block in int32:
// exact, so in any order. One float step a super-block: acc = fma(d*dx, sum, acc). About a third
// of the float path's instructions a weight, so that a 1-token pass is no longer bound by
// arithmetic. The mins' term reads the same rounded x (`quantize_q8`'s sub-block sums), so the
// output is the blocks' weights against the rounded activations. Row-invariant like the rest: a
// row's x8 and dx depend on that row alone, its integer sums on nothing else.

// x8 [T][K], dx [T][K/256] and sums [T][K/32], the sum of x8 over each sub-block of 32 (exact:
// at most 32 * 127).
void quantize_q8(const float* x, int64_t T, int64_t K, int8_t* x8, float* dx, int16_t* sums, int threads) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for num_threads(static_cast<int>(std::min<int64_t>(threads, T))) schedule(static)
    for (int64_t t = 0; t < T; ++t)
        for (int64_t s = 0; s < K / QK; ++s) {
            const float* p = x + t * K + s * QK;
            __m256 m = _mm256_setzero_ps();
            for (int k = 0; k < QK; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(p + k)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
            const float amax = _mm_cvtss_f32(h), d = amax / 127.0f;
            const __m256 inv = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
            dx[t * (K / QK) + s] = d;
            int8_t* q = x8 + t * K + s * QK;
            for (int j = 0; j < QK / 32; ++j) {
                __m256i v[4];
                for (int g = 0; g < 4; ++g) {  // nearest, ties to even; within [-127, 127]
                    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(p + 32 * j + 8 * g), inv);
                    v[g] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-127.0f)),
                                                            _mm256_set1_ps(127.0f)));
                }
                const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
                __m128i r = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
                r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0x4E));
                r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0xB1));
                if (sums) sums[t * (K / 32) + s * 8 + j] = static_cast<int16_t>(_mm_cvtsi128_si32(r));
                // packs interleave 128-bit lanes; the permute restores k order
                const __m256i w16 = _mm256_packs_epi32(v[0], v[1]), x16 = _mm256_packs_epi32(v[2], v[3]);
                const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, x16),
                                                              _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * j), b);
            }
        }
}

// The strip's super-block two ahead into L1: with a third of the float path's arithmetic the
// stream, not the core, sets the pace, and the hardware's prefetcher alone left about 15% of
// it on the table (one core, one 8960 x 1536 layer from memory: 7.2 against 8.3 GB/s). Marked
// non-temporal: a pass reads each block once, and the stream's lines then do not push out of
// the caches what the rest of the pass reads between the products (activations, keys and
// values, the interpreter's and torch's own state). Whole 1-token passes 0.89x the time of
// the same prefetch into every level (AVX2-only EPYC, Zen 2, paired; docs/cpu-kernels.md).
template <int64_t BYTES>
inline void prefetch_ahead(const uint8_t* w) {
    for (int64_t l = 0; l < BYTES; l += 64) _mm_prefetch(reinterpret_cast<const char*>(w + 2 * BYTES + l), _MM_HINT_NTA);
}

// The one float step of a super-block, every kernel on rounded rows alike (decoding passes and
// the GEMM): acc[n] = fma(d * dx, sum, acc[n]) for N token rows, d the strip's 8 rows' factors
// (floats at `d`), dx each token row's rounding scale (K / 256 floats a token row), sum the
// super-block's exact integer a row a lane.
template <int N>
inline void super_block_step(const uint8_t* d, const float* dx, int64_t K, const __m256i* sum, __m256* acc) {
    const __m256 rows = _mm256_loadu_ps(reinterpret_cast<const float*>(d));
    for (int n = 0; n < N; ++n)
        acc[n] = _mm256_fmadd_ps(_mm256_mul_ps(rows, _mm256_set1_ps(dx[n * (K / QK)])), _mm256_cvtepi32_ps(sum[n]), acc[n]);
}

// Q6_K's partner sums for u's offset (`micro_q8_q6k_rows`, `micro_q8_gemm`): each token row's
// sums of x8 over every 16 k, exact in int16 (at most 16 * 127); the caller frees them.
inline int16_t* sums_of_16(const int8_t* x8, int64_t T, int64_t K) {
    int16_t* xs16 = static_cast<int16_t*>(std::aligned_alloc(32, (T * (K / 16) * 2 + 31) / 32 * 32));
    for (int64_t i = 0; i < T * (K / 16); ++i) {
        int sum = 0;
        for (int k = 0; k < 16; ++k) sum += x8[16 * i + k];
        xs16[i] = static_cast<int16_t>(sum);
    }
    return xs16;
}

// Q6_K's offset for a pair of sub-blocks (2i, 2i + 1): its codes are u - 32, so a super-block's
// integer sum of u * x8 comes down by 32 * (sc_2i * xs_2i + sc_2i+1 * xs_2i+1), the rows' two
// scales paired (row r's in lanes 2r, 2r + 1) against the token row's two sums of 16 (`xs`).
inline __m256i q6k_offset(__m256i paired, const int16_t* xs) {
    int32_t two;
    std::memcpy(&two, xs, 4);
    return _mm256_slli_epi32(_mm256_madd_epi16(paired, _mm256_set1_epi32(two)), 5);
}

// A Q4_K strip's slice against N rounded token rows (`quantize_q8`), the strip's 8 rows a lane:
// acc[8n + r] for token row n and row r. A vector of the stream holds the 8 rows' codes at 4 k
// (low nibbles) and at 4 k 16 further (high), so that one `maddubs` against the token row's 4
// x8 broadcast gives the 8 rows' partial sums, and a sub-block's 8 `maddubs` add up in int16
// (|sum| <= 8 * 2 * 15 * 127 < 2^15) before one `madd` by the rows' 8 scales. Per 256 weights a
// token row that is 8 `maddubs` and one `madd`, where a pair of rows a vector took 8 and 8 (the
// multiplies are what AVX2 cores run on one port): from L2, a 1-token product 1.5x faster on
// the AVX2-only EPYC. The sum of a super-block is the same integer either way, and its float
// step acc = fma(d * dx, sum, acc) the same (`super_block_step`), so the bits are too.
template <int N>
inline void micro_q8_rows(const uint8_t* w, const int8_t* x8, const float* dx, int64_t K, int64_t len, float* acc,
                          bool first) {
    __m256 c[N];
    for (int n = 0; n < N; ++n) c[n] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + 8 * n);
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t s = 0; s < len; s += QK, w += Q4K::bytes) {
        __m256i sum[N];
        for (int n = 0; n < N; ++n) sum[n] = _mm256_setzero_si256();
        prefetch_ahead<Q4K::bytes>(w);
        for (int j = 0; j < 8; ++j) {
            __m256i part[N];
            for (int n = 0; n < N; ++n) part[n] = _mm256_setzero_si256();
            for (int v = 0; v < 4; ++v) {
                const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + Q4K::CODES + 128 * j + 32 * v));
                const __m256i q0 = _mm256_and_si256(q, low), q1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                for (int n = 0; n < N; ++n) {
                    int32_t x0, x1;  // the token row's 4 x8 at either nibble's k
                    std::memcpy(&x0, x8 + n * K + s + 32 * j + 4 * v, 4);
                    std::memcpy(&x1, x8 + n * K + s + 32 * j + 16 + 4 * v, 4);
                    part[n] = _mm256_add_epi16(part[n], _mm256_maddubs_epi16(q0, _mm256_set1_epi32(x0)));
                    part[n] = _mm256_add_epi16(part[n], _mm256_maddubs_epi16(q1, _mm256_set1_epi32(x1)));
                }
            }
            // the rows' scales of sub-block j as int16, row r's in lanes 2r and 2r + 1
            const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + Q4K::SCALES + 8 * j)));
            const __m256i paired = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
            for (int n = 0; n < N; ++n) sum[n] = _mm256_add_epi32(sum[n], _mm256_madd_epi16(part[n], paired));
        }
        super_block_step<N>(w + Q4K::D, dx + s / QK, K, sum, c);
    }
    for (int n = 0; n < N; ++n) _mm256_store_ps(acc + 8 * n, c[n]);
}

// The same for Q6_K (codes q = u - 32, u in 0..63, a scale per 16 k): a chunk of 32 k is four
// vectors of the 8 rows' low 4 bits at 4 k (low nibbles) and 4 k 16 further (high), and two of
// their top 2 bits, each group's at bits 2v (`Q6K::group`). A sub-block's 4 `maddubs` of u
// against x8 add up two at a time in int16 (2 * 2 * 63 * 127 < 2^15), times the rows' scales
// (`madd`); u's offset comes off once a sub-block pair: 32 * (sc_2i * xs_2i + sc_2i+1 * xs_2i+1)
// (xs16: the token row's sums of x8 over each 16 k), the scales paired as the stream holds them.
// The same integer a super-block as before, so the same float step and bits.
template <int N>
inline void micro_q8_q6k_rows(const uint8_t* w, const int8_t* x8, const float* dx, const int16_t* xs16, int64_t K,
                              int64_t len, float* acc, bool first) {
    __m256 c[N];
    for (int n = 0; n < N; ++n) c[n] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + 8 * n);
    // a sub-block pair's scales (row r's two in lanes 2r, 2r + 1) to sub-block 2i's or 2i + 1's in both
    const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9,
                                          8, 9, 12, 13, 12, 13);
    const __m256i odd = _mm256_add_epi8(even, _mm256_set1_epi8(2));
    for (int64_t s = 0; s < len; s += QK, w += Q6K::bytes) {
        __m256i sum[N];
        for (int n = 0; n < N; ++n) sum[n] = _mm256_setzero_si256();
        prefetch_ahead<Q6K::bytes>(w);
        for (int ch = 0; ch < 8; ++ch) {
            const __m256i paired = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + Q6K::SCALES + 16 * ch)));
            for (int n = 0; n < N; ++n)
                sum[n] = _mm256_sub_epi32(sum[n], q6k_offset(paired, xs16 + n * (K / 16) + s / 16 + 2 * ch));
            for (int h = 0; h < 2; ++h) {
                const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + Q6K::HIGH + 64 * ch + 32 * h));
                const __m256i sc = _mm256_shuffle_epi8(paired, h ? odd : even);
                for (int half = 0; half < 2; ++half) {  // groups summed in int16, two at a time
                    __m256i part[N];
                    for (int n = 0; n < N; ++n) part[n] = _mm256_setzero_si256();
                    for (int v = 2 * half; v < 2 * half + 2; ++v) {
                        const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + Q6K::LOW + 128 * ch + 32 * v));
                        const __m256i u = Q6K::group(low, high, v, h);
                        for (int n = 0; n < N; ++n) {
                            int32_t four;
                            std::memcpy(&four, x8 + n * K + s + 32 * ch + 16 * h + 4 * v, 4);
                            part[n] = _mm256_add_epi16(part[n], _mm256_maddubs_epi16(u, _mm256_set1_epi32(four)));
                        }
                    }
                    for (int n = 0; n < N; ++n) sum[n] = _mm256_add_epi32(sum[n], _mm256_madd_epi16(part[n], sc));
                }
            }
        }
        super_block_step<N>(w + Q6K::D, dx + s / QK, K, sum, c);
    }
    for (int n = 0; n < N; ++n) _mm256_store_ps(acc + 8 * n, c[n]);
}

// A strip's slice against a tile of n rounded token rows (1 to Q8_TILE), a token row's 8 outputs a
// vector (`acc + 8 * token`).
template <typename B>
inline void micro_q8_direct(int n, const uint8_t* w, const int8_t* x8, const float* dx, const int16_t* xs16, int64_t K,
                            int64_t len, float* acc, bool first) {
    if constexpr (B::FACTORED) {
        switch (n) {
            case 1: return micro_q8_rows<1>(w, x8, dx, K, len, acc, first);
            case 2: return micro_q8_rows<2>(w, x8, dx, K, len, acc, first);
            case 3: return micro_q8_rows<3>(w, x8, dx, K, len, acc, first);
            default: return micro_q8_rows<Q8_TILE>(w, x8, dx, K, len, acc, first);
        }
    } else {
        switch (n) {
            case 1: return micro_q8_q6k_rows<1>(w, x8, dx, xs16, K, len, acc, first);
            case 2: return micro_q8_q6k_rows<2>(w, x8, dx, xs16, K, len, acc, first);
            case 3: return micro_q8_q6k_rows<3>(w, x8, dx, xs16, K, len, acc, first);
            default: return micro_q8_q6k_rows<Q8_TILE>(w, x8, dx, xs16, K, len, acc, first);
        }
    }
}

// Three ways through a block of rows, by the width of the pass (the same chain each way):
// up to DIRECT_MAX token rows decode the blocks in registers, once per tile; up to STRIPWISE_MAX
// decode each strip's slice once into L1 and run `micro` over it for every tile; wider passes
// (prefills) decode the block's rows over a range of k into L2 and run every tile over that,
// every tile's accumulators kept in memory between ranges: the token rows are then read once
// per block of rows, not once per few rows (a prefill's rows of a 8960-wide input are 14 MB).
// The Q4_K mins' term of a strip's 8 rows (`strip_entry`) against n rounded token rows, in
// integers as llama.cpp takes it: per super-block s, I_r = sum_j m_rj * xs_j (exact in int32:
// one `madd` per pair of sub-blocks gives the 8 rows' products in their lanes), then term_r =
// fma(dmin_r * dx_s, I_r, term_r), one lane a row, super-block after super-block. A row's term
// depends on its mins and its token row alone: row-invariant.
inline void strip_mins_q8(const uint8_t* m, const float* dmin, const int16_t* xs, const float* dx, int64_t K, int n,
                          __m256* term) {
    for (int i = 0; i < n; ++i) term[i] = _mm256_setzero_ps();
    for (int64_t s = 0; s < K / QK; ++s, m += 8 * STRIP, dmin += STRIP) {
        __m256i pair[4];  // sub-blocks 2q and 2q + 1: each row's two mins as int16, a row a lane
        for (int q = 0; q < 4; ++q) pair[q] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + 16 * q)));
        const __m256 d = _mm256_loadu_ps(dmin);
        for (int i = 0; i < n; ++i) {
            const int16_t* x = xs + i * (K / 32) + 8 * s;
            int32_t two[4];  // the token row's sums of sub-blocks 2q and 2q + 1, as madd pairs them
            std::memcpy(two, x, sizeof(two));
            __m256i sum = _mm256_madd_epi16(pair[0], _mm256_set1_epi32(two[0]));
            for (int q = 1; q < 4; ++q) sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pair[q], _mm256_set1_epi32(two[q])));
            term[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[i * (K / QK) + s])), _mm256_cvtepi32_ps(sum), term[i]);
        }
    }
}

// A strip's 8 outputs of one token row (`s`, a row a lane) plus the bias, into `out` (row o's
// output; those of rows at or past O are not written).
inline void store_strip(__m256 s, int64_t o, int64_t O, const float* bias, float* out) {
    const int64_t rows = std::min<int64_t>(STRIP, O - o);
    if (rows == STRIP) {
        if (bias) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + o));
        _mm256_storeu_ps(out, s);
    } else {
        alignas(32) float v[STRIP];
        _mm256_store_ps(v, s);
        for (int64_t r = 0; r < rows; ++r) out[r] = bias ? v[r] + bias[o + r] : v[r];
    }
}

// The epilogue of a decoding pass on rounded rows, a strip's 8 rows at once (the row-at-a-time
// `finish` was 14% of a 1-token pass on one core): rows o..o+8 (those below O) for token rows
// t..t+n from their vectors (`micro_q8_direct`), less the mins' term where there is one, plus
// the bias: `micro_q8_gemm`'s epilogue, lane for lane.
inline void finish_strip(const float* acc, int n, int64_t o, int64_t t, int64_t O, const __m256* term,
                         const float* bias, float* y) {
    for (int i = 0; i < n; ++i) {
        __m256 s = _mm256_load_ps(acc + 8 * i);
        if (term) s = _mm256_sub_ps(s, term[i]);
        store_strip(s, o, O, bias, y + (t + i) * O + o);
    }
}

// ---------------------------------------------------------------------------------------------
// Prefills on rounded rows (`linear_q4k(..., prefill, q8)`) where prefills have no bf16 dot
// products (`dot_bf16`: AVX2 CPUs), and wide decoding passes. A prefill is bound by arithmetic.
// llama.cpp's AVX2 GEMM for Q4_K lays 8 rows' codes 4 k at a time in one vector: one `maddubs`
// against the token row's 4 x8 broadcast gives 8 rows' partial sums, and the 8 `maddubs` of a
// sub-block add up in int16 (|sum| <= 8 * 2 * 15 * 127 < 2^15) before one `madd` by the 8 rows'
// scales: 16 products an instruction. Q6_K's codes u = q + 32 (0..63) allow two `maddubs` in
// int16, and take 32 * sum sc * x8 off per super-block, in integers. The stream has held that
// layout since 2026-12-02 (the decoding kernels read it in registers); here a block's strips are
// decoded once per prefill into whole bytes (`decode_strip_q8`: the nibbles apart, the scales
// as int16), and every tile of token rows runs over them (`micro_q8_gemm`). Q4_K layers of 256
// token rows in AVX2 code, 2 threads, on the AVX-512 EPYC (Zen 4): 250-280 G products a second
// against about 100 on the float32 chain; Q6_K 196 G. On the AVX2-only EPYC (Zen 2), a 300-token
// prefill's Q4_K products made 100-105 G, its Q6_K ones 73 G (docs/cpu-kernels.md).
//
// The chain of an output (row-invariant: integer sums are exact in any order, and the float
// steps depend on the row's own x8, dx and weights): per super-block the integer sum of
// sc_j * q * x8 over its 256 k, then acc = fma(d * dx, sum, acc) super-block after super-block;
// the Q4_K mins' term as a decoding pass takes it (`strip_mins_q8`); y = acc - term (+ bias).
// That is the decoding kernels' chain too (the same `super_block_step`), so a prompt token
// prefilled here has the bits it would have in a decoding pass, and wide decoding passes take
// this kernel where it is faster (`gemm_decoding`).

// A strip's super-block decoded (`decode_strip_q8`): per chunk c of 32 k and group g of 4 k in
// it, 32 bytes holding row r's codes at k = 32c + 4g .. + 4 in bytes 4r .. 4r + 4 (Q4_K: q;
// Q6_K: u = q + 32, 0..63); per sub-block the rows' scales as int16, row r's in lanes 2r and
// 2r + 1; Q6_K: per pair of sub-blocks (2i, 2i + 1) row r's two scales in lanes 2r, 2r + 1 (for
// the 32 * sum sc * x8 that u's offset adds); the rows' 8 d.
template <typename B>
struct Q8Gemm {
    static constexpr int64_t CODES = 8 * 8 * 32, SCALES = B::SUBS * 32, PAIRED = B::FACTORED ? 0 : 8 * 32;
    static constexpr int64_t D = CODES + SCALES + PAIRED, bytes = D + 32;
};

// A strip's slice of `len` k into `dst` (`Q8Gemm<B>::bytes` a super-block): the stream's own
// groups (`micro_q8_rows`, `micro_q8_q6k_rows`), each code a byte, and the scales as int16.
template <typename B>
inline void decode_strip_q8(const uint8_t* w, int64_t len, uint8_t* dst) {
    using L = Q8Gemm<B>;
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t s = 0; s < len; s += QK, w += B::bytes, dst += L::bytes) {
        int16_t* scales = reinterpret_cast<int16_t*>(dst + L::CODES);
        std::memcpy(dst + L::D, w + B::D, 32);
        for (int c = 0; c < 8; ++c)
            for (int v = 0; v < 4; ++v) {
                __m256i* at = reinterpret_cast<__m256i*>(dst + 256 * c + 32 * v);
                if constexpr (B::FACTORED) {
                    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + Q4K::CODES + 128 * c + 32 * v));
                    _mm256_store_si256(at, _mm256_and_si256(q, low));
                    _mm256_store_si256(at + 4, _mm256_and_si256(_mm256_srli_epi16(q, 4), low));
                } else {
                    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + Q6K::LOW + 128 * c + 32 * v));
                    for (int h = 0; h < 2; ++h) {
                        const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + Q6K::HIGH + 64 * c + 32 * h));
                        _mm256_store_si256(at + 4 * h, Q6K::group(q, high, v, h));
                    }
                }
            }
        for (int j = 0; j < B::SUBS; ++j)  // row r's scale in lanes 2r and 2r + 1
            for (int r = 0; r < 8; ++r) {
                const int16_t v = B::FACTORED ? w[Q4K::SCALES + 8 * j + r]
                                              : static_cast<int8_t>(w[Q6K::SCALES + 16 * (j / 2) + 2 * r + j % 2]);
                scales[16 * j + 2 * r] = scales[16 * j + 2 * r + 1] = v;
            }
        if constexpr (!B::FACTORED)  // the pairs of sub-blocks' scales, as the stream holds them
            for (int i = 0; i < 8; ++i)
                _mm256_store_si256(reinterpret_cast<__m256i*>(dst + L::CODES + L::SCALES + 32 * i),
                                   _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + Q6K::SCALES + 16 * i))));
    }
}

// N token rows' int16 sums of a decoded strip's groups g0 .. g0 + G of chunk c against their x8
// (from the super-block's first k, K a row), added to part[n]: G `maddubs` a row, summed in
// int16. GCC, left to unroll it whole, took every group's products first and spilled them.
template <int N, int G>
inline void group_sums(const uint8_t* w, const int8_t* x8, int64_t K, int c, int g0, __m256i* part) {
#pragma GCC unroll 4
    for (int g = g0; g < g0 + G; ++g) {
        const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + 256 * c + 32 * g));
        for (int n = 0; n < N; ++n) {
            int32_t four;
            std::memcpy(&four, x8 + n * K + 32 * c + 4 * g, 4);
            part[n] = _mm256_add_epi16(part[n], _mm256_maddubs_epi16(q, _mm256_set1_epi32(four)));
        }
    }
}

// The end of a decoded super-block for N token rows, either kernel: Q6_K's sums less u's offset
// (`q6k_offset`), then acc = fma(d * dx, sum, acc).
template <typename B, int N>
inline void end_super_block(const uint8_t* w, const float* dx, const int16_t* xs16, int64_t K, int64_t s, __m256i* sum,
                            __m256* acc) {
    using L = Q8Gemm<B>;
    if constexpr (!B::FACTORED)
        for (int i = 0; i < 8; ++i) {
            const __m256i paired = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + L::CODES + L::SCALES + 32 * i));
            for (int n = 0; n < N; ++n) sum[n] = _mm256_sub_epi32(sum[n], q6k_offset(paired, xs16 + n * (K / 16) + s / 16 + 2 * i));
        }
    super_block_step<N>(w + L::D, dx + s / QK, K, sum, acc);
}

// A decoded strip's `len` k against N rounded token rows (x8 from the slice's first k, K a row;
// dx from its first super-block, K / 256 a row; Q6_K: xs16, the sums of x8 over each 16 k,
// K / 16 a row): acc[n], a row a lane. Per super-block an exact int32 sum a row: Q4_K, a
// sub-block's 8 groups summed in int16 (|sum| <= 8 * 2 * 15 * 127), times its scale (`madd`);
// Q6_K, two groups at a time (2 * 2 * 63 * 127), then less 32 * sum sc * xs16 for u's offset.
// Then acc = fma(d * dx, sum, acc).
template <typename B, int N>
inline void micro_q8_gemm(const uint8_t* w, const int8_t* x8, const float* dx, const int16_t* xs16, int64_t K,
                          int64_t len, __m256* acc, bool first) {
    using L = Q8Gemm<B>;
    if (first)
        for (int n = 0; n < N; ++n) acc[n] = _mm256_setzero_ps();
    for (int64_t s = 0; s < len; s += QK, w += L::bytes, x8 += QK) {
        __m256i sum[N];
        for (int n = 0; n < N; ++n) sum[n] = _mm256_setzero_si256();
        constexpr int G = B::FACTORED ? 8 : 2;  // groups summed in int16
        for (int h = 0; h < 64 / G; ++h) {
            __m256i part[N];
            for (int n = 0; n < N; ++n) part[n] = _mm256_setzero_si256();
            group_sums<N, G>(w, x8, K, h * G / 8, h * G % 8, part);
            const __m256i sc = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + L::CODES + 32 * (h * G / (256 / B::SUBS / 4))));
            for (int n = 0; n < N; ++n) sum[n] = _mm256_add_epi32(sum[n], _mm256_madd_epi16(part[n], sc));
        }
        end_super_block<B, N>(w, dx, xs16, K, s, sum, acc);
    }
}

constexpr int Q8_GEMM_TILE = 6;  // token rows a `micro_q8_gemm` call: 2 * 6 + 2 of 16 registers

template <typename B>
inline void micro_q8_gemm_n(int n, const uint8_t* w, const int8_t* x8, const float* dx, const int16_t* xs16,
                            int64_t K, int64_t len, __m256* acc, bool first) {
    switch (n) {
        case 1: micro_q8_gemm<B, 1>(w, x8, dx, xs16, K, len, acc, first); break;
        case 2: micro_q8_gemm<B, 2>(w, x8, dx, xs16, K, len, acc, first); break;
        case 3: micro_q8_gemm<B, 3>(w, x8, dx, xs16, K, len, acc, first); break;
        case 4: micro_q8_gemm<B, 4>(w, x8, dx, xs16, K, len, acc, first); break;
        case 5: micro_q8_gemm<B, 5>(w, x8, dx, xs16, K, len, acc, first); break;
        default: micro_q8_gemm<B, 6>(w, x8, dx, xs16, K, len, acc, first); break;
    }
}

// Do passes on rounded rows take `micro_q8_gemm` here (PIPELINE_KERNEL_Q8GEMM=0 says never: the
// float32 chain over the bf16 rounding for prefills, as before, to compare)? Prefills, where they
// do not take bf16 rows (`dot_bf16`); decoding passes of GEMM_DECODING_FROM token rows or more.
// Either way the same chain, so the same bits, as the decoding kernels'. Whole 1.5B passes
// (2 threads, AVX2-only EPYC, 2026-12-02): 12 token rows 413 against 421 ms in tiles of 4
// (`micro_q8_direct`), 16 rows 387 against 390: a draw, so the line stays where the pair
// layout's kernels put it (12 rows 189 against 215 ms on an AVX-512 EPYC in AVX2 code).
constexpr int64_t GEMM_DECODING_FROM = 12;
bool gemm_on() {
    static const bool yes = [] {
        const char* off = std::getenv("PIPELINE_KERNEL_Q8GEMM");
        return !(off && off[0] == '0');
    }();
    return yes;
}
bool gemm_q8() { return gemm_on() && !dot_bf16(); }
bool gemm_decoding(int64_t T) { return gemm_on() && T >= GEMM_DECODING_FROM; }

// A pass on rounded rows by `micro_q8_gemm` (see above): every block's strips decoded over a
// range of k into L2, every tile of token rows run over them, the tiles' accumulators (one vector
// a strip and token row) kept until the block's last range; then the Q4_K mins' term, the bias.
template <typename B>
void linear_q8_gemm(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t O, const float* dmin,
                    const uint8_t* m, const float* bias, float* y, int64_t RB, int64_t KB, int threads) {
    using L = Q8Gemm<B>;
    const int64_t padded = (O + STRIP - 1) / STRIP * STRIP, blocks = (padded + RB - 1) / RB, per_row = K / QK;
    int8_t* x8 = static_cast<int8_t*>(std::aligned_alloc(32, (T * K + 31) / 32 * 32));
    float* dx = static_cast<float*>(std::aligned_alloc(32, (T * per_row * 4 + 31) / 32 * 32));
    int16_t* xs = static_cast<int16_t*>(std::aligned_alloc(32, (T * (K / 32) * 2 + 31) / 32 * 32));
    quantize_q8(x, T, K, x8, dx, xs, threads);
    int16_t* xs16 = B::FACTORED ? nullptr : sums_of_16(x8, T, K);  // Q6_K: u's offset
    const int64_t strips = RB / STRIP;
    // whole slices of k, their decoded strips within SCRATCH_BYTES
    const int64_t range = std::max<int64_t>(KB, SCRATCH_BYTES / (strips * L::bytes) * QK / KB * KB);
    const int64_t tiles = (T + Q8_GEMM_TILE - 1) / Q8_GEMM_TILE;
    auto tile_rows = [&](int64_t tile) { return static_cast<int>(T / tiles + (tile < T % tiles)); };
    auto tile_start = [&](int64_t tile) { return tile * (T / tiles) + std::min(tile, T % tiles); };
#pragma omp parallel num_threads(threads)
    {
        uint8_t* codes = static_cast<uint8_t*>(std::aligned_alloc(32, strips * (range / QK) * L::bytes));
        __m256* acc = static_cast<__m256*>(std::aligned_alloc(32, strips * T * sizeof(__m256)));  // strip i's at i * T
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t o0 = b * RB, rows = std::min(RB, padded - o0);
            const uint8_t* wb = w + (o0 / STRIP) * per_row * B::bytes;
            for (int64_t kr0 = 0; kr0 < K; kr0 += range) {
                const int64_t kr1 = std::min(K, kr0 + range);
                for (int64_t k0 = kr0; k0 < kr1; k0 += KB) {
                    const int64_t len = std::min(KB, K - k0);
                    for (int64_t i = 0; i < rows; i += STRIP)
                        decode_strip_q8<B>(wb + (rows / STRIP) * (k0 / QK) * B::bytes + (i / STRIP) * (len / QK) * B::bytes,
                                           len, codes + ((i / STRIP) * (range / QK) + (k0 - kr0) / QK) * L::bytes);
                }
                for (int64_t tile = 0; tile < tiles; ++tile) {
                    const int64_t t = tile_start(tile);
                    for (int64_t i = 0; i < rows; i += STRIP)
                        micro_q8_gemm_n<B>(tile_rows(tile), codes + (i / STRIP) * (range / QK) * L::bytes, x8 + t * K + kr0,
                                           dx + t * per_row + kr0 / QK, xs16 ? xs16 + t * (K / 16) + kr0 / 16 : nullptr, K,
                                           kr1 - kr0, acc + (i / STRIP) * T + t, kr0 == 0);
                }
            }
            for (int64_t i = 0; i < rows && o0 + i < O; i += STRIP) {
                const int64_t o = o0 + i, at = strip_entry(o, 0, per_row);
                for (int64_t tile = 0; tile < tiles; ++tile) {
                    const int64_t t = tile_start(tile);
                    const int n = tile_rows(tile);
                    __m256 term[Q8_GEMM_TILE];
                    if (dmin) strip_mins_q8(m + 8 * STRIP * at, dmin + STRIP * at, xs + t * (K / 32), dx + t * per_row, K, n, term);
                    for (int r = 0; r < n; ++r) {
                        __m256 v = acc[(i / STRIP) * T + t + r];
                        if (dmin) v = _mm256_sub_ps(v, term[r]);
                        store_strip(v, o, O, bias, y + (t + r) * O + o);
                    }
                }
            }
        }
        std::free(codes);
        std::free(acc);
    }
    std::free(x8);
    std::free(dx);
    std::free(xs);
    std::free(xs16);
}

template <typename B>
void linear_blocks(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t O, const float* dmin,
                   const uint8_t* m, const float* bias, float* y, int64_t RB, int64_t KB, int threads, bool prefill,
                   bool q8 = false) {
    if (q8 && (prefill ? gemm_q8() : gemm_decoding(T))) return linear_q8_gemm<B>(x, T, K, w, O, dmin, m, bias, y, RB, KB, threads);
    const int64_t padded = (O + STRIP - 1) / STRIP * STRIP, blocks = (padded + RB - 1) / RB, per_row = K / QK;
    q8 = q8 && !prefill;  // any other prefill reads the bf16 rounding, whatever the decoding passes read
    const bool dot = prefill && dot_bf16();  // ... and with AVX512_BF16, bf16 token rows (`micro_dot_512`)
    uint16_t* x16 = nullptr;
    if (dot) {
        x16 = static_cast<uint16_t*>(std::aligned_alloc(64, (T * K * 2 + 63) / 64 * 64));
        round_rows_bf16(x, T, K, x16, threads);
    }
    // the Q4_K mins' partner sums (of the rounded rows: integers); a prefill's mins are in its
    // decoded weights
    float* sums = dmin && !prefill && !q8 ? static_cast<float*>(std::aligned_alloc(32, (T * (K / 32) * 4 + 31) / 32 * 32)) : nullptr;
    int16_t* xs = dmin && q8 ? static_cast<int16_t*>(std::aligned_alloc(32, (T * (K / 32) * 2 + 31) / 32 * 32)) : nullptr;
    int8_t* x8 = nullptr;
    float* dx = nullptr;
    int16_t* xs16 = nullptr;  // Q6_K: u's offset
    if (q8) {
        x8 = static_cast<int8_t*>(std::aligned_alloc(32, (T * K + 31) / 32 * 32));
        dx = static_cast<float*>(std::aligned_alloc(32, (T * (K / QK) * 4 + 31) / 32 * 32));
        quantize_q8(x, T, K, x8, dx, xs, threads);
        if constexpr (!B::FACTORED) xs16 = sums_of_16(x8, T, K);
    } else if (sums) {
        sub_block_sums(x, T, K, sums, threads);
    }
    enum { DIRECT, STRIPWISE, GROUPED };
    // rounded activations take the direct path at every width: tiles of up to DIRECT_MAX rows,
    // the block's weights read from L2 again for each tile after the first
    const int path = q8 ? DIRECT : prefill ? GROUPED : T <= DIRECT_MAX ? DIRECT : T <= STRIPWISE_MAX ? STRIPWISE : GROUPED;
    const int64_t unit = prefill ? 2 : 4;  // bytes of a decoded weight on the grouped path
    // a wide pass on rounded activations in tiles of 3 (2 pairs' accumulators of 4 spill registers)
    const int64_t tile_max = path != DIRECT ? TILE : q8 ? Q8_TILE : DIRECT_MAX;
    const int64_t tiles = (T + tile_max - 1) / tile_max;
    // the k values of a block's rows decoded into L2 at a time on the grouped path: whole slices
    const int64_t range = std::max<int64_t>(KB, SCRATCH_BYTES / (RB * unit) / KB * KB);
    constexpr int64_t SUB_K = QK / B::SUBS;
    const int64_t range_subs = range / SUB_K;  // a row's sub-block scales in a decoded range
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
        // the decoded rows' sub-block scales (`decode_codes`), row r's at r * (k values / SUB_K)
        const int64_t scale_floats = !B::FACTORED ? 0
                                     : path == GROUPED && !prefill ? RB * range_subs
                                     : path == STRIPWISE          ? STRIP * (KB / SUB_K)
                                                                  : 0;
        float* scales = scale_floats ? static_cast<float*>(std::aligned_alloc(32, (scale_floats * 4 + 31) / 32 * 32)) : nullptr;
        // The wider paths' two steps, either chain: a strip's slice decoded into float32 pairs
        // (`stride` floats a pair; for FACTORED kinds the codes, their scales from `scales + at`,
        // `row_subs` a row), and one decoded pair against n token rows.
        auto decode = [&](const uint8_t* from, int64_t len, float* dst, int64_t stride, int64_t at, int64_t row_subs) {
            if constexpr (B::FACTORED)
                decode_codes<B>(from, len, dst, stride, scales + at, 2 * row_subs, row_subs);
            else
                decode_strip<B>(from, len, dst, stride);
        };
        auto pair = [&](int n, const float* w, int64_t at, int64_t row_subs, const float* xt, int64_t len,
                        __m256* out, bool first) {
            if constexpr (B::FACTORED)
                micro_scaled_n<SUB_K>(n, w, scales + at, scales + at + row_subs, xt, K, len, out, first);
            else
                micro_n(n, w, xt, K, len, out, first);
        };
        uint16_t* halves = reinterpret_cast<uint16_t*>(scratch);  // the prefill's bf16 pairs
        const int64_t acc_tiles = path == DIRECT || (path == GROUPED && whole) ? 1 : group_tiles;
        // the Q4_K min factors once per block where many tiles' outputs read them
        const bool block_mins = dmin && !q8 && (path == GROUPED || tiles > 1);
        float* mins = block_mins ? static_cast<float*>(std::aligned_alloc(32, MAX_RB * (K / 32) * 4)) : nullptr;
        __m256* acc = static_cast<__m256*>(std::aligned_alloc(32, acc_tiles * MAX_RB * TILE * sizeof(__m256)));
        for (int64_t tg0 = 0; tg0 < tiles; tg0 += group_tiles) {
        const int64_t tg1 = std::min(tiles, tg0 + group_tiles);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t o0 = b * RB, rows = std::min(RB, padded - o0);
            // prefills through the 16-lane kernels, PAIRS_512 pairs a call (`dot`: on bf16 rows)
            const bool wide = prefill && wide_fma() && rows % (2 * PAIRS_512) == 0, dot_rows = dot && wide;
            const uint8_t* wb = w + (o0 / STRIP) * per_row * B::bytes;
            if (mins)  // many token rows: the factors once per block (rows past O have zeros)
                for (int64_t i = 0; i < rows; i += STRIP) strip_min_factors(dmin, m, o0 + i, K, mins + i * (K / 32));
            RowMins row_mins_at;
            auto row_mins = [&](int64_t r) -> const RowMins* {
                if (!dmin) return nullptr;
                const int64_t o = o0 + r;
                row_mins_at = {mins ? mins + r * (K / 32) : nullptr, dmin, m, o, per_row};
                return &row_mins_at;
            };
            if (path == DIRECT) {
                for (int64_t tile = 0, t = 0; tile < tiles; t += tile_rows(tile++)) {
                    const int n = tile_rows(tile);
                    for (int64_t k0 = 0; k0 < K; k0 += KB) {
                        const int64_t len = std::min(KB, K - k0);
                        for (int64_t i = 0; i < rows; i += STRIP)
                            if (x8)
                                micro_q8_direct<B>(n, slice(wb, rows, k0, len, i), x8 + t * K + k0, dx + t * (K / QK) + k0 / QK,
                                                   xs16 ? xs16 + t * (K / 16) + k0 / 16 : nullptr, K, len,
                                                   reinterpret_cast<float*>(acc + i * n), k0 == 0);
                            else
                                micro_direct<B>(n, slice(wb, rows, k0, len, i), x + t * K + k0, K, len, acc + i * n,
                                                k0 == 0);
                    }
                    if (x8) {  // a strip's 8 rows at once
                        for (int64_t i = 0; i < rows && o0 + i < O; i += STRIP) {
                            __m256 term[TILE];  // tiles of rounded rows are at most TILE wide
                            if (dmin) {
                                const int64_t at = strip_entry(o0 + i, 0, per_row);
                                strip_mins_q8(m + 8 * STRIP * at, dmin + STRIP * at, xs + t * (K / 32), dx + t * (K / QK), K, n,
                                              term);
                            }
                            finish_strip(reinterpret_cast<const float*>(acc + i * n), n, o0 + i, t, O, dmin ? term : nullptr,
                                         bias, y);
                        }
                    } else {
                        for (int64_t r = 0; r < rows && o0 + r < O; ++r)
                            finish(acc + r * n, n, o0 + r, t, O, K, row_mins(r), sums, bias, y);
                    }
                }
            } else if (path == STRIPWISE) {
                for (int64_t k0 = 0; k0 < K; k0 += KB) {
                    const int64_t len = std::min(KB, K - k0);
                    const int64_t subs = len / SUB_K;  // each row's scales in the slice
                    for (int64_t i = 0; i < rows; i += STRIP) {
                        decode(slice(wb, rows, k0, len, i), len, scratch, 2 * len, 0, subs);
                        for (int64_t tile = 0, t = 0; tile < tiles; t += tile_rows(tile++))
                            for (int64_t p = 0; p < STRIP; p += 2)
                                pair(tile_rows(tile), scratch + p * len, p * subs, subs, x + t * K + k0, len,
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
                            if (dot_rows)
                                decode_strip_dot<B>(slice(wb, rows, k0, len, i), len, halves + at, 2 * range,
                                                    mins ? mins + i * (K / 32) : nullptr, K / 32, k0 / 32);
                            else if (prefill)
                                decode_strip_bf16<B>(slice(wb, rows, k0, len, i), len, halves + at, 2 * range,
                                                     mins ? mins + i * (K / 32) : nullptr, K / 32, k0 / 32);
                            else
                                decode(slice(wb, rows, k0, len, i), len, scratch + at, 2 * range,
                                       i * range_subs + (k0 - kr0) / SUB_K, range_subs);
                        }
                    }
                    for (int64_t tile = tg0; tile < tg1; ++tile) {
                        __m256* at = acc + (whole ? 0 : (tile - tg0) * MAX_RB * TILE);
                        const int n = tile_rows(tile);
                        // a pair's whole range in one call (PAIRS_512 pairs with AVX-512: rows is whole strips)
                        for (int64_t p = 0; p < rows; p += wide ? 2 * PAIRS_512 : 2) {
                            const float* xt = x + tile_start(tile) * K + kr0;
                            if (dot_rows)
                                micro_dot_512_n(n, halves + p * range, 2 * range, x16 + tile_start(tile) * K + kr0, K,
                                                kr1 - kr0, at + p * n, kr0 == 0);
                            else if (wide)
                                micro_512_n(n, halves + p * range, 2 * range, xt, K, kr1 - kr0, at + p * n, kr0 == 0);
                            else if (prefill)
                                micro_n(n, halves + p * range, xt, K, kr1 - kr0, at + p * n, kr0 == 0);
                            else
                                pair(n, scratch + p * range, p * range_subs, range_subs, xt, kr1 - kr0, at + p * n,
                                     kr0 == 0);
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
        std::free(scales);
    }
    std::free(sums);
    std::free(xs);
    std::free(x8);
    std::free(dx);
    std::free(xs16);
    std::free(x16);
}

// ---------------------------------------------------------------------------------------------
// Attention for float32 models on CPUs, row-invariant by construction: each query's output is
// one fixed chain over the keys it may see, in their order in the cache, whatever else shares
// the call. Its scores are dot products over the head dimension (8 lanes of fused multiply-adds,
// then `hsum`), times the scale, plus the additive mask; the softmax subtracts their maximum
// (exact, order-free), takes expf of each, and sums the weights and the weighted values key
// after key in cache order. Masked keys (mask at or below MASKED) are skipped, never added as
// zeros: a cache's holes and padding may hold anything. So a query's bits depend on the keys it
// sees alone, not on how many queries, rows or masked slots share the pass.

constexpr float MASKED = -1e30f;  // an additive mask at or below this hides its key

// out[b][i][h][:] for query[b][h][i][:] (contiguous [B, H, Q, D]); keys and values [B, Hkv, L, D]
// with the given strides (in floats; a key's D values contiguous), query head h reading kv head
// h / (H / Hkv); mask [B, 1, Q, klen] with strides (its key dimension contiguous). `queries[b]`
// (nullptr: Q each): row b's real queries, the first ones; the rest of its outputs are zeros.
// Heads g0..g0+G of a query against key kj: each head's score as the chain above (the product of
// the first 8 values, fused multiply-adds over the rest in order, `hsum`, the scale, the mask),
// G chains interleaved so that the core does not wait on one's latency. Into scores[g * stride]
// (the key's slot of head g's row), the running maxima `top`.
template <int G, typename Query>
inline void head_scores(const Query& query, int64_t g0, const float* kj, int64_t chunks, float scale, float mask,
                        float* scores, int64_t stride, float* top) {
    const float* qs[G];
    __m256 acc[G];
    const __m256 k0 = _mm256_loadu_ps(kj);
    for (int g = 0; g < G; ++g) {
        qs[g] = query(g0 + g);
        acc[g] = _mm256_mul_ps(_mm256_loadu_ps(qs[g]), k0);
    }
    for (int64_t c = 1; c < chunks; ++c) {
        const __m256 kc = _mm256_loadu_ps(kj + 8 * c);
        for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[g] + 8 * c), kc, acc[g]);
    }
    for (int g = 0; g < G; ++g) {
        const float s = hsum(acc[g]) * scale + mask;
        scores[(g0 + g) * stride] = s;
        top[g0 + g] = std::max(top[g0 + g], s);
    }
}

void attend(const float* q, int64_t B, int64_t H, int64_t Q, int64_t D, const float* k, const float* v,
            int64_t Hkv, int64_t kb, int64_t kh, int64_t vb, int64_t vh, int64_t klen, const float* mask, int64_t mb,
            int64_t mq, float scale, const int64_t* queries, float* out, int threads) {
    // One work item is a query and the `group` query heads that read one key/value head: each
    // key (and value chunk) is loaded once for all of them and read again from L1 (L2) rather
    // than from L3 per head (at 1000 cached tokens a head's keys alone fill L2). Each head's
    // chain is the one described above, whatever the loop order around it.
    const int64_t group = H / Hkv, work = B * Hkv * Q;
    const int64_t chunks = D / 8;
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, work)))
    {
        const int64_t stride = (klen + 7) / 8 * 8;  // a head's scores
        float* scores = static_cast<float*>(std::aligned_alloc(32, group * stride * 4));
        int64_t* seen = static_cast<int64_t*>(std::malloc(klen * sizeof(int64_t)));
        float* top = static_cast<float*>(std::malloc(group * sizeof(float)));
        float* total = static_cast<float*>(std::malloc(group * sizeof(float)));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < work; ++item) {
            const int64_t b = item / (Hkv * Q), kvh = item / Q % Hkv, i = item % Q, h0 = kvh * group;
            auto output = [&](int64_t g) { return out + ((b * Q + i) * H + h0 + g) * D; };
            auto query = [&](int64_t g) { return q + ((b * H + h0 + g) * Q + i) * D; };
            if (queries && i >= queries[b]) {
                for (int64_t g = 0; g < group; ++g) std::memset(output(g), 0, D * 4);
                continue;
            }
            const float* kr = k + b * kb + kvh * kh;
            const float* vr = v + b * vb + kvh * vh;
            const float* m = mask + b * mb + i * mq;
            int64_t n = 0;  // the visible keys: the same for every head (one mask a query)
            for (int64_t g = 0; g < group; ++g) top[g] = -INFINITY;
            for (int64_t j = 0; j < klen; ++j) {
                if (!(m[j] > MASKED)) continue;
                const float* kj = kr + j * D;
                for (int64_t g0 = 0; g0 < group; g0 += 4) {  // 4 heads' chains in flight, not 1
                    switch (std::min<int64_t>(4, group - g0)) {
                        case 1: head_scores<1>(query, g0, kj, chunks, scale, m[j], scores + n, stride, top); break;
                        case 2: head_scores<2>(query, g0, kj, chunks, scale, m[j], scores + n, stride, top); break;
                        case 3: head_scores<3>(query, g0, kj, chunks, scale, m[j], scores + n, stride, top); break;
                        default: head_scores<4>(query, g0, kj, chunks, scale, m[j], scores + n, stride, top); break;
                    }
                }
                seen[n++] = j;
            }
            if (n == 0) {
                for (int64_t g = 0; g < group; ++g) std::memset(output(g), 0, D * 4);
                continue;
            }
            for (int64_t g = 0; g < group; ++g) {
                float* sg = scores + g * stride;
                float sum = 0.0f;
                for (int64_t r = 0; r < n; ++r) {
                    sg[r] = std::exp(sg[r] - top[g]);
                    sum += sg[r];
                }
                total[g] = sum;
            }
            for (int64_t c0 = 0; c0 < chunks; c0 += 8) {  // 64 values of the head at a time
                const int64_t width = std::min<int64_t>(8, chunks - c0);
                for (int64_t g = 0; g < group; ++g) {  // the chunk's values stay in L2 for the next head
                    const float* sg = scores + g * stride;
                    __m256 acc[8];
                    for (int64_t c = 0; c < width; ++c) acc[c] = _mm256_setzero_ps();
                    for (int64_t r = 0; r < n; ++r) {
                        const __m256 p = _mm256_broadcast_ss(sg + r);
                        const float* vj = vr + seen[r] * D + 8 * c0;
                        for (int64_t c = 0; c < width; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * c), acc[c]);
                    }
                    const __m256 t = _mm256_set1_ps(total[g]);
                    for (int64_t c = 0; c < width; ++c) _mm256_storeu_ps(output(g) + 8 * (c0 + c), _mm256_div_ps(acc[c], t));
                }
            }
        }
        std::free(total);
        std::free(top);
        std::free(seen);
        std::free(scores);
    }
}

// Rotary position embeddings as `transformers`' `apply_rotary_pos_emb` takes them, bit for bit:
// out = x * cos + rotate_half(x) * sin, both products rounded, then their sum (no fused
// multiply-add: the library is built with -ffp-contract=off), rotate_half(x) = (-x2, x1) for a
// head's halves x1, x2. x [B, T, H heads of D floats], `row` floats from one token to the next
// (a fused projection's part is fine); cos and sin [B, T, D] contiguous; out [B, H, T, D]
// contiguous, the layout the cache and `attend` take.
void rotary(const float* x, int64_t B, int64_t T, int64_t H, int64_t D, int64_t row, const float* cos,
            const float* sin, float* out) {
    const int64_t half = D / 2;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t bt = 0; bt < B * T; ++bt) {
        const float* c = cos + bt * D;
        const float* s = sin + bt * D;
        for (int64_t h = 0; h < H; ++h) {
            const float* xh = x + bt * row + h * D;
            float* o = out + ((bt / T * H + h) * T + bt % T) * D;
            int64_t d = 0;
            for (; d + 8 <= half; d += 8) {
                const __m256 x1 = _mm256_loadu_ps(xh + d), x2 = _mm256_loadu_ps(xh + half + d);
                _mm256_storeu_ps(o + d, _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + d)),
                                                      _mm256_mul_ps(_mm256_xor_ps(x2, sign), _mm256_loadu_ps(s + d))));
                _mm256_storeu_ps(o + half + d, _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + d)),
                                                             _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + d))));
            }
            for (; d < half; ++d) {
                o[d] = xh[d] * c[d] + -xh[half + d] * s[d];
                o[half + d] = xh[half + d] * c[half + d] + xh[d] * s[half + d];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The small steps of a float32 decoder layer, one call each where torch takes several ops (a
// 1-token pass of the 1.5B target made about 2,000, a few µs of dispatch each): RMSNorm, and
// SiLU(gate) * up. Each output row is one fixed chain over its own input row, row-invariant as
// the products are; the numbers are float32 as torch's, not its bits (its reductions and expf
// round in their own order).

// y = w * (x * (1 / sqrt(sum(x^2) / D + eps))) row after row; the sum of squares in 8 lanes
// (k mod 8), then `hsum`. D a multiple of 8.
void rms_norm(const float* x, int64_t T, int64_t D, const float* w, float eps, float* y) {
    for (int64_t t = 0; t < T; ++t, x += D, y += D) {
        __m256 s = _mm256_setzero_ps();
        for (int64_t k = 0; k < D; k += 8) {
            const __m256 v = _mm256_loadu_ps(x + k);
            s = _mm256_fmadd_ps(v, v, s);
        }
        const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(hsum(s) / static_cast<float>(D) + eps));
        for (int64_t k = 0; k < D; k += 8)
            _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(x + k), r)));
    }
}

// exp(v) lane by lane (Cephes' expf: v = n ln2 + r, a degree-5 polynomial in r, times 2^n), to
// within 2 ulp; v clamped to [-87.3, 88.4], where exp stays a normal float.
inline __m256 exp_ps(__m256 v) {
    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-87.33f)), _mm256_set1_ps(88.37f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);  // ln2 in two parts, exact first
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// y[t] = silu(g) * u = g / (1 + exp(-g)) * u for each token row t (g and u rows `stride` floats
// apart: the halves of a fused gate/up product, or two products).
void silu_mul(const float* g, const float* u, int64_t stride, int64_t T, int64_t I, float* y) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t t = 0; t < T; ++t, g += stride, u += stride, y += I) {
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 v = _mm256_loadu_ps(g + i);
            const __m256 s = _mm256_div_ps(v, _mm256_add_ps(one, exp_ps(_mm256_xor_ps(v, sign))));
            _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
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
                const float* bias, float* y, int64_t RB, int64_t KB, int threads, int prefill, int q8) {
    linear_blocks<Q4K>(x, T, K, w, O, dmin, m, bias, y, RB, KB, threads, prefill != 0, q8 != 0);
}
void linear_q6k(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t O, const float* bias, float* y,
                int64_t RB, int64_t KB, int threads, int prefill, int q8) {
    linear_blocks<Q6K>(x, T, K, w, O, nullptr, nullptr, bias, y, RB, KB, threads, prefill != 0, q8 != 0);
}
int prefill_reads_bf16_rows() { return dot_bf16(); }
int prefill_rounds_rows() { return gemm_q8(); }
int kernel_avx512() { return wide_fma(); }
void rms_norm_f32(const float* x, int64_t T, int64_t D, const float* w, float eps, float* y) { rms_norm(x, T, D, w, eps, y); }
void silu_mul_f32(const float* g, const float* u, int64_t stride, int64_t T, int64_t I, float* y) {
    silu_mul(g, u, stride, T, I, y);
}
void attend_f32(const float* q, int64_t B, int64_t H, int64_t Q, int64_t D, const float* k, const float* v, int64_t Hkv,
                int64_t kb, int64_t kh, int64_t vb, int64_t vh, int64_t klen, const float* mask, int64_t mb, int64_t mq,
                float scale, const int64_t* queries, float* out, int threads) {
    attend(q, B, H, Q, D, k, v, Hkv, kb, kh, vb, vh, klen, mask, mb, mq, scale, queries, out, threads);
}
void rotary_f32(const float* q, const float* k, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t q_row,
                int64_t k_row, const float* cos, const float* sin, float* q_out, float* k_out) {
    rotary(q, B, T, H, D, q_row, cos, sin, q_out);
    rotary(k, B, T, Hkv, D, k_row, cos, sin, k_out);
}
void linear_i8(const float* x, int64_t T, int64_t K, const int8_t* w, int64_t O, const float* scale, const float* bias,
               float* y, int64_t RB, int64_t KB, int threads) {
    linear(x, T, K, w, O, scale, bias, y, RB, KB, threads);
}
}

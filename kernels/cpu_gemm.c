/* out [M, N] = x [M, K] @ w [N, K]^T (+ bias) (+ residual), multiplied in fp32 on the weight as the model holds
 * it (bf16, fp16 or fp32) and rounded once to x's dtype, as a product in that dtype rounds its accumulator.
 *
 * For CPUs with AVX2 and FMA but no bf16 instructions, where torch either emulates a half-precision product
 * (slow past a row or two) or needs an fp32 copy of every weight for oneDNN (twice the bytes to stream each
 * step, and twice the memory). Here each block of 4 weight rows is widened once into an L1-resident fp32
 * scratch, then dotted with the x rows 3 at a time (12 accumulators, all in registers); the rows of w are
 * split between the OpenMP threads, which are torch's own (the same libgomp), as many as the caller says.
 *
 * The ops on either side of a layer's matmuls come along, so that a step makes a few calls a layer, not
 * dozens of small torch ops (each costs its fixed microseconds whatever its size): x may first go through
 * transformers' RMSNorm (PRE_RMS_NORM) or be [gate | up] of width 2K for silu(gate) * up (PRE_SILU_MUL),
 * each rounded to x's dtype where torch's ops round; and the residual stream may be added to the product,
 * or its first heads (q and k) rotated by their positions' rows of the rotary tables.
 * K must be a multiple of 8; any M and N.
 */
#include <math.h>
#include <stdlib.h>

#include "avx2.h"

enum { PRE_NONE = 0, PRE_RMS_NORM = 1, PRE_SILU_MUL = 2 };
#define NR 4    /* weight rows per block */
#define MR 3    /* x rows per pass over a block */
#define KC 512  /* the depth of a block's scratch */
#define CHUNK 32  /* columns a thread finishes at a time: 8 blocks */

/* y[m, 0:4] += x[m, 0:kl] . scratch rows 0..3, for the `rows` (<= MR) rows of x from here */
static inline __attribute__((always_inline)) void block_pass(const float *x, int64_t ldx, const float *scratch,
                                                             int64_t kl, float *y, int64_t ldy, int rows) {
    __m256 acc[MR][NR];
    for (int m = 0; m < rows; m++)
        for (int i = 0; i < NR; i++) acc[m][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kl; k += 8) {
        __m256 w0 = _mm256_load_ps(scratch + k), w1 = _mm256_load_ps(scratch + KC + k);
        __m256 w2 = _mm256_load_ps(scratch + 2 * KC + k), w3 = _mm256_load_ps(scratch + 3 * KC + k);
        for (int m = 0; m < rows; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
            acc[m][0] = _mm256_fmadd_ps(w0, xv, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, xv, acc[m][1]);
            acc[m][2] = _mm256_fmadd_ps(w2, xv, acc[m][2]);
            acc[m][3] = _mm256_fmadd_ps(w3, xv, acc[m][3]);
        }
    }
    for (int m = 0; m < rows; m++) {
        __m128 s = sum8x4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
        _mm_storeu_ps(y + m * ldy, _mm_add_ps(_mm_loadu_ps(y + m * ldy), s));
    }
}

static void weight_block(const float *x, int64_t M, int64_t K, const void *w, int kind, int64_t n0,
                         float *y, int64_t N) {
    float scratch[NR * KC] __attribute__((aligned(32)));
    const int64_t size = kind == KIND_FP32 ? 4 : 2, slabs = (K + KC - 1) / KC;
    /* passes of 3 rows, the last ones of 2 rather than a lone row (4 accumulators wait on each other) */
    const int64_t threes = M % MR == 1 && M > 1 ? M - 4 : M - M % MR;
    const int64_t passes = threes / MR + (M - threes + 1) / 2;
    /* the next block's rows (contiguous) come from memory while this one is multiplied, a few lines after
     * each pass: issued all at once, the prefetches stall on the misses in flight (16 bf16 chats' matmuls
     * 10-20% slower). Past the end of w, a prefetch never faults. */
    const int64_t lines = (NR * K * size / 64 + slabs - 1) / slabs, per_pass = (lines + passes - 1) / passes;
    for (int64_t kc = 0, slab = 0; kc < K; kc += KC, slab++) {
        int64_t kl = K - kc < KC ? K - kc : KC;
        for (int i = 0; i < NR; i++)
            for (int64_t k = 0; k < kl; k += 8)
                _mm256_store_ps(scratch + i * KC + k, load8(w, (n0 + i) * K + kc + k, kind));
        const char *ahead = (const char *)w + (n0 + NR) * K * size + slab * lines * 64;
        for (int64_t m = 0, pass = 0; m < M; pass++) {
            int rows = m < threes ? MR : M - m >= 2 ? 2 : 1;
            if (rows == MR) block_pass(x + m * K + kc, K, scratch, kl, y + m * N + n0, N, MR);
            else if (rows == 2) block_pass(x + m * K + kc, K, scratch, kl, y + m * N + n0, N, 2);
            else block_pass(x + m * K + kc, K, scratch, kl, y + m * N + n0, N, 1);
            m += rows;
            for (int64_t line = pass * per_pass; line < (pass + 1) * per_pass && line < lines; line++)
                _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
        }
    }
}

/* y[0, n] += x . w row n, for one row of x: each weight is used once, so the rows are read in memory order,
 * one stream that the hardware prefetcher follows (4 rows interleaved, as the blocks of several x rows are
 * read, made 4 short streams: 5-6 GB/s on one core against 7-8 here), 4 accumulators, lines a little ahead
 * prefetched (past the end of w a prefetch never faults) */
static void weight_row_one_row(const float *x, int64_t K, const void *w, int kind, int64_t n, float *y) {
    const int64_t at = n * K, size = kind == KIND_FP32 ? 4 : 2;
    const char *ahead = (const char *)w + at * size + 1024;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int64_t line = 0; line < 32 * size; line += 64) _mm_prefetch(ahead + k * size + line, _MM_HINT_T0);
        acc0 = _mm256_fmadd_ps(load8(w, at + k, kind), _mm256_loadu_ps(x + k), acc0);
        acc1 = _mm256_fmadd_ps(load8(w, at + k + 8, kind), _mm256_loadu_ps(x + k + 8), acc1);
        acc2 = _mm256_fmadd_ps(load8(w, at + k + 16, kind), _mm256_loadu_ps(x + k + 16), acc2);
        acc3 = _mm256_fmadd_ps(load8(w, at + k + 24, kind), _mm256_loadu_ps(x + k + 24), acc3);
    }
    for (; k < K; k += 8) acc0 = _mm256_fmadd_ps(load8(w, at + k, kind), _mm256_loadu_ps(x + k), acc0);
    y[n] += sum8(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
}

/* x as the product's fp32 input [M, K], after its pre-op, rounded where torch's ops round */
static void prepare_input(const void *x, int kind, int64_t M, int64_t K, int pre, const void *norm_weight,
                          float eps, float *xs, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float *row = xs + m * K;
        if (pre == PRE_SILU_MUL) {
            for (int64_t k = 0; k < K; k += 8) {
                __m256 g = load8(x, m * 2 * K + k, kind);
                _mm256_storeu_ps(row + k, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                                          exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))));
            }
            for (int64_t k = 0; k < K; k += 8)
                _mm256_storeu_ps(row + k, rounded8(_mm256_mul_ps(rounded8(_mm256_loadu_ps(row + k), kind),
                                                                 load8(x, m * 2 * K + K + k, kind)), kind));
            continue;
        }
        for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(row + k, load8(x, m * K + k, kind));
        if (pre == PRE_RMS_NORM) {
            __m256 squares = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k += 8) {
                __m256 v = _mm256_loadu_ps(row + k);
                squares = _mm256_fmadd_ps(v, v, squares);
            }
            __m256 inverse = _mm256_set1_ps(1.0f / sqrtf(sum8(squares) / (float)K + eps));
            for (int64_t k = 0; k < K; k += 8) {
                __m256 normed = rounded8(_mm256_mul_ps(_mm256_loadu_ps(row + k), inverse), kind);
                _mm256_storeu_ps(row + k, rounded8(_mm256_mul_ps(load8(norm_weight, k, kind), normed), kind));
            }
        }
    }
}

/* out [M, K] = pre(x) in x's dtype: the pre-op alone, for the rows of a product that oneDNN takes (CPUs with
 * bf16 instructions), where torch's own ops would be some ten calls of fixed cost for each norm */
int pagedchat_pre_op(const void *x, int kind, int64_t M, int64_t K, int pre, const void *norm_weight, float eps,
                     void *out, int threads) {
    float *xs = malloc(sizeof(float) * M * K);
    if (!xs) return 1;
    prepare_input(x, kind, M, K, pre, norm_weight, eps, xs, threads);
    for (int64_t i = 0; i < M * K; i += 8) store8(out, i, _mm256_loadu_ps(xs + i), kind);
    free(xs);
    return 0;
}

static void weight_row(const float *x, int64_t M, int64_t K, const void *w, int kind, int64_t n, float *y,
                       int64_t N) {
    for (int64_t m = 0; m < M; m++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8)
            acc = _mm256_fmadd_ps(load8(w, n * K + k, kind), _mm256_loadu_ps(x + m * K + k), acc);
        y[m * N + n] += sum8(acc);
    }
}

/* the first `heads` heads of D of each output row rotated by its row of the rotary tables cos and sin_signed
 * [M, D]: x * cos + roll(x, D / 2) * sin_signed, each product and the sum rounded as torch's ops round
 * (D / 2 a multiple of 8) */
void pagedchat_rotate(void *out, int kind, int64_t M, int64_t N, const void *cos, const void *sin_signed,
                      int64_t heads, int64_t head_dim, int threads) {
    const int64_t half = head_dim / 2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < heads; h++) {
            int64_t d = 0;
            for (; d + 8 <= half; d += 8) {
                const int64_t at = m * N + h * head_dim + d, table = m * head_dim + d;
                __m256 first = load8(out, at, kind), second = load8(out, at + half, kind);
                __m256 a = rounded8(_mm256_mul_ps(first, load8(cos, table, kind)), kind);
                __m256 b = rounded8(_mm256_mul_ps(second, load8(sin_signed, table, kind)), kind);
                __m256 c = rounded8(_mm256_mul_ps(second, load8(cos, table + half, kind)), kind);
                __m256 e = rounded8(_mm256_mul_ps(first, load8(sin_signed, table + half, kind)), kind);
                store8(out, at, _mm256_add_ps(a, b), kind);
                store8(out, at + half, _mm256_add_ps(c, e), kind);
            }
            for (; d < half; d++) {
                const int64_t at = m * N + h * head_dim + d, table = m * head_dim + d;
                float first = widen(out, at, kind), second = widen(out, at + half, kind);
                float a = rounded(first * widen(cos, table, kind), kind);
                float b = rounded(second * widen(sin_signed, table, kind), kind);
                float c = rounded(second * widen(cos, table + half, kind), kind);
                float e = rounded(first * widen(sin_signed, table + half, kind), kind);
                store(out, at, a + b, kind);
                store(out, at + half, c + e, kind);
            }
        }
}

int pagedchat_linear(const void *x, int kind, int64_t M, int64_t K, int pre, const void *norm_weight, float eps,
                     const void *w, int w_kind, int64_t N, const float *bias, const void *residual, void *out,
                     const void *cos, const void *sin_signed, int64_t rotated_heads, int64_t head_dim,
                     int threads) {
    float *xs = malloc(sizeof(float) * M * K);
    float *y = malloc(sizeof(float) * M * N);
    if (!xs || !y) {
        free(xs);
        free(y);
        return 1;
    }
    prepare_input(x, kind, M, K, pre, norm_weight, eps, xs, threads);
    /* the columns in chunks of whole blocks, each finished (bias, residual, rounding) while it is in cache */
    int64_t chunks = (N + CHUNK - 1) / CHUNK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t c0 = c * CHUNK, c1 = c0 + CHUNK < N ? c0 + CHUNK : N;
        for (int64_t m = 0; m < M; m++)
            if (bias) memcpy(y + m * N + c0, bias + c0, sizeof(float) * (c1 - c0));
            else memset(y + m * N + c0, 0, sizeof(float) * (c1 - c0));
        int64_t n0 = c0;
        if (M == 1)
            for (; n0 < c1; n0++) weight_row_one_row(xs, K, w, w_kind, n0, y);
        for (; n0 + NR <= c1; n0 += NR) weight_block(xs, M, K, w, w_kind, n0, y, N);
        for (int64_t n = n0; n < c1; n++) weight_row(xs, M, K, w, w_kind, n, y, N);
        for (int64_t m = 0; m < M; m++) {
            int64_t n = c0;
            for (; n + 8 <= c1; n += 8) {
                __m256 v = _mm256_loadu_ps(y + m * N + n);
                if (residual) v = _mm256_add_ps(load8(residual, m * N + n, kind), rounded8(v, kind));
                store8(out, m * N + n, v, kind);
            }
            for (; n < c1; n++) {
                float v = y[m * N + n];
                if (residual) v = widen(residual, m * N + n, kind) + rounded(v, kind);
                store(out, m * N + n, v, kind);
            }
        }
    }
    if (rotated_heads) pagedchat_rotate(out, kind, M, N, cos, sin_signed, rotated_heads, head_dim, threads);
    free(xs);
    free(y);
    return 0;
}

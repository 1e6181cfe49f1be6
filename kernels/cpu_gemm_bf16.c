/* out [M, N] = x [M, K] @ w [N, K]^T (+ bias), all bf16 (bias fp32), for CPUs with avx512_bf16: the products
 * of bf16 pairs summed in fp32 by VDPBF16PS, as oneDNN's bf16 product sums them, and rounded once to bf16.
 *
 * The weight comes packed by `pack` (cpu_gemm_bf16.py): panels of 32 columns, in each the pairs of depths
 * 2j, 2j+1 of the 32 columns side by side (64 values, two registers), so a thread reads its panels in memory
 * order, one stream, and an instruction takes 16 columns by 2 depths of one x row, broadcast; no sums across
 * lanes. Each panel is multiplied with up to MR x rows at a time (2 MR accumulators); at a decode step's few
 * rows the product waits on the weight coming from memory, so the first pass over a panel prefetches
 * PREFETCH_AHEAD values ahead. The panels are split between the OpenMP threads, which are torch's own, as
 * many as the caller says. K must be even.
 *
 * Beside it, the ops around such a product in bf16, as cpu_gemm.c's pre-ops and rotary do them (each product
 * and sum rounded where torch's ops round), 16 lanes at a time and rounded by VCVTNEPS2BF16 in one instruction.
 */
#include <math.h>

#include "avx512.h"

#define PANEL 32
#define MR 12
#define PREFETCH_AHEAD 1024  /* bf16 values: 2 KiB */

/* acc[m][0:2] = x rows m (rows <= MR) . the panel's 32 columns */
static inline __attribute__((always_inline)) void panel_pass(const uint16_t *x, int64_t K, const uint16_t *panel,
                                                             int prefetch, int rows, __m512 acc[MR][2]) {
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < K / 2; j++) {
        const uint16_t *pair = panel + j * 2 * PANEL;
        if (prefetch) {
            _mm_prefetch((const char *)(pair + PREFETCH_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(pair + PREFETCH_AHEAD + PANEL), _MM_HINT_T0);
        }
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(pair), w1 = (__m512bh)_mm512_loadu_si512(pair + PANEL);
        for (int m = 0; m < rows; m++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + m * K + 2 * j));
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, w0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, w1);
        }
    }
}

/* out[m, n0 : n0 + 16] (its first `columns`) from an accumulator: + bias, rounded */
static inline void finish(__m512 sum, int64_t at, int64_t n0, int64_t columns, const float *bias, uint16_t *out) {
    if (columns <= 0) return;
    __mmask16 mask = first(columns);
    if (bias) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, bias + n0));
    _mm256_mask_storeu_epi16(out + at, mask, rounded16(sum));
}

void pagedchat_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                           const float *bias, uint16_t *out, int threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL, passes = (M + MR - 1) / MR, per_pass = (M + passes - 1) / passes;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const uint16_t *panel = packed + p * K * PANEL;
        const int64_t n0 = p * PANEL;
        for (int64_t m0 = 0; m0 < M; m0 += per_pass) {
            __m512 acc[MR][2];
            const int rows = M - m0 < per_pass ? (int)(M - m0) : (int)per_pass;
            const int prefetch = m0 == 0;  /* the first pass brings the panel in; the rest find it cached */
            switch (rows) {  /* a pass for each row count, its accumulators all in registers */
                case 12: panel_pass(x + m0 * K, K, panel, prefetch, 12, acc); break;
                case 11: panel_pass(x + m0 * K, K, panel, prefetch, 11, acc); break;
                case 10: panel_pass(x + m0 * K, K, panel, prefetch, 10, acc); break;
                case 9: panel_pass(x + m0 * K, K, panel, prefetch, 9, acc); break;
                case 8: panel_pass(x + m0 * K, K, panel, prefetch, 8, acc); break;
                case 7: panel_pass(x + m0 * K, K, panel, prefetch, 7, acc); break;
                case 6: panel_pass(x + m0 * K, K, panel, prefetch, 6, acc); break;
                case 5: panel_pass(x + m0 * K, K, panel, prefetch, 5, acc); break;
                case 4: panel_pass(x + m0 * K, K, panel, prefetch, 4, acc); break;
                case 3: panel_pass(x + m0 * K, K, panel, prefetch, 3, acc); break;
                case 2: panel_pass(x + m0 * K, K, panel, prefetch, 2, acc); break;
                default: panel_pass(x + m0 * K, K, panel, prefetch, 1, acc); break;
            }
            for (int m = 0; m < rows; m++) {
                const int64_t at = (m0 + m) * N + n0;
                finish(acc[m][0], at, n0, N - n0, bias, out);
                finish(acc[m][1], at + 16, n0 + 16, N - n0 - 16, bias, out);
            }
        }
    }
}

enum { PRE_RMS_NORM = 1, PRE_SILU_MUL = 2 };  /* as in cpu_gemm.c */

/* out [M, K] = transformers' RMSNorm of x by norm_weight (PRE_RMS_NORM), or silu(gate) * up of x = [gate | up]
 * [M, 2K] (PRE_SILU_MUL) */
void pagedchat_pre_op_bf16(const uint16_t *x, int64_t M, int64_t K, int pre, const uint16_t *norm_weight,
                           float eps, uint16_t *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        uint16_t *row = out + m * K;
        if (pre == PRE_SILU_MUL) {
            const uint16_t *gate = x + m * 2 * K, *up = gate + K;
            for (int64_t k = 0; k < K; k += 16) {
                __mmask16 mask = first(K - k);
                __m512 g = widen16(gate + k, mask);
                __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
                _mm256_mask_storeu_epi16(row + k, mask, rounded16(_mm512_mul_ps(rounded_bf16(silu), widen16(up + k, mask))));
            }
            continue;
        }
        const uint16_t *in = x + m * K;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            __m512 v = widen16(in + k, first(K - k));
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)K + eps));
        for (int64_t k = 0; k < K; k += 16) {
            __mmask16 mask = first(K - k);
            __m512 normed = rounded_bf16(_mm512_mul_ps(widen16(in + k, mask), inverse));
            _mm256_mask_storeu_epi16(row + k, mask, rounded16(_mm512_mul_ps(widen16(norm_weight + k, mask), normed)));
        }
    }
}

/* the first `heads` heads of D of each row of y [M, N] rotated in place by its row of cos and sin_signed [M, D]:
 * y * cos + roll(y, D / 2) * sin_signed, each product and the sum rounded as torch's ops round */
void pagedchat_rotate_bf16(uint16_t *y, int64_t M, int64_t N, const uint16_t *cos, const uint16_t *sin_signed,
                           int64_t heads, int64_t head_dim, int threads) {
    const int64_t half = head_dim / 2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t d = 0; d < half; d += 16) {
                const __mmask16 mask = first(half - d);
                uint16_t *at = y + m * N + h * head_dim + d;
                const int64_t table = m * head_dim + d;
                __m512 one = widen16(at, mask), two = widen16(at + half, mask);
                __m512 a = rounded_bf16(_mm512_mul_ps(one, widen16(cos + table, mask)));
                __m512 b = rounded_bf16(_mm512_mul_ps(two, widen16(sin_signed + table, mask)));
                __m512 c = rounded_bf16(_mm512_mul_ps(two, widen16(cos + table + half, mask)));
                __m512 e = rounded_bf16(_mm512_mul_ps(one, widen16(sin_signed + table + half, mask)));
                _mm256_mask_storeu_epi16(at, mask, rounded16(_mm512_add_ps(a, b)));
                _mm256_mask_storeu_epi16(at + half, mask, rounded16(_mm512_add_ps(c, e)));
            }
}

/* out [M, N] = x [M, K] @ w [N, K]^T (+ bias) (+ residual), all bf16 (bias fp32), for CPUs with avx512_bf16:
 * the products of bf16 pairs summed in fp32 by VDPBF16PS, as oneDNN's bf16 product sums them, and rounded once
 * to bf16 (then the residual added and rounded again, as torch adds it to a bf16 product).
 *
 * The weight comes packed by `pack` (cpu_gemm_bf16.py): panels of 32 columns, in each the pairs of depths
 * 2j, 2j+1 of the 32 columns side by side (64 values, two registers), so a thread reads its panels in memory
 * order, one stream, and an instruction takes 16 columns by 2 depths of one x row, broadcast; no sums across
 * lanes. Each panel is multiplied with up to MR x rows at a time (2 MR accumulators); at a decode step's few
 * rows the product waits on the weight coming from memory, so the first pass over a panel prefetches
 * PREFETCH_AHEAD values ahead. The panels are split between the OpenMP threads, which are torch's own, as
 * many as the caller says. K must be even.
 */
#include <immintrin.h>
#include <stdint.h>

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

static inline __m512 widen16(const uint16_t *p, __mmask16 mask) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

static inline __m256i rounded16(__m512 v) {  /* to nearest even, as torch rounds */
    return (__m256i)_mm512_cvtneps_pbh(v);
}

/* out[m, n0 : n0 + 16] (its first `columns`) from an accumulator: + bias, rounded, + residual, rounded */
static inline void finish(__m512 sum, int64_t at, int64_t n0, int64_t columns, const float *bias,
                          const uint16_t *residual, uint16_t *out) {
    if (columns <= 0) return;
    __mmask16 mask = columns >= 16 ? 0xffff : (__mmask16)((1u << columns) - 1);
    if (bias) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, bias + n0));
    __m256i v = rounded16(sum);
    if (residual) {
        __m512 r = widen16(residual + at, mask);
        v = rounded16(_mm512_add_ps(r, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16))));
    }
    _mm256_mask_storeu_epi16(out + at, mask, v);
}

void pagedchat_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                           const float *bias, const uint16_t *residual, uint16_t *out, int threads) {
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
                finish(acc[m][0], at, n0, N - n0, bias, residual, out);
                finish(acc[m][1], at + 16, n0 + 16, N - n0 - 16, bias, residual, out);
            }
        }
    }
}

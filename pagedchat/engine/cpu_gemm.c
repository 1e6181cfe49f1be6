/* y [M, N] = x [M, K] @ w [N, K]^T (+ bias), in fp32, on the weight as the model holds it (bf16, fp16 or fp32).
 *
 * For CPUs with AVX2 and FMA but no bf16 instructions, where torch either emulates a half-precision product
 * (slow past a row or two) or needs an fp32 copy of every weight for oneDNN (twice the bytes to stream each
 * step, and twice the memory). Here each block of 4 weight rows is widened once into an L1-resident fp32
 * scratch, then dotted with the x rows 3 at a time (12 accumulators, all in registers); the rows of w are
 * split between the OpenMP threads, which are torch's own (the same libgomp), as many as the caller says.
 * K must be a multiple of 8; any M and N.
 */
#include <immintrin.h>
#include <stdint.h>

enum { WEIGHT_BF16 = 0, WEIGHT_FP16 = 1, WEIGHT_FP32 = 2 };
#define NR 4    /* weight rows per block */
#define MR 3    /* x rows per pass over a block */
#define KC 512  /* the depth of a block's scratch */

static inline __m256 load8(const void *w, int64_t i, int kind) {
    if (kind == WEIGHT_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (kind == WEIGHT_FP16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    return _mm256_loadu_ps((const float *)w + i);
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

static inline __m128 sum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

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
    for (int64_t kc = 0; kc < K; kc += KC) {
        int64_t kl = K - kc < KC ? K - kc : KC;
        for (int i = 0; i < NR; i++)
            for (int64_t k = 0; k < kl; k += 8)
                _mm256_store_ps(scratch + i * KC + k, load8(w, (n0 + i) * K + kc + k, kind));
        int64_t m = 0;
        for (; m + MR <= M; m += MR) block_pass(x + m * K + kc, K, scratch, kl, y + m * N + n0, N, MR);
        if (M - m == 2) block_pass(x + m * K + kc, K, scratch, kl, y + m * N + n0, N, 2);
        if (M - m == 1) block_pass(x + m * K + kc, K, scratch, kl, y + m * N + n0, N, 1);
    }
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

void pagedchat_linear(const float *x, int64_t M, int64_t K, const void *w, int kind, int64_t N,
                      const float *bias, float *y, int threads) {
    int64_t blocks = N / NR;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b <= blocks; b++) {
        int64_t n0 = b * NR, n1 = b < blocks ? n0 + NR : N;
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < n1; n++) y[m * N + n] = bias ? bias[n] : 0.0f;
        if (b < blocks)
            weight_block(x, M, K, w, kind, n0, y, N);
        else
            for (int64_t n = n0; n < n1; n++) weight_row(x, M, K, w, kind, n, y, N);
    }
}

/* cpu_attention.c's decode attention (the same arguments, and the same tasks for the OpenMP threads) for a bf16
 * cache on CPUs with avx512_bf16: each score a VDPBF16PS dot of the query's and the key's bf16 pairs summed in
 * fp32 (4 keys' lanes summed together), then scaled; the softmax and the values' sums in fp32, 16 lanes at a
 * time; the output rounded once to bf16. D a multiple of 16, at most 256.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "avx512.h"

#define AHEAD 8  /* as in cpu_attention.c: rows prefetched this many keys ahead */
#define MAX_VECTORS 16  /* of 16 lanes in a head: D <= 256 */

static inline void prefetch_row(const uint16_t *cache, int64_t at, int64_t head_dim) {
    for (int64_t b = 0; b < head_dim * 2; b += 64) _mm_prefetch((const char *)(cache + at) + b, _MM_HINT_T0);
}

static inline __m512 dot_lanes(const uint16_t *q, const uint16_t *key, int64_t head_dim) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 32) {
        __mmask32 mask = head_dim - d >= 32 ? 0xffffffffu : (1u << (head_dim - d)) - 1;
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(mask, q + d),
                               (__m512bh)_mm512_maskz_loadu_epi16(mask, key + d));
    }
    return acc;
}

/* the 4 lane sums of a, b, c, d */
static inline __m128 sum16x4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* scores[l] = scale * q . key l, for the keys at offsets `at` of the cache */
static void head_scores(const uint16_t *q, const uint16_t *cache, const int64_t *at, int64_t len,
                        int64_t head_dim, float scale, float *scores) {
    int64_t l = 0;
    for (; l + 4 <= len; l += 4) {
        for (int64_t ahead = l + AHEAD; ahead < l + AHEAD + 4 && ahead < len; ahead++)
            prefetch_row(cache, at[ahead], head_dim);
        __m128 sums = sum16x4(dot_lanes(q, cache + at[l], head_dim), dot_lanes(q, cache + at[l + 1], head_dim),
                              dot_lanes(q, cache + at[l + 2], head_dim), dot_lanes(q, cache + at[l + 3], head_dim));
        _mm_storeu_ps(scores + l, _mm_mul_ps(sums, _mm_set1_ps(scale)));
    }
    for (; l < len; l++) scores[l] = scale * _mm512_reduce_add_ps(dot_lanes(q, cache + at[l], head_dim));
}

/* scores become e^(score - max); returns their sum */
static float exponentiate(float *scores, int64_t len) {
    __m512 tops = _mm512_set1_ps(-INFINITY);
    for (int64_t l = 0; l < len; l += 16) tops = _mm512_max_ps(tops, _mm512_maskz_loadu_ps(first(len - l), scores + l));
    __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(tops)), sums = _mm512_setzero_ps();
    for (int64_t l = 0; l < len; l += 16) {
        __mmask16 mask = first(len - l);
        __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + l), top)));
        _mm512_mask_storeu_ps(scores + l, mask, e);
        sums = _mm512_add_ps(sums, e);
    }
    return _mm512_reduce_add_ps(sums);
}

/* o = sum over l of p[l] * value l, `vectors` of 16 lanes */
static inline __attribute__((always_inline)) void head_values(const float *p, const uint16_t *cache,
                                                              const int64_t *at, int64_t len, int64_t head_dim,
                                                              int vectors, __m512 o[MAX_VECTORS]) {
    __m512 a[MAX_VECTORS], b[MAX_VECTORS];
    for (int i = 0; i < vectors; i++) a[i] = b[i] = _mm512_setzero_ps();
    int64_t l = 0;
    for (; l + 2 <= len; l += 2) {  /* two keys at a time: twice the sums in flight */
        for (int64_t ahead = l + AHEAD; ahead < l + AHEAD + 2 && ahead < len; ahead++)
            prefetch_row(cache, at[ahead], head_dim);
        __m512 p0 = _mm512_set1_ps(p[l]), p1 = _mm512_set1_ps(p[l + 1]);
        for (int i = 0; i < vectors; i++) {
            a[i] = _mm512_fmadd_ps(p0, widen16(cache + at[l] + 16 * i, 0xffff), a[i]);
            b[i] = _mm512_fmadd_ps(p1, widen16(cache + at[l + 1] + 16 * i, 0xffff), b[i]);
        }
    }
    if (l < len)
        for (int i = 0; i < vectors; i++)
            a[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[l]), widen16(cache + at[l] + 16 * i, 0xffff), a[i]);
    for (int i = 0; i < vectors; i++) o[i] = _mm512_add_ps(a[i], b[i]);
}

int pagedchat_decode_attention_bf16(const uint16_t *query, int64_t q_stride, const int64_t *rows,
                                     const uint16_t *key_cache, const uint16_t *value_cache,
                                     const int32_t *block_tables, int64_t table_width, const int32_t *seq_lens,
                                     int64_t num_seqs, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                                     int64_t block_size, int kind, int cache_kind, float scale, uint16_t *out,
                                     int64_t out_stride,
                                     const uint16_t *key, int64_t key_stride, const uint16_t *value,
                                     int64_t value_stride, const int64_t *slots, int threads) {
    (void)kind, (void)cache_kind;  /* bf16 queries and cache: the caller checks */
    const int64_t group = num_q_heads / num_kv_heads, vectors = head_dim / 16;
    int failed = 0;
    #pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
        const int64_t s = task / num_kv_heads, h = task % num_kv_heads, len = seq_lens[s];
        const int32_t *table = block_tables + s * table_width;
        if (key) {
            const int64_t to = (slots[rows[s]] * num_kv_heads + h) * head_dim;
            memcpy((uint16_t *)key_cache + to, key + rows[s] * key_stride + h * head_dim, head_dim * 2);
            memcpy((uint16_t *)value_cache + to, value + rows[s] * value_stride + h * head_dim, head_dim * 2);
        }
        int64_t *at = malloc(sizeof(int64_t) * len);
        float *scores = malloc(sizeof(float) * len);
        if (!at || !scores) {  /* the other tasks still run: an error is reported once all have */
            free(at);
            free(scores);
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        for (int64_t b = 0, l = 0; l < len; b++)
            for (int64_t i = 0; i < block_size && l < len; i++, l++)
                at[l] = (((int64_t)table[b] * block_size + i) * num_kv_heads + h) * head_dim;
        for (int64_t g = 0; g < group; g++) {
            const uint16_t *q = query + rows[s] * q_stride + (h * group + g) * head_dim;
            head_scores(q, key_cache, at, len, head_dim, scale, scores);
            __m512 inverse = _mm512_set1_ps(1.0f / exponentiate(scores, len)), o[MAX_VECTORS];
            switch (vectors) {  /* the common head sizes with their sums all in registers */
                case 4: head_values(scores, value_cache, at, len, head_dim, 4, o); break;
                case 8: head_values(scores, value_cache, at, len, head_dim, 8, o); break;
                default: head_values(scores, value_cache, at, len, head_dim, (int)vectors, o); break;
            }
            uint16_t *to = out + rows[s] * out_stride + (h * group + g) * head_dim;
            for (int64_t i = 0; i < vectors; i++)
                _mm256_storeu_si256((__m256i *)(to + 16 * i), rounded16(_mm512_mul_ps(o[i], inverse)));
        }
        free(at);
        free(scores);
    }
    return failed;
}

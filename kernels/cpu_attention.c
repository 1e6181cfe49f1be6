/* Decode attention over a paged KV cache, read in place: for each sequence one query row of Hq heads, over
 * the first seq_lens[s] slots its block table names; softmax and sums in fp32, the output rounded once to
 * the cache's dtype (bf16, fp16 or fp32, as are the queries). Each (sequence, KV head) is one task for the
 * OpenMP threads (torch's own libgomp, as many as the caller says): its group of query heads reads each of
 * its keys and values once. D must be a multiple of 8.
 */
#include <math.h>
#include <stdlib.h>

#include "avx2.h"

/* The keys and values of a step's sequences are scattered over the pool, mostly beyond the caches: a row is
 * prefetched AHEAD rows before it is read (the first head of a group reads it from memory, the others from
 * the cache) */
#define AHEAD 8

static inline void prefetch_row(const void *cache, int64_t at, int kind, int64_t head_dim) {
    const int64_t size = kind == KIND_FP32 ? 4 : 2;
    for (int64_t b = 0; b < head_dim * size; b += 64) _mm_prefetch((const char *)cache + at * size + b, _MM_HINT_T0);
}

/* scores[l] = q . key l, for the keys at offsets `at` of the cache, 4 keys at a time (4 sums in flight) */
static void head_scores(const float *q, const void *cache, int kind, const int64_t *at, int64_t len,
                        int64_t head_dim, float *scores) {
    int64_t l = 0;
    for (; l + 4 <= len; l += 4) {
        for (int64_t ahead = l + AHEAD; ahead < l + AHEAD + 4 && ahead < len; ahead++)
            prefetch_row(cache, at[ahead], kind, head_dim);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < head_dim; d += 8) {
            __m256 qv = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(load8(cache, at[l] + d, kind), qv, a0);
            a1 = _mm256_fmadd_ps(load8(cache, at[l + 1] + d, kind), qv, a1);
            a2 = _mm256_fmadd_ps(load8(cache, at[l + 2] + d, kind), qv, a2);
            a3 = _mm256_fmadd_ps(load8(cache, at[l + 3] + d, kind), qv, a3);
        }
        _mm_storeu_ps(scores + l, sum8x4(a0, a1, a2, a3));
    }
    for (; l < len; l++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 8)
            a = _mm256_fmadd_ps(load8(cache, at[l] + d, kind), _mm256_loadu_ps(q + d), a);
        scores[l] = sum8(a);
    }
}

/* scores become e^(score - max); returns their sum */
static float exponentiate(float *scores, int64_t len) {
    float top = scores[0], total = 0.0f;
    for (int64_t l = 1; l < len; l++) top = scores[l] > top ? scores[l] : top;
    __m256 sums = _mm256_setzero_ps();
    int64_t l = 0;
    for (; l + 8 <= len; l += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + l), _mm256_set1_ps(top)));
        _mm256_storeu_ps(scores + l, e);
        sums = _mm256_add_ps(sums, e);
    }
    for (; l < len; l++) total += scores[l] = expf(scores[l] - top);
    return total + sum8(sums);
}

/* o[d] = sum over l of p[l] * value l [d], 4 vectors of d (or 1 at the end) over 2 values at a time */
static void head_values(const float *p, const void *cache, int kind, const int64_t *at, int64_t len,
                        int64_t head_dim, float *o) {
    int64_t d = 0;
    for (; d + 32 <= head_dim; d += 32) {
        __m256 a[4], b[4];
        for (int i = 0; i < 4; i++) a[i] = b[i] = _mm256_setzero_ps();
        int64_t l = 0;
        for (; l + 2 <= len; l += 2) {
            for (int64_t ahead = l + AHEAD; d == 0 && ahead < l + AHEAD + 2 && ahead < len; ahead++)
                prefetch_row(cache, at[ahead], kind, head_dim);
            __m256 p0 = _mm256_set1_ps(p[l]), p1 = _mm256_set1_ps(p[l + 1]);
            for (int i = 0; i < 4; i++) {
                a[i] = _mm256_fmadd_ps(p0, load8(cache, at[l] + d + 8 * i, kind), a[i]);
                b[i] = _mm256_fmadd_ps(p1, load8(cache, at[l + 1] + d + 8 * i, kind), b[i]);
            }
        }
        if (l < len)
            for (int i = 0; i < 4; i++) a[i] = _mm256_fmadd_ps(_mm256_set1_ps(p[l]), load8(cache, at[l] + d + 8 * i, kind), a[i]);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + d + 8 * i, _mm256_add_ps(a[i], b[i]));
    }
    for (; d < head_dim; d += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t l = 0; l < len; l++) a = _mm256_fmadd_ps(_mm256_set1_ps(p[l]), load8(cache, at[l] + d, kind), a);
        _mm256_storeu_ps(o + d, a);
    }
}

/* query [S] rows at query + rows[s] * q_stride (Hq heads of D); out likewise at out + rows[s] * out_stride;
 * caches [blocks, block_size, Hkv, D]; block_tables [S, table_width]. Where `key`, each task first stores
 * its head of the sequence's new key and value (rows of Hkv heads at key + rows[s] * key_stride, value
 * likewise) in their slot, slots[rows[s]]: the new token's slot lies in a block of its own sequence's,
 * which no other task reads. */
int pagedchat_decode_attention(const void *query, int64_t q_stride, const int64_t *rows, const void *key_cache,
                                const void *value_cache, const int32_t *block_tables, int64_t table_width,
                                const int32_t *seq_lens, int64_t num_seqs, int64_t num_q_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int kind, float scale,
                                void *out, int64_t out_stride, const void *key, int64_t key_stride,
                                const void *value, int64_t value_stride, const int64_t *slots, int threads) {
    const int64_t group = num_q_heads / num_kv_heads, size = kind == KIND_FP32 ? 4 : 2;
    int failed = 0;
    #pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
        const int64_t s = task / num_kv_heads, h = task % num_kv_heads, len = seq_lens[s];
        const int32_t *table = block_tables + s * table_width;
        if (key) {
            const int64_t to = (slots[rows[s]] * num_kv_heads + h) * head_dim * size;
            memcpy((char *)key_cache + to, (const char *)key + (rows[s] * key_stride + h * head_dim) * size,
                   head_dim * size);
            memcpy((char *)value_cache + to, (const char *)value + (rows[s] * value_stride + h * head_dim) * size,
                   head_dim * size);
        }
        int64_t *at = malloc(sizeof(int64_t) * len);
        float *q = malloc(sizeof(float) * (2 * head_dim + len));
        if (!at || !q) {  /* the other tasks still run: an error is reported once all have */
            free(at);
            free(q);
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        float *o = q + head_dim, *scores = o + head_dim;
        for (int64_t b = 0, l = 0; l < len; b++)  /* block by block: a division a key costs as much as its dot */
            for (int64_t i = 0; i < block_size && l < len; i++, l++)
                at[l] = (((int64_t)table[b] * block_size + i) * num_kv_heads + h) * head_dim;
        for (int64_t g = 0; g < group; g++) {
            const int64_t head = rows[s] * q_stride + (h * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; d += 8)
                _mm256_storeu_ps(q + d, _mm256_mul_ps(_mm256_set1_ps(scale), load8(query, head + d, kind)));
            head_scores(q, key_cache, kind, at, len, head_dim, scores);
            float total = exponentiate(scores, len);
            head_values(scores, value_cache, kind, at, len, head_dim, o);
            const int64_t to = rows[s] * out_stride + (h * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; d += 8)
                store8(out, to + d, _mm256_div_ps(_mm256_loadu_ps(o + d), _mm256_set1_ps(total)), kind);
        }
        free(at);
        free(q);
    }
    return failed;
}

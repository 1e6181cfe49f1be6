/* Decode attention over a paged KV cache, read in place: for each sequence one query row of Hq heads, over
 * the first seq_lens[s] slots its block table names; softmax and sums in fp32, the output rounded once to
 * the queries' dtype (`kind`: bf16, fp16 or fp32). The cache is of `cache_kind`: one of those, or an 8-bit
 * cache (kernels/kv_quant.py: each slot's head a row of D int8 or fp8 e4m3 values and its fp32 scale), whose
 * scales are taken once per key: a key's after its dot with the query, a value's into its softmax weight.
 * Each sequence is one task for the OpenMP threads (torch's own libgomp, as many as the caller says), or a share
 * of its KV heads where the sequences are fewer than twice the threads: a task reads its slots' heads as one
 * contiguous span each, in order (one head's rows alone are a short run every Hkv rows, which the memory serves
 * far slower: bench/RESULTS.md). Each KV head's group of query heads, up to 4 at a time, shares each load (and
 * widening) of a key and a value. D must be a multiple of 8.
 */
#include <math.h>
#include <stdlib.h>

#include "avx2.h"

/* The keys and values of a step's sequences are scattered over the pool, mostly beyond the caches: a slot's span
 * is prefetched AHEAD slots before its keys are read, and a tile's values while the tile before it is summed */
#define AHEAD 2
#define TILE 16  /* slots whose values stay in L1 across their passes over d */
#define GROUP_CHUNK 4  /* query heads that share each load of a key or value (a KV head's group, in chunks) */

enum { KIND_INT8 = 3, KIND_FP8 = 4 };  /* past avx2.h's kinds: the 8-bit caches */
#define SCALE_BYTES 4

/* 8 e4m3 values as fp32: a normal one's exponent rebased by adding (127 - 7) to its field, a subnormal one
 * (exponent field 0) as its mantissa times 2^-9; neither makes an fp32 denormal */
static inline __m256 fp8x8(const uint8_t *p) {
    __m256i bits = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7f));
    __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23)));
    __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(1.0f / 512));
    __m256 tiny = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude));
    __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x80)), 24));
    return _mm256_or_ps(_mm256_blendv_ps(normal, subnormal, tiny), sign);
}

/* 8 values of a cache row at element i: an 8-bit cache's unscaled */
static inline __m256 cache8(const void *cache, int64_t i, int kind) {
    if (kind == KIND_INT8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)cache + i))));
    if (kind == KIND_FP8) return fp8x8((const uint8_t *)cache + i);
    return load8(cache, i, kind);
}

static inline float row_scale(const void *cache, int64_t row, int64_t head_dim) {
    float scale;
    memcpy(&scale, (const uint8_t *)cache + row + head_dim, sizeof scale);
    return scale;
}

/* |x| <= 448 as e4m3 bits, to nearest even (as torch converts) */
static uint8_t to_fp8(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint8_t sign = (u >> 24) & 0x80;
    u &= 0x7fffffff;
    float a;
    memcpy(&a, &u, 4);
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f);  /* subnormal: 8 rounds up to 2^-6 */
    u += 0x7ffff + ((u >> 20) & 1);  /* keep 3 mantissa bits */
    return sign | (uint8_t)((((u >> 23) - 120) << 3) | ((u >> 20) & 7));
}

/* One row of D values (of `kind`) into the cache's row at `to` (elements of `cache_kind`): converted, or
 * quantized with its scale as kv_quant.quantize does */
static void store_row(void *cache, int64_t to, int cache_kind, const void *row, int64_t from, int kind,
                      int64_t head_dim) {
    if (cache_kind < KIND_INT8) {
        if (cache_kind == kind) {
            const int64_t size = kind == KIND_FP32 ? 4 : 2;
            memcpy((char *)cache + to * size, (const char *)row + from * size, head_dim * size);
        } else {
            for (int64_t d = 0; d < head_dim; d++) store(cache, to + d, widen(row, from + d, kind), cache_kind);
        }
        return;
    }
    const float qmax = cache_kind == KIND_INT8 ? 127.0f : 448.0f;
    float top = 0.0f;
    for (int64_t d = 0; d < head_dim; d++) top = fmaxf(top, fabsf(widen(row, from + d, kind)));
    const float scale = top > 0.0f ? top / qmax : 1.0f;
    uint8_t *bytes = (uint8_t *)cache + to;
    for (int64_t d = 0; d < head_dim; d++) {
        float q = fminf(fmaxf(widen(row, from + d, kind) / scale, -qmax), qmax);
        bytes[d] = cache_kind == KIND_INT8 ? (uint8_t)(int8_t)nearbyintf(q) : to_fp8(q);
    }
    memcpy(bytes + head_dim, &scale, sizeof scale);
}

/* `count` elements of the cache from element `at` into L1 */
static inline void prefetch_span(const void *cache, int64_t at, int64_t count, int kind) {
    const int64_t size = kind == KIND_FP32 ? 4 : kind >= KIND_INT8 ? 1 : 2;
    for (int64_t b = 0; b < count * size; b += 64) _mm_prefetch((const char *)cache + at * size + b, _MM_HINT_T0);
}

/* scores[g * stride] = q[g] . the key at element `at` of the cache, for n query heads (rows of D in q) that
 * share it: the key is loaded (and widened) once for all n. n is a constant where this is inlined, so the sums
 * stay in registers. */
static inline __attribute__((always_inline)) void key_scores(const float *q, const void *cache, int kind, int64_t at,
                                                             int64_t head_dim, const int n, float *scores,
                                                             int64_t stride) {
    __m256 acc[GROUP_CHUNK];
    for (int g = 0; g < GROUP_CHUNK; g++) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 key = cache8(cache, at + d, kind);
        for (int g = 0; g < n; g++) acc[g] = _mm256_fmadd_ps(key, _mm256_loadu_ps(q + g * head_dim + d), acc[g]);
    }
    float sums[4];
    _mm_storeu_ps(sums, sum8x4(acc[0], acc[1], acc[2], acc[3]));
    for (int g = 0; g < n; g++) scores[g * stride] = sums[g];
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

/* o[g][d] (+)= sum over the tile's m values l of p[g * stride + l] * value l [d], for n query heads, 16 (then
 * 8) lanes of d at a time: each value loaded (and widened) once for all n; the values at elements at[l] + off.
 * The tile's rows stay in L1 across its passes over d. */
static inline __attribute__((always_inline)) void tile_values(const float *p, int64_t stride, const void *cache,
                                                              int kind, const int64_t *at, int64_t off, int64_t m,
                                                              int64_t head_dim, const int n, int add, float *o) {
    int64_t d = 0;
    for (; d + 16 <= head_dim; d += 16) {
        __m256 a[GROUP_CHUNK], b[GROUP_CHUNK];
        for (int g = 0; g < n; g++) {
            a[g] = add ? _mm256_loadu_ps(o + g * head_dim + d) : _mm256_setzero_ps();
            b[g] = add ? _mm256_loadu_ps(o + g * head_dim + d + 8) : _mm256_setzero_ps();
        }
        for (int64_t l = 0; l < m; l++) {
            const __m256 v0 = cache8(cache, at[l] + off + d, kind), v1 = cache8(cache, at[l] + off + d + 8, kind);
            for (int g = 0; g < n; g++) {
                const __m256 weight = _mm256_broadcast_ss(p + g * stride + l);
                a[g] = _mm256_fmadd_ps(weight, v0, a[g]);
                b[g] = _mm256_fmadd_ps(weight, v1, b[g]);
            }
        }
        for (int g = 0; g < n; g++) {
            _mm256_storeu_ps(o + g * head_dim + d, a[g]);
            _mm256_storeu_ps(o + g * head_dim + d + 8, b[g]);
        }
    }
    for (; d < head_dim; d += 8) {
        __m256 a[GROUP_CHUNK];
        for (int g = 0; g < n; g++) a[g] = add ? _mm256_loadu_ps(o + g * head_dim + d) : _mm256_setzero_ps();
        for (int64_t l = 0; l < m; l++) {
            const __m256 v = cache8(cache, at[l] + off + d, kind);
            for (int g = 0; g < n; g++) a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * stride + l), v, a[g]);
        }
        for (int g = 0; g < n; g++) _mm256_storeu_ps(o + g * head_dim + d, a[g]);
    }
}

/* key_scores and tile_values for n = 1..GROUP_CHUNK, each inlined with its n */
#define CHUNK_CASES(call) \
    switch (n) { case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; default: call(4); }

/* query [S] rows at query + rows[s] * q_stride (Hq heads of D); out likewise at out + rows[s] * out_stride;
 * caches [blocks, block_size, Hkv, D]; block_tables [S, table_width]. Where `key`, each task first stores
 * its heads of the sequence's new key and value (rows of Hkv heads at key + rows[s] * key_stride, value
 * likewise) in their slot, slots[rows[s]]: the new token's slot lies in a block of its own sequence's, whose
 * other tasks read other heads. */
int pagedchat_decode_attention(const void *query, int64_t q_stride, const int64_t *rows, const void *key_cache,
                                const void *value_cache, const int32_t *block_tables, int64_t table_width,
                                const int32_t *seq_lens, int64_t num_seqs, int64_t num_q_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int kind,
                                int cache_kind, float scale, void *out, int64_t out_stride, const void *key,
                                int64_t key_stride, const void *value, int64_t value_stride, const int64_t *slots,
                                int threads) {
    const int64_t group = num_q_heads / num_kv_heads;
    const int quantized = cache_kind >= KIND_INT8;
    const int64_t row = quantized ? head_dim + SCALE_BYTES : head_dim;  /* a cache row's elements */
    /* a task is a sequence's KV heads, or a share of them where there are too few sequences for the threads */
    int64_t parts = num_seqs > 0 ? (2 * threads + num_seqs - 1) / num_seqs : 1;
    parts = parts < 1 ? 1 : parts > num_kv_heads ? num_kv_heads : parts;
    int failed = 0;
    #pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t task = 0; task < num_seqs * parts; task++) {
        const int64_t s = task / parts, part = task % parts, len = seq_lens[s];
        const int64_t h0 = part * num_kv_heads / parts, h1 = (part + 1) * num_kv_heads / parts;
        const int64_t kv_heads = h1 - h0, heads = kv_heads * group, span = kv_heads * row;
        const int32_t *table = block_tables + s * table_width;
        if (key)
            for (int64_t h = h0; h < h1; h++) {
                const int64_t to = (slots[rows[s]] * num_kv_heads + h) * row;
                store_row((void *)key_cache, to, cache_kind, key, rows[s] * key_stride + h * head_dim, kind,
                          head_dim);
                store_row((void *)value_cache, to, cache_kind, value, rows[s] * value_stride + h * head_dim, kind,
                          head_dim);
            }
        int64_t *at = malloc(sizeof(int64_t) * len);
        /* the task's queries and outputs, their scores and sums, and an 8-bit cache's key and value scales */
        float *q = malloc(sizeof(float) * (2 * heads * head_dim + heads * (len + 1) + 2 * kv_heads * len));
        if (!at || !q) {  /* the other tasks still run: an error is reported once all have */
            free(at);
            free(q);
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        float *o = q + heads * head_dim, *scores = o + heads * head_dim, *total = scores + heads * len;
        float *key_scales = total + heads, *value_scales = key_scales + kv_heads * len;
        for (int64_t b = 0, l = 0; l < len; b++)  /* block by block: a division a key costs as much as its dot */
            for (int64_t i = 0; i < block_size && l < len; i++, l++)
                at[l] = (((int64_t)table[b] * block_size + i) * num_kv_heads + h0) * row;
        for (int64_t l = 0; l < (len < AHEAD ? len : AHEAD); l++) prefetch_span(key_cache, at[l], span, cache_kind);
        for (int64_t j = 0; j < heads; j++) {
            const int64_t head = rows[s] * q_stride + (h0 * group + j) * head_dim;
            for (int64_t d = 0; d < head_dim; d += 8)
                _mm256_storeu_ps(q + j * head_dim + d,
                                 _mm256_mul_ps(_mm256_set1_ps(scale), load8(query, head + d, kind)));
        }
        /* the keys slot by slot, each slot's heads of the task one contiguous span of the cache */
        for (int64_t l = 0; l < len; l++) {
            if (l + AHEAD < len) prefetch_span(key_cache, at[l + AHEAD], span, cache_kind);
            for (int64_t h = 0; h < kv_heads; h++)
                for (int64_t first = 0; first < group; first += GROUP_CHUNK) {
                    const int n = group - first < GROUP_CHUNK ? (int)(group - first) : GROUP_CHUNK;
                    const int64_t j = h * group + first;
#define SCORES(N) \
    key_scores(q + j * head_dim, key_cache, cache_kind, at[l] + h * row, head_dim, N, scores + j * len + l, len)
                    CHUNK_CASES(SCORES)
                }
        }
        for (int64_t l = 0; l < (len < TILE ? len : TILE); l++) prefetch_span(value_cache, at[l], span, cache_kind);
        if (quantized)
            for (int64_t h = 0; h < kv_heads; h++)
                for (int64_t l = 0; l < len; l++) {
                    key_scales[h * len + l] = row_scale(key_cache, at[l] + h * row, head_dim);
                    value_scales[h * len + l] = row_scale(value_cache, at[l] + h * row, head_dim);
                }
        for (int64_t j = 0; j < heads; j++) {
            float *p = scores + j * len;
            const float *ks = key_scales + (j / group) * len, *vs = value_scales + (j / group) * len;
            if (quantized)  /* a key's scale after its dot; a value's into its weight, after the sum */
                for (int64_t l = 0; l < len; l++) p[l] *= ks[l];
            total[j] = exponentiate(p, len);
            if (quantized)
                for (int64_t l = 0; l < len; l++) p[l] *= vs[l];
        }
        /* the values a tile of slots at a time, the next tile's fetched meanwhile */
        for (int64_t t = 0; t < len; t += TILE) {
            const int64_t m = len - t < TILE ? len - t : TILE;
            for (int64_t l = t + TILE; l < t + 2 * TILE && l < len; l++)
                prefetch_span(value_cache, at[l], span, cache_kind);
            for (int64_t h = 0; h < kv_heads; h++)
                for (int64_t first = 0; first < group; first += GROUP_CHUNK) {
                    const int n = group - first < GROUP_CHUNK ? (int)(group - first) : GROUP_CHUNK;
                    const int64_t j = h * group + first;
#define VALUES(N) tile_values(scores + j * len + t, len, value_cache, cache_kind, at + t, h * row, m, head_dim, N, \
                              t > 0, o + j * head_dim)
                    CHUNK_CASES(VALUES)
                }
        }
        for (int64_t j = 0; j < heads; j++) {
            const int64_t to = rows[s] * out_stride + (h0 * group + j) * head_dim;
            for (int64_t d = 0; d < head_dim; d += 8)
                store8(out, to + d, _mm256_div_ps(_mm256_loadu_ps(o + j * head_dim + d), _mm256_set1_ps(total[j])),
                       kind);
        }
        free(at);
        free(q);
    }
    return failed;
}

/* Decode attention over a paged KV cache, read in place: for each sequence one query row of Hq heads, over
 * the first seq_lens[s] slots its block table names; softmax and sums in fp32, the output rounded once to
 * the cache's dtype (bf16, fp16 or fp32, as are the queries). Each (sequence, KV head) is one task for the
 * OpenMP threads (torch's own libgomp, as many as the caller says): its group of query heads reads each of
 * its keys and values once. D must be a multiple of 8.
 */
#include <math.h>
#include <stdlib.h>

#include "avx2.h"

/* query [S] rows at query + rows[s] * q_stride (Hq heads of D); out likewise at out + rows[s] * out_stride;
 * caches [blocks, block_size, Hkv, D]; block_tables [S, table_width] */
void pagedchat_decode_attention(const void *query, int64_t q_stride, const int64_t *rows, const void *key_cache,
                                const void *value_cache, const int32_t *block_tables, int64_t table_width,
                                const int32_t *seq_lens, int64_t num_seqs, int64_t num_q_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int kind, float scale,
                                void *out, int64_t out_stride, int threads) {
    const int64_t group = num_q_heads / num_kv_heads, vecs = head_dim / 8;
    #pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
        const int64_t s = task / num_kv_heads, h = task % num_kv_heads, len = seq_lens[s];
        const int32_t *table = block_tables + s * table_width;
        float *q = malloc(sizeof(float) * (group * (len + 2 * head_dim)));
        float *acc = q + group * head_dim, *scores = acc + group * head_dim;
        for (int64_t g = 0; g < group; g++)
            for (int64_t v = 0; v < vecs; v++)
                _mm256_storeu_ps(q + g * head_dim + 8 * v,
                                 _mm256_mul_ps(_mm256_set1_ps(scale),
                                               load8(query, rows[s] * q_stride + (h * group + g) * head_dim + 8 * v, kind)));
        for (int64_t l = 0; l < len; l++) {
            const int64_t at = ((int64_t)table[l / block_size] * block_size + l % block_size) * num_kv_heads + h;
            for (int64_t g = 0; g < group; g++) {
                __m256 dot = _mm256_setzero_ps();
                for (int64_t v = 0; v < vecs; v++)
                    dot = _mm256_fmadd_ps(load8(key_cache, at * head_dim + 8 * v, kind),
                                          _mm256_loadu_ps(q + g * head_dim + 8 * v), dot);
                scores[g * len + l] = sum8(dot);
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *row = scores + g * len, top = row[0], total = 0.0f;
            for (int64_t l = 1; l < len; l++) top = row[l] > top ? row[l] : top;
            for (int64_t l = 0; l < len; l++) total += row[l] = expf(row[l] - top);
            for (int64_t l = 0; l < len; l++) row[l] /= total;
        }
        memset(acc, 0, sizeof(float) * group * head_dim);
        for (int64_t l = 0; l < len; l++) {
            const int64_t at = ((int64_t)table[l / block_size] * block_size + l % block_size) * num_kv_heads + h;
            for (int64_t v = 0; v < vecs; v++) {
                __m256 value = load8(value_cache, at * head_dim + 8 * v, kind);
                for (int64_t g = 0; g < group; g++) {
                    float *a = acc + g * head_dim + 8 * v;
                    _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(scores[g * len + l]), value, _mm256_loadu_ps(a)));
                }
            }
        }
        for (int64_t g = 0; g < group; g++)
            for (int64_t d = 0; d < head_dim; d++)
                store(out, rows[s] * out_stride + (h * group + g) * head_dim + d, acc[g * head_dim + d], kind);
        free(q);
    }
}

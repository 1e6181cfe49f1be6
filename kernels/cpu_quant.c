/* y [M, N] (fp32, rows ldy apart) = x [M, K] @ W [N, K]^T, where W is a GGUF tensor of type Q8_0, Q4_0, Q4_1,
 * Q4_K, Q5_K or Q6_K as the file holds it (N rows of ggml's blocks), multiplied where it lies, with no
 * dequantized copy: a model's weights stay 4.5-8.5 bits a value in memory, and one chat's decode, bound by the
 * bytes it streams, reads 2-4x fewer than in bf16.
 *
 * x (fp32, bf16 or fp16) is first quantized per row to 8 bits, as llama.cpp pairs it with each type: blocks
 * of 32 with an fp32 scale for Q8_0, Q4_0 and Q4_1, blocks of 256 for the K-quants, with the block sums that
 * the weights' offsets and mins multiply (`acts`). A weight block against an x block is then a dot product
 * of bytes in integers (u8 x s8 pairs summed to s16, then s32: AVX2's maddubs and madd), scaled in fp32 once
 * per block (once per 256 values for the K-quants, whose sub-block scales are integers applied by madd).
 *
 * The weight rows are split between the OpenMP threads in contiguous ranges; a thread takes its range in
 * tiles small enough to stay in L2, and multiplies each row of a tile against MR rows of x at a time, a piece
 * of K at a time (the piece's bytes of x stay in L1 across the tile), so the weights are read from memory
 * once a call whatever M is, and each weight block is unpacked once per MR rows of x (Q4_K's and Q6_K's by
 * lane, once a tile for all of a prefill's rows: unpack_tile).
 *
 * One file, built per instruction set: with -mavx2 -mfma -mf16c the AVX2 kernels below (with VNNI, their
 * byte products in vpdpbusd); with AVX-512 as well, the many-row kernels take two blocks at once in 512-bit
 * registers and the K-quants 16 rows of x a pass, and Q4_K's one-row kernel two sub-blocks a register; without
 * AVX2, the portable ones (plain C, which unpacks each weight block into bytes and lets the compiler vectorise
 * the dot products as it can), for any CPU.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>
#include <pthread.h>

#if defined(__AVX2__)
#include "avx2.h"
#else
enum { KIND_BF16 = 0, KIND_FP16 = 1, KIND_FP32 = 2 };  /* avx2.h's kinds, which the AVX2 build takes from it */
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  /* ggml_type */
/* rows of x multiplied against each weight row in one pass: each weight block is unpacked once per MR rows, and
 * AVX-512's 32 registers hold the accumulators of 16; Q8_0's, Q4_0's and Q4_1's blocks unpack in a few
 * instructions, and more than MR_SMALL rows only spill their accumulators */
#if defined(__AVX512F__)
#define MR 16
#else
#define MR 8
#endif
#define MR_SMALL 8
/* the rows of a pass from which Q4_0 and Q4_1 take the by-lane kernels (AVX-512 VNNI): at 2, unpacking 16 blocks
 * for each weight row cost more than it saved (bench/RESULTS.md) */
#define Q4_BY_LANE 3
#define Q6_BY_LANE 5  /* and Q6_K from 5: its unpacking by lane costs more */
#define TILE_BYTES 65536  /* the weight bytes of a tile (L2-resident while all of x passes over it) */
#define X_PIECE_BYTES 16384  /* the bytes of x's rows in a pass over a tile, L1-resident while its rows pass (`acts`) */
#define ALWAYS static inline __attribute__((always_inline))
/* Before a loop over the rows of a pass: unrolled whole, so that each row's accumulator has a fixed place, a
 * register or a stack slot (left to itself, GCC unrolls the loop for 2-6 rows but keeps it for 7 and 8, the
 * full passes, indexing an array of accumulators) */
#define EACH_ROW _Pragma("GCC unroll 16")
/* One row's K-quant kernels ask for the weights' cache lines this far ahead of the block they reach: with the
 * hardware's prefetcher alone a chat's decode read its weights well short of memory's pace (bench/RESULTS.md).
 * A prefetch past the end of a mapping is harmless: it never faults. */
#define PREFETCH 2048
#define PREFETCH_AHEAD(p, bytes) \
    for (int line_ = 0; line_ < (bytes); line_ += 64) __builtin_prefetch((const char *)(p) + PREFETCH + line_, 0, 3)

/* ggml's blocks; fp16 fields as their bits */
typedef struct { uint16_t d; int8_t qs[32]; } block_q8_0;
typedef struct { uint16_t d; uint8_t qs[16]; } block_q4_0;            /* value l: low nibble of qs[l], l + 16: high */
typedef struct { uint16_t d, m; uint8_t qs[16]; } block_q4_1;
typedef struct { uint16_t d, dmin; uint8_t scales[12], qs[128]; } block_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12], qh[32], qs[128]; } block_q5_K;
typedef struct { uint8_t ql[128], qh[64]; int8_t scales[16]; uint16_t d; } block_q6_K;
_Static_assert(sizeof(block_q8_0) == 34 && sizeof(block_q4_0) == 18 && sizeof(block_q4_1) == 20, "ggml layout");
_Static_assert(sizeof(block_q4_K) == 144 && sizeof(block_q5_K) == 176 && sizeof(block_q6_K) == 210, "ggml layout");

/* x quantized: q [M, K] (for Q4_0 and Q4_1 in the AVX2 build, each pair of blocks in the order that
 * q4_pair_step reads) and its blocks' d [M, K / 32 or 256]; for all but Q6_K, ds [M, K / 32], the block's d
 * times the sum of each 32 (which Q4_0's offset, Q4_1's m and the mins of Q4_K and Q5_K multiply); for Q6_K,
 * the sums of each 16 [M, K / 16] (which its offset times its scales multiply); and d once more by pass, dt
 * [M rounded up to a pass, K / 32 or 256]: block b's d of the pass of rows m0.. (m0 a multiple of pass_rows)
 * side by side at dt + m0 * nb + b * pass_rows, so that a weight block's d times all of them is one product.
 * For Q4_K's and Q6_K's rows that the by-lane kernels multiply, their q lies pass-major (x_by_lane's 512 bytes of
 * pair p of row m at m0 * K + (p * mr + m - m0) * 512, m0 the pass's first row and mr its rows), and lane
 * [M, K / 16] beside it likewise: for each pair and row, each lane's d (16), then for Q4_K d * sum (16).
 * Held in pieces of `span` values of K, piece by piece (all M rows of the first, then of the second, ...):
 * a piece is an `acts` of its own (piece_of), and the products take x a piece at a time, so that the rows of
 * x a pass multiplies stay in L1 however deep K is (8 rows of an 8192-deep down projection are 64 KB). */
typedef struct {
    int8_t *q;
    float *d, *ds, *lane;
    int16_t *sums16;
    float *dt;  /* d again, by pass: the d of block b of the pass's rows side by side (pass_rows, below) */
    int64_t M, K, span;
    int qb;
} acts;

static int block_values(int type) { return type == Q4_K || type == Q5_K || type == Q6_K ? 256 : 32; }

/* The rows of x that a pass multiplies against each weight row (all M rows where fewer): MR for the K-quants,
 * MR_SMALL for the blocks of 32 */
static int64_t pass_rows(int qb) { return qb == 256 ? MR : MR_SMALL; }

/* M rounded up to a whole number of passes: the rows that dt holds */
static int64_t padded_rows(int64_t M, int qb) { return (M + pass_rows(qb) - 1) / pass_rows(qb) * pass_rows(qb); }

/* The rows of x in row m's pass, in passes of `pass` rows */
static int64_t pass_of(int64_t m, int64_t M, int64_t pass) {
    const int64_t left = M - m / pass * pass;
    return left < pass ? left : pass;
}

/* Whether a pass of `rows` rows of x, K deep in its piece, goes by lane (AVX-512 VNNI): x's layout
 * (quantize_piece) and the kernel the pass takes both ask here. Q4_0 and Q4_1 from Q4_BY_LANE rows, Q6_K from
 * Q6_BY_LANE; Q4_K and Q6_K two blocks at a time, so a piece of an odd count of blocks stays side by side. */
static inline int by_lane_pass(int type, int64_t rows, int64_t K) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (type == Q8_0) return rows > 1;
    if (type == Q4_0 || type == Q4_1) return rows >= Q4_BY_LANE;
    if (type == Q4_K) return rows > 1 && K / 256 % 2 == 0;
    if (type == Q6_K) return rows >= Q6_BY_LANE && K / 256 % 2 == 0;
#endif
    (void)type, (void)rows, (void)K;
    return 0;
}

static int64_t block_bytes(int type) {
    switch (type) {
    case Q4_0: return sizeof(block_q4_0);
    case Q4_1: return sizeof(block_q4_1);
    case Q8_0: return sizeof(block_q8_0);
    case Q4_K: return sizeof(block_q4_K);
    case Q5_K: return sizeof(block_q5_K);
    default: return sizeof(block_q6_K);
    }
}

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) u = sign | 0x7f800000 | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else {  /* zero or subnormal: man * 2^-24, exactly */
        float f = (float)man * 0x1p-24f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline int32_t load32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline float half_at(const uint8_t *p) {  /* the fp16 at p, which a block's layout may leave unaligned */
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* Q4_K's and Q5_K's 12 packed bytes as 8 6-bit scales (the bytes of u[0], u[1]) and 8 mins (u[2], u[3]):
 * scales and mins 0-3 are the low 6 bits of bytes 0-3 and 4-7; 4-7 the nibbles of bytes 8-11 below the top
 * 2 bits of bytes 0-3 and 4-7 */
static inline void k_scales(const uint8_t *packed, uint32_t u[4]) {
    const uint32_t s0 = load32(packed), s1 = load32(packed + 4), s2 = load32(packed + 8);
    u[0] = s0 & 0x3f3f3f3f;
    u[1] = (s2 & 0x0f0f0f0f) | ((s0 >> 2) & 0x30303030);
    u[2] = s1 & 0x3f3f3f3f;
    u[3] = ((s2 >> 4) & 0x0f0f0f0f) | ((s1 >> 2) & 0x30303030);
}

/* A block of 32 as bytes: value l = d * q[l] + m */
typedef struct { float d, m; int8_t q[32]; } small_block;

static void unpack_small(int type, const uint8_t *src, small_block *o) {
    o->d = half_at(src);
    o->m = type == Q4_1 ? half_at(src + 2) : 0.0f;
    if (type == Q8_0) {
        memcpy(o->q, src + 2, 32);
        return;
    }
    const uint8_t *qs = src + (type == Q4_1 ? 4 : 2);
    const int offset = type == Q4_0 ? 8 : 0;
    for (int l = 0; l < 16; l++) {
        o->q[l] = (int8_t)((qs[l] & 15) - offset);
        o->q[l + 16] = (int8_t)((qs[l] >> 4) - offset);
    }
}

/* A K-quant block of 256 as bytes: value i = d * sc[i / 16] * q[i] - dmin * mn[i / 32] */
typedef struct { float d, dmin; int8_t q[256]; int16_t sc[16], mn[8]; } k_block;

static void unpack_k(int type, const uint8_t *src, k_block *o) {
    if (type == Q6_K) {
        const block_q6_K *b = (const block_q6_K *)src;
        o->d = half_at(src + offsetof(block_q6_K, d));
        o->dmin = 0.0f;
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const int a = b->ql[64 * h + l], c = b->ql[64 * h + 32 + l], hb = b->qh[32 * h + l];
                int8_t *q = o->q + 128 * h + l;
                q[0] = (int8_t)(((a & 15) | (hb & 3) << 4) - 32);
                q[32] = (int8_t)(((c & 15) | (hb >> 2 & 3) << 4) - 32);
                q[64] = (int8_t)(((a >> 4) | (hb >> 4 & 3) << 4) - 32);
                q[96] = (int8_t)(((c >> 4) | (hb >> 6) << 4) - 32);
            }
        for (int g = 0; g < 16; g++) o->sc[g] = b->scales[g];
        memset(o->mn, 0, sizeof(o->mn));
        return;
    }
    const int five = type == Q5_K;
    const uint8_t *qs = src + (five ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs));
    const uint8_t *qh = src + offsetof(block_q5_K, qh);
    uint32_t u[4];
    uint8_t sm[16];
    o->d = half_at(src);
    o->dmin = half_at(src + 2);
    k_scales(src + 4, u);
    memcpy(sm, u, 16);
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            int lo = qs[32 * j + l] & 15, hi = qs[32 * j + l] >> 4;
            if (five) {
                lo |= (qh[l] >> (2 * j) & 1) << 4;
                hi |= (qh[l] >> (2 * j + 1) & 1) << 4;
            }
            o->q[64 * j + l] = (int8_t)lo;
            o->q[64 * j + 32 + l] = (int8_t)hi;
        }
    for (int g = 0; g < 16; g++) o->sc[g] = sm[g / 2];
    for (int j = 0; j < 8; j++) o->mn[j] = sm[8 + j];
}

/* the block's values in fp32, rounded as gguf's dequantizer rounds them ((d * scale) * q - dmin * min) */
static void dequantize_block(int type, const uint8_t *src, float *out) {
    if (block_values(type) == 32) {
        small_block b;
        unpack_small(type, src, &b);
        for (int l = 0; l < 32; l++) out[l] = b.d * (float)b.q[l] + b.m;
        return;
    }
    k_block b;
    unpack_k(type, src, &b);
    for (int g = 0; g < 16; g++) {
        const float ds = b.d * (float)b.sc[g], dm = b.dmin * (float)b.mn[g / 2];
        for (int l = 0; l < 16; l++) out[16 * g + l] = ds * (float)b.q[16 * g + l] - dm;
    }
}

#if !defined(__AVX2__)  /* avx2.h has its own */
static inline float widen(const void *p, int64_t i, int kind) {
    if (kind == KIND_FP32) return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    if (kind == KIND_FP16) return half_to_float(h);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif

/* Blocks of qb (32 or 256) of row x: q = round(x * 127 / amax) to nearest even, d = amax / 127 */
static void quantize_row(const void *x, int kind, int64_t K, int qb, int8_t *q, float *d) {
    for (int64_t b0 = 0; b0 < K; b0 += qb) {
#if defined(__AVX2__)
        float v[256] __attribute__((aligned(32)));
        __m256 mx = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < qb; i += 8) {
            const __m256 xi = load8(x, b0 + i, kind);
            _mm256_store_ps(v + i, xi);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, xi));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (int i = 0; i < qb; i += 32) {  /* cvtps rounds to nearest even, as MXCSR is left */
            const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + i), id));
            const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + i + 8), id));
            const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + i + 16), id));
            const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + i + 24), id));
            /* the packs interleave 4-value groups of the 128-bit halves; the permute puts them back in order */
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            _mm256_storeu_si256((__m256i *)(q + b0 + i), _mm256_permutevar8x32_epi32(p, order));
        }
#else
        float v[256], amax = 0.0f;
        for (int i = 0; i < qb; i++) {
            v[i] = widen(x, b0 + i, kind);
            amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        }
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < qb; i++) q[b0 + i] = (int8_t)lrintf(v[i] * id);
#endif
        d[b0 / qb] = amax / 127.0f;
    }
}

#if defined(__AVX2__)
/* The K-quants against more than one row of x (below) sum the s16 products of two or four registers before
 * one madd applies their sub-blocks' scales, where each register would take a madd of its own: a quarter or
 * a sixth fewer of the vector multiplies that bound a batch. That takes each 16-bit word of the registers
 * summed to hold bytes of one sub-block, the same in each; these two shuffles make it so, from registers
 * of one sub-block each, and x's rows are shuffled alike once, as they are quantized. */

/* words_4x4: word k of each register from register k % 4 (a 4 x 4 transpose of the words of each 64 bits) */
ALWAYS void words_4x4(__m256i v[4]) {
    const __m256i p0 = _mm256_unpacklo_epi16(v[0], v[1]), p1 = _mm256_unpackhi_epi16(v[0], v[1]);
    const __m256i q0 = _mm256_unpacklo_epi16(v[2], v[3]), q1 = _mm256_unpackhi_epi16(v[2], v[3]);
    v[0] = _mm256_unpacklo_epi32(p0, q0);
    v[1] = _mm256_unpackhi_epi32(p0, q0);
    v[2] = _mm256_unpacklo_epi32(p1, q1);
    v[3] = _mm256_unpackhi_epi32(p1, q1);
}

/* words_2x2: word k of each register from register k % 2, within each 128-bit half */
ALWAYS void words_2x2(__m256i v[2]) {
    const __m256i lo = _mm256_unpacklo_epi16(v[0], v[1]);
    v[1] = _mm256_unpackhi_epi16(v[0], v[1]);
    v[0] = lo;
}

/* x's row as the many-row K-quant kernels read it: each 128 bytes through words_4x4 (Q4_K, Q5_K) or each 64
 * through words_2x2 (Q6_K) */
static void shuffle_for_k(int8_t *q, int64_t K, int type) {
    const int span = type == Q6_K ? 64 : 128;
    for (int64_t i = 0; i < K; i += span) {
        __m256i v[4];
        for (int t = 0; t < span / 32; t++) v[t] = _mm256_loadu_si256((const __m256i *)(q + i + 32 * t));
        if (type == Q6_K) words_2x2(v);
        else words_4x4(v);
        for (int t = 0; t < span / 32; t++) _mm256_storeu_si256((__m256i *)(q + i + 32 * t), v[t]);
    }
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* x's row as the by-lane kernels read it (rows_q8_0_groups, rows_q4_groups, rows_k_by_lane): each whole 512
 * bytes as 8 registers' worth, register o's 32-bit lane l bytes 4o..4o + 3 of the l-th 32 values (a block, or a
 * K-quant's sub-block or two); for Q8_0 and Q6_K offset by 128 to unsigned bytes. The count of 32 values that
 * lie so. */
static int64_t x_by_lane(int8_t *q, int64_t K, int type) {
    const uint32_t offset = type == Q8_0 || type == Q6_K ? 0x80808080u : 0;
    for (int64_t i = 0; i + 512 <= K; i += 512) {
        uint32_t t[128];
        for (int l = 0; l < 16; l++)
            for (int o = 0; o < 8; o++) memcpy(&t[16 * o + l], q + i + 32 * l + 4 * o, 4);
        for (int k = 0; k < 128; k++) t[k] ^= offset;
        memcpy(q + i, t, 512);
    }
    return K / 512 * 16;
}
#endif

#if defined(__AVX512BW__)
/* Each pair of x's 256-byte blocks as the many-row K-quant kernels read it: 32 bytes of the first, 32 of the second, ... */
static void pair_blocks(int8_t *q, int64_t K) {
    for (int64_t i = 0; i + 512 <= K; i += 512) {
        int8_t pair[512];
        for (int t = 0; t < 8; t++) {
            memcpy(pair + 64 * t, q + i + 32 * t, 32);
            memcpy(pair + 64 * t + 32, q + i + 256 + 32 * t, 32);
        }
        memcpy(q + i, pair, 512);
    }
}
#endif
#endif

/* Row m of x's piece a from its K values at x */
static void quantize_piece(const void *x, int kind, int64_t m, const acts *a, int type) {
    const int64_t K = a->K;
    const int qb = block_values(type);
    const int64_t pass = pass_rows(qb), nb = K / qb, mr = pass_of(m, a->M, pass);
    const int lanes = by_lane_pass(type, mr, K);
    int8_t *q = a->q + m * K;
    float *d = a->d + m * (K / qb);
    /* a K-quant row that goes by lane lies pass-major, so is quantized here first: its place in q is other rows'
     * (a pass of 2 or more rows takes x in pieces of at most X_PIECE_BYTES / 2 values) */
    int8_t row[X_PIECE_BYTES / 2] __attribute__((aligned(64)));
    if (lanes && qb == 256) q = row;
    quantize_row(x, kind, K, qb, q, d);
    for (int64_t b = 0; b < nb; b++) a->dt[(m / pass * nb + b) * pass + m % pass] = d[b];
    if (type != Q6_K)
        for (int64_t b = 0; b < K / 32; b++) {
            int s = 0;
            for (int l = 0; l < 32; l++) s += q[32 * b + l];
            a->ds[m * (K / 32) + b] = d[b * 32 / qb] * (float)s;
        }
#if defined(__AVX2__)  /* the portable kernels take Q6_K's offset off its values as they unpack them */
    else
        for (int64_t g = 0; g < K / 16; g++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += q[16 * g + l];
            a->sums16[m * (K / 16) + g] = (int16_t)s;
        }
    if (qb == 256 && mr > 1) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
        if (lanes) {
            const int64_t m0 = m / pass * pass;
            x_by_lane(q, K, type);
            for (int64_t p = 0; p < K / 512; p++) {
                memcpy(a->q + m0 * K + (p * mr + m - m0) * 512, q + 512 * p, 512);
                float *lane = a->lane + m0 * (K / 16) + (p * mr + m - m0) * 32;
                for (int l = 0; l < 16; l++) {
                    lane[l] = d[2 * p + l / 8];
                    lane[16 + l] = type == Q4_K ? a->ds[m * (K / 32) + 16 * p + l] : 0.0f;
                }
            }
            return;
        }
#endif
        shuffle_for_k(q, K, type);
#if defined(__AVX512BW__)
        pair_blocks(q, K);
#endif
    }
    int64_t by_lane = 0;  /* blocks that x_by_lane laid out */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (lanes) by_lane = x_by_lane(q, K, type);
#endif
    if (type == Q4_0 || type == Q4_1)  /* each further pair of blocks as rows_q4_pairs reads it */
        for (int64_t b = by_lane; b + 1 < K / 32; b += 2) {
            int8_t swap[16];
            memcpy(swap, q + 32 * b + 16, 16);
            memcpy(q + 32 * b + 16, q + 32 * b + 32, 16);
            memcpy(q + 32 * b + 32, swap, 16);
        }
#endif
}

/* The piece of x's pieces that holds values c * span.. of each row, as an `acts` of its own */
static acts piece_of(const acts *a, int64_t c) {
    const int64_t k0 = c * a->span, K = a->K - k0 < a->span ? a->K - k0 : a->span, at = a->M * k0;
    return (acts){a->q + at, a->d + at / a->qb, a->ds + at / 32, a->lane + at / 16, a->sums16 + at / 16,
                  a->dt + padded_rows(a->M, a->qb) * k0 / a->qb, a->M, K, K, a->qb};
}

/* Row m of x into each piece of a */
static void quantize_acts(const void *x, int kind, int64_t m, const acts *a, int type) {
    const int64_t elem = kind == KIND_FP32 ? 4 : 2;
    for (int64_t k0 = 0; k0 < a->K; k0 += a->span) {
        const acts p = piece_of(a, k0 / a->span);
        quantize_piece((const char *)x + (m * a->K + k0) * elem, kind, m, &p, type);
    }
}

/* Each kernel: y[r * ldy] = weight row w . x row m0 + r, for r < mr (at most MR), mr a constant where the
 * kernel is inlined, so that its accumulators live in registers. */

#if defined(__AVX2__)

/* splat[v]: v in every 16-bit lane, for the 6-bit scales of Q4_K and Q5_K */
#define SPLAT1(v) {v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}
#define SPLAT4(v) SPLAT1(v), SPLAT1(v + 1), SPLAT1(v + 2), SPLAT1(v + 3)
#define SPLAT16(v) SPLAT4(v), SPLAT4(v + 4), SPLAT4(v + 8), SPLAT4(v + 12)
static const int16_t splat[64][16] __attribute__((aligned(32))) = {SPLAT16(0), SPLAT16(16), SPLAT16(32), SPLAT16(48)};

/* Q4_K's or Q5_K's 32 bytes of qs from qs + 32j as the values of sub-blocks 2j (lo) and 2j + 1 (hi), with bits 2j
 * and 2j + 1 of each qh byte (`high`, shifted on for the next j) above them for Q5_K */
ALWAYS void q45_k_values(const uint8_t *qs, __m256i *high, int j, const int five, __m256i *lo, __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
    *lo = _mm256_and_si256(packed, low4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    if (five) {
        *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(_mm256_and_si256(*high, _mm256_set1_epi8(1)), 4));
        *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(_mm256_and_si256(*high, _mm256_set1_epi8(2)), 3));
        *high = _mm256_srli_epi16(*high, 2);
    }
}

/* Sub-blocks 2j and 2j + 1 of a Q4_K or Q5_K block against one row of x (in the file's order), into isum */
ALWAYS void q45_k_pair(const uint8_t *qs, __m256i *high, int j, uint32_t sc4_lo, uint32_t sc4_hi, const int8_t *x,
                       const int five, __m256i *isum) {
    __m256i lo, hi;
    q45_k_values(qs, high, j, five, &lo, &hi);
    /* 4 x the scales: an index that addressing scales by 8 to splat's rows of 32 bytes */
    const uint32_t pair = (j < 2 ? sc4_lo : sc4_hi) >> (16 * (j & 1));
    const __m256i scale_lo = _mm256_load_si256((const __m256i *)((const char *)splat + 8 * (pair & 0xfc)));
    const __m256i scale_hi = _mm256_load_si256((const __m256i *)((const char *)splat + 8 * (pair >> 8 & 0xfc)));
    x += 64 * j;
    const __m256i plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)), scale_lo);
    const __m256i phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32))),
                                          scale_hi);
    *isum = _mm256_add_epi32(*isum, _mm256_add_epi32(plo, phi));
}

/* A Q4_K or Q5_K block's d in every lane, dmin x each of its 8 mins, and its scales and mins as k_scales gives them */
ALWAYS void q45_k_header(const uint8_t *blk, uint32_t u[4], __m256 *d, __m256 *mins) {
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(load32(blk)));  /* d, dmin */
    *d = _mm256_broadcastss_ps(dd);
    /* the scales unpacked by the integer units: the vector shuffle units are the unpacking's bottleneck */
    k_scales(blk + 4, u);
    *mins = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)((uint64_t)u[3] << 32 | u[2])))));
}

/* A Q4_K or Q5_K block for more than one row of x: its values unpacked into eight registers, each four through
 * words_4x4, and the scales of each four's sub-blocks in their words */
ALWAYS void q45_k_many(const uint8_t *blk, const uint32_t u[4], const int five, __m256i v[8], __m256i scales[2]) {
    const uint8_t *qs = blk + (five ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs));
    __m256i high = five ? _mm256_loadu_si256((const __m256i *)(blk + offsetof(block_q5_K, qh))) : _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) q45_k_values(qs, &high, j, five, &v[2 * j], &v[2 * j + 1]);
    words_4x4(v);
    words_4x4(v + 4);
    scales[0] = _mm256_broadcastq_epi64(_mm_cvtepu8_epi16(_mm_cvtsi32_si128((int)u[0])));
    scales[1] = _mm256_broadcastq_epi64(_mm_cvtepu8_epi16(_mm_cvtsi32_si128((int)u[1])));
}

#if defined(__AVX512BW__)
/* The many-row K-quant kernels on AVX-512 take blocks b and b + 1 side by side in the halves of 512-bit registers,
 * against x's rows whose quantization interleaved each pair's 32-byte pieces (pair_blocks), so that each
 * multiply does twice the work of the 256-bit kernels'; an odd last block goes alone in the low halves. */
ALWAYS __m512i side_by_side(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

/* 16 blocks' 32 values (z[k]: blocks k and k + 8 side by side) as the by-lane kernels take them: register o's
 * 32-bit lane l bytes 4o..4o + 3 of block l (an 8 x 8 transpose of the 32-bit words in the halves of 8
 * registers) */
ALWAYS void by_lane_halves(const __m512i z[8], __m512i wq[8]) {
    __m512i t[8], u[8];
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm512_unpacklo_epi32(z[k], z[k + 1]);
        t[k + 1] = _mm512_unpackhi_epi32(z[k], z[k + 1]);
    }
    for (int h = 0; h < 8; h += 4) {  /* 128-bit lane j of u[h + c]: word c (j even) or 4 + c of 4 blocks */
        u[h] = _mm512_unpacklo_epi64(t[h], t[h + 2]);
        u[h + 1] = _mm512_unpackhi_epi64(t[h], t[h + 2]);
        u[h + 2] = _mm512_unpacklo_epi64(t[h + 1], t[h + 3]);
        u[h + 3] = _mm512_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    const __m512i even = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i odd = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int c = 0; c < 4; c++) {
        wq[c] = _mm512_permutex2var_epi64(u[c], even, u[4 + c]);
        wq[4 + c] = _mm512_permutex2var_epi64(u[c], odd, u[4 + c]);
    }
}

/* The same of 16 blocks' 32 values, v[l] block l */
ALWAYS void by_lane(const __m256i v[16], __m512i wq[8]) {
    __m512i z[8];
    for (int k = 0; k < 8; k++) z[k] = side_by_side(v[k], v[k + 8]);
    by_lane_halves(z, wq);
}

/* y[r * ldy] = the sum of acc[r]'s lanes, r < mr: for more than 4 rows 16 sums at once, in four rounds that each
 * halve the registers (two shuffles and an add a pair), where one row at a time took 8 operations a row: as many
 * as a Q4_K pass by lane spends on a row's 1,024-value piece of x before it sums them. */
ALWAYS void store_sums(const __m512 acc[MR], const int mr, float *y, int64_t ldy) {
    if (mr <= 4) {
        for (int r = 0; r < mr; r++) y[r * ldy] = _mm512_reduce_add_ps(acc[r]);
        return;
    }
    __m512 a[16];
    for (int r = 0; r < 16; r++) a[r] = r < mr ? acc[r] : _mm512_setzero_ps();
    for (int i = 0; i < 8; i++)  /* 128-bit lane j of a[i]: 2i, 2i + 1, 2i, 2i + 1's sums of lanes 4j.. */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* ... rows 4i..4i + 3's */
        a[i] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]))));
    for (int i = 0; i < 2; i++)  /* 128-bit lanes 0, 1: rows 8i.. over lanes 0-1, 2-3; lanes 2, 3: rows 8i + 4.. */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    a[0] = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x88), _mm512_shuffle_f32x4(a[0], a[1], 0xDD));
    float sums[16] __attribute__((aligned(64)));
    _mm512_store_ps(sums, a[0]);
    for (int r = 0; r < mr; r++) y[r * ldy] = sums[r];
}

/* The fp16 at offset `at` of 16 blocks of `size` bytes from blk, block l's in lane l */
ALWAYS __m512 halves_by_lane(const uint8_t *blk, int64_t size, int64_t at) {
    uint16_t h[16] __attribute__((aligned(32)));
    for (int l = 0; l < 16; l++) memcpy(&h[l], blk + l * size + at, 2);
    return _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)h));
}

ALWAYS __m512 side_by_side_ps(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* Piece t of a pair of x's blocks at x (`two`), or of one block alone */
ALWAYS __m512i pair_x(const int8_t *x, int t, int two) {
    return two ? _mm512_loadu_si512(x + 64 * t) : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(x + 32 * t)));
}

/* x's d of block i over the low half, of block i + 1 over the high; of i again for a block alone, whose zero
 * high weights make it moot */
ALWAYS __m512 pair_d(const float *d, int two) { return side_by_side_ps(_mm256_set1_ps(d[0]), _mm256_set1_ps(d[two])); }

/* Q4_K and Q5_K against more than one row of x on AVX-512 */
ALWAYS void rows_q45_k_pairs(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy,
                             const int five) {
    const int64_t K = a->K, nb = K / 256, size = five ? sizeof(block_q5_K) : sizeof(block_q4_K);
    __m512 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
        const int two = b + 1 < nb;
        __m256i v[2][8], sc[2][2];
        __m256 d[2], mins[2];
        for (int k = 0; k < 2; k++) {
            /* nothing in the high halves; a loop of two known passes keeps v and sc in registers (one of `two`
             * passes over zeroed arrays was 10% slower) */
            if (k && !two) {
                for (int t = 0; t < 8; t++) v[1][t] = _mm256_setzero_si256();
                sc[1][0] = sc[1][1] = _mm256_setzero_si256();
                d[1] = mins[1] = _mm256_setzero_ps();
                break;
            }
            uint32_t u[4];
            q45_k_header(w + (b + k) * size, u, &d[k], &mins[k]);
            q45_k_many(w + (b + k) * size, u, five, v[k], sc[k]);
        }
        __m512i V[8];
        for (int t = 0; t < 8; t++) V[t] = side_by_side(v[0][t], v[1][t]);
        const __m512i scales[2] = {side_by_side(sc[0][0], sc[1][0]), side_by_side(sc[0][1], sc[1][1])};
        const __m512 dw = side_by_side_ps(d[0], d[1]), dmins = side_by_side_ps(mins[0], mins[1]);
        EACH_ROW
        for (int r = 0; r < mr; r++) {
            const int8_t *x = a->q + (m0 + r) * K + 256 * b;
            const int64_t i = (m0 + r) * nb + b;
            __m512i xv[8];
            for (int t = 0; t < 8; t++) xv[t] = pair_x(x, t, two);
            __m512i isum = _mm512_setzero_si512();
            for (int g = 0; g < 2; g++) {
                const __m512i s01 = _mm512_add_epi16(_mm512_maddubs_epi16(V[4 * g], xv[4 * g]),
                                                     _mm512_maddubs_epi16(V[4 * g + 1], xv[4 * g + 1]));
                const __m512i s23 = _mm512_add_epi16(_mm512_maddubs_epi16(V[4 * g + 2], xv[4 * g + 2]),
                                                     _mm512_maddubs_epi16(V[4 * g + 3], xv[4 * g + 3]));
                isum = _mm512_add_epi32(isum, _mm512_madd_epi16(_mm512_add_epi16(s01, s23), scales[g]));
            }
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_cvtepi32_ps(isum)), pair_d(a->d + i, two), acc[r]);
            acc[r] = _mm512_fnmadd_ps(dmins, _mm512_maskz_loadu_ps(two ? 0xFFFF : 0x00FF, a->ds + i * 8), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) y[r * ldy] = _mm512_reduce_add_ps(acc[r]);
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* start + the dot products of the n registers w with n of x's 64 bytes at x (`x_unsigned`: x the unsigned side of
 * vpdpbusd, else w), summed in `chains` chains added at the end (2 or 4, at most n): in one chain of 8 dependent
 * vpdpbusd a row's latency held the by-lane passes to ~16 cycles a row where their operations need ~12
 * (bench/RESULTS.md). Where Q4_K's weights are unpacked as they are read, their registers leave room for no more
 * than 2; Q6_K's two sums of 4 take 2 each. */
ALWAYS __m512i dot_chains(__m512i start, const __m512i *w, const int8_t *x, const int n, const int x_unsigned,
                          const int chains) {
    __m512i sum[4];
    for (int o = 0; o < n; o++) {
        const __m512i xo = _mm512_loadu_si512(x + 64 * o);
        const __m512i from = o == 0 ? start : o < chains ? _mm512_setzero_si512() : sum[o % chains];
        sum[o % chains] = x_unsigned ? _mm512_dpbusd_epi32(from, xo, w[o]) : _mm512_dpbusd_epi32(from, w[o], xo);
    }
    for (int c = 2; c < chains; c++) sum[c - 2] = _mm512_add_epi32(sum[c - 2], sum[c]);
    return _mm512_add_epi32(sum[0], sum[1]);
}

/* Q4_K against more than one row of x on AVX-512 VNNI, two blocks at a time by lane: each 32-bit lane one of
 * their 16 sub-blocks, whose 32 products sum in it over 8 dot products, and each sub-block's d x scale, dmin x
 * min and x's d and sum come by lane too: a row's two blocks are 8 dot products, a conversion and three
 * multiplies, where side by side (rows_q45_k_pairs) the 16-bit sums of the products took 8 more adds and 2
 * multiplies for the scales. x's rows lie pass-major (acts), so that each row's pair is at a constant offset
 * from the pass's (a pointer a row and array spilled). */
typedef struct {
    __m512i wq[8];        /* the values, through by_lane_halves */
    __m512 scales, mins;  /* each sub-block's d x scale and dmin x min */
} q4_k_lanes;

/* Blocks blk and blk + 1 by lane */
ALWAYS void q4_k_lanes_of(const uint8_t *blk, q4_k_lanes *u) {
    __m256 scales[2], mins[2];
    for (int k = 0; k < 2; k++) {
        uint32_t s[4];
        __m256 d;
        q45_k_header(blk + k * sizeof(block_q4_K), s, &d, &mins[k]);
        scales[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                         _mm_cvtsi64_si128((int64_t)((uint64_t)s[1] << 32 | s[0])))));
    }
    /* both blocks' values at once, 32 bytes of qs of each in the halves of a register */
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i z[8];
    for (int j = 0; j < 4; j++) {
        const uint8_t *qs = blk + offsetof(block_q4_K, qs) + 32 * j;
        const __m512i packed = side_by_side(_mm256_loadu_si256((const __m256i *)qs),
                                            _mm256_loadu_si256((const __m256i *)(qs + sizeof(block_q4_K))));
        z[2 * j] = _mm512_and_si512(packed, low4);
        z[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
    }
    by_lane_halves(z, u->wq);
    u->scales = side_by_side_ps(scales[0], scales[1]);
    u->mins = side_by_side_ps(mins[0], mins[1]);
}

/* Two blocks by lane against the mr rows of x's pair at x, their d's and sums at lane, into acc (dot_chains) */
ALWAYS void q4_k_lanes_rows(const q4_k_lanes *u, const int8_t *x, const float *lane, const int mr, __m512 acc[MR],
                            const int chains) {
    EACH_ROW
    for (int r = 0; r < mr; r++) {
        const __m512i dot = dot_chains(_mm512_setzero_si512(), u->wq, x + 512 * r, 8, 0, chains);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), u->scales), _mm512_loadu_ps(lane + 32 * r),
                                 acc[r]);
        acc[r] = _mm512_fnmadd_ps(u->mins, _mm512_loadu_ps(lane + 32 * r + 16), acc[r]);
    }
}

/* A Q4_K or Q6_K weight row at w by lane (below, where both kinds of pairs are known) */
ALWAYS void rows_k_by_lane(int type, const uint8_t *w, const acts *a, int64_t m0, int mr, float *y, int64_t ldy,
                           int unpacked);
#endif

#if defined(__AVX512BW__)
/* Q4_K against one row of x on AVX-512, two sub-blocks a register: qs's 32 bytes of sub-blocks 2j and 2j + 1 in
 * both halves, shifted by 0 and 4 at once (vpsrlvw), so that they lie as x does; their products summed in s16,
 * then by each half's scale (vpermw from the block's eight) in s32. Half the operations of the 256-bit path
 * below: on its own it streams weights from memory faster, in the engine no change showed (bench/RESULTS.md);
 * Q6_K's one-row path, already at memory's pace, gained nothing so. */
ALWAYS void row_q4_k_wide(const uint8_t *w, const acts *a, int64_t m0, float *y) {
    const int64_t K = a->K, nb = K / 256;
    const int8_t *xq = a->q + m0 * K;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    __m512 acc = _mm512_setzero_ps();
    __m256 minus = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * sizeof(block_q4_K);
        PREFETCH_AHEAD(blk, (int)sizeof(block_q4_K));
        uint32_t u[4];
        __m256 d, mins;
        q45_k_header(blk, u, &d, &mins);
        const __m512i sc16 = _mm512_castsi128_si512(
            _mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)((uint64_t)u[1] << 32 | u[0]))));
        __m512i isum = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i packed = _mm512_broadcast_i64x4(
                _mm256_loadu_si256((const __m256i *)(blk + offsetof(block_q4_K, qs) + 32 * j)));
            const __m512i v = _mm512_and_si512(_mm512_srlv_epi16(packed, shift), low4);
            const __m512i scale = _mm512_permutexvar_epi16(
                _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * j)), _mm256_set1_epi16((short)(2 * j + 1)), 1), sc16);
            const __m512i p16 = _mm512_maddubs_epi16(v, _mm512_loadu_si512(xq + 256 * b + 64 * j));
            isum = _mm512_add_epi32(isum, _mm512_madd_epi16(p16, scale));
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(_mm256_cvtss_f32(d) * a->d[m0 * nb + b]), acc);
        minus = _mm256_fmadd_ps(mins, _mm256_loadu_ps(a->ds + (m0 * nb + b) * 8), minus);
    }
    *y = _mm512_reduce_add_ps(acc) - sum8(minus);
}
#endif

/* Q4_K and Q5_K: sub-blocks of 32 with 6-bit scales and mins; x's d * sum of each 32 carries the mins. One row
 * of x in the file's order, sub-block by sub-block; more (shuffled by words_4x4) against the whole block at
 * once, its values unpacked into eight registers first: each row's four products of a register's 128 values
 * summed in s16 (at most 4 x 2 x 31 x 127, no overflow), then one madd of their scales */
ALWAYS void rows_q45_k(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy,
                       const int five) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (!five && by_lane_pass(Q4_K, mr, a->K)) {
        rows_k_by_lane(Q4_K, w, a, m0, mr, y, ldy, 0);
        return;
    }
#endif
#if defined(__AVX512BW__)
    if (mr > 1) {
        rows_q45_k_pairs(w, a, m0, mr, y, ldy, five);
        return;
    }
    if (!five) {
        row_q4_k_wide(w, a, m0, y);
        return;
    }
#endif
    const int64_t K = a->K, nb = K / 256, size = five ? sizeof(block_q5_K) : sizeof(block_q4_K);
    __m256 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * size;
        uint32_t u[4];
        __m256 d, mins;
        q45_k_header(blk, u, &d, &mins);
        const int8_t *xq = a->q + m0 * K + 256 * b;
        if (mr == 1) {
            PREFETCH_AHEAD(blk, size);
            const uint8_t *qs = blk + (five ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs));
            __m256i high = five ? _mm256_loadu_si256((const __m256i *)(blk + offsetof(block_q5_K, qh)))
                                : _mm256_setzero_si256();
            __m256i isum = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) q45_k_pair(qs, &high, j, u[0] << 2, u[1] << 2, xq, five, &isum);
            acc[0] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(isum)), _mm256_broadcast_ss(a->d + m0 * nb + b),
                                     acc[0]);
            acc[0] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(a->ds + (m0 * nb + b) * 8), acc[0]);
            continue;
        }
        __m256i v[8], scales[2];
        q45_k_many(blk, u, five, v, scales);
        float scale[MR] __attribute__((aligned(32)));  /* d times each row's d, read back a lane at a time */
        _mm256_store_ps(scale, _mm256_mul_ps(d, _mm256_loadu_ps(a->dt + (m0 * nb + b * MR))));
        EACH_ROW
        for (int r = 0; r < mr; r++) {
            const __m256i *x = (const __m256i *)(xq + r * K);
            __m256i isum = _mm256_setzero_si256();
            for (int g = 0; g < 2; g++) {
                const __m256i *xg = x + 4 * g, *vg = v + 4 * g;
                const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(vg[0], _mm256_loadu_si256(xg)),
                                                     _mm256_maddubs_epi16(vg[1], _mm256_loadu_si256(xg + 1)));
                const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(vg[2], _mm256_loadu_si256(xg + 2)),
                                                     _mm256_maddubs_epi16(vg[3], _mm256_loadu_si256(xg + 3)));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_add_epi16(s01, s23), scales[g]));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_broadcast_ss(scale + r), acc[r]);
            acc[r] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(a->ds + ((m0 + r) * nb + b) * 8), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) y[r * ldy] = sum8(acc[r]);
}

ALWAYS void rows_q4_k(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    rows_q45_k(w, a, m0, mr, y, ldy, 0);
}

ALWAYS void rows_q5_k(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    rows_q45_k(w, a, m0, mr, y, ldy, 1);
}

/* Half h of a Q6_K block as its 4 groups of 32 values: the low or high nibbles of ql, bits 2g, 2g + 1 of qh on
 * top */
ALWAYS void q6_k_values(const block_q6_K *blk, int h, __m256i q[4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i qa = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h));
    const __m256i qb = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk->qh + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(qa, low4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x03)), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(qb, low4), _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x0C)), 2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), low4), _mm256_and_si256(qh, _mm256_set1_epi8(0x30)));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), low4),
                           _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8((char)0xC0)), 2));
}

/* A Q6_K block for more than one row of x: its values unpacked into eight registers, each two through
 * words_2x2, the scales that each pair's madd takes (s), and all 16 as words (sc16) */
ALWAYS void q6_k_many(const block_q6_K *blk, __m256i q[8], __m256i s[4], __m256i *sc16) {
    *sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)blk->scales));
    /* each half's 8 scales in both halves of a register, for in-lane shuffles to broadcast */
    const __m256i halves[2] = {_mm256_permute4x64_epi64(*sc16, 0x44), _mm256_permute4x64_epi64(*sc16, 0xEE)};
    for (int h = 0; h < 2; h++) {
        q6_k_values(blk, h, q + 4 * h);
        words_2x2(q + 4 * h);
        words_2x2(q + 4 * h + 2);
        for (int P = 0; P < 2; P++) {
            const __m128i lo = _mm_set1_epi32(0x05040100 + 0x08080808 * P);
            s[2 * h + P] = _mm256_shuffle_epi8(halves[h], _mm256_set_m128i(_mm_add_epi8(lo, _mm_set1_epi8(2)), lo));
        }
    }
}

#if defined(__AVX512BW__)
/* Q6_K against more than one row of x on AVX-512, as rows_q45_k_pairs: blocks b and b + 1 in the halves of each
 * register, an odd last block alone in the low halves */
ALWAYS void rows_q6_k_pairs(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    const int64_t K = a->K, nb = K / 256;
    __m512 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
        const int two = b + 1 < nb;
        __m256i q[2][8], s[2][4], sc16[2];
        float d[2] = {0.0f, 0.0f};
        for (int k = 0; k < 2; k++) {
            if (k && !two) {  /* nothing in the high halves */
                for (int t = 0; t < 8; t++) q[1][t] = _mm256_setzero_si256();
                for (int P = 0; P < 4; P++) s[1][P] = _mm256_setzero_si256();
                sc16[1] = _mm256_setzero_si256();
                break;
            }
            d[k] = half_at(w + (b + k) * sizeof(block_q6_K) + offsetof(block_q6_K, d));
            q6_k_many((const block_q6_K *)(w + (b + k) * sizeof(block_q6_K)), q[k], s[k], &sc16[k]);
        }
        __m512i Q[8], S[4];
        for (int t = 0; t < 8; t++) Q[t] = side_by_side(q[0][t], q[1][t]);
        for (int P = 0; P < 4; P++) S[P] = side_by_side(s[0][P], s[1][P]);
        const __m512i scales16 = side_by_side(sc16[0], sc16[1]);
        const __m512 dw = side_by_side_ps(_mm256_set1_ps(d[0]), _mm256_set1_ps(d[1]));
        EACH_ROW
        for (int r = 0; r < mr; r++) {
            const int8_t *x = a->q + (m0 + r) * K + 256 * b;
            const int64_t i = (m0 + r) * nb + b;
            /* minus the sum: the offset (32 x each scale x its 16 values of x) less each product */
            __m512i minus = _mm512_slli_epi32(_mm512_madd_epi16(scales16,
                _mm512_maskz_loadu_epi16(two ? 0xFFFFFFFF : 0x0000FFFF, a->sums16 + i * 16)), 5);
            for (int P = 0; P < 4; P++)
                minus = _mm512_sub_epi32(minus, _mm512_madd_epi16(
                    _mm512_add_epi16(_mm512_maddubs_epi16(Q[2 * P], pair_x(x, 2 * P, two)),
                                     _mm512_maddubs_epi16(Q[2 * P + 1], pair_x(x, 2 * P + 1, two))), S[P]));
            acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dw, pair_d(a->d + i, two)), _mm512_cvtepi32_ps(minus), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) y[r * ldy] = _mm512_reduce_add_ps(acc[r]);
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* Q6_K against more than one row of x on AVX-512 VNNI, two blocks at a time by lane, as Q4_K: register o's lane
 * l (by_lane over the blocks' 32-value groups) bytes 4o..4o + 3 of sub-block 2l' (o < 4) or 2l' + 1 (o >= 4) of
 * block l / 8, l' = l % 8, so that two sums of 4 dot products a row hold the 32 sub-blocks. The values go signed
 * (less their 32) against x's offset by 128 to unsigned bytes; each sum starts at -128 x its 16 values' sum, once
 * per weight row for all rows. A row's two blocks: 8 dot products, 2 conversions and three multiplies, where side
 * by side (rows_q6_k_pairs) the 16-bit sums, their scales and the offset's products took about twice as many. */
typedef struct {
    __m512i wq[8];      /* the values less 32, through by_lane_halves */
    __m512i start[2];   /* -128 x each sub-block's sum: of the even ones, then of the odd */
    __m512 scales[2];   /* d x each sub-block's scale, likewise */
} q6_k_lanes;

/* Half h of blocks blk and blk + 1 at once as q6_k_values takes one block's, blk's in the low halves: as
 * q4_k_lanes_of's, the two blocks' values built in one pass of 512-bit operations where a pass of 256-bit ones
 * for each block, then their halves put side by side, took twice the operations */
ALWAYS void q6_k_values_two(const uint8_t *blk, int h, __m512i z[4]) {
    const block_q6_K *b = (const block_q6_K *)blk;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
#define TWO(field, at) side_by_side(_mm256_loadu_si256((const __m256i *)(b[0].field + (at))), \
                                    _mm256_loadu_si256((const __m256i *)(b[1].field + (at))))
    const __m512i qa = TWO(ql, 64 * h), qb = TWO(ql, 64 * h + 32), qh = TWO(qh, 32 * h);
#undef TWO
#define HIGH(mask) _mm512_and_si512(qh, _mm512_set1_epi8((char)(mask)))
    z[0] = _mm512_or_si512(_mm512_and_si512(qa, low4), _mm512_slli_epi16(HIGH(0x03), 4));
    z[1] = _mm512_or_si512(_mm512_and_si512(qb, low4), _mm512_slli_epi16(HIGH(0x0C), 2));
    z[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(qa, 4), low4), HIGH(0x30));
    z[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(qb, 4), low4), _mm512_srli_epi16(HIGH(0xC0), 2));
#undef HIGH
}

/* Blocks blk and blk + 1 by lane */
ALWAYS void q6_k_lanes_of(const uint8_t *blk, q6_k_lanes *u) {
    __m512i z[8];
    __m256 scales[2][2];
    for (int h = 0; h < 2; h++) q6_k_values_two(blk, h, z + 4 * h);
    for (int g = 0; g < 8; g++) z[g] = _mm512_sub_epi8(z[g], _mm512_set1_epi8(32));
    for (int k = 0; k < 2; k++) {
        const block_q6_K *b = (const block_q6_K *)(blk + k * sizeof(block_q6_K));
        /* the even scales in the low 8 bytes, the odd in the high */
        const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)b->scales),
                                            _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        const __m256 d = _mm256_set1_ps(half_at((const uint8_t *)&b->d));
        scales[k][0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        scales[k][1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    }
    by_lane_halves(z, u->wq);
    for (int e = 0; e < 2; e++) {
        __m512i sum = _mm512_setzero_si512();
        for (int o = 4 * e; o < 4 * e + 4; o++) sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), u->wq[o]);
        u->start[e] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7));
        u->scales[e] = side_by_side_ps(scales[0][e], scales[1][e]);
    }
}

/* Two blocks by lane against the mr rows of x's pair at x, their d's at lane, into acc */
ALWAYS void q6_k_lanes_rows(const q6_k_lanes *u, const int8_t *x, const float *lane, const int mr, __m512 acc[MR]) {
    EACH_ROW
    for (int r = 0; r < mr; r++) {
        const __m512i dot[2] = {dot_chains(u->start[0], u->wq, x + 512 * r, 4, 1, 2),
                                dot_chains(u->start[1], u->wq + 4, x + 512 * r + 256, 4, 1, 2)};
        const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[1]), u->scales[1],
                                           _mm512_mul_ps(_mm512_cvtepi32_ps(dot[0]), u->scales[0]));
        acc[r] = _mm512_fmadd_ps(sum, _mm512_loadu_ps(lane + 32 * r), acc[r]);
    }
}

/* A Q4_K or Q6_K weight row at w by lane: unpacked here, pair by pair (`unpacked` 0), or already, as
 * q4_k_lanes or q6_k_lanes (1) */
ALWAYS void rows_k_by_lane(const int type, const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y,
                           int64_t ldy, const int unpacked) {
    const int64_t K = a->K;
    __m512 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 512; p++) {
        const int8_t *x = a->q + m0 * K + p * mr * 512;
        const float *lane = a->lane + m0 * (K / 16) + p * mr * 32;
        if (type == Q4_K) {
            q4_k_lanes here;
            if (!unpacked) q4_k_lanes_of(w + 2 * p * sizeof(block_q4_K), &here);
            q4_k_lanes_rows(unpacked ? (const q4_k_lanes *)w + p : &here, x, lane, mr, acc, unpacked ? 4 : 2);
        } else {
            q6_k_lanes here;
            if (!unpacked) q6_k_lanes_of(w + 2 * p * sizeof(block_q6_K), &here);
            q6_k_lanes_rows(unpacked ? (const q6_k_lanes *)w + p : &here, x, lane, mr, acc);
        }
    }
    store_sums(acc, mr, y, ldy);
}

ALWAYS void rows_q4_k_unpacked(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    rows_k_by_lane(Q4_K, w, a, m0, mr, y, ldy, 1);
}

ALWAYS void rows_q6_k_unpacked(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    rows_k_by_lane(Q6_K, w, a, m0, mr, y, ldy, 1);
}
#endif

/* Q6_K: sub-blocks of 16 with int8 scales; values 0..63 less 32, the 32 carried by the x sums of 16. One row of
 * x in the file's order, group by group; more (shuffled by words_2x2) against the whole block at once, its
 * values unpacked into eight registers first: each row's products of groups 2P and 2P + 1 summed in s16 (at
 * most 2 x 2 x 63 x 127), then one madd of their scales, which take in the low 128 bits scales 4P and 4P + 2 of
 * the half word by word, in the high, 4P + 1 and 4P + 3 */
ALWAYS void rows_q6_k(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (by_lane_pass(Q6_K, mr, a->K)) {
        rows_k_by_lane(Q6_K, w, a, m0, mr, y, ldy, 0);
        return;
    }
#endif
#if defined(__AVX512BW__)
    if (mr > 1) {
        rows_q6_k_pairs(w, a, m0, mr, y, ldy);
        return;
    }
#endif
    const int64_t K = a->K, nb = K / 256;
    __m256 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const block_q6_K *blk = (const block_q6_K *)(w + b * sizeof(block_q6_K));
        const float d = half_at(w + b * sizeof(block_q6_K) + offsetof(block_q6_K, d));
        if (mr == 1) {
            PREFETCH_AHEAD(blk, (int)sizeof(block_q6_K));
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)blk->scales));
            /* each half's 8 scales in both halves of a register, for in-lane shuffles to broadcast */
            const __m256i halves[2] = {_mm256_permute4x64_epi64(sc16, 0x44), _mm256_permute4x64_epi64(sc16, 0xEE)};
            __m256i q[4], s[4];
            const int8_t *xq = a->q + m0 * K + 256 * b;
            /* the offset, 32 x each scale x its 16 values of x, taken off */
            __m256i isum = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(
                _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(a->sums16 + (m0 * nb + b) * 16))), 5));
            for (int h = 0; h < 2; h++) {
                q6_k_values(blk, h, q);
                for (int g = 0; g < 4; g++) {  /* scales 2g, 2g + 1 of the half: one over each 8 lanes */
                    const __m128i lo = _mm_set1_epi16((short)(0x0100 + 0x0404 * g));
                    s[g] = _mm256_shuffle_epi8(halves[h], _mm256_set_m128i(_mm_add_epi8(lo, _mm_set1_epi8(2)), lo));
                }
                __m256i p[4];
                for (int g = 0; g < 4; g++)
                    p[g] = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(q[g], _mm256_loadu_si256((const __m256i *)(xq + 128 * h + 32 * g))), s[g]);
                isum = _mm256_add_epi32(isum, _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])));
            }
            acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d[m0 * nb + b]), _mm256_cvtepi32_ps(isum), acc[0]);
            continue;
        }
        __m256i q[8], s[4], sc16;
        q6_k_many(blk, q, s, &sc16);
        /* 32 x each scale (at most 4,096: a word) against sums of 16 (at most 2,032): madd's pairs fit 32 bits */
        const __m256i sc32 = _mm256_slli_epi16(sc16, 5);
        float scale[MR] __attribute__((aligned(32)));  /* d times each row's d, read back a lane at a time */
        _mm256_store_ps(scale, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(a->dt + (m0 * nb + b * MR))));
        EACH_ROW
        for (int r = 0; r < mr; r++) {
            const __m256i *x = (const __m256i *)(a->q + (m0 + r) * K + 256 * b);
            const int64_t i = (m0 + r) * nb + b;
            /* minus the sum: the offset (32 x each scale x its 16 values of x) less each product */
            __m256i minus = _mm256_madd_epi16(sc32, _mm256_loadu_si256((const __m256i *)(a->sums16 + i * 16)));
            for (int P = 0; P < 4; P++)
                minus = _mm256_sub_epi32(minus, _mm256_madd_epi16(
                    _mm256_add_epi16(_mm256_maddubs_epi16(q[2 * P], _mm256_loadu_si256(x + 2 * P)),
                                     _mm256_maddubs_epi16(q[2 * P + 1], _mm256_loadu_si256(x + 2 * P + 1))), s[P]));
            acc[r] = _mm256_fnmadd_ps(_mm256_broadcast_ss(scale + r), _mm256_cvtepi32_ps(minus), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) y[r * ldy] = sum8(acc[r]);
}

/* In each int32 lane, the sum of 4 products of unsigned bytes of u and signed bytes of s: one VNNI
 * instruction where the build has it, else through s16 pairs (which the values here never saturate) */
ALWAYS __m256i dot4(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* A weight block of 32 against the mr rows of x: its 32 values as bytes `wq` (unsigned, or signed with
 * `signed_w`), scaled by dw; acc[r] its chain of fp32 sums */
ALWAYS void small_step(__m256i wq, int signed_w, float dw, const acts *a, int64_t m0, const int mr, int64_t b,
                       __m256 *acc) {
    const int64_t K = a->K, nb = K / 32;
    /* unsigned x signed bytes: |w| against x carrying w's sign */
    const __m256i uw = signed_w ? _mm256_sign_epi8(wq, wq) : wq;
    EACH_ROW
    for (int r = 0; r < mr; r++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + r) * K + 32 * b));
        if (signed_w) xv = _mm256_sign_epi8(xv, wq);
        const __m256i p = dot4(uw, xv);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * a->d[(m0 + r) * nb + b]), acc[r]);
    }
}

ALWAYS __m256i nibbles(const uint8_t *qs) {  /* 16 bytes of nibbles as 32 bytes: the low nibbles, then the high */
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
}

/* Block b of a Q8_0, Q4_0 or Q4_1 row against the mr rows of x, into the chain `acc`; Q4_0's -8 d and Q4_1's m
 * times the x block's d * sum into `offset` */
ALWAYS void small_block_step(int type, const uint8_t *w, const acts *a, int64_t m0, const int mr, int64_t b,
                             __m256 *acc, float *offset) {
    const int64_t nb = a->K / 32;
    const uint8_t *blk = w + b * block_bytes(type);
    const float dw = half_at(blk);
    if (type == Q8_0) {
        small_step(_mm256_loadu_si256((const __m256i *)(blk + 2)), 1, dw, a, m0, mr, b, acc);
        return;
    }
    small_step(nibbles(blk + (type == Q4_1 ? 4 : 2)), 0, dw, a, m0, mr, b, acc);
    const float per_sum = type == Q4_1 ? half_at(blk + 2) : -8.0f * dw;
    EACH_ROW
    for (int r = 0; r < mr; r++) offset[r] += per_sum * a->ds[(m0 + r) * nb + b];
}

/* Q8_0 against one row of x: even and odd blocks in two chains (one alone would wait on each fma); the weights
 * asked for ahead, as the K-quants' one-row kernels ask */
ALWAYS void row_q8_0(const uint8_t *w, const acts *a, int64_t m0, float *y) {
    const int64_t nb = a->K / 32;
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        PREFETCH_AHEAD(w + b * sizeof(block_q8_0), 2 * (int)sizeof(block_q8_0));
        small_block_step(Q8_0, w, a, m0, 1, b, &even, NULL);
        small_block_step(Q8_0, w, a, m0, 1, b + 1, &odd, NULL);
    }
    if (b < nb) small_block_step(Q8_0, w, a, m0, 1, b, &even, NULL);
    *y = sum8(_mm256_add_ps(even, odd));
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* Blocks b0.. of a Q8_0 row against more than one row of x on AVX-512, into acc: blocks b and b + 1 side by
 * side, as the K-quants' pairs (x's two blocks lie side by side already); an odd last block alone in the low
 * halves */
ALWAYS void q8_0_pairs(const uint8_t *w, const acts *a, int64_t m0, const int mr, int64_t b0, __m512 *acc) {
    const int64_t K = a->K, nb = K / 32;
    for (int64_t b = b0; b < nb; b += 2) {
        const int two = b + 1 < nb;
        const uint8_t *blk = w + b * sizeof(block_q8_0);
        const __m256i first = _mm256_loadu_si256((const __m256i *)(blk + 2));
        const __m512i wq = side_by_side(first, two ? _mm256_loadu_si256((const __m256i *)(blk + sizeof(block_q8_0) + 2))
                                                   : _mm256_setzero_si256());
        /* unsigned x signed bytes: |w| against x carrying w's sign */
        const __m512i uw = _mm512_abs_epi8(wq);
        const __mmask64 negative = _mm512_movepi8_mask(wq);
        const __m512 dw = side_by_side_ps(_mm256_set1_ps(half_at(blk)),
                                          _mm256_set1_ps(two ? half_at(blk + sizeof(block_q8_0)) : 0.0f));
        EACH_ROW
        for (int r = 0; r < mr; r++) {
            const int64_t i = (m0 + r) * nb + b;
            const __m512i xv = pair_x(a->q + i * 32, 0, two);
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), uw,
                                                  _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, pair_d(a->d + i, two)), acc[r]);
        }
    }
}

/* Q8_0 against more than one row of x on AVX-512, 16 blocks at a time, one in each 32-bit lane: a row's 16
 * blocks are 8 dot products, one conversion and two multiplies, where side by side (q8_0_pairs) each pair of
 * blocks took a sign change, a conversion and three multiplies besides its dot product. x's rows lie so
 * (x_by_lane), the weights are transposed as they are read (by_lane; the ISA's gathers were slower).
 * x is offset by 128 to unsigned bytes, and each block's sum starts at -128 x its weights' sum to take that
 * off. The blocks past the last 16 go side by side. */
ALWAYS void rows_q8_0_groups(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    const int64_t K = a->K, nb = K / 32, groups = nb / 16;
    __m512 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = w + 16 * g * sizeof(block_q8_0);
        __m256i v[16];
        for (int l = 0; l < 16; l++)
            v[l] = _mm256_loadu_si256((const __m256i *)(blk + l * sizeof(block_q8_0) + offsetof(block_q8_0, qs)));
        __m512i wq[8];
        by_lane(v, wq);
        __m512i sum = _mm512_setzero_si512();
        for (int o = 0; o < 8; o++) sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), wq[o]);
        const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7));
        const __m512 dw = halves_by_lane(blk, sizeof(block_q8_0), offsetof(block_q8_0, d));
        EACH_ROW
        for (int r = 0; r < mr; r++) {
            const int8_t *x = a->q + (m0 + r) * K + 512 * g;
            const __m512i p = dot_chains(start, wq, x, 8, 1, 2);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(p), dw),
                                     _mm512_loadu_ps(a->d + (m0 + r) * nb + 16 * g), acc[r]);
        }
    }
    q8_0_pairs(w, a, m0, mr, 16 * groups, acc);
    for (int r = 0; r < mr; r++) y[r * ldy] = _mm512_reduce_add_ps(acc[r]);
}
#endif

/* Q8_0 against more than one row of x: as small_step for each row, but the block's d times the rows' d is one
 * product a block for all of them, each row's read back from memory (a load, where a product and a broadcast
 * for each row and block took two of the vector units' slots) */
ALWAYS void rows_q8_0_many(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    const int64_t K = a->K, nb = K / 32;
    __m256 acc[MR_SMALL];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * sizeof(block_q8_0);
        float scale[MR_SMALL] __attribute__((aligned(32)));
        _mm256_store_ps(scale, _mm256_mul_ps(_mm256_set1_ps(half_at(blk)),
                                             _mm256_loadu_ps(a->dt + (m0 * nb + b * MR_SMALL))));
        const __m256i wq = _mm256_loadu_si256((const __m256i *)(blk + 2)), uw = _mm256_sign_epi8(wq, wq);
        EACH_ROW
        for (int r = 0; r < mr; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + r) * K + 32 * b));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(uw, _mm256_sign_epi8(xv, wq))),
                                     _mm256_broadcast_ss(scale + r), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) y[r * ldy] = sum8(acc[r]);
}

ALWAYS void rows_q8_0(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (by_lane_pass(Q8_0, mr, a->K)) {
        rows_q8_0_groups(w, a, m0, mr, y, ldy);
        return;
    }
#else
    if (mr > 1) {
        rows_q8_0_many(w, a, m0, mr, y, ldy);
        return;
    }
#endif
    row_q8_0(w, a, m0, y);
}

/* In each int32 lane, the sum of 8 products: 4 of u1 by s1, 4 of u2 by s2 (as dot4), where the two s16 pair
 * sums add without saturating (4-bit u) */
ALWAYS __m256i dot8(__m256i u1, __m256i s1, __m256i u2, __m256i s2) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u1, s1), u2, s2);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u1, s1), u2, s2);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2)),
                             _mm256_set1_epi16(1));
#endif
}

/* Blocks b and b + 1 of a Q4_0 or Q4_1 row against the mr rows of x, whose quantization put the pair's 64
 * bytes in the order [low 16 of b, of b + 1, high 16 of b, of b + 1]: the nibbles of both blocks' 16 bytes
 * side by side in one register then meet x in two products, block b in the low 4 lanes, b + 1 in the high.
 * acc[r] gathers d * x's d; lanes 1 and 3 of offset[r] m (Q4_1) or d (Q4_0) times x's d * sum. */
ALWAYS void q4_pair_step(int type, const uint8_t *w, const acts *a, int64_t m0, const int mr, int64_t b,
                         __m256 *acc, __m128 *offset) {
    const int64_t K = a->K, nb = K / 32, size = block_bytes(type), qs = type == Q4_1 ? 4 : 2;
    const uint8_t *blk = w + b * size;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i packed = _mm256_loadu2_m128i((const __m128i *)(blk + size + qs), (const __m128i *)(blk + qs));
    const __m256i lo = _mm256_and_si256(packed, low4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    /* the two blocks' first 4 bytes as fp16 pairs: d, m (Q4_1) or d and 2 bytes of qs (Q4_0, d kept) */
    __m128 dm = _mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128(load32(blk)), _mm_cvtsi32_si128(load32(blk + size))));
    if (type == Q4_0) dm = _mm_moveldup_ps(dm);
    const __m256i lanes = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    for (int r = 0; r < mr; r++) {
        const int64_t i = (m0 + r) * nb + b;
        const int8_t *xq = a->q + (m0 + r) * K + 32 * b;
        const __m256i p = dot8(lo, _mm256_loadu_si256((const __m256i *)xq), hi,
                               _mm256_loadu_si256((const __m256i *)(xq + 32)));
        /* d, m (or d), times x's d and d * sum, of both blocks */
        const __m128 xd = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(a->d + i)));
        const __m128 xds = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(a->ds + i)));
        const __m128 f = _mm_mul_ps(dm, _mm_unpacklo_ps(xd, xds));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), lanes),
                                 acc[r]);
        offset[r] = _mm_add_ps(offset[r], f);
    }
}

/* Q4_0 and Q4_1 from block b0, a pair of blocks at a time; for one row of x, even and odd pairs in two chains */
ALWAYS void rows_q4_pairs(int type, const uint8_t *w, const acts *a, int64_t m0, const int mr, int64_t b0, float *y,
                          int64_t ldy) {
    const int64_t nb = a->K / 32;
    __m256 even[MR], odd[MR];
    __m128 offset[MR];
    float single[MR];  /* an odd last block, as rows_small multiplies it */
    for (int r = 0; r < mr; r++) {
        even[r] = odd[r] = _mm256_setzero_ps();
        offset[r] = _mm_setzero_ps();
        single[r] = 0.0f;
    }
    int64_t b = b0;
    for (; b + 3 < nb; b += 4) {
        q4_pair_step(type, w, a, m0, mr, b, even, offset);
        q4_pair_step(type, w, a, m0, mr, b + 2, mr == 1 ? odd : even, offset);
    }
    if (b + 1 < nb) {
        q4_pair_step(type, w, a, m0, mr, b, even, offset);
        b += 2;
    }
    if (b < nb) small_block_step(type, w, a, m0, mr, b, odd, single);
    const float per_offset = type == Q4_0 ? -8.0f : 1.0f;
    for (int r = 0; r < mr; r++) {
        const __m128 o = offset[r];
        const float offsets = _mm_cvtss_f32(_mm_add_ss(_mm_movehdup_ps(o), _mm_movehl_ps(o, _mm_movehdup_ps(o))));
        y[r * ldy] = sum8(_mm256_add_ps(even[r], odd[r])) + per_offset * offsets + single[r];
    }
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* Q4_0 and Q4_1 against more than one row of x on AVX-512, 16 blocks at a time as rows_q8_0_groups takes Q8_0:
 * their values unsigned (0..15) against x's signed bytes, and Q4_0's -8 d or Q4_1's m times x's d * sum one
 * more multiply. The blocks past the last 16 as pairs. */
ALWAYS void rows_q4_groups(int type, const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y,
                           int64_t ldy) {
    const int64_t K = a->K, nb = K / 32, groups = nb / 16, size = block_bytes(type), qs = type == Q4_1 ? 4 : 2;
    __m512 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = w + 16 * g * size;
        __m256i v[16];
        for (int l = 0; l < 16; l++) v[l] = nibbles(blk + l * size + qs);
        __m512i wq[8];
        by_lane(v, wq);
        const __m512 dw = halves_by_lane(blk, size, 0);  /* d, then Q4_1's m */
        const __m512 offset = type == Q4_1 ? halves_by_lane(blk, size, 2) : _mm512_mul_ps(_mm512_set1_ps(-8.0f), dw);
        EACH_ROW
        for (int r = 0; r < mr; r++) {
            const int8_t *x = a->q + (m0 + r) * K + 512 * g;
            const int64_t i = (m0 + r) * nb + 16 * g;
            const __m512i p = dot_chains(_mm512_setzero_si512(), wq, x, 8, 0, 2);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(p), dw), _mm512_loadu_ps(a->d + i), acc[r]);
            acc[r] = _mm512_fmadd_ps(offset, _mm512_loadu_ps(a->ds + i), acc[r]);
        }
    }
    rows_q4_pairs(type, w, a, m0, mr, 16 * groups, y, ldy);
    for (int r = 0; r < mr; r++) y[r * ldy] += _mm512_reduce_add_ps(acc[r]);
}
#endif

ALWAYS void rows_q4(int type, const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (by_lane_pass(type, mr, a->K)) {
        rows_q4_groups(type, w, a, m0, mr, y, ldy);
        return;
    }
#endif
    rows_q4_pairs(type, w, a, m0, mr, 0, y, ldy);
}

ALWAYS void rows_q4_0(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    rows_q4(Q4_0, w, a, m0, mr, y, ldy);
}

ALWAYS void rows_q4_1(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    rows_q4(Q4_1, w, a, m0, mr, y, ldy);
}

#else  /* portable */

ALWAYS void rows_k(int type, const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    const int64_t K = a->K, nb = K / 256, size = block_bytes(type);
    float acc[MR] = {0};
    k_block kb;
    for (int64_t b = 0; b < nb; b++) {
        unpack_k(type, w + b * size, &kb);
        for (int r = 0; r < mr; r++) {
            const int8_t *xq = a->q + (m0 + r) * K + 256 * b;
            int32_t isum = 0;
            for (int g = 0; g < 16; g++) {
                int32_t dot = 0;
                for (int l = 0; l < 16; l++) dot += kb.q[16 * g + l] * xq[16 * g + l];
                isum += kb.sc[g] * dot;
            }
            float msum = 0.0f;
            if (type != Q6_K)  /* which has no mins, its offset taken off its q */
                for (int j = 0; j < 8; j++) msum += (float)kb.mn[j] * a->ds[((m0 + r) * nb + b) * 8 + j];
            acc[r] += a->d[(m0 + r) * nb + b] * kb.d * (float)isum - kb.dmin * msum;
        }
    }
    for (int r = 0; r < mr; r++) y[r * ldy] = acc[r];
}

ALWAYS void rows_small(int type, const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y,
                       int64_t ldy) {
    const int64_t K = a->K, nb = K / 32, size = block_bytes(type);
    float acc[MR] = {0};
    small_block sb;
    for (int64_t b = 0; b < nb; b++) {
        unpack_small(type, w + b * size, &sb);
        for (int r = 0; r < mr; r++) {
            const int8_t *xq = a->q + (m0 + r) * K + 32 * b;
            int32_t dot = 0;
            for (int l = 0; l < 32; l++) dot += sb.q[l] * xq[l];
            const int64_t i = (m0 + r) * nb + b;
            acc[r] += sb.d * a->d[i] * (float)dot + sb.m * a->ds[i];
        }
    }
    for (int r = 0; r < mr; r++) y[r * ldy] = acc[r];
}

ALWAYS void rows_q4_k(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    rows_k(Q4_K, w, a, m0, mr, y, ldy);
}

ALWAYS void rows_q5_k(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    rows_k(Q5_K, w, a, m0, mr, y, ldy);
}

ALWAYS void rows_q6_k(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    rows_k(Q6_K, w, a, m0, mr, y, ldy);
}

ALWAYS void rows_q8_0(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    rows_small(Q8_0, w, a, m0, mr, y, ldy);
}

ALWAYS void rows_q4_0(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    rows_small(Q4_0, w, a, m0, mr, y, ldy);
}

ALWAYS void rows_q4_1(const uint8_t *w, const acts *a, int64_t m0, const int mr, float *y, int64_t ldy) {
    rows_small(Q4_1, w, a, m0, mr, y, ldy);
}

#endif

/* `rows` weight rows (row_bytes apart) against rows m0..m0 + mr of x's piece a, into y[r * ldy + n], or added
 * to it (`add`: a piece after the first) */
typedef void (*tile_fn)(const uint8_t *w, int64_t row_bytes, int64_t rows, const acts *a, int64_t m0, int mr,
                        float *y, int64_t ldy, int add);

/* A tile's sums go to y OUT_ROWS weight rows at a time from a buffer of their own: y's rows lie a power of two
 * apart in a model (a row of 2,048 or 8,192 floats), so that a sum stored straight into each of the pass's
 * rows of y took the same cache set as the others, and as x's rows. */
#define OUT_ROWS 64
static void store_out(const float out[][OUT_ROWS], int mr, int64_t count, float *y, int64_t ldy, int add) {
    for (int r = 0; r < mr; r++) {
        float *yr = y + r * ldy;
        if (add)
            for (int64_t n = 0; n < count; n++) yr[n] += out[r][n];
        else
            memcpy(yr, out[r], sizeof(float) * count);
    }
}

/* A batch's first pass over a tile asks for the next tile's rows, into L2, row by row as it reaches each: the
 * hardware's prefetcher alone, following a piece of each row at a time, left the first pass waiting on them.
 * (One row of x streams its weights with PREFETCH_AHEAD instead.) */
#define PREFETCH_NEXT_TILE(k, next_row, bytes)                                                               \
    if (prefetch && (k) > 1 && m0 == 0 && !add)                                                              \
        for (int64_t line_ = 0; line_ < (bytes); line_ += 64) __builtin_prefetch((next_row) + line_, 0, 2);

#define TILE_CASE(kernel, k)                                                                                 \
    case k:                                                                                                  \
        for (int64_t n0 = 0; n0 < rows; n0 += OUT_ROWS) {                                                    \
            const int64_t count = rows - n0 < OUT_ROWS ? rows - n0 : OUT_ROWS;                               \
            float out[MR][OUT_ROWS];                                                                         \
            for (int64_t n = n0; n < n0 + count; n++) {                                                      \
                PREFETCH_NEXT_TILE(k, w + (n + rows) * row_bytes, row_bytes)                                 \
                kernel(w + n * row_bytes, a, m0, k, &out[0][n - n0], OUT_ROWS);                              \
            }                                                                                                \
            store_out(out, k, count, y + n0, ldy, add);                                                      \
        }                                                                                                    \
        break;
#if MR == 16
#define WIDE_CASES(kernel)                                                                                   \
    TILE_CASE(kernel, 8) TILE_CASE(kernel, 9) TILE_CASE(kernel, 10) TILE_CASE(kernel, 11)                    \
    TILE_CASE(kernel, 12) TILE_CASE(kernel, 13) TILE_CASE(kernel, 14) TILE_CASE(kernel, 15)
#else
#define WIDE_CASES(kernel)
#endif
#define TILE(name, kernel, prefetching)                                                                      \
    static void name(const uint8_t *w, int64_t row_bytes, int64_t rows, const acts *a, int64_t m0, int mr,   \
                     float *y, int64_t ldy, int add) {                                                       \
        const int prefetch = prefetching;                                                                    \
        switch (mr) {                                                                                        \
        TILE_CASE(kernel, 1) TILE_CASE(kernel, 2) TILE_CASE(kernel, 3) TILE_CASE(kernel, 4)                  \
        TILE_CASE(kernel, 5) TILE_CASE(kernel, 6) TILE_CASE(kernel, 7) WIDE_CASES(kernel)                    \
        default: TILE_CASE(kernel, MR)                                                                       \
        }                                                                                                    \
    }
_Static_assert(MR == 8 || MR == 16, "TILE instantiates mr = 1..MR");
TILE(tile_q4_0, rows_q4_0, 1)
TILE(tile_q4_1, rows_q4_1, 1)
TILE(tile_q8_0, rows_q8_0, 1)
TILE(tile_q4_k, rows_q4_k, 1)
TILE(tile_q5_k, rows_q5_k, 1)
TILE(tile_q6_k, rows_q6_k, 1)
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* their weights are unpack_tile's, which asked for the next tile */
TILE(tile_q4_k_unpacked, rows_q4_k_unpacked, 0)
TILE(tile_q6_k_unpacked, rows_q6_k_unpacked, 0)
#endif

static tile_fn tile_for(int type) {
    switch (type) {
    case Q4_0: return tile_q4_0;
    case Q4_1: return tile_q4_1;
    case Q8_0: return tile_q8_0;
    case Q4_K: return tile_q4_k;
    case Q5_K: return tile_q5_k;
    default: return tile_q6_k;
    }
}

/* A calling thread's scratch (x quantized, a layer call's row buffers), kept from one call to the next: a 1B
 * model's MLP call of 256 rows (a prefill's piece) takes ~34 MB, which malloc mapped afresh each call and the
 * kernel faulted in 4 KiB at a time, call after call (bench/RESULTS.md). A call takes its pieces from it in turn
 * (scratch_take), from malloc where it falls short; its end (scratch_done) frees those and sizes the scratch to
 * what the call took, so that the next call of that size takes all of it here. Sized down too where SHRINK_AFTER
 * calls in a row took less than a quarter of it: a chat's decode after a prefill does not hold the prefill's
 * pages, and a prefill's short last piece of rows (quant.py's ROWS_PER_CALL) does not size it down. One scratch
 * for each entry point: a step's calls of one kind take about the same, where its qkv and its MLP took 3-4x
 * apart. */
#define SCRATCH_SPILLS 8  /* more pieces than any call takes */
#define SHRINK_AFTER 8
typedef struct {
    uint8_t *base;
    size_t size, used;
    void *spill[SCRATCH_SPILLS];
    int spilled, small_calls;
} scratch;
enum { FOR_LINEAR, FOR_QKV, FOR_MLP, ENTRY_POINTS };

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p) {
    for (int e = 0; e < ENTRY_POINTS; e++) free(((scratch *)p)[e].base);
    free(p);
}

static void scratch_key_make(void) { pthread_key_create(&scratch_key, scratch_free); }

/* The calling thread's scratch for an entry point, empty, or NULL where it could not be had */
static scratch *scratch_begin(int entry) {
    pthread_once(&scratch_once, scratch_key_make);
    scratch *s = pthread_getspecific(scratch_key);
    if (s == NULL) {
        if ((s = calloc(ENTRY_POINTS, sizeof *s)) == NULL) return NULL;
        pthread_setspecific(scratch_key, s);
    }
    s += entry;
    s->used = 0;
    s->spilled = 0;
    return s;
}

/* `bytes` on a cache line, or NULL where malloc had none */
static void *scratch_take(scratch *s, size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    s->used += bytes;
    if (s->used <= s->size) return s->base + s->used - bytes;
    void *p;
    if (s->spilled == SCRATCH_SPILLS || posix_memalign(&p, 64, bytes)) return NULL;
    return s->spill[s->spilled++] = p;
}

static void scratch_done(scratch *s) {
    for (int i = 0; i < s->spilled; i++) free(s->spill[i]);
    s->small_calls = s->used < s->size / 4 ? s->small_calls + 1 : 0;
    if (s->used > s->size || s->small_calls == SHRINK_AFTER) {
        s->small_calls = 0;
        free(s->base);
        s->size = 0;
        if (posix_memalign((void **)&s->base, 64, s->used)) s->base = NULL;
        else s->size = s->used;
    }
}

/* The scratch of x quantized for `type`: M rows of K, in pieces whose rows of a pass fit X_PIECE_BYTES (a
 * multiple of 512 values: whole pairs of any type's blocks, as the pair kernels take them); one piece for a
 * single row, whose kernels stream the weights row by row */
static int acts_alloc(acts *a, scratch *s, int64_t M, int64_t K, int type) {
    const int qb = block_values(type);
    const int64_t pass = M < pass_rows(qb) ? M : pass_rows(qb);
    const int64_t span = X_PIECE_BYTES / pass / 512 * 512;
    a->M = M;
    a->K = K;
    a->qb = qb;
    a->span = M == 1 || span >= K ? K : span > 512 ? span : 512;
    const int64_t dt_floats = padded_rows(M, qb) * K / qb;
    /* on a cache line, as x's rows then are (K a multiple of 32): a load of 32 never straddles two */
    int8_t *bytes = scratch_take(s, M * K + sizeof(float) * (M * K / qb + 3 * (M * K / 32) + dt_floats) +
                                        sizeof(int16_t) * (M * K / 16));
    if (bytes == NULL) return 1;
    a->q = bytes;
    a->d = (float *)(a->q + M * K);
    a->ds = a->d + M * K / qb;
    a->lane = a->ds + M * K / 32;
    a->dt = a->lane + 2 * (M * K / 32);
    a->sums16 = (int16_t *)(a->dt + dt_floats);
    return 0;
}

/* y [M, N] (rows ldy apart) = x @ w^T, w N rows of `type`'s blocks, x's M rows as `a` holds them quantized */
typedef struct {
    const uint8_t *w;
    int type;
    int64_t N;
    const acts *a;
    float *y;
    int64_t ldy;
} product;

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* A thread's tile of Q4_K or Q6_K weights by lane, when x has two or more passes: a prefill's hundreds of rows
 * then unpack each weight block once, not once a pass. Kept for the thread's life (~1.8 x TILE_BYTES for Q6_K,
 * ~2.2 x for Q4_K). */
static _Thread_local uint8_t *tile_lanes;
static _Thread_local int64_t tile_lanes_bytes;

/* The bytes of a pair of blocks by lane */
static int64_t lanes_bytes(int type) { return type == Q4_K ? sizeof(q4_k_lanes) : sizeof(q6_k_lanes); }

/* Where piece c's rows begin in a tile of `rows` rows by lane */
static int64_t lanes_piece_at(int type, const acts *a, int64_t rows, int64_t c) {
    return c * rows * (a->span / 512) * lanes_bytes(type);
}

/* The tile's `rows` rows of Q4_K or Q6_K at w (row_bytes apart) into tile_lanes: for each piece of x (a) that goes
 * by lane, its rows' pairs one row after another from c x rows x span / 512 pairs, c the piece. Asks for the next
 * tile's rows as it goes, as PREFETCH_NEXT_TILE does. NULL where the buffer could not be had. */
static const uint8_t *unpack_tile(int type, const uint8_t *w, int64_t row_bytes, int64_t rows, const acts *a) {
    const int64_t size = lanes_bytes(type), bytes = rows * (a->K / 512) * size;
    if (bytes > tile_lanes_bytes) {
        free(tile_lanes);
        tile_lanes_bytes = 0;
        if (posix_memalign((void **)&tile_lanes, 64, bytes)) return tile_lanes = NULL;
        tile_lanes_bytes = bytes;
    }
    for (int64_t n = 0; n < rows; n++) {
        for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(w + (n + rows) * row_bytes + line, 0, 2);
        for (int64_t c = 0; c * a->span < a->K; c++) {
            const int64_t K = piece_of(a, c).K;
            if (!by_lane_pass(type, MR, K)) continue;
            const uint8_t *row = w + n * row_bytes + c * a->span / 256 * block_bytes(type);
            uint8_t *to = tile_lanes + lanes_piece_at(type, a, rows, c) + n * (K / 512) * size;
            for (int64_t p = 0; p < K / 512; p++) {
                if (type == Q4_K) q4_k_lanes_of(row + 2 * p * sizeof(block_q4_K), (q4_k_lanes *)to + p);
                else q6_k_lanes_of(row + 2 * p * sizeof(block_q6_K), (q6_k_lanes *)to + p);
            }
        }
    }
    return tile_lanes;
}
#endif

/* Called by every thread of a parallel region: each takes its own contiguous share of each product's rows, in
 * tiles of about TILE_BYTES, so that a weight streams from memory once and the threads finish together. The
 * caller puts a barrier after it before reading y. */
static void run_products(const product *p, int count, int64_t M) {
    const int threads = omp_get_num_threads(), me = omp_get_thread_num();
    for (int i = 0; i < count; i++) {
        const int64_t row_bytes = p[i].a->K / block_values(p[i].type) * block_bytes(p[i].type);
        const int64_t share = (p[i].N + threads - 1) / threads, begin = me * share;
        const int64_t end = begin + share < p[i].N ? begin + share : p[i].N;
        const int64_t tile_rows = TILE_BYTES / row_bytes > 4 ? TILE_BYTES / row_bytes : 4;
        const tile_fn tile = tile_for(p[i].type);
        const int64_t pass = pass_rows(block_values(p[i].type)), span = p[i].a->span;
        const int64_t piece_bytes = span / block_values(p[i].type) * block_bytes(p[i].type);
        for (int64_t n0 = begin; n0 < end; n0 += tile_rows) {
            const int64_t rows = n0 + tile_rows < end ? tile_rows : end - n0;
            const uint8_t *w = p[i].w + n0 * row_bytes;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
            const int type = p[i].type;
            const uint8_t *lanes = (type == Q4_K || type == Q6_K) && M >= 2 * pass
                                       ? unpack_tile(type, w, row_bytes, rows, p[i].a) : NULL;
#endif
            for (int64_t m0 = 0; m0 < M; m0 += pass)
                for (int64_t c = 0; c * span < p[i].a->K; c++) {
                    const acts piece = piece_of(p[i].a, c);
                    const int mr = M - m0 < pass ? M - m0 : pass;
                    float *y = p[i].y + m0 * p[i].ldy + n0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
                    if (lanes && by_lane_pass(type, mr, piece.K)) {
                        (type == Q4_K ? tile_q4_k_unpacked : tile_q6_k_unpacked)(
                            lanes + lanes_piece_at(type, p[i].a, rows, c), piece.K / 512 * lanes_bytes(type), rows,
                            &piece, m0, mr, y, p[i].ldy, c > 0);
                        continue;
                    }
#endif
                    tile(w + c * piece_bytes, row_bytes, rows, &piece, m0, mr, y, p[i].ldy, c > 0);
                }
        }
    }
}

/* y [M, N] (rows ldy apart) = x [M, K] (kind) @ w [N, K]^T, w N rows of `type`'s blocks; K a multiple of the
 * type's block. The caller checks the type and the shapes. 0, or 1 where the scratch for x could not be had. */
int pagedchat_quant_linear(const void *x, int kind, int64_t M, int64_t K, const void *w, int type, int64_t N,
                           float *y, int64_t ldy, int threads) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0) {  /* empty sums */
        for (int64_t m = 0; m < M; m++) memset(y + m * ldy, 0, sizeof(float) * N);
        return 0;
    }
    acts a;
    scratch *s = scratch_begin(FOR_LINEAR);
    if (s == NULL) return 1;
    if (acts_alloc(&a, s, M, K, type)) {
        scratch_done(s);
        return 1;
    }
    const product p = {w, type, N, &a, y, ldy};
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_acts(x, kind, m, &a, type);
        run_products(&p, 1, M);
    }
    scratch_done(s);
    return 0;
}

/* ---- a layer's products with the row ops around them, in one call and one parallel region ----
 * A decode step of a small model spends more in the calls around its products (one each, with the Python
 * and the thread wake-up each costs) than in the products; these two take a layer in two calls, beside the
 * attention. fp32 throughout, as the model computes on a GGUF. */

static void rms_norm_row(const float *x, const float *weight, float eps, int64_t K, float *out) {
    float lanes[8] = {0}, squares = 0.0f;  /* eight sums the compiler keeps in one vector */
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
        for (int j = 0; j < 8; j++) lanes[j] += x[k + j] * x[k + j];
    for (; k < K; k++) squares += x[k] * x[k];
    for (int j = 0; j < 8; j++) squares += lanes[j];
    const float inverse = 1.0f / sqrtf(squares / (float)K + eps);
    for (k = 0; k < K; k++) out[k] = weight[k] * (x[k] * inverse);
}

static void silu_mul_row(const float *gate, const float *up, int64_t K, float *out) {
    int64_t k = 0;
#if defined(__AVX2__)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; k + 8 <= K; k += 8) {
        const __m256 g = _mm256_loadu_ps(gate + k);
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(out + k, _mm256_mul_ps(silu, _mm256_loadu_ps(up + k)));
    }
#endif
    for (; k < K; k++) out[k] = gate[k] / (1.0f + expf(-gate[k])) * up[k];
}

/* x quantized once for each distinct type of a call's products: a[slot[i]] is the scratch of their i-th type */
typedef struct { acts a[3]; int type[3], slot[3], used; } act_set;

static int act_set_alloc(act_set *s, scratch *from, const int *types, int count, int64_t M, int64_t K) {
    s->used = 0;
    for (int i = 0; i < count; i++) {
        int u = 0;
        while (u < s->used && s->type[u] != types[i]) u++;
        s->slot[i] = u;
        if (u == s->used) {
            s->type[s->used++] = types[i];
            if (acts_alloc(&s->a[u], from, M, K, types[i])) return 1;
        }
    }
    return 0;
}

static void act_set_quantize(act_set *s, const float *x, int64_t m) {
    for (int u = 0; u < s->used; u++) quantize_acts(x, KIND_FP32, m, &s->a[u], s->type[u]);
}

/* y [M, nq + nk + nv] = q, k, v of rms_norm(x) (x [M, K]), plus bias where given; then each head of q and k
 * normed by q_norm or k_norm [head_dim] where given (Qwen3), and rotated by its row's cos and sin_signed
 * [M, head_dim] as transformers rotates it. `interleaved`: q's and k's rows are in llama.cpp's order, each
 * head's two rotary halves interleaved (its row 2i + j is transformers' row j * head_dim / 2 + i); y is in
 * transformers' order all the same, as are the bias and the norms. */
int pagedchat_quant_qkv(const float *x, int64_t M, int64_t K, const float *norm_weight, float eps,
                        const void *wq, int tq, int64_t nq, const void *wk, int tk, int64_t nk, const void *wv,
                        int tv, int64_t nv, const float *bias, const float *q_norm, const float *k_norm,
                        const float *cos, const float *sin_signed, int64_t head_dim, int interleaved, float *y,
                        int threads) {
    const int types[3] = {tq, tk, tv};
    const int64_t N = nq + nk + nv, rotated = nq + nk, half = head_dim / 2;
    act_set s;
    scratch *from = scratch_begin(FOR_QKV);
    if (from == NULL) return 1;
    float *normed = scratch_take(from, sizeof(float) * M * K);
    float *file = interleaved ? scratch_take(from, sizeof(float) * M * rotated) : y;
    if (normed == NULL || file == NULL || act_set_alloc(&s, from, types, 3, M, K)) {
        scratch_done(from);
        return 1;
    }
    const int64_t ldf = interleaved ? rotated : N;
    const product p[3] = {{wq, tq, nq, &s.a[s.slot[0]], file, ldf}, {wk, tk, nk, &s.a[s.slot[1]], file + nq, ldf},
                          {wv, tv, nv, &s.a[s.slot[2]], y + rotated, N}};
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            rms_norm_row(x + m * K, norm_weight, eps, K, normed + m * K);
            act_set_quantize(&s, normed, m);
        }
        run_products(p, 3, M);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            float *row = y + m * N;
            const float *f = file + m * ldf, *c = cos + m * head_dim, *sn = sin_signed + m * head_dim;
            if (bias != NULL)
                for (int64_t n = rotated; n < N; n++) row[n] += bias[n];
            float head[512];  /* a head in transformers' order, before its rotary (head_dim <= 512) */
            for (int64_t h = 0; h < rotated; h += head_dim) {
                for (int64_t i = 0; i < half; i++) {
                    const int64_t a_at = interleaved ? h + 2 * i : h + i, b_at = interleaved ? a_at + 1 : a_at + half;
                    head[i] = f[a_at] + (bias != NULL ? bias[h + i] : 0.0f);
                    head[i + half] = f[b_at] + (bias != NULL ? bias[h + i + half] : 0.0f);
                }
                const float *norm = h < nq ? q_norm : k_norm;
                if (norm != NULL) rms_norm_row(head, norm, eps, head_dim, head);
                for (int64_t i = 0; i < half; i++) {
                    const float a = head[i], b = head[i + half];
                    row[h + i] = a * c[i] + b * sn[i];
                    row[h + i + half] = b * c[i + half] + a * sn[i + half];
                }
            }
        }
    }
    scratch_done(from);
    return 0;
}

/* The rest of a layer after its attention, on residual [M, H] in place: residual += o_proj(attention [M, A]) +
 * o_bias (where given); then residual += down(silu(gate(h)) * up(h)), h = rms_norm(residual). gate and up:
 * [I, H], down: [H, I]. */
int pagedchat_quant_mlp(float *residual, const float *attention, int64_t M, int64_t H, int64_t A, const void *wo,
                        int to, const float *o_bias, const float *norm_weight, float eps, const void *wg, int tg,
                        const void *wu, int tu, int64_t I, const void *wd, int td, int threads) {
    const int gate_up_types[2] = {tg, tu};
    act_set s_o, s_gu, s_d;
    scratch *from = scratch_begin(FOR_MLP);
    if (from == NULL) return 1;
    float *rows = scratch_take(from, sizeof(float) * M * (2 * H + 3 * I));
    if (rows == NULL || act_set_alloc(&s_o, from, &to, 1, M, A) ||
        act_set_alloc(&s_gu, from, gate_up_types, 2, M, H) || act_set_alloc(&s_d, from, &td, 1, M, I)) {
        scratch_done(from);
        return 1;
    }
    float *out = rows, *normed = out + M * H, *gate_up = normed + M * H, *hidden = gate_up + M * 2 * I;
    const product o = {wo, to, H, &s_o.a[0], out, H};
    const product gu[2] = {{wg, tg, I, &s_gu.a[s_gu.slot[0]], gate_up, 2 * I},
                           {wu, tu, I, &s_gu.a[s_gu.slot[1]], gate_up + I, 2 * I}};
    const product d = {wd, td, H, &s_d.a[0], out, H};
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) act_set_quantize(&s_o, attention, m);
        run_products(&o, 1, M);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            float *r = residual + m * H;
            for (int64_t n = 0; n < H; n++) r[n] += out[m * H + n] + (o_bias != NULL ? o_bias[n] : 0.0f);
            rms_norm_row(r, norm_weight, eps, H, normed + m * H);
            act_set_quantize(&s_gu, normed, m);
        }
        run_products(gu, 2, M);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            silu_mul_row(gate_up + m * 2 * I, gate_up + m * 2 * I + I, I, hidden + m * I);
            act_set_quantize(&s_d, hidden, m);
        }
        run_products(&d, 1, M);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < H; n++) residual[m * H + n] += out[m * H + n];
    }
    scratch_done(from);
    return 0;
}

/* out [count, K] = rows `ids` of w (N rows of `type`'s blocks) in fp32, as gguf's dequantizer gives them */
void pagedchat_quant_dequantize_rows(const void *w, int type, int64_t K, const int64_t *ids, int64_t count,
                                     float *out, int threads) {
    const int qb = block_values(type);
    const int64_t row_bytes = K / qb * block_bytes(type), size = block_bytes(type);
    #pragma omp parallel for num_threads(threads) schedule(static) if (count * K >= 65536)
    for (int64_t i = 0; i < count; i++)
        for (int64_t b = 0; b < K / qb; b++)
            dequantize_block(type, (const uint8_t *)w + ids[i] * row_bytes + b * size, out + i * K + b * qb);
}

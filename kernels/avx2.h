/* What the AVX2 kernels share: loading 8 values of a dtype as fp32, rounding back as torch rounds, sums. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { KIND_BF16 = 0, KIND_FP16 = 1, KIND_FP32 = 2 };

static inline __m256 load8(const void *p, int64_t i, int kind) {
    if (kind == KIND_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (kind == KIND_FP16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_loadu_ps((const float *)p + i);
}

static inline float widen(const void *p, int64_t i, int kind) {
    if (kind == KIND_FP32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    if (kind == KIND_FP16) return _cvtsh_ss(h);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_half(float f, int kind) {  /* to nearest even, as torch rounds */
    if (kind == KIND_FP16) return _cvtss_sh(f, 0);
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline void store(void *p, int64_t i, float f, int kind) {
    if (kind == KIND_FP32) ((float *)p)[i] = f;
    else ((uint16_t *)p)[i] = to_half(f, kind);
}

static inline float rounded(float f, int kind) {  /* f as a tensor of this kind holds it */
    if (kind == KIND_FP32) return f;
    uint16_t h = to_half(f, kind);
    return widen(&h, 0, kind);
}

/* 8 values as a tensor of this kind holds them, each rounded as `to_half` rounds it */
static inline __m128i to_half8(__m256 f, int kind) {
    if (kind == KIND_FP16) return _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT);
    __m256i u = _mm256_castps_si256(f);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i h = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08));
}

static inline void store8(void *p, int64_t i, __m256 f, int kind) {
    if (kind == KIND_FP32) _mm256_storeu_ps((float *)p + i, f);
    else _mm_storeu_si128((__m128i *)((uint16_t *)p + i), to_half8(f, kind));
}

static inline __m256 rounded8(__m256 f, int kind) {
    if (kind == KIND_FP32) return f;
    __m128i h = to_half8(f, kind);
    return load8(&h, 0, kind);
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

/* e^x for 8 floats, Cephes' polynomial (within 2 ulp), as torch vectorises its exp */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}

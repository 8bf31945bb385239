/* What the attention units (paged_decode.c, paged_prefill.c) share: K/V element access by cache
 * dtype, the softmax and softcap steps over score rows.
 *
 * The cache dtype is an `int kv_bf16` argument rather than a type: the functions that loop over
 * elements are inlined where it is a constant, so each dtype gets its own loop without one being
 * written per dtype. */
#ifndef TOKENMILL_ATTENTION_H
#define TOKENMILL_ATTENTION_H

#include <math.h>
#include <stdint.h>

#include "simd.h"

#define MAX_CHUNKS 16   /* the AVX-512 paths hold a head in at most 16 vectors: head_dim <= 256 */

/* Element i of a K/V cache (float32 or bfloat16) as float32. */
static inline float kv_load(const void *p, int64_t i, const int kv_bf16) {
    if (!kv_bf16) return ((const float *)p)[i];
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((const uint16_t *)p)[i] << 16;
    return c.f;
}

/* Stores x as element i of a K/V cache; bfloat16 rounds to nearest even, as torch does. */
static inline void kv_store(void *p, int64_t i, float x, const int kv_bf16) {
    if (!kv_bf16) {
        ((float *)p)[i] = x;
        return;
    }
    union { float f; uint32_t u; } c = {x};
    ((uint16_t *)p)[i] = isnan(x) ? (uint16_t)0x7fc0 : (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* A score after the softmax scale, through the logit softcap c (0: none): c tanh(s / c), in the
 * reference's order. */
static inline float softcap_score(float s, float softcap) {
    return softcap > 0.0f ? tanhf(s / softcap) * softcap : s;
}

#ifdef HAVE_AVX512
/* 16 elements of a K/V cache from element i, as float32. */
static inline __m512 kv_loadv(const void *p, int64_t i, const int kv_bf16) {
    if (!kv_bf16) return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Row order. A K or V row of CH x 16 elements comes as CH float32 vectors: for a bfloat16 cache, each
 * 32 elements (one 64-byte load) as two vectors, their even elements then their odd ones (a shift
 * and a mask: no conversion instructions); a float32 cache's rows, and an odd last 16 elements, in
 * their own order. A dot product with a row does not care about the order when the other operand
 * is in it too (to_row_order), and sums of rows come out in it (from_row_order). */
static ALWAYS_INLINE void kv_row(const int CH, const int kv_bf16, const void *p, int64_t i, __m512 *out) {
    for (int c = 0; c < CH; c++) {
        if (kv_bf16 && c + 1 < CH) {
            const __m512i x = _mm512_loadu_si512((const uint16_t *)p + i + 16 * c);
            out[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            out[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
            c++;
        } else {
            out[c] = kv_loadv(p, i + 16 * c, kv_bf16);
        }
    }
}

/* CH float32 vectors (a row of 16 CH values) in kv_row's order, in place. */
static ALWAYS_INLINE void to_row_order(const int CH, const int kv_bf16, __m512 *x) {
    if (!kv_bf16) return;
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int c = 0; c + 1 < CH; c += 2) {
        const __m512 a = x[c], b = x[c + 1];
        x[c] = _mm512_permutex2var_ps(a, even, b);
        x[c + 1] = _mm512_permutex2var_ps(a, odd, b);
    }
}

/* The inverse of to_row_order. */
static ALWAYS_INLINE void from_row_order(const int CH, const int kv_bf16, __m512 *x) {
    if (!kv_bf16) return;
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int c = 0; c + 1 < CH; c += 2) {
        const __m512 e = x[c], o = x[c + 1];
        x[c] = _mm512_permutex2var_ps(e, lo, o);
        x[c + 1] = _mm512_permutex2var_ps(e, hi, o);
    }
}

/* softcap_score on 16 scores. */
static inline __m512 softcap512(__m512 s, float softcap) {
    const __m512 c = _mm512_set1_ps(softcap);
    return _mm512_mul_ps(tanh512(_mm512_div_ps(s, c)), c);
}

/* exp(x) for x <= 0 (scores minus their max); below -87, 0. */
static inline __m512 exp_nonpositive(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    return _mm512_maskz_mov_ps((__mmask16)~under, exp512(x));
}

/* Softmax numerators of a score row of `blocks` x 16 (lanes to ignore -inf): s = exp(s - max), in
 * place; returns their sum, and the max in *max_out unless it is NULL. */
static inline float exp_minus_max(float *s, int64_t blocks, float *max_out) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t b = 0; b < blocks; b++) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + 16 * b));
    const float max = _mm512_reduce_max_ps(mv);
    if (max_out != NULL) *max_out = max;
    const __m512 m = _mm512_set1_ps(max);
    __m512 total = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * b), m));
        _mm512_storeu_ps(s + 16 * b, e);
        total = _mm512_add_ps(total, e);
    }
    return _mm512_reduce_add_ps(total);
}
#endif

#endif

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
 * place; returns their sum. */
static inline float exp_minus_max(float *s, int64_t blocks) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t b = 0; b < blocks; b++) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + 16 * b));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
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

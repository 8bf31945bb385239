/* What the attention units (paged_decode.c, paged_prefill.c) share: K/V row access by cache type
 * (kernels.h TM_KV_*), the softmax and softcap steps over score rows.
 *
 * The cache type is an `int kv_type` argument rather than a C type: the functions that loop over
 * elements are inlined where it is a constant, so each type gets its own loop without one being
 * written per type. Offsets into a cache count its elements (bytes for int8), and a row of a
 * (token, kv head) is kv_row_elems(head_dim) of them. */
#ifndef TOKENMILL_ATTENTION_H
#define TOKENMILL_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define MAX_CHUNKS 16   /* the AVX-512 paths hold a head in at most 16 vectors: head_dim <= 256 */

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

/* x rounded to bfloat16, to nearest even, as torch rounds it. */
static inline uint16_t float_to_bf16(float x) {
    union { float f; uint32_t u; } c = {x};
    return isnan(x) ? (uint16_t)0x7fc0 : (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* Elements per cache row: an int8 row carries a bf16 scale per group after its values. */
static inline int64_t kv_row_elems(int64_t head_dim, const int kv_type) {
    return kv_type == TM_KV_I8 ? head_dim + 2 * ((head_dim + TM_KV_GROUP - 1) / TM_KV_GROUP) : head_dim;
}

static inline int kv_elem_bytes(const int kv_type) {
    return kv_type == TM_KV_F32 ? 4 : kv_type == TM_KV_BF16 ? 2 : 1;
}

/* The scale of group g of the int8 row starting at element `row`. */
static inline float kv_group_scale(const void *p, int64_t row, int64_t head_dim, int64_t g) {
    uint16_t h;
    memcpy(&h, (const int8_t *)p + row + head_dim + 2 * g, sizeof h);
    return bf16_to_float(h);
}

/* Value d of the cache row starting at element `row`, as float32 (an int8 one times its group's scale). */
static inline float kv_value(const void *p, int64_t row, int64_t d, int64_t head_dim, const int kv_type) {
    if (kv_type == TM_KV_F32) return ((const float *)p)[row + d];
    if (kv_type == TM_KV_BF16) return bf16_to_float(((const uint16_t *)p)[row + d]);
    return (float)((const int8_t *)p)[row + d] * kv_group_scale(p, row, head_dim, d / TM_KV_GROUP);
}

/* x [n] as the cache row starting at element `row` (int8: quantized as kernels.h says; a zero
 * group gets scale 0; a group holding NaN a NaN scale and every value 0; NaN quotients (an infinite
 * x) 0: as quantize_kv, byte for byte). */
static inline void kv_store_row(void *p, int64_t row, const float *x, int64_t n, const int kv_type) {
    if (kv_type == TM_KV_F32) {
        memcpy((float *)p + row, x, sizeof(float) * (size_t)n);
    } else if (kv_type == TM_KV_BF16) {
        for (int64_t i = 0; i < n; i++) ((uint16_t *)p)[row + i] = float_to_bf16(x[i]);
    } else {
        int8_t *q = (int8_t *)p + row;
        for (int64_t g0 = 0; g0 < n; g0 += TM_KV_GROUP) {
            const int64_t end = g0 + TM_KV_GROUP < n ? g0 + TM_KV_GROUP : n;
            float amax = 0.0f;
            for (int64_t i = g0; i < end; i++) amax = isnan(x[i]) || fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            const uint16_t h = float_to_bf16(amax / 127.0f);
            const float s = bf16_to_float(h);
            for (int64_t i = g0; i < end; i++) {
                const float r = s > 0.0f ? nearbyintf(x[i] / s) : 0.0f;
                q[i] = isnan(r) ? 0 : (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
            }
            memcpy(q + n + 2 * (g0 / TM_KV_GROUP), &h, sizeof h);
        }
    }
}

/* The first key position a query at `position` sees (its sliding window's start, or 0). */
static inline int64_t first_key(int64_t position, int64_t window) {
    return window > 0 && position + 1 > window ? position + 1 - window : 0;
}

/* A score after the softmax scale, through the logit softcap c (0: none): c tanh(s / c), in the
 * reference's order. */
static inline float softcap_score(float s, float softcap) {
    return softcap > 0.0f ? tanhf(s / softcap) * softcap : s;
}

#ifdef HAVE_AVX512
/* 16 elements of a float32 or bfloat16 cache from element i, as float32. */
static inline __m512 kv_loadv(const void *p, int64_t i, const int kv_type) {
    if (kv_type == TM_KV_F32) return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Row order. A K or V row of CH x 16 elements comes as CH float32 vectors: for a bfloat16 cache, each
 * 32 elements (one 64-byte load) as two vectors, their even elements then their odd ones (a shift
 * and a mask: no conversion instructions); float32 and int8 rows (int8 values times their group's
 * scale: the same bits as dequantizing in PyTorch), and an odd last 16 elements, in their own order. A dot
 * product with a row does not care about the order when the other operand is in it too
 * (to_row_order), and sums of rows come out in it (from_row_order). */
static ALWAYS_INLINE void kv_row(const int CH, const int kv_type, const void *p, int64_t i, __m512 *out) {
    for (int c = 0; c < CH; c++) {
        if (kv_type == TM_KV_I8) {   /* 16 values of group c / 2 (groups of 32 = 2 vectors) */
            const __m128i q = _mm_loadu_si128((const __m128i *)((const int8_t *)p + i + 16 * c));
            out[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)),
                                   _mm512_set1_ps(kv_group_scale(p, i, 16 * CH, c / 2)));
        } else if (kv_type == TM_KV_BF16 && c + 1 < CH) {
            bf16_pair((const uint16_t *)p + i + 16 * c, &out[c], &out[c + 1]);
            c++;
        } else {
            out[c] = kv_loadv(p, i + 16 * c, kv_type);
        }
    }
}

/* CH float32 vectors (a row of 16 CH values) in kv_row's order, in place. */
static ALWAYS_INLINE void to_row_order(const int CH, const int kv_type, __m512 *x) {
    if (kv_type != TM_KV_BF16) return;
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int c = 0; c + 1 < CH; c += 2) {
        const __m512 a = x[c], b = x[c + 1];
        x[c] = _mm512_permutex2var_ps(a, even, b);
        x[c + 1] = _mm512_permutex2var_ps(a, odd, b);
    }
}

/* The inverse of to_row_order. */
static ALWAYS_INLINE void from_row_order(const int CH, const int kv_type, __m512 *x) {
    if (kv_type != TM_KV_BF16) return;
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

#endif


#if defined(HAVE_AVX2) && !defined(HAVE_AVX512)
/* kv_row and its orders with 8-lane vectors: a row of CH x 16 elements as 2 CH vectors; for a
 * bfloat16 cache each 16 elements (one 32-byte load) as two vectors, their even elements then their
 * odd ones, as above. */
static ALWAYS_INLINE void kv_row(const int CH, const int kv_type, const void *p, int64_t i, __m256 *out) {
    for (int c = 0; c < 2 * CH; c++) {
        if (kv_type == TM_KV_I8) {   /* 8 values of group c / 4 (groups of 32 = 4 vectors) */
            const __m128i q = _mm_loadl_epi64((const __m128i *)((const int8_t *)p + i + 8 * c));
            out[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                                   _mm256_set1_ps(kv_group_scale(p, i, 16 * CH, c / 4)));
        } else if (kv_type == TM_KV_BF16) {
            bf16_pair((const uint16_t *)p + i + 8 * c, &out[c], &out[c + 1]);
            c++;
        } else {
            out[c] = _mm256_loadu_ps((const float *)p + i + 8 * c);
        }
    }
}

static ALWAYS_INLINE void to_row_order(const int CH, const int kv_type, __m256 *x) {
    if (kv_type != TM_KV_BF16) return;
    const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);   /* a vector's even, then odd elements */
    for (int c = 0; c < 2 * CH; c += 2) {
        const __m256 a = _mm256_permutevar8x32_ps(x[c], split), b = _mm256_permutevar8x32_ps(x[c + 1], split);
        x[c] = _mm256_permute2f128_ps(a, b, 0x20);
        x[c + 1] = _mm256_permute2f128_ps(a, b, 0x31);
    }
}

static ALWAYS_INLINE void from_row_order(const int CH, const int kv_type, __m256 *x) {
    if (kv_type != TM_KV_BF16) return;
    for (int c = 0; c < 2 * CH; c += 2) {
        const __m256 lo = _mm256_unpacklo_ps(x[c], x[c + 1]), hi = _mm256_unpackhi_ps(x[c], x[c + 1]);
        x[c] = _mm256_permute2f128_ps(lo, hi, 0x20);
        x[c + 1] = _mm256_permute2f128_ps(lo, hi, 0x31);
    }
}
#endif

/* The attention kernels' vf operations (simd.h has the basic ones). */
#if defined(HAVE_AVX512)
static inline vf vf_exp_nonpositive(vf x) { return exp_nonpositive(x); }
static inline vf vf_softcap(vf s, float softcap) { return softcap512(s, softcap); }
/* s where key j0 + lane is seen from position pos (j <= pos, and j > pos - window when window > 0),
 * else -inf */
static inline vf vf_causal(vf s, int64_t j0, int64_t pos, int64_t window) {
    const __m512i j = _mm512_add_epi32(_mm512_set1_epi32((int)j0),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __mmask16 seen = _mm512_cmple_epi32_mask(j, _mm512_set1_epi32((int)pos));
    if (window > 0) seen &= _mm512_cmpgt_epi32_mask(j, _mm512_set1_epi32((int)(pos - window)));
    return _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), s);
}
#elif defined(HAVE_AVX2)
static inline vf vf_exp_nonpositive(vf x) {   /* below -87, 0 */
    return _mm256_and_ps(exp256(x), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}
static inline vf vf_softcap(vf s, float softcap) {
    const vf c = _mm256_set1_ps(softcap);
    return _mm256_mul_ps(tanh256(_mm256_div_ps(s, c)), c);
}
static inline vf vf_causal(vf s, int64_t j0, int64_t pos, int64_t window) {
    const __m256i j = _mm256_add_epi32(_mm256_set1_epi32((int)j0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i seen = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(pos + 1)), j);
    if (window > 0) seen = _mm256_and_si256(seen, _mm256_cmpgt_epi32(j, _mm256_set1_epi32((int)(pos - window))));
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_castsi256_ps(seen));
}
#endif


#ifdef HAVE_VF
/* The first n lanes of p (n may exceed VW), the others 0. */
static inline vf vf_load_first(const float *p, int64_t n) {
#if VW == 16
    return _mm512_maskz_loadu_ps(n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1), p);
#else
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n >= 8 ? 8 : (int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_ps(p, live);
#endif
}

/* Softmax numerators of a score row of `blocks` x 16 (lanes to ignore -inf): s = exp(s - max), in
 * place; returns their sum, and the max in *max_out unless it is NULL. */
static inline float exp_minus_max(float *s, int64_t blocks, float *max_out) {
    vf mv = vf_set1(-INFINITY);
    for (int64_t i = 0; i < 16 * blocks; i += VW) mv = vf_max(mv, vf_load(s + i));
    const float max = vf_reduce_max(mv);
    if (max_out != NULL) *max_out = max;
    const vf m = vf_set1(max);
    vf total = vf_set1(0.0f);
    for (int64_t i = 0; i < 16 * blocks; i += VW) {
        const vf e = vf_exp_nonpositive(vf_sub(vf_load(s + i), m));
        vf_store(s + i, e);
        total = vf_add(total, e);
    }
    return vf_reduce_add(total);
}
#endif

#endif

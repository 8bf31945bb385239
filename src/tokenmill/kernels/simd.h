/* Helpers shared by the kernels' translation units: the instruction sets this build targets and the
 * vector math the kernels need. Everything here is static inline: each unit gets its own copy, so
 * no call crosses a unit boundary in a hot loop.
 *
 * HAVE_AVX512 (AVX-512F) and HAVE_VNNI (plus BW and VNNI) follow the compiler's target
 * (-march=native). Each kernel has a portable C version beside its AVX-512 one; the portable one
 * runs where the instructions are missing, and is the tests' reference where they are not. */
#ifndef TOKENMILL_SIMD_H
#define TOKENMILL_SIMD_H

#include <stdint.h>

/* For the functions whose `const int` parameters (a head_dim in vectors, a row count, a KV dtype)
 * must be constants at every call site: inlined there, the loops over them unroll completely and
 * their arrays of vectors stay in registers. */
#define ALWAYS_INLINE inline __attribute__((always_inline))

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512 1
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#endif

#ifdef HAVE_AVX512
/* exp(x), x clamped to [-87, 88] (no inf, no denormals): 2^n e^r, |r| <= ln2 / 2, degree-6 Taylor
 * of e^r (relative error < 2e-7). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|). Near 0, 1 - e cancels, so there it comes from
 * e^r - 1 = r (1 + r/2 + r^2/6 + ...) directly (for 2|x| <= ln2 / 2, where the exp's reduction gives
 * n = 0 and r = -2|x|); the relative error stays within a few units of float32 over the whole range
 * (|x| >= 9: 1 to float32 precision). */
static inline __m512 tanh512(__m512 x) {
    const __m512 a = _mm512_abs_ps(x), one = _mm512_set1_ps(1.0f);
    const __m512 y = _mm512_mul_ps(a, _mm512_set1_ps(-2.0f));               /* <= 0 */
    __m512 p = _mm512_set1_ps(1.0f / 40320);                                /* (e^y - 1) / y */
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 5040));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, y, one);
    const __mmask16 small = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-0.34657359f), _CMP_GE_OQ);
    const __m512 em1 = _mm512_mask_blend_ps(small, _mm512_sub_ps(exp512(y), one), _mm512_mul_ps(p, y));
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_setzero_ps(), em1), _mm512_add_ps(em1, _mm512_set1_ps(2.0f)));
    /* the sign of x back on |tanh| */
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t),
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
}
#endif

#endif

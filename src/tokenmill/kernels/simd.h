/* Helpers shared by the kernels' translation units: the instruction sets this build targets, the
 * vector math the kernels need and float sums in one fixed order (sum16). Everything here is static
 * inline: each unit gets its own copy, so no call crosses a unit boundary in a hot loop.
 *
 * HAVE_AVX512 (AVX-512F), HAVE_VNNI (plus BW and VNNI), HAVE_AMX (plus the int8 tiles, on Linux)
 * and HAVE_AVX2 (with FMA and F16C) follow the compiler's target (-march=native). Each kernel has a portable C version beside its AVX-512 one; the portable one
 * runs where the instructions are missing, and is the tests' reference where they are not. */
#ifndef TOKENMILL_SIMD_H
#define TOKENMILL_SIMD_H

#include <stdint.h>

/* For the functions whose `const int` parameters (a head_dim in vectors, a row count, a KV dtype)
 * must be constants at every call site: inlined there, the loops over them unroll completely and
 * their arrays of vectors stay in registers. */
#define ALWAYS_INLINE inline __attribute__((always_inline))

/* Software prefetch for a kernel streaming a weight from memory, called as it reaches each
 * [p, p + nbytes): the lines PREFETCH_L1 bytes further on are fetched into L1, those PREFETCH_L2 bytes
 * further into L2. At one or a few activation rows a matmul's arithmetic takes about as long as
 * reading its weight's bytes, so the two must overlap; the hardware prefetchers alone keep too few
 * lines in flight for that (and stop at each 4 KB page), which left each core waiting on memory for
 * about as long as it computed. L2 tracks more misses at once than L1, hence the second, farther
 * distance. A prefetch never faults: running past the end of the weight is harmless. */
#define PREFETCH_L1 1024
#define PREFETCH_L2 8192
static ALWAYS_INLINE void prefetch_ahead(const void *p, int64_t nbytes) {   /* (inlined: see paged_decode.c) */
    for (int64_t off = 0; off < nbytes; off += 64) {
        __builtin_prefetch((const char *)p + PREFETCH_L1 + off, 0, 3);
        __builtin_prefetch((const char *)p + PREFETCH_L2 + off, 0, 2);
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512 1
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#endif

/* AMX (Sapphire Rapids and later): tile registers of 16 rows x 64 bytes, one instruction a 16 x 16
 * block of int8 dot products over 64 bytes. The quantized matmul's path for blocks of up to 16 activation
 * rows; the process must ask Linux for the tile state first (quant_matmul.c), hence Linux only. */
#if defined(HAVE_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__x86_64__) && defined(__linux__)
#define HAVE_AMX 1
#endif

/* AVX512-BF16 (vdpbf16ps: 32 bf16 products per instruction where an fp32 FMA does 16): the prefill
 * attention's dot products on a bfloat16 cache. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_BF16 1
#endif

/* AVX2 with FMA and F16C (x86-64-v3: most x86 CPUs without AVX-512): the quantized matmul's
 * second SIMD path, for CPUs that lack VNNI. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1
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

#if defined(HAVE_AVX2) && !defined(HAVE_AVX512)
/* exp512 and tanh512 on 8 lanes, the same steps (2^n by building the float: n is within
 * [-126, 127] after the clamp, so it is a normal number and the product exact). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

static inline __m256 tanh256(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 a = _mm256_andnot_ps(sign, x);
    const __m256 y = _mm256_mul_ps(a, _mm256_set1_ps(-2.0f));               /* <= 0 */
    __m256 p = _mm256_set1_ps(1.0f / 40320);                                /* (e^y - 1) / y */
    p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 5040));
    p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, y, one);
    const __m256 small = _mm256_cmp_ps(y, _mm256_set1_ps(-0.34657359f), _CMP_GE_OQ);
    const __m256 em1 = _mm256_blendv_ps(_mm256_sub_ps(exp256(y), one), _mm256_mul_ps(p, y), small);
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(_mm256_setzero_ps(), em1), _mm256_add_ps(em1, _mm256_set1_ps(2.0f)));
    return _mm256_or_ps(t, _mm256_and_ps(x, sign));   /* the sign of x back on |tanh| */
}
#endif

/* ---- vf: a float vector of VW lanes, the widest this build has (AVX-512: 16, AVX2: 8) ----
 * The few operations a kernel written once for either width needs (dense_matmul.c, paged_prefill.c,
 * paged_decode.c; attention.h adds the attention's own). */
#if defined(HAVE_AVX512)
#define HAVE_VF 1
#define VW 16
typedef __m512 vf;
static inline vf vf_load(const float *p) { return _mm512_load_ps(p); }
static inline vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf x) { _mm512_store_ps(p, x); }
static inline void vf_storeu(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vf_reduce_max(vf x) { return _mm512_reduce_max_ps(x); }
static inline float vf_reduce_add(vf x) { return _mm512_reduce_add_ps(x); }
#elif defined(HAVE_AVX2)
#define HAVE_VF 1
#define VW 8
typedef __m256 vf;
static inline vf vf_load(const float *p) { return _mm256_load_ps(p); }
static inline vf vf_loadu(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf x) { _mm256_store_ps(p, x); }
static inline void vf_storeu(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vf_reduce_max(vf x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
static inline float vf_reduce_add(vf x) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}
#endif

#ifdef HAVE_VF
/* 2 VW bf16 values from p as two float vectors, their even and odd elements (one load, a shift and a
 * mask, no conversion instructions): a dense bf16 weight's row (dense_matmul.c) and a bf16 K/V row
 * (attention.h's row order). */
static inline void bf16_pair(const uint16_t *p, vf *even, vf *odd) {
#if VW == 16
    const __m512i v = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
#else
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
#endif
}
#endif

/* ---- float sums in one fixed order in every build ----
 * 16 lanes, lane j summing elements j, j + 16, j + 32, ... in turn (lanes past a short row's end
 * hold 0); then lanes j and j + w for w = 8, 4, 2, 1. With `squares`, each element is squared and
 * rounded before it is added: a separate multiply and add, never a fused multiply-add (the -std=c11
 * build contracts nothing, and each product is a statement of its own). The portable loops and the
 * AVX-512 ones add the same numbers in the same order, so the two agree bit for bit. */

static inline float sum16_tree(float s[16]) {
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) s[j] += s[j + w];
    return s[0];
}

static inline float sum16(const float *x, int64_t n, int squares) {
    float s[16] = {0};
    for (int j = 0; j < 16 && j < n; j++) s[j] = squares ? x[j] * x[j] : x[j];
    int64_t i = 16;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) {
            const float t = squares ? x[i + j] * x[i + j] : x[i + j];
            s[j] += t;
        }
    for (int j = 0; i + j < n; j++) {
        const float t = squares ? x[i + j] * x[i + j] : x[i + j];
        s[j] += t;
    }
    return sum16_tree(s);
}

#ifdef HAVE_AVX512
static inline float sum16_512(__m512 v) {  /* sum16_tree on a vector's 16 lanes */
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(c) + _mm_cvtss_f32(_mm_shuffle_ps(c, c, 1));
}

/* sum16 with its 16 lanes in a vector: only the live lanes of a last, partial part are added. */
static inline float sum16_avx512(const float *x, int64_t n, int squares) {
    const __m512 v = _mm512_maskz_loadu_ps(n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1), x);
    __m512 s = squares ? _mm512_mul_ps(v, v) : v;
    for (int64_t i = 16; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 u = _mm512_maskz_loadu_ps(live, x + i);
        s = _mm512_mask_add_ps(s, live, s, squares ? _mm512_mul_ps(u, u) : u);
    }
    return sum16_512(s);
}
#endif

#if defined(HAVE_AVX2) && !defined(HAVE_AVX512)
/* sum16_tree on 16 lanes held as two vectors (lanes 0-7, lanes 8-15). */
static inline float sum16_256(__m256 lo, __m256 hi) {
    const __m256 a = _mm256_add_ps(lo, hi);
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(c) + _mm_cvtss_f32(_mm_shuffle_ps(c, c, 1));
}

/* sum16 in two vectors of 8 lanes: the first 16 elements (lanes past n: 0), then each further part
 * added on its live lanes only (the others get -0, which changes no sum, as sum16 leaves them). */
static inline float sum16_avx2(const float *x, int64_t n, int squares) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 s[2];
    for (int64_t i = 0; i < n || i == 0; i += 16)
        for (int h = 0; h < 2; h++) {
            const int64_t live = n - i - 8 * h;
            const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(live > 8 ? 8 : live < 0 ? 0 : (int)live), lanes);
            const __m256 u = _mm256_maskload_ps(x + i + 8 * h, mask);
            const __m256 t = squares ? _mm256_mul_ps(u, u) : u;
            s[h] = i == 0 ? t : _mm256_add_ps(s[h], _mm256_blendv_ps(_mm256_set1_ps(-0.0f), t, _mm256_castsi256_ps(mask)));
        }
    return sum16_256(s[0], s[1]);
}
#endif

#endif

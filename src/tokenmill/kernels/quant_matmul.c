/* y = x W^T for block-quantized weights and int8-quantized activations, for CPUs.
 *
 * Weights: unsigned values u (4 or 8 bits) in groups of 32 inputs, each group of each row with its
 * own scale d and offset m (fp16): W[n, k] = d[n, g] * u[n, k] + m[n, g], g = k / 32. This holds
 * GGUF's Q4_0/Q4_1/Q4_K (4 bits), Q5_0/Q5_1/Q5_K/Q8_0 (8 bits, e.g. Q8_0: u = q + 128, m = -128 d) and any
 * other weight requantized to 8 bits per group. A symmetric weight (every m = -z d for one integer z:
 * Q4_0, Q5_0, Q8_0) stores no m: the kernels form -z d from d (exact in fp32: an fp16 value times an
 * integer below 2^8), so with two activation planes its results are the bits of the same weight with m
 * stored, from 1/10 fewer bytes at 4 bits (decode reads every weight byte once per step); with one plane
 * it has a formula of its own (below), equal to float32 rounding.
 *
 * Activations: each row's group of 32 is split on entry into two int8 planes (quantize_row):
 * x[k] ~ x^[k] = dx[g] (254 hi[k] + lo[k]), where hi is the plain int8 rounding that llama.cpp uses
 * and lo rounds what it leaves; each activation is then within 2^-16 of its group's largest. Then
 *   sum_k W[n, k] x^[k] = sum_g ( d[n, g] dx[g] (254 sum_k u hi + sum_k u lo)  +  m[n, g] sum_k x^[k] )
 * exactly: the inner sums are exact integers (VNNI dot products of u8 x s8), and the second term
 * takes the sum of the quantized activations (an exact integer times dx), so the result is the
 * dequantized weight times x^, to float32 rounding. (With the exact float sum of x there instead,
 * each group's rounding error would be weighted by d u, all of one sign, rather than by the centred
 * W = d u + m: several times the error; ARCHITECTURE has the measurements.) A row's output never
 * depends on the other rows.
 *
 * A weight with int8_activations set takes one plane: x[k] ~ dx[g] hi[k] with dx = amax / 127 (llama.cpp's
 * int8 activations, ~2^8 times the rounding error, for half the products), and fewer float steps:
 *   sum_k W[n, k] x^[k] = sum_g ( d[n, g] dx[g] sum_k u hi  +  m[n, g] dx[g] sum_k hi )
 * and for a symmetric weight (m = -z d) sum_g (sum_k u hi - z sum_k hi) d[n, g] dx[g], one integer
 * difference (exact in float32: both terms are below 2^24) and one product per group (SUMS_* below).
 *
 * Layout (`pack` in layers/quant.py): rows in tiles of 16. For tile t and group g:
 *   8 bits: 8 vectors of 64 bytes; vector c, byte 4r + i = u[16t + r, 32g + 4c + i]
 *   4 bits: 4 vectors of 64 bytes; vector j, byte 4r + i = u[.., 32g + 4j + i] | u[.., 32g + 16 + 4j + i] << 4
 *   d, m:   [tiles, groups, 16] fp16 (m absent for a symmetric weight)
 * so one VNNI instruction takes 4 inputs of 16 rows against 4 activation bytes broadcast to all
 * lanes, and lane r accumulates row r: no horizontal sums.
 */
#define _GNU_SOURCE   /* syscall (AMX's permission) */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "rows.h"
#include "simd.h"

#ifdef HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* CPUs with AVX2 but not VNNI take tile_avx2; SIMD_TILES: either kind of SIMD tiles (tile_rows_simd) */
#if defined(HAVE_AVX2) && !defined(HAVE_VNNI)
#define AVX2_TILES 1
#else
#define AVX2_TILES 0
#endif
#if defined(HAVE_VNNI) || AVX2_TILES
#define SIMD_TILES 1
#else
#define SIMD_TILES 0
#endif

#define TILE 16
#define GROUP 32

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    union { uint32_t u; float f; } c;
    if (exp == 0) {  /* zero or subnormal */
        c.f = (float)mant * 5.9604644775390625e-8f;  /* 2^-24 */
        c.u |= sign;
        return c.f;
    }
    c.u = sign | (exp == 31 ? 0x7f800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
    return c.f;
}

/* ---- activations: one row -> two int8 planes, scale and exact float sum per group ----
 * x ~ dx (254 hi + lo): hi = round(x / (254 dx)) is the usual int8 rounding (|hi| <= 127) and lo
 * rounds the remainder (|lo| <= 127), so each activation is within dx / 2 of its value: 2^-8 of
 * the plain int8 error, for twice the dot products. */

#if AVX2_TILES
/* 32 int32 values within +-127 (4 vectors, in order) -> 32 bytes in order (the packs work within
 * 128-bit lanes: a permutation puts the 4-byte runs back in order). */
static inline __m256i pack_bytes(const __m256i *v) {
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

/* How a group's integer sums become a float contribution (tile_job.sums; tile_generic has each formula). */
enum {
    SUMS_TWO_PLANES = 0,         /* (254 sum u hi + sum u lo) d dx + m bx, bx = dx sum (254 hi + lo) */
    SUMS_ONE_PLANE = 1,          /* (sum u hi) d dx + m bx, bx = dx sum hi */
    SUMS_ONE_PLANE_SYMMETRIC = 2 /* (sum u hi - bx) d dx, bx = zero sum hi */
};

/* The smallest group maximum quantized as it is: below it the fine step amax / (127 x 254) would not be a
 * normal float, and 1 / step or 1 / fine overflow (NaN planes and sums, and every output of the row NaN).
 * A group that small is quantized as zeros: what it drops is below float32's resolution of any output
 * that has a normal-sized term. */
#define MIN_AMAX (127.0f * 254.0f * FLT_MIN)

/* Per group: step = amax / 127, fine = step / 254; hi = round(x / step), lo = round((x - hi step) / fine)
 * clamped to +-127; dx = fine, bx = the sum of the group's quantized activations, fine sum (254 hi + lo):
 * an integer of at most 32 x 32385 < 2^24, so every float order of the sum gives it exactly, and the
 * builds agree with one rounding of the product. One plane (sums SUMS_ONE_PLANE*): no lo (nothing reads
 * it), dx = step, and bx = step sum hi, or zero sum hi (an exact integer) for a symmetric weight. */
static void quantize_row(const float *x, int64_t k, int sums, float zero, int8_t *hi, int8_t *lo, float *dx,
                         float *bx) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        const float *xg = x + g * GROUP;
        float amax = 0.0f;
#ifdef HAVE_AVX512
        const __m512 x0 = _mm512_loadu_ps(xg), x1 = _mm512_loadu_ps(xg + 16);
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
#elif AVX2_TILES
        __m256 xv[4];
        __m256 mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            xv[j] = _mm256_loadu_ps(xg + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), xv[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
#else
        for (int i = 0; i < GROUP; i++) amax = fabsf(xg[i]) > amax ? fabsf(xg[i]) : amax;
#endif
        if (amax < MIN_AMAX) amax = 0.0f;   /* (a NaN stays, and makes the row's outputs NaN) */
        const float step = amax / 127.0f, fine = step / 254.0f;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, inv_fine = amax > 0.0f ? 1.0f / fine : 0.0f;
#ifdef HAVE_AVX512
        const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512 vinv = _mm512_set1_ps(inv), vstep = _mm512_set1_ps(step), vfine = _mm512_set1_ps(inv_fine);
        const __m512 top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
        __m512 planes = _mm512_setzero_ps();   /* 254 h + l (one plane: h), summed per lane */
        for (int half = 0; half < 2; half++) {
            const __m512 v = half ? x1 : x0;
            const __m512 h = _mm512_roundscale_ps(_mm512_mul_ps(v, vinv), round);
            _mm_storeu_si128((__m128i *)(hi + g * GROUP + 16 * half), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(h)));
            if (sums != SUMS_TWO_PLANES) {
                planes = _mm512_add_ps(planes, h);
                continue;
            }
            __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, _mm512_mul_ps(h, vstep)), vfine), round);
            l = _mm512_min_ps(_mm512_max_ps(l, bottom), top);
            planes = _mm512_add_ps(planes, _mm512_fmadd_ps(h, _mm512_set1_ps(254.0f), l));
            _mm_storeu_si128((__m128i *)(lo + g * GROUP + 16 * half), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(l)));
        }
        const float sum = _mm512_reduce_add_ps(planes);
#elif AVX2_TILES
        const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m256 vinv = _mm256_set1_ps(inv), vstep = _mm256_set1_ps(step), vfine = _mm256_set1_ps(inv_fine);
        __m256i hv[4], lv[4];
        __m256 planes = _mm256_setzero_ps();   /* 254 h + l (one plane: h), summed per lane */
        for (int j = 0; j < 4; j++) {
            const __m256 h = _mm256_round_ps(_mm256_mul_ps(xv[j], vinv), round);
            hv[j] = _mm256_cvtps_epi32(h);
            if (sums != SUMS_TWO_PLANES) {
                planes = _mm256_add_ps(planes, h);
                continue;
            }
            __m256 l = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(xv[j], _mm256_mul_ps(h, vstep)), vfine), round);
            l = _mm256_min_ps(_mm256_max_ps(l, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
            planes = _mm256_add_ps(planes, _mm256_fmadd_ps(h, _mm256_set1_ps(254.0f), l));
            lv[j] = _mm256_cvtps_epi32(l);
        }
        _mm256_storeu_si256((__m256i *)(hi + g * GROUP), pack_bytes(hv));
        if (sums == SUMS_TWO_PLANES) _mm256_storeu_si256((__m256i *)(lo + g * GROUP), pack_bytes(lv));
        const float sum = sum16_256(planes, _mm256_setzero_ps());   /* (exact in any order) */
#else
        float sum = 0.0f;
        for (int i = 0; i < GROUP; i++) {
            const float h = nearbyintf(xg[i] * inv);
            hi[g * GROUP + i] = (int8_t)h;
            if (sums != SUMS_TWO_PLANES) {
                sum += h;
                continue;
            }
            float l = nearbyintf((xg[i] - h * step) * inv_fine);
            l = l > 127.0f ? 127.0f : l < -127.0f ? -127.0f : l;
            lo[g * GROUP + i] = (int8_t)l;
            sum += 254.0f * h + l;
        }
#endif
        if (sums == SUMS_TWO_PLANES) {
            dx[g] = fine;
            bx[g] = fine * sum;
        } else {
            dx[g] = step;
            bx[g] = sums == SUMS_ONE_PLANE_SYMMETRIC ? zero * sum : step * sum;
        }
    }
}

/* ---- the unsigned value of (row r, input k) of a tile-group, from the packed bytes ---- */

static inline int weight_u(const uint8_t *tg, int bits, int r, int k) {
    if (bits == 8) return tg[(k / 4) * 64 + 4 * r + k % 4];
    const int c = k / 4, j = c % 4;
    const uint8_t b = tg[j * 64 + 4 * r + k % 4];
    return c < 4 ? b & 15 : b >> 4;
}

/* Offset m of (tile-group row) sg: stored, or -zero d (exact). */
static inline float group_offset(const uint16_t *d, const uint16_t *m, float zero, int64_t sg) {
    return m != NULL ? f16_to_f32(m[sg]) : -zero * f16_to_f32(d[sg]);
}

/* What every tile of one quant_matmul call shares. */
typedef struct {
    const uint8_t *w;
    const uint16_t *d, *m;          /* m NULL: symmetric, m = -zero d */
    float zero;
    int bits;
    int sums;                       /* SUMS_*: how a group's integer sums become floats */
    int64_t groups, k, n;           /* n: outputs, the row stride of y and residual */
    const int8_t *q;                /* per activation row: its hi plane [k], then its lo plane [k] */
    const float *dx, *bx;           /* per activation row: [groups] */
    const int16_t *x16;             /* AVX2 builds: per activation row, 254 hi + lo [k] */
    const float *residual;          /* or NULL */
    float *y;
} tile_job;

/* Reference (portable C) tile kernel: outputs [16t, 16t + nrows) of activation rows [i, i + mb). */
static void tile_generic(const tile_job *job, int64_t t, int64_t i0, int64_t mb, int nrows) {
    const int64_t groups = job->groups, k = job->k, gbytes = job->bits * GROUP * TILE / 8;
    for (int64_t i = i0; i < i0 + mb; i++) {
        float acc[TILE] = {0};
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *tg = job->w + (t * groups + g) * gbytes;
            const int8_t *hg = job->q + i * 2 * k + g * GROUP, *lg = hg + k;
            for (int r = 0; r < TILE; r++) {
                int32_t sh = 0, sl = 0;
                for (int kk = 0; kk < GROUP; kk++) {
                    sh += weight_u(tg, job->bits, r, kk) * hg[kk];
                    if (job->sums == SUMS_TWO_PLANES) sl += weight_u(tg, job->bits, r, kk) * lg[kk];
                }
                const int64_t sg = (t * groups + g) * TILE + r;
                const float scale = f16_to_f32(job->d[sg]) * job->dx[i * groups + g], bx = job->bx[i * groups + g];
                switch (job->sums) {
                case SUMS_TWO_PLANES:
                    acc[r] = fmaf(fmaf((float)sh, 254.0f, (float)sl), scale, acc[r]);
                    acc[r] = fmaf(group_offset(job->d, job->m, job->zero, sg), bx, acc[r]);
                    break;
                case SUMS_ONE_PLANE:
                    acc[r] = fmaf(f16_to_f32(job->m[sg]), bx, fmaf((float)sh, scale, acc[r]));
                    break;
                default:   /* SUMS_ONE_PLANE_SYMMETRIC */
                    acc[r] = fmaf((float)sh - bx, scale, acc[r]);
                }
            }
        }
        const int64_t at = i * job->n + t * TILE;
        for (int r = 0; r < nrows; r++)
            job->y[at + r] = job->residual != NULL ? acc[r] + job->residual[at + r] : acc[r];
    }
}

#ifdef HAVE_VNNI
/* acc + one activation row's group from its plane sums (hi, lo: an int32 per output; lo unused with one
 * plane): the float steps of the VNNI and AMX paths, in tile_generic's order (the same bits on every
 * path). SUMS (a SUMS_*, constant at the call site); mv unused for SUMS_ONE_PLANE_SYMMETRIC. */
static ALWAYS_INLINE __m512 add_group_sums(const int SUMS, __m512 acc, __m512i hi, __m512i lo, __m512 dv, __m512 mv,
                                           float dx, float bx) {
    const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(dx));
    if (SUMS == SUMS_ONE_PLANE_SYMMETRIC)
        return _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(bx)), scale, acc);
    if (SUMS == SUMS_ONE_PLANE)
        return _mm512_fmadd_ps(mv, _mm512_set1_ps(bx), _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), scale, acc));
    const __m512 s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(254.0f), _mm512_cvtepi32_ps(lo));
    return _mm512_fmadd_ps(mv, _mm512_set1_ps(bx), _mm512_fmadd_ps(s, scale, acc));
}

/* One activation row's contribution of one group to a tile's 16 outputs: acc + the group's sums
 * (16 dot products of 4 inputs each per plane; 4 independent chains; one plane: 8, 2 chains). */
static ALWAYS_INLINE __m512 row_group(const int SUMS, __m512 acc, const __m512i *u, const int8_t *qrow, int64_t k,
                                      __m512 dv, __m512 mv, float dx, float bx) {
    const int32_t *a = (const int32_t *)qrow, *b = (const int32_t *)(qrow + k);
    __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
    __m512i l0 = _mm512_setzero_si512(), l1 = _mm512_setzero_si512();
    for (int c = 0; c < 8; c += 2) {
        h0 = _mm512_dpbusd_epi32(h0, u[c], _mm512_set1_epi32(a[c]));
        if (SUMS == SUMS_TWO_PLANES) l0 = _mm512_dpbusd_epi32(l0, u[c], _mm512_set1_epi32(b[c]));
        h1 = _mm512_dpbusd_epi32(h1, u[c + 1], _mm512_set1_epi32(a[c + 1]));
        if (SUMS == SUMS_TWO_PLANES) l1 = _mm512_dpbusd_epi32(l1, u[c + 1], _mm512_set1_epi32(b[c + 1]));
    }
    return add_group_sums(SUMS, acc, _mm512_add_epi32(h0, h1), _mm512_add_epi32(l0, l1), dv, mv, dx, bx);
}

/* Row i of a tile's result, + residual, to y (mask: the tile's live outputs). */
static inline void store_tile_row(const tile_job *job, __m512 acc, int64_t i, int64_t t, __mmask16 mask) {
    const int64_t at = i * job->n + t * TILE;
    if (job->residual != NULL) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, job->residual + at));
    _mm512_mask_storeu_ps(job->y + at, mask, acc);
}

/* The same sums as tile_generic for MB (1 to 8, constant at the call site) activation rows at
 * once: the tile's weights are unpacked once per group and reused by every row. Each row's
 * accumulator is a variable of its own (not an array), which keeps all eight in registers; the rows
 * past MB compile away. */
static ALWAYS_INLINE void tile_vnni(const int MB, const int SUMS, const tile_job *job, int64_t t, int64_t i0,
                                    int nrows) {
    const int64_t groups = job->groups, k = job->k, gbytes = job->bits * GROUP * TILE / 8;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, acc4 = acc0, acc5 = acc0, acc6 = acc0,
           acc7 = acc0;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *tg = job->w + (t * groups + g) * gbytes;
        __m512i u[8];
        prefetch_ahead(tg, gbytes);   /* (a thread's tiles lie one after another in memory) */
        if (job->bits == 4) {
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512(tg + 64 * j);
                u[j] = _mm512_and_si512(v, low);
                u[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        } else {
            for (int c = 0; c < 8; c++) u[c] = _mm512_loadu_si512(tg + 64 * c);
        }
        const int64_t sg = (t * groups + g) * TILE;
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(job->d + sg)));
        const __m512 mv = SUMS == SUMS_ONE_PLANE_SYMMETRIC ? dv   /* (unused) */
                          : job->m != NULL ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(job->m + sg)))
                                           : _mm512_mul_ps(dv, _mm512_set1_ps(-job->zero));
        const int8_t *qg = job->q + i0 * 2 * k + g * GROUP;
        const float *dxg = job->dx + i0 * groups + g, *bxg = job->bx + i0 * groups + g;
        acc0 = row_group(SUMS, acc0, u, qg, k, dv, mv, dxg[0], bxg[0]);
        if (MB > 1) acc1 = row_group(SUMS, acc1, u, qg + 2 * k, k, dv, mv, dxg[groups], bxg[groups]);
        if (MB > 2) acc2 = row_group(SUMS, acc2, u, qg + 4 * k, k, dv, mv, dxg[2 * groups], bxg[2 * groups]);
        if (MB > 3) acc3 = row_group(SUMS, acc3, u, qg + 6 * k, k, dv, mv, dxg[3 * groups], bxg[3 * groups]);
        if (MB > 4) acc4 = row_group(SUMS, acc4, u, qg + 8 * k, k, dv, mv, dxg[4 * groups], bxg[4 * groups]);
        if (MB > 5) acc5 = row_group(SUMS, acc5, u, qg + 10 * k, k, dv, mv, dxg[5 * groups], bxg[5 * groups]);
        if (MB > 6) acc6 = row_group(SUMS, acc6, u, qg + 12 * k, k, dv, mv, dxg[6 * groups], bxg[6 * groups]);
        if (MB > 7) acc7 = row_group(SUMS, acc7, u, qg + 14 * k, k, dv, mv, dxg[7 * groups], bxg[7 * groups]);
    }
    const __mmask16 mask = (__mmask16)((1u << nrows) - 1);
    store_tile_row(job, acc0, i0, t, mask);
    if (MB > 1) store_tile_row(job, acc1, i0 + 1, t, mask);
    if (MB > 2) store_tile_row(job, acc2, i0 + 2, t, mask);
    if (MB > 3) store_tile_row(job, acc3, i0 + 3, t, mask);
    if (MB > 4) store_tile_row(job, acc4, i0 + 4, t, mask);
    if (MB > 5) store_tile_row(job, acc5, i0 + 5, t, mask);
    if (MB > 6) store_tile_row(job, acc6, i0 + 6, t, mask);
    if (MB > 7) store_tile_row(job, acc7, i0 + 7, t, mask);
}

/* A block of MB rows for rows_simd (below); FORM: the SUMS_* form. */
static ALWAYS_INLINE void simd_block(const int MB, const int FORM, const tile_job *job, int64_t t, int64_t i0,
                                     int nrows) {
    tile_vnni(MB, FORM, job, t, i0, nrows);
}
#endif

#ifdef HAVE_AMX
/* ---- AMX: up to 16 activation rows x one tile (16 outputs) per group, in tile registers ----
 * Per group, two tile products (TDPBSUD: signed activation bytes x unsigned weight bytes) give the
 * hi and lo plane sums of 16 rows x 16 outputs as int32, the same exact integers row_group forms
 * with VNNI; stored to memory, they are scaled and added by row_group's add_group_sums, so every
 * output is bit for bit the VNNI path's (and the generic path's). The packed tile
 * group of an 8-bit weight is already the B operand's layout (row c: inputs 4c..4c+3 of each of the
 * 16 outputs); a 4-bit one is unpacked into that layout first. What bounds this path is the tile
 * unit's work per group: each group's int32 sums need their own scales, so every group takes two
 * half-depth products (32 of a tile row's 64 bytes) and two tile stores. */

#define ARCH_REQ_XCOMP_PERM 0x1023   /* Linux arch_prctl: ask for a dynamically enabled xstate */
#define XFEATURE_XTILEDATA 18
/* Tile registers: 0 and 1 the activations' hi and lo planes, 2 the weight, 3 and 4 the hi and lo sums
 * (literal numbers where the intrinsics take them: gcc pastes them into the instruction's text). */

static int amx_usable;

/* Linux gives a process the tile registers' state only when asked (the state is 8 KB a thread on
 * every context switch); a kernel too old to know AMX refuses, and the VNNI path runs. Asked once,
 * when the library loads: the permission is the whole process's. */
__attribute__((constructor)) static void amx_request(void) {
    amx_usable = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* The tile shapes (palette 1): activations m rows (at most 16) x 32 bytes (one group), the weight
 * 8 rows x 64 bytes (4 inputs of 16 outputs a row), the sums m rows x 16 int32. Per thread: each
 * thread of a team loads it before its first tile instruction. */
static void amx_configure(int m) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    config.rows[0] = config.rows[1] = (uint8_t)m;
    config.colsb[0] = config.colsb[1] = GROUP;
    config.rows[2] = GROUP / 4;
    config.colsb[2] = 64;
    config.rows[3] = config.rows[4] = (uint8_t)m;
    config.colsb[3] = config.colsb[4] = 64;
    __asm__ volatile("" ::: "memory");   /* (gcc's intrinsic declares a read of the first 8 bytes only) */
    _tile_loadconfig(&config);
}

/* A 4-bit tile-group (4 vectors of nibble pairs) as the tile products' weight operand: 8 rows of
 * 64 bytes, row c inputs 4c..4c+3 of the 16 outputs (the 8-bit packing's layout). */
static inline void amx_unpack(const uint8_t *tg, uint8_t out[GROUP / 4][64]) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512(tg + 64 * j);
        _mm512_store_si512(out[j], _mm512_and_si512(v, low));
        _mm512_store_si512(out[j + 4], _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
}

/* The products of one group: the block's activation rows (from qg, the hi plane; the lo plane k bytes on)
 * x the group's weight operand w, to sums[0] (hi) and sums[1] (lo). gcc's tile load intrinsic does
 * not tell the compiler that it reads memory (nor, in some versions, the tile store that it writes):
 * hence the barriers. */
static inline void amx_group(const void *w, const int8_t *qg, int64_t k, int one_plane,
                             int32_t sums[2][16][TILE]) {
    __asm__ volatile("" ::: "memory");   /* w's unpacking is stored before the tile load reads it */
    _tile_loadd(2, w, 64);
    _tile_loadd(0, qg, 2 * k);
    _tile_zero(3);
    _tile_zero(4);
    _tile_dpbsud(3, 0, 2);
    if (!one_plane) {   /* (one plane: the lo sums stay zero, and add_group_sums ignores them) */
        _tile_loadd(1, qg + k, 2 * k);
        _tile_dpbsud(4, 1, 2);
    }
    _tile_stored(3, sums[0], 64);
    _tile_stored(4, sums[1], 64);
    __asm__ volatile("" ::: "memory");   /* and the sums are read after the tile stores wrote them */
}

/* Groups per batch of tile_amx. A load waits until an earlier store to its bytes has left the core
 * (neither a tile load nor a load of a tile store's bytes takes them from the store): so the tile
 * products of a batch's groups go first, then the float work of each; and a 4-bit weight's
 * groups are unpacked a batch ahead of their products. Issued right after their stores, each such
 * load stalled the core for a long part of the group's time. */
#define AMX_BATCH 4

/* The fewest activation rows a step runs on the tiles (all of them in one block). Fewer rows pay
 * the weight's loads and unpacking per row more than the tile products save: on
 * `scripts/kernel-ab.py matmul`, 7-8 rows ran at VNNI's speed, 10 at 1.09x, 12 at 1.17x, 14 at
 * 1.29x. */
#define AMX_MIN_ROWS 10

/* The float steps of group g's tile sums into the accumulators of rows [i0, i0 + m) (add_group_sums). */
static ALWAYS_INLINE void amx_add_group(const int SUMS, const tile_job *job, __m512 *acc, int32_t sums[2][16][TILE],
                                        int64_t t, int64_t g, int64_t i0, int m) {
    const int64_t groups = job->groups, sg = (t * groups + g) * TILE;
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(job->d + sg)));
    const __m512 mv = SUMS == SUMS_ONE_PLANE_SYMMETRIC ? dv   /* (unused) */
                      : job->m != NULL ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(job->m + sg)))
                                       : _mm512_mul_ps(dv, _mm512_set1_ps(-job->zero));
    const float *dxg = job->dx + i0 * groups + g, *bxg = job->bx + i0 * groups + g;
    #pragma GCC unroll 16
    for (int i = 0; i < 16 && i < m; i++)
        acc[i] = add_group_sums(SUMS, acc[i], _mm512_load_si512(sums[0][i]), _mm512_load_si512(sums[1][i]), dv, mv,
                                dxg[i * groups], bxg[i * groups]);
}

/* Activation rows [i0, i0 + m) against tile t, m the rows the tiles were configured for. */
static void tile_amx(const tile_job *job, int64_t t, int64_t i0, int nrows, int m) {
    const int64_t groups = job->groups, k = job->k, gbytes = job->bits * GROUP * TILE / 8;
    const uint8_t *tw = job->w + t * groups * gbytes;
    _Alignas(64) int32_t sums[AMX_BATCH][2][16][TILE];
    _Alignas(64) uint8_t unpacked[2][AMX_BATCH][GROUP / 4][64];   /* 4 bits: this batch's and the next */
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    if (job->bits == 4)
        for (int64_t g = 0; g < AMX_BATCH && g < groups; g++) amx_unpack(tw + g * gbytes, unpacked[0][g]);
    for (int64_t g0 = 0; g0 < groups; g0 += AMX_BATCH) {
        const int batch = groups - g0 < AMX_BATCH ? (int)(groups - g0) : AMX_BATCH, ring = (int)(g0 / AMX_BATCH) % 2;
        if (job->bits == 4)
            for (int64_t g = g0 + AMX_BATCH; g < g0 + 2 * AMX_BATCH && g < groups; g++)
                amx_unpack(tw + g * gbytes, unpacked[1 - ring][g - g0 - AMX_BATCH]);
        for (int b = 0; b < batch; b++) {
            const uint8_t *tg = tw + (g0 + b) * gbytes;
            prefetch_ahead(tg, gbytes);
            amx_group(job->bits == 4 ? (const void *)unpacked[ring][b] : tg, job->q + i0 * 2 * k + (g0 + b) * GROUP,
                      k, job->sums != SUMS_TWO_PLANES, sums[b]);
        }
        for (int b = 0; b < batch; b++) {
            switch (job->sums) {
            case SUMS_ONE_PLANE: amx_add_group(SUMS_ONE_PLANE, job, acc, sums[b], t, g0 + b, i0, m); break;
            case SUMS_ONE_PLANE_SYMMETRIC:
                amx_add_group(SUMS_ONE_PLANE_SYMMETRIC, job, acc, sums[b], t, g0 + b, i0, m);
                break;
            default: amx_add_group(SUMS_TWO_PLANES, job, acc, sums[b], t, g0 + b, i0, m);
            }
        }
    }
    const __mmask16 mask = (__mmask16)((1u << nrows) - 1);
    for (int i = 0; i < m; i++) store_tile_row(job, acc[i], i0 + i, t, mask);
}
#endif

#if AVX2_TILES
/* x16 = 254 hi + lo over a row of k: the two planes in one int16 plane, exactly (|x16| <= 32385); one
 * plane: x16 = hi. */
static inline void combine_planes(const int8_t *hi, const int8_t *lo, int64_t k, int one_plane, int16_t *x16) {
    for (int64_t i = 0; i < k; i += 16) {
        const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(hi + i)));
        if (one_plane) {
            _mm256_storeu_si256((__m256i *)(x16 + i), h);
            continue;
        }
        const __m256i l = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(lo + i)));
        _mm256_storeu_si256((__m256i *)(x16 + i), _mm256_add_epi16(_mm256_mullo_epi16(h, _mm256_set1_epi16(254)), l));
    }
}

/* Weights of 4 inputs of 8 rows (one 32-byte half of a tile vector, as 16-bit values: `a` rows 0, 1,
 * 4, 5 and `b` rows 2, 3, 6, 7, each lane of 32 bits a pair of inputs) against MB activation rows:
 * A[r] / B[r] += pair sums with those 4 inputs of row r's x16 (broadcast as one 64-bit value, so
 * lanes alternate between the pairs). */
static ALWAYS_INLINE void madd_rows(const int MB, __m256i *A, __m256i *B, __m256i a, __m256i b, const int16_t *x,
                                    int64_t k) {
    for (int r = 0; r < MB; r++) {
        const __m256i xv = _mm256_set1_epi64x(*(const int64_t *)(x + r * k));
        A[r] = _mm256_add_epi32(A[r], _mm256_madd_epi16(a, xv));
        B[r] = _mm256_add_epi32(B[r], _mm256_madd_epi16(b, xv));
    }
}

/* The AVX2 tiles' float steps, in tile_generic's order (one definition for both tile forms, so that
 * both give its bits): a half-tile group's scales d and offsets m (m = -zero d when not stored) ... */
static ALWAYS_INLINE __m256 group_scales_avx2(const tile_job *job, int64_t sg, __m256 *mv) {
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(job->d + sg)));
    *mv = job->m != NULL ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(job->m + sg)))
                         : _mm256_mul_ps(dv, _mm256_set1_ps(-job->zero));
    return dv;
}

/* ... an activation row's exact group sums (254 sh + sl per weight row, rows in order; one plane: sh)
 * into its accumulator (at: the row's group index into dx and bx) ... */
static ALWAYS_INLINE __m256 add_group_avx2(const tile_job *job, __m256 acc, __m256i sums, __m256 dv, __m256 mv,
                                           int64_t at) {
    const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(job->dx[at])), bx = _mm256_set1_ps(job->bx[at]);
    if (job->sums == SUMS_ONE_PLANE_SYMMETRIC)
        return _mm256_fmadd_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(sums), bx), scale, acc);
    return _mm256_fmadd_ps(mv, bx, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc));
}

/* ... and row i's 16 results (+ residual) to y. */
static ALWAYS_INLINE void store_row_avx2(const tile_job *job, const float *out, int64_t i, int64_t t, int nrows) {
    const int64_t at = i * job->n + t * TILE;
    for (int j = 0; j < nrows; j++) job->y[at + j] = job->residual != NULL ? out[j] + job->residual[at + j] : out[j];
}

/* The same sums as tile_generic on AVX2 (+ FMA, F16C) for MB (1 to 8, constant at the call site)
 * activation rows, one half of the tile (8 outputs) at a time. The activations are the two planes
 * combined, x16 = 254 hi + lo, and the weights are widened to 16 bits, so one madd (pairs of s16 x
 * s16 -> s32) takes both planes: sum_k u x16 = 254 sh + sl, exact in int32 (at most 32 x 255 x 32385).
 * Its conversion to float is tile_generic's fmaf((float)sh, 254, (float)sl) (one rounding of the same
 * integer), and the float steps follow in its order: the same bits. (One plane: x16 = hi, sh alone, no
 * faster.) */
static ALWAYS_INLINE void tile_avx2(const int MB, const tile_job *job, int64_t t, int64_t i0, int nrows) {
    const int64_t groups = job->groups, k = job->k, gbytes = job->bits * GROUP * TILE / 8;
    const __m256i zero = _mm256_setzero_si256(), low = _mm256_set1_epi16(15);
    float out[8][TILE];
    for (int h = 0; h < 2; h++) {
        __m256 acc[8];
        for (int r = 0; r < MB; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *tg = job->w + (t * groups + g) * gbytes + 32 * h;
            const int16_t *xg = job->x16 + i0 * k + g * GROUP;
            if (h == 0) prefetch_ahead(tg, gbytes);   /* (the second half reads the same lines) */
            __m256i A[8], B[8];
            for (int r = 0; r < MB; r++) A[r] = B[r] = zero;
            /* One input quad per iteration, at 4 bits too (each vector is loaded twice, once per nibble):
             * not unrolled, and not both nibbles in one iteration: given two quads' products at once, the
             * compiler hoists them all ahead of the sums and spills them. */
            if (job->bits == 4) {
#pragma GCC unroll 1
                for (int c = 0; c < 8; c++) {  /* inputs 4c..: vector c % 4, low nibbles for c < 4, else high */
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(tg + 64 * (c & 3)));
                    __m256i a = _mm256_unpacklo_epi8(v, zero), b = _mm256_unpackhi_epi8(v, zero);
                    if (c < 4) {
                        a = _mm256_and_si256(a, low);
                        b = _mm256_and_si256(b, low);
                    } else {
                        a = _mm256_srli_epi16(a, 4);
                        b = _mm256_srli_epi16(b, 4);
                    }
                    madd_rows(MB, A, B, a, b, xg + 4 * c, k);
                }
            } else {
#pragma GCC unroll 1
                for (int c = 0; c < 8; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(tg + 64 * c));
                    madd_rows(MB, A, B, _mm256_unpacklo_epi8(v, zero), _mm256_unpackhi_epi8(v, zero), xg + 4 * c, k);
                }
            }
            __m256 mv;
            const __m256 dv = group_scales_avx2(job, (t * groups + g) * TILE + 8 * h, &mv);
            for (int r = 0; r < MB; r++)   /* (hadd: rows 0..7 in order) */
                acc[r] = add_group_avx2(job, acc[r], _mm256_hadd_epi32(A[r], B[r]), dv, mv, (i0 + r) * groups + g);
        }
        for (int r = 0; r < MB; r++) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);
    }
    for (int r = 0; r < MB; r++) store_row_avx2(job, out[r], i0 + r, t, nrows);
}

/* 4-bit weights with less work per weight byte than tile_avx2: the nibbles stay bytes and vpmaddubsw
 * multiplies them by an int8 plane (u8 x s8, 32 products at once), whose pair sums (at most 2 x 15 x
 * 127) add up over the group's 8 input quads in int16 without overflow (8 x 3810 < 2^15); a madd by 1
 * (by 254 for the hi plane of two) then gives each weight row's exact integer in row order (no hadd),
 * and the same float steps. With two planes only for one activation row (a batch-1 decode step, where
 * the row's arithmetic competes with the weights' read: 254 sh + sl from both planes' products); with
 * one plane (int8 activations, llama.cpp's products) for MB rows (1 to 8, constant at the call site). */
static ALWAYS_INLINE void tile_avx2_nibbles(const int MB, const tile_job *job, int64_t t, int64_t i0, int nrows) {
    const int64_t groups = job->groups, k = job->k, gbytes = 4 * GROUP * TILE / 8;
    const __m256i low = _mm256_set1_epi8(15), w254 = _mm256_set1_epi16(254), ones = _mm256_set1_epi16(1);
    const int two = job->sums == SUMS_TWO_PLANES;   /* (then MB is 1) */
    float out[8][TILE];
    for (int h = 0; h < 2; h++) {
        __m256 acc[8];
        for (int r = 0; r < MB; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *tg = job->w + (t * groups + g) * gbytes + 32 * h;
            if (h == 0) prefetch_ahead(tg, gbytes);
            const int8_t *qg = job->q + i0 * 2 * k + g * GROUP;   /* row r's hi plane at 2 k r, lo k after */
            __m256i sh[8], sl = _mm256_setzero_si256();
            for (int r = 0; r < MB; r++) sh[r] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {  /* inputs 4j.. in the low nibbles, 16 + 4j.. in the high */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(tg + 64 * j));
                const __m256i lo4 = _mm256_and_si256(v, low), hi4 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (int r = 0; r < MB; r++) {
                    const int32_t *hq = (const int32_t *)(qg + 2 * k * r);
                    sh[r] = _mm256_add_epi16(sh[r], _mm256_maddubs_epi16(lo4, _mm256_set1_epi32(hq[j])));
                    sh[r] = _mm256_add_epi16(sh[r], _mm256_maddubs_epi16(hi4, _mm256_set1_epi32(hq[4 + j])));
                }
                if (two) {
                    const int32_t *lq = (const int32_t *)(qg + k);
                    sl = _mm256_add_epi16(sl, _mm256_maddubs_epi16(lo4, _mm256_set1_epi32(lq[j])));
                    sl = _mm256_add_epi16(sl, _mm256_maddubs_epi16(hi4, _mm256_set1_epi32(lq[4 + j])));
                }
            }
            __m256 mv;
            const __m256 dv = group_scales_avx2(job, (t * groups + g) * TILE + 8 * h, &mv);
            for (int r = 0; r < MB; r++) {
                const __m256i sums = two ? _mm256_add_epi32(_mm256_madd_epi16(sh[r], w254), _mm256_madd_epi16(sl, ones))
                                         : _mm256_madd_epi16(sh[r], ones);
                acc[r] = add_group_avx2(job, acc[r], sums, dv, mv, (i0 + r) * groups + g);
            }
        }
        for (int r = 0; r < MB; r++) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);
    }
    for (int r = 0; r < MB; r++) store_row_avx2(job, out[r], i0 + r, t, nrows);
}

/* A block of MB rows for rows_simd (below): a 4-bit weight takes the nibble products with one plane
 * (FORM 1) and for a lone row; everything else tile_avx2's. */
static ALWAYS_INLINE void simd_block(const int MB, const int FORM, const tile_job *job, int64_t t, int64_t i0,
                                     int nrows) {
    if (FORM || (MB == 1 && job->bits == 4)) tile_avx2_nibbles(MB, job, t, i0, nrows);
    else tile_avx2(MB, job, t, i0, nrows);
}
#endif

#if SIMD_TILES
/* Activation rows [i, end) against tile t, 8 at a time and the rest in one pass of the build's
 * simd_block (MB constant at each call): every pass unpacks the tile's weights again, which at a few
 * rows (a speculative step's k + 1, a small batch) costs about as much as the rows' products, so 5
 * rows are one pass, not 4 + 1. */
static ALWAYS_INLINE void rows_simd(const int FORM, const tile_job *job, int64_t t, int64_t i, int64_t end,
                                    int nrows) {
    for (; end - i >= 8; i += 8) simd_block(8, FORM, job, t, i, nrows);
    switch (end - i) {
    case 7: simd_block(7, FORM, job, t, i, nrows); break;
    case 6: simd_block(6, FORM, job, t, i, nrows); break;
    case 5: simd_block(5, FORM, job, t, i, nrows); break;
    case 4: simd_block(4, FORM, job, t, i, nrows); break;
    case 3: simd_block(3, FORM, job, t, i, nrows); break;
    case 2: simd_block(2, FORM, job, t, i, nrows); break;
    case 1: simd_block(1, FORM, job, t, i, nrows); break;
    default: break;
    }
}

/* Kept out of line: the caller's loops and these register-hungry bodies are allocated apart. Each form
 * a compile-time constant: VNNI's three SUMS_* forms; AVX2's nibble products (1) or not (0). */
__attribute__((noinline)) static void tile_rows_simd(const tile_job *job, int64_t t, int64_t i, int64_t end,
                                                     int nrows) {
#ifdef HAVE_VNNI
    switch (job->sums) {
    case SUMS_ONE_PLANE: rows_simd(SUMS_ONE_PLANE, job, t, i, end, nrows); break;
    case SUMS_ONE_PLANE_SYMMETRIC: rows_simd(SUMS_ONE_PLANE_SYMMETRIC, job, t, i, end, nrows); break;
    default: rows_simd(SUMS_TWO_PLANES, job, t, i, end, nrows);
    }
#else
    if (job->bits == 4 && job->sums != SUMS_TWO_PLANES) rows_simd(1, job, t, i, end, nrows);
    else rows_simd(0, job, t, i, end, nrows);
#endif
}
#endif

#define MBLOCK 8
#define ROW_CHUNK 64

int matmul_scratch_alloc(tm_matmul_scratch *s, int64_t rows, int64_t k, int kinds) {
    const size_t n = (size_t)(rows * k > 0 ? rows * k : 1), groups = (size_t)(rows * (k / GROUP) + 1);
    const int quant = (kinds & TM_SCRATCH_QUANT) != 0, fused = (kinds & TM_SCRATCH_FUSED) != 0,
              dense = (kinds & TM_SCRATCH_DENSE) != 0;
    *s = (tm_matmul_scratch){
        .q = quant ? aligned_alloc(64, (2 * n + 63) / 64 * 64) : NULL,
        .dx = quant ? malloc(sizeof(float) * groups) : NULL, .bx = quant ? malloc(sizeof(float) * groups) : NULL,
        .x16 = quant && AVX2_TILES ? malloc(sizeof(int16_t) * n) : NULL,
        .rows = fused ? malloc(sizeof(float) * n) : NULL,
        .xp = dense ? aligned_alloc(64, (sizeof(float) * n + 63) / 64 * 64) : NULL};
    if ((quant && (s->q == NULL || s->dx == NULL || s->bx == NULL || (AVX2_TILES && s->x16 == NULL)))
        || (fused && s->rows == NULL) || (dense && s->xp == NULL)) {
        matmul_scratch_free(s);
        return 1;
    }
    return 0;
}

void matmul_scratch_free(tm_matmul_scratch *s) {
    free(s->q); free(s->dx); free(s->bx); free(s->x16); free(s->rows); free(s->xp);
    *s = (tm_matmul_scratch){0};
}

void quant_matmul_team(const float *x, int64_t mrows, const tm_weight *weight, int gated, const float *norm_w,
                       float eps, const float *residual, float *y, int generic, const tm_matmul_scratch *s) {
    const int64_t k = weight->in_features, n = weight->out_features;
    const int64_t groups = k / GROUP, tiles = (n + TILE - 1) / TILE, ldx = gated ? 2 * k : k;
    const int fused = gated || norm_w != NULL;
    const int sums = !weight->int8_activations ? SUMS_TWO_PLANES
                     : weight->offsets != NULL ? SUMS_ONE_PLANE : SUMS_ONE_PLANE_SYMMETRIC;
    /* each thread's own copy, on its own stack: no cache line shared with another thread's spills */
    const tile_job job = {weight->packed, weight->scales, weight->offsets, (float)weight->zero, (int)weight->bits,
                          sums, groups, k, n, s->q, s->dx, s->bx, s->x16, residual, y};
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < mrows; i++) {
        const float *row = prepare_row(x + i * ldx, k, gated, norm_w, eps, fused ? s->rows + i * k : NULL, generic);
        quantize_row(row, k, sums, job.zero, s->q + 2 * i * k, s->q + 2 * i * k + k, s->dx + i * groups,
                     s->bx + i * groups);
#if AVX2_TILES
        combine_planes(s->q + 2 * i * k, s->q + 2 * i * k + k, k, sums != SUMS_TWO_PLANES, s->x16 + i * k);
#endif
    }
    /* Rows in chunks of ROW_CHUNK, whose quantized activations stay in L2 while every tile of the
     * weight passes over them (a prefill chunk's rows would not). */
    int64_t block = MBLOCK;   /* rows a work item takes */
#ifdef HAVE_AMX
    /* the tiles take blocks of 16 rows, or all the rows of a step of AMX_MIN_ROWS to 15 (a chunk's
     * shorter last block goes to VNNI) */
    const int amx = !generic && amx_usable && mrows >= AMX_MIN_ROWS, amx_rows = mrows < 16 ? (int)mrows : 16;
    if (amx) {
        amx_configure(amx_rows);
        block = amx_rows;
    }
#endif
    for (int64_t first = 0; first < mrows; first += ROW_CHUNK) {
        const int64_t last = first + ROW_CHUNK < mrows ? first + ROW_CHUNK : mrows;
        const int64_t blocks = (last - first + block - 1) / block;
        #pragma omp for collapse(2) schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            for (int64_t b = 0; b < blocks; b++) {
                const int nrows = (int)(n - t * TILE < TILE ? n - t * TILE : TILE);
                const int64_t i = first + b * block, end = i + block < last ? i + block : last;
#ifdef HAVE_AMX
                if (amx && end - i == amx_rows) {
                    tile_amx(&job, t, i, nrows, amx_rows);
                    continue;
                }
#endif
#if SIMD_TILES
                if (!generic) {
                    tile_rows_simd(&job, t, i, end, nrows);
                    continue;
                }
#endif
                tile_generic(&job, t, i, end - i, nrows);
            }
        }
    }
#ifdef HAVE_AMX
    if (amx) _tile_release();   /* (a thread holding tile state saves 8 KB more at each switch) */
#endif
}

/* y [M, N] fp32 = f(x) @ W^T (+ residual [M, N] when not NULL), f the fused input ops of
 * prepare_row (x is [M, 2K] when gated, else [M, K]; gated is a TM_GATE_*). K is a multiple of 32; W has ceil(N / 16)
 * tiles. generic = 1 forces the portable path (the reference the tests hold the SIMD path to).
 * Returns 1 if out of memory. */
int quant_matmul(const float *x, int64_t mrows, const tm_weight *weight, int gated, const float *norm_w, float eps,
                 const float *residual, float *y, int generic, int num_threads) {
    const int64_t k = weight->in_features, n = weight->out_features;
    tm_matmul_scratch s;
    if (matmul_scratch_alloc(&s, mrows, k, TM_SCRATCH_QUANT | (gated || norm_w != NULL ? TM_SCRATCH_FUSED : 0)))
        return 1;
    #pragma omp parallel num_threads(num_threads) if (mrows * n * k > (1 << 18))
    quant_matmul_team(x, mrows, weight, gated, norm_w, eps, residual, y, generic, &s);
    matmul_scratch_free(&s);
    return 0;
}

int quant_matmul_has_simd(void) {
#ifdef HAVE_VNNI
    return 1;
#else
    return 0;
#endif
}

int quant_matmul_has_amx(void) {
#ifdef HAVE_AMX
    return amx_usable;
#else
    return 0;
#endif
}

/* out [len(ids), K] fp32: rows `ids` of W, dequantized (embedding lookups, exact logits). */
void quant_rows(const tm_weight *weight, const int64_t *ids, int64_t count, float *out) {
    const uint8_t *w = weight->packed;
    const uint16_t *d = weight->scales;
    const int64_t k = weight->in_features, groups = k / GROUP;
    const int bits = (int)weight->bits, gbytes = bits * GROUP * TILE / 8;
    for (int64_t i = 0; i < count; i++) {
        const int64_t t = ids[i] / TILE;
        const int r = (int)(ids[i] % TILE);
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *tg = w + (t * groups + g) * gbytes;
            const int64_t sg = (t * groups + g) * TILE + r;
            const float scale = f16_to_f32(d[sg]), offset = group_offset(d, weight->offsets, (float)weight->zero, sg);
            for (int kk = 0; kk < GROUP; kk++)
                out[i * k + g * GROUP + kk] = fmaf(scale, (float)weight_u(tg, bits, r, kk), offset);
        }
    }
}

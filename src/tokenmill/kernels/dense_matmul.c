/* y = f(x) W^T (+ residual) for a dense bfloat16 weight and a few float32 activation rows (decode
 * steps of a bf16 model, in its layers or in decode_stack, and its LM head): PyTorch's bf16 matmul
 * does these skinny products far below the memory's rate, while each weight is read once and used by
 * at most a few rows, so the product is bound by the weight's bytes.
 *
 * x [m, k] fp32 ([m, 2k] when gated), w [n, k] bf16 (row-major), y [m, n] fp32: y[i][j] = sum_c
 * f(x)[i][c] w[j][c] (+ residual[i][j]), the products exact in fp32 (a bf16 value is an fp32 value)
 * and summed in fp32; f: the fused input ops of rows.h, as quant_matmul's.
 *
 * SIMD (simd.h's vf: AVX-512 or AVX2; k a multiple of 2 VW): each 2 VW weights of a row come from one
 * load as two vectors, their even and odd elements (simd.h's bf16_pair: attention.h's row order), so
 * the activation rows are permuted to that order once per call; 4 weight rows x up to MB activation
 * rows are independent FMA chains. Output rows are split across threads. Portable C loops elsewhere
 * (and as the tests' reference): a scalar loop, several times slower than PyTorch's bf16 matmul. */
#include <stdlib.h>

#include "kernels.h"
#include "rows.h"
#include "simd.h"

#define NB 4   /* weight rows per block */
/* activation rows per block: AVX-512's 32 registers hold 4 x 4 accumulators; AVX2's 16 hold 2 x 4,
 * the rows' 4 vectors and a weight's 2 */
#if defined(HAVE_VF) && VW == 8
#define MB 2
#else
#define MB 4
#endif

static void dense_generic(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, const float *residual,
                          float *y) {
    #pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < m; i++) {
            float acc = 0.0f;
            for (int64_t c = 0; c < k; c++) {
                union { uint32_t u; float f; } v = {(uint32_t)w[j * k + c] << 16};
                acc += x[i * k + c] * v.f;
            }
            y[i * n + j] = residual != NULL ? acc + residual[i * n + j] : acc;
        }
}

#ifdef HAVE_VF
/* Rows [i0, i0 + MR) of x (permuted: xp) against weight rows [j0, j0 + NR) (MR, NR constant at the
 * call site, so the MR x NR accumulators stay in registers). */
static ALWAYS_INLINE void dense_block(const int MR, const int NR, const float *xp, int64_t k, const uint16_t *w,
                                      int64_t n, const float *residual, float *y, int64_t i0, int64_t j0) {
    vf acc[MB][NB];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = vf_set1(0.0f);
    for (int64_t c = 0; c < k; c += 2 * VW) {
        vf xe[MB], xo[MB];
        for (int i = 0; i < MR; i++) {
            xe[i] = vf_loadu(xp + (i0 + i) * k + c);
            xo[i] = vf_loadu(xp + (i0 + i) * k + c + VW);
        }
        for (int j = 0; j < NR; j++) {
            prefetch_ahead(w + (j0 + j) * k + c, 4 * VW);   /* (a thread's rows lie one after another in memory) */
            vf even, odd;
            bf16_pair(w + (j0 + j) * k + c, &even, &odd);
            for (int i = 0; i < MR; i++) acc[i][j] = vf_fmadd(xo[i], odd, vf_fmadd(xe[i], even, acc[i][j]));
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            const int64_t at = (i0 + i) * n + j0 + j;
            const float sum = vf_reduce_add(acc[i][j]);
            y[at] = residual != NULL ? sum + residual[at] : sum;
        }
}

static ALWAYS_INLINE void dense_rows(const int MR, const float *xp, int64_t k, const uint16_t *w, int64_t n,
                                     const float *residual, float *y, int64_t i0, int64_t j0) {
    switch (n - j0 < NB ? n - j0 : NB) {
        case 1: dense_block(MR, 1, xp, k, w, n, residual, y, i0, j0); break;
        case 2: dense_block(MR, 2, xp, k, w, n, residual, y, i0, j0); break;
        case 3: dense_block(MR, 3, xp, k, w, n, residual, y, i0, j0); break;
        default: dense_block(MR, NB, xp, k, w, n, residual, y, i0, j0); break;
    }
}

/* x's rows are already prepared (f applied); xp: scratch [m, k], 64-byte aligned. */
static void dense_simd(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, const float *residual,
                       float *y, float *xp) {
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < m; i++)   /* x in the weights' even/odd order */
        for (int64_t c = 0; c < k; c += 2 * VW)
            for (int64_t e = 0; e < VW; e++) {
                xp[i * k + c + e] = x[i * k + c + 2 * e];
                xp[i * k + c + VW + e] = x[i * k + c + 2 * e + 1];
            }
    #pragma omp for schedule(static)
    for (int64_t jb = 0; jb < (n + NB - 1) / NB; jb++)
        for (int64_t i0 = 0; i0 < m; i0 += MB) {
#if MB == 4
            switch (m - i0 < MB ? m - i0 : MB) {
                case 1: dense_rows(1, xp, k, w, n, residual, y, i0, jb * NB); break;
                case 2: dense_rows(2, xp, k, w, n, residual, y, i0, jb * NB); break;
                case 3: dense_rows(3, xp, k, w, n, residual, y, i0, jb * NB); break;
                default: dense_rows(MB, xp, k, w, n, residual, y, i0, jb * NB); break;
            }
#else
            if (m - i0 == 1) dense_rows(1, xp, k, w, n, residual, y, i0, jb * NB);
            else dense_rows(MB, xp, k, w, n, residual, y, i0, jb * NB);
#endif
        }
}
#endif

void bf16_matmul_team(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, int gated,
                      const float *norm_w, float eps, const float *residual, float *y, int generic,
                      const tm_matmul_scratch *s) {
    const int fused = gated || norm_w != NULL;
    const int64_t ldx = gated ? 2 * k : k;
#ifdef HAVE_VF
    const int simd = !generic && k % (2 * VW) == 0;
#else
    const int simd = 0;
#endif
    if (fused) {   /* f(x) contiguous [m, k] in the scratch's rows */
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) prepare_row(x + i * ldx, k, gated, norm_w, eps, s->rows + i * k, generic);
    }
    const float *in = fused ? s->rows : x;
#ifdef HAVE_VF
    if (simd) {
        dense_simd(in, m, k, w, n, residual, y, s->xp);
        return;
    }
#endif
    (void)simd;
    dense_generic(in, m, k, w, n, residual, y);
}

int bf16_matmul(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, int gated, const float *norm_w,
                float eps, const float *residual, float *y, int generic, int num_threads) {
    tm_matmul_scratch s;
    if (matmul_scratch_alloc(&s, m, k, TM_SCRATCH_DENSE | (gated || norm_w != NULL ? TM_SCRATCH_FUSED : 0)))
        return 1;
    #pragma omp parallel num_threads(num_threads) if (m * n * k > (1 << 18))
    bf16_matmul_team(x, m, k, w, n, gated, norm_w, eps, residual, y, generic, &s);
    matmul_scratch_free(&s);
    return 0;
}

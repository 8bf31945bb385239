/* The fused input ops of a matmul's activation rows (quant_matmul.c, dense_matmul.c): a row of the
 * layer's input before it is multiplied.
 * gated (TM_GATE_*): the row is a fused [gate | up] projection of 2k values -> act(gate) * up, act
 * SiLU (SwiGLU) or GELU with the tanh approximation (GeGLU; PyTorch's gelu(approximate="tanh"));
 * norm_w: RMSNorm with weight norm_w (norm.h: the same bits as the standalone rms_norm).
 * One definition, so that a row is prepared to the same bits whichever weight type it meets. */

#ifndef TOKENMILL_ROWS_H
#define TOKENMILL_ROWS_H

#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "norm.h"
#include "simd.h"

/* gelu_tanh(x) = x / 2 (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) */
#define GELU_BETA 0.7978845608028654f
#define GELU_KAPPA 0.044715f

static inline void gate_row(const float *x, int64_t k, int gated, float *out) {
    int64_t i = 0;
#ifdef HAVE_AVX512
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= k; i += 16) {  /* a vectorized exp / tanh: this runs for every prefill row */
        const __m512 g = _mm512_loadu_ps(x + i);
        __m512 act;
        if (gated == TM_GATE_SILU) {
            act = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        } else {
            const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
            const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(GELU_BETA),
                                               _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(GELU_KAPPA), cube)));
            act = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, tanh512(inner)));
        }
        _mm512_storeu_ps(out + i, _mm512_mul_ps(act, _mm512_loadu_ps(x + k + i)));
    }
#elif defined(HAVE_AVX2)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= k; i += 8) {  /* the same steps on 8 lanes */
        const __m256 g = _mm256_loadu_ps(x + i);
        __m256 act;
        if (gated == TM_GATE_SILU) {
            act = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        } else {
            const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
            const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(GELU_BETA),
                                               _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(GELU_KAPPA), cube)));
            act = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, tanh256(inner)));
        }
        _mm256_storeu_ps(out + i, _mm256_mul_ps(act, _mm256_loadu_ps(x + k + i)));
    }
#endif
    for (; i < k; i++) {
        const float g = x[i];
        const float act = gated == TM_GATE_SILU ? g / (1.0f + expf(-g))
                                                : 0.5f * g * (1.0f + tanhf(GELU_BETA * (g + GELU_KAPPA * (g * g * g))));
        out[i] = act * x[k + i];
    }
}

/* The row x after the fused ops (x itself when there are none, else tmp [k], which receives it). */
static inline const float *prepare_row(const float *x, int64_t k, int gated, const float *norm_w, float eps,
                                       float *tmp, int generic) {
    const float *src = x;
    if (gated) {
        gate_row(x, k, gated, tmp);
        src = tmp;
    }
    if (norm_w != NULL) {
        rms_norm_row(src, k, norm_w, eps, tmp, generic);
        src = tmp;
    }
    return src;
}

#endif

/* RMSNorm, the one definition every kernel uses: the quantized matmul's fused input norm
 * (quant_matmul.c), the per-head q/k norms of the fused rotary decode (paged_decode.c), the decode
 * stack's sandwich norms (kernels.c) and the exported rms_norm (norm.c), which layers/norm.py RMSNorm
 * runs for float32 CPU tensors. So a row is normed to the same bits on every path: the decode stack
 * or the layer loop, a decode-only step or a mixed one.
 *
 *   out = x * r * w,  r = 1 / sqrt(sum(x^2) / n + eps)
 *
 * in float32, the sum of squares in sum16's fixed order (simd.h: the portable and AVX-512 builds
 * agree bit for bit), the products rounded left to right, as PyTorch's reference computes
 * w * (x * r). */
#ifndef TOKENMILL_NORM_H
#define TOKENMILL_NORM_H

#include <math.h>
#include <stdint.h>

#include "simd.h"

/* One row x [n] (any n) -> out [n] (out may be x); generic = 1 forces the portable sum. */
static inline void rms_norm_row(const float *x, int64_t n, const float *w, float eps, float *out, int generic) {
#ifdef HAVE_AVX512
    const float squares = generic ? sum16(x, n, 1) : sum16_avx512(x, n, 1);
#elif defined(HAVE_AVX2)
    const float squares = generic ? sum16(x, n, 1) : sum16_avx2(x, n, 1);
#else
    (void)generic;
    const float squares = sum16(x, n, 1);
#endif
    const float r = 1.0f / sqrtf(squares / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

#endif

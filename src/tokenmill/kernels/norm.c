/* rms_norm: RMSNorm over rows (norm.h), for layers/norm.py. */
#include "kernels.h"
#include "norm.h"

void rms_norm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *out, int generic,
              int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n > (1 << 16))
    for (int64_t i = 0; i < rows; i++) rms_norm_row(x + i * n, n, w, eps, out + i * n, generic);
}

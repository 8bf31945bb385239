/* Single-query (decode) attention over a paged KV cache, for CPUs.
 *
 * One task per (request, kv head): its `group` query heads share every K/V row the task reads,
 * so each cached byte is read once per step. Pass 1 scores the request's tokens block by block
 * (straight from the cache: no gather, no padding to the longest request), pass 2 takes the
 * softmax and accumulates V. All arithmetic is fp32; K/V are fp32 or bf16.
 *
 * Layouts (row-major, contiguous):
 *   q, out        [batch, heads, head_dim] fp32
 *   k, v          [num_blocks, block_size, kv_heads, head_dim] (one layer's cache)
 *   block_tables  [batch, max_blocks] int64;  seq_lens [batch] int64
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float load_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }

static inline float load_bf16(const void *p, int64_t i) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((const uint16_t *)p)[i] << 16;
    return c.f;
}

#define DEFINE_PAGED_DECODE(NAME, LOAD)                                                          \
int NAME(const float *q, const void *k, const void *v, const int64_t *block_tables,              \
         int64_t max_blocks, const int64_t *seq_lens, float *out, int64_t batch, int64_t heads,   \
         int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, int num_threads) { \
    const int64_t group = heads / kv_heads;                                                      \
    int failed = 0;                                                                              \
    _Pragma("omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)")           \
    for (int64_t b = 0; b < batch; b++) {                                                        \
        for (int64_t kh = 0; kh < kv_heads; kh++) {                                              \
            const int64_t len = seq_lens[b];                                                     \
            const int64_t *table = block_tables + b * max_blocks;                                \
            const float *qh = q + (b * heads + kh * group) * head_dim;                           \
            float *oh = out + (b * heads + kh * group) * head_dim;                               \
            float *scores = malloc(sizeof(float) * (size_t)(len > 0 ? len * group : 1));         \
            if (scores == NULL) { failed = 1; continue; }                                        \
            for (int64_t t = 0; t < len; t++) {                                                  \
                const int64_t row = ((table[t / block_size] * block_size + t % block_size)       \
                                     * kv_heads + kh) * head_dim;                                \
                for (int64_t g = 0; g < group; g++) {                                            \
                    const float *qg = qh + g * head_dim;                                         \
                    float s = 0.0f;                                                              \
                    _Pragma("omp simd reduction(+:s)")                                           \
                    for (int64_t d = 0; d < head_dim; d++) s += qg[d] * LOAD(k, row + d);       \
                    scores[g * len + t] = s * scale;                                             \
                }                                                                                \
            }                                                                                    \
            for (int64_t g = 0; g < group; g++) {                                                \
                float *sg = scores + g * len;                                                    \
                float m = -INFINITY, total = 0.0f;                                               \
                for (int64_t t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;                     \
                for (int64_t t = 0; t < len; t++) { sg[t] = expf(sg[t] - m); total += sg[t]; }   \
                const float inv = total > 0.0f ? 1.0f / total : 0.0f;                            \
                for (int64_t t = 0; t < len; t++) sg[t] *= inv;                                  \
                memset(oh + g * head_dim, 0, sizeof(float) * (size_t)head_dim);                  \
            }                                                                                    \
            for (int64_t t = 0; t < len; t++) {                                                  \
                const int64_t row = ((table[t / block_size] * block_size + t % block_size)       \
                                     * kv_heads + kh) * head_dim;                                \
                for (int64_t g = 0; g < group; g++) {                                            \
                    const float p = scores[g * len + t];                                         \
                    float *og = oh + g * head_dim;                                               \
                    _Pragma("omp simd")                                                          \
                    for (int64_t d = 0; d < head_dim; d++) og[d] += p * LOAD(v, row + d);        \
                }                                                                                \
            }                                                                                    \
            free(scores);                                                                        \
        }                                                                                        \
    }                                                                                            \
    return failed;                                                                               \
}

DEFINE_PAGED_DECODE(paged_decode_f32, load_f32)
DEFINE_PAGED_DECODE(paged_decode_bf16, load_bf16)

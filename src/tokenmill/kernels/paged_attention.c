/* Single-query (decode) attention over a paged KV cache, for CPUs.
 *
 * One task per (request, kv head): its `group` query heads share every K/V row the task reads,
 * so each cached byte is read once per step. Pass 1 scores the request's tokens block by block
 * (straight from the cache: no gather, no padding to the longest request), pass 2 takes the
 * softmax and accumulates V. All arithmetic is fp32; K/V are fp32 or bf16.
 *
 * Two implementations of the same passes: AVX-512 (head_dim a multiple of 16: 16 dims per
 * instruction, a vectorized exp, the V sums in registers) and portable C loops (everything else,
 * and the tests' reference; `generic` forces it).
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

/* Token t of the task's request and the offset `row` of its (kv head kh) K/V vector in the cache,
 * block by block (no division per token). Needs table, len, block_size, kv_heads, kh, head_dim. */
#define FOR_EACH_TOKEN(t, row)                                                                   \
    for (int64_t blk_ = 0, t = 0; t < len; blk_++) {                                             \
        const int64_t base_ = table[blk_] * block_size;                                          \
        for (int64_t s_ = 0; s_ < block_size && t < len; s_++, t++) {                            \
            const int64_t row = ((base_ + s_) * kv_heads + kh) * head_dim;
#define END_EACH_TOKEN }}

#define DECODE_FN(NAME)                                                                          \
static int NAME(const float *q, const void *k, const void *v, const int64_t *block_tables,       \
                int64_t max_blocks, const int64_t *seq_lens, float *out, int64_t batch,          \
                int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,           \
                float scale, int num_threads)

/* The (request b, kv head kh) tasks in parallel, each with its len, block table, q and out heads. */
#define FOR_EACH_TASK                                                                            \
    _Pragma("omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)")           \
    for (int64_t b = 0; b < batch; b++) {                                                        \
        for (int64_t kh = 0; kh < kv_heads; kh++) {                                              \
            const int64_t len = seq_lens[b];                                                     \
            const int64_t *table = block_tables + b * max_blocks;                                \
            const float *qh = q + (b * heads + kh * group) * head_dim;                           \
            float *oh = out + (b * heads + kh * group) * head_dim;

#define DEFINE_GENERIC_DECODE(NAME, LOAD)                                                          \
DECODE_FN(NAME) {                                                                                \
    const int64_t group = heads / kv_heads;                                                      \
    int failed = 0;                                                                              \
    FOR_EACH_TASK                                                                                \
            float *scores = malloc(sizeof(float) * (size_t)(len > 0 ? len * group : 1));         \
            if (scores == NULL) { failed = 1; continue; }                                        \
            FOR_EACH_TOKEN(t, row) {                                                             \
                for (int64_t g = 0; g < group; g++) {                                            \
                    const float *qg = qh + g * head_dim;                                         \
                    float s = 0.0f;                                                              \
                    _Pragma("omp simd reduction(+:s)")                                           \
                    for (int64_t d = 0; d < head_dim; d++) s += qg[d] * LOAD(k, row + d);       \
                    scores[g * len + t] = s * scale;                                             \
                }                                                                                \
            } END_EACH_TOKEN                                                                     \
            for (int64_t g = 0; g < group; g++) {                                                \
                float *sg = scores + g * len;                                                    \
                float m = -INFINITY, total = 0.0f;                                               \
                for (int64_t t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;                     \
                for (int64_t t = 0; t < len; t++) { sg[t] = expf(sg[t] - m); total += sg[t]; }   \
                const float inv = total > 0.0f ? 1.0f / total : 0.0f;                            \
                for (int64_t t = 0; t < len; t++) sg[t] *= inv;                                  \
                memset(oh + g * head_dim, 0, sizeof(float) * (size_t)head_dim);                  \
            }                                                                                    \
            FOR_EACH_TOKEN(t, row) {                                                             \
                for (int64_t g = 0; g < group; g++) {                                            \
                    const float p = scores[g * len + t];                                         \
                    float *og = oh + g * head_dim;                                               \
                    _Pragma("omp simd")                                                          \
                    for (int64_t d = 0; d < head_dim; d++) og[d] += p * LOAD(v, row + d);        \
                }                                                                                \
            } END_EACH_TOKEN                                                                     \
            free(scores);                                                                        \
        }                                                                                        \
    }                                                                                            \
    return failed;                                                                               \
}

DEFINE_GENERIC_DECODE(generic_decode_f32, load_f32)
DEFINE_GENERIC_DECODE(generic_decode_bf16, load_bf16)

#include "simd.h"

#ifdef HAVE_AVX512
#define MAX_CHUNKS 16   /* head_dim <= 256 */

static inline __m512 loadv_f32(const void *p, int64_t i) { return _mm512_loadu_ps((const float *)p + i); }

static inline __m512 loadv_bf16(const void *p, int64_t i) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* exp(x) for x <= 0 (scores minus their max); below -87, 0. */
static inline __m512 exp_nonpositive(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    return _mm512_maskz_mov_ps((__mmask16)~under, exp512(x));
}

/* Softmax numerators of a score row of `blocks` x 16 (past-the-end lanes -inf): s = exp(s - max),
 * in place; returns their sum. */
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

/* One (request, kv head) task with CH = head_dim / 16 known at compile time, so that a token's K
 * or V row and the accumulators stay in registers:
 *   scores: the token's K row is loaded once for the group's query heads;
 *   softmax over the padded score rows;
 *   V sums: heads in blocks of HB = 24 / CH (HB * CH <= 24 accumulators: independent FMA chains),
 *   the V row loaded once per block of heads. */
#define HEAD_BLOCK(CH) (24 / (CH))

/* Inside FOR_EACH_TOKEN (its blk_ and s_): at a block's first token, ask for the task's rows of the
 * next block of a K or V cache; the blocks lie anywhere in the cache, and a task reads only its kv
 * head's slice of each token row, which the hardware prefetcher does not follow. */
#define PREFETCH_NEXT_BLOCK(cache, elem)                                                         \
    if (s_ == 0 && (blk_ + 1) * block_size < len) {                                             \
        const char *next_ = (const char *)(cache) + table[blk_ + 1] * block_size * kv_heads * head_dim * (elem); \
        for (int64_t r_ = 0; r_ < block_size; r_++)                                              \
            for (int64_t b_ = 0; b_ < head_dim * (elem); b_ += 64)                               \
                _mm_prefetch(next_ + ((r_ * kv_heads + kh) * head_dim) * (elem) + b_, _MM_HINT_T0); \
    }

#define DEFINE_AVX512_TASK(NAME, LOADV, ELEM)                                                          \
static inline __attribute__((always_inline)) void NAME(                                          \
        const int CH, const float *qh, float *oh, const void *k, const void *v,                  \
        const int64_t *table, int64_t len, int64_t group, int64_t kv_heads, int64_t kh,          \
        int64_t block_size, float scale, float *scores, int64_t padded) {                        \
    const int64_t head_dim = 16 * CH;                                                            \
    FOR_EACH_TOKEN(t, row) {                                                                     \
        PREFETCH_NEXT_BLOCK(k, ELEM)                                                             \
        __m512 kr[16];                                                                           \
        _Pragma("GCC unroll 16")                                                                 \
        for (int c = 0; c < CH; c++) kr[c] = LOADV(k, row + 16 * c);                             \
        for (int64_t g = 0; g < group; g++) {                                                    \
            const float *qg = qh + g * head_dim;                                                 \
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kr[0]);                              \
            _Pragma("GCC unroll 16")                                                             \
            for (int c = 1; c < CH; c++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kr[c], acc); \
            scores[g * padded + t] = _mm512_reduce_add_ps(acc) * scale;                          \
        }                                                                                        \
    } END_EACH_TOKEN                                                                             \
    for (int64_t g = 0; g < group; g++) {                                                        \
        float *sg = scores + g * padded;                                                         \
        for (int64_t t = len; t < padded; t++) sg[t] = -INFINITY;                                \
        const float sum = exp_minus_max(sg, padded / 16);                                        \
        const __m512 inv = _mm512_set1_ps(sum > 0.0f ? 1.0f / sum : 0.0f);                      \
        for (int64_t t = 0; t < padded; t += 16)                                                 \
            _mm512_store_ps(sg + t, _mm512_mul_ps(_mm512_load_ps(sg + t), inv));                 \
    }                                                                                            \
    const int HB = HEAD_BLOCK(CH);                                                               \
    for (int64_t g0 = 0; g0 < group; g0 += HB) {                                                 \
        const int64_t n = group - g0 < HB ? group - g0 : HB;                                     \
        __m512 acc[24];                                                                          \
        _Pragma("GCC unroll 24")                                                                 \
        for (int j = 0; j < HB; j++)                                                             \
            _Pragma("GCC unroll 16")                                                             \
            for (int c = 0; c < CH; c++) acc[j * CH + c] = _mm512_setzero_ps();                     \
        FOR_EACH_TOKEN(t, row) {                                                                 \
            PREFETCH_NEXT_BLOCK(v, ELEM)                                                         \
            __m512 vr[16];                                                                       \
            _Pragma("GCC unroll 16")                                                             \
            for (int c = 0; c < CH; c++) vr[c] = LOADV(v, row + 16 * c);                         \
            _Pragma("GCC unroll 24")                                                             \
            for (int j = 0; j < HB; j++) {                                                       \
                if (j < n) {                                                                     \
                    const __m512 p = _mm512_set1_ps(scores[(g0 + j) * padded + t]);              \
                    _Pragma("GCC unroll 16")                                                     \
                    for (int c = 0; c < CH; c++) acc[j * CH + c] = _mm512_fmadd_ps(p, vr[c], acc[j * CH + c]); \
                }                                                                                \
            }                                                                                    \
        } END_EACH_TOKEN                                                                         \
        _Pragma("GCC unroll 24")                                                                 \
        for (int j = 0; j < HB; j++)                                                             \
            if (j < n)                                                                           \
                _Pragma("GCC unroll 16")                                                         \
                for (int c = 0; c < CH; c++) _mm512_storeu_ps(oh + (g0 + j) * head_dim + 16 * c, acc[j * CH + c]); \
    }                                                                                            \
}

#define TASK_CASE(TASK, CH) case CH: TASK(CH, qh, oh, k, v, table, len, group, kv_heads, kh, block_size, \
                                         scale, scores, padded); break;

#define DEFINE_AVX512_DECODE(NAME, TASK)                                                         \
DECODE_FN(NAME) {                                                                                \
    const int64_t group = heads / kv_heads;                                                      \
    int failed = 0;                                                                              \
    FOR_EACH_TASK                                                                                \
            const int64_t padded = (len + 15) / 16 * 16;                                         \
            float *scores = aligned_alloc(64, sizeof(float) * (size_t)(padded > 0 ? padded * group : 16)); \
            if (scores == NULL) { failed = 1; continue; }                                        \
            switch (head_dim / 16) {                                                             \
                TASK_CASE(TASK, 1) TASK_CASE(TASK, 2) TASK_CASE(TASK, 3) TASK_CASE(TASK, 4)      \
                TASK_CASE(TASK, 5) TASK_CASE(TASK, 6) TASK_CASE(TASK, 7) TASK_CASE(TASK, 8)      \
                TASK_CASE(TASK, 9) TASK_CASE(TASK, 10) TASK_CASE(TASK, 11) TASK_CASE(TASK, 12)   \
                TASK_CASE(TASK, 13) TASK_CASE(TASK, 14) TASK_CASE(TASK, 15) TASK_CASE(TASK, 16)  \
                default: break;                                                                  \
            }                                                                                    \
            free(scores);                                                                        \
        }                                                                                        \
    }                                                                                            \
    return failed;                                                                               \
}

DEFINE_AVX512_TASK(avx512_task_f32, loadv_f32, 4)
DEFINE_AVX512_TASK(avx512_task_bf16, loadv_bf16, 2)
DEFINE_AVX512_DECODE(avx512_decode_f32, avx512_task_f32)
DEFINE_AVX512_DECODE(avx512_decode_bf16, avx512_task_bf16)
#endif

#ifdef HAVE_AVX512
#define DISPATCH(SUFFIX)                                                                         \
    (!generic && head_dim % 16 == 0 && head_dim <= 16 * MAX_CHUNKS ? avx512_decode_##SUFFIX      \
                                                                    : generic_decode_##SUFFIX)
#else
#define DISPATCH(SUFFIX) ((void)generic, generic_decode_##SUFFIX)
#endif

#define DEFINE_ENTRY(NAME, SUFFIX)                                                               \
int NAME(const float *q, const void *k, const void *v, const int64_t *block_tables,              \
         int64_t max_blocks, const int64_t *seq_lens, float *out, int64_t batch, int64_t heads,   \
         int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, int num_threads,    \
         int generic) {                                                                          \
    return DISPATCH(SUFFIX)(q, k, v, block_tables, max_blocks, seq_lens, out, batch, heads,      \
                            kv_heads, head_dim, block_size, scale, num_threads);                 \
}

DEFINE_ENTRY(paged_decode_f32, f32)
DEFINE_ENTRY(paged_decode_bf16, bf16)

/* ---- decode with the rotary embedding and the cache write fused in ----
 * qkv [batch, (heads + 2 kv_heads) * head_dim] fp32 (the fused projection: q heads, k heads, v
 * heads), cos/sin [batch, head_dim] (full-width tables, sin negated on the first half: the
 * rotate-half rotation is x cos + roll(x, head_dim / 2) sin, rounded as PyTorch rounds it), slots
 * [batch]: each request's new K/V are rotated (K) and written to its slot, then it attends. The
 * same bits as rotating in PyTorch, writing with index_copy_ and calling paged_decode_*. */

static inline void store_f32(void *p, int64_t i, float x) { ((float *)p)[i] = x; }

static inline void store_bf16(void *p, int64_t i, float x) {   /* round to nearest even, as torch */
    union { float f; uint32_t u; } c = {x};
    ((uint16_t *)p)[i] = isnan(x) ? (uint16_t)0x7fc0 : (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline void rotate(const float *x, const float *cos, const float *sin, int64_t d, float *out) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) {
        const float a = x[i] * cos[i], b = x[(i + half) % d] * sin[i];
        out[i] = a + b;
    }
}

#define DEFINE_ROTARY_ENTRY(NAME, SUFFIX, STORE)                                                   \
int NAME(const float *qkv, const float *cos, const float *sin, const int64_t *slots, void *k,    \
         void *v, const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens,       \
         float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,            \
         int64_t block_size, float scale, int num_threads, int generic) {                         \
    const int64_t width = (heads + 2 * kv_heads) * head_dim;                                     \
    float *q = malloc(sizeof(float) * (size_t)(batch * heads * head_dim));                       \
    if (q == NULL) return 1;                                                                     \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (batch > 1)")         \
    for (int64_t b = 0; b < batch; b++) {                                                        \
        const float *row = qkv + b * width, *c = cos + b * head_dim, *s = sin + b * head_dim;   \
        float rotated[512];                                                                      \
        for (int64_t h = 0; h < heads; h++)                                                      \
            rotate(row + h * head_dim, c, s, head_dim, q + (b * heads + h) * head_dim);          \
        for (int64_t kh = 0; kh < kv_heads; kh++) {                                              \
            const int64_t dst = (slots[b] * kv_heads + kh) * head_dim;                           \
            const float *vh = row + (heads + kv_heads + kh) * head_dim;                          \
            rotate(row + (heads + kh) * head_dim, c, s, head_dim, rotated);                      \
            for (int64_t i = 0; i < head_dim; i++) {                                             \
                STORE(k, dst + i, rotated[i]);                                                   \
                STORE(v, dst + i, vh[i]);                                                        \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    const int failed = DISPATCH(SUFFIX)(q, k, v, block_tables, max_blocks, seq_lens, out, batch, \
                                        heads, kv_heads, head_dim, block_size, scale,            \
                                        num_threads);                                            \
    free(q);                                                                                     \
    return failed;                                                                               \
}

DEFINE_ROTARY_ENTRY(paged_decode_rotary_f32, f32, store_f32)
DEFINE_ROTARY_ENTRY(paged_decode_rotary_bf16, bf16, store_bf16)

/* ---- prefill attention: one request's num_q query rows (the last num_q positions of its
 * seq_len tokens, causal) over its paged K/V ----
 * q, out [num_q, heads, head_dim] fp32. The request's K/V of each kv head are first gathered into
 * fp32 scratch (K transposed: [head_dim][L16 + 16], so 16 keys' scores are one vector FMA per dim; V
 * [L16][head_dim]); then tasks of (query head, 4 query rows) score, softmax and sum V with the
 * rows' accumulators in registers. Keys past a row's position get probability 0 (exp(-inf)).
 * AVX-512 only (head_dim a multiple of 16, at most 16 * MAX_CHUNKS): returns -1 where it does not
 * apply (the caller then runs SDPA), 1 if out of memory, 0 on success. */
#ifdef HAVE_AVX512
#define PREFILL_ROWS 4

static inline __attribute__((always_inline)) void prefill_task(
        const int CH, const float *q, float *out, const float *kt, const float *vv, int64_t L16, int64_t KS,
        int64_t seq_len, int64_t num_q, int64_t heads, int64_t h, int64_t r0, float scale, float *s) {
    const int64_t head_dim = 16 * CH, first = seq_len - num_q;
    const int64_t rows = num_q - r0 < PREFILL_ROWS ? num_q - r0 : PREFILL_ROWS;
    const int64_t last = first + r0 + rows - 1;              /* the block's last position */
    const int64_t nkeys = last + 1, nblk = (nkeys + 15) / 16;
    const float *qr[PREFILL_ROWS];
    for (int r = 0; r < PREFILL_ROWS; r++) qr[r] = q + ((r0 + (r < rows ? r : 0)) * heads + h) * head_dim;
    /* scores: s[r][j] for j < 16 nblk, -inf past the row's position */
    for (int64_t b0 = 0; b0 < nblk; b0 += 2) {    /* two key blocks at once: 8 independent FMA chains */
        __m512 acc[2 * PREFILL_ROWS];
        for (int i = 0; i < 2 * PREFILL_ROWS; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < head_dim; d++) {  /* kt rows have a zero block past L16 (odd nblk) */
            const __m512 k0 = _mm512_loadu_ps(kt + d * KS + 16 * b0), k1 = _mm512_loadu_ps(kt + d * KS + 16 * b0 + 16);
            for (int r = 0; r < PREFILL_ROWS; r++) {
                const __m512 qd = _mm512_set1_ps(qr[r][d]);
                acc[2 * r] = _mm512_fmadd_ps(qd, k0, acc[2 * r]);
                acc[2 * r + 1] = _mm512_fmadd_ps(qd, k1, acc[2 * r + 1]);
            }
        }
        for (int64_t b = b0; b < b0 + 2 && b < nblk; b++)
            for (int r = 0; r < PREFILL_ROWS; r++) {
                const int64_t pos = first + r0 + r;
                const __m512i j = _mm512_add_epi32(_mm512_set1_epi32((int)(16 * b)),
                                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
                const __mmask16 ok = _mm512_cmple_epi32_mask(j, _mm512_set1_epi32((int)pos));
                _mm512_storeu_ps(s + r * L16 + 16 * b, _mm512_mask_blend_ps(ok, _mm512_set1_ps(-INFINITY),
                                 _mm512_mul_ps(acc[2 * r + (b - b0)], _mm512_set1_ps(scale))));
            }
    }
    float inv[PREFILL_ROWS];
    for (int r = 0; r < PREFILL_ROWS; r++) {
        const float sum = exp_minus_max(s + r * L16, nblk);
        inv[r] = sum > 0.0f ? 1.0f / sum : 0.0f;
    }
    /* out rows: sum over keys of p V, accumulators [rows][CH] in registers */
    __m512 acc[PREFILL_ROWS * 16];
    _Pragma("GCC unroll 64")
    for (int i = 0; i < PREFILL_ROWS * CH; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nkeys; j++) {
        __m512 vr[16];
        _Pragma("GCC unroll 16")
        for (int c = 0; c < CH; c++) vr[c] = _mm512_loadu_ps(vv + j * head_dim + 16 * c);
        _Pragma("GCC unroll 4")
        for (int r = 0; r < PREFILL_ROWS; r++) {
            const __m512 p = _mm512_set1_ps(s[r * L16 + j]);
            _Pragma("GCC unroll 16")
            for (int c = 0; c < CH; c++) acc[r * CH + c] = _mm512_fmadd_ps(p, vr[c], acc[r * CH + c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < CH; c++)
            _mm512_storeu_ps(out + ((r0 + r) * heads + h) * head_dim + 16 * c,
                             _mm512_mul_ps(acc[r * CH + c], _mm512_set1_ps(inv[r])));
}

#define PREFILL_CASE(CH) case CH: prefill_task(CH, q, out, kt + kh * head_dim * KS, vv + kh * L16 * head_dim, L16, KS, \
                                               seq_len, num_q, heads, h, r0, scale, s); break;

#define DEFINE_PREFILL(NAME, LOAD)                                                               \
int NAME(const float *q, const void *k, const void *v, const int64_t *table, int64_t seq_len,    \
         int64_t num_q, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim,           \
         int64_t block_size, float scale, int num_threads) {                                     \
    if (head_dim % 16 != 0 || head_dim > 16 * MAX_CHUNKS || num_q > seq_len) return -1;          \
    const int64_t L16 = (seq_len + 15) / 16 * 16, KS = L16 + 16, group = heads / kv_heads;       \
    const int64_t row_blocks = (num_q + PREFILL_ROWS - 1) / PREFILL_ROWS;                        \
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)(kv_heads * head_dim * KS));           \
    float *vv = aligned_alloc(64, sizeof(float) * (size_t)(kv_heads * L16 * head_dim));         \
    if (kt == NULL || vv == NULL) { free(kt); free(vv); return 1; }                              \
    int failed = 0;                                                                              \
    _Pragma("omp parallel num_threads(num_threads)")                                             \
    {                                                                                            \
        _Pragma("omp for collapse(2) schedule(static)")                                          \
        for (int64_t kh = 0; kh < kv_heads; kh++)                                                \
            for (int64_t t = 0; t < KS; t++) {                                                   \
                const int64_t row = t < seq_len ? ((table[t / block_size] * block_size + t % block_size) \
                                                   * kv_heads + kh) * head_dim : -1;             \
                for (int64_t d = 0; d < head_dim; d++) {                                         \
                    const float kx = row >= 0 ? LOAD(k, row + d) : 0.0f;                         \
                    kt[(kh * head_dim + d) * KS + t] = kx;                                       \
                    if (t < L16) vv[(kh * L16 + t) * head_dim + d] = row >= 0 ? LOAD(v, row + d) : 0.0f; \
                }                                                                                \
            }                                                                                    \
        float *s = aligned_alloc(64, sizeof(float) * (size_t)(PREFILL_ROWS * L16));              \
        if (s == NULL) {                                                                         \
            _Pragma("omp atomic write")                                                          \
            failed = 1;                                                                          \
        }                                                                                        \
        /* later row blocks see more keys: hand them out first, dynamically */                   \
        _Pragma("omp for schedule(dynamic)")                                                     \
        for (int64_t task = 0; task < heads * row_blocks; task++) {                              \
            if (s == NULL) continue;                                                             \
            const int64_t h = task % heads, r0 = (row_blocks - 1 - task / heads) * PREFILL_ROWS; \
            const int64_t kh = h / group;                                                        \
            switch (head_dim / 16) {                                                             \
                PREFILL_CASE(1) PREFILL_CASE(2) PREFILL_CASE(3) PREFILL_CASE(4)                  \
                PREFILL_CASE(5) PREFILL_CASE(6) PREFILL_CASE(7) PREFILL_CASE(8)                  \
                PREFILL_CASE(9) PREFILL_CASE(10) PREFILL_CASE(11) PREFILL_CASE(12)               \
                PREFILL_CASE(13) PREFILL_CASE(14) PREFILL_CASE(15) PREFILL_CASE(16)              \
                default: break;                                                                  \
            }                                                                                    \
        }                                                                                        \
        free(s);                                                                                 \
    }                                                                                            \
    free(kt); free(vv);                                                                          \
    return failed;                                                                               \
}
#else
#define DEFINE_PREFILL(NAME, LOAD)                                                               \
int NAME(const float *q, const void *k, const void *v, const int64_t *table, int64_t seq_len,    \
         int64_t num_q, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim,           \
         int64_t block_size, float scale, int num_threads) {                                     \
    (void)q; (void)k; (void)v; (void)table; (void)seq_len; (void)num_q; (void)out; (void)heads;  \
    (void)kv_heads; (void)head_dim; (void)block_size; (void)scale; (void)num_threads;            \
    return -1;                                                                                   \
}
#endif

DEFINE_PREFILL(paged_prefill_f32, load_f32)
DEFINE_PREFILL(paged_prefill_bf16, load_bf16)

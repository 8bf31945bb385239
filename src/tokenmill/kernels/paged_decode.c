/* Single-query (decode) attention over a paged KV cache, for CPUs.
 *
 * One task per (request, kv head): its `group` query heads share every K/V row the task reads,
 * so each cached byte is read once per step. Pass 1 scores the request's tokens block by block
 * (straight from the cache: no gather, no padding to the longest request), pass 2 takes the
 * softmax and accumulates V. All arithmetic is fp32; K/V are fp32 or bf16.
 *
 * Options: a sliding window w (the query at position len - 1 sees positions len - w .. len - 1:
 * the task starts at the block holding len - w and never reads the blocks before it) and a logit
 * softcap c (scores -> c tanh(scores / c), after the softmax scale). 0 turns either off.
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
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "attention.h"
#include "norm.h"

/* One decode step of one layer: what every entry point below passes on. */
typedef struct {
    const float *q;
    const void *k, *v;
    const int64_t *block_tables, *seq_lens;
    float *out;
    int64_t max_blocks, batch, heads, kv_heads, head_dim, block_size, window;
    float scale, softcap;
} decode_step;

/* One (request, kv head) task. Its keys are the positions [first, len), visited block by block
 * without a division per token:
 *     for (blk = first / block_size; blk * block_size < len; blk++)
 *         for (s = slot_begin(t, blk); s < slot_end(t, blk); s++)      (position blk * block_size + s)
 * and its scores are indexed from `first`. */
typedef struct {
    const float *q;          /* the group's query heads [group, head_dim] */
    float *out;              /* and their outputs */
    const void *k, *v;
    const int64_t *table;    /* the request's block table */
    int64_t first, len, group, kv_heads, kh, head_dim, block_size;
    float scale, softcap;
} decode_task;

static inline decode_task task_of(const decode_step *a, int64_t b, int64_t kh) {
    const int64_t group = a->heads / a->kv_heads, len = a->seq_lens[b];
    return (decode_task){
        .q = a->q + (b * a->heads + kh * group) * a->head_dim,
        .out = a->out + (b * a->heads + kh * group) * a->head_dim,
        .k = a->k, .v = a->v, .table = a->block_tables + b * a->max_blocks,
        .first = a->window > 0 && len > a->window ? len - a->window : 0, .len = len, .group = group,
        .kv_heads = a->kv_heads, .kh = kh, .head_dim = a->head_dim, .block_size = a->block_size,
        .scale = a->scale, .softcap = a->softcap};
}

static inline int64_t slot_begin(const decode_task *t, int64_t blk) {
    const int64_t s = t->first - blk * t->block_size;
    return s > 0 ? s : 0;
}

static inline int64_t slot_end(const decode_task *t, int64_t blk) {
    const int64_t s = t->len - blk * t->block_size;
    return s < t->block_size ? s : t->block_size;
}

/* Where the task's kv head's vector of cache slot `slot` starts in a K or V cache (in elements);
 * head_dim is an argument so that the AVX-512 tasks pass their compile-time constant. */
static ALWAYS_INLINE int64_t kv_offset(const decode_task *t, int64_t slot, int64_t head_dim) {
    return (slot * t->kv_heads + t->kh) * head_dim;
}

/* ---- portable C ---- */

static ALWAYS_INLINE void decode_task_generic(const int kv_bf16, const decode_task *task, float *scores) {
    const decode_task t = *task;   /* a local copy: stores to the scores cannot alias its fields */
    const int64_t n = t.len - t.first, head_dim = t.head_dim, bs = t.block_size;
    for (int64_t blk = t.first / bs; blk * bs < t.len; blk++) {
        const int64_t base = t.table[blk] * bs, end = slot_end(&t, blk);
        for (int64_t s = slot_begin(&t, blk); s < end; s++) {
            const int64_t i = blk * bs + s - t.first, row = kv_offset(&t, base + s, head_dim);
            for (int64_t g = 0; g < t.group; g++) {
                const float *qg = t.q + g * head_dim;
                float acc = 0.0f;
                #pragma omp simd reduction(+:acc)
                for (int64_t d = 0; d < head_dim; d++) acc += qg[d] * kv_load(t.k, row + d, kv_bf16);
                scores[g * n + i] = softcap_score(acc * t.scale, t.softcap);
            }
        }
    }
    for (int64_t g = 0; g < t.group; g++) {
        float *sg = scores + g * n;
        float m = -INFINITY, total = 0.0f;
        for (int64_t i = 0; i < n; i++) m = sg[i] > m ? sg[i] : m;
        for (int64_t i = 0; i < n; i++) { sg[i] = expf(sg[i] - m); total += sg[i]; }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t i = 0; i < n; i++) sg[i] *= inv;
        memset(t.out + g * head_dim, 0, sizeof(float) * (size_t)head_dim);
    }
    for (int64_t blk = t.first / bs; blk * bs < t.len; blk++) {
        const int64_t base = t.table[blk] * bs, end = slot_end(&t, blk);
        for (int64_t s = slot_begin(&t, blk); s < end; s++) {
            const int64_t i = blk * bs + s - t.first, row = kv_offset(&t, base + s, head_dim);
            for (int64_t g = 0; g < t.group; g++) {
                const float p = scores[g * n + i];
                float *og = t.out + g * head_dim;
                #pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) og[d] += p * kv_load(t.v, row + d, kv_bf16);
            }
        }
    }
}

/* ---- AVX-512 ---- */
#ifdef HAVE_AVX512

/* At a block's start, ask for the task's rows of its next block (elem: bytes per cache element):
 * the blocks lie anywhere in the cache, and a task reads only its kv head's slice of each token
 * row, which the hardware prefetcher does not follow. Always inlined: as a function of its own it
 * has no effect the compiler can see (a prefetch changes no memory), so its calls would be removed
 * as dead code. */
static ALWAYS_INLINE void prefetch_block(const void *cache, const decode_task *t, int64_t blk, const int64_t head_dim,
                                         const int elem) {
    if (blk * t->block_size >= t->len) return;
    const char *block = (const char *)cache + t->table[blk] * t->block_size * t->kv_heads * head_dim * elem;
    for (int64_t r = 0; r < t->block_size; r++)
        for (int64_t b = 0; b < head_dim * elem; b += 64)
            _mm_prefetch(block + kv_offset(t, r, head_dim) * elem + b, _MM_HINT_T0);
}

/* A task with CH = head_dim / 16 and the cache dtype constant at the call site, so that a token's K
 * or V row and the accumulators stay in registers:
 *   scores: the token's K row is loaded once for the group's query heads;
 *   softmax over the score rows, padded to `padded` (a multiple of 16) with -inf;
 *   V sums: heads in blocks of 24 / CH (at most 24 accumulators: independent FMA chains), the V row
 *   loaded once per block of heads. */
static ALWAYS_INLINE void decode_task_avx512(const int CH, const int kv_bf16, const decode_task *task, float *scores,
                                             int64_t padded) {
    const decode_task t = *task;   /* a local copy: stores to the scores cannot alias its fields */
    const int64_t head_dim = 16 * CH, bs = t.block_size, n = t.len - t.first;
    const int elem = kv_bf16 ? 2 : 4;
    for (int64_t blk = t.first / bs; blk * bs < t.len; blk++) {
        prefetch_block(t.k, &t, blk + 1, head_dim, elem);
        const int64_t base = t.table[blk] * bs, end = slot_end(&t, blk);
        for (int64_t s = slot_begin(&t, blk); s < end; s++) {
            const int64_t i = blk * bs + s - t.first, row = kv_offset(&t, base + s, head_dim);
            __m512 kr[16];
            #pragma GCC unroll 16
            for (int c = 0; c < CH; c++) kr[c] = kv_loadv(t.k, row + 16 * c, kv_bf16);
            for (int64_t g = 0; g < t.group; g++) {
                const float *qg = t.q + g * head_dim;
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kr[0]);
                #pragma GCC unroll 16
                for (int c = 1; c < CH; c++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kr[c], acc);
                scores[g * padded + i] = _mm512_reduce_add_ps(acc) * t.scale;
            }
        }
    }
    for (int64_t g = 0; g < t.group; g++) {
        float *sg = scores + g * padded;
        if (t.softcap > 0.0f)
            for (int64_t i = 0; i < n; i += 16) {
                const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
                _mm512_storeu_ps(sg + i, softcap512(_mm512_maskz_loadu_ps(live, sg + i), t.softcap));
            }
        for (int64_t i = n; i < padded; i++) sg[i] = -INFINITY;
        const float sum = exp_minus_max(sg, padded / 16);
        const __m512 inv = _mm512_set1_ps(sum > 0.0f ? 1.0f / sum : 0.0f);
        for (int64_t i = 0; i < padded; i += 16) _mm512_store_ps(sg + i, _mm512_mul_ps(_mm512_load_ps(sg + i), inv));
    }
    const int HB = 24 / CH;
    for (int64_t g0 = 0; g0 < t.group; g0 += HB) {
        const int64_t heads = t.group - g0 < HB ? t.group - g0 : HB;
        __m512 acc[24];
        #pragma GCC unroll 24
        for (int j = 0; j < HB; j++)
            #pragma GCC unroll 16
            for (int c = 0; c < CH; c++) acc[j * CH + c] = _mm512_setzero_ps();
        for (int64_t blk = t.first / bs; blk * bs < t.len; blk++) {
            prefetch_block(t.v, &t, blk + 1, head_dim, elem);
            const int64_t base = t.table[blk] * bs, end = slot_end(&t, blk);
            for (int64_t s = slot_begin(&t, blk); s < end; s++) {
                const int64_t i = blk * bs + s - t.first, row = kv_offset(&t, base + s, head_dim);
                __m512 vr[16];
                #pragma GCC unroll 16
                for (int c = 0; c < CH; c++) vr[c] = kv_loadv(t.v, row + 16 * c, kv_bf16);
                #pragma GCC unroll 24
                for (int j = 0; j < HB; j++) {
                    if (j < heads) {
                        const __m512 p = _mm512_set1_ps(scores[(g0 + j) * padded + i]);
                        #pragma GCC unroll 16
                        for (int c = 0; c < CH; c++) acc[j * CH + c] = _mm512_fmadd_ps(p, vr[c], acc[j * CH + c]);
                    }
                }
            }
        }
        #pragma GCC unroll 24
        for (int j = 0; j < HB; j++)
            if (j < heads)
                #pragma GCC unroll 16
                for (int c = 0; c < CH; c++) _mm512_storeu_ps(t.out + (g0 + j) * head_dim + 16 * c, acc[j * CH + c]);
    }
}

/* The task's code for its head_dim (a multiple of 16, at most 16 * MAX_CHUNKS). */
static ALWAYS_INLINE void run_task_avx512(const int kv_bf16, const decode_task *t, float *scores, int64_t padded) {
    switch (t->head_dim / 16) {
        case 1: decode_task_avx512(1, kv_bf16, t, scores, padded); break;
        case 2: decode_task_avx512(2, kv_bf16, t, scores, padded); break;
        case 3: decode_task_avx512(3, kv_bf16, t, scores, padded); break;
        case 4: decode_task_avx512(4, kv_bf16, t, scores, padded); break;
        case 5: decode_task_avx512(5, kv_bf16, t, scores, padded); break;
        case 6: decode_task_avx512(6, kv_bf16, t, scores, padded); break;
        case 7: decode_task_avx512(7, kv_bf16, t, scores, padded); break;
        case 8: decode_task_avx512(8, kv_bf16, t, scores, padded); break;
        case 9: decode_task_avx512(9, kv_bf16, t, scores, padded); break;
        case 10: decode_task_avx512(10, kv_bf16, t, scores, padded); break;
        case 11: decode_task_avx512(11, kv_bf16, t, scores, padded); break;
        case 12: decode_task_avx512(12, kv_bf16, t, scores, padded); break;
        case 13: decode_task_avx512(13, kv_bf16, t, scores, padded); break;
        case 14: decode_task_avx512(14, kv_bf16, t, scores, padded); break;
        case 15: decode_task_avx512(15, kv_bf16, t, scores, padded); break;
        case 16: decode_task_avx512(16, kv_bf16, t, scores, padded); break;
        default: break;
    }
}

/* One out-of-line function per cache dtype, so that neither's register allocation is shared with the
 * caller's loop or the other dtype's code. */
__attribute__((noinline)) static void run_task_avx512_f32(const decode_task *t, float *scores, int64_t padded) {
    run_task_avx512(0, t, scores, padded);
}

__attribute__((noinline)) static void run_task_avx512_bf16(const decode_task *t, float *scores, int64_t padded) {
    run_task_avx512(1, t, scores, padded);
}
#endif

/* Every (request, kv head) task of the step in parallel. Returns 1 if out of memory. */
static int decode(const decode_step *a, int kv_bf16, int generic, int num_threads) {
#ifdef HAVE_AVX512
    const int use_avx512 = !generic && a->head_dim % 16 == 0 && a->head_dim <= 16 * MAX_CHUNKS;
#else
    (void)generic;
#endif
    int failed = 0;
    #pragma omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)
    for (int64_t b = 0; b < a->batch; b++) {
        for (int64_t kh = 0; kh < a->kv_heads; kh++) {
            const decode_task t = task_of(a, b, kh);
            const int64_t n = t.len - t.first;
#ifdef HAVE_AVX512
            if (use_avx512) {
                const int64_t padded = (n + 15) / 16 * 16;
                float *scores = aligned_alloc(64, sizeof(float) * (size_t)(padded > 0 ? padded * t.group : 16));
                if (scores == NULL) { failed = 1; continue; }
                if (kv_bf16) run_task_avx512_bf16(&t, scores, padded);
                else run_task_avx512_f32(&t, scores, padded);
                free(scores);
                continue;
            }
#endif
            float *scores = malloc(sizeof(float) * (size_t)(n > 0 ? n * t.group : 1));
            if (scores == NULL) { failed = 1; continue; }
            if (kv_bf16) decode_task_generic(1, &t, scores);
            else decode_task_generic(0, &t, scores);
            free(scores);
        }
    }
    return failed;
}

int paged_decode_f32(const float *q, const void *k, const void *v, const int64_t *block_tables, int64_t max_blocks,
                     const int64_t *seq_lens, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, int64_t block_size, float scale, int64_t window, float softcap,
                     int num_threads, int generic) {
    const decode_step a = {q, k, v, block_tables, seq_lens, out, max_blocks, batch, heads, kv_heads, head_dim,
                           block_size, window, scale, softcap};
    return decode(&a, 0, generic, num_threads);
}

int paged_decode_bf16(const float *q, const void *k, const void *v, const int64_t *block_tables, int64_t max_blocks,
                      const int64_t *seq_lens, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t block_size, float scale, int64_t window, float softcap,
                      int num_threads, int generic) {
    const decode_step a = {q, k, v, block_tables, seq_lens, out, max_blocks, batch, heads, kv_heads, head_dim,
                           block_size, window, scale, softcap};
    return decode(&a, 1, generic, num_threads);
}

/* ---- decode with the rotary embedding and the cache write fused in ----
 * qkv [batch, (heads + 2 kv_heads) * head_dim] fp32 (the fused projection: q heads, k heads, v
 * heads), cos/sin [batch, head_dim] (full-width tables, sin negated on the first half: the
 * rotate-half rotation is x cos + roll(x, head_dim / 2) sin, rounded as PyTorch rounds it), slots
 * [batch]: each request's new K/V are rotated (K) and written to its slot, then it attends. The
 * same bits as rotating in PyTorch, writing with index_copy_ and calling paged_decode_*.
 * q_norm / k_norm (or NULL): RMSNorm weights [head_dim] applied to each q / k head before the
 * rotation (Qwen3, Gemma 3), norm.h's RMSNorm: the same bits as layers/norm.py's C path. */

static void rotate(const float *x, const float *cos, const float *sin, int64_t d, float *out) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) {
        const float a = x[i] * cos[i], b = x[(i + half) % d] * sin[i];
        out[i] = a + b;
    }
}

/* Head x [d] normed (when w is not NULL; scratch: d floats) and rotated into out. */
static void norm_rotate(const float *x, const float *w, float eps, const float *cos, const float *sin, int64_t d,
                        float *scratch, float *out, int generic) {
    if (w != NULL) {
        rms_norm_row(x, d, w, eps, scratch, generic);
        x = scratch;
    }
    rotate(x, cos, sin, d, out);
}

/* x [n] to the cache from element `at`. */
static void store_row(void *cache, int64_t at, const float *x, int64_t n, int kv_bf16) {
    if (!kv_bf16) {
        memcpy((float *)cache + at, x, sizeof(float) * (size_t)n);
        return;
    }
    for (int64_t i = 0; i < n; i++) kv_store(cache, at + i, x[i], 1);
}

static int decode_rotary(const float *qkv, const float *cos, const float *sin, const int64_t *slots, void *k,
                         void *v, const float *q_norm, const float *k_norm, float norm_eps, decode_step *a,
                         int kv_bf16, int generic, int num_threads) {
    const int64_t heads = a->heads, kv_heads = a->kv_heads, head_dim = a->head_dim;
    const int64_t width = (heads + 2 * kv_heads) * head_dim;
    float *q = malloc(sizeof(float) * (size_t)(a->batch * heads * head_dim));
    if (q == NULL) return 1;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (a->batch > 1)
    for (int64_t b = 0; b < a->batch; b++) {
        const float *row = qkv + b * width, *c = cos + b * head_dim, *s = sin + b * head_dim;
        float rotated[512], scratch[512];
        for (int64_t h = 0; h < heads; h++)
            norm_rotate(row + h * head_dim, q_norm, norm_eps, c, s, head_dim, scratch, q + (b * heads + h) * head_dim,
                        generic);
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            const int64_t dst = (slots[b] * kv_heads + kh) * head_dim;
            norm_rotate(row + (heads + kh) * head_dim, k_norm, norm_eps, c, s, head_dim, scratch, rotated, generic);
            store_row(k, dst, rotated, head_dim, kv_bf16);
            store_row(v, dst, row + (heads + kv_heads + kh) * head_dim, head_dim, kv_bf16);
        }
    }
    a->q = q;
    const int failed = decode(a, kv_bf16, generic, num_threads);
    free(q);
    return failed;
}

int paged_decode_rotary_f32(const float *qkv, const float *cos, const float *sin, const int64_t *slots, void *k,
                            void *v, const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens,
                            float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t block_size, float scale, int64_t window, float softcap, const float *q_norm,
                            const float *k_norm, float qk_norm_eps, int num_threads, int generic) {
    decode_step a = {NULL, k, v, block_tables, seq_lens, out, max_blocks, batch, heads, kv_heads, head_dim,
                     block_size, window, scale, softcap};
    return decode_rotary(qkv, cos, sin, slots, k, v, q_norm, k_norm, qk_norm_eps, &a, 0, generic, num_threads);
}

int paged_decode_rotary_bf16(const float *qkv, const float *cos, const float *sin, const int64_t *slots, void *k,
                             void *v, const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens,
                             float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             int64_t block_size, float scale, int64_t window, float softcap, const float *q_norm,
                             const float *k_norm, float qk_norm_eps, int num_threads, int generic) {
    decode_step a = {NULL, k, v, block_tables, seq_lens, out, max_blocks, batch, heads, kv_heads, head_dim,
                     block_size, window, scale, softcap};
    return decode_rotary(qkv, cos, sin, slots, k, v, q_norm, k_norm, qk_norm_eps, &a, 1, generic, num_threads);
}

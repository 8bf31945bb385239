/* Single-query (decode) attention over a paged KV cache, for CPUs.
 *
 * One task per (request, kv head): its `group` query heads share every K/V row the task reads,
 * so each cached byte is read once per step (a speculative verify step's rows of one request
 * too: "Verify rows" below). Pass 1 scores the request's tokens block by block
 * (straight from the cache: no gather, no padding to the longest request), pass 2 takes the
 * softmax and accumulates V. All arithmetic is fp32; K/V are fp32, bf16 or int8 rows with a scale
 * (kernels.h TM_KV_*), each row converted to fp32 as it is read.
 *
 * Options: a sliding window w (the query at position len - 1 sees positions len - w .. len - 1:
 * the task starts at the block holding len - w and never reads the blocks before it) and a logit
 * softcap c (scores -> c tanh(scores / c), after the softmax scale). 0 turns either off.
 *
 * Two implementations of the same passes: SIMD, written once on attention.h's vf vectors (AVX-512
 * or AVX2; head_dim a multiple of 16: 16 or 8 dims per instruction, a vectorized exp, the V sums in
 * registers) and portable C loops (everything else, and the tests' reference; `generic` forces it).
 *
 * Layouts (row-major, contiguous but for the blocks):
 *   q, out        [batch, heads, head_dim] fp32
 *   k, v          [num_blocks, block_size, kv_heads, row] (one layer's cache; attention.h kv_row_elems),
 *                 block b at b * block_stride elements (engine/kv_cache.py lays the blocks of every
 *                 layer side by side, so one block of the model's K/V is one stretch of memory)
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
    int64_t max_blocks, batch, heads, kv_heads, head_dim, block_size, block_stride, window;
    float scale, softcap;
} decode_step;

/* One (request, kv head) task: the kv head's `group` query heads of `rows` consecutive query rows
 * of one request (more than one row: a speculative verify step's, "Verify rows" below), row r at
 * position len - rows + r. Its keys are the positions [first, len), visited block by block without
 * a division per token:
 *     for (blk = first / block_size; blk * block_size < len; blk++)
 *         for (s = slot_begin(t, blk); s < slot_end(t, blk); s++)      (position blk * block_size + s)
 * and its scores are indexed from `first`; each row's scores outside its own keys are -inf. */
typedef struct {
    const float *q;          /* row 0's query heads of the group [group, head_dim], row r at r * row_stride */
    float *out;              /* and their outputs, laid out the same */
    const void *k, *v;
    const int64_t *table;    /* the request's block table */
    float *stats;            /* a split's softmax max and sum per query head [group][2], or NULL (1 row) */
    int64_t first, len, rows, row_stride, window, group, kv_heads, kh, head_dim, block_size, block_stride;
    float scale, softcap;
} decode_task;

/* The task of kv head kh for entries b .. b + rows - 1 (one request's consecutive rows: verify_rows). */
static inline decode_task task_of(const decode_step *a, int64_t b, int64_t kh, int64_t rows) {
    const int64_t group = a->heads / a->kv_heads, len = a->seq_lens[b + rows - 1];
    return (decode_task){
        .q = a->q + (b * a->heads + kh * group) * a->head_dim,
        .out = a->out + (b * a->heads + kh * group) * a->head_dim,
        .k = a->k, .v = a->v, .table = a->block_tables + (b + rows - 1) * a->max_blocks, .stats = NULL,
        .first = first_key(a->seq_lens[b] - 1, a->window), .len = len, .rows = rows,
        .row_stride = a->heads * a->head_dim, .window = a->window, .group = group,
        .kv_heads = a->kv_heads, .kh = kh, .head_dim = a->head_dim, .block_size = a->block_size,
        .block_stride = a->block_stride, .scale = a->scale, .softcap = a->softcap};
}

/* Query head g of the task (g = r * group + i: head i of row r) in q or out. */
static inline int64_t head_offset(const decode_task *t, int64_t g) {
    return g / t->group * t->row_stride + g % t->group * t->head_dim;
}

static inline int64_t slot_begin(const decode_task *t, int64_t blk) {
    const int64_t s = t->first - blk * t->block_size;
    return s > 0 ? s : 0;
}

static inline int64_t slot_end(const decode_task *t, int64_t blk) {
    const int64_t s = t->len - blk * t->block_size;
    return s < t->block_size ? s : t->block_size;
}

/* Where the task's kv head's row of slot s of cache block `block` starts in a K or V cache (in
 * elements; `row`: elements per row, an argument so that the AVX-512 tasks pass their compile-time
 * constant). */
static ALWAYS_INLINE int64_t kv_offset(const decode_task *t, int64_t block, int64_t s, int64_t row) {
    return block * t->block_stride + (s * t->kv_heads + t->kh) * row;
}

/* ---- portable C ---- */

/* One row (verify rows are taken together only by the SIMD tasks: group_rows). */
static ALWAYS_INLINE void decode_task_generic(const int kv_type, const decode_task *task, float *scores) {
    const decode_task t = *task;   /* a local copy: stores to the scores cannot alias its fields */
    const int64_t n = t.len - t.first, head_dim = t.head_dim, bs = t.block_size;
    const int64_t width = kv_row_elems(head_dim, kv_type);
    for (int64_t blk = t.first / bs; blk * bs < t.len; blk++) {
        const int64_t block = t.table[blk], end = slot_end(&t, blk);
        for (int64_t s = slot_begin(&t, blk); s < end; s++) {
            const int64_t i = blk * bs + s - t.first, row = kv_offset(&t, block, s, width);
            for (int64_t g = 0; g < t.group; g++) {
                const float *qg = t.q + g * head_dim;
                float acc = 0.0f;
                #pragma omp simd reduction(+:acc)
                for (int64_t d = 0; d < head_dim; d++) acc += qg[d] * kv_value(t.k, row, d, head_dim, kv_type);
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
        if (t.stats != NULL) { t.stats[2 * g] = m; t.stats[2 * g + 1] = total; }
        memset(t.out + g * head_dim, 0, sizeof(float) * (size_t)head_dim);
    }
    for (int64_t blk = t.first / bs; blk * bs < t.len; blk++) {
        const int64_t block = t.table[blk], end = slot_end(&t, blk);
        for (int64_t s = slot_begin(&t, blk); s < end; s++) {
            const int64_t i = blk * bs + s - t.first, row = kv_offset(&t, block, s, width);
            for (int64_t g = 0; g < t.group; g++) {
                const float p = scores[g * n + i];
                float *og = t.out + g * head_dim;
                #pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) og[d] += p * kv_value(t.v, row, d, head_dim, kv_type);
            }
        }
    }
}

/* ---- SIMD: AVX-512 or AVX2 (attention.h's vf vectors, VW lanes) ---- */
#ifdef HAVE_VF

/* Software prefetch: the blocks lie anywhere in the cache, and a task reads only its kv head's slice
 * of each token row, which the hardware prefetcher does not follow. Two levels:
 * - into L2, whole blocks PREFETCH_TOKENS_L2 tokens ahead: the blocks after the first when the task
 *   starts, then at each block's start the block that many tokens ahead (L2 tracks more misses at
 *   once than L1; simd.h prefetch_ahead: the same two levels). The V pass's first blocks are asked
 *   for when the task starts, so that a short task's V pass does not start cold;
 * - into L1, one row at a time: the row PREFETCH_ROWS_L1 tokens ahead of each row read (a
 *   row_cursor walks the block table that far ahead). Not a block at a time: a block's burst of
 *   lines (32 for a bf16 row of 64) waits on L1's few miss buffers, and the reads behind it with it.
 * ARCHITECTURE.md has the distances measured. */
#define PREFETCH_ROWS_L1 8
#define PREFETCH_TOKENS_L2 64

static inline int64_t l2_distance(const decode_task *t) {   /* in blocks */
    return (PREFETCH_TOKENS_L2 + t->block_size - 1) / t->block_size;
}

/* Ask for the task's rows of block `blk` into L2 (row: elements per row, elem: bytes per element).
 * Always inlined: as a function of its own it has no effect the compiler can see (a prefetch
 * changes no memory), so its calls would be removed as dead code. */
static ALWAYS_INLINE void prefetch_block(const void *cache, const decode_task *t, int64_t blk, const int64_t row,
                                         const int elem) {
    if (blk * t->block_size >= t->len) return;
    for (int64_t r = 0; r < t->block_size; r++) {
        const char *p = (const char *)cache + kv_offset(t, t->table[blk], r, row) * elem;
        for (int64_t b = 0; b < row * elem; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    }
}

/* The prefetches of a task's start: blocks blk + 1 .. blk + l2_distance into L2. */
static ALWAYS_INLINE void prefetch_start(const void *cache, const decode_task *t, int64_t blk, const int64_t row,
                                         const int elem) {
    for (int64_t b = 1; b <= l2_distance(t); b++) prefetch_block(cache, t, blk + b, row, elem);
}

/* A position in a task's keys as (block, slot): the row PREFETCH_ROWS_L1 tokens ahead, advanced
 * one row per row read. */
typedef struct {
    int64_t blk, slot;
} row_cursor;

static ALWAYS_INLINE row_cursor cursor_at(const decode_task *t, int64_t position) {
    return (row_cursor){position / t->block_size, position % t->block_size};
}

/* Ask for the cursor's row into L1 (none past the task's keys), then advance the cursor. */
static ALWAYS_INLINE void prefetch_row(const void *cache, const decode_task *t, row_cursor *c, const int64_t row,
                                       const int elem) {
    if (c->blk * t->block_size + c->slot < t->len) {
        const char *p = (const char *)cache + kv_offset(t, t->table[c->blk], c->slot, row) * elem;
        for (int64_t b = 0; b < row * elem; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    }
    if (++c->slot == t->block_size) {
        c->slot = 0;
        c->blk++;
    }
}

/* The 8 horizontal sums of a[0..7], in order: a transposing tree of shuffles and adds (about 3
 * instructions per sum, where a sum alone takes 8 in a dependent chain). */
static ALWAYS_INLINE __m256 sum8(const vf *a) {
#if VW == 16
    __m512 p[4];
    for (int i = 0; i < 4; i++)   /* per 128-bit lane: a[2i][0]+a[2i][2], a[2i+1][0]+.., a[2i][1]+.., a[2i+1][1]+.. */
        p[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    /* per 128-bit lane: the lane's partial sums of a[0..3] (q0) and a[4..7] (q1) */
    const __m512 q0 = _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], 0x44), _mm512_shuffle_ps(p[0], p[1], 0xee));
    const __m512 q1 = _mm512_add_ps(_mm512_shuffle_ps(p[2], p[3], 0x44), _mm512_shuffle_ps(p[2], p[3], 0xee));
    /* lanes (q0 L0+L2, q0 L1+L3, q1 L0+L2, q1 L1+L3), then each pair of lanes summed */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(q0, q1, 0x44), _mm512_shuffle_f32x4(q0, q1, 0xee));
    const __m512 t = _mm512_add_ps(r, _mm512_shuffle_f32x4(r, r, 0xb1));
    /* lane 0: a[0..3]'s sums, lane 2: a[4..7]'s */
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm512_castps512_ps128(t)), _mm512_extractf32x4_ps(t, 2), 1);
#else
    /* per 128-bit lane: pair sums, then each vector's lane sums: (a0 a1 a2 a3 | the same of the upper lanes) */
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#endif
}

/* Accumulators of the V sums: 24 of AVX-512's 32 registers, 12 of AVX2's 16. */
#define V_ACC (VW == 16 ? 24 : 12)

/* A task with CH = head_dim / 16 and the cache dtype constant at the call site, every row in
 * attention.h's row order (q and the outputs permuted to it once per task), a row NV vectors:
 *   scores: 8 tokens at a time, their K rows into an L1 buffer, then per query head 8 independent
 *   FMA chains (one per token) and one transposing reduction (sum8), its 8 sums stored whole (lanes
 *   past the last token land in the padding, which the softmax overwrites: a masked store made
 *   the whole task ~6% slower on an AVX2 EPYC);
 *   softmax over the score rows, padded to `padded` (a multiple of 16) with -inf;
 *   V sums: heads in blocks of V_ACC / NV (at least one: independent FMA chains), the V row loaded
 *   once per block of heads.
 * scratch: the scores [rows x group][padded], then the queries in row order [rows x group][NV] vectors. */
static ALWAYS_INLINE void decode_task_simd(const int CH, const int kv_type, const decode_task *task, float *scratch,
                                           int64_t padded) {
    const decode_task t = *task;   /* a local copy: stores to the scores cannot alias its fields */
    const int NV = 16 * CH / VW;
    const int64_t head_dim = 16 * CH, bs = t.block_size, n = t.len - t.first, row = kv_row_elems(head_dim, kv_type);
    const int elem = kv_elem_bytes(kv_type);
    const int64_t heads_all = t.group * t.rows;   /* the task's query heads, row by row */
    float *scores = scratch;
    vf *q = (vf *)(scratch + heads_all * padded);
    for (int64_t g = 0; g < heads_all; g++) {
        #pragma GCC unroll 32
        for (int c = 0; c < NV; c++) q[g * NV + c] = vf_loadu(t.q + head_offset(&t, g) + VW * c);
        to_row_order(CH, kv_type, q + g * NV);
    }
    vf kbuf[8 * 32];   /* 8 tokens' K rows */
    for (int i = 0; i < 8 * NV; i++) kbuf[i] = vf_set1(0.0f);
    const int64_t ahead_l2 = l2_distance(&t);
    int64_t blk = t.first / bs, slot = t.first % bs;
    prefetch_start(t.k, &t, blk, row, elem);
    /* and its first V blocks into L2: at a short context the V pass would otherwise start cold */
    for (int64_t b = 0; b <= ahead_l2; b++) prefetch_block(t.v, &t, blk + b, row, elem);
    row_cursor k_ahead = cursor_at(&t, t.first + PREFETCH_ROWS_L1);
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
        const int nk = n - i0 < 8 ? (int)(n - i0) : 8;
        for (int j = 0; j < nk; j++) {
            prefetch_row(t.k, &t, &k_ahead, row, elem);
            kv_row(CH, kv_type, t.k, kv_offset(&t, t.table[blk], slot, row), kbuf + j * NV);
            if (++slot == bs) {
                slot = 0;
                prefetch_block(t.k, &t, ++blk + ahead_l2, row, elem);
            }
        }
        for (int64_t g = 0; g < heads_all; g++) {
            const vf *qg = q + g * NV;
            vf acc[8];
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++) acc[j] = vf_mul(qg[0], kbuf[j * NV]);
            #pragma GCC unroll 32
            for (int c = 1; c < NV; c++)
                #pragma GCC unroll 8
                for (int j = 0; j < 8; j++) acc[j] = vf_fmadd(qg[c], kbuf[j * NV + c], acc[j]);
            _mm256_storeu_ps(scores + g * padded + i0, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(t.scale)));
        }
    }
    for (int64_t g = 0; g < heads_all; g++) {
        float *sg = scores + g * padded;
        if (t.softcap > 0.0f)
            for (int64_t i = 0; i < n; i += VW) vf_store(sg + i, vf_softcap(vf_load_first(sg + i, n - i), t.softcap));
        /* the row's own keys: [first_key(its position), its position] */
        const int64_t back = t.rows - 1 - g / t.group, seen = n - back;
        for (int64_t i = first_key(t.len - 1 - back, t.window) - t.first - 1; i >= 0; i--) sg[i] = -INFINITY;
        for (int64_t i = seen; i < padded; i++) sg[i] = -INFINITY;
        float max;
        const float sum = exp_minus_max(sg, padded / 16, &max);
        if (t.stats != NULL) { t.stats[2 * g] = max; t.stats[2 * g + 1] = sum; }
        const vf inv = vf_set1(sum > 0.0f ? 1.0f / sum : 0.0f);
        for (int64_t i = 0; i < padded; i += VW) vf_store(sg + i, vf_mul(vf_load(sg + i), inv));
    }
    const int HB = V_ACC / NV > 0 ? V_ACC / NV : 1;
    for (int64_t g0 = 0; g0 < heads_all; g0 += HB) {
        const int64_t heads = heads_all - g0 < HB ? heads_all - g0 : HB;
        vf acc[V_ACC > 32 ? V_ACC : 32];
        #pragma GCC unroll 24
        for (int j = 0; j < HB; j++)
            #pragma GCC unroll 32
            for (int c = 0; c < NV; c++) acc[j * NV + c] = vf_set1(0.0f);
        prefetch_start(t.v, &t, t.first / bs, row, elem);
        row_cursor v_ahead = cursor_at(&t, t.first + PREFETCH_ROWS_L1);
        for (int64_t blk = t.first / bs; blk * bs < t.len; blk++) {
            prefetch_block(t.v, &t, blk + ahead_l2, row, elem);
            const int64_t block = t.table[blk], end = slot_end(&t, blk);
            for (int64_t s = slot_begin(&t, blk); s < end; s++) {
                const int64_t i = blk * bs + s - t.first;
                prefetch_row(t.v, &t, &v_ahead, row, elem);
                vf vr[32];
                kv_row(CH, kv_type, t.v, kv_offset(&t, block, s, row), vr);
                #pragma GCC unroll 24
                for (int j = 0; j < HB; j++) {
                    if (j < heads) {
                        const vf p = vf_set1(scores[(g0 + j) * padded + i]);
                        #pragma GCC unroll 32
                        for (int c = 0; c < NV; c++) acc[j * NV + c] = vf_fmadd(p, vr[c], acc[j * NV + c]);
                    }
                }
            }
        }
        #pragma GCC unroll 24
        for (int j = 0; j < HB; j++)
            if (j < heads) {
                from_row_order(CH, kv_type, acc + j * NV);
                #pragma GCC unroll 32
                for (int c = 0; c < NV; c++) vf_storeu(t.out + head_offset(&t, g0 + j) + VW * c, acc[j * NV + c]);
            }
    }
}

/* The task's code for its head_dim (a multiple of 16, at most 16 * MAX_CHUNKS). */
static ALWAYS_INLINE void run_task_simd(const int kv_type, const decode_task *t, float *scores, int64_t padded) {
    switch (t->head_dim / 16) {
        case 1: decode_task_simd(1, kv_type, t, scores, padded); break;
        case 2: decode_task_simd(2, kv_type, t, scores, padded); break;
        case 3: decode_task_simd(3, kv_type, t, scores, padded); break;
        case 4: decode_task_simd(4, kv_type, t, scores, padded); break;
        case 5: decode_task_simd(5, kv_type, t, scores, padded); break;
        case 6: decode_task_simd(6, kv_type, t, scores, padded); break;
        case 7: decode_task_simd(7, kv_type, t, scores, padded); break;
        case 8: decode_task_simd(8, kv_type, t, scores, padded); break;
        case 9: decode_task_simd(9, kv_type, t, scores, padded); break;
        case 10: decode_task_simd(10, kv_type, t, scores, padded); break;
        case 11: decode_task_simd(11, kv_type, t, scores, padded); break;
        case 12: decode_task_simd(12, kv_type, t, scores, padded); break;
        case 13: decode_task_simd(13, kv_type, t, scores, padded); break;
        case 14: decode_task_simd(14, kv_type, t, scores, padded); break;
        case 15: decode_task_simd(15, kv_type, t, scores, padded); break;
        case 16: decode_task_simd(16, kv_type, t, scores, padded); break;
        default: break;
    }
}

/* One out-of-line function per cache type, so that none's register allocation is shared with the
 * caller's loop or another type's code. */
__attribute__((noinline)) static void run_task_simd_f32(const decode_task *t, float *scores, int64_t padded) {
    run_task_simd(TM_KV_F32, t, scores, padded);
}

__attribute__((noinline)) static void run_task_simd_bf16(const decode_task *t, float *scores, int64_t padded) {
    run_task_simd(TM_KV_BF16, t, scores, padded);
}

__attribute__((noinline)) static void run_task_simd_i8(const decode_task *t, float *scores, int64_t padded) {
    run_task_simd(TM_KV_I8, t, scores, padded);
}
#endif

/* One task's attention, into t->out (and t->stats when split). Returns 1 if out of memory. */
static int run_task(const decode_task *t, int kv_type, int use_simd) {
    const int64_t n = t->len - t->first;
#ifdef HAVE_VF
    if (use_simd) {
        const int64_t padded = (n + 15) / 16 * 16;   /* the scores, then the queries (decode_task_simd) */
        float *scores = aligned_alloc(64, sizeof(float) * (size_t)((padded + t->head_dim) * t->group * t->rows));
        if (scores == NULL) return 1;
        if (kv_type == TM_KV_BF16) run_task_simd_bf16(t, scores, padded);
        else if (kv_type == TM_KV_I8) run_task_simd_i8(t, scores, padded);
        else run_task_simd_f32(t, scores, padded);
        free(scores);
        return 0;
    }
#else
    (void)use_simd;
#endif
    float *scores = malloc(sizeof(float) * (size_t)(n > 0 ? n * t->group : 1));
    if (scores == NULL) return 1;
    if (kv_type == TM_KV_BF16) decode_task_generic(TM_KV_BF16, t, scores);
    else if (kv_type == TM_KV_I8) decode_task_generic(TM_KV_I8, t, scores);
    else decode_task_generic(TM_KV_F32, t, scores);
    free(scores);
    return 0;
}

/* Splitting the sequence (flash-decoding). A step with fewer (request, kv head) tasks than
 * SPLIT_TASKS_PER_THREAD per thread leaves cores idle, or unevenly loaded (3 kv heads on 2 threads),
 * exactly when each task is long: batch 1 at long context. Such a step splits each request's keys
 * into at most `max_splits` runs of at least SPLIT_MIN_KEYS keys (whole blocks); each run's task
 * writes its softmax-normalized partial output with the run's max m and sum l per query head, and a
 * second pass combines the runs: out = sum_s w_s o_s / sum_s w_s with w_s = exp(m_s - M) l_s, M the
 * largest m_s. How a request is split depends only on its length, the batch and the thread count
 * (not on timing), so a step's result is reproducible. */
#define SPLIT_TASKS_PER_THREAD 8
#define SPLIT_MIN_KEYS 256

/* The keys of request b's run s, of `runs` runs of `per_run` keys each (the last shorter). */
static void split_range(decode_task *t, int64_t s, int64_t per_run) {
    const int64_t first = t->first + s * per_run, len = first + per_run < t->len ? first + per_run : t->len;
    t->first = first;
    t->len = len;
}

/* The combining pass: request b's outputs from its `runs` partial outputs part [runs][heads][head_dim]
 * and their stats [runs][heads][2]. */
static void combine_runs(const decode_step *a, int64_t b, int64_t runs, const float *part, const float *stats) {
    const int64_t heads = a->heads, head_dim = a->head_dim;
    for (int64_t h = 0; h < heads; h++) {
        float big = -INFINITY, total = 0.0f;
        for (int64_t s = 0; s < runs; s++) big = stats[(s * heads + h) * 2] > big ? stats[(s * heads + h) * 2] : big;
        float *o = a->out + (b * heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) o[d] = 0.0f;
        for (int64_t s = 0; s < runs; s++) {
            const float w = expf(stats[(s * heads + h) * 2] - big) * stats[(s * heads + h) * 2 + 1];
            const float *p = part + (s * heads + h) * head_dim;
            total += w;
            for (int64_t d = 0; d < head_dim; d++) o[d] += w * p[d];
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < head_dim; d++) o[d] *= inv;
    }
}

/* The most runs a request's keys are split into: enough for SPLIT_TASKS_PER_THREAD tasks per thread
 * (1 for an empty step). */
static int64_t split_limit(int64_t tasks, int num_threads) {
    const int64_t wanted = (int64_t)SPLIT_TASKS_PER_THREAD * num_threads;
    return num_threads > 1 && tasks > 0 && tasks < wanted ? (wanted + tasks - 1) / tasks : 1;
}

int decode_scratch_alloc(tm_decode_scratch *s, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int num_threads) {
    const int64_t width = split_limit(batch * kv_heads, num_threads);
    *s = (tm_decode_scratch){
        .q = malloc(sizeof(float) * (size_t)(batch * heads * head_dim + 1)),
        .runs = malloc(sizeof(int64_t) * (size_t)(3 * batch + 1)),
        .part = malloc(sizeof(float) * (size_t)(batch * width * heads * head_dim + 1)),
        .stats = malloc(sizeof(float) * (size_t)(batch * width * heads * 2 + 1))};
    if (s->q == NULL || s->runs == NULL || s->part == NULL || s->stats == NULL) {
        decode_scratch_free(s);
        return 1;
    }
    return 0;
}

void decode_scratch_free(tm_decode_scratch *s) {
    free(s->q); free(s->runs); free(s->part); free(s->stats);
    *s = (tm_decode_scratch){0};
}

/* Verify rows. A request verifying k proposed tokens enters the step as k + 1 entries at
 * consecutive lengths over the same block table (engine/runner.py), each of which would read the
 * request's whole K/V again. One task per kv head takes those rows together instead: it reads each
 * K and V row once for all of them, and each row's scores past its own position are -inf, which
 * leaves its output as its own task's, bit for bit (a score is the same sum in either; the -inf
 * scores add 0 to the softmax's sums and 0 x V to the output's: the V rows past a row are the
 * later rows' own, finite unless the model's activations are not, and then those rows are NaN
 * anyway). Entries are taken as one request's rows where each is one longer than the one before
 * and their block tables agree on every block the longer one reads, so rows taken together read
 * exactly what they would alone. Only unsplit entries are grouped, and only where the SIMD tasks
 * run. So that a batch-1 step still gives every thread work, a request's rows are cut into pieces
 * of at least MIN_PIECE_ROWS while the step has fewer than GROUP_TASKS_PER_THREAD tasks per thread. */
#define GROUP_TASKS_PER_THREAD 2
#define MIN_PIECE_ROWS 3   /* pieces of 2 rows ran slower than whole requests (kernel-ab, 4 and 5 rows) */

/* 1 if entry b + 1 is the row after entry b's: one key longer, over the same blocks. */
static int next_row(const decode_step *a, int64_t b) {
    if (a->seq_lens[b + 1] != a->seq_lens[b] + 1) return 0;
    const int64_t blocks = (a->seq_lens[b + 1] + a->block_size - 1) / a->block_size;
    return blocks <= a->max_blocks && memcmp(a->block_tables + b * a->max_blocks,
                                             a->block_tables + (b + 1) * a->max_blocks,
                                             sizeof(int64_t) * (size_t)blocks) == 0;
}

/* rows[b]: how many consecutive entries from b one task takes (verify rows, above), 0 for an entry
 * that another's task takes; 1 everywhere unless `group`. */
static void group_rows(const decode_step *a, const int64_t *runs, int group, int num_threads, int64_t *rows) {
    int64_t tasks = 0;
    for (int64_t b = 0; b < a->batch; tasks++) {
        int64_t r = 1;
        while (group && b + r < a->batch && runs[b + r - 1] == 1 && runs[b + r] == 1 && next_row(a, b + r - 1)) r++;
        rows[b] = r;
        for (int64_t j = 1; j < r; j++) rows[b + j] = 0;
        b += r;
    }
    tasks *= a->kv_heads;
    const int64_t want = (int64_t)GROUP_TASKS_PER_THREAD * num_threads;
    if (tasks == 0 || tasks >= want) return;
    const int64_t pieces = (want + tasks - 1) / tasks;   /* per request */
    for (int64_t b = 0, r; b < a->batch; b += r) {
        r = rows[b];
        const int64_t cuts = r / MIN_PIECE_ROWS < pieces ? r / MIN_PIECE_ROWS : pieces;
        if (cuts < 2) continue;
        for (int64_t j = 0, at = b; j < cuts; j++) {   /* sizes that differ by at most one */
            rows[at] = r / cuts + (j < r % cuts);
            at += rows[at];
        }
    }
}

/* Every (request, kv head) task of the step, split as above when there are too few, by the team
 * (kernels.h); *failed set to 1 if out of memory. */
static void decode_team(const decode_step *a, int kv_type, int generic, int num_threads, const tm_decode_scratch *sc,
                        int *failed) {
#ifdef HAVE_VF
    const int use_simd = !generic && a->head_dim % 16 == 0 && a->head_dim <= 16 * MAX_CHUNKS;
#else
    (void)generic;
    const int use_simd = 0;
#endif
    const int64_t max_splits = split_limit(a->batch * a->kv_heads, num_threads);
    /* runs per request and keys per run, from its length; runs[2 batch]: 1 if any request is split;
     * then the entries' task rows (group_rows) */
    int64_t *runs = sc->runs, *per_run = sc->runs + a->batch, *rows = sc->runs + 2 * a->batch + 1;
    #pragma omp single
    {
        int64_t split_any = 0;
        for (int64_t b = 0; b < a->batch; b++) {
            const decode_task t = task_of(a, b, 0, 1);
            const int64_t n = t.len - t.first, most = n / SPLIT_MIN_KEYS;
            int64_t r = most < max_splits ? most : max_splits;
            if (r < 1) r = 1;
            per_run[b] = (n + r - 1) / r;
            per_run[b] = (per_run[b] + a->block_size - 1) / a->block_size * a->block_size;   /* whole blocks */
            runs[b] = per_run[b] > 0 ? (n + per_run[b] - 1) / per_run[b] : 1;
            split_any |= runs[b] > 1;
        }
        runs[2 * a->batch] = split_any;
        group_rows(a, runs, use_simd, num_threads, rows);
    }
    const int64_t split_any = runs[2 * a->batch];
    const int64_t width = split_any ? max_splits : 1;   /* runs' stride in the scratch below */
    float *part = sc->part, *stats = sc->stats;
    #pragma omp for collapse(3) schedule(dynamic)
    for (int64_t b = 0; b < a->batch; b++)
        for (int64_t s = 0; s < width; s++)
            for (int64_t kh = 0; kh < a->kv_heads; kh++) {
                if (s >= runs[b] || rows[b] == 0) continue;
                decode_task t = task_of(a, b, kh, rows[b]);
                if (runs[b] > 1) {   /* a run of the request's keys, into the scratch */
                    const int64_t at = (b * width + s) * a->heads + kh * t.group;
                    split_range(&t, s, per_run[b]);
                    t.out = part + at * a->head_dim;
                    t.stats = stats + at * 2;
                }
                if (run_task(&t, kv_type, use_simd)) {
                    #pragma omp atomic write
                    *failed = 1;
                }
            }
    if (split_any) {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < a->batch; b++)
            if (runs[b] > 1)
                combine_runs(a, b, runs[b], part + b * width * a->heads * a->head_dim, stats + b * width * a->heads * 2);
    }
}

static int valid_kv_type(int kv_type) {
    return kv_type == TM_KV_F32 || kv_type == TM_KV_BF16 || kv_type == TM_KV_I8;
}

int paged_decode(const float *q, const void *k, const void *v, int kv_type, const int64_t *block_tables,
                 int64_t max_blocks, const int64_t *seq_lens, float *out, int64_t batch, int64_t heads,
                 int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t block_stride, float scale,
                 int64_t window, float softcap, int num_threads, int generic) {
    if (!valid_kv_type(kv_type)) return 2;
    const decode_step a = {q, k, v, block_tables, seq_lens, out, max_blocks, batch, heads, kv_heads, head_dim,
                           block_size, block_stride, window, scale, softcap};
    tm_decode_scratch sc;
    if (decode_scratch_alloc(&sc, batch, heads, kv_heads, head_dim, num_threads)) return 1;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    decode_team(&a, kv_type, generic, num_threads, &sc, &failed);
    decode_scratch_free(&sc);
    return failed;
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

void paged_decode_rotary_team(const float *qkv, const float *cos, const float *sin, const int64_t *slots, void *k,
                              void *v, int kv_type, const int64_t *block_tables, int64_t max_blocks,
                              const int64_t *seq_lens, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                              int64_t head_dim, int64_t block_size, int64_t block_stride, float scale, int64_t window,
                              float softcap, const float *q_norm, const float *k_norm, float norm_eps, int num_threads,
                              int generic, const tm_decode_scratch *sc, int *failed) {
    const int64_t kv_row = kv_row_elems(head_dim, kv_type);
    const int64_t width = (heads + 2 * kv_heads) * head_dim;
    float *q = sc->q;
    #pragma omp for schedule(static)
    for (int64_t b = 0; b < batch; b++) {
        const float *row = qkv + b * width, *c = cos + b * head_dim, *s = sin + b * head_dim;
        float rotated[512], scratch[512];
        for (int64_t h = 0; h < heads; h++)
            norm_rotate(row + h * head_dim, q_norm, norm_eps, c, s, head_dim, scratch, q + (b * heads + h) * head_dim,
                        generic);
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            const int64_t dst = slots[b] / block_size * block_stride + (slots[b] % block_size * kv_heads + kh) * kv_row;
            norm_rotate(row + (heads + kh) * head_dim, k_norm, norm_eps, c, s, head_dim, scratch, rotated, generic);
            kv_store_row(k, dst, rotated, head_dim, kv_type);
            kv_store_row(v, dst, row + (heads + kv_heads + kh) * head_dim, head_dim, kv_type);
        }
    }
    const decode_step a = {q, k, v, block_tables, seq_lens, out, max_blocks, batch, heads, kv_heads, head_dim,
                           block_size, block_stride, window, scale, softcap};
    decode_team(&a, kv_type, generic, num_threads, sc, failed);
}

int paged_decode_rotary(const float *qkv, const float *cos, const float *sin, const int64_t *slots, void *k,
                        void *v, int kv_type, const int64_t *block_tables, int64_t max_blocks,
                        const int64_t *seq_lens, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t block_stride, float scale, int64_t window,
                        float softcap, const float *q_norm, const float *k_norm, float qk_norm_eps, int num_threads,
                        int generic) {
    if (!valid_kv_type(kv_type)) return 2;
    tm_decode_scratch sc;
    if (decode_scratch_alloc(&sc, batch, heads, kv_heads, head_dim, num_threads)) return 1;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    paged_decode_rotary_team(qkv, cos, sin, slots, k, v, kv_type, block_tables, max_blocks, seq_lens, out, batch,
                             heads, kv_heads, head_dim, block_size, block_stride, scale, window, softcap, q_norm,
                             k_norm, qk_norm_eps,
                             num_threads, generic, &sc, &failed);
    decode_scratch_free(&sc);
    return failed;
}

/* Prefill attention over a paged KV cache, for CPUs with AVX-512 or AVX2: one request's num_q query
 * rows (the last num_q positions of its seq_len tokens, causal) over its K/V.
 *
 * q, out [num_q, heads, head_dim] fp32. Flash-style: the request's K/V of each kv head are first
 * gathered into fp32 scratch in tiles of KT keys (K transposed within a tile, [head_dim][KT], so VW
 * keys' scores are one vector FMA per dim; V [KT][head_dim]); then each task, one query head and QT
 * query rows, walks the key tiles its rows see in order, and for each tile and each block of ROWS
 * rows: scores in registers, an online softmax (each row's running max and sum; its output rescaled
 * when the max grows), and the tile's V summed into the rows' outputs. A tile (16 KiB of K, 16 KiB
 * of V at head_dim 64) is read from memory once per task and then from L1 by its QT / ROWS row
 * blocks, so the work stays bound by the FMAs at any context length rather than by the caches.
 * Keys a row does not see get probability 0. A bfloat16 cache on a CPU with AVX512-BF16 is gathered
 * as bf16 pairs instead (half the bytes) for bf16 dot products: see gathered_kv and tile_rows.
 *
 * Options as in paged_decode.c: a sliding window w (the row at position p sees keys p - w < j <= p:
 * the gather starts at the tile of the first key the first row sees, whose earlier keys are zeros, so
 * blocks wholly before that key are never read, and each row block skips the tiles wholly before its
 * window) and a logit softcap c (scores ->
 * c tanh(scores / c) after the scale). 0 turns either off.
 *
 * Written once on attention.h's vf vectors (VW lanes: 16 with AVX-512, 8 with AVX2; the tile and
 * row block sized so that a block's scores stay in the registers either has). Needs one of them and
 * head_dim a multiple of 16, at most 16 * MAX_CHUNKS: returns -1 where it does not apply (the caller
 * then runs SDPA), 1 if out of memory, 0 on success. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "attention.h"

#ifdef HAVE_VF
/* query rows per register block and keys per tile: 4 vectors of scores per row, ROWS x 4 of the
 * block's scores in registers (32 AVX-512 registers, 16 AVX2 ones) */
#if VW == 16
#define ROWS 4
#else
#define ROWS 2
#endif
#define KT (4 * VW)
#define QT 32     /* query rows per task */
#define VG 4      /* output vectors per row held in registers while V is summed */

/* The gathered keys of a request, from position key0 (a multiple of KT) on, in `tiles` tiles of KT
 * (zeros before the first key seen and past seq_len). float32: kt [kv_heads][tiles][head_dim][KT],
 * vv [kv_heads][tiles][KT][head_dim]. For bf16 dot products (see tile_rows), bfloat16 values in
 * pairs, each pair one 32-bit lane of a vdpbf16ps: kt [kv_heads][tiles][head_dim / 2][KT][2] (two
 * dims of a key), vv [kv_heads][tiles][KT / 2][head_dim][2] (one dim of two keys). */
typedef struct {
    void *kt, *vv;
    int64_t key0, tiles;
} gathered_kv;

/* One task: query head h, rows [r0, r0 + QT) (those below num_q). */
typedef struct {
    const float *q;
    float *out;
    const void *kt, *vv;    /* its kv head's gathered tiles */
    int64_t key0, seq_len, num_q, heads, h, r0, window;
    float scale, softcap;
} prefill_task;

/* A task's state per row: the output so far (unnormalized) [QT][head_dim], the running max (of the
 * scores, or of scale log2(e) scores in tile_rows' base-2 softmax) and sum,
 * a row block's probabilities for the current tile, and (bf16 dot products) its query rows in bfloat16
 * [QT][head_dim]. */
typedef struct {
    float *o, *m, *l, *p;
    uint16_t *q16;
} task_scratch;

/* 2^t for t <= 0 or -inf: 2^floor(t) 2^f with f = t - floor(t) in [0, 1] (vreduceps), 2^f by a
 * degree-5 polynomial fitted for relative error (1.6e-7 at most, float32's own scale), 2^floor(t)
 * by vscalefps (-inf: 0). A degree-4 fit (2.7e-6, still 1/700 of the bfloat16 rounding that
 * follows) measurably raised the default model's KL to the reference: its error is smooth in f, so
 * it biases probabilities alike rather than averaging out (ARCHITECTURE). */
#ifdef HAVE_BF16
static inline __m512 exp2_nonpositive(__m512 t) {
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0018775766948238015f), f, _mm512_set1_ps(0.008989340625703335f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05582631751894951f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24015361070632935f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931530833244324f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999999403953552f));
    return _mm512_scalef_ps(p, t);
}
#endif

/* One tile for one block of rows (positions pos[r], gathered index): scores, the online softmax
 * step, and the tile's V into the rows' outputs. tile0: the tile's first gathered key. qr[r]: the
 * row's query, float32 or (BF) bfloat16.
 *
 * BF (a bfloat16 cache on a CPU with AVX512-BF16): the dot products of both matmuls take vdpbf16ps,
 * which sums products of bfloat16 pairs into float32 lanes (each product exact in float32), at twice
 * the products per instruction of an fp32 FMA. K and V are the cache's own values; the query rows and
 * the probabilities are rounded to bfloat16 (and the row sums add the rounded probabilities, so a
 * row's output stays a weighted mean of V). As llama.cpp's flash attention rounds Q to its f16 cache's
 * type. The cost, next to the float32 dot products, is measured by `bench quality` (ARCHITECTURE).
 * Without a softcap, its softmax runs in base 2 with a shorter exp (exp2_nonpositive).
 * (vdpbf16ps flushes denormal inputs and results to zero: an output below 2^-126 reads as 0.) */
static ALWAYS_INLINE void tile_rows(const int CH, const int BF, const prefill_task *t, const void *const *qr,
                                    const int64_t *pos, const void *kt, const void *vv, int64_t tile0, float *o,
                                    float *m, float *l, float *p) {
    const int64_t head_dim = 16 * CH;
    const int NV = 16 * CH / VW;   /* vectors per row of head_dim */
    vf acc[ROWS][KT / VW];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < KT / VW; v++) acc[r][v] = vf_set1(0.0f);
    if (BF) {
#ifdef HAVE_BF16
        for (int64_t dp = 0; dp < head_dim / 2; dp++) {
            __m512i k[KT / VW];
            for (int v = 0; v < KT / VW; v++) k[v] = _mm512_load_si512((const uint32_t *)kt + dp * KT + VW * v);
            for (int r = 0; r < ROWS; r++) {
                const __m512bh qd = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)qr[r])[dp]);
                for (int v = 0; v < KT / VW; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)k[v], qd);
            }
        }
#endif
    } else {
        for (int64_t d = 0; d < head_dim; d++) {
            vf k[KT / VW];
            for (int v = 0; v < KT / VW; v++) k[v] = vf_load((const float *)kt + d * KT + VW * v);
            for (int r = 0; r < ROWS; r++) {
                const vf qd = vf_set1(((const float *)qr[r])[d]);
                for (int v = 0; v < KT / VW; v++) acc[r][v] = vf_fmadd(qd, k[v], acc[r][v]);
            }
        }
    }
    float alpha[ROWS];
    /* keys every row of the block sees (the tile wholly at or before the first row's position and,
     * with a window, after the last row's window start) need no mask */
    int64_t last_pos = pos[0];
    for (int r = 1; r < ROWS; r++) last_pos = pos[r] > last_pos ? pos[r] : last_pos;
    const int masked = tile0 + KT - 1 > pos[0] || (t->window > 0 && tile0 <= last_pos - t->window);
#ifdef HAVE_BF16
    if (BF && t->softcap == 0.0f) {
        /* the softmax in base 2: m is the row's max of scale log2(e) score, p = 2^(scale log2(e) score - m),
         * stored as bfloat16 pairs; the row sum adds those rounded values (one vdpbf16ps against ones) */
        const float log2_scale = t->scale * 1.44269504088896341f;
        const __m512 c = _mm512_set1_ps(log2_scale);
        const __m512bh ones = (__m512bh)_mm512_set1_epi32(0x3f803f80);
        for (int r = 0; r < ROWS; r++) {
            __m512 sv[KT / VW];
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int v = 0; v < KT / VW; v++) {
                sv[v] = masked ? vf_causal(acc[r][v], tile0 + VW * v, pos[r], t->window) : acc[r][v];
                mx = _mm512_max_ps(mx, sv[v]);
            }
            const float tile_max = _mm512_reduce_max_ps(mx) * log2_scale;
            const float m_new = tile_max > m[r] ? tile_max : m[r];
            const __m512 base = _mm512_set1_ps(m_new == -INFINITY ? 0.0f : m_new);
            __m512 sum = _mm512_setzero_ps();
            for (int v = 0; v < KT / VW; v += 2) {
                const __m512bh e = _mm512_cvtne2ps_pbh(exp2_nonpositive(_mm512_fmsub_ps(sv[v + 1], c, base)),
                                                       exp2_nonpositive(_mm512_fmsub_ps(sv[v], c, base)));
                _mm512_store_si512((uint16_t *)p + r * KT + VW * v, (__m512i)e);
                sum = _mm512_dpbf16_ps(sum, e, ones);
            }
            alpha[r] = m[r] == -INFINITY ? 0.0f : m_new == m[r] ? 1.0f : exp2f(m[r] - m_new);
            l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
            m[r] = m_new;
        }
    } else
#endif
    for (int r = 0; r < ROWS; r++) {
        vf sv[KT / VW];
        vf mx = vf_set1(-INFINITY);
        for (int v = 0; v < KT / VW; v++) {
            vf score = vf_mul(acc[r][v], vf_set1(t->scale));
            if (t->softcap > 0.0f) score = vf_softcap(score, t->softcap);
            sv[v] = masked ? vf_causal(score, tile0 + VW * v, pos[r], t->window) : score;
            mx = vf_max(mx, sv[v]);
        }
        const float tile_max = vf_reduce_max(mx);
        const float m_new = tile_max > m[r] ? tile_max : m[r];
        /* a row that has seen no key yet keeps max -inf: its probabilities are 0 */
        const vf base = vf_set1(m_new == -INFINITY ? 0.0f : m_new);
        vf sum = vf_set1(0.0f);
        for (int v = 0; v < KT / VW; v++) {
            vf e = vf_exp_nonpositive(vf_sub(sv[v], base));
            if (BF) {   /* p as bfloat16 [ROWS][KT] */
#ifdef HAVE_BF16
                const __m256bh e16 = _mm512_cvtneps_pbh(e);
                _mm256_store_si256((__m256i *)((uint16_t *)p + r * KT + VW * v), (__m256i)e16);
                e = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)e16), 16));
#endif
            } else {
                vf_store(p + r * KT + VW * v, e);
            }
            sum = vf_add(sum, e);
        }
        alpha[r] = m[r] == -INFINITY ? 0.0f : m_new == m[r] ? 1.0f : expf(m[r] - m_new);
        l[r] = l[r] * alpha[r] + vf_reduce_add(sum);
        m[r] = m_new;
    }
    /* o[r] = alpha[r] o[r] + sum_j p[r][j] V[j], VG vectors of each row at a time */
    for (int c0 = 0; c0 < NV; c0 += VG) {
        const int nc = NV - c0 < VG ? NV - c0 : VG;
        vf ov[ROWS][VG];
        for (int r = 0; r < ROWS; r++)
            for (int c = 0; c < VG; c++)
                if (c < nc) {
                    const vf x = vf_load(o + r * head_dim + VW * (c0 + c));
                    ov[r][c] = alpha[r] == 1.0f ? x : vf_mul(x, vf_set1(alpha[r]));
                }
        if (BF) {
#ifdef HAVE_BF16
            for (int64_t jp = 0; jp < KT / 2; jp++) {   /* keys 2 jp and 2 jp + 1 */
                __m512i vr[VG];
                for (int c = 0; c < VG; c++)
                    if (c < nc) vr[c] = _mm512_load_si512((const uint32_t *)vv + jp * head_dim + VW * (c0 + c));
                for (int r = 0; r < ROWS; r++) {
                    const __m512bh pj = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)p)[r * (KT / 2) + jp]);
                    for (int c = 0; c < VG; c++)
                        if (c < nc) ov[r][c] = _mm512_dpbf16_ps(ov[r][c], (__m512bh)vr[c], pj);
                }
            }
#endif
        } else {
            for (int64_t j = 0; j < KT; j++) {
                vf vr[VG];
                for (int c = 0; c < VG; c++)
                    if (c < nc) vr[c] = vf_load((const float *)vv + j * head_dim + VW * (c0 + c));
                for (int r = 0; r < ROWS; r++) {
                    const vf pj = vf_set1(p[r * KT + j]);
                    for (int c = 0; c < VG; c++)
                        if (c < nc) ov[r][c] = vf_fmadd(pj, vr[c], ov[r][c]);
                }
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int c = 0; c < VG; c++)
                if (c < nc) vf_store(o + r * head_dim + VW * (c0 + c), ov[r][c]);
    }
}

/* The task with CH = head_dim / 16 and BF (bf16 dot products) constant at the call site. */
static ALWAYS_INLINE void run_prefill_task(const int CH, const int BF, const prefill_task *task,
                                           const task_scratch *sc) {
    const prefill_task t = *task;   /* a local copy: the stores cannot alias its fields */
    const int64_t head_dim = 16 * CH, first = t.seq_len - t.num_q;   /* position of query row 0 */
    const int64_t rows = t.num_q - t.r0 < QT ? t.num_q - t.r0 : QT;
    const int64_t last = first + t.r0 + rows - 1 - t.key0;   /* gathered index of the task's last position */
    const int64_t tile_bytes = head_dim * KT * (BF ? 2 : 4);
    memset(sc->o, 0, sizeof(float) * (size_t)(QT * head_dim));
    for (int r = 0; r < QT; r++) { sc->m[r] = -INFINITY; sc->l[r] = 0.0f; }
    if (BF) {   /* the task's query rows, rounded to bfloat16 once */
#ifdef HAVE_BF16
        for (int64_t r = 0; r < rows; r++)
            for (int c = 0; c < CH; c++)
                _mm256_store_si256((__m256i *)(sc->q16 + r * head_dim + 16 * c),
                                   (__m256i)_mm512_cvtneps_pbh(vf_loadu(t.q + ((t.r0 + r) * t.heads + t.h) * head_dim
                                                                        + 16 * c)));
#endif
    }
    /* the first tile any row of the task sees */
    const int64_t lowest = t.window > 0 ? first + t.r0 - t.window + 1 - t.key0 : 0;
    for (int64_t tile = lowest > 0 ? lowest / KT : 0; tile * KT <= last; tile++) {
        const void *kt = (const char *)t.kt + tile * tile_bytes, *vv = (const char *)t.vv + tile * tile_bytes;
        for (int64_t b = 0; b < rows; b += ROWS) {
            const void *qr[ROWS];
            int64_t pos[ROWS];
            for (int r = 0; r < ROWS; r++) {   /* rows past the task's repeat its first (never stored) */
                const int64_t i = b + r < rows ? b + r : 0;
                qr[r] = BF ? (const void *)(sc->q16 + i * head_dim) : t.q + ((t.r0 + i) * t.heads + t.h) * head_dim;
                pos[r] = first + t.r0 + i - t.key0;
            }
            const int64_t block_last = pos[0] + (rows - b < ROWS ? rows - b : ROWS) - 1;
            if (tile * KT > block_last) continue;   /* the block's rows are all before the tile */
            if (t.window > 0 && (tile + 1) * KT <= pos[0] - t.window + 1) continue;   /* wholly before its window */
            tile_rows(CH, BF, &t, qr, pos, kt, vv, tile * KT, sc->o + b * head_dim, sc->m + b, sc->l + b, sc->p);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = sc->l[r] > 0.0f ? 1.0f / sc->l[r] : 0.0f;
        float *dst = t.out + ((t.r0 + r) * t.heads + t.h) * head_dim;
        for (int c = 0; c < 16 * CH / VW; c++)
            vf_storeu(dst + VW * c, vf_mul(vf_load(sc->o + r * head_dim + VW * c), vf_set1(inv)));
    }
}

static ALWAYS_INLINE void run_prefill_task_ch(const int BF, const prefill_task *t, int64_t head_dim,
                                              const task_scratch *sc) {
    switch (head_dim / 16) {
        case 1: run_prefill_task(1, BF, t, sc); break;
        case 2: run_prefill_task(2, BF, t, sc); break;
        case 3: run_prefill_task(3, BF, t, sc); break;
        case 4: run_prefill_task(4, BF, t, sc); break;
        case 5: run_prefill_task(5, BF, t, sc); break;
        case 6: run_prefill_task(6, BF, t, sc); break;
        case 7: run_prefill_task(7, BF, t, sc); break;
        case 8: run_prefill_task(8, BF, t, sc); break;
        case 9: run_prefill_task(9, BF, t, sc); break;
        case 10: run_prefill_task(10, BF, t, sc); break;
        case 11: run_prefill_task(11, BF, t, sc); break;
        case 12: run_prefill_task(12, BF, t, sc); break;
        case 13: run_prefill_task(13, BF, t, sc); break;
        case 14: run_prefill_task(14, BF, t, sc); break;
        case 15: run_prefill_task(15, BF, t, sc); break;
        case 16: run_prefill_task(16, BF, t, sc); break;
        default: break;
    }
}

/* One key's K (into column `col` of its tile's transposed K) and V (a row), from cache offset `row`,
 * or zeros where row < 0 (past seq_len), as float32. */
static ALWAYS_INLINE void gather_key(const int kv_type, const void *k, const void *v, int64_t row, int64_t head_dim,
                                     float *kt, int64_t col, float *vv) {
    if (row < 0) {
        for (int64_t d = 0; d < head_dim; d++) kt[d * KT + col] = vv[d] = 0.0f;
        return;
    }
    for (int64_t d = 0; d < head_dim; d++) {
        kt[d * KT + col] = kv_value(k, row, d, head_dim, kv_type);
        vv[d] = kv_value(v, row, d, head_dim, kv_type);
    }
}

/* The same from a bfloat16 cache into the pairs of gathered_kv's bf16 layout: key `col` of its tile,
 * kt / vv the tile's. */
static inline void gather_key_bf16(const uint16_t *k, const uint16_t *v, int64_t row, int64_t head_dim,
                                   uint32_t *kt, int64_t col, uint16_t *vv) {
    for (int64_t dp = 0; dp < head_dim / 2; dp++) {
        uint32_t pair = 0;
        if (row >= 0) memcpy(&pair, k + row + 2 * dp, sizeof pair);
        kt[dp * KT + col] = pair;
    }
    uint16_t *dst = vv + (col / 2) * head_dim * 2 + col % 2;
    for (int64_t d = 0; d < head_dim; d++) dst[2 * d] = row >= 0 ? v[row + d] : 0;
}

static int prefill(const float *q, const void *k, const void *v, const int64_t *table, int64_t seq_len,
                   int64_t num_q, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                   int64_t block_stride, float scale, int64_t window, float softcap, int kv_type, int num_threads) {
    if (head_dim % 16 != 0 || head_dim > 16 * MAX_CHUNKS || num_q > seq_len) return -1;
#ifdef HAVE_BF16
    const int bf16 = kv_type == TM_KV_BF16;
#else
    const int bf16 = 0;
#endif
    const size_t esize = bf16 ? 2 : 4;
    /* The first key the first query row sees, and the tiles from the one that holds it: tiles start
     * at multiples of KT whatever the chunk, so a row's sums (tile by tile, and bf16's pairs of keys)
     * run in the same order in any chunk: its result does not depend on the chunk. The keys of that
     * tile before first_seen are zeros (their blocks may be gone: never read). */
    const int64_t first_seen = first_key(seq_len - num_q, window);
    const int64_t key0 = first_seen / KT * KT, tiles = (seq_len - key0 + KT - 1) / KT, keys = tiles * KT;
    const gathered_kv g = {aligned_alloc(64, esize * (size_t)(kv_heads * keys * head_dim)),
                           aligned_alloc(64, esize * (size_t)(kv_heads * keys * head_dim)),
                           key0, tiles};
    if (g.kt == NULL || g.vv == NULL) { free(g.kt); free(g.vv); return 1; }
    const int64_t group = heads / kv_heads, tasks_per_head = (num_q + QT - 1) / QT;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for collapse(2) schedule(static)
        for (int64_t kh = 0; kh < kv_heads; kh++)
            for (int64_t i = 0; i < keys; i++) {   /* key position key0 + i */
                const int64_t pos = g.key0 + i;
                const int64_t row = pos >= first_seen && pos < seq_len
                                    ? table[pos / block_size] * block_stride
                                      + (pos % block_size * kv_heads + kh) * kv_row_elems(head_dim, kv_type)
                                    : -1;
                const int64_t tile0 = (kh * keys + i / KT * KT) * head_dim;   /* the tile's first element */
                if (bf16) {
                    gather_key_bf16(k, v, row, head_dim, (uint32_t *)((uint16_t *)g.kt + tile0), i % KT,
                                    (uint16_t *)g.vv + tile0);
                    continue;
                }
                float *kt = (float *)g.kt + tile0, *vv = (float *)g.vv + (kh * keys + i) * head_dim;
                if (kv_type == TM_KV_BF16) gather_key(TM_KV_BF16, k, v, row, head_dim, kt, i % KT, vv);
                else if (kv_type == TM_KV_I8) gather_key(TM_KV_I8, k, v, row, head_dim, kt, i % KT, vv);
                else gather_key(TM_KV_F32, k, v, row, head_dim, kt, i % KT, vv);
            }
        /* the task scratch: outputs [QT][head_dim], maxima [QT], sums [QT], probabilities [ROWS][KT],
         * bfloat16 query rows [QT][head_dim] */
        const size_t floats = (size_t)(QT * head_dim + 2 * QT + ROWS * KT);
        float *buf = aligned_alloc(64, sizeof(float) * floats + sizeof(uint16_t) * (size_t)(QT * head_dim));
        if (buf == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        const task_scratch sc = {buf, buf + QT * head_dim, buf + QT * head_dim + QT, buf + QT * head_dim + 2 * QT,
                                 (uint16_t *)(buf + floats)};
        /* without a window, later tasks see more keys: hand them out first, dynamically */
        #pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < heads * tasks_per_head; i++) {
            if (buf == NULL) continue;
            const int64_t h = i % heads, kh = h / group;
            const int64_t kv0 = kh * keys * head_dim * (int64_t)esize;   /* the kv head's gathered bytes */
            const prefill_task t = {q, out, (const char *)g.kt + kv0, (const char *)g.vv + kv0, g.key0,
                                    seq_len, num_q, heads, h, (tasks_per_head - 1 - i / heads) * QT, window, scale,
                                    softcap};
#ifdef HAVE_BF16
            if (bf16) {
                run_prefill_task_ch(1, &t, head_dim, &sc);
                continue;
            }
#endif
            run_prefill_task_ch(0, &t, head_dim, &sc);
        }
        free(buf);
    }
    free(g.kt); free(g.vv);
    return failed;
}
#else
static int prefill(const float *q, const void *k, const void *v, const int64_t *table, int64_t seq_len,
                   int64_t num_q, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                   int64_t block_stride, float scale, int64_t window, float softcap, int kv_type, int num_threads) {
    (void)q; (void)k; (void)v; (void)table; (void)seq_len; (void)num_q; (void)out; (void)heads; (void)kv_heads;
    (void)head_dim; (void)block_size; (void)block_stride; (void)scale; (void)window; (void)softcap; (void)kv_type;
    (void)num_threads;
    return -1;
}
#endif

int paged_prefill(const float *q, const void *k, const void *v, int kv_type, const int64_t *table, int64_t seq_len,
                  int64_t num_q, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                  int64_t block_stride, float scale, int64_t window, float softcap, int num_threads) {
    if (kv_type != TM_KV_F32 && kv_type != TM_KV_BF16 && kv_type != TM_KV_I8) return -1;
    return prefill(q, k, v, table, seq_len, num_q, out, heads, kv_heads, head_dim, block_size, block_stride, scale,
                   window, softcap, kv_type, num_threads);
}

int paged_prefill_available(void) {
#ifdef HAVE_VF
    return 1;
#else
    return 0;
#endif
}

int paged_prefill_bf16_dots(void) {
#if defined(HAVE_VF) && defined(HAVE_BF16)
    return 1;
#else
    return 0;
#endif
}

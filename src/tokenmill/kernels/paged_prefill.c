/* Prefill attention over a paged KV cache, for CPUs with AVX-512: one request's num_q query rows
 * (the last num_q positions of its seq_len tokens, causal) over its K/V.
 *
 * q, out [num_q, heads, head_dim] fp32. The request's K/V of each kv head are first gathered into
 * fp32 scratch (K transposed: [head_dim][L16 + 16], so 16 keys' scores are one vector FMA per dim; V
 * [L16][head_dim]); then tasks of (query head, 4 query rows) score, softmax and sum V with the
 * rows' accumulators in registers. Keys a row does not see get probability 0 (exp(-inf)).
 *
 * Options as in paged_decode.c: a sliding window w (the row at position p sees keys p - w < j <= p:
 * the gather starts at the first key the first row sees, so blocks wholly before it are never read,
 * and each row block scores only from the 16 keys holding its first row's first key) and a logit
 * softcap c (scores -> c tanh(scores / c) after the scale). 0 turns either off.
 *
 * AVX-512 only (head_dim a multiple of 16, at most 16 * MAX_CHUNKS): returns -1 where it does not
 * apply (the caller then runs SDPA), 1 if out of memory, 0 on success. */
#include <stdlib.h>

#include "kernels.h"
#include "attention.h"

#ifdef HAVE_AVX512
#define PREFILL_ROWS 4

/* The gathered keys of a request, from position key0 on: L16 of them (zeros past seq_len) in kt
 * [kv_heads][head_dim][ks] (a zero block after them) and vv [kv_heads][L16][head_dim]. */
typedef struct {
    float *kt, *vv;
    int64_t key0, L16, ks;
} gathered_kv;

/* One query row block's job. */
typedef struct {
    const float *q;
    float *out;
    const float *kt, *vv;    /* its kv head's gathered keys */
    int64_t L16, ks, key0, seq_len, num_q, heads, h, r0, window;
    float scale, softcap;
} prefill_task;

/* One key's K (into a column of kt, stride ks) and V (into a row of vv, unless vv is NULL) from cache
 * offset `row`, or zeros where row < 0 (past seq_len). */
static ALWAYS_INLINE void gather_key(const int kv_bf16, const void *k, const void *v, int64_t row, int64_t head_dim,
                                     float *kt, int64_t ks, float *vv) {
    if (row < 0) {
        for (int64_t d = 0; d < head_dim; d++) kt[d * ks] = 0.0f;
        if (vv != NULL)
            for (int64_t d = 0; d < head_dim; d++) vv[d] = 0.0f;
        return;
    }
    for (int64_t d = 0; d < head_dim; d++) kt[d * ks] = kv_load(k, row + d, kv_bf16);
    if (vv != NULL)
        for (int64_t d = 0; d < head_dim; d++) vv[d] = kv_load(v, row + d, kv_bf16);
}

/* The task with CH = head_dim / 16 constant at the call site: scores of the block's rows for two
 * key vectors at a time (8 independent FMA chains), softmax, then the V sums with the rows'
 * accumulators in registers. */
static ALWAYS_INLINE void run_prefill_task(const int CH, const prefill_task *task, float *s) {
    const prefill_task t = *task;   /* a local copy: the score stores cannot alias its fields */
    const int64_t head_dim = 16 * CH, first = t.seq_len - t.num_q, L16 = t.L16, ks = t.ks, key0 = t.key0;
    const int64_t rows = t.num_q - t.r0 < PREFILL_ROWS ? t.num_q - t.r0 : PREFILL_ROWS;
    const int64_t last = first + t.r0 + rows - 1;                      /* the block's last position */
    const int64_t nkeys = last + 1 - key0, nblk = (nkeys + 15) / 16;   /* gathered keys it may see */
    /* the first key vector any row of the block sees */
    const int64_t lowest = t.window > 0 ? first + t.r0 - t.window + 1 - key0 : 0;
    const int64_t blo = lowest > 0 ? lowest / 16 : 0;
    const float *qr[PREFILL_ROWS];
    for (int r = 0; r < PREFILL_ROWS; r++) qr[r] = t.q + ((t.r0 + (r < rows ? r : 0)) * t.heads + t.h) * head_dim;
    /* scores: s[r][j] for blo <= j / 16 < nblk, -inf where row r does not see key j */
    for (int64_t b0 = blo; b0 < nblk; b0 += 2) {
        __m512 acc[2 * PREFILL_ROWS];
        for (int i = 0; i < 2 * PREFILL_ROWS; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < head_dim; d++) {  /* kt rows have a zero block past L16 (odd count) */
            const float *kd = t.kt + d * ks + 16 * b0;
            const __m512 k0 = _mm512_loadu_ps(kd), k1 = _mm512_loadu_ps(kd + 16);
            for (int r = 0; r < PREFILL_ROWS; r++) {
                const __m512 qd = _mm512_set1_ps(qr[r][d]);
                acc[2 * r] = _mm512_fmadd_ps(qd, k0, acc[2 * r]);
                acc[2 * r + 1] = _mm512_fmadd_ps(qd, k1, acc[2 * r + 1]);
            }
        }
        for (int64_t b = b0; b < b0 + 2 && b < nblk; b++)
            for (int r = 0; r < PREFILL_ROWS; r++) {
                const int64_t pos = first + t.r0 + r - key0;   /* in gathered keys */
                const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
                const __m512i j = _mm512_add_epi32(_mm512_set1_epi32((int)(16 * b)), lanes);
                __mmask16 seen = _mm512_cmple_epi32_mask(j, _mm512_set1_epi32((int)pos));
                if (t.window > 0)
                    seen &= _mm512_cmpgt_epi32_mask(j, _mm512_set1_epi32((int)(pos - t.window)));
                __m512 score = _mm512_mul_ps(acc[2 * r + (b - b0)], _mm512_set1_ps(t.scale));
                if (t.softcap > 0.0f) score = softcap512(score, t.softcap);
                _mm512_storeu_ps(s + r * L16 + 16 * b, _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), score));
            }
    }
    float inv[PREFILL_ROWS];
    for (int r = 0; r < PREFILL_ROWS; r++) {
        const float sum = exp_minus_max(s + r * L16 + 16 * blo, nblk - blo, NULL);
        inv[r] = sum > 0.0f ? 1.0f / sum : 0.0f;
    }
    /* out rows: sum over keys of p V, accumulators [rows][CH] in registers */
    __m512 acc[PREFILL_ROWS * 16];
    #pragma GCC unroll 64
    for (int i = 0; i < PREFILL_ROWS * CH; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 16 * blo; j < nkeys; j++) {
        __m512 vr[16];
        #pragma GCC unroll 16
        for (int c = 0; c < CH; c++) vr[c] = _mm512_loadu_ps(t.vv + j * head_dim + 16 * c);
        #pragma GCC unroll 4
        for (int r = 0; r < PREFILL_ROWS; r++) {
            const __m512 p = _mm512_set1_ps(s[r * L16 + j]);
            #pragma GCC unroll 16
            for (int c = 0; c < CH; c++) acc[r * CH + c] = _mm512_fmadd_ps(p, vr[c], acc[r * CH + c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < CH; c++)
            _mm512_storeu_ps(t.out + ((t.r0 + r) * t.heads + t.h) * head_dim + 16 * c,
                             _mm512_mul_ps(acc[r * CH + c], _mm512_set1_ps(inv[r])));
}

static ALWAYS_INLINE void run_prefill_task_any(const prefill_task *t, int64_t head_dim, float *s) {
    switch (head_dim / 16) {
        case 1: run_prefill_task(1, t, s); break;
        case 2: run_prefill_task(2, t, s); break;
        case 3: run_prefill_task(3, t, s); break;
        case 4: run_prefill_task(4, t, s); break;
        case 5: run_prefill_task(5, t, s); break;
        case 6: run_prefill_task(6, t, s); break;
        case 7: run_prefill_task(7, t, s); break;
        case 8: run_prefill_task(8, t, s); break;
        case 9: run_prefill_task(9, t, s); break;
        case 10: run_prefill_task(10, t, s); break;
        case 11: run_prefill_task(11, t, s); break;
        case 12: run_prefill_task(12, t, s); break;
        case 13: run_prefill_task(13, t, s); break;
        case 14: run_prefill_task(14, t, s); break;
        case 15: run_prefill_task(15, t, s); break;
        case 16: run_prefill_task(16, t, s); break;
        default: break;
    }
}

static int prefill(const float *q, const void *k, const void *v, const int64_t *table, int64_t seq_len,
                   int64_t num_q, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                   float scale, int64_t window, float softcap, int kv_bf16, int num_threads) {
    if (head_dim % 16 != 0 || head_dim > 16 * MAX_CHUNKS || num_q > seq_len) return -1;
    /* the first key the first query row sees */
    const int64_t first_seen = window > 0 && seq_len - num_q - window + 1 > 0 ? seq_len - num_q - window + 1 : 0;
    const int64_t L16 = (seq_len - first_seen + 15) / 16 * 16;
    const gathered_kv g = {aligned_alloc(64, sizeof(float) * (size_t)(kv_heads * head_dim * (L16 + 16))),
                           aligned_alloc(64, sizeof(float) * (size_t)(kv_heads * L16 * head_dim)),
                           first_seen, L16, L16 + 16};
    if (g.kt == NULL || g.vv == NULL) { free(g.kt); free(g.vv); return 1; }
    const int64_t group = heads / kv_heads, row_blocks = (num_q + PREFILL_ROWS - 1) / PREFILL_ROWS;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for collapse(2) schedule(static)
        for (int64_t kh = 0; kh < kv_heads; kh++)
            for (int64_t t = 0; t < g.ks; t++) {   /* key position first_seen + t */
                const int64_t pos = g.key0 + t;
                const int64_t row = pos < seq_len ? ((table[pos / block_size] * block_size + pos % block_size)
                                                     * kv_heads + kh) * head_dim : -1;
                float *kt = g.kt + kh * head_dim * g.ks + t, *vv = t < L16 ? g.vv + (kh * L16 + t) * head_dim : NULL;
                if (kv_bf16) gather_key(1, k, v, row, head_dim, kt, g.ks, vv);
                else gather_key(0, k, v, row, head_dim, kt, g.ks, vv);
            }
        float *s = aligned_alloc(64, sizeof(float) * (size_t)(PREFILL_ROWS * L16));
        if (s == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        /* without a window, later row blocks see more keys: hand them out first, dynamically */
        #pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < heads * row_blocks; i++) {
            if (s == NULL) continue;
            const int64_t h = i % heads, kh = h / group;
            const prefill_task t = {q, out, g.kt + kh * head_dim * g.ks, g.vv + kh * L16 * head_dim, L16, g.ks,
                                    g.key0, seq_len, num_q, heads, h, (row_blocks - 1 - i / heads) * PREFILL_ROWS,
                                    window, scale, softcap};
            run_prefill_task_any(&t, head_dim, s);
        }
        free(s);
    }
    free(g.kt); free(g.vv);
    return failed;
}
#else
static int prefill(const float *q, const void *k, const void *v, const int64_t *table, int64_t seq_len,
                   int64_t num_q, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                   float scale, int64_t window, float softcap, int kv_bf16, int num_threads) {
    (void)q; (void)k; (void)v; (void)table; (void)seq_len; (void)num_q; (void)out; (void)heads; (void)kv_heads;
    (void)head_dim; (void)block_size; (void)scale; (void)window; (void)softcap; (void)kv_bf16; (void)num_threads;
    return -1;
}
#endif

int paged_prefill_f32(const float *q, const void *k, const void *v, const int64_t *table, int64_t seq_len,
                      int64_t num_q, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      int64_t block_size, float scale, int64_t window, float softcap, int num_threads) {
    return prefill(q, k, v, table, seq_len, num_q, out, heads, kv_heads, head_dim, block_size, scale, window,
                   softcap, 0, num_threads);
}

int paged_prefill_bf16(const float *q, const void *k, const void *v, const int64_t *table, int64_t seq_len,
                       int64_t num_q, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       int64_t block_size, float scale, int64_t window, float softcap, int num_threads) {
    return prefill(q, k, v, table, seq_len, num_q, out, heads, kv_heads, head_dim, block_size, scale, window,
                   softcap, 1, num_threads);
}

/* The C kernels' one header: the plan structs that Python builds (kernels/__init__.py mirrors them
 * with ctypes; tests/test_kernels.py checks the sizes agree) and every exported function, each
 * defined in one unit:
 *   paged_decode.c   paged_decode, paged_decode_rotary, paged_decode_rotary_team, decode_scratch_alloc / _free
 *   paged_prefill.c  paged_prefill, paged_prefill_available, paged_prefill_bf16_dots
 *   quant_matmul.c   quant_matmul, quant_matmul_team, quant_matmul_has_simd, quant_matmul_has_amx,
 *                    quant_rows,
 *                    matmul_scratch_alloc / _free
 *   dense_matmul.c   bf16_matmul, bf16_matmul_team
 *   moe.c            sparse_moe
 *   kernels.c        decode_stack, plan_struct_size
 *   norm.c           rms_norm
 *   shm_exchange.c   shm_exchange, shm_all_reduce, shm_header_bytes
 * Their shared inline helpers live in simd.h (vector math, fixed-order sums), norm.h (RMSNorm),
 * attention.h (K/V access, softmax) and rows.h (a matmul's fused input ops); plan_matmul (below) runs a
 * plan's weight. */
#ifndef TOKENMILL_KERNELS_H
#define TOKENMILL_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* A [out_features, in_features] weight (plan_matmul runs it): packed by layers/quant.py for
 * quant_matmul (bits 4 or 8: layout there), or dense bfloat16, row-major (bits 16: `packed` holds it,
 * no scales or offsets; bf16_matmul). A quantized weight whose every offset is -zero * its scale (a
 * symmetric type: Q4_0 zero 8, Q5_0 16, Q8_0 128) stores no offsets: offsets NULL, m = -zero d. */
typedef struct {
    const uint8_t *packed;
    const uint16_t *scales;     /* fp16, or NULL (bits 16) */
    const uint16_t *offsets;    /* fp16, or NULL (bits 16, or symmetric) */
    int64_t out_features;
    int64_t in_features;
    int64_t bits;               /* 4 or 8 (quantized), 16 (dense bfloat16) */
    int64_t zero;               /* with offsets NULL and bits 4 or 8: m = -zero d; else unused */
    int64_t int8_activations;   /* bits 4 or 8: 1 rounds the activations to one int8 plane per group (llama.cpp's
                                   rounding), 0 to two (quant_matmul.c); else unused */
} tm_weight;

/* K/V cache element types. A float32 or bfloat16 row of a (token, kv head) is its head_dim values. An
 * int8 row is head_dim int8 values q, then one bfloat16 scale s per group of TM_KV_GROUP values (the
 * last group may be shorter), each value being q * s: each group quantized symmetrically,
 * s = bf16(max |x| / 127), q = round-half-even(x / s) clamped to +-127; llama.cpp's q8_0 in
 * granularity and bytes (layers/attention.py quantize_kv, the same bits). */
enum { TM_KV_F32 = 0, TM_KV_BF16 = 1, TM_KV_I8 = 2 };
#define TM_KV_GROUP 32

/* x + o_proj(attention(rotary(qk_norm(qkv_proj(rmsnorm(x)) + qkv_bias)))) for one decode step, K/V
 * written to the cache. Built by layers/self_attention.py (RotaryAttention.plan) only for options this
 * code implements. */
typedef struct {
    tm_weight qkv, o;
    const float *qkv_bias;      /* [(heads + 2 kv_heads) head_dim], or NULL */
    const float *norm;          /* the input RMSNorm's weight [hidden] */
    float norm_eps;
    float scale;                /* softmax scale of the scores */
    void *k_cache, *v_cache;    /* [num_blocks, block_size, kv_heads, row] (TM_KV_* rows), blocks block_stride apart */
    int64_t kv_type;            /* the cache's TM_KV_* type */
    int64_t heads, kv_heads, head_dim, block_size, block_stride;
    int64_t sliding_window;     /* w: the query at p sees keys p - w < k <= p; 0: all keys */
    float logit_softcap;        /* c: scores -> c tanh(scores / c) after the scale; 0: none */
    const float *q_norm, *k_norm;   /* per-head RMSNorm weights [head_dim] before the rotation, or NULL */
    float qk_norm_eps;
    int64_t kv_group;           /* its KV cache group: the decode_stack `groups` entry it reads */
} tm_attention_plan;

/* The activation fused into quant_matmul's input pass (its `gated` argument): none, or act(gate) * up
 * of a fused [gate | up] input with act SiLU (SwiGLU) or GELU's tanh approximation (GeGLU). */
enum { TM_GATE_NONE = 0, TM_GATE_SILU = 1, TM_GATE_GELU_TANH = 2 };

/* x + down_proj(act(gate) * up), [gate | up] = gate_up_proj(rmsnorm(x)) (layers/mlp.py GatedMLP.plan). */
typedef struct {
    tm_weight gate_up, down;
    const float *norm;          /* the pre-MLP RMSNorm's weight [hidden] */
    float norm_eps;
    int64_t activation;         /* TM_GATE_SILU or TM_GATE_GELU_TANH */
} tm_mlp_plan;

/* x + moe(rmsnorm(x)) for a sparse mixture-of-experts MLP whose experts are all quantized (moe.c
 * sparse_moe: the routing and the sum; layers/moe.py SparseMoE.plan). */
typedef struct {
    const tm_weight *gate_up, *down;  /* [num_experts] each: an expert's [gate | up] and down */
    const float *router;        /* [num_experts, hidden] float32 */
    const float *norm;          /* the pre-MLP RMSNorm's weight [hidden], or NULL (x is normed already) */
    float norm_eps;
    int64_t num_experts, top_k;
    int64_t renormalize;        /* 1: the top_k weights are divided by their sum */
    int64_t activation;         /* TM_GATE_SILU or TM_GATE_GELU_TANH, every expert's */
    const tm_weight *shared_gate_up, *shared_down;  /* a shared expert every row passes through, or NULL */
    const float *shared_gate;   /* its gate's weight [hidden]: its output is scaled by sigmoid(gate . h) */
} tm_moe_plan;

/* A decoder layer (layers/decoder.py DecoderLayer.plan):
 *   x = x + out_norm(attention block(x)),  x = x + out_norm(mlp block(x))
 * where out_norm is the identity, or with "sandwich" norms (Gemma 2/3) an RMSNorm of its own, and
 * the mlp block is `mlp`, or `moe` where that is not NULL (then without a sandwich norm). */
typedef struct {
    tm_attention_plan attn;
    tm_mlp_plan mlp;
    const float *attn_out_norm, *mlp_out_norm;  /* the sandwich norms' weights [hidden], or NULL */
    float attn_out_norm_eps, mlp_out_norm_eps;
    int64_t rope_local;         /* 1: the layer rotates with decode_stack's local table, 0: the global one */
    const tm_moe_plan *moe;     /* the layer's mixture of experts (then `mlp` is unused), or NULL */
} tm_layer_plan;

/* The shared mapping of a tensor-parallel group on one machine (tokenmill/parallel.py SharedExchange). */
typedef struct {
    uint8_t *region;            /* headers, then data[2][size][slot_bytes] (shm_exchange.c) */
    int64_t slot_bytes;
    int64_t *seq;               /* exchanges made so far: shared by Python and C, advanced by each */
    const int64_t *peer_pids;   /* processes whose death ends a wait (rank 0: its workers), or NULL */
    int64_t num_peer_pids;
    int64_t timeout_us;         /* 0: wait as long as it takes (a worker: it exits with the engine) */
    int64_t *stats;             /* [exchanges, microseconds spent in them] */
    int32_t rank, size;
} tm_shm;

/* A decode step's block tables and cache slots in one KV cache group (engine/kv_cache.py: layers that
 * mix full and sliding-window attention keep a table per group): slots [batch], block_tables
 * [batch, max_blocks]. */
typedef struct {
    const int64_t *slots;
    const int64_t *block_tables;
    int64_t max_blocks;
} tm_kv_group;

/* sizeof of each plan struct, for the ctypes mirror's test: 0 tm_weight, 1 tm_attention_plan,
 * 2 tm_mlp_plan, 3 tm_layer_plan, 4 tm_shm, 5 tm_moe_plan, 6 tm_kv_group. */
int64_t plan_struct_size(int which);

/* A decode step through `num_layers` layers: x [batch, hidden] fp32 (hidden: every layer's qkv
 * in_features) updated in place; cos/sin [batch, head_dim] (full-width rotary tables at each row's
 * position; cos_local/sin_local the same for layers with rope_local, else NULL), `groups`: the
 * block tables and slots of each of `num_groups` KV cache groups, seq_lens [batch]. `shm`: this
 * rank's tensor-parallel group (the layers are its part: o and down row-parallel, their outputs
 * all-reduced), or NULL. Returns 1 if out of memory, 2 for a plan this code cannot run (an unknown
 * weight, activation or cache type, a local layer without local tables, a KV cache group out of
 * range, a mixture of experts under tensor parallelism or with a sandwich norm), 3 if an all-reduce
 * failed (shm_exchange's -1 / -2). */
int decode_stack(const tm_layer_plan *layers, int64_t num_layers, float *x, int64_t batch, const float *cos,
                 const float *sin, const float *cos_local, const float *sin_local, const tm_kv_group *groups,
                 int64_t num_groups, const int64_t *seq_lens, const tm_shm *shm, int num_threads);

/* out [rows, hidden] = residual + moe(rmsnorm(x)) for x [rows, hidden] (moe.c; residual may be NULL: out
 * = moe(...); out may be x or residual). Returns 1 if out of memory. */
int sparse_moe(const tm_moe_plan *plan, const float *x, int64_t rows, const float *residual, float *out,
               int num_threads);

/* y [mrows, n] = f(x) W^T (+ residual) for a quantized weight w [n, k] (bits 4 or 8; quant_matmul.c);
 * f: the `gated` activation (TM_GATE_*), then an RMSNorm with weight norm_w (or NULL). generic: force
 * the portable C loops. Returns 1 if out of memory. */
int quant_matmul(const float *x, int64_t mrows, const tm_weight *w, int gated, const float *norm_w, float eps,
                 const float *residual, float *y, int generic, int num_threads);
/* 1 where quant_matmul has its VNNI path (AVX-512 builds); 0 where it runs the AVX2 path (x86-64-v3
 * builds) or the portable loops. */
int quant_matmul_has_simd(void);
/* 1 where quant_matmul runs blocks of 16 activation rows on AMX tiles, and a step of 10 to 15 rows
 * as one block (a build for an AMX CPU, on a Linux that granted the tile state); the rows left
 * over, and steps of fewer than 10 rows, take VNNI. */
int quant_matmul_has_amx(void);

/* y [m, n] fp32 = f(x) W^T (+ residual) for a dense bfloat16 W [n, k] and a few fp32 rows x (dense_matmul.c);
 * f and its arguments as quant_matmul's. generic: force the portable C loops. Returns 1 if out of memory. */
int bf16_matmul(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, int gated, const float *norm_w,
                float eps, const float *residual, float *y, int generic, int num_threads);

/* Kernels as teams. A parallel region costs its threads a start and an end (about three barriers'
 * time), which at one row per step adds up over a decode step's ~150 kernel calls; so decode_stack
 * runs its layers in one region, and calls these forms of the kernels: every thread of the region
 * calls them alike (one thread outside any region runs them alone), their loops are orphaned
 * `omp for`s, each ending in a barrier, and their scratch is allocated by the caller, shared by the
 * team. quant_matmul, bf16_matmul, paged_decode and paged_decode_rotary are these inside a region of
 * their own. */

/* A matmul's scratch for up to `rows` rows of k inputs, for the `kinds` of matmul it serves (or-ed):
 * TM_SCRATCH_QUANT, quantized planes and their scales (q [rows][2k], dx, bx [rows][k / 32]; x16 on AVX2
 * builds); TM_SCRATCH_FUSED, the rows after the fused input ops (rows [rows][k]); TM_SCRATCH_DENSE,
 * dense_matmul's permuted rows (xp, 64-byte aligned). The others are NULL. */
typedef struct {
    int8_t *q;
    float *dx, *bx;
    int16_t *x16;
    float *rows, *xp;
} tm_matmul_scratch;
enum { TM_SCRATCH_QUANT = 1, TM_SCRATCH_FUSED = 2, TM_SCRATCH_DENSE = 4 };
int matmul_scratch_alloc(tm_matmul_scratch *s, int64_t rows, int64_t k, int kinds);   /* 1 if out of memory */
void matmul_scratch_free(tm_matmul_scratch *s);
void quant_matmul_team(const float *x, int64_t mrows, const tm_weight *w, int gated, const float *norm_w, float eps,
                       const float *residual, float *y, int generic, const tm_matmul_scratch *s);
void bf16_matmul_team(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, int gated,
                      const float *norm_w, float eps, const float *residual, float *y, int generic,
                      const tm_matmul_scratch *s);

/* The matmul of a plan's weight in a team (decode_stack): quant_matmul_team, or bf16_matmul_team for
 * a dense one. */
static inline void plan_matmul_team(const tm_weight *w, const float *x, int64_t rows, int gated, const float *norm_w,
                                    float eps, const float *residual, float *y, const tm_matmul_scratch *s) {
    if (w->bits == 16)
        bf16_matmul_team(x, rows, w->in_features, (const uint16_t *)w->packed, w->out_features, gated, norm_w, eps,
                         residual, y, 0, s);
    else
        quant_matmul_team(x, rows, w, gated, norm_w, eps, residual, y, 0, s);
}

/* The matmul of a plan's weight (sparse_moe's experts): quant_matmul, or bf16_matmul for a dense one. */
static inline int plan_matmul(const tm_weight *w, const float *x, int64_t rows, int gated, const float *norm_w,
                              float eps, const float *residual, float *y, int num_threads) {
    if (w->bits == 16)
        return bf16_matmul(x, rows, w->in_features, (const uint16_t *)w->packed, w->out_features, gated, norm_w, eps,
                           residual, y, 0, num_threads);
    return quant_matmul(x, rows, w, gated, norm_w, eps, residual, y, 0, num_threads);
}

/* out [count, in_features] fp32: rows `ids` of a quantized weight, dequantized (quant_matmul.c). */
void quant_rows(const tm_weight *w, const int64_t *ids, int64_t count, float *out);

/* RMSNorm of each row of x [rows, n] with weight w [n] into out (norm.h; out may be x): the one RMSNorm
 * of every kernel here. generic: force the portable sum (the same bits). */
void rms_norm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *out, int generic,
              int num_threads);

/* Tensor-parallel ranks of one machine exchanging through a shared mapping (shm_exchange.c: layout
 * and protocol). shm_exchange publishes nbytes <= slot_bytes of data and waits for every rank's;
 * shm_all_reduce sums x [n] (float32, or bfloat16 with bf16 = 1) over the ranks in rank order.
 * Both return 0, -1 on timeout, -2 if a process in peer_pids died; shm_all_reduce -3 if a rank sent
 * another size (out of step). */
int32_t shm_exchange(const tm_shm *shm, const uint8_t *data, int64_t nbytes);
int32_t shm_all_reduce(const tm_shm *shm, void *x, int64_t n, int32_t bf16);
int64_t shm_header_bytes(void);

/* Decode attention, one query row per request (paged_decode.c): q/out [batch, heads, head_dim] fp32,
 * k/v [num_blocks, block_size, kv_heads, row] (rows of the TM_KV_* kv_type; block b starts at element
 * b * block_stride, the rest contiguous), block_tables [batch, max_blocks], seq_lens [batch].
 * window: sliding window (0: none); softcap: logit softcap (0: none); generic: force the portable C
 * path. Return 1 if out of memory, 2 for an unknown kv_type. */
int paged_decode(const float *q, const void *k, const void *v, int kv_type, const int64_t *block_tables,
                 int64_t max_blocks, const int64_t *seq_lens, float *out, int64_t batch, int64_t heads,
                 int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t block_stride, float scale,
                 int64_t window, float softcap, int num_threads, int generic);
/* The same from the fused projection qkv [batch, (heads + 2 kv_heads) head_dim]: q/k RMSNorms per
 * head (q_norm / k_norm weights [head_dim], or NULL), rotary (cos/sin [batch, head_dim]), K/V written
 * to slots [batch] (an int8 cache quantizes each row), then attention; out [batch, heads * head_dim]. */
int paged_decode_rotary(const float *qkv, const float *cos, const float *sin, const int64_t *slots, void *k,
                        void *v, int kv_type, const int64_t *block_tables, int64_t max_blocks,
                        const int64_t *seq_lens, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t block_stride, float scale, int64_t window,
                        float softcap, const float *q_norm, const float *k_norm, float qk_norm_eps, int num_threads,
                        int generic);
/* A decode step's scratch for a team (paged_decode.c): the rotated queries [batch][heads][head_dim],
 * each request's runs and keys per run [2 batch + 1] (flash-decoding's split) and each entry's task
 * rows [batch] (paged_decode.c "Verify rows"), and the runs' partial outputs and softmax stats, for
 * up to `heads` x head_dim per request. */
typedef struct {
    float *q;
    int64_t *runs;
    float *part, *stats;
} tm_decode_scratch;
int decode_scratch_alloc(tm_decode_scratch *s, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int num_threads);   /* 1 if out of memory */
void decode_scratch_free(tm_decode_scratch *s);
/* paged_decode_rotary in a team (above: "Kernels as teams"); *failed set to 1 if out of memory. The kv_type
 * must be a valid one. */
void paged_decode_rotary_team(const float *qkv, const float *cos, const float *sin, const int64_t *slots, void *k,
                              void *v, int kv_type, const int64_t *block_tables, int64_t max_blocks,
                              const int64_t *seq_lens, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                              int64_t head_dim, int64_t block_size, int64_t block_stride, float scale, int64_t window,
                              float softcap, const float *q_norm, const float *k_norm, float norm_eps, int num_threads,
                              int generic, const tm_decode_scratch *sc, int *failed);
/* Causal prefill attention of one request's last num_q positions (paged_prefill.c, AVX-512 and AVX2
 * builds): q/out [num_q, heads, head_dim], table its block table. Returns -1 where it does not apply. */
int paged_prefill(const float *q, const void *k, const void *v, int kv_type, const int64_t *table, int64_t seq_len,
                  int64_t num_q, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                  int64_t block_stride, float scale, int64_t window, float softcap, int num_threads);
/* 1 where this build has paged_prefill (AVX-512 or AVX2), else 0. */
int paged_prefill_available(void);
/* 1 where its dot products on a bfloat16 cache are bfloat16 ones (AVX512-BF16), else 0. */
int paged_prefill_bf16_dots(void);

#endif

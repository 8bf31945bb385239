/* The C kernels' one header: the plan structs that Python builds (kernels/__init__.py mirrors them
 * with ctypes; tests/test_kernels.py checks the sizes agree) and every exported function. */
#ifndef TOKENMILL_KERNELS_H
#define TOKENMILL_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* A [out_features, in_features] weight packed by layers/quant.py for quant_matmul (layout there). */
typedef struct {
    const uint8_t *packed;
    const uint16_t *scales;     /* fp16 */
    const uint16_t *offsets;    /* fp16 */
    int64_t out_features;
    int64_t in_features;
    int64_t bits;               /* 4 or 8 */
} tm_quant_weight;

/* x + o_proj(attention(rotary(qkv_proj(rmsnorm(x)) + qkv_bias))) for one decode step, K/V written
 * to the cache. Built by layers/self_attention.py (RotaryAttention.plan) only for options this
 * code implements. */
typedef struct {
    tm_quant_weight qkv, o;
    const float *qkv_bias;      /* [(heads + 2 kv_heads) head_dim], or NULL */
    const float *norm;          /* the input RMSNorm's weight [hidden] */
    float norm_eps;
    float scale;                /* softmax scale of the scores */
    void *k_cache, *v_cache;    /* [num_blocks, block_size, kv_heads, head_dim] */
    int64_t kv_bf16;            /* cache dtype: 1 bfloat16, 0 float32 */
    int64_t heads, kv_heads, head_dim, block_size;
} tm_attention_plan;

/* x + down_proj(silu(gate) * up), [gate | up] = gate_up_proj(rmsnorm(x)) (layers/mlp.py GatedMLP.plan). */
typedef struct {
    tm_quant_weight gate_up, down;
    const float *norm;          /* the pre-MLP RMSNorm's weight [hidden] */
    float norm_eps;
} tm_mlp_plan;

typedef struct {
    tm_attention_plan attn;
    tm_mlp_plan mlp;
} tm_layer_plan;

/* sizeof of each plan struct, for the ctypes mirror's test: 0 tm_quant_weight, 1 tm_attention_plan,
 * 2 tm_mlp_plan, 3 tm_layer_plan. */
int64_t plan_struct_size(int which);

/* A decode step through `num_layers` layers: x [batch, hidden] fp32 (hidden: every layer's qkv in_features) updated in place; cos/sin
 * [batch, head_dim] (full-width rotary tables at each row's position), slots [batch], block_tables
 * [batch, max_blocks], seq_lens [batch]. Returns 1 if out of memory. */
int decode_stack(const tm_layer_plan *layers, int64_t num_layers, float *x, int64_t batch, const float *cos,
                 const float *sin, const int64_t *slots, const int64_t *block_tables,
                 int64_t max_blocks, const int64_t *seq_lens, int num_threads);

int quant_matmul(const float *x, int64_t mrows, int64_t k, const uint8_t *w, const uint16_t *d,
                 const uint16_t *m, int64_t n, int bits, int gated, const float *norm_w, float eps,
                 const float *residual, float *y, int generic, int num_threads);
int quant_matmul_has_simd(void);
void quant_rows(const uint8_t *w, const uint16_t *d, const uint16_t *m, int64_t k, int bits,
                const int64_t *ids, int64_t count, float *out);

int paged_decode_f32(const float *q, const void *k, const void *v, const int64_t *block_tables,
                     int64_t max_blocks, const int64_t *seq_lens, float *out, int64_t batch, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, int num_threads,
                     int generic);
int paged_decode_bf16(const float *q, const void *k, const void *v, const int64_t *block_tables,
                      int64_t max_blocks, const int64_t *seq_lens, float *out, int64_t batch, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, int num_threads,
                      int generic);
int paged_decode_rotary_f32(const float *qkv, const float *cos, const float *sin, const int64_t *slots, void *k,
                            void *v, const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens,
                            float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t block_size, float scale, int num_threads, int generic);
int paged_decode_rotary_bf16(const float *qkv, const float *cos, const float *sin, const int64_t *slots, void *k,
                             void *v, const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens,
                             float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             int64_t block_size, float scale, int num_threads, int generic);
int paged_prefill_f32(const float *q, const void *k, const void *v, const int64_t *table, int64_t seq_len,
                      int64_t num_q, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      int64_t block_size, float scale, int num_threads);
int paged_prefill_bf16(const float *q, const void *k, const void *v, const int64_t *table, int64_t seq_len,
                       int64_t num_q, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       int64_t block_size, float scale, int num_threads);

#endif

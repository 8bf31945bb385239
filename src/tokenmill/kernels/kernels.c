/* tokenmill's C kernels, built as one library: decode attention (paged_attention.c), the quantized
 * matmul (quant_matmul.c), and decode_stack below, which runs a whole Llama decoder stack for one
 * decode step by calling them in sequence. */
#include "paged_attention.c"
#include "quant_matmul.c"

/* Per layer, `ptrs` holds these pointers (the packed weights, scales and offsets of the four
 * projections, the two RMSNorm weights, the layer's K and V caches, the q/k/v bias or NULL) and
 * `bits` the projections' bits. */
enum { QKV_W, QKV_D, QKV_M, O_W, O_D, O_M, GU_W, GU_D, GU_M, DN_W, DN_D, DN_M, IN_NORM, POST_NORM,
       K_CACHE, V_CACHE, QKV_BIAS, PTRS_PER_LAYER };

/* x [batch, hidden] fp32, updated in place: for each layer,
 *   x = x + o_proj(attention(rotary(qkv_proj(rmsnorm(x)))))       (K/V written to the cache)
 *   x = x + down_proj(silu(gate) * up), [gate | up] = gate_up_proj(rmsnorm(x))
 * the same kernel calls, in the same order, as the per-layer Python path (models/llama.py), so the
 * same bits. Returns 1 if out of memory. */
int decode_stack(int64_t layers, void *const *ptrs, const int *bits, float *x, int64_t batch, int64_t hidden,
                 int64_t inter, int64_t heads, int64_t kv_heads, int64_t head_dim, float eps, const float *cos,
                 const float *sin, const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,
                 const int64_t *seq_lens, int64_t block_size, float scale, int kv_bf16, int num_threads) {
    const int64_t qkv_n = (heads + 2 * kv_heads) * head_dim, attn_n = heads * head_dim;
    float *qkv = malloc(sizeof(float) * (size_t)(batch * qkv_n));
    float *attn = malloc(sizeof(float) * (size_t)(batch * attn_n));
    float *gate_up = malloc(sizeof(float) * (size_t)(batch * 2 * inter));
    int failed = qkv == NULL || attn == NULL || gate_up == NULL;
    for (int64_t l = 0; l < layers && !failed; l++) {
        void *const *p = ptrs + l * PTRS_PER_LAYER;
        const int *b = bits + 4 * l;
        failed = quant_matmul(x, batch, hidden, p[QKV_W], p[QKV_D], p[QKV_M], qkv_n, b[0], 0, p[IN_NORM], eps,
                              NULL, qkv, 0, num_threads);
        if (!failed && p[QKV_BIAS] != NULL) {  /* added after the matmul, as the layer loop adds it */
            const float *bias = p[QKV_BIAS];
            for (int64_t i = 0; i < batch; i++)
                for (int64_t j = 0; j < qkv_n; j++) qkv[i * qkv_n + j] += bias[j];
        }
        failed = failed
              || (kv_bf16 ? paged_decode_rotary_bf16 : paged_decode_rotary_f32)(
                     qkv, cos, sin, slots, p[K_CACHE], p[V_CACHE], block_tables, max_blocks, seq_lens, attn,
                     batch, heads, kv_heads, head_dim, block_size, scale, num_threads, 0)
              || quant_matmul(attn, batch, attn_n, p[O_W], p[O_D], p[O_M], hidden, b[1], 0, NULL, 0.0f, x, x, 0,
                              num_threads)
              || quant_matmul(x, batch, hidden, p[GU_W], p[GU_D], p[GU_M], 2 * inter, b[2], 0, p[POST_NORM], eps,
                              NULL, gate_up, 0, num_threads)
              || quant_matmul(gate_up, batch, inter, p[DN_W], p[DN_D], p[DN_M], hidden, b[3], 1, NULL, 0.0f, x, x,
                              0, num_threads);
    }
    free(qkv); free(attn); free(gate_up);
    return failed;
}

/* tokenmill's C kernels, built as one library: decode attention (paged_attention.c), the quantized
 * matmul (quant_matmul.c), and decode_stack below, which runs a decoder stack for one decode step
 * by calling them in sequence, layer by layer, from the plans declared in kernels.h. */
#include "paged_attention.c"
#include "quant_matmul.c"
#include "kernels.h"

int64_t plan_struct_size(int which) {
    switch (which) {
        case 0: return (int64_t)sizeof(tm_quant_weight);
        case 1: return (int64_t)sizeof(tm_attention_plan);
        case 2: return (int64_t)sizeof(tm_mlp_plan);
        case 3: return (int64_t)sizeof(tm_layer_plan);
        default: return -1;
    }
}

static int matmul(const tm_quant_weight *w, const float *x, int64_t batch, int gated, const float *norm, float eps,
                  const float *residual, float *y, int num_threads) {
    return quant_matmul(x, batch, w->in_features, w->packed, w->scales, w->offsets, w->out_features, (int)w->bits,
                        gated, norm, eps, residual, y, 0, num_threads);
}

/* x [batch, hidden] fp32, updated in place: for each layer,
 *   x = x + o_proj(attention(rotary(qkv_proj(rmsnorm(x)) + bias)))   (K/V written to the cache)
 *   x = x + down_proj(silu(gate) * up), [gate | up] = gate_up_proj(rmsnorm(x))
 * the same kernel calls, in the same order, as the blocks' PyTorch path (layers/), so the same
 * bits. Layers may differ in shape: the scratch buffers are sized for the widest. */
int decode_stack(const tm_layer_plan *layers, int64_t num_layers, float *x, int64_t batch, const float *cos,
                 const float *sin, const int64_t *slots, const int64_t *block_tables,
                 int64_t max_blocks, const int64_t *seq_lens, int num_threads) {
    int64_t qkv_max = 0, attn_max = 0, gate_up_max = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const tm_attention_plan *a = &layers[l].attn;
        qkv_max = a->qkv.out_features > qkv_max ? a->qkv.out_features : qkv_max;
        attn_max = a->heads * a->head_dim > attn_max ? a->heads * a->head_dim : attn_max;
        gate_up_max = layers[l].mlp.gate_up.out_features > gate_up_max ? layers[l].mlp.gate_up.out_features
                                                                       : gate_up_max;
    }
    float *qkv = malloc(sizeof(float) * (size_t)(batch * qkv_max));
    float *attn = malloc(sizeof(float) * (size_t)(batch * attn_max));
    float *gate_up = malloc(sizeof(float) * (size_t)(batch * gate_up_max));
    int failed = qkv == NULL || attn == NULL || gate_up == NULL;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const tm_attention_plan *a = &layers[l].attn;
        const tm_mlp_plan *m = &layers[l].mlp;
        const int64_t qkv_n = a->qkv.out_features;
        failed = matmul(&a->qkv, x, batch, 0, a->norm, a->norm_eps, NULL, qkv, num_threads);
        if (!failed && a->qkv_bias != NULL) {  /* added after the matmul, as the layer loop adds it */
            for (int64_t i = 0; i < batch; i++)
                for (int64_t j = 0; j < qkv_n; j++) qkv[i * qkv_n + j] += a->qkv_bias[j];
        }
        failed = failed
              || (a->kv_bf16 ? paged_decode_rotary_bf16 : paged_decode_rotary_f32)(
                     qkv, cos, sin, slots, a->k_cache, a->v_cache, block_tables, max_blocks, seq_lens, attn, batch,
                     a->heads, a->kv_heads, a->head_dim, a->block_size, a->scale, num_threads, 0)
              || matmul(&a->o, attn, batch, 0, NULL, 0.0f, x, x, num_threads)
              || matmul(&m->gate_up, x, batch, 0, m->norm, m->norm_eps, NULL, gate_up, num_threads)
              || matmul(&m->down, gate_up, batch, 1, NULL, 0.0f, x, x, num_threads);
    }
    free(qkv); free(attn); free(gate_up);
    return failed;
}

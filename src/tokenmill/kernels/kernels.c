/* decode_stack: a decoder stack's decode step in one call, from the per-layer plans declared in
 * kernels.h, calling the exported kernels of the other units layer by layer. */
#include <stdlib.h>

#include "kernels.h"
#include "norm.h"

int64_t plan_struct_size(int which) {
    switch (which) {
        case 0: return (int64_t)sizeof(tm_weight);
        case 1: return (int64_t)sizeof(tm_attention_plan);
        case 2: return (int64_t)sizeof(tm_mlp_plan);
        case 3: return (int64_t)sizeof(tm_layer_plan);
        case 4: return (int64_t)sizeof(tm_shm);
        case 5: return (int64_t)sizeof(tm_moe_plan);
        case 6: return (int64_t)sizeof(tm_kv_group);
        default: return -1;
    }
}

/* x [batch, n] += rmsnorm(y) row by row (norm.h: the same bits as the layer loop's RMSNorm, then its
 * residual add); y is normed in place. */
static void add_rmsnorm(float *x, float *y, const float *w, float eps, int64_t batch, int64_t n) {
    for (int64_t b = 0; b < batch; b++) {
        rms_norm_row(y + b * n, n, w, eps, y + b * n, 0);
        for (int64_t i = 0; i < n; i++) x[b * n + i] += y[b * n + i];
    }
}

/* x + out_norm(y), y = w(a): the projection ending a block, with the residual add fused into the
 * matmul when there is no sandwich norm (tmp: [batch, hidden] scratch). Under tensor parallelism
 * (shm) w is row-parallel: y is summed over the ranks first, rank 0 adding the residual to its part
 * (layers/linear.py Linear.forward, the same bits). */
static int block_output(const tm_weight *w, const float *a, int64_t batch, int gated, const float *out_norm,
                        float eps, float *x, float *tmp, const tm_shm *shm, int num_threads) {
    const int64_t n = batch * w->out_features;
    if (out_norm == NULL) {
        const float *residual = shm == NULL || shm->rank == 0 ? x : NULL;
        if (plan_matmul(w, a, batch, gated, NULL, 0.0f, residual, x, num_threads)) return 1;
        return shm != NULL && shm_all_reduce(shm, x, n, 0) ? 3 : 0;
    }
    if (plan_matmul(w, a, batch, gated, NULL, 0.0f, NULL, tmp, num_threads)) return 1;
    if (shm != NULL && shm_all_reduce(shm, tmp, n, 0)) return 3;
    add_rmsnorm(x, tmp, out_norm, eps, batch, w->out_features);
    return 0;
}

static int valid_weight(const tm_weight *w) {
    return w->bits == 4 || w->bits == 8 || w->bits == 16;
}

static int valid_plan(const tm_layer_plan *layer, const float *cos_local, int64_t num_groups, const tm_shm *shm) {
    const int64_t act = layer->moe != NULL ? layer->moe->activation : layer->mlp.activation;
    const int64_t kv = layer->attn.kv_type;
    return (act == TM_GATE_SILU || act == TM_GATE_GELU_TANH) && (!layer->rope_local || cos_local != NULL)
           && layer->attn.kv_group >= 0 && layer->attn.kv_group < num_groups
           && valid_weight(&layer->attn.qkv) && valid_weight(&layer->attn.o)
           && (layer->moe != NULL || (valid_weight(&layer->mlp.gate_up) && valid_weight(&layer->mlp.down)))
           && (kv == TM_KV_F32 || kv == TM_KV_BF16 || kv == TM_KV_I8)
           && (layer->moe == NULL || (shm == NULL && layer->mlp_out_norm == NULL));
}

/* x [batch, hidden] fp32, updated in place: for each layer,
 *   x = x + out_norm(o_proj(attention(rotary(qk_norm(qkv_proj(rmsnorm(x)) + bias)))))   (K/V to the cache)
 *   x = x + out_norm(down_proj(act(gate) * up)), [gate | up] = gate_up_proj(rmsnorm(x))
 *       (or x + out_norm(moe(rmsnorm(x))) for a mixture of experts: moe.c)
 * the same kernel calls, in the same order, as the blocks' path in the layer loop (layers/), so the
 * same bits (out_norm: the sandwich norm where a layer has one). Layers may differ in shape: the
 * scratch buffers are sized for the widest. */
int decode_stack(const tm_layer_plan *layers, int64_t num_layers, float *x, int64_t batch, const float *cos,
                 const float *sin, const float *cos_local, const float *sin_local, const tm_kv_group *groups,
                 int64_t num_groups, const int64_t *seq_lens, const tm_shm *shm, int num_threads) {
    int64_t qkv_max = 0, attn_max = 0, gate_up_max = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const tm_attention_plan *a = &layers[l].attn;
        if (!valid_plan(&layers[l], cos_local, num_groups, shm)) return 2;
        qkv_max = a->qkv.out_features > qkv_max ? a->qkv.out_features : qkv_max;
        attn_max = a->heads * a->head_dim > attn_max ? a->heads * a->head_dim : attn_max;
        gate_up_max = layers[l].mlp.gate_up.out_features > gate_up_max ? layers[l].mlp.gate_up.out_features
                                                                       : gate_up_max;
    }
    const int64_t hidden = num_layers > 0 ? layers[0].attn.qkv.in_features : 0;
    float *qkv = malloc(sizeof(float) * (size_t)(batch * qkv_max));
    float *attn = malloc(sizeof(float) * (size_t)(batch * attn_max));
    float *gate_up = malloc(sizeof(float) * (size_t)(batch * gate_up_max + 1));   /* (0 if every layer is MoE) */
    float *out = malloc(sizeof(float) * (size_t)(batch * hidden + 1));
    int failed = qkv == NULL || attn == NULL || gate_up == NULL || out == NULL;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const tm_layer_plan *layer = &layers[l];
        const tm_attention_plan *a = &layer->attn;
        const tm_mlp_plan *m = &layer->mlp;
        const tm_kv_group *g = &groups[a->kv_group];
        const int64_t qkv_n = a->qkv.out_features;
        failed = plan_matmul(&a->qkv, x, batch, TM_GATE_NONE, a->norm, a->norm_eps, NULL, qkv, num_threads);
        if (!failed && a->qkv_bias != NULL) {  /* added after the matmul, as the layer loop adds it */
            for (int64_t i = 0; i < batch; i++)
                for (int64_t j = 0; j < qkv_n; j++) qkv[i * qkv_n + j] += a->qkv_bias[j];
        }
        failed = failed
              || paged_decode_rotary(
                     qkv, layer->rope_local ? cos_local : cos, layer->rope_local ? sin_local : sin, g->slots,
                     a->k_cache, a->v_cache, (int)a->kv_type, g->block_tables, g->max_blocks, seq_lens, attn, batch, a->heads,
                     a->kv_heads, a->head_dim, a->block_size, a->scale, a->sliding_window, a->logit_softcap, a->q_norm,
                     a->k_norm, a->qk_norm_eps, num_threads, 0);
        if (!failed)
            failed = block_output(&a->o, attn, batch, TM_GATE_NONE, layer->attn_out_norm, layer->attn_out_norm_eps,
                                  x, out, shm, num_threads);
        if (!failed && layer->moe != NULL) {   /* x + moe(rmsnorm(x)), in place */
            failed = sparse_moe(layer->moe, x, batch, x, x, num_threads);
            continue;
        }
        if (!failed)
            failed = plan_matmul(&m->gate_up, x, batch, TM_GATE_NONE, m->norm, m->norm_eps, NULL, gate_up, num_threads);
        if (!failed)
            failed = block_output(&m->down, gate_up, batch, (int)m->activation, layer->mlp_out_norm,
                                  layer->mlp_out_norm_eps, x, out, shm, num_threads);
    }
    free(qkv); free(attn); free(gate_up); free(out);
    return failed;
}

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

/* What a layer of the step reads and writes besides its plan: the step's inputs and the scratch
 * shared by the team. */
typedef struct {
    float *x;
    int64_t batch;
    const float *cos, *sin, *cos_local, *sin_local;
    const tm_kv_group *groups;
    const int64_t *seq_lens;
    const tm_shm *shm;
    int num_threads;
    float *qkv, *attn, *gate_up, *out;   /* [batch, the widest layer's] */
    tm_matmul_scratch mm;
    tm_decode_scratch dec;
    int *failed;                         /* shared: 1 out of memory, 3 an all-reduce failed */
} stack_step;

/* x + out_norm(y), y = w(a): the projection ending a block, with the residual add fused into the
 * matmul when there is no sandwich norm (y in st->out). Under tensor parallelism (shm) w is
 * row-parallel: y is summed over the ranks first, rank 0 adding the residual to its part
 * (layers/linear.py Linear.forward, the same bits). In a team, as every function here. */
static void block_output(const stack_step *st, const tm_weight *w, const float *a, int gated, const float *out_norm,
                         float eps) {
    const int64_t batch = st->batch, n = w->out_features;
    float *y = out_norm == NULL ? st->x : st->out;
    const float *residual = out_norm == NULL && (st->shm == NULL || st->shm->rank == 0) ? st->x : NULL;
    plan_matmul_team(w, a, batch, gated, NULL, 0.0f, residual, y, &st->mm);
    if (st->shm != NULL) {
        #pragma omp single
        if (shm_all_reduce(st->shm, y, batch * n, 0)) *st->failed = 3;
    }
    if (out_norm != NULL) {   /* x += rmsnorm(y) row by row (norm.h: the layer loop's RMSNorm, then its residual add) */
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; b++) {
            rms_norm_row(y + b * n, n, out_norm, eps, y + b * n, 0);
            for (int64_t i = 0; i < n; i++) st->x[b * n + i] += y[b * n + i];
        }
    }
}

/* x = x + out_norm(o_proj(attention(rotary(qk_norm(qkv_proj(rmsnorm(x)) + bias))))), K/V to the cache */
static void attention_block(const stack_step *st, const tm_layer_plan *layer) {
    const tm_attention_plan *a = &layer->attn;
    const tm_kv_group *g = &st->groups[a->kv_group];
    const int64_t batch = st->batch, qkv_n = a->qkv.out_features;
    plan_matmul_team(&a->qkv, st->x, batch, TM_GATE_NONE, a->norm, a->norm_eps, NULL, st->qkv, &st->mm);
    if (a->qkv_bias != NULL) {  /* added after the matmul, as the layer loop adds it */
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < batch; i++)
            for (int64_t j = 0; j < qkv_n; j++) st->qkv[i * qkv_n + j] += a->qkv_bias[j];
    }
    paged_decode_rotary_team(st->qkv, layer->rope_local ? st->cos_local : st->cos,
                             layer->rope_local ? st->sin_local : st->sin, g->slots, a->k_cache, a->v_cache,
                             (int)a->kv_type, g->block_tables, g->max_blocks, st->seq_lens, st->attn, batch, a->heads,
                             a->kv_heads, a->head_dim, a->block_size, a->block_stride, a->scale, a->sliding_window,
                             a->logit_softcap, a->q_norm, a->k_norm, a->qk_norm_eps, st->num_threads, 0, &st->dec,
                             st->failed);
    block_output(st, &a->o, st->attn, TM_GATE_NONE, layer->attn_out_norm, layer->attn_out_norm_eps);
}

/* x = x + out_norm(down_proj(act(gate) * up)), [gate | up] = gate_up_proj(rmsnorm(x)) */
static void mlp_block(const stack_step *st, const tm_layer_plan *layer) {
    const tm_mlp_plan *m = &layer->mlp;
    plan_matmul_team(&m->gate_up, st->x, st->batch, TM_GATE_NONE, m->norm, m->norm_eps, NULL, st->gate_up, &st->mm);
    block_output(st, &m->down, st->gate_up, (int)m->activation, layer->mlp_out_norm, layer->mlp_out_norm_eps);
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
 * same bits (out_norm: the sandwich norm where a layer has one). The layers run in one parallel
 * region (kernels.h: "Kernels as teams"), left only for a mixture of experts' MLP (sparse_moe runs
 * its experts in regions of its own). Layers may differ in shape: the scratch is sized for the
 * widest. */
int decode_stack(const tm_layer_plan *layers, int64_t num_layers, float *x, int64_t batch, const float *cos,
                 const float *sin, const float *cos_local, const float *sin_local, const tm_kv_group *groups,
                 int64_t num_groups, const int64_t *seq_lens, const tm_shm *shm, int num_threads) {
    int64_t qkv_max = 0, attn_max = 0, gate_up_max = 0, k_max = 0, kv_heads_min = 0;
    int kinds = TM_SCRATCH_FUSED;   /* (the input norms are fused into qkv and gate_up) */
    for (int64_t l = 0; l < num_layers; l++) {
        const tm_layer_plan *layer = &layers[l];
        const tm_attention_plan *a = &layer->attn;
        if (!valid_plan(layer, cos_local, num_groups, shm)) return 2;
        qkv_max = a->qkv.out_features > qkv_max ? a->qkv.out_features : qkv_max;
        attn_max = a->heads * a->head_dim > attn_max ? a->heads * a->head_dim : attn_max;
        kv_heads_min = l == 0 || a->kv_heads < kv_heads_min ? a->kv_heads : kv_heads_min;
        const tm_weight *ws[4] = {&a->qkv, &a->o, layer->moe == NULL ? &layer->mlp.gate_up : NULL,
                                  layer->moe == NULL ? &layer->mlp.down : NULL};
        for (int i = 0; i < 4; i++)
            if (ws[i] != NULL) {
                k_max = ws[i]->in_features > k_max ? ws[i]->in_features : k_max;
                kinds |= ws[i]->bits == 16 ? TM_SCRATCH_DENSE : TM_SCRATCH_QUANT;
            }
        if (layer->moe == NULL)
            gate_up_max = layer->mlp.gate_up.out_features > gate_up_max ? layer->mlp.gate_up.out_features : gate_up_max;
    }
    const int64_t hidden = num_layers > 0 ? layers[0].attn.qkv.in_features : 0;
    int failed = 0;
    stack_step st = {x, batch, cos, sin, cos_local, sin_local, groups, seq_lens, shm, num_threads,
                     malloc(sizeof(float) * (size_t)(batch * qkv_max + 1)),
                     malloc(sizeof(float) * (size_t)(batch * attn_max + 1)),
                     malloc(sizeof(float) * (size_t)(batch * gate_up_max + 1)),   /* (0 if every layer is MoE) */
                     malloc(sizeof(float) * (size_t)(batch * hidden + 1)), {0}, {0}, &failed};
    /* (one scratch of each kind, for the widest: every layer's heads x head_dim fit in attn_max) */
    if (st.qkv == NULL || st.attn == NULL || st.gate_up == NULL || st.out == NULL
        || matmul_scratch_alloc(&st.mm, batch, k_max, kinds)
        || decode_scratch_alloc(&st.dec, batch, attn_max, kv_heads_min, 1, num_threads))
        failed = 1;
    for (int64_t l = 0; l < num_layers && !failed;) {
        int64_t moe = l;   /* the next mixture-of-experts layer, or num_layers */
        while (moe < num_layers && layers[moe].moe == NULL) moe++;
        #pragma omp parallel num_threads(num_threads)
        for (int64_t i = l; i < num_layers && i <= moe; i++) {
            int stop;   /* every thread reads it before any goes on (and could fail): they agree */
            #pragma omp atomic read
            stop = failed;
            #pragma omp barrier
            if (stop) break;
            attention_block(&st, &layers[i]);
            if (i < moe) mlp_block(&st, &layers[i]);
        }
        if (moe < num_layers && !failed)   /* x + moe(rmsnorm(x)), in place */
            failed = sparse_moe(layers[moe].moe, x, batch, x, x, num_threads);
        l = moe + 1;
    }
    free(st.qkv); free(st.attn); free(st.gate_up); free(st.out);
    matmul_scratch_free(&st.mm);
    decode_scratch_free(&st.dec);
    return failed;
}

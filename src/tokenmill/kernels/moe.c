/* sparse_moe: a mixture-of-experts MLP block on the quantized CPU path, from kernels.h's
 * tm_moe_plan: routing, the experts' quantized matmuls grouped by expert and the weighted sum, in
 * one call with no Python between experts (layers/moe.py SparseMoE; its PyTorch steps are the
 * reference).
 *
 * Per row: h = rmsnorm(x); logits = router h (float32 dot products); p = softmax(logits); the top_k
 * experts by p (ties: the lower index), weights p_e, divided by their sum when `renormalize`; then
 *     out = residual + sum over the chosen e, in increasing e, of w_e * down_e(act(gate_e) * up_e)
 *           (+ sigmoid(shared_gate . h) * shared(h) with a shared expert)
 * where [gate_e | up_e] = gate_up_e(h).
 *
 * Each expert that was chosen runs once on the rows that chose it (gathered), through quant_matmul
 * with the activation fused into down's input pass. The experts (and the shared expert) are the
 * parallel tasks, a matmul on one thread each, when there are at least as many as threads: at
 * decode each expert's matmuls are small, and starting the threads for each of them would cost more
 * than the work (measured: so did prefill, on Mixtral's 8 and Qwen3-MoE's 64 experts). With fewer
 * tasks each matmul uses every thread, called outside any parallel region (a region nested in even
 * a one-thread team starts new threads every time). Their outputs are kept per (row, expert) pair
 * and summed per row in expert order afterwards, so a row's result depends neither on the other
 * rows nor on which thread ran what. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "norm.h"

/* The dot products of h with 4 consecutive rows of w [.., n]: four independent sums in one pass. */
static void dot4(const float *h, const float *w, int64_t n, float *out) {
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    #pragma omp simd reduction(+:a0, a1, a2, a3)
    for (int64_t i = 0; i < n; i++) {
        a0 += h[i] * w[i];
        a1 += h[i] * w[n + i];
        a2 += h[i] * w[2 * n + i];
        a3 += h[i] * w[3 * n + i];
    }
    out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3;
}

static float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
    #pragma omp simd reduction(+:acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* The top_k experts of the normed row h (chosen, in decreasing probability) and their weights;
 * p: [num_experts] scratch. */
static void route(const tm_moe_plan *plan, const float *h, int64_t hidden, float *p, int64_t *chosen, float *weights) {
    const int64_t n = plan->num_experts, k = plan->top_k;
    int64_t e = 0;
    for (; e + 4 <= n; e += 4) dot4(h, plan->router + e * hidden, hidden, p + e);
    for (; e < n; e++) p[e] = dot(h, plan->router + e * hidden, hidden);
    float big = -INFINITY, total = 0.0f;
    for (e = 0; e < n; e++) big = p[e] > big ? p[e] : big;
    for (e = 0; e < n; e++) {
        p[e] = expf(p[e] - big);
        total += p[e];
    }
    for (e = 0; e < n; e++) p[e] /= total;
    float kept = 0.0f;
    for (int64_t j = 0; j < k; j++) {   /* the j-th largest probability; taken ones are set to -1 */
        int64_t best = 0;
        for (e = 1; e < n; e++) best = p[e] > p[best] ? e : best;
        chosen[j] = best;
        weights[j] = p[best];
        kept += p[best];
        p[best] = -1.0f;
    }
    if (plan->renormalize)
        for (int64_t j = 0; j < k; j++) weights[j] /= kept;
}

/* One task: an expert (or the shared expert) on its `count` rows listed in `rows` (NULL: rows 0..count-1
 * of h), into y [count, hidden]. */
static int run_expert(const tm_weight *gate_up, const tm_weight *down, int activation, const float *h,
                      const int64_t *rows, int64_t count, float *y, int num_threads) {
    const int64_t hidden = gate_up->in_features;
    float *gathered = NULL;
    if (rows != NULL) {
        gathered = malloc(sizeof(float) * (size_t)(count * hidden));
        if (gathered == NULL) return 1;
        for (int64_t i = 0; i < count; i++)
            memcpy(gathered + i * hidden, h + rows[i] * hidden, sizeof(float) * (size_t)hidden);
    }
    float *mid = malloc(sizeof(float) * (size_t)(count * gate_up->out_features));
    int failed = mid == NULL
              || plan_matmul(gate_up, gathered != NULL ? gathered : h, count, TM_GATE_NONE, NULL, 0.0f, NULL, mid,
                             num_threads)
              || plan_matmul(down, mid, count, activation, NULL, 0.0f, NULL, y, num_threads);
    free(gathered); free(mid);
    return failed;
}

/* Task e: expert e on its pairs' rows into y at its pairs' place, or (e = -1) the shared expert on
 * every row into y after the pairs. */
static int run_task(const tm_moe_plan *p, int64_t e, const float *h, int64_t rows, const int64_t *pair_row,
                    const int64_t *start, float *y, int num_threads) {
    const int64_t hidden = p->gate_up[0].in_features, pairs = rows * p->top_k;
    if (e < 0)
        return run_expert(p->shared_gate_up, p->shared_down, (int)p->activation, h, NULL, rows, y + pairs * hidden,
                          num_threads);
    return run_expert(&p->gate_up[e], &p->down[e], (int)p->activation, h, pair_row + start[e], start[e + 1] - start[e],
                      y + start[e] * hidden, num_threads);
}

int sparse_moe(const tm_moe_plan *p, const float *x, int64_t rows, const float *residual, float *out,
               int num_threads) {
    if (rows == 0) return 0;
    const int64_t n = p->num_experts, k = p->top_k, hidden = p->gate_up[0].in_features, pairs = rows * k;
    const int shared = p->shared_gate_up != NULL;
    float *h = malloc(sizeof(float) * (size_t)(rows * hidden));
    float *probs = malloc(sizeof(float) * (size_t)(rows * n));
    int64_t *chosen = malloc(sizeof(int64_t) * (size_t)pairs);
    float *weights = malloc(sizeof(float) * (size_t)pairs);
    int64_t *start = calloc((size_t)(n + 1), sizeof(int64_t));   /* expert e's pairs: [start[e], start[e + 1]) */
    int64_t *fill = malloc(sizeof(int64_t) * (size_t)n);
    int64_t *pair_row = malloc(sizeof(int64_t) * (size_t)pairs), *slot = malloc(sizeof(int64_t) * (size_t)pairs);
    int64_t *active = malloc(sizeof(int64_t) * (size_t)(n + 1));
    float *y = malloc(sizeof(float) * (size_t)((pairs + (shared ? rows : 0)) * hidden));  /* per pair, then shared */
    float *sum = malloc(sizeof(float) * (size_t)(rows * hidden));
    int failed = !h || !probs || !chosen || !weights || !start || !fill || !pair_row || !slot || !active || !y || !sum;
    if (!failed) {
        #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
        for (int64_t r = 0; r < rows; r++) {
            if (p->norm != NULL) rms_norm_row(x + r * hidden, hidden, p->norm, p->norm_eps, h + r * hidden, 0);
            else memcpy(h + r * hidden, x + r * hidden, sizeof(float) * (size_t)hidden);
            route(p, h + r * hidden, hidden, probs + r * n, chosen + r * k, weights + r * k);
        }
        /* the pairs (row i / k, choice i % k) grouped by expert, rows in order within an expert;
         * slot[i]: pair i's place */
        for (int64_t i = 0; i < pairs; i++) start[chosen[i] + 1]++;
        for (int64_t e = 0; e < n; e++) start[e + 1] += start[e];
        memcpy(fill, start, sizeof(int64_t) * (size_t)n);
        for (int64_t i = 0; i < pairs; i++) {
            slot[i] = fill[chosen[i]]++;
            pair_row[slot[i]] = i / k;
        }
    }
    int64_t tasks = 0;   /* the chosen experts, then the shared one (-1) */
    for (int64_t e = 0; e < n && !failed; e++)
        if (start[e + 1] > start[e]) active[tasks++] = e;
    if (shared && !failed) active[tasks++] = -1;
    if (tasks >= num_threads) {
        #pragma omp parallel for schedule(dynamic) num_threads(num_threads)
        for (int64_t t = 0; t < tasks; t++)
            if (run_task(p, active[t], h, rows, pair_row, start, y, 1)) {
                #pragma omp atomic write
                failed = 1;
            }
    } else {
        for (int64_t t = 0; t < tasks && !failed; t++)
            failed = run_task(p, active[t], h, rows, pair_row, start, y, num_threads);
    }
    if (!failed) {
        #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
        for (int64_t r = 0; r < rows; r++) {
            float *s = sum + r * hidden;
            memset(s, 0, sizeof(float) * (size_t)hidden);
            for (int64_t e = 0; e < n; e++)   /* the row's choices in increasing expert order */
                for (int64_t j = 0; j < k; j++)
                    if (chosen[r * k + j] == e) {
                        const float w = weights[r * k + j], *ye = y + slot[r * k + j] * hidden;
                        for (int64_t d = 0; d < hidden; d++) s[d] += ye[d] * w;
                    }
            if (shared) {
                const float g = 1.0f / (1.0f + expf(-dot(h + r * hidden, p->shared_gate, hidden)));
                const float *ys = y + (pairs + r) * hidden;
                for (int64_t d = 0; d < hidden; d++) s[d] += g * ys[d];
            }
        }
        /* out may be x or residual: written only now */
        for (int64_t i = 0; i < rows * hidden; i++) out[i] = residual != NULL ? residual[i] + sum[i] : sum[i];
    }
    free(h); free(probs); free(chosen); free(weights); free(start); free(fill); free(pair_row); free(slot);
    free(active); free(y); free(sum);
    return failed;
}

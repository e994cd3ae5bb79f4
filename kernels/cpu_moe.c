/* A mixture-of-experts layer's experts in one call (llama.cpp's mul_mat_id idea), from Python or from
 * the one-call decode step (cpu_decode_step.c).
 *
 * pagedinfer/model/moe.py's ExpertMLP computes, per step: each row's top-k experts (highest logit
 * first, of tied logits the lower index first) and their weights (a softmax of the router's logits in
 * float64, exponentials by a Taylor polynomial, sums by a fixed halving tree), the rows grouped by
 * expert (stably: rows in step order within an expert), each active expert's gate-up GEMM, activation
 * and down GEMM once over its rows, and each row's weighted sum of its k outputs in rank order. Done
 * from Python that is a dozen torch ops and module calls per expert. moe_experts_{f32,bf16} do the
 * same arithmetic in the same order (the GEMMs and the activation chains are cpu_gemm.c's and
 * cpu_llama_ops.c's own, linked in), so the outputs are the same bits; moe_layer_{f32,bf16} add the
 * router's GEMM before and the shared expert after (the whole ExpertMLP), for the one-call step.
 *
 * Every multiply and add below is rounded on its own, as torch's elementwise ops round them: no fused
 * multiply-add contracted from them (the pragmas), whatever the compiler's default.
 */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
static int max_threads(void) { return omp_get_max_threads(); }
#else
static int max_threads(void) { return 1; }
#endif

#include "cpu_llama_ops.h" /* silu_mul, clamped_swiglu_mul (cpu_llama_ops.c, linked in) */
#include "cpu_moe.h"       /* moe_expert, moe_shape, moe_layer; gemm_segments (cpu_gemm.c, linked in) */

#define EXP_TERMS 18              /* moe.py EXP_TERMS */
#define LN2 0.6931471805599453094 /* Python's math.log(2), to the bit */

/* moe.py _exp: exp(x) for x <= 0 by range reduction and a Taylor polynomial in Horner form, each
 * operation float64 as torch's elementwise ops round it; below 2^-1022: 0. */
static double exp_taylor(double x) {
    const double n = nearbyint(x / LN2);
    if (n < -1022) return 0.0;
    const double r = x - n * LN2;
    double p = 1.0;
    for (int i = EXP_TERMS; i > 0; i--) p = 1.0 + p * r / (double)i;
    if (isnan(n)) return p; /* a NaN logit: its NaN */
    const uint64_t bits = (uint64_t)((int64_t)n + 1023) << 52;
    double power;
    memcpy(&power, &bits, sizeof power);
    return p * power;
}

/* moe.py _fixed_sum over v[0, n) (overwritten): halving, column i plus column i + n / 2, an odd last carried. */
static double fixed_sum(double *v, int n) {
    while (n > 1) {
        const int half = n / 2;
        for (int i = 0; i < half; i++) v[i] = v[i] + v[i + half];
        if (n & 1) v[half] = v[2 * half];
        n = half + (n & 1);
    }
    return v[0];
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* float32 to bfloat16, to nearest even (a NaN: torch's quiet NaN) */
static inline uint16_t f32_to_bf16(float f) {
    if (isnan(f)) return 0x7fc0;
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* Row t's weights w[k] (float32, as moe.py route's; the caller rounds them to bfloat16 for bfloat16
 * activations) from its logits [E] (float64 copies) and chosen experts [k]. e, v: [E] scratch. */
static void route_row(const double *logit, const int64_t *chosen, const moe_shape *s, double *e, double *v,
                      float *w) {
    const int E = s->experts, k = s->top_k;
    double m = -INFINITY;
    for (int j = 0; j < E; j++) m = isnan(logit[j]) || isnan(m) ? NAN : (logit[j] > m ? logit[j] : m);
    for (int j = 0; j < E; j++) e[j] = exp_taylor(logit[j] - m);
    if (s->renormalise)
        for (int r = 0; r < k; r++) v[r] = e[chosen[r]];
    else
        memcpy(v, e, sizeof(double) * E);
    const double sum = fixed_sum(v, s->renormalise ? k : E);
    for (int r = 0; r < k; r++) w[r] = (float)(e[chosen[r]] / sum);
}

/* Whether logit a ranks above logit b: a NaN above every number (as torch.topk ranks it). */
static int ranks_above(double a, double b) { return isnan(a) ? !isnan(b) : a > b; }

/* Row t's k experts [k] from its logits [E]: highest first, of tied logits the lower index first (moe.py
 * route's stable sort; torch.topk's own order where no two logits tie). */
static void top_k_row(const double *logit, int E, int k, int64_t *chosen) {
    for (int r = 0; r < k; r++) {
        int best = -1;
        for (int j = 0; j < E; j++) {
            int taken = 0;
            for (int q = 0; q < r && !taken; q++) taken = chosen[q] == j;
            if (!taken && (best < 0 || ranks_above(logit[j], logit[best]))) best = j;
        }
        chosen[r] = best;
    }
}

/* One expert's MLP over n rows in [n, H] (ELEM by bf16): gate-up GEMM (SiLU in the paired panels'
 * epilogue, else the plain product gu [n, 2 I] and its activation chain) into act [n, I], down GEMM into
 * out [n, H]: what moe.py's Expert computes. */
static void expert_mlp(const moe_expert *x_e, const moe_shape *s, int inter, const void *in, int n, void *gu,
                       void *act, void *out, int bf16) {
    if (x_e->paired)
        gemm_segments(x_e->gate_up, x_e->gate_up_segments, in, act, n, s->hidden, 1);
    else {
        gemm_segments(x_e->gate_up, x_e->gate_up_segments, in, gu, n, s->hidden, 0);
        if (s->glu && bf16)
            clamped_swiglu_mul_bf16((const uint16_t *)gu, (uint16_t *)act, n, inter, s->alpha, s->limit);
        else if (s->glu)
            clamped_swiglu_mul_f32((const float *)gu, (float *)act, n, inter, s->alpha, s->limit);
        else if (bf16)
            silu_mul_bf16((const uint16_t *)gu, (uint16_t *)act, n, inter);
        else
            silu_mul_f32((const float *)gu, (float *)act, n, inter);
    }
    gemm_segments(x_e->down, 1, act, out, n, inter, 0);
}

/* The shared part of both instantiations: x [T, H], logits [T, E], chosen [T, k] (each row's experts,
 * highest logit first; NULL: chosen here by top_k_row), y [T, H] out: each row's weighted sum of its
 * experts' outputs. work: scratch of T k (2 H + 3 I) elements. 0, or (nothing done) an expert outside
 * the layer's. */
static int moe_experts(const moe_expert *ex, const moe_shape *s, const void *x, const void *logits,
                       const int64_t *given, int rows, void *y, void *work, int bf16, refusal *why) {
    const int E = s->experts, k = s->top_k, H = s->hidden, I = s->inter;
    const int64_t slots = (int64_t)rows * k;
    const size_t es = bf16 ? 2 : 4;
    if (given) {
        const int refused = check_indexes(given, (int)slots, 0, E, REFUSED_EXPERT, why);
        if (refused) return refused;
    }
    int64_t *own = given ? NULL : malloc(sizeof(int64_t) * slots); /* [T k] the rows' top k, where not given */
    const int64_t *chosen = given ? given : own;
    int64_t *start = malloc(sizeof(int64_t) * (E + 1)); /* [E + 1] each expert's first grouped slot */
    int64_t *pos = malloc(sizeof(int64_t) * slots);     /* [T k] slot t k + r's place in expert order */
    int32_t *row_of = malloc(sizeof(int32_t) * slots);  /* [T k] each grouped slot's row */
    float *w = malloc(sizeof(float) * slots);           /* [T k] */
    double *scratch = malloc(sizeof(double) * 3 * E);   /* a row's logits, e and v */
    int *hit = malloc(sizeof(int) * E);                 /* the experts some row chose, in order */
    /* by grouped slot: the outputs [T k, H], the inputs [T k, H], the gate-up products [T k, 2 I] and
     * the activations [T k, I] */
    char *grouped = work, *xs = grouped + slots * H * es, *gu = xs + slots * H * es;
    char *act = gu + slots * 2 * I * es;
    for (int t = 0; t < rows; t++) {
        for (int j = 0; j < E; j++)
            scratch[j] = bf16 ? (double)bf16_to_f32(((const uint16_t *)logits)[(int64_t)t * E + j])
                              : (double)((const float *)logits)[(int64_t)t * E + j];
        if (own) top_k_row(scratch, E, k, own + (int64_t)t * k);
        route_row(scratch, chosen + (int64_t)t * k, s, scratch + E, scratch + 2 * E, w + (int64_t)t * k);
    }
    /* a stable counting sort of the slots by expert (torch.argsort(stable=True) of moe.py) */
    memset(start, 0, sizeof(int64_t) * (E + 1));
    for (int64_t j = 0; j < slots; j++) start[chosen[j] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t j = 0; j < slots; j++) {
        const int64_t p = start[chosen[j]]++;
        pos[j] = p;
        row_of[p] = (int32_t)(j / k);
    }
    for (int e = E; e > 0; e--) start[e] = start[e - 1]; /* back to each expert's first slot */
    start[0] = 0;
    int active = 0;
    for (int e = 0; e < E; e++)
        if (start[e + 1] > start[e]) hit[active++] = e;
    for (int64_t j = 0; j < slots; j++) memcpy(xs + j * H * es, (const char *)x + (int64_t)row_of[j] * H * es, H * es);
    /* Each active expert's GEMMs over its rows. Where there are experts enough for every thread, one
     * parallel loop over them (each expert's GEMMs on one thread: a row's bits do not depend on how
     * the GEMM's columns are split over threads), one meeting of the threads per layer, not two per
     * expert; else one expert after another, each GEMM over every thread. */
#pragma omp parallel for schedule(dynamic, 1) if (active > 1 && active >= max_threads())
    for (int a = 0; a < active; a++) {
        const int e = hit[a];
        const int64_t at = start[e];
        expert_mlp(ex + e, s, I, xs + at * H * es, (int)(start[e + 1] - at), gu + at * 2 * I * es,
                   act + at * I * es, grouped + at * H * es, bf16);
    }
    /* each row's sum in rank order: y = o_0 w_0, then y += o_r w_r (the product rounded, then the sum) */
#pragma omp parallel for if ((int64_t)rows * k * H >= (1 << 16))
    for (int t = 0; t < rows; t++) {
        for (int r = 0; r < k; r++) {
            const int64_t j = (int64_t)t * k + r;
            const char *o = grouped + pos[j] * H * es;
            if (bf16) {
                const float wr = bf16_to_f32(f32_to_bf16(w[j]));
                uint16_t *yt = (uint16_t *)y + (int64_t)t * H;
                const uint16_t *ot = (const uint16_t *)o;
                for (int h = 0; h < H; h++) {
                    const uint16_t p = f32_to_bf16(bf16_to_f32(ot[h]) * wr);
                    yt[h] = r ? f32_to_bf16(bf16_to_f32(yt[h]) + bf16_to_f32(p)) : p;
                }
            } else {
                const float wr = w[j];
                float *yt = (float *)y + (int64_t)t * H;
                const float *ot = (const float *)o;
                if (r == 0)
                    for (int h = 0; h < H; h++) yt[h] = ot[h] * wr;
                else
                    for (int h = 0; h < H; h++) {
                        const float p = ot[h] * wr;
                        yt[h] = yt[h] + p;
                    }
            }
        }
    }
    free(own);
    free(start);
    free(pos);
    free(row_of);
    free(w);
    free(scratch);
    free(hit);
    return REFUSED_NONE;
}

int moe_experts_f32(const moe_expert *ex, const moe_shape *s, const float *x, const float *logits,
                    const int64_t *chosen, int rows, float *y, float *work, refusal *why) {
    return moe_experts(ex, s, x, logits, chosen, rows, y, work, 0, why);
}

int moe_experts_bf16(const moe_expert *ex, const moe_shape *s, const uint16_t *x, const uint16_t *logits,
                     const int64_t *chosen, int rows, uint16_t *y, uint16_t *work, refusal *why) {
    return moe_experts(ex, s, x, logits, chosen, rows, y, work, 1, why);
}

int64_t moe_layer_work(const moe_layer *l, int rows) {
    const moe_shape *s = &l->shape;
    const int64_t routed = (int64_t)rows * s->top_k * (2 * s->hidden + 3 * s->inter);
    const int64_t shared = l->shared ? (int64_t)rows * (3 * l->shared_inter + s->hidden + 1) : 0;
    return (int64_t)rows * s->experts + routed + shared;
}

/* moe.py sigmoid of a gate logit z: 1 / (1 + e) or e / (1 + e) for e = exp(-|z|), float64, rounded once
 * to float32 (then to bfloat16 where the activations are: a float64's conversion to bfloat16 in torch
 * goes through float32). */
static float sigmoid_of(double z) {
    const double e = exp_taylor(-fabs(z));
    return (float)(z >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e));
}

/* The shared part of both instantiations of moe_layer: the router's GEMM, the routed experts (their
 * top k chosen here), then where the layer has one the shared expert's output times the sigmoid of its
 * gate's logit added to each row (the product rounded, then the sum, as moe.py's SharedExpert and
 * ExpertMLP round them). */
static void moe_layer_run(const moe_layer *l, const void *x, int rows, void *y, void *work, int bf16) {
    const moe_shape *s = &l->shape;
    const int H = s->hidden, Is = l->shared_inter;
    const size_t es = bf16 ? 2 : 4;
    char *logits = work, *rest = logits + (int64_t)rows * s->experts * es; /* [T, E]; the experts' scratch */
    gemm_segments(l->router, l->router_segments, x, logits, rows, H, 0);
    moe_experts(l->experts, s, x, logits, NULL, rows, y, rest, bf16, NULL);
    if (!l->shared) return;
    /* the shared expert's gate-up products [T, 2 Is], activations [T, Is], outputs [T, H], gate logits [T, 1] */
    char *gu = rest + (int64_t)rows * s->top_k * (2 * H + 3 * s->inter) * es;
    char *act = gu + (int64_t)rows * 2 * Is * es, *out = act + (int64_t)rows * Is * es;
    char *gate = out + (int64_t)rows * H * es;
    expert_mlp(l->shared, s, Is, x, rows, gu, act, out, bf16);
    gemm_segments(l->shared_gate, 1, x, gate, rows, H, 0);
    for (int t = 0; t < rows; t++) {
        const int64_t at = (int64_t)t * H;
        if (bf16) {
            const uint16_t *o = (const uint16_t *)out + at;
            uint16_t *yt = (uint16_t *)y + at;
            const float g = bf16_to_f32(f32_to_bf16(sigmoid_of(bf16_to_f32(((const uint16_t *)gate)[t]))));
            for (int h = 0; h < H; h++) {
                const uint16_t p = f32_to_bf16(bf16_to_f32(o[h]) * g);
                yt[h] = f32_to_bf16(bf16_to_f32(yt[h]) + bf16_to_f32(p));
            }
        } else {
            const float *o = (const float *)out + at;
            float *yt = (float *)y + at;
            const float g = sigmoid_of(((const float *)gate)[t]);
            for (int h = 0; h < H; h++) {
                const float p = o[h] * g;
                yt[h] = yt[h] + p;
            }
        }
    }
}

void moe_layer_f32(const moe_layer *l, const float *x, int rows, float *y, float *work) {
    moe_layer_run(l, x, rows, y, work, 0);
}

void moe_layer_bf16(const moe_layer *l, const uint16_t *x, int rows, uint16_t *y, uint16_t *work) {
    moe_layer_run(l, x, rows, y, work, 1);
}

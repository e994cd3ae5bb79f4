/* Every decoder layer of a decode-only CPU step (float32, Llama family) in one call from Python.
 *
 * At batch 1-16 a step's Python between the kernels (module calls, ctypes argument conversion,
 * output allocations, the attention plan) cost about 200-250 us per layer, 15-20% of a batch-1
 * step of SmolLM2-135M. This file runs the same kernels in the same order as pagedinfer/model/llama.py's
 * layers do one by one (so the products are the same bits): residual add + RMSNorm, the QKV panel
 * GEMM, per-head norm + RoPE, the K/V write, paged decode attention, the output GEMM, residual add +
 * RMSNorm, the gated gate-up GEMM (silu(gate) * up in its epilogue) and the down GEMM. It is one
 * translation unit with those kernels' sources, built like them (pagedinfer/model/decode_step.py).
 */
#include <time.h>

#include "cpu_gemm.c"
#include "cpu_llama_ops.c"
#include "cpu_paged_decode.c"

/* Wall seconds spent in the GEMMs of decode_layers_f32 since the last read (about 40 ns of clock
 * reads per GEMM): what scripts/profile_layer_step.py splits a step by. */
static double gemm_seconds;

double decode_gemm_seconds(void) {
    const double s = gemm_seconds;
    gemm_seconds = 0;
    return s;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void timed_gemm(const float *x, const float *p, const float *bias, float *y, int m, int n, int k,
                       int gated) {
    const double t = now();
    gemm_panels(x, p, bias, y, m, n, k, gated);
    gemm_seconds += now() - t;
}

/* One layer's tensors: float32, GEMM weights in cpu_gemm.c's panels, biases packed per panel;
 * NULL where the layer has none (biases, Qwen3's q/k norms). */
typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* [H], [H], [D], [D] */
    const float *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    float *k_cache, *v_cache; /* [blocks, block_size, kv_heads, D] */
    int window;               /* sliding window, 0: none */
} step_layer;

/* The model's sizes and the step's attention metadata (decode only: one query row per sequence). */
typedef struct {
    int layers, rows, hidden, q_heads, kv_heads, head_dim, inter;
    float eps, scale;
    const float *cos, *sin;                    /* [rows, D / 2] */
    const int64_t *slots;                      /* [rows] pool slot of each new token */
    const int32_t *tables, *ctx_lens;          /* [rows, max_blocks], [rows] */
    const int64_t *query_rows;                 /* [rows] 0 .. rows - 1 */
    int max_blocks, block_size;
    const int32_t *bounds;                     /* [parts + 1] sequence ranges, one per thread */
    int parts;
} step_meta;

/* residual [rows, H] in: the embeddings; out: the residual stream after the last layer. h [rows, H]
 * out: the last layer's MLP output (not yet added). x [rows, H], qkv [rows, (Hq + 2 Hkv) D],
 * attn [rows, Hq D] and act [rows, I] are scratch. */
void decode_layers_f32(const step_layer *layer, const step_meta *s, float *residual, float *h, float *x,
                       float *qkv, float *attn, float *act) {
    const int d = s->head_dim, qkv_n = (s->q_heads + 2 * s->kv_heads) * d, qd = s->q_heads * d;
    for (int i = 0; i < s->layers; i++, layer++) {
        add_rms_norm_f32(residual, i ? h : NULL, layer->input_norm, x, s->rows, s->hidden, s->eps);
        timed_gemm(x, layer->qkv, layer->qkv_bias, qkv, s->rows, qkv_n, s->hidden, 0);
        qk_norm_rope_f32(qkv, qkv_n, s->rows, s->q_heads, s->kv_heads, d, s->cos, s->sin, layer->q_norm,
                         layer->k_norm, s->eps);
        const float *k = qkv + qd, *v = qkv + qd + s->kv_heads * d;
        store_kv((char *)layer->k_cache, (char *)layer->v_cache, (const char *)k, (const char *)v, s->slots,
                 s->rows, s->kv_heads, d, d, qkv_n, d, qkv_n, d, sizeof(float));
        paged_decode_ranges_f32(s->bounds, s->parts, attn, qkv, layer->k_cache, layer->v_cache, s->tables,
                                s->ctx_lens, s->query_rows, s->max_blocks, s->block_size, s->q_heads,
                                s->kv_heads, d, d, qkv_n, d, s->scale, layer->window, 0.f, NULL);
        timed_gemm(attn, layer->o, layer->o_bias, h, s->rows, s->hidden, qd, 0);
        add_rms_norm_f32(residual, h, layer->post_norm, x, s->rows, s->hidden, s->eps);
        timed_gemm(x, layer->gate_up, layer->gate_up_bias, act, s->rows, 2 * s->inter, s->hidden, 1);
        timed_gemm(act, layer->down, layer->down_bias, h, s->rows, s->hidden, s->inter, 0);
    }
}

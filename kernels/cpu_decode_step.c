/* Every decoder layer of a decoding CPU step (float32 or bfloat16, Llama family) in one call from Python.
 *
 * At batch 1-16 a step's Python between the kernels (module calls, ctypes argument conversion,
 * output allocations, the attention plan) is a large share of a small model's step (docs/kernels.md).
 * This file runs the same kernels in the same order as pagedinfer/model/llama.py's layers do one by
 * one (so the products are the same bits): residual add + RMSNorm, the QKV panel GEMM, per-head norm
 * + RoPE, the K/V write, paged decode attention, the output GEMM, residual add + RMSNorm, the gated
 * gate-up GEMM (silu(gate) * up in its epilogue; Gemma's gelu-tanh: the plain GEMM, then its chain) and
 * the down GEMM (a mixture of experts' layer: its router, routed experts and shared expert through
 * cpu_moe.c's moe_layer, the code its layer-by-layer path calls), each branch normed where the family
 * norms its output; then the model's final
 * residual add + RMSNorm, the lm_head's input.
 * Its library links cpu_gemm.c and cpu_llama_ops.c (the same code the layer-by-layer path calls), built
 * like them (pagedinfer/model/decode_step.py).
 */
#include "cpu_gemm.h"       /* gemm_segment, gemm_segments (cpu_gemm.c, linked in) */
#include "cpu_llama_ops.h"  /* add_rms_norm, qk_norm_rope (cpu_llama_ops.c, linked in) */
#include "cpu_moe.h"        /* moe_layer: a mixture of experts' MLP (cpu_moe.c, linked in) */
#include "cpu_paged_decode.c" /* the K/V write and decode attention: static there, so in this unit */

/* Profiling clocks (built with -DSTEP_TIMERS, e.g. PAGEDINFER_CC_FLAGS=-DSTEP_TIMERS): wall seconds
 * spent in the GEMMs, and in the K/V writes and decode attention, of decode_layers since the last
 * read, what scripts/profile_layer_step.py splits a step by. Without it the calls run untimed. */
#ifdef STEP_TIMERS
#include <time.h>

static double gemm_seconds, attention_seconds;

double decode_gemm_seconds(void) {
    const double s = gemm_seconds;
    gemm_seconds = 0;
    return s;
}

double decode_attention_seconds(void) {
    const double s = attention_seconds;
    attention_seconds = 0;
    return s;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define TIMED(clock, calls)                                                                                  \
    do {                                                                                                     \
        const double t_ = now();                                                                             \
        calls;                                                                                               \
        clock += now() - t_;                                                                                 \
    } while (0)
#else
#define TIMED(clock, calls)                                                                                  \
    do {                                                                                                     \
        calls;                                                                                               \
    } while (0)
#endif

/* One layer's tensors, in the step's element type (float32 or bfloat16; the K/V pool in that type
 * or, under float32 activations, in bfloat16 or float16): each GEMM's weight as cpu_gemm.c segments
 * (float32 activations: float32, int8, int4 or GGUF block panels, a format per segment; the fused
 * QKV of a GGUF may hold up to three), NULL where the layer has none (Qwen3's q/k norms). */
typedef struct {
    /* [H] each, NULL where the family has none (families/spec.py NORM_ROLES): on the attention's and
     * the MLP's inputs (input_norm, post_norm; none: the stream itself is the branch's input), on their
     * outputs before each residual add (attn_out_norm, mlp_out_norm); q_norm, k_norm [D] (per head) or
     * [Hq D], [Hkv D] (step_meta.qk_norm_all), or NULL */
    const void *input_norm, *post_norm, *attn_out_norm, *mlp_out_norm, *q_norm, *k_norm;
    gemm_segment qkv[3], o, gate_up, down; /* gate_up and down unused where moe is set */
    const moe_layer *moe;                  /* the layer's mixture of experts in place of its MLP; NULL: dense */
    int qkv_segments;
    void *k_cache, *v_cache; /* [blocks, block_size, kv_heads, D] */
    int window;              /* sliding window, 0: none */
    int group;               /* its layer group: the slots and block tables it reads in step_meta */
    int rope;                /* its RoPE table in step_meta's cos and sin (Gemma 3's: by layer type) */
} step_layer;

/* The model's sizes, its final norm and the step's attention metadata, per query row (a decoding
 * sequence's row, or one of its drafted rows, each over its own context). Slots and block tables come
 * per layer group (layers of one attention window: a windowed group's tables name the pool's null
 * block where the window released a block); the context lengths and the rows' split are every group's. */
typedef struct {
    int layers, rows, hidden, q_heads, kv_heads, head_dim, inter;
    float eps, scale;
    const void *final_norm;                    /* [H] */
    const void *const *cos;                    /* [tables] -> [rows, D / 2] */
    const void *const *sin;                    /* [tables] -> [rows, D / 2] */
    const int64_t *const *slots;               /* [groups] -> [rows] pool slot of each new token */
    const int32_t *const *tables;              /* [groups] -> [rows, max_blocks[group]]: each row's sequence's */
    const int32_t *max_blocks;                 /* [groups] */
    int groups;
    const int32_t *ctx_lens;                   /* [rows] */
    const int64_t *query_rows;                 /* [rows] 0 .. rows - 1 */
    int block_size;
    const int32_t *bounds;                     /* [parts + 1] sequence ranges, one per thread */
    int parts;
    int64_t num_blocks;                        /* the pool's blocks (every layer's) */
    int qk_norm_all;                           /* q_norm / k_norm over all of a row's q / k, not per head */
    float residual_scale;                      /* each branch's factor before its residual add (Granite) */
    int gelu;                                  /* the MLP's gelu-tanh(gate) * up by its chain (Gemma) */
    float clip_qkv;                            /* q, k and v clamped to [-clip_qkv, clip_qkv] (OLMoE); 0: none */
} step_meta;

/* float32 activations (weights of any float32-activation format): decode_layers_f32 */
#define ELEM float
#define FN(name) CAT(name, f32)
#define KV(name) CAT(name, f32)
#define STEP(name) CAT(name, f32)
#include "cpu_decode_step_body.h"
/* float32 activations over a 16-bit K/V pool (--kv-cache-dtype): decode_layers_f32_kv_{bf16,f16} */
#define ELEM float
#define FN(name) CAT(name, f32)
#define KV(name) CAT(name, f32_kv_bf16)
#define STEP(name) CAT(name, f32_kv_bf16)
#include "cpu_decode_step_body.h"
#ifdef __FLT16_MAX__
#define ELEM float
#define FN(name) CAT(name, f32)
#define KV(name) CAT(name, f32_kv_f16)
#define STEP(name) CAT(name, f32_kv_f16)
#include "cpu_decode_step_body.h"
#endif
#define ELEM uint16_t
#define FN(name) CAT(name, bf16)
#define KV(name) CAT(name, bf16)
#define STEP(name) CAT(name, bf16)
#include "cpu_decode_step_body.h"


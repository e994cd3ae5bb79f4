/* A mixture-of-experts layer's MLP in cpu_moe.c, for other translation units (cpu_decode_step.c): the
 * experts' and the layer's descriptions and the whole MLP's entry points (router GEMM, top-k, routed
 * experts, shared expert), one per element type, float32 (f32) and bfloat16 (bf16). */
#ifndef PAGEDINFER_CPU_MOE_H
#define PAGEDINFER_CPU_MOE_H

#include <stdint.h>

#include "cpu_gemm.h" /* gemm_segment, refusal */

/* One expert's linears (pointers into its PackedLinears' segment arrays): gate_up [gate_up_segments]
 * (paired: one segment of paired panels whose GEMM writes silu(gate) * up; else plain columns, gate
 * then up, whose activation is a chain), down one segment. */
typedef struct {
    const gemm_segment *gate_up;
    int gate_up_segments;
    int paired;
    const gemm_segment *down;
} moe_expert;

/* The layer's sizes and routing rule. */
typedef struct {
    int experts, top_k, hidden, inter;
    int renormalise; /* the weights a softmax over the k chosen (else over every expert) */
    int glu;         /* gpt-oss's clamped SwiGLU (alpha, limit) over a plain gate-up product */
    float alpha, limit;
} moe_shape;

/* A layer's whole MLP of experts (pagedinfer/model/moe_kernel.py MoeLayer): the router's segments
 * (its logits [T, E] in the activations' type), the experts [E] and their shape, and the shared
 * expert (NULL: none) of inner size shared_inter, scaled by the sigmoid of its gate's [1, H] logit. */
typedef struct {
    const gemm_segment *router;
    int router_segments;
    const moe_expert *experts;
    moe_shape shape;
    const moe_expert *shared;
    const gemm_segment *shared_gate;
    int shared_inter;
} moe_layer;

/* Elements of the scratch moe_layer_{f32,bf16} takes for `rows` rows. */
int64_t moe_layer_work(const moe_layer *l, int rows);

/* x [rows, H] -> y [rows, H]: the layer's MLP, the same bits as moe.py's ExpertMLP over x. work: scratch
 * of moe_layer_work(l, rows) elements. */
void moe_layer_f32(const moe_layer *l, const float *x, int rows, float *y, float *work);
void moe_layer_bf16(const moe_layer *l, const uint16_t *x, int rows, uint16_t *y, uint16_t *work);

#endif

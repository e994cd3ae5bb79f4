/* The GEMM's interface to other translation units (cpu_decode_step.c): a segment of a linear's
 * panels and the entry points of cpu_gemm.c. */
#ifndef PAGEDINFER_CPU_GEMM_H
#define PAGEDINFER_CPU_GEMM_H

#include <stdint.h>

#include "cpu_bounds.h" /* refusal */

/* One run of a linear's output columns in one format (pagedinfer/model/packed_linear.py builds them):
 * panels [P][panel_bytes(kind, k, group)], bias and scale (I8) [P][16] float32 or NULL. bf16_io: x and
 * y in bfloat16 over a quantized kind: its weights are rounded to bfloat16 pairs (qtile_bf16 in
 * registers, or dequantize_panel) and multiplied as K_BF16's are. */
typedef struct {
    int kind, group, cols; /* cols: this segment's outputs (the gated half's for a gated one) */
    const void *panels;
    const float *bias, *scale;
    int bf16_io;
    int q8_dot; /* Q4_0, Q4_1, Q8_0, I8, I4, I4Z under float32 x: llama.cpp's numerics (cpu_gemm_q8dot.h), not the float32 products */
} gemm_segment;


int gemm_kind_available(int kind);
int gemm_native_bf16(void);
int gemm_amx(void);
int64_t gemm_panel_bytes(int kind, int k, int group);
void gemm_segments(const gemm_segment *seg, int nseg, const void *x, void *y, int m, int k, int gated);
int gemm_panel_rows(const gemm_segment *s, const int64_t *rows, int n, int k, float *out, refusal *why);

#endif

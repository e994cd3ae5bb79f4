/* The norm, RoPE and activation chains of cpu_llama_ops.c, for other translation units
 * (cpu_decode_step.c): one instantiation per element type, float32 (f32) and bfloat16 (bf16). */
#ifndef PAGEDINFER_CPU_LLAMA_OPS_H
#define PAGEDINFER_CPU_LLAMA_OPS_H

#include <stdint.h>

#define LLAMA_OPS(ELEM, SUFFIX)                                                                              \
    void add_rms_norm_##SUFFIX(ELEM *residual, const ELEM *x, const ELEM *w, ELEM *out, int rows, int dim,  \
                               float eps);                                                                   \
    void qk_norm_rope_##SUFFIX(ELEM *qkv, int64_t row_stride, int rows, int q_heads, int k_heads, int dim,   \
                               const ELEM *cos_t, const ELEM *sin_t, const ELEM *q_w, const ELEM *k_w,       \
                               float eps);                                                                   \
    void add_rows_##SUFFIX(ELEM *x, const ELEM *y, int64_t n);                                              \
    void scale_rows_##SUFFIX(ELEM *x, int64_t n, float s);                                                   \
    void clamp_rows_##SUFFIX(ELEM *x, int64_t n, float c);                                                  \
    void silu_mul_##SUFFIX(const ELEM *gate_up, ELEM *out, int rows, int inter);                            \
    void gelu_tanh_mul_##SUFFIX(const ELEM *gate_up, ELEM *out, int rows, int inter);                       \
    void clamped_swiglu_mul_##SUFFIX(const ELEM *gate_up, ELEM *out, int rows, int inter, float alpha,       \
                                     float limit);
LLAMA_OPS(float, f32)
LLAMA_OPS(uint16_t, bf16)
#undef LLAMA_OPS

#endif

/* The 8-float vector type of the CPU kernels (GCC / Clang vector extensions: AVX2 on x86, two NEON
 * registers on Arm) and its unaligned load and store, shared by cpu_gemm.c and cpu_paged_decode.c. */
#ifndef PAGEDINFER_CPU_VEC_H
#define PAGEDINFER_CPU_VEC_H
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
#endif

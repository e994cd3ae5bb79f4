"""The C kernels as a subsystem (the lowest layer: nothing here imports anything above it).

`sources` finds the sources (the top-level ``kernels/`` folder) and derives what each library is
built from; `build` compiles, caches (`kernel_cache`) and loads them; `abi` holds what every binding
shares with the C side (the refusal record, the debug checks, the dtype suffixes); `weight_types`
declares the GEMM's weight types once (the C header's enum and traits are generated from it);
`paged_decode` binds decode attention. The model's and LoRA's bindings (model/fused_ops.py, model/packed_linear.py,
model/decode_step.py, lora/delta.py) load their libraries through `build`. docs/kernels.md maps the
C files.
"""

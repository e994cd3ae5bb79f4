"""Qwen2: Llama's layer with q, k and v biases always."""

from dataclasses import replace

from pagedinfer.model.families.llama import LAYER, LINEARS, NORMS, QKV
from pagedinfer.model.families.spec import Family, Need

QWEN2 = Family(
    model_types=("qwen2",),
    gguf_arch="qwen2",
    layer=tuple(replace(m, bias=Need.REQUIRED) if m.hf in QKV else m for m in LAYER),
    linears=LINEARS,
    norms=NORMS,
)

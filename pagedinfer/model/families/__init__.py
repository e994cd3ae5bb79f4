"""The families pagedinfer's own layers serve, one declaration each (`spec.Family`).

Adding a family is adding its module here and its name to `FAMILIES`; everything that knows a
family (the loader, the GGUF reader, the validation, the layers, the C step, the LoRA sites) reads it.
"""

from __future__ import annotations

from pagedinfer.model.families.gemma3 import GEMMA3
from pagedinfer.model.families.gpt_oss import GPT_OSS
from pagedinfer.model.families.granite import GRANITE
from pagedinfer.model.families.llama import LLAMA
from pagedinfer.model.families.mistral import MISTRAL
from pagedinfer.model.families.mixtral import MIXTRAL
from pagedinfer.model.families.olmo2 import OLMO2
from pagedinfer.model.families.olmoe import OLMOE
from pagedinfer.model.families.phi3 import PHI3
from pagedinfer.model.families.qwen2 import QWEN2
from pagedinfer.model.families.qwen2_moe import QWEN2_MOE
from pagedinfer.model.families.qwen3 import QWEN3
from pagedinfer.model.families.qwen3_moe import QWEN3_MOE
from pagedinfer.model.families.spec import Family

FAMILIES = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    OLMO2,
    GRANITE,
    PHI3,
    GEMMA3,
    QWEN3_MOE,
    QWEN2_MOE,
    MIXTRAL,
    OLMOE,
    GPT_OSS,
)


def find(config) -> Family | None:
    """The family of a Hugging Face config (by its model_type), None when ours serve none."""
    return by_model_type(getattr(config, "model_type", None))


def by_model_type(kind: object) -> Family | None:
    """The family serving ``model_type`` ``kind`` (a config.json's value, of any type), None when none does."""
    return next((f for f in FAMILIES if kind in f.model_types), None)


def by_gguf_arch(arch: object, metadata: dict[str, object] | None = None) -> Family | None:
    """The family of GGUF files of architecture ``arch`` (their size keys are what it gives): of two
    sharing one (llama's files: llama, mixtral), the mixture of experts where ``metadata`` gives the
    architecture an expert count; None for an architecture no family reads."""
    moe = bool((metadata or {}).get(f"{arch}.expert_count"))
    of_arch = [f for f in FAMILIES if f.gguf_arch == arch]
    return next((f for f in of_arch if (f.experts is not None) == moe), of_arch[0] if of_arch else None)


def names() -> str:
    """The served model types, for messages: "llama, mistral, qwen2, qwen3, ..."."""
    return ", ".join(t for f in FAMILIES for t in f.model_types)

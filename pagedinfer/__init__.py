"""pagedinfer: offline batch LLM inference on a paged KV cache with copy-on-write parallel sampling."""

from pagedinfer.llm import LLM
from pagedinfer.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from pagedinfer.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "__version__",
]

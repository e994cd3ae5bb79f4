"""What a run generates with: one `LLM` in this process, or ``--data-parallel`` replicas on Ray. Either
answers the run's rows (`lines.runner`): a `LineRunner` over the `LLM`, or the replicas' driver."""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from pagedinfer.cli.run_options import RunOptions, UsageError
from pagedinfer.config import LLMConfig, engine_option_words, flag_of
from pagedinfer.errors import first_line
from pagedinfer.terminal import say

if TYPE_CHECKING:
    from pagedinfer.lines.runner import LineRunner
    from pagedinfer.llm import LLM
    from pagedinfer.ray.driver import DataParallelEngines


def start(
    opts: RunOptions, config: LLMConfig, err: Console
) -> tuple[LLM | DataParallelEngines, LineRunner | DataParallelEngines]:
    """The model (an `LLM`, or the replicas) and what answers rows on it, loaded now; a `UsageError`
    says what could not be loaded."""
    if opts.data_parallel:
        replicas = _start_replicas(opts, config, err)
        return replicas, replicas
    return _load(opts, err)


def model_name(opts: RunOptions) -> str:
    """The run's model as records and the report name it."""
    return opts.model or "pagedinfer-demo"


def status(opts: RunOptions, err: Console, what: str):
    """A spinner with ``what`` on a terminal (not with --quiet); else nothing."""
    return err.status(what) if err.is_terminal and not opts.quiet else contextlib.nullcontext()


def note_capped_context(opts: RunOptions, llm: LLM | DataParallelEngines, err: Console) -> None:
    """--max-model-len above the model's context runs capped: said once, here, on stderr (even
    with --quiet: the run does not do what the option asked). The engine's own warning is
    silenced when it loads; replicas' are not shown (Ray does not forward their output)."""
    from pagedinfer.engine.llm_engine import capped_context_words

    words = capped_context_words(
        flag_of("max_model_len"), opts.engine.get("max_model_len"), llm.context_length
    )
    if words is not None:
        say(err, f"note: {escape(words)}")


def _demo_model_hint(opts: RunOptions, error: Exception) -> str:
    """ "; pass --model" when the embedded demo model itself could not be loaded; not after an error
    that another model would meet as well (a device, a dtype), where the hint would mislead."""
    from pagedinfer.model.loader import DEMO_MODEL

    return "; pass --model" if opts.model is None and str(DEMO_MODEL) in str(error) else ""


def _load(opts: RunOptions, err: Console) -> tuple[LLM, LineRunner]:
    from pagedinfer.engine.llm_engine import MaxModelLenCapped
    from pagedinfer.hf_logging import quiet_transformers
    from pagedinfer.lines.runner import LineRunner
    from pagedinfer.llm import LLM
    from pagedinfer.lora.adapter import AdapterError
    from pagedinfer.model.loader import ModelLoadError

    quiet_transformers()
    with status(opts, err, f"loading {opts.model or 'the demo model'}"):
        try:
            with warnings.catch_warnings():  # the run says it in its own words (`note_capped_context`)
                warnings.simplefilter("ignore", MaxModelLenCapped)
                llm = LLM(opts.model, seed=opts.seed, **opts.engine)
        except ModelLoadError as e:
            raise UsageError(f"{e}{_demo_model_hint(opts, e)}") from None
        except ValueError as e:
            raise UsageError(engine_option_words(first_line(e))) from None
        try:
            return llm, LineRunner(llm, model_name(opts), opts.loras)
        except AdapterError as e:
            raise UsageError(str(e)) from None


def _start_replicas(opts: RunOptions, config: LLMConfig, err: Console) -> DataParallelEngines:
    """``--data-parallel N``: N engine replicas on Ray (local, or the cluster at ``--ray-address``).
    The ``--lora`` adapters' files are read here first, so an unreadable one is refused as a
    single-process run refuses it, before Ray starts; each replica checks them against its model."""
    from pagedinfer.lora.adapter import AdapterError, read_adapter
    from pagedinfer.ray.driver import DataParallelEngines, RayUnavailable, ReplicaSpec

    for name, path in opts.loras:
        try:
            read_adapter(name, path)
        except AdapterError as e:
            raise UsageError(f"--lora {name}={path}: {e}") from None
    spec = ReplicaSpec(
        config, opts.data_parallel, opts.ray_address, model_name(opts), loras=tuple(opts.loras)
    )
    with status(
        opts, err, f"starting {opts.data_parallel} replicas of {opts.model or 'the demo model'} on Ray"
    ):
        try:
            return DataParallelEngines(spec)
        except RayUnavailable as e:
            raise UsageError(str(e)) from None

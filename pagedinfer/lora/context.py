"""The step's LoRA context: which packed rows run which adapter, set by the model runner for one forward.

The runner orders a step's sequences by adapter slot, so each adapter's rows are one contiguous
range of the packed row (``tokens``) and of the rows the logits are computed for (``logits``); slot
0, the base model, gets no range. Like the attention step context, every targeted linear reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

Ranges = list[tuple[int, int, int]]  # (slot, first row, end row), slots ascending, never slot 0


@dataclass
class LoRAContext:
    tokens: Ranges  # over the step's packed tokens [T]
    logits: Ranges  # over the rows whose logits are computed [R] (what an lm_head sees)


_current: LoRAContext | None = None


def set_context(ctx: LoRAContext | None) -> None:
    global _current
    _current = ctx


def current_context() -> LoRAContext | None:
    """The running step's context; None when no row of the step runs an adapter."""
    return _current


def ranges(slots: list[int], counts: list[int]) -> Ranges:
    """Contiguous per-slot ranges of rows: sequence ``i`` has ``counts[i]`` rows, ``slots`` ascending."""
    out: Ranges = []
    row = 0
    for slot, n in zip(slots, counts, strict=True):
        if slot and n:
            if out and out[-1][0] == slot:
                out[-1] = (slot, out[-1][1], row + n)
            else:
                out.append((slot, row, row + n))
        row += n
    return out

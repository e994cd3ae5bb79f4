"""Which adapter each slot holds, and which slot an adapter that starts running takes.

Slots ``1 .. max_loras`` are where the model's LoRA sites keep installed deltas (slot 0 is the base
model). The scheduler lets at most ``max_loras`` distinct adapters run at once, so an adapter that
starts running always finds a slot no running adapter holds: an empty one first, else the one whose
adapter was used least recently (its deltas are then replaced). An adapter that still holds a slot
takes it again without a reinstall.
"""

from __future__ import annotations

from collections.abc import Collection


class SlotTable:
    def __init__(self, max_loras: int) -> None:
        self.holders: list[str | None] = [None] * (max_loras + 1)  # slot -> adapter name; [0] unused
        self._used = [0] * (max_loras + 1)  # slot -> the tick it was last used
        self._tick = 0

    def find(self, name: str) -> int | None:
        """The slot ``name`` holds (marked used now), or None."""
        for slot, holder in enumerate(self.holders):
            if slot and holder == name:
                self._use(slot)
                return slot
        return None

    def free(self, busy: Collection[str]) -> int:
        """The slot for an adapter that holds none: empty first, else the least recently used one
        whose adapter is not in ``busy`` (those of running requests)."""
        candidates = [s for s in range(1, len(self.holders)) if self.holders[s] not in busy]
        if not candidates:
            raise RuntimeError(f"all {len(self.holders) - 1} adapter slots are held by running adapters")
        return min(candidates, key=lambda s: (self.holders[s] is not None, self._used[s]))

    def hold(self, slot: int, name: str | None) -> None:
        """``slot`` now holds ``name`` (None: nothing, while its deltas are replaced)."""
        self.holders[slot] = name
        self._use(slot)

    def _use(self, slot: int) -> None:
        self._tick += 1
        self._used[slot] = self._tick

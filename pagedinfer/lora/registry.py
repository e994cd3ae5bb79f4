"""The engine's adapters: every one named so far, the weights kept in memory, and the slots.

An adapter is read and checked when first named (`LoRARequest` in `LLM.generate`, ``--lora`` at
startup): its rank against ``max_lora_rank``, its modules against the model's linears (`LoRASite`
parts, by checkpoint name) and each ``A`` / ``B`` against that linear's shape, so an adapter trained
for another base fails with the module that does not fit. A name stays bound to its directory for the
engine's lifetime. vLLM's two bounds apply:

* ``max_loras``: adapters whose deltas the model holds (slots 1..max_loras; slot 0 is the base
  model), so adapters in one step. The scheduler admits requests of at most that many distinct
  adapters at once and calls `activate` for a request whose adapter is not running; other lines wait.
* ``max_cpu_loras``: adapters whose weights stay in memory, least recently used dropped first. A
  dropped one is read and checked again when a request needs a slot for it; if its files changed
  meanwhile (another digest) or cannot be read, that request fails, never runs other weights.

Each adapter's digest (of the scaled weights it computes with) seeds its prefix-cache hash chains:
slots change hands, so a slot number would let one adapter's cached K/V serve another's.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, replace

import torch

from pagedinfer.lora.adapter import Adapter, AdapterError, read_adapter
from pagedinfer.lora.request import LoRARequest
from pagedinfer.lora.site import LoRASite, Part
from pagedinfer.lora.slots import SlotTable


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter named and checked: what requests carry and the report lists."""

    name: str
    path: str
    rank: int
    modules: int  # base linears it changes
    digest: bytes  # of its scaling and weights: the prefix cache's chain seed, checked on every read


@dataclass
class AdapterCounters:
    """Adapter traffic since the last `AdapterRegistry.reset_stats`."""

    reads: int = 0  # adapter directories read (a first read, or again after it left memory)
    slot_loads: int = 0  # adapters installed into a slot (each first use, and each swap back in)


class AdapterRegistry:
    def __init__(
        self,
        sites: dict[str, tuple[LoRASite, Part]],
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None = None,
    ) -> None:
        self.sites = sites  # checkpoint module name -> (its site, its part)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        self.named: dict[str, LoadedAdapter] = {}  # every adapter named, in the order first named
        self.slots = SlotTable(max_loras)
        self.counters = AdapterCounters()
        self._memory: OrderedDict[str, Adapter] = OrderedDict()  # by name, least recently used first

    def make_stats(self) -> AdapterCounters:
        """The adapter traffic since the last `reset_stats` (a copy)."""
        return replace(self.counters)

    def reset_stats(self) -> None:
        self.counters = AdapterCounters()

    def add(self, request: LoRARequest) -> LoadedAdapter:
        """``request``'s adapter, read and checked the first time its name is seen."""
        name, path = request.lora_name, str(request.lora_path)
        if not isinstance(name, str) or not name:
            raise AdapterError(f"an adapter name must be a non-empty string, not {name!r}")
        if (known := self.named.get(name)) is not None:
            if known.path != path:
                raise AdapterError(f"adapter {name!r} is loaded from {known.path}, not {path}")
            return known
        adapter = self._read(name, path)
        info = LoadedAdapter(name, adapter.path, adapter.rank, len(adapter.modules), _digest(adapter))
        self._keep(adapter)
        self.named[name] = info
        return info

    def get(self, name: str) -> LoadedAdapter:
        """An adapter named already (a line's ``lora`` field names one)."""
        known = self.named.get(name)
        if known is None:
            have = ", ".join(map(repr, self.named)) or "none"
            raise AdapterError(f"unknown adapter {name!r} (loaded: {have})")
        return known

    def activate(self, adapter: LoadedAdapter, busy: Collection[LoadedAdapter]) -> int:
        """The slot ``adapter``'s rows run with, installing it there unless it holds one already;
        ``busy``: the adapters of the running requests (fewer than ``max_loras`` when ``adapter`` is
        not one of them), whose slots stay as they are. Raises `AdapterError` (the slots unchanged)
        when it must be read again and cannot be, or its files changed since it was checked."""
        slot = self.slots.find(adapter.name)
        if slot is not None:
            return slot
        slot = self.slots.free({a.name for a in busy})
        weights = self._weights(adapter)
        self.slots.hold(slot, None)  # until every site holds the new deltas
        by_site: dict[int, tuple[LoRASite, dict]] = {}
        for site, _ in self.sites.values():
            site.uninstall(slot)
        for module, w in weights.modules.items():
            site, _ = self.sites[module]
            by_site.setdefault(id(site), (site, {}))[1][module] = w
        for site, found in by_site.values():
            site.install(slot, found, weights.scaling)
        self.slots.hold(slot, adapter.name)
        self.counters.slot_loads += 1
        return slot

    def _weights(self, adapter: LoadedAdapter) -> Adapter:
        """The weights of ``adapter``: from memory, or read again and checked to be the same."""
        if (kept := self._memory.get(adapter.name)) is not None:
            self._memory.move_to_end(adapter.name)
            return kept
        again = self._read(adapter.name, adapter.path)
        if _digest(again) != adapter.digest:
            raise AdapterError(
                f"adapter {adapter.name!r}: the files in {adapter.path} changed since they were "
                "first read (read again because more adapters are in use than max_cpu_loras keeps in memory)"
            )
        self._keep(again)
        return again

    def _keep(self, adapter: Adapter) -> None:
        self._memory[adapter.name] = adapter
        self._memory.move_to_end(adapter.name)
        while len(self._memory) > self.max_cpu_loras:
            self._memory.popitem(last=False)

    def _read(self, name: str, path: str) -> Adapter:
        """Read ``name`` from ``path`` and check it against the model; raises `AdapterError`."""
        adapter = read_adapter(name, path)
        self.counters.reads += 1
        if adapter.rank > self.max_lora_rank:
            raise AdapterError(
                f"adapter {name!r}: rank {adapter.rank} is above max_lora_rank={self.max_lora_rank}"
            )
        for module, w in adapter.modules.items():
            if module not in self.sites:
                raise AdapterError(
                    f"adapter {name!r} targets {module}, which this model has no linear layer for "
                    "(LoRA serves the linear layers)"
                )
            site, part = self.sites[module]
            if w.a.shape[1] != site.in_features or w.b.shape[0] != part.width:
                raise AdapterError(
                    f"adapter {name!r} does not fit this model (trained for another base?): {module} has "
                    f"lora_A {list(w.a.shape)} and lora_B {list(w.b.shape)}; the model's {module} maps "
                    f"{site.in_features} -> {part.width}"
                )
        return adapter


def _digest(adapter: Adapter) -> bytes:
    """What the adapter computes with: its scaling and every module's A and B (dtype, shape, bytes)."""
    h = hashlib.blake2b(repr(adapter.scaling).encode(), digest_size=32)
    for module, w in sorted(adapter.modules.items()):
        for t in (w.a, w.b):
            h.update(f"{module}:{t.dtype}:{list(t.shape)}".encode())
            h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy())
    return h.digest()

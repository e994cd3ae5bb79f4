"""The engine's adapters: name -> slot (1 .. max_loras; slot 0 is the base model), each checked once.

An adapter is read and checked when first named (`LoRARequest` in `LLM.generate`, ``--lora`` at
startup): its rank against ``max_lora_rank``, its modules against the model's linears (`LoRASite`
parts, by checkpoint name) and each ``A`` / ``B`` against that linear's shape, so an adapter trained
for another base fails with the module that does not fit. Adapters stay loaded for the engine's
lifetime (at most ``max_loras`` of them); their slot also seeds their prefix-cache hash chains.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedinfer.lora.adapter import AdapterError, read_adapter
from pagedinfer.lora.request import LoRARequest
from pagedinfer.lora.site import LoRASite, Part


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    path: str
    slot: int
    rank: int
    modules: int  # base linears it changes


class AdapterRegistry:
    def __init__(self, sites: dict[str, tuple[LoRASite, Part]], max_loras: int, max_lora_rank: int) -> None:
        self.sites = sites  # checkpoint module name -> (its site, its part)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.loaded: dict[str, LoadedAdapter] = {}  # by name, in load order

    def add(self, request: LoRARequest) -> int:
        """The slot of ``request``'s adapter, reading and installing it the first time its name is seen."""
        name, path = request.lora_name, str(request.lora_path)
        if not isinstance(name, str) or not name:
            raise AdapterError(f"an adapter name must be a non-empty string, not {name!r}")
        if (known := self.loaded.get(name)) is not None:
            if known.path != path:
                raise AdapterError(f"adapter {name!r} is loaded from {known.path}, not {path}")
            return known.slot
        if len(self.loaded) >= self.max_loras:
            raise AdapterError(
                f"adapter {name!r}: max_loras={self.max_loras} adapters are loaded already "
                f"({', '.join(self.loaded)})"
            )
        adapter = read_adapter(name, path)
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
        slot = len(self.loaded) + 1
        by_site: dict[int, tuple[LoRASite, dict]] = {}
        for module, w in adapter.modules.items():
            site, _ = self.sites[module]
            by_site.setdefault(id(site), (site, {}))[1][module] = w
        for site, found in by_site.values():
            site.install(slot, found, adapter.scaling)
        self.loaded[name] = LoadedAdapter(name, adapter.path, slot, adapter.rank, len(adapter.modules))
        return slot

    def slot_of(self, name: str) -> int:
        """The slot of an adapter loaded already (a line's ``lora`` field names one)."""
        known = self.loaded.get(name)
        if known is None:
            have = ", ".join(map(repr, self.loaded)) or "none"
            raise AdapterError(f"unknown adapter {name!r} (loaded: {have})")
        return known.slot

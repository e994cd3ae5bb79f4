"""Which waiting request a step admits next: the order, the adapter slots, and who may not starve.

The scheduler asks an `AdmissionRound` about each waiting request in turn and admits those that
also fit its token budget, its sequence limit and the free blocks.

* Order: ``fcfs`` is arrival order; ``lpm`` (longest prefix match, SGLang's name) takes the requests
  with the most cached prompt blocks first, arrival order among equals, so that requests sharing a
  cached prefix run while it is still cached instead of after it was evicted. A request overtaken
  by ``max_num_seqs`` later arrivals goes first: none starves.
* A prefix in prefill: a request whose next uncached prompt block is being computed right now by a
  request still in prefill waits for it (it will hit the cache instead of computing the same
  tokens); the requests behind it may go first. Its wait is bounded by that prefill.
* LoRA adapters (vLLM's ``max_loras``): the running requests use at most ``max_loras`` distinct
  adapters, each holding a slot of the model's deltas; a waiting request whose adapter is not
  running is admitted when a slot is free (its adapter is then installed there,
  `AdapterSlots.activate`), and the requests behind it may go first meanwhile. Once it has been
  overtaken ``max_num_seqs`` times, no request of another adapter is admitted before it, so the
  running adapters drain and it gets a slot: none starves, and base-model requests (which need no
  slot) still pass it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pagedinfer.config import EngineConfig
from pagedinfer.core.sequence import Request, RequestState

if TYPE_CHECKING:
    from pagedinfer.core.kv_cache_manager import KVCacheManager, PrefixHit


class AdapterSlots(Protocol):
    """The adapters' slots admission takes (`lora.registry.AdapterRegistry`)."""

    max_loras: int

    def activate(self, adapter: Any, busy: Collection[Any]) -> int:
        """The slot ``adapter`` runs in, installed now if needed (the ``busy`` adapters keep theirs);
        raises `AdapterError` when it cannot be installed."""
        ...


class AdmissionPolicy:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        schedule_policy: Literal["fcfs", "lpm"] = EngineConfig.schedule_policy,
        adapters: AdapterSlots | None = None,
    ) -> None:
        """``adapters``: the slots of the LoRA adapters requests name (None: no request names one)."""
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs  # also the starvation bound
        self.schedule_policy = schedule_policy
        self.adapters = adapters

    def start(self, waiting: Iterable[Request], running: list[Request]) -> AdmissionRound:
        """One step's admission over ``waiting`` (in arrival order), ``running`` being admitted already."""
        return AdmissionRound(self, self._order(list(enumerate(waiting))), running)

    def _order(self, waiting: list[tuple[int, Request]]) -> list[tuple[int, Request]]:
        """Waiting requests with their queue positions, in the order admission considers them."""
        kv = self.kv_cache_manager
        if self.schedule_policy == "fcfs" or not kv.enable_prefix_caching or len(waiting) < 2:
            return waiting

        def key(item: tuple[int, Request]) -> tuple[bool, int, int]:
            pos, req = item
            if req.num_overtaken >= self.max_num_seqs:
                return (False, 0, pos)
            return (True, -kv.num_cached_blocks(req), pos)

        return sorted(waiting, key=key)


class AdmissionRound:
    """One step's admission: its order, the adapters holding slots, the prompt blocks in prefill, and
    which requests were admitted (`close` counts who overtook whom)."""

    def __init__(
        self, policy: AdmissionPolicy, order: list[tuple[int, Request]], running: list[Request]
    ) -> None:
        self.policy = policy
        self.order = order  # (queue position, request), in the order to consider them
        self.busy = {r.lora for r in running if r.lora is not None}  # adapters holding a slot
        self.held = False  # a request waits for a slot past its bound: no other adapter goes before it
        kv = policy.kv_cache_manager
        # full prompt blocks that running requests are computing (or have computed) now
        self.in_prefill: set[bytes] = set()
        if kv.enable_prefix_caching:
            self.in_prefill = {h for r in running if r.prompt_seq is not None for h in kv.prompt_hashes(r)}
        self.admitted: list[int] = []  # queue positions of the requests admitted

    def waits_for_slot(self, req: Request) -> bool:
        """Whether ``req``'s adapter must wait for a slot: it is not running and every slot is held, or
        a request past its bound holds every other adapter back."""
        if req.lora is None:
            return False
        full = req.lora not in self.busy and len(self.busy) >= self.policy.adapters.max_loras
        if self.held or full:
            self.held = self.held or req.num_overtaken >= self.policy.max_num_seqs
            return True
        return False

    def waits_for_prefill(self, hit: PrefixHit) -> bool:
        """Whether the first prompt block ``hit`` misses is being computed by a request in prefill."""
        return hit.next_hash is not None and hit.next_hash in self.in_prefill

    def take_slot(self, req: Request) -> int:
        """The slot ``req``'s adapter runs in (installed now if it holds none); raises `AdapterError`."""
        slot = self.policy.adapters.activate(req.lora, self.busy)
        self.busy.add(req.lora)
        return slot

    def admit(self, pos: int, hit: PrefixHit) -> None:
        """Record that the request at queue position ``pos`` was admitted, computing ``hit``'s blocks."""
        self.admitted.append(pos)
        self.in_prefill.update(hit.hashes)

    def close(self) -> None:
        """Count, for each request still waiting, the later arrivals admitted before it."""
        if not self.admitted:
            return
        admitted = sorted(self.admitted)
        for pos, req in self.order:
            if req.state is RequestState.WAITING:
                req.num_overtaken += len(admitted) - bisect_right(admitted, pos)

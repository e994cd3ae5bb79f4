"""The scheduler alone, no model: schedule() -> fake sampled tokens -> update(), checked after every step."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedinfer.core.beam import BeamSearch, Candidate
from pagedinfer.core.kv_cache_manager import KVCacheManager
from pagedinfer.core.limits import RequestLimits
from pagedinfer.core.scheduler import ModelOutput, Scheduler, SchedulerOutput
from pagedinfer.core.sequence import Request, RequestState
from pagedinfer.lora.adapter import AdapterError
from pagedinfer.lora.slots import SlotTable
from pagedinfer.sampling_params import SamplingParams

STOP = 3  # tokens are drawn from range(VOCAB); requests that list STOP end when they draw it
VOCAB = 8


@dataclass
class FakeSampled:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[dict | None] = field(default_factory=list)


def _mix(*values: object) -> int:
    """A fixed function of its arguments, the same in every process (``hash()`` of a str is not)."""
    return zlib.crc32(repr(values).encode())


def token_for(req: Request, index: int, position: int) -> int:
    """The token a completion draws at an output position: a fixed function, as a seeded sampler is."""
    return _mix(req.request_id, index, position) % VOCAB


def fake_beams(plan: SchedulerOutput) -> dict[Request, list[Candidate]]:
    """Each beam search's best continuations, as the engine ranks them: log-probabilities that are a
    fixed function of the beam's own tokens, so a beam recomputed after a preemption scores the same."""
    rows: dict[Request, list] = {}
    for t in plan.beam_targets:
        rows.setdefault(t.seq.request, []).append(t.seq)
    out = {}
    for req, beams in rows.items():
        scored = [
            (b.cumulative_logprob - (_mix(req.request_id, tuple(b.output_ids), tok) % 97) / 10, i, tok)
            for i, b in enumerate(beams)
            for tok in range(VOCAB)
        ]
        scored.sort(key=lambda x: (-x[0], x[1], x[2]))
        out[req] = [Candidate(i, tok, score) for score, i, tok in scored[: req.beam.num_candidates]]
    return out


def fake_sample(plan: SchedulerOutput) -> FakeSampled:
    out = FakeSampled()
    for t in plan.targets:
        out.token_ids.append(token_for(t.seq.request, t.seq.index, t.seq.num_output_tokens))
        out.logprobs.append(None)
        out.top.append(None)
    return out


@dataclass(frozen=True)
class FakeAdapter:
    """What the scheduler reads of an adapter (`lora.registry.LoadedAdapter`)."""

    name: str

    @property
    def digest(self) -> bytes:
        return self.name.encode()


class FakeSlots:
    """The registry's slots without weights: `SlotTable` choices, installs recorded, ``broken``
    adapters failing to install."""

    def __init__(self, max_loras: int, broken: frozenset[str] = frozenset()) -> None:
        self.max_loras = max_loras
        self.table = SlotTable(max_loras)
        self.broken = broken
        self.installs: list[tuple[str, int]] = []

    def activate(self, adapter: FakeAdapter, busy) -> int:
        if adapter.name in self.broken:
            raise AdapterError(f"adapter {adapter.name!r}: cannot be read")
        slot = self.table.find(adapter.name)
        if slot is None:
            slot = self.table.free({a.name for a in busy})
            self.table.hold(slot, adapter.name)
            self.installs.append((adapter.name, slot))
        return slot


def request(
    rid: str,
    prompt_len: int,
    n: int = 1,
    max_tokens: int = 4,
    stop: bool = False,
    first: int = 10,
    lora: str | None = None,
) -> Request:
    """Prompts ``first, first + 1, ...``: requests with the same ``first`` share a prefix (prefix cache)."""
    params = SamplingParams(n=n, max_tokens=max_tokens, stop_token_ids=[STOP] if stop else None)
    prompt = list(range(first, first + prompt_len))
    adapter = None if lora is None else FakeAdapter(lora)
    return Request(rid, int(rid.strip("r") or 0), None, prompt, params, max_tokens, lora=adapter)


def check_adapters(sched: Scheduler) -> None:
    """At most max_loras distinct adapters run, each in the slot the table gives it, one slot each."""
    slots = {r.lora.name: r.lora_slot for r in sched.running if r.lora is not None}
    assert len(slots) <= sched.admission.adapters.max_loras
    assert all(sched.admission.adapters.table.holders[slot] == name for name, slot in slots.items())
    assert len(set(slots.values())) == len(slots)
    assert all(
        r.lora_slot == slots[r.lora.name] for r in sched.running if r.lora is not None
    )  # lines of one adapter share its slot


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    plan = sched.schedule()
    return plan, sched.update_from_output(plan, ModelOutput(fake_sample(plan) if plan.batch else None))


def run(sched: Scheduler, limit: int = 1000) -> list[SchedulerOutput]:
    plans = []
    while sched.has_work:
        assert len(plans) < limit, "the scheduler made no progress"
        plans.append(step(sched)[0])
    return plans


def test_token_budget_splits_a_long_prompt_into_chunks():
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=5)
    sched.add(request("r1", 12, max_tokens=2))
    plans = run(sched)
    assert [[(s.start, s.num_tokens, s.sample) for s in p.batch] for p in plans] == [
        [(0, 5, False)],
        [(5, 5, False)],
        [(10, 2, True)],
        [(12, 1, True)],
    ]


def test_admission_stops_at_max_num_seqs_counting_future_completions():
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=4, max_num_batched_tokens=100)
    for rid, n in (("r1", 3), ("r2", 2), ("r3", 1)):
        sched.add(request(rid, 4, n=n))
    plan, _ = step(sched)
    assert [s.seq.name for s in plan.batch] == ["r1/prompt"]  # r2's 2 completions would make 5 > 4
    assert [r.request_id for r in sched.running] == ["r1"] and len(sched.waiting) == 2  # r3 waits behind


def test_admission_needs_free_blocks_for_the_prompt():
    sched = Scheduler(KVCacheManager(3, 4), max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(request("r1", 8))  # 2 blocks
    sched.add(request("r2", 8))  # 2 more: only 1 left
    step(sched)
    assert [r.request_id for r in sched.running] == ["r1"] and len(sched.waiting) == 1


def test_forked_completions_share_the_prompt_row_and_blocks():
    sched = Scheduler(KVCacheManager(16, 4), max_num_seqs=8, max_num_batched_tokens=100)
    req = request("r1", 6, n=3)
    sched.add(req)
    plan, _ = step(sched)
    assert plan.num_rows == 1 and [(t.seq.name, t.row) for t in plan.targets] == [
        ("r1/0", 0),
        ("r1/1", 0),
        ("r1/2", 0),
    ]
    tables = [s.block_table for s in req.completions]
    assert (
        tables[0] == tables[1] == tables[2] and sched.kv_cache_manager.pool.num_used == 2
    )  # seed 000: 6 tokens, 2 blocks
    assert all(sched.kv_cache_manager.pool.ref_counts[b] == 3 for b in tables[0])
    plan, _ = step(sched)  # each completion writes position 6 into the shared partial block
    assert len(plan.copies) == 2  # the first two writers copy; the last writes the original in place
    assert (
        sched.kv_cache_manager.pool.num_used == 4
        and sched.kv_cache_manager.pool.ref_counts[tables[0][0]] == 3
    )


def test_the_latest_admitted_request_is_preempted_and_resumes_with_its_tokens():
    sched = Scheduler(KVCacheManager(4, 2), max_num_seqs=8, max_num_batched_tokens=100)
    first, second = request("r1", 4, max_tokens=3), request("r2", 4, max_tokens=3, first=50)
    sched.add(first)
    sched.add(second)
    step(sched)  # both prompts: 2 blocks each, the pool is full
    before = list(second.completions[0].token_ids)
    plan, _ = step(sched)  # r1 needs a third block: r2, admitted last, gives its blocks back
    assert plan.preempted == [second] and second.state is RequestState.WAITING
    assert all(not s.block_table for s in second.completions) and second.completions[0].num_computed == 0
    run(sched)
    assert second.completions[0].token_ids[: len(before)] == before  # resumed with exactly what it had
    assert second.completions[0].num_output_tokens == 3 and sched.kv_cache_manager.pool.num_free == 4


def test_a_resumed_completion_restores_its_cached_generated_blocks():
    """r2 is preempted with 6 positions computed (3 full blocks: 4 prompt tokens, 2 generated); on its
    return the prompt recomputes only its last token and the completion starts at position 6."""
    for caching, resumed in ((True, [(3, 1), (6, 1)]), (False, [(0, 4), (4, 3)])):
        sched = Scheduler(KVCacheManager(7, 2, caching), max_num_seqs=8, max_num_batched_tokens=100)
        r1, r2 = request("r1", 4, max_tokens=4), request("r2", 4, max_tokens=8, first=50)
        sched.add(r1)
        sched.add(r2)
        plans = run(sched)
        assert plans[3].preempted == [r2]
        assert [(s.seq.name, s.start, s.num_tokens) for p in plans[4:6] for s in p.batch] == [
            ("r2/prompt", *resumed[0]),
            ("r2/0", *resumed[1]),
        ]
        assert sched.counters.output_tokens_restored == (2 if caching else 0)
        assert sched.counters.output_tokens_recomputed == (0 if caching else 2)
        assert sched.kv_cache_manager.pool.prefix_queries == (
            8 + 4 if caching else 0
        )  # prompts only, not the restored tokens


def test_a_request_that_preempts_itself_leaves_nothing_scheduled():
    sched = Scheduler(KVCacheManager(2, 2), max_num_seqs=8, max_num_batched_tokens=100)
    lone = request("r1", 3, n=2, max_tokens=2)  # prompt: 2 blocks; the completions then need 1 each
    sched.add(lone)
    step(sched)
    plan, _ = step(sched)  # the first completion copies... no block left for the second: r1 preempts itself
    assert plan.preempted == [lone] and plan.batch == [] and plan.targets == [] and plan.copies == []
    assert sched.kv_cache_manager.pool.num_free == 2 and lone.state is RequestState.WAITING


def test_finished_and_failed_requests_hold_no_blocks():
    sched = Scheduler(KVCacheManager(16, 4), max_num_seqs=8, max_num_batched_tokens=100)
    ok, bad = request("r1", 5, max_tokens=2), request("r2", 5, max_tokens=2)
    sched.add(ok)
    sched.add(bad)
    step(sched)
    sched.fail(bad, "broken")
    assert bad.error == "broken" and all(not s.block_table for s in bad.completions)
    plans = run(sched)
    assert ok.finished and not ok.error and sched.kv_cache_manager.pool.num_free == 16
    assert all(t.seq.request is ok for p in plans for t in p.targets)


def finish_first(sched: Scheduler) -> list[Request]:
    """Steps until some request finishes; returns what finished."""
    while True:
        done = step(sched)[1]
        if done:
            return done


def test_lpm_admits_the_request_with_the_cached_prefix_first():
    for policy, expected in (("fcfs", "r2"), ("lpm", "r3")):
        sched = Scheduler(KVCacheManager(64, 4), 1, 100, schedule_policy=policy)
        sched.add(request("r1", 12, max_tokens=1))  # prefix family 10: its 3 blocks stay cached
        sched.add(request("r2", 12, max_tokens=1, first=40))  # another family, arrived first
        sched.add(request("r3", 13, max_tokens=1))  # family 10 again: 3 blocks cached
        assert [r.request_id for r in finish_first(sched)] == ["r1"]
        plan, _ = step(sched)
        assert [s.seq.request.request_id for s in plan.batch] == [expected]
        if policy == "lpm":  # it starts after the cached 12 tokens
            assert plan.batch[0].start == 12 and sched.kv_cache_manager.pool.prefix_hits == 12
            assert sched.waiting[0].num_overtaken == 1  # r2 was passed over once


def test_lpm_lets_no_request_be_overtaken_more_than_max_num_seqs_times():
    max_seqs = 2
    sched = Scheduler(KVCacheManager(64, 4), max_seqs, 100, schedule_policy="lpm")
    sched.add(request("r0", 8, n=max_seqs, max_tokens=1))  # family 10, alone in the first step
    sched.add(request("r1", 8, max_tokens=1, first=40))  # a lone family, never cached while it waits
    for i in range(2, 12):
        sched.add(request(f"r{i}", 8, max_tokens=1))  # family 10: cached once r0 ran
    order = [r.request_id for plan in run(sched) for r in {s.seq.request: 0 for s in plan.batch}]
    overtaken_by = order.index("r1") - 1  # r0 arrived before it
    assert overtaken_by == max_seqs, order  # the bound, and no more
    assert sorted(order, key=lambda rid: int(rid[1:])) == [f"r{i}" for i in range(12)]  # all ran


def admissions(sched: Scheduler, limit: int = 1000) -> list[str]:
    """Run to the end, checking the adapters after every step; the request ids in admission order."""
    order: list[str] = []
    for _ in range(limit):
        if not sched.has_work:
            return order
        running = set(sched.running)
        step(sched)
        order += [r.request_id for r in sched.running if r not in running and r.request_id not in order]
        check_adapters(sched)
    raise AssertionError("the scheduler made no progress")


def test_requests_of_at_most_max_loras_adapters_run_at_once_and_slots_are_reused():
    sched = Scheduler(KVCacheManager(64, 4), 8, 100, adapters=FakeSlots(2))
    names = ["a", "b", "c", None, "a", "d", "b", "c"]
    reqs = [request(f"r{i}", 5, max_tokens=3 + i % 3, lora=n, first=10 + i) for i, n in enumerate(names)]
    for r in reqs:
        sched.add(r)
    order = admissions(sched)
    assert sorted(order) == sorted(r.request_id for r in reqs) and all(
        r.finished and not r.error for r in reqs
    )
    assert order[:4] == ["r0", "r1", "r3", "r4"]  # c waits for a slot; the base line and a's next pass it
    installs = sched.admission.adapters.installs
    assert {name for name, _ in installs} == {"a", "b", "c", "d"} and {s for _, s in installs} == {1, 2}


def test_a_request_waiting_for_a_slot_is_overtaken_at_most_max_num_seqs_times():
    """One slot, adapter a's lines keep arriving and running: b's line waits, base lines pass it,
    and once max_num_seqs later lines went first, no other adapter's line goes before it."""
    max_seqs = 3
    sched = Scheduler(KVCacheManager(256, 4), max_seqs, 100, adapters=FakeSlots(1))
    sched.add(request("r0", 4, max_tokens=6, lora="a"))
    sched.add(request("r1", 4, max_tokens=2, lora="b", first=30))
    for i in range(2, 14):  # a's lines (staggered lengths keep one running at every step) and base lines
        sched.add(request(f"r{i}", 4, max_tokens=2 + i % 4, lora=None if i % 3 == 0 else "a", first=40 + i))
    order = admissions(sched)
    # r2, r3 (base) and r4 overtake it: max_num_seqs; then only the base line r6 passes it
    assert order[: order.index("r1") + 1] == ["r0", "r2", "r3", "r4", "r6", "r1"], order
    assert len(order) == 14


def test_an_adapter_that_cannot_be_installed_fails_its_requests_alone():
    sched = Scheduler(KVCacheManager(64, 4), 8, 100, adapters=FakeSlots(1, frozenset({"x"})))
    ok, bad, base = (
        request("r1", 5, lora="a"),
        request("r2", 5, lora="x", first=30),
        request("r3", 5, first=50),
    )
    for r in (ok, bad, base):
        sched.add(r)
    finished = [r for _ in range(20) if sched.has_work for r in step(sched)[1]]
    assert bad in finished and bad.error == "lora: adapter 'x': cannot be read" and not bad.completions
    assert ok.finished and base.finished and not ok.error and not base.error
    assert sched.kv_cache_manager.pool.num_free == 64


class SchedulerMachine(RuleBasedStateMachine):
    """Random requests, beam searches and failures on tiny pools; the rules every step must keep,
    checked after each one."""

    @initialize(
        num_blocks=st.integers(4, 12),
        block_size=st.sampled_from([1, 2, 4]),
        max_seqs=st.integers(1, 6),
        budget=st.integers(1, 12),
        policy=st.sampled_from(["fcfs", "lpm"]),
        max_loras=st.integers(1, 3),
        windows=st.sampled_from([(0,), (0,), (2,), (0, 3), (0, 1, 5)]),  # layer groups' windows
    )
    def setup(self, num_blocks, block_size, max_seqs, budget, policy, max_loras, windows):
        slots = FakeSlots(max_loras)
        num_blocks *= len(windows)  # as many per layer group
        kv = KVCacheManager(num_blocks, block_size, windows=windows)
        self.sched = Scheduler(kv, max_seqs, budget, schedule_policy=policy, adapters=slots)
        self.limits = RequestLimits(40, max_seqs, budget, num_blocks, block_size, num_groups=len(windows))
        self.requests: list[Request] = []
        self.expected: dict[tuple[str, int], list[int]] = {}  # (request, completion) -> tokens handed out
        self.steps = 0
        self.arrival: dict[str, int] = {}
        self.finished_at: dict[str, int] = {}
        self.failed: set[str] = set()

    def _add(self, req: Request, beam: bool) -> None:
        if self.limits.rejection_reason(req.num_prompt_tokens, req.params.n, req.max_tokens, beam) is None:
            self.sched.add(req)
            self.requests.append(req)
            self.arrival[req.request_id] = self.steps

    @rule(
        prompt_len=st.integers(1, 9),
        n=st.integers(1, 3),
        max_tokens=st.integers(1, 5),
        stop=st.booleans(),
        first=st.sampled_from([10, 30]),
        lora=st.sampled_from([None, "a", "b", "c", "d"]),
    )
    def add(self, prompt_len, n, max_tokens, stop, first, lora):
        rid = f"r{len(self.requests)}"
        self._add(request(rid, prompt_len, n, max_tokens, stop, first, lora), beam=False)

    @rule(
        prompt_len=st.integers(1, 9),
        width=st.integers(1, 3),
        max_tokens=st.integers(1, 4),
        early=st.sampled_from([True, False, "never"]),
        first=st.sampled_from([10, 30]),
    )
    def add_beam_search(self, prompt_len, width, max_tokens, early, first):
        req = request(f"r{len(self.requests)}", prompt_len, width, max_tokens, False, first)
        req.beam = BeamSearch(width, max_tokens, 1.0, early, frozenset({STOP}))
        self._add(req, beam=True)

    @precondition(
        lambda self: any(r.state is not RequestState.FINISHED for r in getattr(self, "requests", []))
    )
    @rule(data=st.data())
    def fail(self, data):
        """A request fails mid-run (its tokenizer or a processor raised): it alone ends, its blocks freed."""
        req = data.draw(st.sampled_from([r for r in self.requests if r.state is not RequestState.FINISHED]))
        self.sched.fail(req, "failed by the test")
        self.failed.add(req.request_id)
        assert req.prompt_seq is None and all(not s.block_table for s in req.completions)

    @rule()
    def step(self):
        sched = self.sched
        plan = sched.schedule()
        self.steps += 1
        assert plan.num_tokens <= sched.max_num_batched_tokens
        assert (
            sum(r.num_future_seqs() for r in sched.running) <= sched.max_num_seqs or len(sched.running) == 1
        )
        assert plan.num_rows == sum(s.sample for s in plan.batch)
        assert all(0 <= t.row < plan.num_rows for t in [*plan.targets, *plan.beam_targets])
        live_beams = {}
        for t in plan.beam_targets:
            live_beams.setdefault(t.seq.request, []).append(t.seq)
        for req, beams in live_beams.items():  # every live beam of a search computes its last token together
            assert beams == [s for s in req.completions if not s.finished]
        sampled = fake_sample(plan) if plan.batch else None
        for t, token in zip(plan.targets, sampled.token_ids if sampled else [], strict=True):
            key = (t.seq.request.request_id, t.seq.index)
            assert t.seq.output_ids == self.expected.get(key, []), (
                "a resumed completion lost or changed tokens"
            )
            self.expected.setdefault(key, []).append(token)
        beams = fake_beams(plan) if plan.beam_targets else None
        for req in sched.update_from_output(plan, ModelOutput(sampled, beams or {})):
            self.finished_at[req.request_id] = self.steps

    @invariant()
    def adapters_fit_their_slots(self):
        if hasattr(self, "sched"):
            check_adapters(self.sched)

    @invariant()
    def reference_counts_match_tables(self):
        if not hasattr(self, "sched"):
            return
        kv = self.sched.kv_cache_manager
        pool, null = kv.pool, kv.pool.null_block
        counts = [0] * len(pool.ref_counts)
        if null is not None:
            counts[null] = 1  # the pool's own reference
        for req in self.sched.running:  # only live sequences hold blocks: finished completions free theirs
            for seq in req.live_seqs():
                for g, table in enumerate(seq.block_tables):
                    for block in table:
                        counts[block] += 1
                    # a windowed table released no block its next query's window still reads
                    first = max(0, seq.num_computed - kv.windows[g] + 1) // pool.block_size
                    assert null not in table[first if kv.windows[g] else 0 :]
        assert counts == pool.ref_counts
        assert pool.num_free == counts[: pool.num_blocks].count(0)
        used = [0] * len(kv.windows)
        for block in range(pool.num_blocks):
            used[pool.group_of[block]] += counts[block] > 0
        assert used == pool.used_by_group

    @invariant()
    def finished_requests_hold_nothing_and_kept_their_tokens(self):
        for req in getattr(self, "requests", []):
            if req.state is RequestState.FINISHED:
                assert req.prompt_seq is None and all(not s.block_table for s in req.completions)
                if req.request_id in self.failed:
                    assert req.error == "failed by the test"
                elif req.beam is not None:
                    assert req.beam.done and 1 <= len(req.beam.finished) <= req.params.n
                    assert all(h.token_ids and len(h.token_ids) <= req.max_tokens for h in req.beam.finished)
                else:
                    for s in req.completions:
                        assert s.output_ids == self.expected[(req.request_id, s.index)]
                        assert s.finish_reason == (
                            "stop" if s.output_ids[-1] in s.request.params.stop_token_ids else "length"
                        )
            elif req.state is RequestState.WAITING:
                assert all(not s.block_table for s in req.completions)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        work = sum(
            r.num_prompt_tokens + r.params.n * r.max_tokens * (1 + (r.beam is not None))
            for r in self.requests
        )
        bound = self.steps + 2 * work + 10
        while self.sched.has_work:
            assert self.steps < bound, "a request starves: the workload did not finish in time"
            self.step()
            self.reference_counts_match_tables()
            self.finished_requests_hold_nothing_and_kept_their_tokens()
        assert all(r.state is RequestState.FINISHED for r in self.requests)
        assert all(bool(r.error) == (r.request_id in self.failed) for r in self.requests)
        for r in self.requests:  # no request waits longer than the whole workload's token count, twice over
            if r.request_id in self.finished_at:
                assert self.finished_at[r.request_id] - self.arrival[r.request_id] <= 2 * work + 10
        assert self.sched.kv_cache_manager.pool.num_free == self.sched.kv_cache_manager.pool.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase

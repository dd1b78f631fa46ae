"""Agreed copy completion (``kv/copies.py``): when a copy or a reader epoch completes is a function of the step
sequence, not of device event timing, so tensor-parallel ranks take the same KV decisions.

CPU copies have no events; the CUDA-shaped completion path (``query()`` to test readiness, ``synchronize()`` to wait)
is driven here by stand-in events (``CopyEngine.event_source`` / ``ReaderFence.event_source``) whose ``query()``
answers at random (seeded) — event timing that differs from run to run, as it does between ranks. The copies
themselves are performed (on CPU) when they complete, so reading a destination too early still shows stale rows."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import random_prompts
from tiny_v4 import make_v4_checkpoint

from dhisparse import LLM, SamplingParams
from dhisparse.engine.parallel.rank import digest
from dhisparse.kv.copies import CopyEngine, ReaderFence
from dhisparse.kv.factory import agree_copy_completion

CPU = torch.device("cpu")


class StandInEvent:
    """A device event whose completion the test controls: ``query()`` fires with probability ``p`` per call (seeded;
    once fired it stays fired), ``synchronize()`` waits for it (fires it)."""

    def __init__(self, rng: random.Random, p: float) -> None:
        self.rng, self.p, self.fired = rng, p, False

    def query(self) -> bool:
        self.fired = self.fired or self.rng.random() < self.p
        return self.fired

    def synchronize(self) -> None:
        self.fired = True


class Events:
    """A source of stand-in events; ``made`` keeps them so a unit test can fire one by hand."""

    def __init__(self, seed: int = 0, p: float = 0.0) -> None:
        self.rng, self.p = random.Random(seed), p
        self.made: list[StandInEvent] = []

    def __call__(self) -> StandInEvent:
        self.made.append(StandInEvent(self.rng, self.p))
        return self.made[-1]


def _copy(engine: CopyEngine, buf: torch.Tensor, row: int, value: float):
    return engine.issue("fetch", buf, torch.tensor([row]), torch.full((1, 1), value), torch.tensor([0]))


# ------------------------------------------------------------------------------------------------ the rule
def test_event_timing_decides_completion_when_not_agreed() -> None:
    engine, events = CopyEngine(CPU), Events()
    engine.event_source = events
    buf = torch.zeros(3, 1)
    a, b = _copy(engine, buf, 0, 1.0), _copy(engine, buf, 1, 2.0)
    assert engine.poll() == 0 and not a.done  # neither event fired
    events.made[1].fired = True
    assert engine.poll() == 0  # oldest first: b waits behind a
    events.made[0].fired = True
    assert engine.poll() == 2 and a.done and b.done and buf.flatten().tolist() == [1.0, 2.0, 0.0]


def test_agreed_poll_completes_exactly_the_copies_issued_before_the_previous_poll() -> None:
    engine, events = CopyEngine(CPU), Events()
    engine.event_source, engine.agreed = events, True
    buf = torch.zeros(3, 1)
    a, b = _copy(engine, buf, 0, 1.0), _copy(engine, buf, 1, 2.0)
    events.made[0].fired = True
    assert engine.poll() == 0 and not a.done  # issued after the previous poll (none): not yet, even though fired
    c = _copy(engine, buf, 2, 3.0)
    events.made[2].fired = True
    assert engine.poll() == 2 and a.done and b.done and not c.done  # b's event had not fired: waited on
    assert engine.agreed_stalls == 1 and events.made[1].fired  # the wait synchronised on b's event
    assert buf.flatten().tolist() == [1.0, 2.0, 0.0]
    assert engine.poll() == 1 and c.done and engine.agreed_stalls == 1 and engine.num_pending == 0
    assert engine.poll() == 0


def test_agreed_mode_keeps_explicit_waits_and_reads() -> None:
    engine, events = CopyEngine(CPU), Events()
    engine.event_source, engine.agreed = events, True
    buf = torch.zeros(2, 1)
    a, b = _copy(engine, buf, 0, 1.0), _copy(engine, buf, 1, 2.0)
    engine.wait_for_read(a)  # on CPU a reader waits: the rows are there before it reads them
    assert a.done and not b.done and buf[0, 0] == 1.0 and events.made[0].fired
    engine.wait_all()
    assert b.done and buf[1, 0] == 2.0


def test_agreed_reader_fence_counts_epochs_ended_before_the_previous_tick() -> None:
    fence, events = ReaderFence(CPU), Events()
    fence.event_source, fence.agreed = events, True
    fence.begin()
    fence.end()
    events.made[0].fired = True
    assert not fence.finished(1)  # no tick since it ended
    fence.tick()
    assert not fence.finished(1)  # ended before this tick, not before the previous one
    fence.begin()
    fence.end()
    events.made[1].fired = True
    fence.tick()
    assert fence.finished(1) and not fence.finished(2) and fence.agreed_stalls == 0
    fence.tick()
    assert fence.finished(2)


def test_agreed_reader_fence_waits_on_an_event_that_has_not_fired() -> None:
    fence, events = ReaderFence(CPU), Events()
    fence.event_source, fence.agreed = events, True
    fence.begin()
    fence.end()
    fence.tick()
    fence.tick()
    assert fence.finished(1) and fence.agreed_stalls == 1 and events.made[0].fired
    plain, plain_events = ReaderFence(CPU), Events()
    plain.event_source = plain_events
    plain.begin()
    plain.end()
    plain.tick()
    plain.tick()
    assert not plain.finished(1)  # not agreed: the event decides
    plain_events.made[0].fired = True
    assert plain.finished(1)


# ------------------------------------------------------------------------------------------------ an engine
LENGTHS = [7, 23, 50, 31, 64]
NEW_TOKENS = 10


def _run(engine_dir, pool_bytes: int, seed: int, agreed: bool) -> tuple[list[list[int]], list[str], float]:
    """Serve the prompts with stand-in events answering at random (``seed``); returns the tokens, the per-step digest
    the tensor-parallel driver compares (tokens + KV decision counters and gauges) and the stalls."""
    llm = LLM(engine_dir, kv_policy="adaptive", page_rows=4, pool_bytes=pool_bytes, refill_pages_per_step=4,
              max_batch_size=3, agreed_copy_completion=agreed)  # the runtime option (TP ranks: always on)
    kv = llm.engine.kv
    assert kv.copies.agreed == kv.fence.agreed == agreed and kv.stats()["kv_copies_agreed"] == float(agreed)
    events = Events(seed, p=0.4)
    kv.copies.event_source = kv.fence.event_source = events
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
           for p in random_prompts(LENGTHS, 96, seed=5)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    digests = []
    while engine.has_unfinished():
        updates = engine.step()
        for u in updates:
            assert u.error is None, u.error
            tokens[u.request_id] += u.new_token_ids
        digests.append(digest(updates, kv.stats()))
    for _ in range(20):  # deferred frees of the last releases (bounded: nothing may hang)
        if not (kv.releasing or kv.copies.num_pending):
            break
        engine.poll_idle()
        digests.append(digest([], kv.stats()))
    assert len(events.made) > 20  # the stand-in events really decided completions
    stats = kv.stats()
    assert stats["kv_requests_releasing"] == 0 and stats["kv_required_bytes"] == 0
    return [tokens[i] for i in ids], digests, stats["kv_copy_agreed_stalls"]


def test_agreed_completion_makes_kv_decisions_independent_of_event_timing(tiny_engine) -> None:
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    probe = LLM(engine_dir, kv_policy="adaptive", page_rows=4)
    pool_bytes = 2 * probe.engine.kv.required_bytes(max(LENGTHS), NEW_TOKENS)
    reference = [o.token_ids for o in LLM(engine_dir, kv_policy="dense").generate(
        random_prompts(LENGTHS, 96, seed=5), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))]
    seeds = (0, 1, 2)
    agreed = [_run(engine_dir, pool_bytes, seed, agreed=True) for seed in seeds]
    for tokens, digests, _ in agreed:
        assert tokens == reference
        assert digests == agreed[0][1]  # the same KV decisions at every step, whatever the events answered
    assert any(stalls > 0 for _, _, stalls in agreed)  # some completions had to wait on their event
    plain = [_run(engine_dir, pool_bytes, seed, agreed=False) for seed in seeds]
    assert all(tokens == reference for tokens, _, _ in plain)  # exact either way …
    assert len({tuple(digests) for _, digests, _ in plain}) > 1  # … but the decisions follow the event timing


@pytest.mark.parametrize("policy", ["dense", "adaptive"])
def test_agree_copy_completion_reaches_the_hierarchy_of_every_store(tiny_root, policy) -> None:
    from dhisparse_builder import BuildOptions, build_engine

    out = tiny_root / "engine-v4-v4_small_topk-plain"  # the same directory as test_deepseek_v4_hierarchy.py's
    if not out.exists():
        build_engine(BuildOptions(make_v4_checkpoint(tiny_root, "v4_small_topk"), out, {"dtype": "float64"}),
                     progress=lambda d, t: None)
    llm = LLM(out, kv_policy=policy, **({} if policy == "dense" else {"page_rows": 4}))
    kv = llm.engine.kv
    assert agree_copy_completion(kv) == (policy != "dense")
    if policy != "dense":
        assert kv.inner.copies.agreed and kv.inner.fence.agreed
        assert llm.stats()["kv_copies_agreed"] == 1.0

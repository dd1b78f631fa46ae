"""Persistent batch state (kv/batch_state.py): requests occupy slots of batched device tensors from admission to
release, steps read their slots (in any order) and the resolver's hot-cache changes land in the slots during the
step, never copied back at end_step; gathers stay exact and the invariants (slot consistency included) hold."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from kv_driver import KVDriver, make_layout, make_manager

from dhisparse.kv import KVManager


def _sized(m: KVManager, max_batch_size: int, max_model_len: int) -> KVManager:
    cfg = dataclasses.replace(m.config, max_batch_size=max_batch_size, max_model_len=max_model_len)
    return KVManager(m.layout, cfg, torch.device("cpu"), poison_freed=True)


@pytest.mark.parametrize("policy", ["resident", "hisparse", "adaptive"])
@pytest.mark.parametrize("sized", [True, False])
def test_slots_follow_admission_and_release_with_steps_in_any_order(policy: str, sized: bool) -> None:
    layout = make_layout("glm")
    m = make_manager(layout, policy, pool_bytes=1 << 20, hot_rows=4)
    if sized:
        m = _sized(m, max_batch_size=4, max_model_len=64)
        assert m.batch.nbytes == m.stats()["kv_batch_state_bytes"]
    allocated = m.batch.nbytes
    m.compact_slots = False  # slots stay where admission put them (compaction: the test below)
    d = KVDriver(m, seed=3)
    rng = random.Random(5)
    for i in range(3):
        d.submit(f"r{i}", 9 + 4 * i, 12)
    assert [m.requests[f"r{i}"].slot for i in range(3)] == [0, 1, 2]
    for n in range(14):
        rids = d.steppable()
        rng.shuffle(rids)  # slots not consecutive in step order: the step gathers and scatters back
        if n % 3 == 0:
            rids = sorted(rids, key=lambda r: m.requests[r].slot)  # consecutive: views of the batch state
        d.step(rids, 1)
        if n == 4:
            d.finish("r1")
            assert 1 in m.batch.free_slots
            d.submit("r3", 21, 10)
            assert m.requests["r3"].slot == 1  # the lowest free slot is reused
        d.poll()
    assert m.stats()["kv_batch_slots_used"] == len(m.requests)
    if sized:
        assert m.batch.nbytes == allocated  # allocated once
    d.drain()
    assert sorted(m.batch.free_slots) == list(range(m.batch.num_slots))
    m.check_invariants()


def test_state_grows_without_a_configured_size_and_refuses_beyond_a_configured_one() -> None:
    layout = make_layout("deepseek")
    m = make_manager(layout, "hisparse", pool_bytes=1 << 20, hot_rows=4)
    d = KVDriver(m, seed=1)
    for i in range(6):  # more requests and positions than the initial size: grows, views re-pointed
        d.submit(f"r{i}", 40 + 10 * i, 8)
    assert m.batch.num_slots >= 6
    for _ in range(3):
        d.step(d.steppable(), 1)
    d.drain()
    sized = _sized(m, max_batch_size=2, max_model_len=32)
    assert sized.try_admit("a", 10, 5) and sized.try_admit("b", 10, 5)
    with pytest.raises(ValueError, match="max_batch_size"):
        sized.try_admit("c", 10, 5)
    with pytest.raises(ValueError, match="max_model_len"):
        _sized(m, 2, 32).try_admit("long", 40, 5)


@pytest.mark.parametrize("shuffle", [False, True])
def test_hot_cache_changes_land_in_the_slots_during_the_step(shuffle: bool) -> None:
    """No copy back at end_step: the batch state holds the resolver's hot state before end_step runs, and a
    rolled-back step restores it (slots it refilled emptied)."""
    layout = make_layout("deepseek")
    m = make_manager(layout, "hisparse", pool_bytes=1 << 20, hot_rows=4)
    m.compact_slots = False  # shuffled: the step gathers its slots' rows and writes hot state back through them
    d = KVDriver(m, seed=2)
    for i in range(3):
        d.submit(f"r{i}", 13, 6)
    rids = ["r2", "r0", "r1"] if shuffle else ["r0", "r1", "r2"]
    before = m.batch.hot_pos.clone()
    step = m.begin_step(rids, 1)
    for layer in range(layout.num_layers):
        step.write(layer, torch.zeros(3, 1, layout.row_dim), torch.zeros(3, 1, layout.index_key_dim))
        step.gather(layer, torch.tensor([[[0, 1, 2, 3]]] * 3))  # the first page left the tail: host misses
    slots = [m.requests[r].slot for r in rids]
    assert torch.equal(m.batch.hot_pos[slots], step.hot_pos)
    assert not torch.equal(m.batch.hot_pos, before)
    m.abort_step()
    assert bool((m.batch.hot_pos[slots] == -1).all())  # every slot the step filled is emptied
    m.check_invariants()


def test_engine_allocates_the_batch_state_once_within_pool_plus_workspace_bound(tiny_engine) -> None:
    """The engine sizes the batch state from max_batch_size and max_model_len at start; the KV side's persistent
    device bytes (arena + batch state) stay within pool_bytes + the printed workspace bound, and generating does
    not change them."""
    from tiny_models import random_prompts

    from dhisparse import LLM, SamplingParams

    pool = 1 << 20
    llm = LLM(tiny_engine("glm_fsfs_sparse", "float32"), kv_policy="adaptive", max_batch_size=2,
              prefill_chunk_tokens=32, page_rows=16, pool_bytes=pool, max_model_len=320)
    kv = llm.engine.kv
    assert kv.batch.fixed and kv.batch.num_slots == 2 and kv.batch.pages_per_slot == 20
    before = kv.batch.nbytes
    assert kv.pool.arena.nbytes + before <= pool + llm.engine.workspace.total_bytes
    llm.generate(random_prompts([40, 70, 25], 96, seed=4), SamplingParams(max_tokens=5, ignore_eos=True))
    assert kv.batch.nbytes == before and llm.stats()["kv_batch_state_bytes"] == before
    kv.check_invariants()


@pytest.mark.parametrize("policy", ["resident", "hisparse", "adaptive"])
def test_slots_are_compacted_so_steps_read_views(policy: str) -> None:
    """After requests leave from the middle of the batch, or a step lists its requests in another order, begin_step
    moves requests so the step's slots are consecutive in step order (a view, no gather); the moved rows, hot state
    and key pages stay exact (the driver checks every gathered row) and the invariants hold."""
    layout = make_layout("deepseek")
    m = make_manager(layout, policy, pool_bytes=1 << 21, hot_rows=8)
    d = KVDriver(m, seed=3)
    for i in range(5):
        assert d.submit(f"r{i}", 9 + 7 * i, 12)
    d.step(d.steppable(), 1)
    d.finish("r1")
    d.finish("r3")
    views = []
    begin = m.begin_step

    def recording_begin(ids, q):
        step = begin(ids, q)
        views.append(step.scatter is None)
        return step
    m.begin_step = recording_begin
    for order in (["r0", "r2", "r4"], ["r4", "r0", "r2"], ["r2", "r4"]):
        d.step(order, 1)
        assert [m.requests[r].slot for r in order] == list(range(len(order)))
        m.check_invariants()
    assert views == [True, True, True] and m.stats()["kv_batch_slots_moved"] >= 4
    assert d.submit("r5", 20, 6)  # the lowest free slot after the three running requests
    assert m.requests["r5"].slot == 3
    d.step(["r2", "r4", "r0", "r5"], 1)
    m.check_invariants()
    d.drain()

"""Faults of a multi-rank engine: a rank killed mid-stream, a rank that raises inside a forward, a rank that raises
where the others do not (its peers' collective times out), ranks whose KV decisions diverge. Each time the clients get
an error within seconds, the engine turns dead, and no rank process is left behind (nothing hangs in a collective).
Bad input and cancellation on a healthy multi-rank engine behave as on one process."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from parallel_engines import parallel_llm, tight_pool
from tiny_models import random_prompts

from dhisparse import SamplingParams
from dhisparse.engine.loop import EngineLoop
from dhisparse.engine.parallel.rank import DRILL_ENV
from dhisparse.errors import EngineDeadError, InvalidRequestError, RequestFailedError

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


def _gone(pids: dict[int, int], within_s: float = 5.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        alive = []
        for pid in pids.values():
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _errors_within(stream, seconds: float) -> tuple[type[BaseException], float]:
    start = time.monotonic()
    with pytest.raises((EngineDeadError, RequestFailedError)) as info:
        for _ in stream:
            assert time.monotonic() - start < seconds, "the stream kept going after the fault"
    return info.type, time.monotonic() - start


def test_rank_killed_mid_stream(tiny_engine) -> None:
    engine_dir = tiny_engine("glm_fsfs_sparse", "float64")
    pool = tight_pool(engine_dir, 12, 200, kv_policy="resident", page_rows=8)
    with parallel_llm(engine_dir, tensor_parallel_size=2, kv_policy="resident", page_rows=8, pool_bytes=pool) as llm:
        engine = llm.engine
        # A healthy multi-rank engine refuses bad input before queueing anything and frees a cancelled request.
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            engine.validate([1, 500], SamplingParams())
        with pytest.raises(InvalidRequestError, match="never fit the KV pool"):
            engine.validate([1] * 100, SamplingParams(max_tokens=800))
        assert not engine.requests
        loop = EngineLoop(llm)
        doomed = loop.submit(random_prompts([9], 96, 3)[0], LONG)
        cancelled = loop.submit(random_prompts([12], 96, 4)[0], LONG)
        it = iter(cancelled)
        next(it)
        cancelled.cancel()
        assert [u.finish_reason for u in it][-1] == "abort"
        stream = iter(doomed)
        next(stream)  # tokens are flowing
        pids = engine.ranks.pids()
        os.kill(pids[1], signal.SIGKILL)
        kind, took = _errors_within(stream, 10.0)
        assert kind is EngineDeadError and took < 5.0
        assert not loop.alive and engine.dead is not None and "rank 1" in engine.dead
        assert _gone(pids)  # rank 0 was killed too: nothing waits in a collective
        with pytest.raises(EngineDeadError):
            loop.submit([1, 2, 3], SamplingParams())
        loop.close()


@pytest.mark.parametrize("shape", [dict(data_parallel_size=2), dict(tensor_parallel_size=2, expert_parallel=True)],
                         ids=["dp", "tp-ep"])
def test_rank_that_raises_in_a_forward_stops_the_engine(shape, tiny_engine, monkeypatch) -> None:
    monkeypatch.setenv(DRILL_ENV, json.dumps({"1": {"fault_injection": "decode_forward@3"}}))
    engine_dir = tiny_engine("glm_fsfs_sparse", "float64")
    with parallel_llm(engine_dir, kv_policy="hisparse", **shape) as llm:
        pids = llm.engine.ranks.pids()
        start = time.monotonic()
        with pytest.raises(RequestFailedError) as info:
            llm.generate(random_prompts([9, 14, 5], 96, 5), LONG)
        assert time.monotonic() - start < 30.0
        assert all(o.finish_reason == "error" for o in info.value.outputs)
        assert "injected fault at decode_forward" in llm.engine.dead
        assert _gone(pids)
        with pytest.raises(EngineDeadError):
            llm.engine.step()


def test_rank_that_raises_alone_outside_a_forward_times_out_its_peer(tiny_engine, monkeypatch) -> None:
    """Rank 1 fails a prefill before its forward; rank 0's forward waits in a collective that rank 1 never joins:
    the collective timeout (here 3 s) ends it, and the engine stops instead of hanging."""
    monkeypatch.setenv(DRILL_ENV, json.dumps({"1": {"fault_injection": "prefill_chunk@1"}}))
    engine_dir = tiny_engine("glm_fsfs_sparse", "float64")
    with parallel_llm(engine_dir, tensor_parallel_size=2, kv_policy="resident", collective_timeout_s=3.0) as llm:
        pids = llm.engine.ranks.pids()
        start = time.monotonic()
        with pytest.raises(RequestFailedError):
            llm.generate(random_prompts([9], 96, 6), LONG)
        took = time.monotonic() - start
        assert 2.5 < took < 20.0, took
        assert llm.engine.dead is not None
        assert _gone(pids)


def test_diverging_kv_decisions_are_caught(tiny_engine, monkeypatch) -> None:
    """Tensor-parallel ranks must take the same residency decisions; one rank with a different hot cache resolves
    rows differently (same tokens): the per-step digest differs and the engine stops, naming the divergence."""
    monkeypatch.setenv(DRILL_ENV, json.dumps({"1": {"hot_rows": 24}}))
    engine_dir = tiny_engine("glm_fsfs_sparse", "float64")
    with parallel_llm(engine_dir, tensor_parallel_size=2, kv_policy="hisparse", page_rows=8) as llm:
        with pytest.raises(RequestFailedError):
            llm.generate(random_prompts([50, 41], 96, 7), SamplingParams(max_tokens=8, ignore_eos=True))
        assert "diverged" in llm.engine.dead

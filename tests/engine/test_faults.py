"""A failed engine step costs only the requests in it: fault injection through ``EngineLoop``.

Each case serves several concurrent streams on a tight pool with one injected fault (``fault_injection``, see
``dhisparse/engine/faults.py``) and checks that (1) every stream ends within a bound, (2) the fault reached a
client as ``RequestFailedError`` naming it, (3) every stream that finished has exactly its fault-free tokens,
(4) a request submitted afterwards is token-exact, (5) the KV hierarchy returns to idle (no bytes, no host
pages) with its invariants intact.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from tiny_models import build_spec_engine, random_prompts

from dhisparse import LLM, SamplingParams
from dhisparse.engine.faults import FaultInjector
from dhisparse.engine.loop import EngineLoop
from dhisparse.errors import ConfigError, EngineDeadError, RequestFailedError

LENGTHS = [41, 23, 57, 30, 35]
NEW_TOKENS = 12
BOUND_S = 120.0  # generous: a hung stream is what this catches, not a slow one
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    return build_spec_engine(tmp_path_factory.mktemp("faults"), tiny_checkpoint("glm_fsfs_sparse"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS + [19], 96, seed=5)


@pytest.fixture(scope="module")
def reference(engine_dir, prompts) -> list[list[int]]:
    llm = LLM(engine_dir, kv_policy="dense")
    return [o.token_ids for o in llm.generate(prompts, PARAMS)]


def _kwargs(engine_dir: Path, policy: str, speculative: str | None, faults: str) -> dict:
    kwargs = dict(kv_policy=policy, page_rows=8, max_batch_size=3, prefill_chunk_tokens=16, speculative=speculative,
                  num_draft_tokens=3, fault_injection=faults)
    if faults.startswith("copy.import"):  # the import copy runs where the prefill hands over a LocalKV's rows
        kwargs["stream_prefill"] = False
    probe = LLM(engine_dir, **{**kwargs, "fault_injection": ""}, pool_bytes=1 << 30)
    need = probe.engine.kv.required_bytes(max(LENGTHS), NEW_TOKENS)
    kwargs["pool_bytes"] = 2 * need + 4096  # two requests at a time: reclaim, waiting and refill all happen
    return kwargs


def _consume(stream, out: dict, i: int) -> None:
    tokens: list[int] = []
    try:
        for update in stream:
            tokens.extend(update.new_token_ids)
        out[i] = tokens
    except BaseException as exc:  # recorded for the assertions
        out[i] = exc


def _serve(loop: EngineLoop, prompts: list[list[int]]) -> dict:
    streams = [loop.submit(p, PARAMS) for p in prompts]
    results: dict = {}
    threads = [threading.Thread(target=_consume, args=(s, results, i)) for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    assert not any(t.is_alive() for t in threads), "a stream did not end"
    return results


def _assert_idle(llm: LLM) -> None:
    kv = llm.engine.kv
    kv.copies.wait_all()
    kv.poll()
    kv.check_invariants()
    stats = kv.stats()
    assert stats["kv_required_bytes"] == 0 and stats["kv_optional_bytes"] == 0
    assert stats["kv_host_pages_used"] == 0 and stats["kv_requests_running"] == 0
    assert not llm.engine.requests and not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


CASES = [
    ("decode_forward@4", "adaptive", None),
    ("verify_forward@3", "adaptive", "dflash2"),
    ("verify_forward@3", "hisparse", "dspark"),
    ("draft_propose@2", "adaptive", "dflash2"),
    ("prefill_chunk@1", "adaptive", None),
    ("prefill_chunk@3", "hisparse", "dspark"),  # a later chunk of the first prompt (41 tokens, chunks of 16)
    ("copy.fetch@2", "hisparse", None),  # host→device rows of a decode step
    ("copy.import@1", "adaptive", None),  # a prompt's pages going to the host store (prefill over a LocalKV)
]


@pytest.mark.parametrize(("faults", "policy", "speculative"), CASES)
def test_a_fault_ends_only_the_requests_of_the_failing_work(engine_dir, prompts, reference, faults, policy,
                                                             speculative):
    llm = LLM(engine_dir, **_kwargs(engine_dir, policy, speculative, faults))
    loop = EngineLoop(llm)
    try:
        results = _serve(loop, prompts[:-1])
        failed = [i for i, r in results.items() if isinstance(r, BaseException)]
        assert failed, f"the injected fault {faults} reached no request"
        for i in failed:
            assert isinstance(results[i], RequestFailedError), results[i]
            assert "injected fault" in str(results[i])
        for i, r in results.items():
            if i not in failed:
                assert r == reference[i], f"request {i} changed its tokens after a fault elsewhere"
        assert len(failed) < len(results), "the fault ended requests outside the failing work"
        after = _serve(loop, prompts[-1:])  # the engine goes on serving, exactly
        assert after[0] == reference[-1]
        stats = loop.stats()
        assert stats["step_faults"] >= 1 and stats["requests_failed"] == len(failed)
        assert stats["engine_alive"] == 1.0
    finally:
        loop.close()
    _assert_idle(llm)


def test_an_engine_that_cannot_restore_its_invariants_stops_and_answers_everyone(engine_dir, prompts):
    llm = LLM(engine_dir, **_kwargs(engine_dir, "adaptive", None, "break_invariants@3"))
    loop = EngineLoop(llm)
    try:
        results = _serve(loop, prompts[:-1])
        assert all(isinstance(r, EngineDeadError) for r in results.values()), results
        assert any("could not recover" in str(r) for r in results.values())
        assert not loop.alive and loop.stats()["engine_alive"] == 0.0
        with pytest.raises(EngineDeadError):
            loop.submit(prompts[-1], PARAMS)
    finally:
        loop.close()


def test_close_ends_every_stream_including_queued_ones(engine_dir, prompts):
    llm = LLM(engine_dir, kv_policy="adaptive", page_rows=8, max_batch_size=1)
    loop = EngineLoop(llm)
    streams = [loop.submit(p, SamplingParams(max_tokens=60, ignore_eos=True)) for p in prompts]
    results: dict = {}
    threads = [threading.Thread(target=_consume, args=(s, results, i)) for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    loop.close()
    for t in threads:
        t.join(BOUND_S)
    assert not any(t.is_alive() for t in threads)
    assert len(results) == len(prompts)
    with pytest.raises(EngineDeadError, match="shut down"):
        loop.submit(prompts[0], PARAMS)
    _assert_idle(llm)


def test_a_dead_engine_thread_is_noticed_by_submit(engine_dir, prompts):
    llm = LLM(engine_dir, kv_policy="dense")
    loop = EngineLoop(llm)

    def broken_step():
        raise SystemError("the loop thread itself failed")

    llm.engine.step = broken_step  # an error outside any request's work: the loop's own last line of defence
    stream = loop.submit(prompts[0], PARAMS)
    with pytest.raises(EngineDeadError, match="the loop thread itself failed"):
        list(stream)
    with pytest.raises(EngineDeadError):
        loop.submit(prompts[1], PARAMS)
    loop.close()


@pytest.mark.parametrize("spec", ["decode@1", "nowhere@1", "decode_forward", "decode_forward@0", "decode_forward@x"])
def test_fault_injection_spec_is_validated(spec):
    with pytest.raises(ConfigError, match="fault_injection"):
        FaultInjector(spec)


def test_offline_generate_reports_the_failed_request(engine_dir, prompts, reference):
    llm = LLM(engine_dir, kv_policy="adaptive", page_rows=8, prefill_chunk_tokens=16,
              fault_injection="prefill_chunk@4")  # the second prompt's first chunk (the first has 3)
    with pytest.raises(RequestFailedError, match="1 of 3 requests failed") as failure:
        llm.generate(prompts[:3], PARAMS)
    outs = failure.value.outputs
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "injected fault at prefill_chunk" in outs[1].error
    assert outs[0].token_ids == reference[0] and outs[2].token_ids == reference[2]

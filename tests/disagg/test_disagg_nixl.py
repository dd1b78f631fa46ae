"""Disaggregated prefill/decode over real NIXL transfers (UCX, host memory) between two processes on loopback.

A context worker process prefills and publishes each prompt's history; this process runs the decode engine,
which READs the history into its host store (or a staging buffer for policies without one) and decodes.
Greedy tokens must equal the co-located engine's for every policy, with and without speculation, under a pool
so tight that imports wait for memory; a killed prefill process ends its request with an error and leaks nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from context_regions import wait_regions_released
from tiny_models import build_spec_engine, random_prompts

from dhisparse import LLM, SamplingParams

nixl = pytest.importorskip("nixl._api", reason="NIXL (nixl==1.5.1) is not installed")

from dhisparse.disagg.decode import DecodeEngine, load_decode_engine  # noqa: E402
from dhisparse.disagg.nixl_transfer import NixlImporter  # noqa: E402
from dhisparse.disagg.worker import ContextWorker  # noqa: E402

LENGTHS = [9, 41, 70]
NEW_TOKENS = 12
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    return build_spec_engine(tmp_path_factory.mktemp("disagg"), tiny_checkpoint("glm_fsfs_sparse"), "float32")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, 96, seed=5)


@pytest.fixture(scope="module")
def colocated(engine_dir, prompts) -> list[list[int]]:
    return [o.token_ids for o in LLM(engine_dir, kv_policy="dense").generate(prompts, PARAMS)]


@pytest.fixture(scope="module")
def importer():
    imp = NixlImporter("decode-test", timeout_s=5.0)
    yield imp
    imp.close()


@pytest.fixture(scope="module")
def worker(engine_dir):
    """One context process hosting the engine without a drafter ("") and with each drafter ("dflash2", "dspark")."""
    variants = {kind: {"speculative": kind, "num_draft_tokens": 4} for kind in ("dflash2", "dspark")}
    started = ContextWorker(engine_dir, agent_name="context-test", variants=variants)
    yield started
    started.close()


def _tight_pool(engine_dir: Path, **kwargs) -> int:
    probe = LLM(engine_dir, **kwargs, pool_bytes=1 << 24)
    need = probe.engine.kv.required_bytes(max(LENGTHS), NEW_TOKENS)
    return need + 2 * probe.engine.model.cfg.row_dim * 4 * 4 * probe.config.page_rows


def _run(engine: DecodeEngine, ids: list[str]) -> dict[str, list[int]]:
    while any(engine.requests[i].finish_reason is None for i in ids):
        engine.step()
        if hasattr(engine.kv, "check_invariants"):  # the dense reference store has none
            engine.kv.check_invariants()
    return {i: list(engine.requests[i].output_token_ids) for i in ids}


@pytest.mark.parametrize("speculative", [None, "dflash2", "dspark"])
def test_disaggregated_greedy_equals_colocated(engine_dir, prompts, colocated, importer, worker, speculative
                                               ) -> None:
    spec = {"speculative": speculative, "num_draft_tokens": 4} if speculative else {}
    for policy in ("dense", "resident", "hisparse", "adaptive"):
        kwargs = dict(kv_policy=policy, page_rows=8, max_batch_size=4, **spec)
        tight = policy != "dense"
        if tight:
            kwargs["pool_bytes"] = _tight_pool(engine_dir, **kwargs)
        engine = load_decode_engine(engine_dir, importer, **kwargs)
        ids = []
        for n, prompt in enumerate(prompts):  # every context phase first: the prefill side holds the rows
            rid = f"{policy}-{n}"
            context = worker.prefill(prompt, PARAMS, rid, speculative or "")
            ids.append(engine.add_imported_request(prompt, PARAMS, context, rid))
        got = _run(engine, ids)
        assert [got[i] for i in ids] == colocated, f"{policy} / {speculative}: tokens differ from co-located"
        stats = engine.stats()
        assert stats["transfers"] == len(prompts) and stats.get("transfers_failed", 0) == 0
        if tight:
            engine.kv.poll()
            assert stats["kv_admissions_waited"] >= 1, "the tight pool should make imports wait"
            after = engine.stats()
            assert after["kv_required_bytes"] == 0 and after["kv_optional_bytes"] == after["kv_prefix_device_bytes"]
            assert after["kv_host_pages_used"] == after["kv_prefix_host_pages"]  # only the prefix cache's pages
            engine.kv.check_invariants()
        if policy == "adaptive":
            assert stats["kv_rows_direct"] > 0
        assert wait_regions_released(worker)["regions_held"] == 0


def test_killed_prefill_process_gives_an_error_and_leaks_nothing(engine_dir, prompts, colocated, importer, worker
                                                                  ) -> None:
    healthy = worker
    doomed = ContextWorker(engine_dir, agent_name="context-doomed")
    try:
        engine = load_decode_engine(engine_dir, importer, kv_policy="adaptive", page_rows=8, max_batch_size=4)
        lost = engine.add_imported_request(prompts[2], PARAMS, doomed.prefill(prompts[2], PARAMS, "lost"), "lost")
        kept = engine.add_imported_request(prompts[1], PARAMS, healthy.prefill(prompts[1], PARAMS, "kept"), "kept")
        doomed.kill()  # its registered region dies with it, before the decode side pulls
        updates = []
        while engine.has_unfinished():
            updates += engine.step()
            engine.kv.check_invariants()
        failed = [u for u in updates if u.request_id == lost]
        assert failed and failed[-1].finished and failed[-1].finish_reason == "error"
        assert "context-doomed" in engine.errors[lost]
        assert engine.requests[kept].output_token_ids == colocated[1]
        engine.kv.poll()
        stats = engine.stats()
        assert stats["transfers_failed"] == 1
        assert stats["kv_required_bytes"] == 0 and stats["kv_optional_bytes"] == stats["kv_prefix_device_bytes"]
        assert stats["kv_host_pages_used"] == stats["kv_prefix_host_pages"]  # only the prefix cache's pages stay
        assert wait_regions_released(healthy)["regions_held"] == 0
    finally:
        doomed.close()


@pytest.mark.parametrize("policy", ["hisparse", "adaptive"])
def test_generation_engine_pulls_only_pages_it_does_not_hold(engine_dir, importer, worker, policy) -> None:
    """Prefix reuse on the generation side: the second turn of a conversation hits the pages the first turn left
    in its prefix cache (its prompt and decoded pages), so its READ brings only the pages after them; the tokens
    are the co-located ones. (The context engine prefills the whole prompt: docs/prefix_reuse.md.)"""
    engine = load_decode_engine(engine_dir, importer, kv_policy=policy, page_rows=8, max_batch_size=4)
    first = random_prompts([29], 96, seed=21)[0]
    rid = engine.add_imported_request(first, PARAMS, worker.prefill(first, PARAMS, f"{policy}-t0", ""), f"{policy}-t0")
    second = first + _run(engine, [rid])[rid] + random_prompts([7], 96, seed=22)[0]
    rid = engine.add_imported_request(second, PARAMS, worker.prefill(second, PARAMS, f"{policy}-t1", ""),
                                      f"{policy}-t1")
    got = _run(engine, [rid])[rid]
    assert got == LLM(engine_dir, kv_policy="dense").generate([second], PARAMS)[0].token_ids
    counters = engine.requests[rid].counters
    cached = (len(first) + NEW_TOKENS - 1) // 8 * 8  # every complete page of the first turn's rows
    assert counters["kv_prefix_reused_tokens"] == cached
    layout = engine.kv.layout
    assert counters["disagg_transfer_bytes_cached"] == cached * layout.num_sources * layout.row_bytes
    engine.kv.check_invariants()

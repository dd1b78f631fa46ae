"""Disaggregation across shapes: a single-process context engine feeds a generation engine of 2 ranks (gloo, one
thread each), whose ranks READ the histories over NIXL (UCX, loopback) into their own host stores.

Under data-parallel attention each rank READs its own requests' rows and indexer keys; under tensor parallelism
every rank READs every request's (the same rows on every rank) and the ranks agree on when each READ ended. Greedy
and seeded-sampling tokens equal the co-located single-process engine's (float64) under a pool tight enough that
the hierarchy fetches rows from the host store; the context side frees every region
once all its readers' notifications arrived; every rank holding a request checks its params again (trust); a
context process that dies before the READ fails its request only (under TP on every rank in the same step).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from context_regions import wait_regions_released
from parallel_engines import tight_pool
from tiny_models import random_prompts

from dhisparse import LLM, SamplingParams

pytest.importorskip("nixl._api", reason="NIXL (nixl==1.5.1) is not installed")

from dhisparse.disagg.decode import load_decode_engine
from dhisparse.disagg.nixl_transfer import NixlImporter
from dhisparse.disagg.params import prompt_digest
from dhisparse.disagg.ranks import ParallelDecodeEngine
from dhisparse.disagg.worker import ContextWorker
from dhisparse.errors import InvalidRequestError

LENGTHS = [7, 23, 50, 31]
NEW_TOKENS = 10
GREEDY = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)] * len(LENGTHS)
SAMPLED = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.9, top_p=0.95, seed=100 + i)
           for i in range(len(LENGTHS))]
SHAPES = {"dp2": dict(data_parallel_size=2), "tp2": dict(tensor_parallel_size=2)}


@pytest.fixture(scope="module")
def engine_dir(tiny_engine):
    return tiny_engine("glm_fsfs_sparse", "float64")


@pytest.fixture(scope="module")
def worker(engine_dir):
    started = ContextWorker(engine_dir, agent_name="context-ranks")
    yield started
    started.close()


def _run(engine: ParallelDecodeEngine, worker: ContextWorker, prompts: list[list[int]],
         params: list[SamplingParams], tag: str) -> list[list[int]]:
    ids = []
    for n, (prompt, p) in enumerate(zip(prompts, params, strict=True)):  # every context phase first
        rid = f"{tag}-{n}"
        ids.append(engine.add_imported_request(prompt, p, worker.prefill(prompt, p, rid), rid))
    while any(engine.requests[i].finish_reason is None for i in ids):
        engine.step()
    assert all(engine.requests[i].finish_reason == "length" for i in ids), [engine.requests[i].error for i in ids]
    return [engine.requests.pop(i).output_token_ids for i in ids]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_generation_ranks_read_their_histories_and_give_the_colocated_tokens(engine_dir, worker, shape) -> None:
    overrides: dict = dict(kv_policy="adaptive", max_batch_size=4, page_rows=8)
    overrides["pool_bytes"] = tight_pool(engine_dir, max(LENGTHS), NEW_TOKENS, **overrides)
    prompts = random_prompts(LENGTHS, 96, seed=11)
    single = LLM(engine_dir, **overrides)
    expected_greedy = [o.token_ids for o in single.generate(prompts, GREEDY[0])]
    expected_sampled = [o.token_ids for o in single.generate(prompts, SAMPLED)]
    assert expected_greedy != expected_sampled
    before = worker.stats()
    engine = load_decode_engine(engine_dir, NixlImporter(f"generation-{shape}", timeout_s=10.0), **overrides,
                                **SHAPES[shape])
    assert isinstance(engine, ParallelDecodeEngine)
    try:
        assert _run(engine, worker, prompts, GREEDY, f"{shape}-greedy") == expected_greedy
        assert _run(engine, worker, prompts, SAMPLED, f"{shape}-sampled") == expected_sampled

        # Trust on every rank: the driver refuses params made for another prompt, and so does a rank handed them
        # past the driver (the request ends with the rank's error; nothing is read).
        other = random_prompts([23], 96, seed=99)[0]
        genuine = worker.prefill(prompts[1], GREEDY[0], f"{shape}-genuine")
        with pytest.raises(InvalidRequestError, match="another prompt"):
            engine.add_imported_request(other, GREEDY[0], genuine, f"{shape}-refused")
        forged = replace(genuine, prompt_sha256=prompt_digest(other))  # passes the driver's check for `other`…
        engine.engine.add_request(prompts[1], GREEDY[0], f"{shape}-forged", seed=genuine.seed, imported=forged)
        updates = []
        while engine.has_unfinished():
            updates += engine.step()
        refused = [u for u in updates if u.request_id == f"{shape}-forged"]
        assert refused and refused[-1].finish_reason == "error" and "another prompt" in (refused[-1].error or "")
        # A context process that dies before its history is READ: the request ends with an error naming it (under
        # TP on every rank at once, the same message: the ranks agreed), the engine goes on.
        doomed = ContextWorker(engine_dir, agent_name="context-doomed")
        try:
            lost = doomed.prefill(prompts[2], GREEDY[0], f"{shape}-lost")
            doomed.kill()
            rid = engine.add_imported_request(prompts[2], GREEDY[0], lost, f"{shape}-lost")
            while engine.requests[rid].finish_reason is None:
                engine.step()
            failed = engine.requests.pop(rid)
        finally:
            doomed.close()
        assert failed.finish_reason == "error" and "context-doomed" in (failed.error or ""), failed.error
        if shape == "tp2":
            assert "failed on tensor-parallel rank(s) 0, 1" in (failed.error or "")
        assert engine.dead is None
        # the genuine params still import (and their region is freed by the READs)
        rid = engine.add_imported_request(prompts[1], GREEDY[0], genuine, f"{shape}-genuine")
        while engine.requests[rid].finish_reason is None:
            engine.step()
        assert engine.requests.pop(rid).output_token_ids == expected_greedy[1]
        stats = engine.stats()
    finally:
        engine.close()
    released = wait_regions_released(worker)
    n = 2 * len(prompts) + 1
    assert stats["transfers"] == n  # DP: the ranks' sum; TP: rank 0's (every rank's are equal)
    if shape == "dp2":  # each rank READ its own requests' histories, and both served some
        assert stats["rank0_transfers"] + stats["rank1_transfers"] == n
        assert stats["rank0_transfers"] > 0 and stats["rank1_transfers"] > 0
    else:  # every rank READ every request's history; the ranks agreed on when each READ ended
        assert stats["rank0_transfers"] == stats["rank1_transfers"] == n
        assert stats["rank0_transfer_bytes"] == stats["rank1_transfer_bytes"] > 0
        assert stats["comm_bytes_disagg_all_gather"] > 0
    assert stats["transfers_failed"] == 1  # the dead context's (DP: on one rank; TP: rank 0's, as on every rank)
    assert stats["kv_rows_host"] > 0  # the tight pool made the hierarchy fetch rows from the host store
    # every region is freed by its readers' notifications (under TP: both ranks' READs), none by its deadline
    assert released["regions_released"] - before["regions_released"] == n
    assert released["regions_expired"] == before["regions_expired"]

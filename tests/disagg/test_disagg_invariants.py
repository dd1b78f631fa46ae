"""The decode side's invariants over random sequences of imports, cancellations, transfer failures and steps.

READs are asynchronous: admission posts them and later steps import them, so cancellations land on requests that
wait for admission, whose READ is in flight (they keep their memory until it ended), or that decode.

Both NIXL agents live in this process (real UCX transfers over loopback); a failed transfer is a READ whose
descriptors NIXL refuses (the params point past the exporter's registered region). After every operation the
KV manager's invariants hold; at the end every tier is empty and the exporter holds no region.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import random_prompts

from dhisparse import SamplingParams

pytest.importorskip("nixl._api", reason="NIXL (nixl==1.5.1) is not installed")

from dhisparse.disagg.decode import load_decode_engine
from dhisparse.disagg.nixl_transfer import NixlExporter, NixlImporter
from dhisparse.disagg.prefill import PrefillEngine, PrefillService

PROMPTS = random_prompts([5, 18, 33, 41], 96, seed=3)
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def sides(tiny_engine):
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    service = PrefillService(PrefillEngine(engine_dir), NixlExporter("prop-context", hold_timeout_s=60.0))
    importer = NixlImporter("prop-decode", timeout_s=5.0)
    probe = load_decode_engine(engine_dir, importer, kv_policy="adaptive", page_rows=4, pool_bytes=1 << 24)
    need = probe.kv.required_bytes(max(len(p) for p in PROMPTS), PARAMS.max_tokens)
    yield engine_dir, service, importer, need
    importer.close()
    service.close()


def _check_transfers(engine) -> None:
    """A request whose READ is in flight holds its admission and a batch slot, and is neither waiting nor running."""
    scheduler = engine.engine.scheduler
    for request_id, (req, _, _, _) in engine.transferring.items():
        assert req.kv_admitted and req not in scheduler.waiting and req not in scheduler.running, request_id
    assert len(scheduler.running) + len(engine.transferring) <= engine.engine.cfg.max_batch_size


OPS = st.lists(st.tuples(st.sampled_from(["import", "import", "fail", "cancel", "step", "step"]),
                         st.integers(0, len(PROMPTS) - 1)), min_size=3, max_size=10)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_invariants_hold_over_imports_cancellations_and_failures(sides, ops) -> None:
    engine_dir, service, importer, need = sides
    engine = load_decode_engine(engine_dir, importer, kv_policy="adaptive", page_rows=4, max_batch_size=4,
                                pool_bytes=2 * need + need // 3, refill_pages_per_step=2)
    failing: set[str] = set()
    for n, (op, k) in enumerate(ops):
        if op in ("import", "fail"):
            rid = f"r{n}"
            context = service.run(PROMPTS[k], PARAMS, rid)
            if op == "fail":  # descriptors outside the registered region: NIXL refuses the READ (the decode side
                # then tells the context to free the region: the exporter must hold nothing at the end)
                context = dataclasses.replace(context, region_addr=context.region_addr + (1 << 40))
                failing.add(rid)
            engine.add_imported_request(PROMPTS[k], PARAMS, context, rid)
        elif op == "cancel":
            live = [r for r, req in engine.requests.items() if req.finish_reason is None]
            if live:
                engine.abort_request(live[k % len(live)])
        else:
            engine.step()
        engine.kv.check_invariants()
        _check_transfers(engine)
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_invariants()
        _check_transfers(engine)
    assert not engine.transferring
    for rid in failing:
        if engine.requests[rid].finish_reason != "abort":
            assert engine.requests[rid].finish_reason == "error" and rid in engine.errors
    engine.kv.poll()
    stats = engine.stats()
    assert stats["kv_required_bytes"] == 0 and stats["kv_optional_bytes"] == 0 and stats["kv_host_pages_used"] == 0
    engine.kv.check_invariants()
    for _ in range(2000):  # notifications of completed READs (and of cancelled waits) release the regions
        service.poll()
        if not service.exporter.held_keys:
            break
        time.sleep(0.005)
    assert service.exporter.held_keys == []


class HeldImporter(NixlImporter):
    """A real importer whose finished READs are reported in flight while ``held`` (a slow link, made
    deterministic): the bytes move over NIXL as usual, the engine just sees them arrive when the test says."""

    held = False

    def check(self, pending) -> bool:
        return super().check(pending) and not self.held


def test_decode_proceeds_while_a_read_is_in_flight_and_a_cancelled_read_keeps_its_memory(sides) -> None:
    engine_dir, service, _, need = sides
    importer = HeldImporter("held-decode", timeout_s=30.0)
    try:
        engine = load_decode_engine(engine_dir, importer, kv_policy="adaptive", page_rows=4, max_batch_size=4,
                                    pool_bytes=3 * need)
        long = SamplingParams(max_tokens=40, ignore_eos=True)
        engine.add_imported_request(PROMPTS[0], long, service.run(PROMPTS[0], long, "a"), "a")
        while "a" in engine.transferring or engine.requests["a"].status.name == "WAITING":
            engine.step()
        for rid in ("b", "c"):
            engine.add_imported_request(PROMPTS[1], PARAMS, service.run(PROMPTS[1], PARAMS, rid), rid)
        importer.held = True
        for _ in range(3):  # both READs in flight: "a" keeps decoding meanwhile
            before = len(engine.requests["a"].output_token_ids)
            engine.step()
            engine.kv.check_invariants()
            assert set(engine.transferring) == {"b", "c"} and len(engine.requests["a"].output_token_ids) > before
        running = engine.stats()["kv_requests_running"]
        assert engine.abort_request("b")  # cancelled mid-READ: its pages stay reserved until the READ ended
        engine.step()
        assert "b" in engine.transferring and engine.stats()["kv_requests_running"] == running
        importer.held = False
        engine.step()
        assert not engine.transferring and engine.requests["b"].finish_reason == "abort"
        assert engine.requests["c"].status.name == "RUNNING"
        while engine.has_unfinished():
            engine.step()
            engine.kv.check_invariants()
        assert engine.requests["c"].finish_reason == "length" and engine.requests["a"].finish_reason == "length"
        engine.kv.poll()
        stats = engine.stats()
        assert stats["kv_required_bytes"] == 0 and stats["kv_host_pages_used"] == 0
    finally:
        importer.close()
    for _ in range(2000):  # the READs' notifications released every region
        service.poll()
        if not service.exporter.held_keys:
            break
        time.sleep(0.005)
    assert service.exporter.held_keys == []

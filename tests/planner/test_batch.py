"""The reproduction's speed-ups change no result: runs done ahead in worker processes equal runs simulated in place,
the simulation core's ``locations`` path equals the former ``gather`` path, and the host store's per-chunk gather
equals a dense reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dhisparse.kv.host_store import ChunkedRows
from dhisparse_planner import batch, core
from dhisparse_planner.disaggregated import DisaggregationSpec
from dhisparse_planner.locality import LocalityModel
from dhisparse_planner.paper import BASE, SPEC
from dhisparse_planner.report import parse_config
from dhisparse_planner.scale import ScaleSpec
from dhisparse_planner.simulator import AHEAD, Simulator, simulate
from dhisparse_planner.specs import GLM5_INDEXSHARE_NVFP4 as GLM
from dhisparse_planner.specs import H200
from dhisparse_planner.workload import WorkloadSpec

LOC = LocalityModel(overlap=0.7, recent_fraction=0.3)


def _job(label: str, disaggregation: DisaggregationSpec | None = None) -> batch.Job:
    serving = dataclasses.replace(parse_config(label, BASE, SPEC), locality=LOC)
    work = WorkloadSpec(8192, 512, concurrency=4, num_requests=6, seed=3)
    return batch.Job(H200, GLM, serving, work, ScaleSpec(64), disaggregation=disaggregation)


def _same(a, b) -> None:  # type: ignore[no-untyped-def]
    assert a.summary() == b.summary()
    assert [(p.time_s, p.batch, p.host_share) for p in a.timeline] == [(p.time_s, p.batch, p.host_share)
                                                                          for p in b.timeline]
    assert a.counters == b.counters


def test_runs_done_ahead_equal_runs_in_place() -> None:
    jobs = [_job("hisparse"), _job("adaptive+dflash2"), _job("adaptive", DisaggregationSpec())]
    batch.clear()
    try:
        batch.run_ahead(jobs + jobs[:1], workers=2)  # a repeated job is simulated once
        assert len(AHEAD) == 3
        ahead = [batch.run_job(j) for j in jobs]
        j = jobs[0]
        assert simulate(j.hw, j.model, j.serving, j.workload, j.scale) is ahead[0]  # served, not simulated again
    finally:
        batch.clear()
    for job, done in zip(jobs, ahead, strict=True):
        _same(done, job.run())
    assert ahead[2].summary()["mean_transfer_s"] > 0  # the disaggregated run is one


def test_locations_path_equals_former_gather_path(monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job("adaptive+dflash2")
    now = job.run()
    original = core.EngineCore.decode
    gathered: list[int] = []

    def decode_with_gather(self, out, query_lens, accept):  # type: ignore[no-untyped-def]
        real_begin = self.kv.begin_step

        def begin(ids, q):  # type: ignore[no-untyped-def]
            step = real_begin(ids, q)

            def via_gather(layer, positions):  # type: ignore[no-untyped-def]
                del step.locations  # gather's own call resolves with the class's method
                gathered.append(layer)
                try:
                    return step.gather(layer, positions)  # the former path: every layer's rows read back
                finally:
                    step.locations = via_gather

            step.locations = via_gather
            return step

        self.kv.begin_step = begin
        try:
            original(self, out, query_lens, accept)
        finally:
            del self.kv.begin_step

    monkeypatch.setattr(core.EngineCore, "decode", decode_with_gather)
    before = Simulator(job.hw, job.model, job.serving, job.workload, job.scale).run()
    assert gathered
    _same(before, now)


def test_chunked_host_rows_gather_and_scatter_match_a_dense_copy() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = ChunkedRows(capacity_rows=50, chunk_rows=8, row_dim=3, dtype=torch.float32, pinned=False)
    rows.ensure(45)
    assert len(rows.chunks) == 6
    dense = torch.rand(45, 3, generator=gen)
    rows.index_copy_(0, torch.arange(45), dense)
    index = torch.randint(0, 45, (200,), generator=gen)
    assert torch.equal(rows.index_select(0, index), dense[index])
    new = torch.rand(20, 3, generator=gen)
    at = torch.randperm(45, generator=gen)[:20]
    rows.index_copy_(0, at, new)
    dense[at] = new
    assert torch.equal(rows.index_select(0, torch.arange(45)), dense)
    # positions beyond the allocated rows read as zeros, as with the fixed-shape pass over every chunk
    assert torch.equal(rows.index_select(0, torch.tensor([48, 3])), torch.stack([torch.zeros(3), dense[3]]))

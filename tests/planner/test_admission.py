"""SGLang HiSparse's token-budget admission for the HiSparse baseline (issue 28, point 5)."""

from __future__ import annotations

import dataclasses

import pytest

from dhisparse_planner import paper
from dhisparse_planner.admission import TokenBudget
from dhisparse_planner.report import parse_config
from dhisparse_planner.scale import ScaleSpec, check_simulated_host
from dhisparse_planner.simulator import Simulator
from dhisparse_planner.specs import GLM5_INDEXSHARE_NVFP4, H200
from dhisparse_planner.workload import WorkloadSpec


def test_the_rule_counts_lengths_clipped_reservations_and_the_new_request() -> None:
    rule = TokenBudget(host_to_device_ratio=2, new_token_ratio=0.5, clip_max_new_tokens=100)
    running = [(1000, 10, 500), (2000, 400, 500)]  # used 3410; reserve min(490, 100) + min(100, 100) = 200 x 0.5
    need = 3410 + 100 + 800 + 100  # the new request: prompt 800 + min(500, 100)
    assert rule.admits(running, 800, 500, need)
    assert not rule.admits(running, 800, 500, need - 1)
    m = GLM5_INDEXSHARE_NVFP4
    per_token = m.num_layers * m.row_bytes + 2 * m.num_indexers * m.index_key_bytes
    assert rule.device_tokens(m, 1e9) == pytest.approx(1e9 / per_token)
    assert rule.logical_tokens(m, 1e9) == pytest.approx(2e9 / per_token)
    host = 1e9  # rows of every layer per token on host: the smaller budget wins
    assert rule.logical_tokens(m, 1e9, host) == pytest.approx(host / (m.num_layers * m.row_bytes))
    with pytest.raises(ValueError, match="host_to_device_ratio"):
        TokenBudget(host_to_device_ratio=0.5)


def test_the_hisparse_baseline_runs_no_more_than_its_budget_allows() -> None:
    """At 100K the reference ratio's logical pool holds ~85 sessions: a C128 hisparse run never runs more, while
    the same run under the engine's own rule (memory) admits all 128; adaptive is not subject to it."""
    work = WorkloadSpec(102400, 256, concurrency=128, num_requests=128)
    scale = ScaleSpec(token_scale=64)
    sgl = parse_config("hisparse", paper.BASE, paper.SPEC, paper.ADMISSION)
    own = dataclasses.replace(sgl, admission=None)
    assert parse_config("adaptive", paper.BASE, paper.SPEC, paper.ADMISSION).admission is None
    m = GLM5_INDEXSHARE_NVFP4
    # room for twice the run's histories: the host store does not bind here
    roomy = dataclasses.replace(H200, host_bytes_per_gpu=2 * 128 * m.num_layers * m.row_bytes * (102400 + 256 + 64))
    capped = Simulator(roomy, GLM5_INDEXSHARE_NVFP4, sgl, work, scale)
    cap = capped.logical_tokens / (102400 + 4096 * 0.098)
    a = capped.run()
    b = Simulator(roomy, GLM5_INDEXSHARE_NVFP4, own, work, scale).run()
    assert b.max_batch == 128
    assert 60 <= a.max_batch <= cap < 128
    assert a.summary()["admissions_waited"] > 0


def test_host_capacity_is_the_simulated_machines_and_binds_when_histories_outgrow_it() -> None:
    """The host store holds the simulated rank's host memory (never the planner machine's); with room for 10
    32K+256 histories a C16 hisparse run waits for host pages and never runs more than 10 at once (issue 28,
    point 8)."""
    m = GLM5_INDEXSHARE_NVFP4
    per_request = m.num_layers * m.row_bytes * (32768 + 256)  # rows of every layer, whole pages
    hw = dataclasses.replace(H200, host_bytes_per_gpu=10.5 * per_request)
    serving = dataclasses.replace(paper.BASE, policy="hisparse")
    work = WorkloadSpec(32768, 256, concurrency=16, num_requests=16)
    sim = Simulator(hw, m, serving, work, ScaleSpec(token_scale=64))
    assert sim.kvs.config.host_bytes * sim.kvs.byte_factor == pytest.approx(hw.host_bytes_per_gpu, rel=1e-6)
    res = sim.run()
    assert res.max_batch == 10
    s = res.summary()
    assert s["waited_for_host"] > 0 and s["waited_for_device"] == 0 and s["requests_done"] == 16
    roomy = Simulator(H200, m, serving, work, ScaleSpec(token_scale=64)).run()
    assert roomy.max_batch == 16 and roomy.summary()["waited_for_host"] == 0


def test_a_simulated_host_store_this_process_cannot_hold_is_refused_by_the_planners_fields() -> None:
    """The simulated store is never shrunk to the planner machine's memory: a run that would need more than this
    process may hold is refused before the runtime's own check, naming host_bytes_per_gpu and token_scale."""
    m = GLM5_INDEXSHARE_NVFP4
    work = WorkloadSpec(32768, 256, concurrency=2, num_requests=2)
    sim = Simulator(H200, m, paper.BASE, work, ScaleSpec(token_scale=64))
    check_simulated_host(sim.kvs, limit=sim.kvs.config.host_bytes)  # exactly what it may hold: accepted
    with pytest.raises(ValueError, match="host_bytes_per_gpu.*token_scale"):
        check_simulated_host(sim.kvs, limit=sim.kvs.config.host_bytes - 1)
    huge = dataclasses.replace(H200, host_bytes_per_gpu=1e18)
    with pytest.raises(ValueError, match="simulated host store"):
        Simulator(huge, m, paper.BASE, work, ScaleSpec(token_scale=64))

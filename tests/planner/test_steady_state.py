"""The closed loop's steady state (issue 28, point 6): several requests per client, metrics over the window from
the first completion to the last issue, TTFT including the wait for admission."""

from __future__ import annotations

import dataclasses

import pytest

from dhisparse_planner import paper
from dhisparse_planner.metrics import steady_window, tokens_at
from dhisparse_planner.report import parse_config, result_row
from dhisparse_planner.scale import ScaleSpec
from dhisparse_planner.simulator import simulate
from dhisparse_planner.specs import GLM5_INDEXSHARE_NVFP4, H200
from dhisparse_planner.workload import WorkloadSpec

SCALE = ScaleSpec(token_scale=64)


def test_one_wave_has_no_steady_window_and_reports_the_whole_run() -> None:
    serving = parse_config("adaptive", paper.BASE, paper.SPEC)
    res = simulate(H200, GLM5_INDEXSHARE_NVFP4, serving, WorkloadSpec(32768, 1024, concurrency=4, num_requests=4),
                   SCALE)
    s = res.summary()
    assert steady_window(res) is None
    assert s["steady_output_tok_per_s"] == s["output_tok_per_s"] and s["steady_mean_ttft_s"] == s["mean_ttft_s"]


def test_the_steady_window_counts_only_what_happens_inside_it() -> None:
    serving = parse_config("adaptive+dflash2", paper.BASE, paper.SPEC)
    res = simulate(H200, GLM5_INDEXSHARE_NVFP4, serving, WorkloadSpec(32768, 2048, concurrency=8, num_requests=24),
                   SCALE)
    start, end = steady_window(res)
    s = res.summary()
    assert end > start and s["steady_window_s"] == pytest.approx(end - start)
    assert s["steady_output_tok_per_s"] == pytest.approx((tokens_at(res, end) - tokens_at(res, start)) / (end - start))
    inside = [r for r in res.requests if start < r.arrival_s <= end]
    assert inside and s["steady_mean_ttft_s"] == pytest.approx(
        sum(r.first_token_s - r.arrival_s for r in inside) / len(inside))
    assert tokens_at(res, res.timeline[-1].time_s) == pytest.approx(res.output_tokens)
    row = result_row(res, "adaptive+dflash2", 8, 0.8, 8)
    assert row["output_tok_per_s_per_gpu"] == pytest.approx(s["steady_output_tok_per_s"] / 8)
    assert row["run_output_tok_per_s_per_gpu"] == pytest.approx(s["output_tok_per_s"] / 8)


def test_ttft_includes_the_wait_for_admission() -> None:
    """A pool that holds two sessions at once: the later waves' requests wait for admission, and their TTFT (issue
    to first token) includes that wait, well beyond one prefill."""
    m = GLM5_INDEXSHARE_NVFP4
    serving = dataclasses.replace(parse_config("hisparse", paper.BASE, paper.SPEC), admission=None)
    from dhisparse_planner.simulator import Simulator

    probe = Simulator(H200, m, serving, WorkloadSpec(32768, 1024, concurrency=1, num_requests=1), SCALE)
    need = probe.core.kv.required_bytes(probe.kvs.sim_tokens(32768), probe.kvs.sim_output_tokens(1024))
    small = m.with_(workspace_bytes=m.kv_pool_bytes(H200) + m.workspace_bytes - 2.5 * need * probe.kvs.byte_factor)
    res = simulate(H200, small, serving, WorkloadSpec(32768, 1024, concurrency=6, num_requests=12), SCALE)
    s = res.summary()
    assert res.max_batch == 2 and s["waited_for_device"] > 0
    prefill = min(r.first_token_s - r.admitted_s for r in res.requests)
    assert s["steady_mean_ttft_s"] > 3 * prefill


def test_identical_requests_do_not_stay_in_lockstep() -> None:
    """A real engine prefills a few prompts per real step and each request decodes from its own first token, so a
    closed loop of identical requests spreads out: in the steady state a request waits for about its own prefill,
    not for the whole wave's (the first wave, issued at once, does queue)."""
    from dhisparse_planner.timing import prefill_seconds

    serving = dataclasses.replace(parse_config("adaptive", paper.BASE, paper.SPEC),
                                  max_prefill_tokens_per_step=32768)
    res = simulate(H200, GLM5_INDEXSHARE_NVFP4, serving, WorkloadSpec(32768, 4096, concurrency=16, num_requests=48),
                   SCALE)
    s = res.summary()
    prefill = prefill_seconds(H200, GLM5_INDEXSHARE_NVFP4, 32768)
    first_wave = sorted(res.requests, key=lambda r: r.arrival_s)[:16]
    assert max(r.first_token_s - r.arrival_s for r in first_wave) > 10 * prefill
    assert s["steady_window_s"] > 0 and s["steady_mean_ttft_s"] < 3 * prefill

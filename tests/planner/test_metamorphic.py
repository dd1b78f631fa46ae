"""Metamorphic properties of the planner (issue 28): relations between runs that must hold whatever the constants'
exact values are."""

from __future__ import annotations

import dataclasses

import pytest

from dhisparse_planner import paper
from dhisparse_planner.locality import CALIBRATED
from dhisparse_planner.report import parse_config
from dhisparse_planner.retime import retime
from dhisparse_planner.scale import ScaleSpec
from dhisparse_planner.simulator import simulate
from dhisparse_planner.specs import GLM5_INDEXSHARE_NVFP4, H200
from dhisparse_planner.speculation import SpeculationModel
from dhisparse_planner.workload import WorkloadSpec

M = GLM5_INDEXSHARE_NVFP4
SCALE = ScaleSpec(token_scale=64)


def _serving(label: str, spec: SpeculationModel = paper.SPEC):
    return dataclasses.replace(parse_config(label, paper.BASE, spec, paper.ADMISSION), locality=CALIBRATED)


def test_more_host_link_bandwidth_never_lowers_adaptive_output() -> None:
    """A pool that holds only part of 24 sessions' prompts, so adaptive fetches from host; a faster link never
    slows it (re-timing is exact for closed loops: test_sensitivity_cli / test_simulator)."""
    small = M.with_(workspace_bytes=M.workspace_bytes + 40e9)
    res = simulate(H200, small, _serving("adaptive"), WorkloadSpec(32768, 1024, concurrency=24, num_requests=48),
                   SCALE)
    assert res.summary()["host_share"] > 0.01
    outputs = []
    for gbps in (5, 10, 25, 50, 100, 400):
        s = retime(res, dataclasses.replace(H200, host_link_bytes_per_s=gbps * 1e9), small).summary()
        outputs.append((s["output_tok_per_s"], s["steady_output_tok_per_s"]))
    for (a_run, a_steady), (b_run, b_steady) in zip(outputs, outputs[1:], strict=False):
        assert b_run >= a_run * (1 - 1e-12) and b_steady >= a_steady * (1 - 1e-9)
    assert outputs[-1][0] > outputs[0][0]


def test_one_accepted_token_per_step_makes_speculation_lose() -> None:
    """With every draft rejected a verification step emits one token, like a plain step, but pays for the draft
    pass, the longer verification and the draft ring: the speculative configuration must be slower."""
    work = WorkloadSpec(32768, 1024, concurrency=8, num_requests=16)
    never = paper.SPEC.replace(accept_len_short=1.0, accept_len_long=1.0)
    spec = simulate(H200, M, _serving("adaptive+dflash2", never), work, SCALE).summary()
    plain = simulate(H200, M, _serving("adaptive"), work, SCALE).summary()
    assert spec["output_tok_per_s"] < plain["output_tok_per_s"]
    assert spec["steady_output_tok_per_s"] < plain["steady_output_tok_per_s"]


def test_with_every_history_fitting_adaptive_is_within_5_percent_of_resident() -> None:
    """C8 at 32K fits the H200 pool fully resident: adaptive keeps every prompt page resident and fetches only the
    generated rows the hot cache lost."""
    work = WorkloadSpec(32768, 2048, concurrency=8, num_requests=16)
    ada = simulate(H200, M, _serving("adaptive"), work, SCALE).summary()
    res = simulate(H200, M, _serving("resident"), work, SCALE).summary()
    assert res["max_batch"] == 8 and ada["max_batch"] == 8
    assert ada["output_tok_per_s"] == pytest.approx(res["output_tok_per_s"], rel=0.05)
    assert ada["steady_output_tok_per_s"] == pytest.approx(res["steady_output_tok_per_s"], rel=0.05)


def test_hisparse_host_share_at_low_load_stays_between_10_and_20_percent() -> None:
    """The calibrated locality puts HiSparse's host-fetched share at low load near the paper's 14.2%: one request
    at 32K, whatever the output length and the scale."""
    for output, g in ((2048, 64), (8192, 64), (2048, 32)):
        s = simulate(H200, M, _serving("hisparse"), WorkloadSpec(32768, output, concurrency=1, num_requests=1),
                     ScaleSpec(token_scale=g)).summary()
        assert 0.10 <= s["host_share"] <= 0.20, (output, g, s["host_share"])

"""Planner disaggregated mode: TTFT is prefill queue + prefill + transfer, the decode GPU never prefills, and with
enough prefill GPUs the first token comes sooner than when every prefill stalls the decode GPU."""

from __future__ import annotations

import pytest

from dhisparse_planner import HARDWARE_PRESETS, MODEL_PRESETS, LocalityModel, ScaleSpec, ServingSpec, WorkloadSpec
from dhisparse_planner.disaggregated import DisaggregatedSimulator, DisaggregationSpec
from dhisparse_planner.simulator import simulate
from dhisparse_planner.timing import prefill_seconds

H200 = HARDWARE_PRESETS["h200"]
GLM = MODEL_PRESETS["glm5-indexshare-nvfp4"]


def test_ttft_is_queue_plus_prefill_plus_transfer_and_beats_colocated() -> None:
    serving = ServingSpec(policy="adaptive", locality=LocalityModel(overlap=0.7))
    workload = WorkloadSpec(input_tokens=8192, output_tokens=512, concurrency=6, seed=0)
    link = DisaggregationSpec(prefill_gpus=2, link_bytes_per_s=25e9, link_latency_s=1e-4)
    sim = DisaggregatedSimulator(H200, GLM, serving, workload, ScaleSpec(64), disaggregation=link)
    result = sim.run()
    prefill_s = prefill_seconds(H200, GLM, 8192)
    transfer_s = 1e-4 + 8192 * GLM.resident_bytes_per_token() / 25e9
    for req in result.requests:
        queue_s, pre, xfer = req.ttft_split
        assert pre == pytest.approx(prefill_s) and xfer == pytest.approx(transfer_s) and queue_s >= 0
        assert req.first_token_s - req.arrival_s == pytest.approx(queue_s + pre + xfer)
        assert req.admitted_s >= req.first_token_s  # decode admits only once the history has arrived
    assert max(r.ttft_split[0] for r in result.requests) > 0  # 6 clients on 2 prefill GPUs queue
    colocated = simulate(H200, GLM, serving, workload, ScaleSpec(64)).summary()
    summary = result.summary()
    assert summary["requests_done"] == colocated["requests_done"] == float(len(result.requests))
    assert summary["mean_ttft_s"] < colocated["mean_ttft_s"]
    assert summary["mean_transfer_s"] == pytest.approx(transfer_s)
    waits = [r.admitted_s - r.first_token_s for r in result.requests]
    assert summary["mean_decode_admission_wait_s"] == pytest.approx(sum(waits) / len(waits))


def test_bad_disaggregation_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="prefill_gpus"):
        DisaggregationSpec(prefill_gpus=0)
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        DisaggregationSpec(link_bytes_per_s=0)

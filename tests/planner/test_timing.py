"""The DSA time model's reads (issue 28, point 3): the indexer loads each key once per request and step, however
many verification queries score it; attention rows are read per query (each its own selection)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dhisparse_planner import paper
from dhisparse_planner.simulator import Simulator
from dhisparse_planner.specs import GLM5_INDEXSHARE_NVFP4, H200
from dhisparse_planner.timing import StepLoad, decode_step_seconds
from dhisparse_planner.workload import WorkloadSpec


def test_verification_queries_do_not_read_the_indexer_keys_again() -> None:
    m = GLM5_INDEXSHARE_NVFP4
    one = StepLoad(batch=4, query_tokens=4, attention_rows=4 * 2048.0 * m.num_layers,
                   index_keys_scanned=4 * 32768.0 * m.num_indexers, index_keys_read=4 * 32768.0 * m.num_indexers,
                   host_bytes=0.0)
    five = dataclasses.replace(one, query_tokens=20, index_keys_scanned=5 * one.index_keys_scanned)
    a, b = decode_step_seconds(H200, m, one), decode_step_seconds(H200, m, five)
    weights = (b["hbm"] - a["hbm"]) * H200.hbm_bytes_per_s  # only the experts 20 tokens touch beyond 4 tokens'
    assert weights > 0 and b["flops_s"] > a["flops_s"]
    more_rows = dataclasses.replace(five, attention_rows=5 * one.attention_rows)
    c = decode_step_seconds(H200, m, more_rows)
    assert (c["hbm"] - b["hbm"]) * H200.hbm_bytes_per_s == pytest.approx(4 * one.attention_rows * m.row_bytes)


def test_the_simulators_step_load_reads_keys_once_per_request() -> None:
    sim = Simulator(H200, GLM5_INDEXSHARE_NVFP4, dataclasses.replace(paper.BASE, speculation=paper.SPEC),
                    WorkloadSpec(32768, 64, concurrency=2, num_requests=2), paper.SCALE)
    ctx = torch.tensor([32768, 40000])
    q = torch.tensor([5, 3])
    load = sim._decode_load([], q, ctx, 0.0, 0.0)
    n = GLM5_INDEXSHARE_NVFP4.num_indexers
    assert load.index_keys_read == (32768 + 40000) * n
    assert load.index_keys_scanned == (5 * 32768 + 3 * 40000) * n

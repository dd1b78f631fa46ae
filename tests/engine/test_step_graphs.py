"""CUDA-graph capture machinery (``dhisparse.engine.step_graphs``): buckets, fixed buffers, the capturability audit
(on CPU), and on a GPU capture + replay exact against eager with no allocation during replay."""

from __future__ import annotations

import pytest
import torch

from dhisparse.engine.step_graphs import BufferSpec, GraphBuckets, StepGraphs, audit_step

INPUTS = {"positions": BufferSpec((6,), torch.int64, pad=-1), "q": BufferSpec((4,), torch.float32)}


def fixed_shape_step(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A step in the style of the decode path: masks instead of compaction, gathers with clamped indices."""
    table = torch.arange(40, dtype=torch.float32).view(10, 4)
    valid = b["positions"] >= 0
    rows = table[b["positions"].clamp(min=0) % 10]  # [R, 6, 4]
    scores = torch.einsum("rd,rkd->rk", b["q"], rows).masked_fill(~valid, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=1), nan=0.0)
    return {"out": torch.einsum("rk,rkd->rd", probs, rows), "count": valid.sum(1)}


def inputs(batch: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 30, (batch, 6), generator=g)
    pos[torch.rand(batch, 6, generator=g) < 0.3] = -1
    return {"positions": pos, "q": torch.randn(batch, 4, generator=g)}


def test_buckets_choose_the_smallest_that_holds_the_batch() -> None:
    b = GraphBuckets((1, 2, 4, 8))
    assert [b.bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    with pytest.raises(ValueError, match="ascending"):
        GraphBuckets((4, 2))
    with pytest.raises(ValueError, match="batch must be"):
        b.bucket_for(0)


def test_eager_runs_over_fixed_buffers_equal_the_step_and_reuse_them() -> None:
    graphs = StepGraphs(fixed_shape_step, INPUTS, torch.device("cpu"), GraphBuckets((2, 4, 8)))
    addresses = None
    for batch, seed in ((3, 1), (4, 2), (2, 3), (3, 4)):
        x = inputs(batch, seed)
        got = graphs.run(batch, x)
        want = fixed_shape_step(x)
        assert torch.allclose(got["out"], want["out"]) and torch.equal(got["count"], want["count"])
        buffers = graphs.buffers(4).tensors
        if batch in (3, 4):
            now = {k: v.data_ptr() for k, v in buffers.items()}
            assert addresses is None or now == addresses  # one set of buffers per bucket, never reallocated
            addresses = now
    assert bool((graphs.buffers(4).tensors["positions"][3:] == -1).all())  # padding rows hold the pad value
    with pytest.raises(ValueError, match="does not fit"):
        graphs.run(2, {"positions": torch.zeros(2, 5, dtype=torch.int64), "q": torch.zeros(2, 4)})
    big = inputs(9, 5)  # above the largest bucket: eager over the live inputs
    assert torch.allclose(graphs.run(9, big)["out"], fixed_shape_step(big)["out"])


def test_the_audit_passes_a_fixed_shape_step_and_names_what_breaks_a_capture() -> None:
    variants = [StepGraphs(fixed_shape_step, INPUTS, torch.device("cpu")).buffers(4).tensors]
    other = {k: v.clone() for k, v in variants[0].items()}
    other["positions"][:, :3] = 5
    assert audit_step(fixed_shape_step, [variants[0], other]) == []

    def compacting(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"kept": b["positions"][b["positions"] >= 0]}  # size depends on the data

    def reading(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        n = int(b["positions"].max())  # a host read
        return {"x": b["q"] * n}

    assert any("masked_select" in p or "nonzero" in p or "depends on the values" in p
               for p in audit_step(compacting, [variants[0], other]))
    assert any("_local_scalar_dense" in p or "item" in p for p in audit_step(reading, [variants[0], other]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA-graph capture")
def test_captured_replay_equals_eager_and_allocates_nothing() -> None:
    dev = torch.device("cuda")
    graphs = StepGraphs(_cuda_step, INPUTS, dev, GraphBuckets((4,)))
    for seed in range(3):
        x = {k: v.to(dev) for k, v in inputs(3, seed).items()}
        got = graphs.run(3, x)
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        got = graphs.run(3, x)
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before  # replay allocates nothing
        want = _cuda_step(x)  # rows are independent: the padded bucket's first rows are the batch's
        assert torch.allclose(got["out"], want["out"]) and torch.equal(got["count"], want["count"])
    assert graphs.replays == 6


def _cuda_step(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    table = torch.arange(40, dtype=torch.float32, device=b["q"].device).view(10, 4)
    valid = b["positions"] >= 0
    rows = table[b["positions"].clamp(min=0) % 10]
    scores = torch.einsum("rd,rkd->rk", b["q"], rows).masked_fill(~valid, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=1), nan=0.0)
    return {"out": torch.einsum("rk,rkd->rd", probs, rows), "count": valid.sum(1)}

"""The GLM-5-shaped layer-step bench (``dhisparse.kernels.layer_step``) at tiny shapes on the CPU: the step resolver's
block code, the torch row copy and attention. Every policy attends to the same rows (the host store is a copy of the
history), so their outputs agree; the host-fetched share orders hisparse > adaptive > resident = 0."""

from __future__ import annotations

import pytest
import torch

from dhisparse.kernels import native
from dhisparse.kernels.emulated import EmulatedKernels
from dhisparse.kernels.layer_step import (
    LayerShape,
    LayerStack,
    StackCase,
    history_rows_needed,
    random_rows,
    scratch_rows_needed,
)

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU library not built (the step resolver's "
                                "block code runs through it); run scripts/setup_native.sh")

CPU = torch.device("cpu")


def shared_state(shape: LayerShape, batch: int, history: int, queries: int, sources: int
                 ) -> tuple[torch.Tensor, int, torch.Tensor]:
    rows = history_rows_needed(shape, batch, history, sources)
    arena = torch.cat([random_rows(rows, shape, CPU, torch.Generator().manual_seed(3)),
                       torch.zeros(scratch_rows_needed(shape, batch, queries, sources), shape.row_width,
                                   dtype=shape.row_dtype)])
    return arena, rows, arena[:rows].clone()  # the host store: a copy of the history


@pytest.mark.parametrize("queries", [1, 3])
def test_policies_attend_to_the_same_rows_and_fetch_in_the_expected_order(queries: int) -> None:
    shape = LayerShape(heads=4, rank=32, rope=16, index_heads=4, index_dim=16, topk=16, page_rows=8, hot_rows=16)
    arena, rows, host = shared_state(shape, 3, 64, queries, 2)
    results, shares = {}, {}
    for policy in ("resident", "hisparse", "adaptive"):
        case = StackCase(policy, batch=3, history=64, queries=queries, sources=2, resident_share=0.5, drift=0.3,
                         spread=1.0)
        stack = LayerStack(shape, case, EmulatedKernels(), arena, rows, host, CPU)
        results[policy] = [stack.step() for _ in range(4)]
        assert int(stack.flags[0]) == 0
        shares[policy] = stack.host_share()
        if queries > 1 and policy == "hisparse":
            assert int(stack.staged.sum()) > 0  # the union overflows the hot cache into staging
    for policy in ("hisparse", "adaptive"):
        for got, want in zip(results[policy], results["resident"], strict=True):
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert shares["resident"] == 0.0 < shares["adaptive"] < shares["hisparse"]


def test_fp8_rows_at_glm5_row_shape() -> None:
    shape = LayerShape(heads=2, rank=512, rope=64, index_heads=2, index_dim=16, topk=8, page_rows=8, hot_rows=24,
                       fp8=True)
    arena, rows, host = shared_state(shape, 1, 32, 1, 1)
    outs = {}
    for policy in ("resident", "hisparse"):
        stack = LayerStack(shape, StackCase(policy, batch=1, history=32, sources=1), EmulatedKernels(), arena, rows,
                           host, CPU)
        outs[policy] = [stack.step()[0] for _ in range(2)]
    for a, b in zip(outs["hisparse"], outs["resident"], strict=True):
        assert bool(torch.isfinite(a.float()).all())
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_cases_refuse_what_they_cannot_run() -> None:
    shape = LayerShape(heads=2, rank=32, rope=16, index_heads=2, index_dim=8, topk=8, page_rows=8, hot_rows=16)
    arena, rows, host = shared_state(shape, 1, 32, 1, 1)
    with pytest.raises(ValueError, match="multiple of the page"):
        LayerStack(shape, StackCase("hisparse", batch=1, history=30, sources=1), EmulatedKernels(), arena, rows, host,
                   CPU)
    with pytest.raises(ValueError, match="smaller than this case"):
        LayerStack(shape, StackCase("hisparse", batch=2, history=32, sources=1), EmulatedKernels(), arena, rows, host,
                   CPU)
    with pytest.raises(ValueError, match="policy must be"):
        StackCase("dense", batch=1, history=32)

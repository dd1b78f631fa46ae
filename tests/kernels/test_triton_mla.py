"""The Triton sparse MLA decode kernel against the torch reference: on the CPU under ``TRITON_INTERPRET=1`` (set by
``tests/kernels/conftest.py`` on machines without a GPU), compiled on a GPU otherwise.

The kernel source is the one a GPU compiles (``dhisparse.kernels.triton_mla``; in interpreter mode only its
tensor-core operands are widened to float32, see the module docstring). Irregular shapes: odd batch, heads, rows,
rank and rope below a power of two, masked rows, a fully masked query, verification queries that share most rows,
splits with a combine step and without, 656-byte FP8 rows at their real size.
"""

from __future__ import annotations

import pytest
import torch

from dhisparse.kernels import triton_mla
from dhisparse.kernels.mla_union import union_of_queries
from dhisparse.kernels.reference import decode_fp8_rows, encode_fp8_rows, sparse_mla_reference
from dhisparse.kernels.self_check import compare_attention

DEVICE = "cpu" if triton_mla.interpreting() else "cuda"
pytestmark = pytest.mark.skipif(
    not triton_mla.available() or (DEVICE == "cuda" and not torch.cuda.is_available()),
    reason="Triton-lang not installed (pip install -e '.[kernels]'), or its kernels were compiled for a GPU "
           "(TRITON_INTERPRET unset when dhisparse.kernels.triton_mla was imported) and none is visible",
)


def run(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, loc: torch.Tensor, scale: float,
        **options: object) -> torch.Tensor:
    """The kernel on DEVICE (the CPU interpreter, or the GPU), its output back on the CPU."""
    return triton_mla.sparse_mla(q_lat.to(DEVICE), q_pe.to(DEVICE), kv.to(DEVICE), loc.to(DEVICE), scale,
                                 **options).cpu()  # type: ignore[arg-type]


def case(g: torch.Generator, batch: int, queries: int, heads: int, rank: int, rope: int, topk: int, rows: int,
         dtype: torch.dtype, shared: float = 0.8) -> tuple[torch.Tensor, ...]:
    q_lat = torch.randn(batch, queries, heads, rank, generator=g).to(dtype)
    q_pe = torch.randn(batch, queries, heads, rope, generator=g).to(dtype)
    kv = (torch.randn(rows, rank + rope, generator=g) * 0.5).to(dtype)
    selections = []
    for _ in range(batch):  # each query's rows are distinct (a top-k); later queries share most of the first's
        order = torch.randperm(rows, generator=g)
        first, fresh = order[:topk], order[topk:]
        per_query = [first]
        for _ in range(queries - 1):
            kept = first[torch.rand(topk, generator=g) < shared]
            other = torch.cat([kept, fresh[torch.randperm(fresh.numel(), generator=g)[: topk - kept.numel()]]])
            per_query.append(other[torch.randperm(topk, generator=g)])
        selections.append(torch.stack(per_query))
    loc = torch.stack(selections)
    loc[torch.rand(batch, queries, topk, generator=g) < 0.15] = -1
    return q_lat, q_pe, kv, loc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("queries,splits", [(1, 0), (1, 1), (3, 0), (3, 1)])
def test_matches_the_reference_on_irregular_shapes(dtype: torch.dtype, queries: int, splits: int) -> None:
    g = torch.Generator().manual_seed(queries * 10 + splits)
    q_lat, q_pe, kv, loc = case(g, batch=3, queries=queries, heads=5, rank=40, rope=12, topk=45, rows=300,
                                dtype=dtype)
    loc[1, -1] = -1  # a query with no row: zeros
    want = sparse_mla_reference(q_lat, q_pe, kv, loc, 0.13)
    config = triton_mla.MlaConfig(block_m=16, block_n=16, splits=splits, target_programs=12)
    got = run(q_lat, q_pe, kv, loc, 0.13, config=config)
    assert got.dtype == dtype and got.shape == want.shape
    assert compare_attention(got, want, 1e-4 if dtype == torch.float32 else 2e-2) is None
    assert bool((got[1, -1] == 0).all())


def test_many_heads_and_queries_span_several_m_tiles_and_splits() -> None:
    g = torch.Generator().manual_seed(5)
    q_lat, q_pe, kv, loc = case(g, batch=2, queries=2, heads=21, rank=32, rope=16, topk=70, rows=200,
                                dtype=torch.float32)
    want = sparse_mla_reference(q_lat, q_pe, kv, loc, 0.2)
    got = run(q_lat, q_pe, kv, loc, 0.2, config=triton_mla.MlaConfig(block_m=16, block_n=32, splits=3))
    assert compare_attention(got, want, 1e-4) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rows_at_their_real_size(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(9)
    values = torch.randn(150, 576, generator=g)
    kv = encode_fp8_rows(values)
    q_lat = torch.randn(2, 2, 3, 512, generator=g).to(dtype)
    q_pe = torch.randn(2, 2, 3, 64, generator=g).to(dtype)
    loc = torch.stack([torch.randperm(150, generator=g)[:37] for _ in range(4)]).view(2, 2, 37)  # distinct per query
    loc[torch.rand(2, 2, 37, generator=g) < 0.2] = -1
    want = sparse_mla_reference(q_lat, q_pe, decode_fp8_rows(kv), loc, 576**-0.5)
    got = run(q_lat, q_pe, kv, loc, 576**-0.5, fp8_rows=True,
              config=triton_mla.MlaConfig(block_m=16, block_n=16, target_programs=8))
    assert compare_attention(got, want, 1e-4 if dtype == torch.float32 else 2e-2) is None


def test_a_wrong_kernel_would_be_caught() -> None:
    """The comparison is tight enough to see one row dropped from one query's selection."""
    g = torch.Generator().manual_seed(2)
    q_lat, q_pe, kv, loc = case(g, batch=2, queries=2, heads=3, rank=32, rope=16, topk=20, rows=80,
                                dtype=torch.float32)
    want = sparse_mla_reference(q_lat, q_pe, kv, loc, 0.3)
    dropped = loc.clone()
    dropped[0, 1, torch.nonzero(dropped[0, 1] >= 0)[0, 0]] = -1
    got = run(q_lat, q_pe, kv, dropped, 0.3, config=triton_mla.MlaConfig(block_m=16, block_n=16))
    assert compare_attention(got, want, 1e-4) is not None


def test_union_of_queries_lists_each_row_once_with_its_queries() -> None:
    loc = torch.tensor([[[5, 2, -1, 9], [2, 7, 5, 5]], [[-1, -1, -1, -1], [3, -1, 3, 1]]])
    u = union_of_queries(loc)
    assert u.length.tolist() == [4, 2]
    assert u.locations[0, :4].tolist() == [2, 5, 7, 9] and bool((u.locations[0, 4:] == -1).all())
    assert u.member[0, :4].tolist() == [0b11, 0b11, 0b10, 0b01]
    assert u.locations[1, :2].tolist() == [1, 3] and u.member[1, :2].tolist() == [0b10, 0b10]
    single = union_of_queries(loc[:, :1])
    assert single.member is None and torch.equal(single.locations, loc[:, 0]) and single.length.tolist() == [4, 4]
    with pytest.raises(ValueError, match="B, Q, K"):
        union_of_queries(loc[0])

"""A GLM-5-shaped attention layer step over a synthetic KV hierarchy: the paper's per-layer experiment, measurable.

A *stack* is ``S`` attention layers (KV sources) sharing one indexer (a GLM index group: the first layer computes the
top-k, the others reuse it), at real shapes (64 heads, MLA rows of 512 + 64 values, indexer 32 x 128, top-k 2048,
pages of 64 rows, hot caches of 4096 rows), for ``B`` requests of ``L`` history rows each. Its state is made
directly rather than by a prefill (histories of 32K-100K rows for 128 requests cannot be prefilled in a GPU check):

- ``history`` (device) holds every row of every (request, source); the host store (pinned, mapped) holds a byte
  copy of it, so every policy reads the same values and their outputs agree;
- **resident**: every page of the history is mapped (the step is page-table lookups: the engine's direct path);
- **hisparse**: only the tail page is mapped; the rest comes through the hot caches and host fetches;
- **adaptive**: the tail page and a share of the history's pages (``resident_share``: the pool scaled to the layers
  run) are mapped; the rest as hisparse.

One step = indexer scores ``sum_h w_h relu(q_h . k)`` over the history and their top-k (queries drift a little from
step to step, as a decode's do), then for the group's sources one step-resolver launch (``resolve_step``) and one
row-copy launch per source, then sparse MLA per source over the resolved rows. With a drafter, ``Q = γ + 1``
verification queries select together (their union is resolved once; misses past the hot cache go to staging rows).
Projections and MoE are not part of it: they cost the same under every policy.

The kernels come from a kernel set with the interface of :class:`~dhisparse.kernels.cuda_kernels.CudaKernels`
(``resolve_step``, ``copy_rows``, ``sparse_mla``); CPU tests run tiny stacks with the torch reference and the step
resolver's block code run on the CPU. Nothing in a step reads the device on the host, so a step can be captured in a
CUDA graph (:mod:`dhisparse.engine.step_graphs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dhisparse.kernels.reference import FP8_ROW_BYTES

# How each KV policy lays out a request's history in this benchmark: ``(share of history pages mapped on the
# device, None: the case's resident_share; resolution by page-table lookups alone)``. The engine's policy objects
# live in ``kv/policies.py``, a layer above ``kernels``; a case names its policy and reads its layout here.
POLICY_LAYOUT: dict[str, tuple[float | None, bool]] = {
    "resident": (1.0, True), "hisparse": (0.0, False), "adaptive": (None, False)}
POLICIES = tuple(POLICY_LAYOUT)


@dataclass(frozen=True)
class LayerShape:
    """Attention shapes of one layer (defaults: GLM-5)."""

    heads: int = 64
    rank: int = 512
    rope: int = 64
    index_heads: int = 32
    index_dim: int = 128
    topk: int = 2048
    page_rows: int = 64
    hot_rows: int = 4096
    fp8: bool = False  # 656-byte FP8 rows (rank 512, rope 64) instead of bfloat16 rows

    @property
    def row_width(self) -> int:
        return FP8_ROW_BYTES if self.fp8 else self.rank + self.rope

    @property
    def row_dtype(self) -> torch.dtype:
        return torch.uint8 if self.fp8 else torch.bfloat16

    @property
    def row_bytes(self) -> int:
        return self.row_width * (1 if self.fp8 else 2)


@dataclass(frozen=True)
class StackCase:
    """One measured configuration: policy, batch ``B``, history rows ``L`` per request (a multiple of the page),
    verification queries ``Q`` (1: no drafter), sources ``S`` of the index group, the adaptive policy's resident share
    of history pages, the queries' drift per step and the spread of a request's verification queries around their
    mean (both relative to unit-variance indexer queries)."""

    policy: str
    batch: int
    history: int
    queries: int = 1
    sources: int = 2
    resident_share: float = 0.5
    drift: float = 0.05
    spread: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.batch < 1 or self.queries < 1 or self.sources < 1 or not 0.0 <= self.resident_share <= 1.0:
            raise ValueError(f"bad case {self}")

    @property
    def mapped_share(self) -> float:
        """The share of history pages the policy keeps mapped on the device (the tail page always is)."""
        share = POLICY_LAYOUT[self.policy][0]
        return self.resident_share if share is None else share

    @property
    def direct_only(self) -> bool:
        """Whether every history page is mapped, so resolution is page-table lookups (the engine's direct path)."""
        return POLICY_LAYOUT[self.policy][1]


def history_rows_needed(shape: LayerShape, batch: int, history: int, sources: int) -> int:
    """Rows of the history (and of the host store) for ``batch`` requests of ``history`` rows and ``sources``."""
    return batch * sources * history


def scratch_rows_needed(shape: LayerShape, batch: int, queries: int, sources: int) -> int:
    """Arena rows past the history a case needs: hot caches, and staging rows when ``queries > 1``."""
    staging = queries * shape.topk if queries > 1 else 0
    return batch * sources * (shape.hot_rows + staging)


def random_rows(rows: int, shape: LayerShape, device: torch.device, generator: torch.Generator | None = None
                ) -> torch.Tensor:
    """``rows`` valid KV rows: bfloat16 values, or FP8 rows with finite e4m3 bytes, scales 1/64 and bfloat16 rope."""
    if not shape.fp8:
        return (torch.randn(rows, shape.row_width, device=device, generator=generator) * 0.5).to(torch.bfloat16)
    out = torch.randint(0, 0x7F, (rows, FP8_ROW_BYTES), dtype=torch.uint8, device=device, generator=generator)
    out[:, :512] |= torch.randint(0, 2, (rows, 512), dtype=torch.uint8, device=device, generator=generator) << 7
    out[:, 512:528] = torch.full((rows, 4), 1 / 64, device=device).view(torch.uint8)
    rope = (torch.randn(rows, 64, device=device, generator=generator) * 0.5).to(torch.bfloat16)
    out[:, 528:] = rope.view(torch.uint8)
    return out


class LayerStack:
    """The state and step of one :class:`StackCase` (see the module docstring).

    ``arena`` ``[history_rows + scratch, row_width]`` on the device and ``host`` (its first ``history_rows`` rows
    again, in pinned host memory: a mapped view or a tensor the kernels' ``copy_rows`` accepts) are shared by every
    case of a run: arena row ``(b * S + s) * L + p`` (below ``history_rows``) is position ``p`` of request ``b``,
    source ``s``, and so is host row ``(b * S + s) * L + p``; the rows past ``history_rows`` are hot caches and
    staging."""

    def __init__(self, shape: LayerShape, case: StackCase, kernels: Any, arena: torch.Tensor, history_rows: int,
                 host: torch.Tensor, device: torch.device,
                 host_rows: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        b, s, length, p = case.batch, case.sources, case.history, shape.page_rows
        if length % p or length < shape.topk:
            raise ValueError(f"history {length} must be a multiple of the page ({p}) and at least top-k")
        if history_rows < history_rows_needed(shape, b, length, s) or \
                arena.shape[0] - history_rows < scratch_rows_needed(shape, b, case.queries, s):
            raise ValueError("the shared arena is smaller than this case needs")
        self.shape, self.case, self.kernels, self.device = shape, case, kernels, device
        # The host store: a tensor indexed by host row (``host_rows`` None), or a chunked store's mapped span with
        # ``host_rows`` translating global host rows to span rows (``MappedRows.span_rows``).
        self.arena, self.host, self.host_rows = arena, host, host_rows
        g = torch.Generator(device=device).manual_seed(case.seed)  # the data: equal under every policy
        layout = torch.Generator(device=device).manual_seed(case.seed + 1)  # which pages the policy keeps mapped
        pages = length // p
        self.pages = pages
        self.hot_base = history_rows
        staging = case.queries * shape.topk if case.queries > 1 else 0
        first_page = (torch.arange(b * s, device=device) * pages).view(b, s, 1)
        own_pages = first_page + torch.arange(pages, device=device)  # arena page = history page
        if case.direct_only:
            mapped = torch.ones(b, s, pages, dtype=torch.bool, device=device)
        else:
            mapped = torch.rand(b, s, pages, device=device, generator=layout) < case.mapped_share
            mapped[:, :, -1] = True  # the tail page
        self.page_table = torch.where(mapped, own_pages, -1)
        self.host_pages = own_pages.clone()  # host store rows = history rows
        hot = torch.arange(b * s * shape.hot_rows, device=device).view(b, s, shape.hot_rows)
        self.hot_loc = self.hot_base + hot
        self.hot_pos = torch.full((b, s, shape.hot_rows), -1, dtype=torch.int64, device=device)
        self.hot_stamp = torch.zeros(b, s, shape.hot_rows, dtype=torch.int64, device=device)
        self.staging: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [slots, staging slots, T], slot of s)
        if staging:
            base = self.hot_base + b * s * shape.hot_rows
            self.staging = (base + torch.arange(b * s * staging, device=device).view(b, s, staging),
                            torch.arange(s, device=device))
        self.slots = torch.arange(b, device=device)
        self.sources = torch.arange(s, device=device)
        self.lengths = torch.full((b,), length, dtype=torch.int64, device=device)
        self.stamp = torch.zeros(1, dtype=torch.int64, device=device)
        self.counts = torch.zeros(b, 3, dtype=torch.int64, device=device)
        self.staged = torch.zeros(b, dtype=torch.int64, device=device)
        self.flags = torch.zeros(1, dtype=torch.int32, device=device)
        n = case.queries * shape.topk
        self.out = {name: torch.empty(s, b, n, dtype=torch.int64, device=device)
                    for name in ("locations", "fetch_src", "fetch_dst")}
        # Indexer keys and weights, the queries' base and the attention queries (random, fixed across steps).
        self.keys = torch.randn(b, length, shape.index_dim, device=device, generator=g).to(torch.bfloat16)
        self.index_weights = torch.rand(shape.index_heads, device=device, generator=g)
        self.q_base = torch.randn(b, 1, shape.index_heads, shape.index_dim, device=device, generator=g)
        # The drift: one fixed direction, so that an eager step and a CUDA-graph replay walk the same path.
        self.q_drift = torch.randn(b, 1, shape.index_heads, shape.index_dim, device=device, generator=g) * case.drift
        self.q_spread = torch.randn(b, case.queries, shape.index_heads, shape.index_dim, device=device,
                                    generator=g) * case.spread  # verification queries: neighbours of one another
        q_dtype = torch.bfloat16
        self.q_lat = torch.randn(s, b, case.queries, shape.heads, shape.rank, device=device, generator=g).to(q_dtype)
        self.q_pe = torch.randn(s, b, case.queries, shape.heads, shape.rope, device=device, generator=g).to(q_dtype)
        self.scale = (shape.rank + shape.rope) ** -0.5

    def select(self) -> torch.Tensor:
        """The indexer's top-k positions ``[B, Q, K]`` for this step (queries drift from the last step's)."""
        sh = self.shape
        self.q_base.add_(self.q_drift)
        q = (self.q_base + self.q_spread).to(torch.bfloat16)  # [B, Q, H, D]
        scores = torch.einsum("bqhd,bld->bqhl", q, self.keys).float().relu_()
        weighted = torch.einsum("bqhl,h->bql", scores, self.index_weights)
        return torch.topk(weighted, sh.topk, dim=-1).indices  # [B, Q, K] int64

    def resolve(self, positions: torch.Tensor) -> torch.Tensor:
        """Arena rows ``[S, B, Q*K]`` of ``positions`` for every source; fetches issued (same stream)."""
        b, s = self.case.batch, self.case.sources
        flat = positions.reshape(b, -1)
        if self.case.direct_only:  # every page mapped: page-table lookups (the engine's direct path)
            p = self.shape.page_rows
            page = self.page_table.gather(2, (flat // p).unsqueeze(1).expand(b, s, -1))
            return (page * p + (flat % p).unsqueeze(1)).transpose(0, 1)
        self.stamp += 1
        out = dict(self.out, counts=self.counts, staged=self.staged, flags=self.flags)
        self.kernels.resolve_step(self.stamp, flat.contiguous(), self.lengths, self.sources, self.slots,
                                  self.page_table, self.hot_pos, self.hot_stamp, self.hot_loc, self.host_pages,
                                  self.staging, self.shape.page_rows, out)
        for source in range(s):
            src = self.out["fetch_src"][source]
            if self.host_rows is not None:
                src = torch.where(src >= 0, self.host_rows(src.clamp(min=0)), -1)
            self.kernels.copy_rows(self.host, self.arena, src, self.out["fetch_dst"][source])
        return self.out["locations"]

    def step(self) -> list[torch.Tensor]:
        """One layer-group step: select, resolve and fetch, attend per source; ``out_lat [B, Q, H, rank]`` each."""
        positions = self.select()
        locations = self.resolve(positions)
        b, q, k = positions.shape
        return [self.kernels.sparse_mla(self.q_lat[src], self.q_pe[src], self.arena, locations[src].view(b, q, k),
                                        self.scale, kv_format=2 if self.shape.fp8 else None)
                for src in range(self.case.sources)]

    def host_share(self) -> float:
        """Share of the resolved rows (distinct per request, step and source) fetched from host so far (0 under the
        resident policy, which resolves by page-table lookups alone)."""
        counts = self.counts.sum(0).double()
        total = float(counts.sum())
        return float(counts[2]) / total if total else 0.0

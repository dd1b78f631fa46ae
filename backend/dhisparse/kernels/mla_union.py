"""The rows the verification queries of a request select, as one list with a query bit mask (pure torch).

The ``Q = γ + 1`` verification queries of a request each select ``K`` arena rows; most of them are the same rows.
Sparse MLA decode (:mod:`dhisparse.kernels.triton_mla`) reads each row of a request once for all of its queries
and heads: it walks the request's *union* of selected rows and masks, per query, the rows that query did not
select. :func:`union_of_queries` builds that form from per-query locations with fixed-shape, vectorised operations
(a sort per request; no value is read on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SENTINEL = torch.iinfo(torch.int64).max
MAX_QUERIES = 31  # query bits of an int32 mask


@dataclass(frozen=True)
class RowUnion:
    """``locations [B, U]`` distinct arena rows of each request, ascending, ``-1`` after its ``length [B]`` (int32)
    valid ones; ``member [B, U]`` int32 bit ``q`` set where query ``q`` selected the row (``None``: one query, every
    valid row is its)."""

    locations: torch.Tensor
    member: torch.Tensor | None
    length: torch.Tensor


def union_of_queries(locations: torch.Tensor) -> RowUnion:
    """The union form of ``locations [B, Q, K]`` (int32 / int64 arena rows, ``-1`` = not selected).

    With ``Q == 1`` the rows are used as they are (``U = K``; a query's top-k rows are distinct). Otherwise
    ``U = Q * K`` (fixed shape): each request's distinct valid rows first, ascending, and a bit per query; a query
    that names a row twice sets its bit once."""
    if locations.dim() != 3:
        raise ValueError(f"locations must be [B, Q, K], got {list(locations.shape)}")
    batch, queries, topk = locations.shape
    if queries > MAX_QUERIES:
        raise ValueError(f"at most {MAX_QUERIES} verification queries share a row mask, got {queries}")
    device = locations.device
    if queries == 1:
        return RowUnion(locations[:, 0], None, torch.full((batch,), topk, dtype=torch.int32, device=device))
    width = queries * topk
    flat = locations.reshape(batch, width).to(torch.int64)
    key = flat.masked_fill(flat < 0, _SENTINEL)
    ordered, order = torch.sort(key, dim=1)
    valid = ordered != _SENTINEL
    first = valid.clone()
    first[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    slot = torch.cumsum(first, dim=1) - 1  # union index of every sorted entry
    dump = torch.full_like(slot, width)  # entries with nowhere to go write one extra column, dropped
    rows = torch.full((batch, width + 1), -1, dtype=torch.int64, device=device)
    rows.scatter_(1, torch.where(first, slot, dump), ordered.masked_fill(~first, -1))
    query = order // topk  # query of every sorted entry
    bits = torch.zeros(batch, (width + 1) * queries, dtype=torch.bool, device=device)
    bits.scatter_(1, torch.where(valid, slot, dump) * queries + query, valid)
    weights = (1 << torch.arange(queries, device=device, dtype=torch.int32))
    member = (bits.view(batch, width + 1, queries)[:, :width].to(torch.int32) * weights).sum(-1, dtype=torch.int32)
    return RowUnion(rows[:, :width].to(locations.dtype), member, first.sum(1, dtype=torch.int32))

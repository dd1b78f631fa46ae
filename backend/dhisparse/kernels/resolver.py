"""The three-step resolver: selected positions → device locations (pure, vectorised over the batch).

This module is the specification that the header-only C++/CUDA port in ``plugins/`` must reproduce
bit for bit (locations, LRU state and copy list). It holds no state: the caller passes the batched
state of one KV source (one hot cache per request) and gets back the new state.

Inputs, for ``R`` requests of one KV source
--------------------------------------------
``positions``  ``[R, N]`` int64. The selected token positions of request ``r`` (the selections of all of
               its queries in this step, concatenated); ``-1`` marks an unused entry. Duplicates are
               allowed and are resolved once (shared missing-row retrieval: each missing row is copied
               once). Valid positions are ``>= 0``; the caller guarantees they are below the request's
               history length and that every one of them is direct, in the hot cache, or on the host.
``page_table`` ``[R, M]`` int64. ``page_table[r, i]`` is the device arena page holding rows
               ``i*page_rows .. (i+1)*page_rows-1`` of request ``r`` (the tail or a ready optional page),
               or ``-1``. A position whose page index is ``>= M`` is not direct.
``hot_pos``    ``[R, B]`` int64. Position held by each hot-cache slot, ``-1`` = empty. A position occupies
               at most one slot of a row.
``hot_stamp``  ``[R, B]`` int64, ``>= 0``. Stamp of the slot's last use (ignored for empty slots).
``hot_loc``    ``[R, B]`` int64. Device arena row of each slot (fixed for the life of the cache).
``stamp``      int, the current step's stamp; larger than every stamp in ``hot_stamp``.
``page_rows``  int, rows per page ``P``.
``staging_loc`` optional ``[R, T]`` int64. Device arena rows of the request's verification staging for this
               source (``T`` may be 0). Only used when a step misses more rows than the hot cache can take.

Semantics, for each request ``r`` independently (``U`` = the distinct valid positions of row ``r``)
---------------------------------------------------------------------------------------------------
1. **Direct**: ``p`` in ``U`` with ``page_table[r, p // P] >= 0`` resolves to
   ``page_table[r, p // P] * P + p % P``. The hot cache is not touched for such rows, even if a slot
   happens to hold ``p`` as well.
2. **Hot**: the remaining ``p`` with a slot ``j`` where ``hot_pos[r, j] == p`` resolve to
   ``hot_loc[r, j]``; ``hot_stamp[r, j]`` becomes ``stamp``. The scan is over the ``B`` slots only.
3. **Host copy**: the remaining positions (the misses), in ascending position order ``m_0 < m_1 < ...``,
   are assigned victim slots in *eviction order*: among the slots **not hit in step 2** (a slot the
   current step needs is never evicted), empty slots first, then occupied slots by ascending
   ``hot_stamp``; ties by ascending slot index. Miss ``m_k`` takes the ``k``-th slot of that order:
   ``hot_pos = m_k``, ``hot_stamp = stamp``, location ``hot_loc`` of that slot, and a copy-list entry
   ``(r, m_k, slot, hot_loc[r, slot])``.
4. **Verification staging** (overflow): with ``E`` candidate slots, misses ``m_E, m_E+1, ...`` (the largest
   positions) do not enter the hot cache: miss ``m_{E+j}`` resolves to ``staging_loc[r, j]`` with a copy-list
   entry ``(r, m_{E+j}, -1, staging_loc[r, j])``; the hot cache's positions and stamps are not changed for
   them, so no row another query of the step needs is evicted and what enters the hot cache (and the LRU
   order) is the same as with a larger cache. More overflow rows than ``T`` raises
   :class:`HotCacheOverflowError`.

Every entry of ``positions`` equal to ``p`` receives ``p``'s location and step code. The copy list is
ordered by request, then ascending position. The inputs are not modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STEP_UNUSED = 0
STEP_DIRECT = 1
STEP_HOT = 2
STEP_HOST = 3

_POS_SENTINEL = torch.iinfo(torch.int64).max


def _empty(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor (the on-device path's unused outputs)."""
    return torch.empty(0, dtype=dtype, device=device)


class HotCacheOverflowError(ValueError):
    """A request's step selects more missing rows than its hot cache has evictable slots."""


@dataclass(frozen=True)
class Resolution:
    """Result of :func:`resolve` for one KV source.

    Attributes:
        locations: ``[R, N]`` int64 device arena row of every entry of ``positions``; ``-1`` where unused.
        steps: ``[R, N]`` int8 step code per entry: 0 unused, 1 direct, 2 hot, 3 host copy.
        hot_pos: ``[R, B]`` int64 new slot positions.
        hot_stamp: ``[R, B]`` int64 new slot stamps.
        copy_request: ``[C]`` int64 request row of each row to copy from host.
        copy_position: ``[C]`` int64 token position of each row to copy.
        copy_slot: ``[C]`` int64 hot-cache slot it is copied into.
        copy_location: ``[C]`` int64 device arena row it is copied into (``hot_loc`` of that slot).
        counts: ``[R, 3]`` int64 distinct positions resolved at steps 1, 2 and 3 per request (3 includes staged).
        staged: ``[R]`` int64 distinct positions copied into verification staging (a subset of step 3).
        fetch_mask: ``[R, N]`` bool, the copy list in fixed shape (entries in each request's ascending position
            order; ``True`` exactly for the copy-list entries, staged ones included), so a caller can copy
            without reading the list's length on the host. ``fetch_position`` / ``fetch_location``: ``[R, N]``
            int64 position and arena row (hot slot or staging row) of each entry (meaningful where ``fetch_mask``).
        overflow: ``[R]`` bool, requests whose misses exceed their evictable slots plus staging rows (only when
            the caller asked :func:`resolve` not to raise; their locations are then not valid).
    """

    locations: torch.Tensor
    steps: torch.Tensor
    hot_pos: torch.Tensor
    hot_stamp: torch.Tensor
    copy_request: torch.Tensor
    copy_position: torch.Tensor
    copy_slot: torch.Tensor
    copy_location: torch.Tensor
    counts: torch.Tensor
    staged: torch.Tensor
    fetch_mask: torch.Tensor | None = None
    fetch_position: torch.Tensor | None = None
    fetch_location: torch.Tensor | None = None
    overflow: torch.Tensor | None = None


def from_padded(locations: torch.Tensor, steps: torch.Tensor, hot_pos: torch.Tensor, hot_stamp: torch.Tensor,
                copy_position: torch.Tensor, copy_slot: torch.Tensor, copy_location: torch.Tensor,
                summary: torch.Tensor) -> Resolution:
    """A :class:`Resolution` from a native resolver's fixed-shape outputs (``dhisparse/resolver.h``: the CPU
    library and the CUDA kernel): the padded ``[R, N]`` copy lists (``-1`` = none) compacted, counts from the
    summary's columns 3..5. The native resolvers have no verification staging, so ``staged`` is zero."""
    rows, cols = torch.nonzero(copy_position >= 0, as_tuple=True)
    return Resolution(
        locations=locations, steps=steps, hot_pos=hot_pos, hot_stamp=hot_stamp, copy_request=rows,
        copy_position=copy_position[rows, cols], copy_slot=copy_slot[rows, cols],
        copy_location=copy_location[rows, cols], counts=summary[:, 3:6].to(torch.int64),
        staged=torch.zeros(locations.shape[0], dtype=torch.int64, device=locations.device),
    )


def resolve(
    positions: torch.Tensor,
    page_table: torch.Tensor,
    hot_pos: torch.Tensor,
    hot_stamp: torch.Tensor,
    hot_loc: torch.Tensor,
    stamp: int,
    page_rows: int,
    staging_loc: torch.Tensor | None = None,
    *,
    on_device: bool = False,
) -> Resolution:
    """Resolve the selected positions of ``R`` requests of one KV source (see the module docstring).

    Leading dimensions beyond one are allowed (``[R1, R2, ..., N]`` etc., every input with the same leading shape):
    each row along the last dimension is resolved on its own, and every output keeps the leading shape (the
    compacted copy list's ``copy_request`` then indexes the flattened rows). A step resolves an index group's
    sources this way (``[G, B, ...]``) without stacking them.

    ``on_device=True`` is the step's path: no value is read on the host (no overflow check, which the caller
    reads later from ``overflow``; no compacted copy list, whose ``copy_*`` fields are then empty — use the
    ``fetch_*`` fields); ``steps`` is empty too (the step does not use it)."""
    dims = positions.dim()
    if dims < 2 or page_table.dim() != dims or hot_pos.dim() != dims:
        raise ValueError("positions, page_table and hot_pos must be [R, ...] tensors with the same number of "
                         "dimensions")
    num_slots = hot_pos.shape[-1]
    num_pages = page_table.shape[-1]
    device = positions.device

    # Sort each row's entries: duplicates become adjacent, misses come out in ascending order, unused entries
    # (the sentinel) last. The sentinel is past every page table and never in a hot cache, so it resolves to
    # nothing without a mask.
    sorted_pos, perm = torch.sort(positions.masked_fill(positions < 0, _POS_SENTINEL), dim=-1)
    valid = sorted_pos != _POS_SENTINEL
    first = valid.clone()
    first[..., 1:].logical_and_(sorted_pos[..., 1:] != sorted_pos[..., :-1])

    # Step 1: direct (tail or ready optional page).
    page_index = torch.div(sorted_pos, page_rows, rounding_mode="floor")
    if num_pages > 0:
        page = page_table.gather(-1, page_index.clamp(max=num_pages - 1)).masked_fill_(page_index >= num_pages, -1)
    else:
        page = torch.full_like(sorted_pos, -1)
    direct = page >= 0
    direct_loc = torch.add(sorted_pos % page_rows, page, alpha=page_rows)

    # Step 2: hot cache, a search over the B slots (sorted copy + binary search).
    if num_slots > 0:
        hot_sorted, hot_order = torch.sort(hot_pos, dim=-1)
        hot_sorted = hot_sorted.contiguous()  # sort keeps a permuted input's layout; searchsorted wants rows
        probe = torch.searchsorted(hot_sorted, sorted_pos.contiguous()).clamp_(max=num_slots - 1)
        resolved = direct | (hot_sorted.gather(-1, probe) == sorted_pos)
        hit_slot = hot_order.gather(-1, probe)
    else:
        resolved = direct
        hit_slot = torch.zeros_like(sorted_pos)
    hot = resolved ^ direct  # found and not direct
    miss = valid ^ resolved  # valid, neither direct nor found (resolved entries are valid)

    # Distinct positions resolved at steps 1, 2 and 3, in one reduction.
    counts = (torch.stack([direct, hot, miss], dim=-2) & first.unsqueeze(-2)).sum(dim=-1)
    num_miss = counts[..., 2]

    # Step 3: eviction order = not hit (hit slots get the largest key: an entry that hit nothing writes -1, which
    # the maximum ignores, as every key is >= -1); empty first, then ascending stamp; ties by slot index (stable).
    key_max = torch.iinfo(torch.int64).max
    evict_key = torch.where(hot_pos < 0, -1, hot_stamp)
    if num_slots > 0:
        evict_key = evict_key.scatter_reduce(-1, hit_slot, torch.where(hot, key_max, -1), "amax")
    miss_first = miss & first
    miss_rank = miss_first.cumsum(dim=-1) - 1
    num_candidates = num_slots - counts[..., 1]  # each distinct hot position hit one slot
    num_staging = 0 if staging_loc is None else staging_loc.shape[-1]
    overflow = num_miss > (num_candidates + num_staging if num_staging else num_candidates)
    if not on_device and bool(overflow.any()):
        r = int(torch.nonzero(overflow.reshape(-1))[0, 0])
        raise HotCacheOverflowError(
            f"request row {r} misses {int(num_miss.reshape(-1)[r])} rows but its hot cache has only "
            f"{int(num_candidates.reshape(-1)[r])} evictable of {num_slots} slots and {num_staging} staging rows; "
            "raise hot_rows (B) to at least the number of distinct rows one step can select"
        )
    if num_slots > 0:
        evict_order = torch.sort(evict_key, dim=-1, stable=True).indices
        victim = evict_order.gather(-1, miss_rank.clamp(min=0, max=num_slots - 1))
    else:
        victim = hit_slot

    # Misses past the evictable slots go to verification staging, in ascending position order. Without staging
    # there are none (more misses than evictable slots is an overflow: raised here, or flagged on the device and
    # raised at end_step, whose abort restores the hot caches).
    slot = torch.where(hot, hit_slot, victim)
    slot_loc = hot_loc.gather(-1, slot) if num_slots > 0 else torch.full_like(sorted_pos, -1)
    if num_staging > 0:
        assert staging_loc is not None
        stage_rank = miss_rank - num_candidates.unsqueeze(-1)
        staged = miss & (stage_rank >= 0)
        cached_miss_first = miss_first & ~staged
        stage_loc = staging_loc.gather(-1, stage_rank.clamp(min=0, max=num_staging - 1))
        slot_loc = torch.where(staged, stage_loc, slot_loc)
        staged_count = (staged & first).sum(dim=-1)
    else:
        staged = None
        cached_miss_first = miss_first
        staged_count = torch.zeros_like(num_miss)

    # Locations in sorted order, then back to the caller's order (perm is a permutation: every entry is written).
    loc_sorted = torch.where(direct, direct_loc, torch.where(valid, slot_loc, -1))
    locations = loc_sorted.scatter(-1, perm, loc_sorted)
    if on_device:  # the step's path uses neither the per-entry steps nor the compacted copy list
        steps = _empty(device, torch.int8)
    else:
        step_sorted = torch.where(
            direct, STEP_DIRECT, torch.where(hot, STEP_HOT, torch.where(miss, STEP_HOST, STEP_UNUSED))
        ).to(torch.int8)
        steps = step_sorted.scatter(-1, perm, step_sorted)

    # New LRU state: hit slots and victim slots take the current stamp (larger than every stamp: the maximum keeps
    # it, and the -1 of the other entries changes nothing); victims take their miss (other entries write into an
    # extra column, dropped).
    if num_slots > 0:
        new_stamp = hot_stamp.scatter_reduce(-1, slot, torch.where(hot | cached_miss_first, int(stamp), -1), "amax")
        new_pos = torch.cat([hot_pos, hot_pos[..., :1]], dim=-1).scatter_(
            -1, torch.where(cached_miss_first, victim, num_slots), sorted_pos)[..., :num_slots]
    else:
        new_stamp, new_pos = hot_stamp.clone(), hot_pos.clone()

    if on_device:
        copy_rows = copy_slot = copy_location = copy_position = _empty(device, torch.int64)
    else:
        copy_rows, copy_cols = torch.nonzero(miss_first.flatten(0, -2), as_tuple=True)
        entry = (copy_rows, copy_cols)
        copy_staged = (staged.flatten(0, -2)[entry] if staged is not None
                       else torch.zeros_like(copy_rows, dtype=torch.bool))
        copy_slot = torch.where(copy_staged, -1, victim.flatten(0, -2)[entry])
        copy_location = slot_loc.flatten(0, -2)[entry]
        copy_position = sorted_pos.flatten(0, -2)[entry]
    return Resolution(
        locations=locations,
        steps=steps,
        hot_pos=new_pos,
        hot_stamp=new_stamp,
        copy_request=copy_rows,
        copy_position=copy_position,
        copy_slot=copy_slot,
        copy_location=copy_location,
        counts=counts,
        staged=staged_count,
        fetch_mask=miss_first,
        fetch_position=sorted_pos,
        fetch_location=slot_loc,
        overflow=overflow,
    )

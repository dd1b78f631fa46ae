"""Random step-resolver traces with a chosen miss rate, and their expected results (pure torch, CPU).

A trace is one KV step of an index group as the step resolver (``StepResolveArgs`` of
``plugins/common/include/dhisparse/launch.h``) sees it: ``B`` requests in scattered slots of the batch state, ``G``
sources selected by the same positions (``Q`` verification queries of ``K`` entries each, so duplicates across
queries), a page-table snapshot with some pages direct, and hot caches holding about ``1 - miss_rate`` of each
row's non-direct selections (the rest miss and are fetched from host pages). The expected result is
:func:`dhisparse.kernels.resolver.resolve` per source — the specification every resolver (the CPU library, the CUDA
kernel, the kernel's block code run on the CPU) must equal. Used by ``tests/native/test_block_resolver.py`` and
``scripts/gpu_check.py`` (the kernel on a GPU against the CPU library on the same trace).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhisparse.kernels.resolver import resolve


@dataclass
class StepTrace:
    """One step's inputs (int64 CPU tensors; shapes as in ``launch.h``'s ``StepResolveArgs``)."""

    stamp: int
    page_rows: int
    positions: torch.Tensor  # [B, N]
    lengths: torch.Tensor  # [B]
    sources: torch.Tensor  # [G]
    slots: torch.Tensor  # [B]
    page_table: torch.Tensor  # [B, S, M] snapshot by request
    hot_pos: torch.Tensor  # [slots, S, H]
    hot_stamp: torch.Tensor  # [slots, S, H]
    hot_loc: torch.Tensor  # [slots, S, H]
    host_pages: torch.Tensor  # [slots, S, M]
    staging_loc: torch.Tensor | None  # [slots, staging slots, T]
    staging_slots: torch.Tensor | None  # [G] each group member's staging slot

    @property
    def staging(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What the step resolver takes for staging: ``(staging_loc, staging_slots)`` or None."""
        return None if self.staging_loc is None or self.staging_slots is None else (self.staging_loc,
                                                                                    self.staging_slots)

    def to(self, device: torch.device | str) -> StepTrace:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return StepTrace(**moved)

    def clone(self) -> StepTrace:
        return StepTrace(**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})


@dataclass
class StepExpected:
    """What the step must produce: ``locations [G, B, N]``, each source's copy list as host rows → arena rows in
    request order, then ascending position (``fetch_src`` / ``fetch_dst``: lists of ``G`` tensors), ``counts
    [B, 3]``, ``staged [B]``, the hot state after the step and the number of distinct misses."""

    locations: torch.Tensor
    fetch_src: list[torch.Tensor]
    fetch_dst: list[torch.Tensor]
    counts: torch.Tensor
    staged: torch.Tensor
    hot_pos: torch.Tensor
    hot_stamp: torch.Tensor
    misses: int
    union: int


def step_trace(seed: int, batch: int, sources: int, groups: int, queries: int, topk: int, hot_rows: int,
               miss_rate: float, page_rows: int = 16, direct_share: float = 0.3, staging_rows: int = 0,
               history: int | None = None) -> StepTrace:
    """A random step (see the module docstring). ``history`` rows per request (default ``4 * topk``, at least a
    page); ``hot_rows`` must hold every hit plus the misses' victims (else the trace overflows, also a valid
    case). The group's sources are ``groups`` of the ``sources`` in a random order; requests sit in a random
    subset of ``batch + 3`` slots."""
    g = torch.Generator().manual_seed(seed)
    history = history or max(4 * topk, page_rows)
    pages = -(-history // page_rows)
    num_slots = batch + 3
    slots = torch.randperm(num_slots, generator=g)[:batch]
    group = torch.randperm(sources, generator=g)[:groups]
    lengths = torch.randint(max(history // 2, 1), history + 1, (batch,), generator=g)
    # Selections: each query picks topk distinct positions; later queries share most of the first one's.
    picks = []
    for b in range(batch):
        first = torch.randperm(int(lengths[b]), generator=g)[:topk]
        rows = [first]
        for _ in range(queries - 1):
            other = first.clone()
            change = torch.rand(other.numel(), generator=g) < 0.2
            other[change] = torch.randint(0, int(lengths[b]), (int(change.sum()),), generator=g)
            rows.append(other)
        sel = torch.cat(rows)
        sel = torch.cat([sel, torch.full((topk * queries - sel.numel(),), -1)])
        sel[torch.rand(sel.numel(), generator=g) < 0.05] = -1  # unused entries
        picks.append(sel)
    positions = torch.stack(picks)
    ready = torch.rand(batch, sources, pages, generator=g) < direct_share
    ready[:, :, -1] = True  # the tail page
    page_table = torch.where(ready, torch.randperm(batch * sources * pages, generator=g).view(batch, sources, pages),
                             -1)
    hot_pos = torch.full((num_slots, sources, hot_rows), -1, dtype=torch.int64)
    hot_stamp = torch.randint(0, 50, (num_slots, sources, hot_rows), generator=g)
    hot_loc = 10**7 + torch.randperm(num_slots * sources * hot_rows, generator=g).view(num_slots, sources, hot_rows)
    host_pages = torch.randperm(num_slots * sources * pages, generator=g).view(num_slots, sources, pages)
    for b in range(batch):
        slot = int(slots[b])
        sel = positions[b][positions[b] >= 0].unique()
        for s in range(sources):
            direct = page_table[b, s, sel // page_rows] >= 0
            wanted = sel[~direct]
            keep = wanted[torch.rand(wanted.numel(), generator=g) >= miss_rate]
            others = torch.tensor(sorted(set(range(int(lengths[b]))) - set(sel.tolist())), dtype=torch.int64)
            filler = others[torch.randperm(others.numel(), generator=g)[: max(hot_rows - keep.numel(), 0) * 3 // 4]]
            held = torch.cat([keep, filler])[:hot_rows]
            at = torch.randperm(hot_rows, generator=g)[: held.numel()]
            hot_pos[slot, s, at] = held
    staging = staging_slots = None
    if staging_rows:  # the batch state's layout: per slot, groups + 1 staging slots, the members' in a random order
        staging = 2 * 10**7 + torch.randperm(num_slots * (groups + 1) * staging_rows, generator=g).view(
            num_slots, groups + 1, staging_rows)
        staging_slots = torch.randperm(groups + 1, generator=g)[:groups]
    return StepTrace(stamp=100, page_rows=page_rows, positions=positions, lengths=lengths, sources=group,
                     slots=slots, page_table=page_table, hot_pos=hot_pos, hot_stamp=hot_stamp, hot_loc=hot_loc,
                     host_pages=host_pages, staging_loc=staging, staging_slots=staging_slots)


def expected_step(t: StepTrace) -> StepExpected:
    """The specification's result of trace ``t``: :func:`resolve` per source (raises ``HotCacheOverflowError``
    when a row overflows)."""
    batch, n = t.positions.shape
    hot_pos, hot_stamp = t.hot_pos.clone(), t.hot_stamp.clone()
    locations = torch.empty(t.sources.numel(), batch, n, dtype=torch.int64)
    counts = torch.zeros(batch, 3, dtype=torch.int64)
    staged = torch.zeros(batch, dtype=torch.int64)
    fetch_src, fetch_dst = [], []
    misses = union = 0
    for g, source in enumerate(t.sources.tolist()):
        staging = None
        if t.staging_loc is not None and t.staging_slots is not None:
            staging = t.staging_loc[t.slots, int(t.staging_slots[g])]
        res = resolve(t.positions, t.page_table[:, source], hot_pos[t.slots, source], hot_stamp[t.slots, source],
                      t.hot_loc[t.slots, source], t.stamp, t.page_rows, staging)
        hot_pos[t.slots, source] = res.hot_pos
        hot_stamp[t.slots, source] = res.hot_stamp
        locations[g] = res.locations
        counts += res.counts
        staged += res.staged
        misses += int(res.counts[:, 2].sum())
        union += int(res.counts.sum())
        host_page = t.host_pages[t.slots[res.copy_request], source, res.copy_position // t.page_rows]
        fetch_src.append(host_page * t.page_rows + res.copy_position % t.page_rows)
        fetch_dst.append(res.copy_location)
    return StepExpected(locations, fetch_src, fetch_dst, counts, staged, hot_pos, hot_stamp, misses, union)


def compact_fetch(fetch: torch.Tensor) -> list[torch.Tensor]:
    """A step resolver's padded ``[G, B, N]`` fetch list as ``G`` compacted lists (request order, then the
    order within the request: the specification's order)."""
    return [row[row >= 0] for row in fetch.reshape(fetch.shape[0], -1).cpu()]


def step_outputs(t: StepTrace, staged: bool = True) -> dict[str, torch.Tensor]:
    """Output tensors of a step-resolver launch over trace ``t`` (on its device): ``locations``, ``steps``,
    ``fetch_src``, ``fetch_dst`` ``[G, B, N]``, ``counts [B, 3]`` and ``staged [B]`` zeroed, ``flags [1]`` int32."""
    groups, (batch, n), device = t.sources.numel(), t.positions.shape, t.positions.device
    out = {name: torch.full((groups, batch, n), -7, dtype=torch.int64, device=device)
           for name in ("locations", "fetch_src", "fetch_dst")}
    out["steps"] = torch.full((groups, batch, n), -7, dtype=torch.int8, device=device)
    out["counts"] = torch.zeros(batch, 3, dtype=torch.int64, device=device)
    if staged:
        out["staged"] = torch.zeros(batch, dtype=torch.int64, device=device)
    out["flags"] = torch.zeros(1, dtype=torch.int32, device=device)
    return out


def mismatch(got: dict[str, torch.Tensor], state: StepTrace, want: StepExpected) -> str | None:
    """``None`` when a step resolver's outputs ``got`` (and the hot state it left in ``state``) equal ``want``."""
    checks = [("locations", got["locations"], want.locations), ("counts", got["counts"], want.counts),
              ("hot_pos", state.hot_pos, want.hot_pos), ("hot_stamp", state.hot_stamp, want.hot_stamp)]
    if "staged" in got:
        checks.append(("staged", got["staged"], want.staged))
    for name, a, b in checks:
        a = a.cpu()
        if a.shape != b.shape or not torch.equal(a, b):
            bad = (a != b).nonzero()[:1].tolist() if a.shape == b.shape else "shape"
            return f"{name} differs (first at {bad})"
    for name, lists, wanted in (("fetch_src", compact_fetch(got["fetch_src"]), want.fetch_src),
                                ("fetch_dst", compact_fetch(got["fetch_dst"]), want.fetch_dst)):
        for g, (a, b) in enumerate(zip(lists, wanted, strict=True)):
            if not torch.equal(a, b):
                return f"{name} of source {g}: {a.numel()} entries vs {b.numel()} expected, or values differ"
    if int(got["flags"][0]) != 0:
        return f"flags {int(got['flags'][0])}"
    return None

"""Which rows a decode step selects: a documented synthetic locality model, or a replayed engine trace.

Synthetic model (per request and simulated index group; positions in simulated rows):

- A selection belongs to a *position*: the query at position ``p`` selects ``S(p)``, whatever step verifies it.
  ``S(p)`` keeps each position of ``S(p - 1)`` with probability ``overlap`` (the temporal locality of the indexer's
  top-k across consecutive tokens): consecutive verification queries of one step follow the same per-token
  overlap as consecutive decode steps.
- A position verified again (a draft rejected in the previous step, re-verified from the corrected token on) keeps
  the selection it had, and the next step's first query is anchored on the previous step's selection of the
  position before it (the last *accepted* one), never on a rejected draft's.
- Every position not kept is a *fresh* pick: with probability ``recent_fraction`` uniform over the most recent
  ``recent_window_tokens`` (real tokens) of the history, else uniform over the whole history. Duplicates are
  re-drawn (three rounds; any left are dropped as unused entries).
- Query ``j`` of a step may select positions ``< start + j + 1`` (causal); when that history is no longer than
  ``index_topk`` it selects all of it.

``query_overlap`` set (not None) restores the selector from before issue 28's fix, for the ablation only
(``scripts/planner_ablation.py``): every query of a step draws its selection anew, query ``j > 0`` keeping each
position of query ``j - 1`` with probability ``query_overlap`` (an unsourced constant, 0.9 then), a re-verified
position draws again, and the next step is anchored on the previous step's *last* query, even a rejected draft's.

All randomness comes from one seeded ``torch.Generator``: a run is a pure function of its seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LocalityModel:
    """Attributes (fractions in [0, 1]; window in real tokens):
    overlap, recent_fraction, recent_window_tokens, query_overlap (None: selections belong to positions; a
    fraction: the pre-fix selector) — see the module docstring."""

    overlap: float = 0.8
    recent_fraction: float = 0.2
    recent_window_tokens: int = 4096
    query_overlap: float | None = None

    def __post_init__(self) -> None:
        for name in ("overlap", "recent_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.query_overlap is not None and not 0.0 <= self.query_overlap <= 1.0:
            raise ValueError(f"query_overlap must be None or in [0, 1], got {self.query_overlap}")
        if self.recent_window_tokens < 1:
            raise ValueError("recent_window_tokens must be >= 1")


# The calibrated model (docs/results/calibration.csv, written by scripts/reproduce_paper.py): fitted to the
# paper's published resolution shares; the plausible overlap range spans that fit and the fit to our engine's
# selection traces (docs/results/engine_trace.json). dhisparse-plan uses these by default.
CALIBRATED = LocalityModel(overlap=0.858, recent_fraction=0.394)
CALIBRATED_OVERLAP_RANGE = (0.604, 0.888)
CALIBRATED_RECENT_RANGE = (0.034, 0.444)


class SyntheticSelector:
    """Generates ``[B, Q, K]`` positions per simulated index group with :class:`LocalityModel` statistics."""

    def __init__(self, model: LocalityModel, topk: int, groups: int, token_scale: int, seed: int) -> None:
        self.model, self.topk, self.groups = model, topk, groups
        self.window = max(1, model.recent_window_tokens // token_scale)
        self.gen = torch.Generator().manual_seed(seed)
        # request -> (first position, [groups, n, K] selections of positions first .. first + n - 1): the last
        # step's queries, kept so a position verified again keeps its selection
        self.stored: dict[str, tuple[int, torch.Tensor]] = {}

    def forget(self, request_id: str) -> None:
        self.stored.pop(request_id, None)

    def _fresh(self, limit: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Fresh picks below ``limit`` (broadcast to ``shape``): recent window or uniform history."""
        u = torch.rand(shape, generator=self.gen, dtype=torch.float64)
        recent = torch.rand(shape, generator=self.gen, dtype=torch.float64) < self.model.recent_fraction
        span = torch.where(recent, torch.clamp(limit, max=self.window), limit).to(torch.float64)
        offset = torch.floor(u * span).to(torch.int64)
        return torch.where(recent, limit - 1 - offset, offset)

    def _dedupe(self, sel: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            s, order = torch.sort(sel, dim=-1)
            dup_sorted = torch.zeros_like(s, dtype=torch.bool)
            dup_sorted[..., 1:] = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
            dup = torch.zeros_like(dup_sorted).scatter_(-1, order, dup_sorted)
            if not bool(dup.any()):
                return sel
            sel = torch.where(dup, self._fresh(limit, tuple(sel.shape)), sel)
        s, order = torch.sort(sel, dim=-1)
        dup_sorted = torch.zeros_like(s, dtype=torch.bool)
        dup_sorted[..., 1:] = s[..., 1:] == s[..., :-1]
        dup = torch.zeros_like(dup_sorted).scatter_(-1, order, dup_sorted)
        return torch.where(dup, torch.full_like(sel, -1), sel)

    def _known(self, request_ids: list[str], starts: list[int], q: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
        """From the stored selections: ``anchor [B, G, K]`` = ``S(start - 1)`` (-1 where unknown), ``known [B, G,
        Q, K]`` = ``S(start + j)`` where stored and ``have [B, Q]`` marking them."""
        batch, k = len(request_ids), self.topk
        anchor = torch.full((batch, self.groups, k), -1, dtype=torch.int64)
        known = torch.full((batch, self.groups, q, k), -1, dtype=torch.int64)
        have = torch.zeros(batch, q, dtype=torch.bool)
        for b, (rid, start) in enumerate(zip(request_ids, starts, strict=True)):
            got = self.stored.get(rid)
            if got is None:
                continue
            first, sel = got
            n = sel.shape[1]
            if self.model.query_overlap is not None:  # pre-fix: the last query's selection, nothing kept
                anchor[b] = sel[:, n - 1]
                continue
            if first <= start - 1 < first + n:
                anchor[b] = sel[:, start - 1 - first]
            lo, hi = max(start, first), min(start + q, first + n)
            if lo < hi:
                known[b, :, lo - start:hi - start] = sel[:, lo - first:hi - first]
                have[b, lo - start:hi - start] = True
        return anchor, known, have

    def select(self, request_ids: list[str], starts: torch.Tensor, query_lens: torch.Tensor,
               max_query_len: int) -> list[torch.Tensor]:
        """Positions ``[B, Q, K]`` int64 for each simulated group; ``-1`` for queries beyond ``query_lens``. Query
        ``j`` of request ``b`` is the one at position ``starts[b] + j``."""
        batch, k, q = len(request_ids), self.topk, max_query_len
        start_list = [int(x) for x in starts.tolist()]
        limit = (starts.view(-1, 1) + 1 + torch.arange(q)).view(batch, 1, q, 1)  # [B, 1, Q, 1]
        limit = limit.expand(batch, self.groups, q, 1)
        out = torch.empty(batch, self.groups, q, k, dtype=torch.int64)
        prev, known, have = self._known(request_ids, start_list, q)
        legacy = self.model.query_overlap
        for j in range(q):
            lim = limit[:, :, j]  # [B, G, 1]
            keep_p = self.model.overlap if legacy is None or j == 0 else legacy
            keep = (torch.rand(batch, self.groups, k, generator=self.gen) < keep_p) & (prev >= 0) & (prev < lim)
            sel = torch.where(keep, prev, self._fresh(lim, (batch, self.groups, k)))
            sel = self._dedupe(sel, lim)
            short = lim <= k  # whole history fits the top-k: select all of it
            every = torch.arange(k).expand(batch, self.groups, k)
            sel = torch.where(short, torch.where(every < lim, every, -1), sel)
            sel = torch.where(have[:, j].view(batch, 1, 1), known[:, :, j], sel)  # verified again: unchanged
            out[:, :, j] = sel
            prev = sel
        for b, (rid, start) in enumerate(zip(request_ids, start_list, strict=True)):
            self.stored[rid] = (start, out[b, :, : int(query_lens[b])].clone())
        active = torch.arange(q).view(1, 1, q, 1) < query_lens.view(-1, 1, 1, 1)
        out = torch.where(active, out, torch.full_like(out, -1))
        return [out[:, g_] for g_ in range(self.groups)]


class ReplaySelector:
    """Replays positions recorded from the real engine: ``trace[request_id][i]`` is ``{layer: [Q, K]}`` for the
    request's ``i``-th decode step."""

    def __init__(self, trace: dict[str, list[dict[int, torch.Tensor]]]) -> None:
        self.trace = trace
        self.cursor: dict[str, int] = {}

    def forget(self, request_id: str) -> None:
        self.cursor.pop(request_id, None)

    def select_layers(self, request_ids: list[str], layers: list[int], max_query_len: int) -> dict[int, torch.Tensor]:
        """``{layer: [B, Q, K]}`` for the next decode step of each request (``-1`` padded)."""
        steps = []
        for r in request_ids:
            i = self.cursor.get(r, 0)
            if i >= len(self.trace.get(r, [])):
                raise KeyError(f"trace has no decode step {i} for request {r!r}")
            steps.append(self.trace[r][i])
            self.cursor[r] = i + 1
        out: dict[int, torch.Tensor] = {}
        cache: dict[int, torch.Tensor] = {}
        for layer in layers:
            rows = [s[layer] for s in steps]
            k = max(x.shape[-1] for x in rows)
            pos = torch.full((len(rows), max_query_len, k), -1, dtype=torch.int64)
            for b, x in enumerate(rows):
                pos[b, : x.shape[0], : x.shape[1]] = x
            # layers that shared one positions tensor in the engine share one here too
            same = next((t for lyr, t in cache.items() if all(steps[b][lyr] is rows[b] for b in range(len(rows)))),
                        None)
            out[layer] = same if same is not None else pos
            cache[layer] = out[layer]
        return out

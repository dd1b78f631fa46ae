"""Calibrating the selection model (:mod:`dhisparse_planner.locality`) in the open.

Two kinds of evidence, each fitted separately and reported with its residuals:

1. **Selection traces** (recorded from our engine with :class:`~dhisparse_planner.trace.RecordingKV`, or any
   sequence of top-k selections): a method of simulated moments. Two statistics are measured on consecutive
   selections of one request and index group, for histories longer than the top-k:

   - ``kept``: ``|S_t ∩ S_{t-1}| / |S_t|`` (pooled over all pairs);
   - ``recent``: the share of the *new* positions ``S_t \\ S_{t-1}`` that lie in the last ``window`` tokens.

   :func:`fit_trace` finds the ``(overlap, recent_fraction)`` for which the planner's own
   :class:`~dhisparse_planner.locality.SyntheticSelector`, run over the same history lengths, top-k and window,
   produces the same two statistics (Newton/Broyden iterations; ``kept`` rises with ``overlap``, ``recent`` with
   ``recent_fraction``; common random numbers keep the objective smooth).

2. **Published resolution shares** (:func:`fit_published`, alternating regula falsi): the simulator (real KV
   manager) is run at low load and the two parameters are set so that HiSparse's host-fetched share and the
   adaptive direct share equal the published ones; every other published share is then a prediction whose
   residual is reported.
   At low load every request's resolution is independent of the others' (hisparse: fixed ``B``; adaptive:
   everything fits), so one or two requests per run suffice.

Nothing here looks at throughput: the throughput claims are predicted with the fitted parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dhisparse_planner.locality import LocalityModel, SyntheticSelector

# one (history limit, positions) pair per decode step: positions of one query, -1 padded; limit = history length
Sequence_ = list[tuple[int, torch.Tensor]]


@dataclass(frozen=True)
class TraceMoments:
    kept: float
    recent: float
    pairs: int


def trace_moments(sequences: Sequence[Sequence_], window: int) -> TraceMoments:
    """``kept`` and ``recent`` pooled over consecutive steps whose history exceeds the selection size."""
    kept = total = new = new_recent = pairs = 0
    for seq in sequences:
        for (_, prev), (limit, cur) in zip(seq, seq[1:], strict=False):
            cur = cur[cur >= 0]
            prev = prev[prev >= 0]
            if cur.numel() == 0 or limit <= cur.numel():
                continue
            inside = torch.isin(cur, prev)
            fresh = cur[~inside]
            kept += int(inside.sum())
            total += cur.numel()
            new += fresh.numel()
            new_recent += int((fresh >= limit - window).sum())
            pairs += 1
    if total == 0:
        raise ValueError("trace has no consecutive selections with a history longer than the top-k")
    return TraceMoments(kept / total, new_recent / new if new else 0.0, pairs)


def synthetic_sequences(model: LocalityModel, topk: int, limits: Sequence[Sequence[int]],
                        seed: int) -> list[Sequence_]:
    """Selections the planner's selector makes over the given per-request history limits (one group, q = 1)."""
    n = len(limits)
    steps = max(len(x) for x in limits)
    sel = SyntheticSelector(model, topk, 1, 1, seed)
    ids = [f"s{i}" for i in range(n)]
    out: list[Sequence_] = [[] for _ in range(n)]
    for t in range(steps):
        live = [i for i in range(n) if t < len(limits[i])]
        starts = torch.tensor([limits[i][t] - 1 for i in live], dtype=torch.int64)
        pos = sel.select([ids[i] for i in live], starts, torch.ones(len(live), dtype=torch.int64), 1)[0]
        for b, i in enumerate(live):
            out[i].append((limits[i][t], pos[b, 0]))
    return out


Vec = tuple[float, float]


def _newton(f: Callable[[Vec], Vec], target: Vec, x: Vec, step: float, iters: int, hi: float = 1.0) -> Vec:
    """Solve ``f(x) = target`` on ``[0, hi]^2``: a forward-difference Jacobian (``step``) at the start, then
    Broyden updates (one evaluation of ``f`` per iteration)."""
    fx = f(x)
    cols = []
    for i in range(2):
        h = step if x[i] + step <= hi else -step
        fi = f((x[0] + h, x[1]) if i == 0 else (x[0], x[1] + h))
        cols.append([(fi[0] - fx[0]) / h, (fi[1] - fx[1]) / h])
    jac = [[cols[0][0], cols[1][0]], [cols[0][1], cols[1][1]]]
    for _ in range(iters):
        (a, b), (c, d) = jac
        det = a * d - b * c
        if abs(det) < 1e-12:
            break
        r0, r1 = target[0] - fx[0], target[1] - fx[1]
        new = (min(hi, max(0.0, x[0] + (d * r0 - b * r1) / det)), min(hi, max(0.0, x[1] + (a * r1 - c * r0) / det)))
        dx = (new[0] - x[0], new[1] - x[1])
        if abs(dx[0]) < 1e-3 and abs(dx[1]) < 1e-3:
            return new
        fn = f(new)
        norm = dx[0] ** 2 + dx[1] ** 2
        for i in range(2):  # Broyden: J += (df - J dx) dx^T / |dx|^2
            resid = (fn[i] - fx[i]) - (jac[i][0] * dx[0] + jac[i][1] * dx[1])
            jac[i][0] += resid * dx[0] / norm
            jac[i][1] += resid * dx[1] / norm
        x, fx = new, fn
    return x


@dataclass(frozen=True)
class TraceFit:
    overlap: float
    recent_fraction: float
    observed: TraceMoments
    fitted: TraceMoments

    def residuals(self) -> dict[str, float]:
        return {"kept": self.fitted.kept - self.observed.kept, "recent": self.fitted.recent - self.observed.recent}


def fit_trace(sequences: Sequence[Sequence_], topk: int, window: int, seed: int = 0, iters: int = 6,
              step: float = 0.08) -> TraceFit:
    """Fit ``overlap`` and ``recent_fraction`` (window fixed) to a selection trace (see module docstring)."""
    limits = [[limit for limit, _ in seq] for seq in sequences]
    return fit_trace_moments(trace_moments(sequences, window), limits, topk, window, seed, iters, step)


def fit_trace_moments(observed: TraceMoments, limits: Sequence[Sequence[int]], topk: int, window: int,
                      seed: int = 0, iters: int = 6, step: float = 0.08) -> TraceFit:
    """The fit from a trace's pooled statistics and its per-step history lengths ``limits``: Newton/Broyden
    iterations on the two moments of the planner's selector run over the same ``limits`` (close to linear in
    the parameters; common random numbers keep the differences free of sampling noise)."""

    def moments(x: Vec) -> Vec:
        model = LocalityModel(overlap=x[0], recent_fraction=x[1], recent_window_tokens=window)
        m = trace_moments(synthetic_sequences(model, topk, limits, seed), window)
        return m.kept, m.recent

    x = _newton(moments, (observed.kept, observed.recent), (min(0.95, max(0.05, observed.kept)), 0.2), step, iters)
    fitted = trace_moments(synthetic_sequences(LocalityModel(overlap=x[0], recent_fraction=x[1],
                                                             recent_window_tokens=window), topk, limits, seed), window)
    return TraceFit(x[0], x[1], observed, fitted)


def sequences_from_recording(selections: dict[str, list[dict[int, torch.Tensor]]], prompt_lens: dict[str, int],
                             layers: Sequence[int]) -> list[Sequence_]:
    """Per request and indexer layer: ``(history limit, first query's positions)`` per decode step, from
    :attr:`RecordingKV.selections` (decode step ``i`` of a request sees ``prompt + i`` rows)."""
    out: list[Sequence_] = []
    for rid, steps in selections.items():
        for layer in layers:
            out.append([(prompt_lens[rid] + i, step[layer][0]) for i, step in enumerate(steps) if layer in step])
    return out


# ----------------------------------------------------------------------------------------- published shares
@dataclass(frozen=True)
class ShareTarget:
    """A published resolution share: ``policy`` at ``concurrency`` (no speculation), metric ``share``
    (``host_share`` / ``direct_share`` / ``hot_share``), ``value`` (fraction) and where it comes from."""

    name: str
    policy: str
    share: str
    value: float
    source: str
    fitted: bool


PUBLISHED_SHARES = (
    ShareTarget("hisparse host share, low load", "hisparse", "host_share", 0.142,
                "paper (seeds/): optional residency cuts host-fetched selections from 14.2% ...", True),
    ShareTarget("adaptive direct share, C8", "adaptive", "direct_share", 0.697,
                "paper (seeds/): GLM C8 without speculation, 69.7% direct", True),
    ShareTarget("adaptive hot share, C8", "adaptive", "hot_share", 0.303, "paper: 30.3% hot cache", False),
    ShareTarget("adaptive host share, C8", "adaptive", "host_share", 0.0005, "paper: 0.05% host", False),
    ShareTarget("adaptive host share, low load", "adaptive", "host_share", 0.014, "paper: ... to 1.4%", False),
)


@dataclass(frozen=True)
class PublishedFit:
    overlap: float
    recent_fraction: float
    rows: list[dict[str, float | str]]  # target, published, fitted/predicted, residual


def _root(g: Callable[[float], float], lo: float, hi: float, iters: int, tol: float) -> float:
    """x in [lo, hi] with g(x) ~ 0 (Illinois regula falsi; the nearer end when g does not change sign)."""
    glo, ghi = g(lo), g(hi)
    if glo * ghi > 0:
        return lo if abs(glo) < abs(ghi) else hi
    side = 0
    x = lo
    for _ in range(iters):
        x = (lo * ghi - hi * glo) / (ghi - glo)
        gx = g(x)
        if abs(gx) < tol:
            break
        if gx * ghi > 0:
            hi, ghi = x, gx
            glo = glo / 2 if side == -1 else glo
            side = -1
        else:
            lo, glo = x, gx
            ghi = ghi / 2 if side == 1 else ghi
            side = 1
    return x


def fit_published(run_shares: Callable[[str, LocalityModel], dict[str, float]], base: LocalityModel,
                  targets: Sequence[ShareTarget] = PUBLISHED_SHARES, rounds: int = 2, iters: int = 4,
                  tol: float = 0.002, overlap_bracket: tuple[float, float] = (0.6, 0.98),
                  recent_bracket: tuple[float, float] = (0.0, 0.8)) -> PublishedFit:
    """Alternating one-dimensional root finding (regula falsi): ``overlap`` so that the hisparse host share
    equals its target (log scale: ~linear in the overlap), then ``recent_fraction`` so that the adaptive direct
    share equals its target; ``rounds`` times. ``run_shares(policy, locality)`` returns a run's ``host_share`` /
    ``direct_share`` / ``hot_share`` (seeded: the same locality gives the same shares)."""
    import math

    host_t = next(t for t in targets if t.fitted and t.policy == "hisparse")
    direct_t = next(t for t in targets if t.fitted and t.policy == "adaptive")
    cache: dict[tuple[str, float, float], dict[str, float]] = {}

    def shares(policy: str, model: LocalityModel) -> dict[str, float]:
        key = (policy, round(model.overlap, 6), round(model.recent_fraction, 6))
        if key not in cache:
            cache[key] = run_shares(policy, model)
        return cache[key]

    loc = base
    for _ in range(rounds):
        here = loc
        ov = _root(lambda x, at=here: math.log(max(1e-6, shares("hisparse", dataclasses.replace(at, overlap=x))[
            "host_share"])) - math.log(host_t.value), *overlap_bracket, iters, tol / max(host_t.value, 1e-6))
        here = loc = dataclasses.replace(loc, overlap=ov)
        rf = _root(lambda x, at=here: shares("adaptive", dataclasses.replace(at, recent_fraction=x))["direct_share"]
                   - direct_t.value, *recent_bracket, iters, tol)
        loc = dataclasses.replace(loc, recent_fraction=rf)
    rows: list[dict[str, float | str]] = []
    for t in targets:
        got = shares(t.policy, loc)[t.share]
        rows.append({"target": t.name, "published": t.value, "planner": got, "residual": got - t.value,
                     "role": "fitted" if t.fitted else "predicted", "source": t.source})
    return PublishedFit(loc.overlap, loc.recent_fraction, rows)

"""The synthetic selection model's verification semantics (issue 28, point 2): a selection belongs to a position; a
position verified again keeps it; the next step is anchored on the last accepted position; consecutive queries of
one step follow the same per-token overlap as consecutive steps."""

from __future__ import annotations

import torch

from dhisparse_planner.locality import LocalityModel, SyntheticSelector

TOPK, HISTORY = 64, 20_000


def _selector(overlap: float, seed: int = 0) -> SyntheticSelector:
    return SyntheticSelector(LocalityModel(overlap=overlap, recent_fraction=0.2), TOPK, 2, 1, seed)


def _kept(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of ``b``'s positions that are in ``a`` (per row, averaged); both ``[..., K]``."""
    hits = (b.unsqueeze(-1) == a.unsqueeze(-2)).any(-1) & (b >= 0)
    return float(hits.float().mean())


def test_a_position_verified_again_keeps_its_selection() -> None:
    sel = _selector(0.7)
    ids = ["a", "b", "c"]
    starts = torch.tensor([HISTORY, HISTORY + 5, HISTORY + 9])
    q = torch.tensor([5, 5, 3])
    first = sel.select(ids, starts, q, 5)
    accepted = torch.tensor([2, 5, 1])  # a: 3 drafts rejected; b: all accepted; c: 2 rejected
    second = sel.select(ids, starts + accepted, torch.tensor([5, 5, 5]), 5)
    for group in range(2):
        assert torch.equal(second[group][0, :3], first[group][0, 2:5])  # a: positions +2 .. +4 again
        assert torch.equal(second[group][2, :2], first[group][2, 1:3])  # c: positions +1 .. +2 again
        # b: every draft accepted, so nothing is re-verified: its first query is a new position anchored on the
        # last one verified (kept with the per-token overlap, not drawn afresh)
        assert _kept(first[group][1, 4], second[group][1, 0]) > 0.4


def test_the_next_step_is_anchored_on_the_last_accepted_position_not_a_rejected_draft() -> None:
    """After a rejection the next step's first query is the position after the last accepted one: it is the
    stored selection of that position (a query of the previous step), not a fresh draw near the last query's."""
    sel = _selector(0.5, seed=3)
    first = sel.select(["r"], torch.tensor([HISTORY]), torch.tensor([6]), 6)[0]
    second = sel.select(["r"], torch.tensor([HISTORY + 1]), torch.tensor([6]), 6)[0]
    assert torch.equal(second[0, 0], first[0, 1])
    assert _kept(first[0, 5], second[0, 0]) < _kept(first[0, 1], second[0, 0])


def test_consecutive_queries_follow_the_per_token_overlap() -> None:
    """Within one verification step the share kept from query j to j + 1 is the per-token overlap, as from one
    decode step to the next."""
    overlap = 0.8
    sel = _selector(overlap, seed=5)
    ids = [f"r{i}" for i in range(64)]
    starts = torch.full((64,), HISTORY)
    out = sel.select(ids, starts, torch.full((64,), 5), 5)[0]
    within = [_kept(out[:, j], out[:, j + 1]) for j in range(4)]
    plain = _selector(overlap, seed=6)
    steps = [plain.select(ids, starts + i, torch.ones(64, dtype=torch.int64), 1)[0][:, 0] for i in range(5)]
    across = [_kept(steps[i], steps[i + 1]) for i in range(4)]
    for value in within + across:
        assert abs(value - overlap) < 0.03, (within, across)

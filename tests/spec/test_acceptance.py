"""The acceptance rules: greedy equals plain greedy; rejection sampling is lossless (empirical check)."""

from __future__ import annotations

import torch

from dhisparse.sampling.sampler import uniform
from dhisparse.spec.acceptance import greedy_accept, rejection_accept
from dhisparse.spec.ring import DraftRing


def test_greedy_accept_takes_matching_prefix_and_bonus():
    logits = torch.full((3, 4, 10), -1.0)
    best = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 1, 2]])
    logits.scatter_(2, best.unsqueeze(-1), 5.0)
    draft = torch.tensor([[1, 2, 3], [5, 0, 7], [1, 0, 1]])
    lengths = torch.tensor([3, 3, 3])
    accepted, nxt = greedy_accept(logits, draft, lengths)
    assert accepted.tolist() == [3, 1, 0] and nxt.tolist() == [4, 6, 9]
    accepted, nxt = greedy_accept(logits, draft, torch.tensor([2, 3, 3]))  # verification shortened to 2 drafts
    assert accepted.tolist() == [2, 1, 0] and nxt.tolist() == [3, 6, 9]


def _empirical_first_token(p, q, n, seed):
    """Emit the first token of a speculative step n times: drafts drawn from q, then rejection_accept."""
    g, v = q.shape[0], q.shape[1]
    counters = torch.arange(n, dtype=torch.int64)
    seeds = torch.full((n,), seed, dtype=torch.int64)
    cdf = q.cumsum(-1)
    drafts = torch.stack([torch.searchsorted(cdf[i].expand(n, v).contiguous(),
                                             uniform(seeds, counters, stream=10 + i).unsqueeze(-1).to(cdf.dtype),
                                             right=True).squeeze(-1).clamp(max=v - 1) for i in range(g)], dim=1)
    u_acc = torch.stack([uniform(seeds, counters, stream=20 + i) for i in range(g)], dim=1)
    accepted, nxt = rejection_accept(p.expand(n, -1, -1), drafts, q.expand(n, -1, -1), torch.full((n,), g),
                                     u_acc, uniform(seeds, counters, stream=30))
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    return torch.bincount(first, minlength=v).double() / n, accepted


def test_rejection_sampling_is_lossless():
    """With q != p the first emitted token must still follow p_0 exactly. Bound: total variation < 0.02 for
    200k draws over 8 outcomes (expected TV ≈ 0.003; a biased rule — e.g. always accepting — gives TV ≈ 0.3)."""
    torch.manual_seed(0)
    v, g, n = 8, 3, 200_000
    p = torch.softmax(torch.randn(g + 1, v, dtype=torch.float64) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(g, v, dtype=torch.float64) * 1.5, dim=-1)
    freq, accepted = _empirical_first_token(p, q, n, seed=1)
    assert (freq - p[0]).abs().sum().item() / 2 < 0.02
    # acceptance rate of the first draft matches theory: sum_x min(p, q)
    rate = (accepted > 0).double().mean().item()
    assert abs(rate - torch.minimum(p[0], q[0]).sum().item()) < 0.01
    # a point-mass proposal (the engine's greedy drafters) is lossless too
    point = torch.zeros(g, v, dtype=torch.float64)
    point[:, 3] = 1.0
    freq, _ = _empirical_first_token(p, point, n, seed=2)
    assert (freq - p[0]).abs().sum().item() / 2 < 0.02


def test_ring_keeps_only_the_window():
    ring = DraftRing(slots=2, window=3, row_values=1, dtype=torch.float32, device=torch.device("cpu"))
    a, b = ring.allocate(), ring.allocate()
    slots = torch.tensor([a, b])
    ring.append(slots, torch.arange(8, dtype=torch.float32).view(2, 4, 1), torch.tensor([4, 1]))
    rows, mask = ring.context(slots)
    assert rows[0, :, 0].tolist() == [1.0, 2.0, 3.0] and mask[0].all()
    assert rows[1, :, 0].tolist() == [0.0, 0.0, 4.0] and mask[1].tolist() == [False, False, True]
    ring.append(slots, torch.tensor([[[10.0], [11.0]], [[20.0], [21.0]]]), torch.tensor([2, 2]))
    rows, mask = ring.context(slots)
    assert rows[0, :, 0].tolist() == [3.0, 10.0, 11.0]
    assert rows[1, :, 0].tolist() == [4.0, 20.0, 21.0] and mask[1].all()
    assert ring.rows.shape == (2, 3 + 1, 1)  # the window per request, and one row that takes discarded writes
    assert ring.bytes_per_request == (3 + 1) * 4  # what the slot holds on the device

"""Sampled proposals of the published drafters carry the law they were drawn from, which verification needs to keep
the target's distribution (``rejection_accept``; its exactness is ``test_acceptance.py`` and, end to end,
``test_spec_sampling.py``).

With the reference fixture checkpoints, at temperature ``T``: every draft token is the inverse-CDF draw of its ``q``
with the engine's uniform; ``q`` is ``softmax(scores / T)`` of the scores along the sampled path (DSpark: its Markov
head conditioned on the previous *sampled* draft; DFlash2: the selector row of the previously *sampled* candidate,
``q`` zero outside the candidates); greedy rows of the same batch keep the greedy proposal.
"""

from __future__ import annotations

import pytest
import torch
from test_published_fixtures import CASES, _setup

from dhisparse.sampling.sampler import uniform


def _batch(spec, target, meta, rows: int):
    """One context (the first sequence's prompt) replicated over ``rows`` requests."""
    published = spec.published
    slot = spec.start(target["features"][0, :meta["prompts"][0]])
    ctx = published.context(torch.tensor([slot]))
    ctx = type(ctx)(*(t.expand(rows, *t.shape[1:]) for t in ctx))
    last = target["tokens"][0, meta["prompts"][0]].expand(rows)
    return published.drafter, ctx, last


@pytest.mark.parametrize("case", CASES)
def test_sampled_drafts_are_drawn_from_their_q(case):
    meta, target, _, spec = _setup(case)
    rows, temperature = 256, 0.8
    drafter, ctx, last = _batch(spec, target, meta, rows)
    t = torch.full((rows,), temperature, dtype=torch.float64)
    t[0] = 0.0  # one greedy row in the batch
    steps = torch.arange(rows).unsqueeze(1) * 8 + torch.arange(spec.gamma)
    u = uniform(torch.full_like(steps, 1234), steps, stream=3)
    out = drafter.propose(ctx, last, spec.gamma, t, u)
    greedy = drafter.propose(type(ctx)(*(x[:1] for x in ctx)), last[:1], spec.gamma, t[:1], u[:1])
    assert torch.equal(out.tokens[0], greedy.tokens[0])
    q = out.q[1:]
    torch.testing.assert_close(q.sum(-1), torch.ones_like(q[..., 0]))
    law = torch.softmax(out.scores[1:] / temperature, dim=-1)
    torch.testing.assert_close(q, law, atol=1e-9, rtol=0)
    cdf = q.cumsum(-1)
    tok = out.tokens[1:]
    upper = cdf.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    lower = upper - q.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    uu = u[1:] * cdf[..., -1]
    assert bool(((lower <= uu + 1e-12) & (uu < upper + 1e-12)).all())  # the inverse-CDF draw of q with u
    assert len(set(out.tokens[1:, 0].tolist())) > 1  # really sampled


@pytest.mark.skipif("dflash2" not in CASES, reason="no DFlash2 fixture")
def test_dflash2_walk_follows_the_sampled_candidate():
    meta, target, _, spec = _setup("dflash2")
    rows = 64
    drafter, ctx, last = _batch(spec, target, meta, rows)
    t = torch.ones(rows, dtype=torch.float64)
    steps = torch.arange(rows).unsqueeze(1) * 8 + torch.arange(spec.gamma)
    out = drafter.propose(ctx, last, spec.gamma, t, uniform(torch.full_like(steps, 99), steps, stream=3))
    h = drafter.hidden(ctx, last, spec.gamma)
    ids, scores = drafter.edge_scores(h, torch.nn.functional.linear(h, drafter.lm_head), last)
    previous = torch.zeros(rows, dtype=torch.int64)
    for s in range(spec.gamma):
        row = scores[torch.arange(rows), s, previous]
        want = torch.full((rows, drafter.embed.shape[0]), float("-inf"), dtype=row.dtype)
        want.scatter_(1, ids[:, s], row)
        torch.testing.assert_close(out.scores[:, s], want.double())
        assert bool((out.q[:, s].gather(1, ids[:, s]).sum(-1) > 1 - 1e-9).all())  # q lives on the candidates
        previous = (ids[:, s] == out.tokens[:, s].unsqueeze(1)).long().argmax(-1)

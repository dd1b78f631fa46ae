"""The switches scripts/planner_ablation.py reverts issue 28's fixes with: each restores the former behaviour, and
left at its default changes nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dhisparse_planner import paper
from dhisparse_planner.locality import CALIBRATED, LocalityModel, SyntheticSelector
from dhisparse_planner.scale import ScaleSpec, build_scaled_kv, byte_factor
from dhisparse_planner.specs import GLM5_INDEXSHARE_NVFP4, H200
from dhisparse_planner.speculation import DecayingAlpha, SpeculationModel

TOPK, HISTORY = 64, 20_000


def test_the_pre_fix_selector_draws_re_verified_positions_again_and_anchors_on_the_last_query() -> None:
    sel = SyntheticSelector(LocalityModel(overlap=0.5, recent_fraction=0.2, query_overlap=0.5), TOPK, 1, 1, 3)
    first = sel.select(["r"], torch.tensor([HISTORY]), torch.tensor([6]), 6)[0]
    second = sel.select(["r"], torch.tensor([HISTORY + 1]), torch.tensor([6]), 6)[0]
    assert not torch.equal(second[0, 0], first[0, 1])  # position +1 verified again: drawn anew
    kept_last = float((second[0, 0].unsqueeze(-1) == first[0, 5].unsqueeze(-2)).any(-1).float().mean())
    assert kept_last > 0.35  # anchored on the last query of the step (a rejected draft's), overlap 0.5


def test_the_pre_fix_selector_keeps_query_overlap_between_queries() -> None:
    sel = SyntheticSelector(LocalityModel(overlap=0.6, recent_fraction=0.2, query_overlap=0.95), TOPK, 1, 1, 5)
    out = sel.select([f"r{i}" for i in range(64)], torch.full((64,), HISTORY), torch.full((64,), 5), 5)[0]
    kept = (out[:, 1].unsqueeze(-1) == out[:, 0].unsqueeze(-2)).any(-1).float().mean()
    assert abs(float(kept) - 0.95) < 0.03


def test_query_overlap_left_unset_changes_nothing() -> None:
    a = SyntheticSelector(LocalityModel(overlap=0.7), TOPK, 2, 1, 1)
    b = SyntheticSelector(dataclasses.replace(LocalityModel(overlap=0.7), query_overlap=None), TOPK, 2, 1, 1)
    for step in range(3):
        x = a.select(["r"], torch.tensor([HISTORY + 3 * step]), torch.tensor([4]), 4)
        y = b.select(["r"], torch.tensor([HISTORY + 3 * step]), torch.tensor([4]), 4)
        assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
    with pytest.raises(ValueError, match="query_overlap"):
        LocalityModel(query_overlap=1.5)


def test_the_unsourced_acceptance_rule_gives_the_issues_figure() -> None:
    """Issue 28, point 4: gamma 4 with alpha = 0.75 - 0.03 per doubling gives 2.35 tokens per step at 100K."""
    old = SpeculationModel(gamma=4, unsourced_alpha=DecayingAlpha())
    alpha = old.accept_prob_at(torch.tensor([4096, 102400, 10**9]))
    assert alpha.tolist() == pytest.approx([0.75, 0.75 - 0.03 * torch.log2(torch.tensor(25.0)).item(), 0.3])
    assert float(old.mean_accepted(torch.tensor([102400]))[0]) == pytest.approx(2.35, abs=0.01)
    assert SpeculationModel().unsourced_alpha is None
    with pytest.raises(ValueError, match="DecayingAlpha"):
        DecayingAlpha(at_ref=1.0)


def test_byte_factor_is_the_scaled_kvs() -> None:
    scale = ScaleSpec(token_scale=64)
    kvs = build_scaled_kv(GLM5_INDEXSHARE_NVFP4, scale, "adaptive", 70e9, 4096, 64, 0, 0, 1)
    assert byte_factor(GLM5_INDEXSHARE_NVFP4, scale) == kvs.byte_factor


def test_a_sweep_with_its_defaults_is_the_paper_scenario_and_its_fields_reach_the_runs() -> None:
    s = paper.Sweep(32768, ("hisparse", "adaptive+dflash2"), (8,), CALIBRATED)
    assert s.grid() == paper.glm_grid(32768, (8,), (CALIBRATED.overlap,), s.configs, CALIBRATED)
    changed = dataclasses.replace(s, hw=dataclasses.replace(H200, host_bytes_per_gpu=1e12), admission=(),
                                  requests_per_client=1,
                                  speculation=dataclasses.replace(paper.SPEC, gamma=4))
    jobs = changed.jobs()
    assert {j.hw.host_bytes_per_gpu for j in jobs} == {1e12}
    assert all(j.serving.admission is None and j.workload.num_requests == 8 for j in jobs)
    assert [j.serving.speculation.gamma for j in jobs if j.serving.speculation] == [4]

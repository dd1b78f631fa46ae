"""The HiSparse validation's setup: the pool and the one absolute anchor come from the PR's own statements."""

from __future__ import annotations

from dhisparse_planner import ScaleSpec, ServingSpec, WorkloadSpec, simulate
from dhisparse_planner.validation import (
    BASELINE_RUNNING,
    BASELINE_TOK_S,
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    hisparse_capacity,
    steady_decode_tok_per_s,
    validation_setup,
)


def test_baseline_is_pinned_at_six_and_anchored_at_batch_one() -> None:
    hw, model = validation_setup()
    scale = ScaleSpec(token_scale=64)
    one = simulate(hw, model, ServingSpec(policy="resident"), WorkloadSpec(INPUT_TOKENS, OUTPUT_TOKENS, 1, 1), scale)
    assert abs(steady_decode_tok_per_s(one) / BASELINE_TOK_S[0] - 1) < 0.02
    eight = simulate(hw, model, ServingSpec(policy="resident"), WorkloadSpec(INPUT_TOKENS, OUTPUT_TOKENS, 8, 8),
                     scale)
    assert eight.max_batch == BASELINE_RUNNING  # the 7th request waits, as in the PR
    assert BASELINE_RUNNING < hisparse_capacity(model, hw) < 54

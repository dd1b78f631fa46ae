"""Speculative output stays identical to plain output with every logit-processing feature on (the verifier
processes each window position with the history the plain path would have)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import build_spec_engine, random_prompts

from dhisparse import LLM, SamplingParams

FEATURES = {
    "repetition": dict(repetition_penalty=1.8),
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=0.7),
    "bad_words": dict(bad_words=((84,), (4, 8), (11, 12, 13))),
    "min_tokens": dict(min_tokens=6, stop_token_ids=(84, 8)),
    "bias": dict(logit_bias={5: 4.0, 9: 3.0, 30: -2.0}),
}


@pytest.fixture(scope="module")
def spec_engine(tiny_checkpoint, tmp_path_factory) -> Path:
    return build_spec_engine(tmp_path_factory.mktemp("spec_processing"), tiny_checkpoint("glm_fsfs_sparse"))


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_speculative_equals_plain_with_each_processing_feature(spec_engine, kind):
    prompts = random_prompts([9, 30], 96, seed=4)
    prompts[1][-2:] = [11, 12]
    plain = LLM(spec_engine, kv_policy="dense")
    spec = LLM(spec_engine, kv_policy="adaptive", speculative=kind, num_draft_tokens=4, page_rows=8)
    for name, feature in FEATURES.items():
        params = SamplingParams(max_tokens=12, logprobs=True, **feature)
        expected = plain.generate(prompts, params)
        outs = spec.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in expected], name
        for got, want in zip(outs, expected, strict=True):  # the same tokens at the same logits
            assert torch.allclose(torch.tensor(got.log_probs), torch.tensor(want.log_probs), atol=1e-9), name


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_sampled_speculation_respects_bans(spec_engine, kind):
    """Rejection sampling against the processed target law: a banned token (p = 0) is never accepted."""
    prompts = random_prompts([9, 30, 5], 96, seed=6)
    spec = LLM(spec_engine, kv_policy="dense", speculative=kind, num_draft_tokens=4)
    banned = tuple((t,) for t in range(0, 96, 2))  # every even token
    params = SamplingParams(max_tokens=16, temperature=1.5, seed=2, bad_words=banned, ignore_eos=True)
    for out in spec.generate(prompts, params):
        assert all(t % 2 == 1 for t in out.token_ids), out.token_ids
    assert spec.stats()["verify_steps"] > 0

"""Speculation on DeepSeek-V4 never changes greedy output: both drafters × dense, hisparse and tight adaptive
(resident runs the same hierarchy code path with every page on the device).

Random-init drafters of both kinds (low acceptance: most steps exercise rejection and the bonus token; the
partial-acceptance path over the hierarchy is covered in ``tests/kv/test_deepseek_v4_hierarchy.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import build_spec_engine, random_prompts
from tiny_v4 import make_v4_checkpoint

from dhisparse import LLM, SamplingParams

PROMPTS = random_prompts([1, 13, 30, 45, 7], 97, seed=11)
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def v4_spec_engine(tiny_root, tmp_path_factory) -> Path:
    return build_spec_engine(tmp_path_factory.mktemp("v4spec"), make_v4_checkpoint(tiny_root, "v4_small_topk"),
                             vocab_size=97, target_hidden_size=32)


@pytest.fixture(scope="module")
def plain_tokens(v4_spec_engine) -> list[list[int]]:
    return [o.token_ids for o in LLM(v4_spec_engine, max_batch_size=8).generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
@pytest.mark.parametrize("policy, extra", [("dense", {}), ("hisparse", {"pool_bytes": 1 << 22, "page_rows": 4}),
                                           ("adaptive", {"pool_bytes": 250_000, "page_rows": 4})])
def test_speculative_greedy_equals_plain_greedy(v4_spec_engine, plain_tokens, kind, policy, extra):
    llm = LLM(v4_spec_engine, kv_policy=policy, speculative=kind, num_draft_tokens=4, max_batch_size=8, **extra)
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == plain_tokens
    stats = llm.stats()
    assert stats["verify_steps"] > 0 and stats["draft_tokens_proposed"] > 0
    if policy == "adaptive":
        assert stats["kv_admissions_waited"] > 0

"""Speculation on DeepSeek-V4 never changes greedy output: both drafters × dense, hisparse and tight adaptive
(resident runs the same hierarchy code path with every page on the device).

Random-init drafters of both kinds (low acceptance: most steps exercise rejection and the bonus token; the
partial-acceptance path over the hierarchy is covered in ``tests/kv/test_deepseek_v4_hierarchy.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import random_prompts
from tiny_v4 import make_v4_checkpoint

from dhisparse import LLM, SamplingParams
from dhisparse.spec.drafters import DFlash2Config, DFlash2Drafter, DSparkConfig, DSparkDrafter, save_drafter
from dhisparse_builder import BuildOptions, build_engine

PROMPTS = random_prompts([1, 13, 30, 45, 7], 97, seed=11)
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def v4_spec_engine(tiny_root, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("v4spec")
    torch.manual_seed(0)
    common = dict(vocab_size=97, target_hidden_size=32, hidden_size=32, num_layers=1, num_heads=2,
                  intermediate_size=64, max_block=8)
    save_drafter(DFlash2Drafter(DFlash2Config(target_layer_ids=(1, 3), window=16, **common)), root / "dflash2")
    save_drafter(DSparkDrafter(DSparkConfig(target_layer_ids=(3,), markov_rank=4, confidence_hidden=16, **common)),
                 root / "dspark")
    return build_engine(BuildOptions(make_v4_checkpoint(tiny_root, "v4_small_topk"), root / "engine",
                                     {"dtype": "float64"}, drafters=(root / "dflash2", root / "dspark")),
                        progress=lambda d, t: None)


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

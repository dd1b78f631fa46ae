"""Published drafters end to end: packed by ``dhisparse-build``, loaded by ``LLM``, proposing over the KV hierarchy
and verified by the target — greedy output equal to the target alone under every KV policy, on GLM-style and
DeepSeek-V3.2-style targets (z-lab DFlash, DFlash2 with a sliding window that the ring wraps, DeepSpec's Qwen3
DSpark) and on DeepSeek-V4 (its ``mtp.*`` DSpark stages). Acceptance per verification step is reported in stats.

The drafters are random (their acceptance is low: most steps exercise rejection and the bonus token); the
reference fixtures (``test_published_fixtures.py``) pin the proposals, partial acceptances included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from published_drafters import add_v4_dspark, qwen_drafter_config, write_qwen_drafter
from tiny_models import random_prompts
from tiny_v4 import make_v4_checkpoint

from dhisparse import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
FAMILIES = ("dflash", "dflash2", "dspark")


def _drafters(root: Path, hidden: int, vocab: int, layers: int) -> tuple[Path, ...]:
    out = []
    for fmt in FAMILIES:
        extra = dict(layer_types=["sliding_attention"] * 2, sliding_window=12) if fmt == "dflash2" else {}
        cfg = qwen_drafter_config(fmt, hidden=hidden, vocab=vocab, target_layers=layers, layer_ids=[0, layers - 2],
                                  **extra)
        out.append(write_qwen_drafter(root / fmt, cfg, hidden, seed=len(out)))
    return tuple(out)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    from dhisparse_builder import BuildOptions, build_engine

    root = tmp_path_factory.mktemp("published")
    out = {}
    for name in ("glm_fsfs_sparse", "dsv32_sparse_yarn"):
        drafters = _drafters(root / name, 64, 96, 4)
        out[name] = build_engine(BuildOptions(tiny_checkpoint(name), root / name / "engine", {"dtype": "float64"},
                                              drafters=drafters), progress=lambda d, t: None)
    return out


@pytest.fixture(scope="module")
def plain(engines) -> dict[str, list[list[int]]]:
    prompts = random_prompts([7, 23, 50], 96, seed=3)
    return {name: [o.token_ids for o in LLM(e, kv_policy="dense").generate(prompts, PARAMS)]
            for name, e in engines.items()}


def _check(llm: LLM, prompts: list[list[int]], want: list[list[int]]) -> dict[str, float]:
    outs = llm.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == want
    stats = llm.stats()
    assert stats["verify_steps"] > 0 and stats["draft_tokens_proposed"] > 0
    assert stats["tokens_per_verify_step"] >= 1.0  # accepted drafts + the bonus token, per verification step
    assert 0.0 <= stats["draft_acceptance_rate"] <= 1.0
    assert all(o.stats["verify_steps"] > 0 for o in outs)
    return stats


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["dense", "resident", "hisparse", "adaptive"])
def test_glm_target_greedy_equals_the_target_alone(engines, plain, family, policy):
    kwargs = dict(kv_policy=policy, speculative=family, num_draft_tokens=4, page_rows=8, max_batch_size=4)
    if policy != "dense":
        kwargs["pool_bytes"] = 1 << 26
    llm = LLM(engines["glm_fsfs_sparse"], **kwargs)
    stats = _check(llm, random_prompts([7, 23, 50], 96, seed=3), plain["glm_fsfs_sparse"])
    spec = llm.engine.spec
    assert spec is not None and spec.published is not None
    window = 11 if family == "dflash2" else llm.engine.model.cfg.max_position_embeddings  # SWA 12, else whole history
    assert spec.published.window == window
    assert stats["spec_ring_bytes_per_request"] == (window + 1) * spec.drafter.row_values * 8
    if policy != "dense":
        llm.engine.kv.check_invariants()


@pytest.mark.parametrize("family", FAMILIES)
def test_deepseek_v32_target_greedy_equals_the_target_alone(engines, plain, family):
    llm = LLM(engines["dsv32_sparse_yarn"], kv_policy="adaptive", speculative=family, num_draft_tokens=3,
              page_rows=8, max_batch_size=4, pool_bytes=1 << 26)
    _check(llm, random_prompts([7, 23, 50], 96, seed=3), plain["dsv32_sparse_yarn"])


@pytest.fixture(scope="module")
def v4_engine(tiny_root, tmp_path_factory) -> Path:
    from dhisparse_builder import BuildOptions, build_engine

    root = tmp_path_factory.mktemp("v4dspark")
    checkpoint = add_v4_dspark(make_v4_checkpoint(tiny_root, "v4_small_topk"), root / "v4_dspark")
    return build_engine(BuildOptions(checkpoint, root / "engine", {"dtype": "float64"}, drafters=(checkpoint,)),
                        progress=lambda d, t: None)


V4_PROMPTS = random_prompts([1, 13, 30, 45, 7], 97, seed=11)


@pytest.fixture(scope="module")
def v4_plain(v4_engine) -> list[list[int]]:
    return [o.token_ids for o in LLM(v4_engine, max_batch_size=8).generate(V4_PROMPTS, PARAMS)]


@pytest.mark.parametrize("policy, extra", [("dense", {}), ("resident", {"pool_bytes": 1 << 22, "page_rows": 4}),
                                           ("hisparse", {"pool_bytes": 1 << 22, "page_rows": 4}),
                                           ("adaptive", {"pool_bytes": 250_000, "page_rows": 4})])
def test_deepseek_v4_dspark_stages_greedy_equal_the_target_alone(v4_engine, v4_plain, policy, extra):
    llm = LLM(v4_engine, kv_policy=policy, speculative="dspark", num_draft_tokens=5, max_batch_size=8,
              dspark_busy_batch=4, **extra)
    stats = _check(llm, V4_PROMPTS, v4_plain)
    spec = llm.engine.spec
    assert spec is not None and spec.published is not None
    assert spec.drafter.fmt == "dspark-v4" and spec.published.window == 8  # the config's sliding_window
    if policy == "adaptive":
        assert stats["kv_admissions_waited"] > 0  # the tight pool runs the requests one or two at a time
    else:
        assert stats["draft_tokens_shortened"] > 0  # batches of >= 4 are busy: the confidence cut shortens

"""Speculation never changes greedy output: both drafters × every KV policy × tight and generous budgets.

The drafters here are small random-init models of the two kinds (their acceptance is low, so most verification
steps exercise rejection and the bonus token); the demo pair's tests exercise high acceptance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import random_prompts

from dhisparse import LLM, SamplingParams
from dhisparse.spec.drafters import DFlash2Config, DFlash2Drafter, DSparkConfig, DSparkDrafter, save_drafter
from dhisparse_builder import BuildOptions, build_engine

PROMPT_LENGTHS = [7, 23, 50, 97]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def spec_engine(tiny_checkpoint, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("spec")
    torch.manual_seed(0)
    common = dict(vocab_size=96, target_hidden_size=64, hidden_size=32, num_layers=1, num_heads=2,
                  intermediate_size=64, max_block=8)
    save_drafter(DFlash2Drafter(DFlash2Config(target_layer_ids=(1, 3), window=16, **common)), root / "dflash2")
    save_drafter(DSparkDrafter(DSparkConfig(target_layer_ids=(3,), markov_rank=4, confidence_hidden=16, **common)),
                 root / "dspark")
    return build_engine(BuildOptions(tiny_checkpoint("glm_fsfs_sparse"), root / "engine", {"dtype": "float64"},
                                     drafters=(root / "dflash2", root / "dspark")), progress=lambda d, t: None)


@pytest.fixture(scope="module")
def reference_tokens(spec_engine) -> list[list[int]]:
    prompts = random_prompts(PROMPT_LENGTHS, 96, seed=21)
    llm = LLM(spec_engine, kv_policy="dense")
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))]


def _smallest_pool(llm_kwargs: dict, spec_engine: Path) -> int:
    """The pool that admits exactly one of the longest requests (required memory of one request + 1 page)."""
    llm = LLM(spec_engine, **llm_kwargs, pool_bytes=1 << 30)
    need = llm.engine.kv.required_bytes(max(PROMPT_LENGTHS), NEW_TOKENS)
    return need + 2 * llm.engine.model.cfg.row_dim * 8 * 4 * llm.config.page_rows


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
@pytest.mark.parametrize("policy", ["dense", "resident", "hisparse", "adaptive"])
@pytest.mark.parametrize("budget", ["generous", "tight"])
def test_speculative_greedy_equals_plain_greedy(spec_engine, reference_tokens, kind, policy, budget):
    if policy == "dense" and budget == "tight":
        pytest.skip("the dense reference store has no budget")
    kwargs = dict(kv_policy=policy, speculative=kind, num_draft_tokens=4, page_rows=8, max_batch_size=4,
                  dspark_busy_batch=2)
    if policy != "dense":
        kwargs["pool_bytes"] = (1 << 26) if budget == "generous" else _smallest_pool(kwargs, spec_engine)
    llm = LLM(spec_engine, **kwargs)
    prompts = random_prompts(PROMPT_LENGTHS, 96, seed=21)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference_tokens
    stats = llm.stats()
    assert stats["verify_steps"] > 0
    assert stats["spec_ring_bytes_per_request"] > 0 and stats["spec_staging_bytes_per_request"] > 0
    if kind == "dspark" and budget == "generous":
        assert stats["draft_tokens_shortened"] > 0  # batches of >= 2 are busy: load-aware shortening is active
    if policy != "dense":
        llm.engine.kv.check_invariants()
        assert stats["kv_requests_running"] == 0


def test_staging_does_not_grow_with_layers(spec_engine):
    llm = LLM(spec_engine, kv_policy="dense", speculative="dflash2", num_draft_tokens=3)
    staging = llm.engine.staging
    cfg = llm.engine.model.cfg
    longest_group = max(len(g) for g in cfg.index_groups)
    assert staging.buffer.shape[0] == longest_group < cfg.num_hidden_layers
    before = staging.uses
    llm.generate(random_prompts([30], 96, seed=2), SamplingParams(max_tokens=6, ignore_eos=True))
    assert staging.uses > before  # verification really gathers through it


def test_missing_drafter_is_a_clear_error(tiny_engine):
    from dhisparse.errors import ConfigError

    with pytest.raises(ConfigError, match="needs a drafter"):
        LLM(tiny_engine("glm_fsfs_sparse"), speculative="dflash2")


def test_speculative_memory_is_required_memory(spec_engine):
    plain = LLM(spec_engine, kv_policy="adaptive", page_rows=8, hot_rows=8 * 5)  # index_topk 8, 1 + gamma = 5
    spec = LLM(spec_engine, kv_policy="adaptive", page_rows=8, speculative="dflash2", num_draft_tokens=4)
    extra = spec.engine.spec_bytes_per_request
    assert extra == spec.stats()["spec_ring_bytes_per_request"] + spec.stats()["spec_staging_bytes_per_request"]
    # same B (index_topk x 5) and query length: the only difference is the speculative state
    assert spec.engine.kv.config.hot_rows == plain.engine.kv.config.hot_rows
    assert spec.engine.kv.required_bytes(50, 10) - plain.engine.kv.required_bytes(50, 10) >= extra
    spec.generate(random_prompts([40], 96, seed=3), SamplingParams(max_tokens=5, ignore_eos=True))
    spec.engine.kv.poll()
    assert spec.engine.kv.stats()["kv_required_bytes"] == 0  # everything released, ring slot included
    assert len(spec.engine.spec.ring.free) == spec.config.max_batch_size


@pytest.mark.parametrize("kind,reads", [("dflash2", 1), ("dspark", 2)])
def test_verification_step_reads_the_host_a_constant_number_of_times(spec_engine, kind, reads):
    """One host read per verification step (acceptance, next tokens and the KV report together); DSpark adds
    one before verifying (its confidence decides the verification length). Batch 1 and 4 alike."""
    seen = set()
    for batch in (1, 4):
        llm = LLM(spec_engine, kv_policy="hisparse", speculative=kind, num_draft_tokens=3, page_rows=8,
                  max_batch_size=4)
        engine = llm.engine
        for p in random_prompts([31, 22, 40, 27][:batch], 96, seed=4):
            engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True))
        engine.step()  # admissions, prefill and the first verification step
        while engine.has_unfinished():
            before = engine.kv.sync.reads
            engine.step()
            seen.add(engine.kv.sync.reads - before)
        assert llm.stats()["kv_rows_host"] > 0
    assert seen == {reads}

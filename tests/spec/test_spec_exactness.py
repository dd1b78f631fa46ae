"""Speculation never changes greedy output: both drafters × every KV policy × tight and generous budgets, and
γ = 1 … 8 with B = index_topk (the hot cache does not grow with γ) and tight pools, so that the rows of a
verification step that the hot cache cannot take go through verification staging on most steps.

The drafters here are small random-init models of the two kinds (their acceptance is low, so most verification
steps exercise rejection and the bonus token); the demo pair's tests exercise high acceptance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import build_spec_engine, random_prompts

from dhisparse import LLM, SamplingParams

PROMPT_LENGTHS = [7, 23, 50, 97]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def spec_engine(tiny_checkpoint, tmp_path_factory) -> Path:
    return build_spec_engine(tmp_path_factory.mktemp("spec"), tiny_checkpoint("glm_fsfs_sparse"))


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
    assert stats["spec_ring_bytes_per_request"] > 0
    # what each request is charged for its verification block's rows and (with a hot cache) its overflow rows
    assert (stats["spec_staging_bytes_per_request"] > 0) == (policy != "dense")
    if policy != "dense":
        overflow = llm.engine.kv.footprint(1, 1).staging_overflow_bytes
        assert (overflow > 0) == (policy in ("hisparse", "adaptive"))
    assert llm.engine.kv.config.hot_rows in (0, llm.engine.model.cfg.index_topk) if policy != "dense" else True
    if policy == "hisparse":
        assert stats["kv_rows_staged"] > 0  # B = index_topk: verification overflows into staging
    if kind == "dspark" and budget == "generous":
        assert stats["draft_tokens_shortened"] > 0  # batches of >= 2 are busy: load-aware shortening is active
    if policy != "dense":
        llm.engine.kv.check_invariants()
        assert stats["kv_requests_running"] == 0


GAMMA_PROMPTS = (3,)  # index into PROMPT_LENGTHS: the 97-token prompt (the pool leaves it 2 optional pages)
GAMMA_NEW_TOKENS = 8


@pytest.mark.parametrize("gamma", range(1, 9))
@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
@pytest.mark.parametrize("policy", ["resident", "hisparse", "adaptive"])
def test_every_gamma_with_fixed_hot_cache_and_tight_pool(spec_engine, reference_tokens, gamma, kind, policy):
    """B stays index_topk for every γ; the pool holds one request and two pages (tight): most rows come from the
    hot cache or host, and the verification block's union overflows into staging."""
    kwargs = dict(kv_policy=policy, speculative=kind, num_draft_tokens=gamma, page_rows=8, max_batch_size=2)
    llm = LLM(spec_engine, **kwargs, pool_bytes=_smallest_pool(kwargs, spec_engine))
    kv = llm.engine.kv
    assert kv.config.hot_rows_for(kv.layout) == (0 if policy == "resident" else llm.engine.model.cfg.index_topk)
    prompts = random_prompts(PROMPT_LENGTHS, 96, seed=21)
    outs = llm.generate([prompts[i] for i in GAMMA_PROMPTS],
                        SamplingParams(max_tokens=GAMMA_NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [reference_tokens[i][:GAMMA_NEW_TOKENS] for i in GAMMA_PROMPTS]
    stats = llm.stats()
    assert stats["verify_steps"] > 0
    if policy == "hisparse":
        assert stats["kv_rows_staged"] > 0
    kv.check_invariants()
    assert stats["kv_requests_running"] == 0


def test_staging_does_not_grow_with_layers(spec_engine):
    llm = LLM(spec_engine, kv_policy="hisparse", speculative="dflash2", num_draft_tokens=3, page_rows=8)
    kv = llm.engine.kv
    cfg = llm.engine.model.cfg
    fp = kv.footprint(30, 6)
    longest_group = max(len(g) for g in cfg.index_groups)
    assert fp.staging_slots == kv.layout.staging_slots == longest_group < cfg.num_hidden_layers
    assert fp.staging_rows == 4 * cfg.index_topk - cfg.index_topk  # (γ + 1) · index_topk − B
    assert fp.staging_pages == longest_group * -(-fp.staging_rows // 8)
    llm.generate(random_prompts([30], 96, seed=2), SamplingParams(max_tokens=6, ignore_eos=True))
    assert llm.stats()["kv_rows_staged"] > 0  # verification really reads through staging


def test_missing_drafter_is_a_clear_error(tiny_engine):
    from dhisparse.errors import ConfigError

    with pytest.raises(ConfigError, match="needs a drafter"):
        LLM(tiny_engine("glm_fsfs_sparse"), speculative="dflash2")


@pytest.mark.parametrize("policy", ["resident", "hisparse", "adaptive"])
def test_speculative_memory_is_exactly_ring_plus_staging(spec_engine, policy):
    plain = LLM(spec_engine, kv_policy=policy, page_rows=8)
    spec = LLM(spec_engine, kv_policy=policy, page_rows=8, speculative="dflash2", num_draft_tokens=4)
    ring = spec.engine.spec.ring_bytes_per_request
    assert spec.stats()["spec_ring_bytes_per_request"] == ring > 0
    # same B with and without a drafter
    assert spec.engine.kv.config.hot_rows_for(spec.engine.kv.layout) == \
        plain.engine.kv.config.hot_rows_for(plain.engine.kv.layout)
    for prompt, new in ((50, 10), (7, 33), (97, 40)):
        with_spec = spec.engine.kv.footprint(prompt, new)
        without = plain.engine.kv.footprint(prompt, new)
        assert without.speculative_bytes == 0
        assert with_spec.speculative_bytes == ring + with_spec.staging_bytes
        assert with_spec.required_bytes == without.required_bytes + ring + with_spec.staging_bytes
        assert spec.engine.kv.required_bytes(prompt, new) == with_spec.required_bytes
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

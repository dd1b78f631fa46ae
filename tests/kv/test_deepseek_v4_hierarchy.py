"""DeepSeek-V4 over the hierarchy: CSA compressed entries resolved like any selectable row, exact under every
policy and tight pools (the dense V4 store is the reference; it matches transformers in
``tests/model/test_deepseek_v4.py``), and shared KV sources resolved once per step."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_models import random_prompts
from tiny_v4 import make_v4_checkpoint

from dhisparse import LLM, SamplingParams
from dhisparse.kv.deepseek_v4 import V4HierarchyKVStore
from dhisparse.model.deepseek_v4.kv_state import V4StepKV

PROMPTS = random_prompts([1, 13, 30, 45, 7], 97, seed=11)
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)

POLICIES = {
    "resident": dict(kv_policy="resident", pool_bytes=1 << 22),
    "hisparse": dict(kv_policy="hisparse", pool_bytes=1 << 22, page_rows=4),
    "adaptive_roomy": dict(kv_policy="adaptive", pool_bytes=1 << 22, page_rows=4),
    "adaptive_tight": dict(kv_policy="adaptive", pool_bytes=250_000, page_rows=4),
}


@pytest.fixture(scope="module")
def v4_engine(tiny_root):
    from dhisparse_builder import BuildOptions, build_engine

    def make(name: str, config_changes: dict | None = None):
        suffix = "-".join(sorted(config_changes)) if config_changes else "plain"
        out = tiny_root / f"engine-v4-{name}-{suffix}"
        if out.exists():
            return out
        src = make_v4_checkpoint(tiny_root, name)
        if config_changes:
            edited = tiny_root / f"ckpt-v4-{name}-{suffix}"
            shutil.rmtree(edited, ignore_errors=True)
            shutil.copytree(src, edited)
            raw = json.loads((edited / "config.json").read_text())
            (edited / "config.json").write_text(json.dumps({**raw, **config_changes}))
            src = edited
        return build_engine(BuildOptions(src, out, {"dtype": "float64"}), progress=lambda d, t: None)

    return make


@pytest.fixture(scope="module")
def dense_tokens(v4_engine):
    llm = LLM(v4_engine("v4_small_topk"), max_batch_size=8)
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_matches_the_dense_store(policy, v4_engine, dense_tokens):
    llm = LLM(v4_engine("v4_small_topk"), max_batch_size=8, **POLICIES[policy])
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == dense_tokens
    kv = llm.engine.kv
    assert isinstance(kv, V4HierarchyKVStore)
    kv.check_invariants()
    stats = llm.stats()
    assert stats["kv_resolved_rows"] > 0
    if policy == "hisparse":
        assert stats["kv_host_fetched_rows"] > 0  # selections really went to the host store
    if policy == "adaptive_tight":
        assert stats["kv_admissions_waited"] > 0  # the pool really was tight


class _ExpandedStepKV(V4StepKV):
    """Reference for a shared source: layer 3 keeps its own *copy* of layer 1's entries and reads the copy."""

    def add_entries(self, key, first, counts, entries):
        super().add_entries(key, first, counts, entries)
        if key == (1, "kv"):
            super().add_entries((3, "kv"), first, counts, entries.clone())


def _expanded_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of ``model`` with layer 3 reading its per-layer copy (prefill in chunks of 7)."""
    state = model.new_state(len(prompt) + n)
    state.entries[(3, "kv")] = torch.zeros_like(state.entries[(1, "kv")])
    model.attn[3].source = 3  # read the copy, not layer 1's table
    try:
        tokens: list[int] = []
        chunks = [prompt[i:i + 7] for i in range(0, len(prompt), 7)]
        for chunk in chunks + [None] * (n - 1):
            ids = chunk if chunk is not None else tokens[-1:]
            step = _ExpandedStepKV([state], len(ids), model.device)
            logits = model.forward(torch.tensor([ids]), None, step).logits[0, -1]
            step.commit()
            if chunk is None or chunk is chunks[-1]:
                tokens.append(int(logits.argmax()))
        return tokens
    finally:
        model.attn[3].source = 1


def test_shared_source_resolves_once_per_step(v4_engine):
    """Layer 3 reuses layer 1's compressed KV and top-k: one hierarchy source, one resolution per step, and the
    tokens of the same model run with the reuse expanded into a per-layer copy of the source."""
    changes = {"kv_source_layers": [0, 1, 2, 1], "kv_source_shares_topk": [False, False, False, True]}
    engine = v4_engine("v4_small_topk", changes)
    llm = LLM(engine, max_batch_size=8, kv_policy="hisparse", pool_bytes=1 << 22, page_rows=4)
    expected = [_expanded_greedy(llm.engine.model, p, PARAMS.max_tokens) for p in PROMPTS]
    kv = llm.engine.kv
    assert kv.layout.num_sources == 1 and kv.layout.num_layers == 2
    calls: list[int] = []
    end_step = kv.end_step

    def record(accepted, report=None):
        calls.append(kv.step.inner.resolver_calls)
        end_step(accepted, report)

    kv.end_step = record
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == expected
    assert calls and set(calls) == {1}  # two CSA layers, one source, one resolution per step
    assert llm.stats()["kv_host_fetched_rows"] > 0


def test_required_tail_is_reserved_per_request(v4_engine):
    llm = LLM(v4_engine("v4_small_topk"), kv_policy="hisparse", pool_bytes=1 << 22, page_rows=4)
    kv = llm.engine.kv
    assert kv.inner.config.model_state_bytes == kv.state_bytes > 0
    out = llm.generate([PROMPTS[3]], PARAMS)[0]
    assert out.stats["kv_window_bytes"] > 0 and out.stats["kv_csa_entries_bytes"] == 0  # entries live in the hierarchy


def test_adaptive_reclaims_optional_entries_and_stays_exact(v4_engine):
    """Long prompts whose optional entry pages must be reclaimed for later admissions."""
    engine = v4_engine("v4_small_topk")
    prompts = random_prompts([300, 350, 280, 320, 9], 97, seed=11)
    expected = [o.token_ids for o in LLM(engine, max_batch_size=8).generate(prompts, PARAMS)]
    llm = LLM(engine, kv_policy="adaptive", max_batch_size=8, pool_bytes=250_000, page_rows=2, hot_rows=3,
              max_model_len=400)
    assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == expected
    stats = llm.stats()
    assert stats["kv_reclaim_events"] > 0 and stats["kv_rows_host"] > 0 and stats["kv_rows_direct"] > 0
    llm.engine.kv.check_invariants()


@pytest.mark.parametrize("policy", ["hisparse"])
def test_verification_steps_with_partial_acceptance_stay_exact(policy, v4_engine):
    """Steps of Q = 5 tokens (the true continuation as drafts), keeping 1..5 of them in a varying pattern: two
    compressed entries may complete in one step and those of rejected tokens are rolled back. Every kept
    position's argmax must be the reference's next token."""
    from dhisparse.kv import KVConfig

    llm = LLM(v4_engine("v4_small_topk"), kv_policy="dense", max_batch_size=8)
    n_new = 24
    dense_tokens = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=n_new, ignore_eos=True))]
    model, cfg, q = llm.engine.model, llm.engine.model.cfg, 5
    kv = V4HierarchyKVStore(cfg, KVConfig(policy=policy, pool_bytes=1 << 22, hot_rows=cfg.index_topk * q,
                                            page_rows=2, max_query_len=2), model.dtype, model.device, 128)
    sequences = [p + t for p, t in zip(PROMPTS, dense_tokens, strict=True)]
    done = []
    for i, p in enumerate(PROMPTS):
        assert kv.try_admit(f"r{i}", len(p), n_new + q)
        kv.import_prompt(f"r{i}", model.prefill(p, chunk_tokens=7).state, {})
        done.append(len(p))
    step = 0
    while min(len(s) - d for s, d in zip(sequences, done, strict=True)) > q:
        ids = [f"r{i}" for i in range(len(PROMPTS))]
        tokens = torch.tensor([s[d:d + q] for s, d in zip(sequences, done, strict=True)])
        out = model.forward(tokens, None, kv.begin_step(ids, q), all_logits=True)
        keep = [(step + b) % q + 1 for b in range(len(ids))]
        for b, (s, d) in enumerate(zip(sequences, done, strict=True)):
            assert out.logits[b, :keep[b]].argmax(-1).tolist() == s[d + 1:d + 1 + keep[b]]
        kv.end_step(dict(zip(ids, keep, strict=True)))
        done = [d + k for d, k in zip(done, keep, strict=True)]
        step += 1
        kv.check_invariants()
    assert step >= 4 and kv.stats()["kv_resolved_rows"] > 0


def test_never_admissible_names_the_v4_state(v4_engine):
    with pytest.raises(ValueError, match=r"prompt 45 \+ max_new_tokens 12 tokens, of which \d+ are the deepseek_v4"):
        LLM(v4_engine("v4_small_topk"), kv_policy="hisparse", pool_bytes=20_000).generate([PROMPTS[3]], PARAMS)


def test_hot_cache_below_a_verification_block_is_refused():
    """V4 has no verification staging: the hot cache must hold a block's whole union of selections."""
    import dataclasses

    from dhisparse.engine.config import EngineConfig
    from dhisparse.errors import ConfigError
    from dhisparse.kv.factory import make_kv_store
    from dhisparse_planner.deepseek_v4 import DSV4_FLASH

    cfg = dataclasses.replace(DSV4_FLASH, num_hidden_layers=3, layer_types=DSV4_FLASH.layer_types[:3],
                              mlp_layer_types=("moe",) * 3, hidden_size=64, head_dim=64, qk_rope_head_dim=16,
                              num_attention_heads=2, index_n_heads=2, index_head_dim=16, index_topk=8,
                              max_position_embeddings=256)
    engine = EngineConfig(kv_policy="hisparse", pool_bytes=1 << 22, page_rows=4, hot_rows=8 * 5 - 1)
    def make(engine: EngineConfig) -> object:
        return make_kv_store(cfg, policy=engine.kv_policy, dtype=torch.float32, device=torch.device("cpu"),
                             kv_config=engine.kv_config(5, 0, 256), max_query_len=5)

    with pytest.raises(ConfigError, match="hot_rows"):
        make(engine)
    assert make(dataclasses.replace(engine, hot_rows=0)) is not None

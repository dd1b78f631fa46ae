"""The planner's engine core makes exactly the engine's decisions on the same trace: the real LLMEngine runs a
tiny model while RecordingKV records its selections and decisions; the planner replays the selections and
must reproduce every admission, refusal, batch, finish and KV counter (hits, misses, reclaims, refills,
bytes), step by step, for every policy and for a pool small enough to force waiting and reclaim."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import random_prompts

from dhisparse import LLM, SamplingParams
from dhisparse_planner.trace import RecordingKV, replay

LENGTHS = [40, 23, 61, 97, 12, 55]
NEW_TOKENS = [9, 14, 6, 11, 8, 10]


def _run_engine(engine_dir, policy: str, pool_scale: float):
    # The planner's replay models no prefix reuse (its cached pages and shared device copies change reclaims): off.
    probe = LLM(engine_dir, kv_policy=policy, page_rows=4, prefix_reuse=False)
    smallest = probe.engine.kv.required_bytes(max(LENGTHS), max(NEW_TOKENS))
    recorders: list[RecordingKV] = []

    def record(kv):
        recorders.append(RecordingKV(kv))
        return recorders[-1]

    llm = LLM(engine_dir, wrap_kv=record, kv_policy=policy, page_rows=4, pool_bytes=int(smallest * pool_scale),
              refill_pages_per_step=3, max_batch_size=4, max_prefill_tokens_per_step=120, prefix_reuse=False)
    recorder = recorders[0]
    prompts = random_prompts(LENGTHS, 96, seed=3)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in NEW_TOKENS]
    llm.generate(prompts, params)
    recorder.finish()
    return llm, recorder


@pytest.mark.parametrize("policy,pool_scale", [("resident", 2.5), ("hisparse", 2.5), ("adaptive", 2.5),
                                               ("adaptive", 40.0)])
def test_replayed_decisions_equal_the_engines(tiny_engine, policy: str, pool_scale: float) -> None:
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    llm, rec = _run_engine(engine_dir, policy, pool_scale)
    kv = rec.inner
    pairs = zip(LENGTHS, NEW_TOKENS, strict=True)
    requests = [(f"req-{i}", n_prompt, n_new) for i, (n_prompt, n_new) in enumerate(pairs)]
    outcomes = replay(kv.layout, kv.config, requests, rec.selections, max_batch_size=4,
                      max_prefill_tokens_per_step=120)
    assert len(outcomes) == len(rec.steps)
    for i, (ours, theirs) in enumerate(zip(outcomes, rec.steps, strict=True)):
        assert dataclasses.asdict(ours) == dataclasses.asdict(theirs), f"engine step {i} differs"
    last = rec.steps[-1].counters
    assert last["rows_host"] + last["rows_hot"] + last["rows_direct"] > 0
    if policy == "adaptive" and pool_scale < 10:
        assert any(s.refused for s in rec.steps), "the small pool should force an admission to wait"
        assert last["reclaim_events"] >= 1 and last["optional_pages_refill_issued"] >= 1
    if policy == "hisparse":
        assert last["rows_host"] > 0


def test_model_forward_trace_equals_the_engines_selections(tiny_engine) -> None:
    """``engine_trace`` records selections from the model's own forward (no engine internals touched); they must be
    the selections the engine's decode steps make on the same prompts (greedy, every indexer layer)."""
    import torch

    from dhisparse.model.model import DSAModel
    from dhisparse_planner.engine_trace import greedy_selections

    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    llm, rec = _run_engine(engine_dir, "resident", 40.0)
    model = DSAModel.from_checkpoint(engine_dir, torch.float32)
    prompts = random_prompts(LENGTHS, 96, seed=3)
    indexers = list(model.cfg.indexer_layers)
    for i, (prompt, new) in enumerate(zip(prompts, NEW_TOKENS, strict=True)):
        ours = greedy_selections(model, prompt, new)
        theirs = rec.selections[f"req-{i}"]
        assert len(ours) == len(theirs) == new - 1
        for step_ours, step_theirs in zip(ours, theirs, strict=True):
            for layer in indexers:
                assert torch.equal(step_ours[layer], step_theirs[layer][:1]), f"request {i} layer {layer}"

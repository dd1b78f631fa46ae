"""Prefix reuse through the engine: the tokens with reuse equal the tokens without, exactly.

Multi-turn sessions (each turn's prompt is the whole history plus a new message, so turn ``k`` hits the pages turn
``k-1`` cached, its decoded pages included) and concurrent requests sharing a prefix that ends mid-page or at a page
boundary, for both model families, every policy (``resident`` and ``dense`` keep no prefix cache: their tokens are the
same and nothing is reused), greedy and seeded sampling, with and without each drafter. The reference is the same
engine with ``prefix_reuse=False`` (itself tested against the dense store and transformers elsewhere).
"""

from __future__ import annotations

import pytest
from tiny_models import build_spec_engine, random_prompts

from dhisparse import LLM, SamplingParams

PAGE = 8
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, top_k=20, seed=1234)
REUSING = ("hisparse", "adaptive")


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    """Spec engines (both drafters packed) of both families."""
    return {family: build_spec_engine(tmp_path_factory.mktemp(f"prefix-{family}"), tiny_checkpoint(family))
            for family in ("glm_fsfs_sparse", "dsv32_sparse_yarn")}


def _pair(engine_dir, **options) -> tuple[LLM, LLM]:
    common = dict(page_rows=PAGE, prefill_chunk_tokens=16, max_batch_size=4, **options)
    return LLM(engine_dir, **common), LLM(engine_dir, prefix_reuse=False, **common)


def _session(llm: LLM, first: list[int], messages: list[list[int]], params: SamplingParams
             ) -> tuple[list[list[int]], list[float]]:
    """Turns of one conversation: outputs and each turn's reused prompt tokens."""
    history, outputs, reused = list(first), [], []
    for message in [[], *messages]:
        history = history + message
        out = llm.generate([history], params)[0]
        outputs.append(out.token_ids)
        reused.append(out.stats.get("kv_prefix_reused_tokens", 0.0))
        history = history + out.token_ids
    return outputs, reused


MULTI_TURN = [(family, policy, params) for family in ("glm_fsfs_sparse", "dsv32_sparse_yarn") for policy in REUSING
              for params in ("greedy", "sampled")] + [("glm_fsfs_sparse", "dense", "greedy"),
                                                      ("dsv32_sparse_yarn", "resident", "sampled")]


@pytest.mark.parametrize(("family", "policy", "params"), MULTI_TURN)
def test_multi_turn_tokens_with_reuse_equal_tokens_without(engines, family, policy, params) -> None:
    params = GREEDY if params == "greedy" else SAMPLED
    reuse, plain = _pair(engines[family], kv_policy=policy)
    first, *messages = random_prompts([21, 11, 16, 5], 96, seed=3)  # turn prompts end mid-page and at boundaries
    got, reused = _session(reuse, first, messages, params)
    want, none = _session(plain, first, messages, params)
    assert got == want
    assert not any(none)
    if policy in REUSING:
        assert reused[0] == 0 and all(r > 0 for r in reused[1:]), reused
        # turn k reuses every complete page of turn k-1's sequence (its prompt and decoded rows)
        assert reused[1] == (21 + GREEDY.max_tokens - 1) // PAGE * PAGE
        reuse.engine.kv.check_invariants()
    else:
        assert not any(reused)


@pytest.mark.parametrize("speculative", ["dflash2", "dspark"])
@pytest.mark.parametrize("policy", REUSING)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_speculation_with_reuse_is_exact(engines, speculative, policy, params) -> None:
    """The drafter's ring is seeded from the recomputed window (the last ``window`` prompt tokens are never
    reused), so even the sampled tokens, which depend on the drafts, are those without reuse."""
    reuse, plain = _pair(engines["glm_fsfs_sparse"], kv_policy=policy, speculative=speculative, num_draft_tokens=3)
    first, *messages = random_prompts([37, 9, 20], 96, seed=4)
    got, reused = _session(reuse, first, messages, params)
    want, _ = _session(plain, first, messages, params)
    assert got == want
    window = reuse.engine.spec.ring.window
    assert all(r > 0 for r in reused[1:]), reused
    assert reuse.engine.stats()["prefill_tokens"] < plain.engine.stats()["prefill_tokens"]
    # what was reused leaves at least the drafter's window to compute
    history = 37 + params.max_tokens + 9
    assert reused[1] <= history - window


@pytest.mark.parametrize(("family", "policy", "shared"), [
    ("glm_fsfs_sparse", "hisparse", 2 * PAGE), ("glm_fsfs_sparse", "adaptive", 2 * PAGE + 3),
    ("dsv32_sparse_yarn", "adaptive", 2 * PAGE), ("dsv32_sparse_yarn", "hisparse", 2 * PAGE + 3)])
def test_concurrent_requests_sharing_a_prefix(engines, family, policy, shared) -> None:
    """Requests queued together whose prompts share ``shared`` tokens: the first prefills them, the others reuse
    its complete pages (adaptive: they map its resident copy instead of holding their own)."""
    reuse, plain = _pair(engines[family], kv_policy=policy)
    system = random_prompts([shared], 96, seed=7)[0]
    prompts = [system + tail for tail in random_prompts([5, 13, 1, 8], 96, seed=8)]
    got = reuse.generate(prompts, GREEDY)
    want = plain.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    reused = [o.stats["kv_prefix_reused_tokens"] for o in got]
    assert reused[0] == 0 and reused[1:] == [shared // PAGE * PAGE] * 3
    stats = reuse.stats()
    assert stats["kv_prefix_hits"] == 3 and stats["kv_prefix_lookup_tokens"] == sum(len(p) for p in prompts)
    assert stats["prefill_tokens"] == sum(len(p) for p in prompts) - sum(reused)
    reuse.engine.kv.check_invariants()


def test_shared_resident_copies_are_one_per_page(engines) -> None:
    """adaptive: requests running at once with one system prompt map one device copy of its pages."""
    reuse, _ = _pair(engines["glm_fsfs_sparse"], kv_policy="adaptive")
    system = random_prompts([4 * PAGE + 2], 96, seed=9)[0]
    engine = reuse.engine
    ids = [engine.add_request(system + tail, GREEDY) for tail in random_prompts([3, 6, 9], 96, seed=10)]
    engine.step()  # all three admitted and prefilled: the later two hit the first one's pages
    kv = engine.kv
    sources = kv.layout.num_sources
    held = [kv.request_stats(i)["kv_optional_pages_shared"] for i in ids]
    # prompts of 37, 40 and 43 tokens: four shared pages, and the last two have a fifth page of their own (each
    # published as its own entry's copy)
    assert held == [4 * sources, 5 * sources, 5 * sources]
    assert kv.stats()["kv_prefix_device_pages"] == (4 + 2) * sources  # one copy per distinct page
    assert sorted(e.mappers for e in kv.prefix.cache.entries.values()) == [1, 1, 3, 3, 3, 3]
    kv.check_invariants()
    while engine.has_unfinished():
        engine.step()
    kv.check_invariants()


def test_context_logits_requests_are_computed_whole(engines) -> None:
    """A request that wants every prompt position's logits looks nothing up (its pages are still cached)."""
    reuse, plain = _pair(engines["glm_fsfs_sparse"], kv_policy="hisparse")
    prompt = random_prompts([30], 96, seed=12)[0]
    reuse.generate([prompt], GREEDY)
    params = SamplingParams(max_tokens=4, ignore_eos=True, context_logits=True)
    out = reuse.generate([prompt], params)[0]
    assert out.stats["kv_prefix_reused_tokens"] == 0
    assert out.token_ids == plain.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("policy", ["dense", "adaptive"])
def test_deepseek_v4_refuses_reuse_cleanly(tiny_root, policy) -> None:
    """DeepSeek-V4: a hit could not restore the sliding window and the compressor's state from cached pages, so with
    ``prefix_reuse`` on (the default) every prompt is prefilled in full, and the statistics say so."""
    from tiny_v4 import make_v4_checkpoint

    from dhisparse_builder import BuildOptions, build_engine

    out = tiny_root / "engine-v4-prefix"
    if not out.exists():
        build_engine(BuildOptions(make_v4_checkpoint(tiny_root, "v4_small_topk"), out, {"dtype": "float64"}),
                     progress=lambda d, t: None)
    options = dict(kv_policy=policy, pool_bytes=1 << 22, page_rows=4)
    llm = LLM(out, **options)
    first, message = random_prompts([19, 6], 97, seed=13)
    got, reused = _session(llm, first, [message], GREEDY)
    want, _ = _session(LLM(out, prefix_reuse=False, **options), first, [message], GREEDY)
    assert got == want and not any(reused)
    assert llm.stats()["kv_prefix_reuse_enabled"] == 0

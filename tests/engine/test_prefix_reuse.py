"""Prefix reuse through the engine: the tokens with reuse equal the tokens without, exactly.

Multi-turn sessions (each turn's prompt is the whole history plus a new message, so turn ``k`` hits the pages turn
``k-1`` cached, its decoded pages included) and concurrent requests sharing a prefix that ends mid-page or at a page
boundary, for both DSA families and DeepSeek-V4, every policy (``resident`` and ``dense`` keep no prefix cache: their
tokens are the same and nothing is reused), greedy and seeded sampling, with and without each drafter. The reference
is the same engine with ``prefix_reuse=False`` (itself tested against the dense store and transformers elsewhere).
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


# ----------------------------------------------------------------------------------------------- DeepSeek-V4
# v4_small_topk (layers sliding, CSA rate 4, HCA rate 8, CSA; window 8), hierarchy pages of 4 entry rows: page i
# spans tokens (4i - 1)·4 … (4i + 3)·4 - 1 (boundaries 12, 28, 44, 60, 76, …). A hit on the pages ending at token E
# restores every compressed entry before E and recomputes from restart_position(E) = E - 28
# (tests/kv/test_deepseek_v4_prefix.py): that many tokens are reused.
V4_OPTIONS = dict(page_rows=4, pool_bytes=1 << 22, prefill_chunk_tokens=16, max_batch_size=4)


@pytest.fixture(scope="module")
def v4_engine(tiny_root, tmp_path_factory):
    from tiny_v4 import make_v4_checkpoint

    return build_spec_engine(tmp_path_factory.mktemp("prefix-v4"), make_v4_checkpoint(tiny_root, "v4_small_topk"),
                             vocab_size=97, target_hidden_size=32)


def _v4_pair(engine_dir, **options) -> tuple[LLM, LLM]:
    common = {**V4_OPTIONS, **options}
    return LLM(engine_dir, **common), LLM(engine_dir, prefix_reuse=False, **common)


V4_MULTI_TURN = [("hisparse", "greedy"), ("hisparse", "sampled"), ("adaptive", "greedy"), ("adaptive", "sampled"),
                 ("dense", "greedy"), ("resident", "sampled")]


@pytest.mark.parametrize(("policy", "params"), V4_MULTI_TURN)
def test_deepseek_v4_multi_turn_tokens_with_reuse_equal_tokens_without(v4_engine, policy, params) -> None:
    """Two conversations. The first's turns end mid-page (computed sequences of 49, 72, 89 tokens: cached up to 44,
    60, 76); the second's first turn ends on a page boundary (35 + 10 - 1 = 44 tokens). Turn k reuses E - 28 tokens
    of the pages turn k-1 cached (its decoded ones included)."""
    params = GREEDY if params == "greedy" else SAMPLED
    reuse, plain = _v4_pair(v4_engine, kv_policy=policy)
    sessions = [random_prompts([40, 13, 7, 20], 97, seed=13), random_prompts([35, 16, 6], 97, seed=14)]
    for (first, *messages), expected in zip(sessions, [[0, 16, 32, 48], [0, 16, 32]], strict=True):
        got, reused = _session(reuse, first, messages, params)
        want, none = _session(plain, first, messages, params)
        assert got == want
        assert not any(none)
        assert reused == (expected if policy in REUSING else [0] * len(expected))
    stats, plain_stats = reuse.stats(), plain.stats()
    assert stats["kv_prefix_reuse_enabled"] == (policy in REUSING)
    assert stats["prefill_tokens"] == plain_stats["prefill_tokens"] - (96 + 48 if policy in REUSING else 0)
    if policy in REUSING:
        assert stats["kv_prefix_reused_tokens"] == 96 + 48 and stats["kv_prefix_hits"] == 5
        assert stats["kv_prefix_lookup_tokens"] == plain_stats["prefill_tokens"]  # every prompt token looked up
        reuse.engine.kv.check_invariants()


@pytest.mark.parametrize("speculative", ["dflash2", "dspark"])
@pytest.mark.parametrize("policy", REUSING)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_deepseek_v4_speculation_with_reuse_is_exact(v4_engine, speculative, policy, params) -> None:
    """Both drafters on V4: the hit leaves the drafter's window to compute (its ring is seeded from it), so even the
    sampled tokens, which depend on the drafts, are those without reuse."""
    options = dict(kv_policy=policy, speculative=speculative, num_draft_tokens=3)
    reuse, plain = _v4_pair(v4_engine, **options)
    first, *messages = random_prompts([45, 9, 20], 97, seed=15)
    got, reused = _session(reuse, first, messages, params)
    want, _ = _session(plain, first, messages, params)
    assert got == want
    assert reused[0] == 0 and all(r > 0 for r in reused[1:]), reused
    assert reuse.engine.stats()["prefill_tokens"] < plain.engine.stats()["prefill_tokens"]
    assert reuse.stats()["verify_steps"] > 0
    history = 45 + params.max_tokens + 9
    assert reused[1] <= history - reuse.engine.spec.ring.window - 28
    reuse.engine.kv.check_invariants()


@pytest.mark.parametrize(("policy", "shared", "expected"), [
    ("hisparse", 44, 16), ("adaptive", 44, 16),  # ends on a page boundary
    ("adaptive", 47, 16), ("hisparse", 47, 16),  # ends mid-page
    ("adaptive", 12, 0),  # one page, shorter than the recompute margin: nothing to save, no hit taken
    ("hisparse", 7, 0)])  # shorter than the sliding window: no complete page
def test_deepseek_v4_concurrent_requests_sharing_a_prefix(v4_engine, policy, shared, expected) -> None:
    reuse, plain = _v4_pair(v4_engine, kv_policy=policy)
    system = random_prompts([shared], 97, seed=16)[0]
    prompts = [system + tail for tail in random_prompts([5, 13, 1, 8], 97, seed=17)]
    got = reuse.generate(prompts, GREEDY)
    want = plain.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    reused = [o.stats["kv_prefix_reused_tokens"] for o in got]
    assert reused == [0] + [expected] * 3
    stats = reuse.stats()
    assert stats["kv_prefix_hits"] == (3 if expected else 0)
    assert stats["prefill_tokens"] == sum(len(p) for p in prompts) - sum(reused)
    reuse.engine.kv.check_invariants()


def test_deepseek_v4_reuse_under_a_tight_device_pool(v4_engine) -> None:
    """adaptive with a pool that holds few requests at once: admissions wait for releases, and every later request
    still reuses the shared prefix's pages (registered by the first one) with the tokens unchanged."""
    reuse, plain = _v4_pair(v4_engine, kv_policy="adaptive", pool_bytes=150_000)
    system = random_prompts([44], 97, seed=16)[0]
    prompts = [system + tail for tail in random_prompts([5, 13, 1, 8, 30, 2], 97, seed=17)]
    got, want = reuse.generate(prompts, GREEDY), plain.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.stats["kv_prefix_reused_tokens"] for o in got] == [0] + [16] * 5
    assert reuse.stats()["kv_admissions_waited"] > 0
    reuse.engine.kv.check_invariants()


def test_deepseek_v4_reuse_under_a_tight_host_store(v4_engine) -> None:
    """Distinct conversations through a host store that holds few cached pages: unreferenced pages are evicted (LRU)
    instead of admissions waiting, and the tokens stay those without reuse."""
    reuse, plain = _v4_pair(v4_engine, kv_policy="hisparse", host_bytes=40 * 4 * 32 * 8)
    for seed in range(3):
        first, *messages = random_prompts([40, 13], 97, seed=20 + seed)
        assert _session(reuse, first, messages, GREEDY)[0] == _session(plain, first, messages, GREEDY)[0]
    stats = reuse.stats()
    assert stats["kv_prefix_evicted_pages"] > 0 and stats["kv_prefix_reused_tokens"] > 0
    reuse.engine.kv.check_invariants()


def test_deepseek_v4_context_logits_requests_are_computed_whole(v4_engine) -> None:
    reuse, plain = _v4_pair(v4_engine, kv_policy="adaptive")
    prompt = random_prompts([50], 97, seed=18)[0]
    reuse.generate([prompt], GREEDY)
    params = SamplingParams(max_tokens=4, ignore_eos=True, context_logits=True)
    out = reuse.generate([prompt], params)[0]
    assert out.stats["kv_prefix_reused_tokens"] == 0
    assert out.token_ids == plain.generate([prompt], params)[0].token_ids

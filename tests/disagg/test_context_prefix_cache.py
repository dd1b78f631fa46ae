"""The context engine's prefix cache (``disagg/context_cache.py``): a prompt that starts with an earlier prompt's
complete pages is prefilled only after them, and what it publishes (rows, indexer keys, drafter features, first
token) is what a full prefill produces; the cache stays within its byte capacity."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_spec_engine, random_prompts

from dhisparse import SamplingParams
from dhisparse.disagg.prefill import PrefillEngine

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_dir(tiny_checkpoint, tmp_path_factory):
    return build_spec_engine(tmp_path_factory.mktemp("context-cache"), tiny_checkpoint("glm_fsfs_sparse"))


@pytest.mark.parametrize("speculative", [None, "dflash2"])
def test_context_prefill_reuses_cached_pages_exactly(engine_dir, speculative) -> None:
    options = dict(page_rows=8, prefill_chunk_tokens=16, speculative=speculative)
    cached_engine = PrefillEngine(engine_dir, **options)
    plain = PrefillEngine(engine_dir, prefix_reuse=False, **options)
    first, more = random_prompts([45, 12], 96, seed=31)
    cached_engine.prefill(first, PARAMS, "a")
    prompt = first + more
    got, want = cached_engine.prefill(prompt, PARAMS, "b"), plain.prefill(prompt, PARAMS, "b")
    window = cached_engine.spec.ring.window if speculative else 1
    # the first prompt's complete pages, leaving at least the last token (and the drafter's window) to compute
    assert got.cached_tokens == min(len(first) // 8, (len(prompt) - window) // 8) * 8 > 0
    assert want.cached_tokens == 0
    assert got.first_token == want.first_token
    assert torch.equal(got.rows, want.rows)
    assert all(torch.equal(got.index_keys[k], want.index_keys[k]) for k in want.index_keys)
    if speculative:
        assert torch.equal(got.features, want.features)
    stats = cached_engine.cache.stats()
    assert stats["context_prefix_reused_tokens"] == got.cached_tokens


def test_context_cache_stays_within_its_capacity(engine_dir) -> None:
    probe = PrefillEngine(engine_dir, page_rows=8)
    probe.prefill(random_prompts([17], 96, seed=1)[0], PARAMS, "p")
    page_bytes = probe.cache.nbytes // 2  # two complete pages
    engine = PrefillEngine(engine_dir, page_rows=8, host_bytes=5 * page_bytes)
    for n, prompt in enumerate(random_prompts([40, 33, 50, 24], 96, seed=2)):  # distinct prefixes
        engine.prefill(prompt, PARAMS, f"r{n}")
        assert engine.cache.nbytes <= 5 * page_bytes
    assert engine.cache.stats()["context_prefix_evicted_pages"] > 0

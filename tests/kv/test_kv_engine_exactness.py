"""Greedy tokens of every KV policy equal the dense reference store's (which equals transformers, see
tests/model/test_exactness.py), for both model families, from generous budgets down to the smallest pool
that admits the largest request, with concurrent requests of irregular lengths (prompts several times
longer than index_topk)."""

from __future__ import annotations

import pytest
from tiny_models import random_prompts

from dhisparse import LLM, SamplingParams

LENGTHS = [7, 23, 50, 97]
NEW_TOKENS = 12


@pytest.mark.parametrize("name", ["glm_fsfs_sparse", "dsv32_sparse_yarn"])
def test_every_policy_and_budget_gives_the_dense_tokens(name, tiny_engine) -> None:
    engine_dir = tiny_engine(name, "float32")
    prompts = random_prompts(LENGTHS, 96, seed=7)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [o.token_ids for o in LLM(engine_dir, kv_policy="dense").generate(prompts, params)]
    assert any(len(set(e)) > 4 for e in expected), "reference output is degenerate; the test would be weak"
    for policy in ("resident", "hisparse", "adaptive"):
        probe = LLM(engine_dir, kv_policy=policy, page_rows=4)
        smallest = probe.engine.kv.required_bytes(max(LENGTHS), NEW_TOKENS)
        for pool_bytes in (30 * smallest, 2 * smallest + smallest // 2, smallest):
            llm = LLM(engine_dir, kv_policy=policy, page_rows=4, pool_bytes=pool_bytes, refill_pages_per_step=4)
            got = [o.token_ids for o in llm.generate(prompts, params)]
            assert got == expected, f"{policy} at pool_bytes={pool_bytes} changed the tokens"
            llm.engine.kv.poll()  # frees deferred by copies still in flight at the last release
            stats = llm.stats()
            assert stats["kv_required_bytes"] == 0  # all released; only the prefix cache's pages stay
            assert stats["kv_optional_bytes"] == stats["kv_prefix_device_bytes"]
            if pool_bytes == smallest:
                assert stats["kv_admissions_waited"] >= 1  # one request at a time
            if policy == "resident":
                assert stats["kv_rows_host"] == 0
            llm.engine.kv.check_invariants()

"""Several ranks give the single-process engine's tokens (float64; gloo, 2 ranks, one thread each).

One engine per case, each checked for greedy tokens and seeded sampling against the single-process engine of the
same configuration, on concurrent prompts of irregular lengths (several times ``index_topk``). The cases cover every
parallel shape (TP, DP attention, TP + EP, DP attention + EP), every KV policy (tight pools where the hierarchy
fetches rows from the host store and requests wait for admission), both drafters, and the three model families;
``DHISPARSE_SLOW=1`` adds the full cross product of shapes x policies for each family.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from parallel_engines import parallel_llm, tight_pool
from tiny_models import random_prompts

from dhisparse import LLM, SamplingParams

TP = dict(tensor_parallel_size=2)
DP = dict(data_parallel_size=2)
TP_EP = dict(tensor_parallel_size=2, expert_parallel=True)
DP_EP = dict(data_parallel_size=2, expert_parallel=True)
LENGTHS = [7, 23, 50, 31]
NEW_TOKENS = 10

# (engine, shape, KV policy, tight pool, drafter)
CASES = [
    ("glm_fsfs_sparse", TP, "adaptive", True, None),
    ("glm_fsfs_sparse", DP_EP, "hisparse", True, None),
    ("dsv32_sparse_yarn", TP_EP, "resident", False, None),
    ("dsv32_sparse_yarn", DP, "dense", False, None),
    ("v4_small_topk", TP, "adaptive", True, None),
    ("v4_small_topk", DP_EP, "hisparse", False, None),
    ("spec", TP_EP, "adaptive", True, "dflash2"),
    ("spec", DP, "hisparse", True, "dspark"),
]
if os.environ.get("DHISPARSE_SLOW") == "1":
    CASES += [(name, shape, policy, policy in ("hisparse", "adaptive"), None)
              for name in ("glm_fsfs_sparse", "dsv32_sparse_yarn", "v4_small_topk")
              for shape in (TP, DP, TP_EP, DP_EP) for policy in ("dense", "resident", "hisparse", "adaptive")]
    CASES += [("spec", shape, policy, policy in ("hisparse", "adaptive"), drafter) for drafter in ("dflash2", "dspark")
              for shape in (TP, DP, TP_EP, DP_EP) for policy in ("dense", "resident", "hisparse", "adaptive")]


def _engine_dir(name: str, tiny_engine, v4_engine: Path, spec_engine: Path) -> Path:
    if name == "v4_small_topk":
        return v4_engine
    if name == "spec":
        return spec_engine
    return tiny_engine(name, "float64")


def _case_id(case) -> str:
    name, shape, policy, tight, drafter = case
    parts = [name, "+".join(f"{k.split('_')[0]}{v}" if v is not True else "ep" for k, v in shape.items()), policy]
    return "-".join(parts + (["tight"] if tight else []) + ([drafter] if drafter else []))


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_parallel_tokens_equal_single_process(case, tiny_engine, v4_engine, spec_engine) -> None:
    name, shape, policy, tight, drafter = case
    engine_dir = _engine_dir(name, tiny_engine, v4_engine, spec_engine)
    vocab = 97 if name == "v4_small_topk" else 96
    overrides: dict = dict(kv_policy=policy, max_batch_size=4)
    if policy != "dense":
        overrides["page_rows"] = 8
    if drafter:
        overrides.update(speculative=drafter, num_draft_tokens=3, dspark_busy_batch=2)
    if tight:
        overrides["pool_bytes"] = tight_pool(engine_dir, max(LENGTHS), NEW_TOKENS, **overrides)
    prompts = random_prompts(LENGTHS, vocab, seed=11)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.9, top_p=0.95, seed=100 + i)
               for i in range(len(prompts))]
    single = LLM(engine_dir, **overrides)
    expected_greedy = [o.token_ids for o in single.generate(prompts, greedy)]
    expected_sampled = [o.token_ids for o in single.generate(prompts, sampled)]
    assert expected_greedy != expected_sampled
    with parallel_llm(engine_dir, **overrides, **shape) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected_greedy
        assert [o.token_ids for o in llm.generate(prompts, sampled)] == expected_sampled
        llm.engine.poll_idle()
        stats = llm.stats()
    assert stats["parallel_world_size"] == 2
    assert stats["requests_finished"] == 2 * len(prompts)
    if policy != "dense":
        assert stats["kv_required_bytes"] == 0 and stats["kv_optional_bytes"] == 0  # everything released
        assert stats["rank0_kv_pool_bytes"] == stats["rank1_kv_pool_bytes"] == overrides.get("pool_bytes", 256 << 20)
    if tight and policy in ("hisparse", "adaptive"):
        assert stats["kv_rows_host"] > 0  # the tight pool made the hierarchy fetch rows from the host store
    if drafter:
        assert stats["verify_steps"] > 0
    if "data_parallel_size" in shape:
        # both groups served requests (placement by KV demand), and MLP layers exchanged tokens
        assert stats["rank0_requests_running"] == stats["rank1_requests_running"] == 0
        assert stats["comm_idle_forwards"] >= 0 and stats["comm_bytes_sync_all_gather"] > 0
    else:
        assert stats["comm_bytes_attention_all_reduce"] > 0 and stats["comm_bytes_lm_head_all_gather"] > 0
    if shape.get("expert_parallel") and "data_parallel_size" in shape:
        assert stats["comm_bytes_moe_dispatch_all_to_all"] > 0

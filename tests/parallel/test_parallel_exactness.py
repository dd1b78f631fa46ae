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
from dhisparse.engine.parallel.comm import DP_STEP_CLOSE_BYTES, ForwardShape, ModelComm, forward_comm_bytes
from dhisparse.engine.parallel.shape import ParallelShape
from dhisparse_planner.comm import step_comm_bytes
from dhisparse_planner.specs import GLM5

TP = dict(tensor_parallel_size=2)
DP = dict(data_parallel_size=2)
TP_EP = dict(tensor_parallel_size=2, expert_parallel=True)
DP_EP = dict(data_parallel_size=2, expert_parallel=True)
LENGTHS = [7, 23, 50, 31]
NEW_TOKENS = 10

TP_EP_WHOLE_INDEXER = dict(tensor_parallel_size=2, expert_parallel=True, tp_split_indexer=False)

# (engine, shape, KV policy, tight pool, drafter)
CASES = [
    ("glm_fsfs_sparse", TP, "adaptive", True, None),
    ("glm_fsfs_sparse", DP_EP, "hisparse", True, None),
    ("dsv32_sparse_yarn", TP_EP_WHOLE_INDEXER, "resident", False, None),
    ("dsv32_sparse_yarn", DP, "dense", False, None),
    ("dsv32_sparse_yarn", TP, "hisparse", True, None),
    ("v4_small_topk", TP, "adaptive", True, None),
    ("v4_small_topk", DP_EP, "hisparse", False, None),
    ("v4_small_topk", DP, "resident", False, None),
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
    words = {"tensor_parallel_size": "tp", "data_parallel_size": "dp", "expert_parallel": "ep",
             "tp_split_indexer": "whole-indexer"}
    parts = [name, "+".join(words[k] + (str(v) if isinstance(v, int) and not isinstance(v, bool) else "")
                            for k, v in shape.items()), policy]
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
        if name == "glm_fsfs_sparse":
            _check_decode_step_volume(llm, prompts[:2])
        for _ in range(3):  # frees deferred by copies in flight at the last release (agreed completion, under TP,
            llm.engine.poll_idle()  # completes a copy at the second poll after it was issued)
            if llm.stats().get("kv_requests_releasing", 0.0) == 0:
                break
        stats = llm.stats()
    assert stats["parallel_world_size"] == 2
    assert stats["requests_finished"] == 2 * len(prompts) + (2 if name == "glm_fsfs_sparse" else 0)
    if policy != "dense":
        assert stats["kv_required_bytes"] == 0  # everything released; the prefix cache's device copies may stay
        assert stats["kv_optional_bytes"] == stats.get("kv_prefix_device_bytes", 0.0)
        assert stats["rank0_kv_pool_bytes"] == stats["rank1_kv_pool_bytes"] == overrides.get("pool_bytes", 256 << 20)
        # tensor-parallel ranks complete copies by the step sequence (agreed completion; TP reports rank 0's figure,
        # the driver compared every rank's decisions each step), data-parallel groups by their own events (DP: a sum)
        assert stats["kv_copies_agreed"] == float("tensor_parallel_size" in shape)
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
        # the indexer's scores are all-reduced only when its heads are split
        assert (stats.get("comm_bytes_indexer_all_reduce", 0.0) > 0) == shape.get("tp_split_indexer", True)
    if shape.get("expert_parallel") and "data_parallel_size" in shape:
        assert stats["comm_bytes_moe_dispatch_all_to_all"] > 0


def _check_decode_step_volume(llm: LLM, prompts: list[list[int]]) -> None:
    """The bytes each rank passed to its collectives in one decode step equal the model of that step's shape
    (``engine/parallel/comm.py``), layer type by layer type; under DP + EP the routing-dependent all-to-all volume
    is checked for conservation (every row dispatched comes back) and its bounds."""
    engine = llm.engine
    shape = ParallelShape.of(llm.config)
    rids = [engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
    requests = [engine.requests[r] for r in rids]
    for _ in range(4):  # admissions, prefills and first decodes (a tight pool may admit the second a step later)
        engine.step()
        if all(len(r.output_token_ids) >= 2 for r in requests):
            break
    assert all(2 <= len(r.output_token_ids) < 8 for r in requests), "both requests must decode in the next step"
    before = engine.stats()
    lengths = [r.prompt_len + len(r.output_token_ids) for r in requests]  # KV length after this step's token
    engine.step()  # one pure decode step
    after = engine.stats()
    cfg, e = engine.model.cfg, 8  # float64
    if shape.data_parallel:
        forwards = [ForwardShape(1, 1, n) for n in lengths]  # placement: one request per group
    else:
        forwards = [ForwardShape(2, 1, max(lengths))]
    model = forward_comm_bytes(cfg, shape, forwards, e)
    # the planner's figure for this step (its deployment described as 2 GPUs, attention TP or DP; uniform routing)
    planned = step_comm_bytes(ModelComm.of(cfg), GLM5.with_(gpus=2, attention_dp=shape.data_parallel_size),
                              1 if shape.data_parallel else 2, max(lengths), e, expert_parallel=shape.expert_parallel)
    planned_total = planned.pop("total")
    dispatched_rows, returned_rows = [], []
    for rank in range(shape.world_size):
        measured = {k.removeprefix(f"rank{rank}_comm_bytes_"): after[k] - before.get(k, 0.0) for k in after
                    if k.startswith(f"rank{rank}_comm_bytes_")}
        measured = {k: v for k, v in measured.items() if v}
        expected = dict(model[rank])
        if shape.data_parallel:
            expected["sync_all_gather"] += DP_STEP_CLOSE_BYTES
        if shape.expert_parallel and shape.data_parallel:
            moe_layers = sum(k != "dense" for k in cfg.mlp_layer_types)
            row = cfg.hidden_size * e
            dispatched = measured.pop("moe_dispatch_all_to_all", 0.0)
            returned = measured.pop("moe_combine_all_to_all", 0.0)
            assert dispatched % (row + 8) == 0 and returned % row == 0
            assert dispatched / (row + 8) <= moe_layers * cfg.num_experts_per_tok  # one token on this rank
            for key in ("moe_dispatch_all_to_all", "moe_combine_all_to_all"):
                expected.pop(key)
            dispatched_rows.append(dispatched / (row + 8))
            returned_rows.append(returned / row)
        assert measured == expected, rank
        if not (shape.expert_parallel and shape.data_parallel):  # the planner's per-step bytes are the runtime's
            assert planned == measured and planned_total == sum(measured.values()), rank
        else:  # all but the routing-dependent all-to-all (the planner assumes uniform routing)
            assert {k: v for k, v in planned.items() if k not in ("moe_dispatch_all_to_all",
                                                                    "moe_combine_all_to_all")} == measured, rank
    assert sum(dispatched_rows) == sum(returned_rows)  # every row sent to an expert's rank came back
    total = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("comm_bytes_")}
    per_rank_sum = {k: sum(after[f"rank{r}_{k}"] - before.get(f"rank{r}_{k}", 0.0) for r in range(2))
                    for k in total}
    assert total == per_rank_sum  # the engine's figure is every rank's traffic, summed
    while any(engine.requests[r].finish_reason is None for r in rids):
        engine.step()
    for r in rids:
        engine.pop_finished(r)

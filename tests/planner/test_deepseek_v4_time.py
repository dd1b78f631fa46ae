"""The DeepSeek-V4 time model (a step cost computed by hand) and the V4 stepping's admission."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dhisparse.model.deepseek_v4.config import CSA, HCA, SLIDING
from dhisparse_planner.deepseek_v4 import DSV4_FLASH, request_split
from dhisparse_planner.deepseek_v4_sim import V4Scale, V4Serving, V4Sim
from dhisparse_planner.deepseek_v4_time import V4Costs, V4Deployment, V4Params, V4StepLoad, v4_step_seconds
from dhisparse_planner.specs import H200, HardwareSpec
from dhisparse_planner.speculation import SpeculationModel


def test_step_cost_by_hand():
    cfg = dataclasses.replace(DSV4_FLASH, num_hidden_layers=3, layer_types=(SLIDING, CSA, HCA),
                              mlp_layer_types=("moe",) * 3, sliding_window=8, compress_rate_csa=4,
                              compress_rate_hca=16, index_topk=3, num_attention_heads=2, head_dim=8,
                              index_n_heads=2, index_head_dim=4)
    params = V4Params(total=1000.0, dense=100.0, expert=10.0, active=160.0, moe_layers=3, num_experts=4,
                      experts_per_token=2)
    costs = V4Costs(cfg, params, row_bytes=10, index_key_bytes=4, attn_flops_per_head_row=2.0 * (8 + 8))
    hw = HardwareSpec("toy", hbm_bytes=1e6, hbm_bytes_per_s=1000.0, host_link_bytes_per_s=100.0,
                      flops_per_s=10000.0, mfu=0.5, step_overhead_s=0.1)
    # one request, 40 tokens of context, a verification step of 2 queries, data-parallel attention on 2 GPUs
    load = V4StepLoad(torch.tensor([40]), torch.tensor([2]), host_bytes=50.0)
    parts = v4_step_seconds(hw, costs, V4Deployment(gpus=2, attn_tp=1), load)
    # rows per query: 3 layers x min(40, 8) window + CSA min(3, 40 // 4) + HCA 40 // 16 = 24 + 3 + 2 = 29
    assert parts["rows"] == 58 and parts["keys"] == 20  # x 2 queries; keys: 10 entries x 2 queries
    # weights: instance tokens 2 x 2 = 4, experts touched 4 * (1 - (1/2)^4) = 3.75 per layer
    weights = (100 + 3 * 3.75 * 10) / 2
    hbm = (weights + 58 * 10 + 10 * 4) / 1000.0  # keys: the 10 entries read once for both queries
    flops = 2 * 160 * 4 / 2 + 2 * 32 * 58 + 2 * 2 * 4 * 20
    assert parts["hbm"] == pytest.approx(hbm)
    assert parts["compute"] == pytest.approx(max(hbm, flops / 5000.0))
    # every CSA layer owns its indexer: the whole fetch (0.5 s) is on the critical path
    assert parts["total"] == pytest.approx(0.1 + flops / 5000.0 + 0.5)
    # window + HCA rows (26) read once per request as well; the 3 x 2 selected rows still per query
    once = v4_step_seconds(hw, costs, V4Deployment(gpus=2, attn_tp=1, kv_read_once=True), load)
    assert once["hbm"] == pytest.approx((weights + (6 + 26) * 10 + 10 * 4) / 1000.0)


def test_flash_parameters_match_the_model_card():
    p = V4Params.of(DSV4_FLASH)
    assert 280e9 < p.total < 290e9 and 12.5e9 < p.active < 14e9  # 284B total / 13B active


def _sim(policy: str, pool: float, clients: int = 5) -> dict[str, float]:
    spec = SpeculationModel.for_drafter("dspark", gamma=4, busy_batch=2)
    return V4Sim(H200, DSV4_FLASH, V4Deployment(8, 1), V4Serving(policy, spec), clients, 131072, 96,
                 pool_bytes=pool, scale=V4Scale(entry_scale=8, step_scale=16)).run()


def test_resident_admits_only_what_fits():
    required = request_split(DSV4_FLASH, "resident", 131072, 96, max_query_len=5)["required_bytes"]
    pool = 2.5 * required
    res = _sim("resident", pool)
    assert res["max_batch"] == 2 and res["host_share"] == 0.0
    ada = _sim("adaptive", pool)
    assert ada["max_batch"] > 2 and ada["host_share"] > 0.0
    with pytest.raises(ValueError, match="needs"):
        _sim("resident", 0.5 * required)


@pytest.mark.parametrize("overlap", [0.6, 0.858])
def test_entry_cache_model_agrees_with_the_kv_manager(overlap):
    """With one token per entry (rate 1) the V4 stepping's direct / hot / host split of selected entries is the
    one the real KVManager's resolver produces in the DSA simulator for the same selections' statistics."""
    from dhisparse_planner.locality import CALIBRATED
    from dhisparse_planner.scale import ScaleSpec
    from dhisparse_planner.simulator import simulate
    from dhisparse_planner.specs import ModelSpec
    from dhisparse_planner.workload import ServingSpec, WorkloadSpec

    m = ModelSpec(name="one CSA layer", num_layers=1, index_group_size=1, index_topk=512, row_bytes=584,
                  index_key_bytes=132, attn_heads=64, index_heads=64, index_head_dim=128, total_params=284e9,
                  active_params=13e9, dense_params=6e9, moe_layers=43, num_experts=256, experts_per_token=6)
    # small arena; a host store of 16 GiB (the H200 rank's 256 GiB, simulated at 1/8, is more than this process may
    # hold; the two histories take 38 MB of it either way)
    hw = dataclasses.replace(H200, hbm_bytes=m.weight_bytes_per_gpu + m.workspace_bytes + 256e6,
                             host_bytes_per_gpu=16 * 2**30)
    loc = dataclasses.replace(CALIBRATED, overlap=overlap, recent_window_tokens=1024)
    ref = simulate(hw, m, ServingSpec(policy="hisparse", hot_rows=4096, locality=loc, max_batch_size=2),
                   WorkloadSpec(32768, 256, concurrency=2, num_requests=2), ScaleSpec(token_scale=8)).summary()
    cfg = dataclasses.replace(DSV4_FLASH, compress_rate_csa=1)
    got = V4Sim(H200, cfg, V4Deployment(8, 1), V4Serving("hisparse", None, locality=loc), 2, 32768, 256,
                pool_bytes=80e9, scale=V4Scale(entry_scale=8, step_scale=8)).run()
    assert ref["host_share"] > 0.1
    assert abs(got["host_share"] - ref["host_share"]) < 0.1 * ref["host_share"]
    assert abs(got["hot_share"] - ref["hot_share"]) < 0.03 and abs(got["direct_share"] - ref["direct_share"]) < 0.01

"""The parts of the multi-rank engine that need no rank process: the shape and its checks, weight slices that add
back up to the model, the padded vocabulary shard, the expert combine order, placement, statistics aggregation, the
communication model's arithmetic, the local-rank list and the configuration's errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import BASE, CONFIGS

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.parallel.comm import (
    DP_STEP_CLOSE_BYTES,
    ForwardShape,
    ModelComm,
    decode_comm_bytes,
    forward_comm_bytes,
)
from dhisparse.engine.parallel.driver import least_loaded
from dhisparse.engine.parallel.launch import parse_ranks
from dhisparse.engine.parallel.mlp import combine
from dhisparse.engine.parallel.model import vocab_shard
from dhisparse.engine.parallel.rank import digest
from dhisparse.engine.parallel.shape import ParallelShape, split_range
from dhisparse.engine.parallel.sharding import shard_weights
from dhisparse.engine.parallel.stats import aggregate
from dhisparse.engine.request import RequestUpdate
from dhisparse.errors import ConfigError
from dhisparse.model.config import ModelConfig
from dhisparse.model.layers import gated_mlp
from dhisparse_planner.comm import HIDDEN_AND_VOCAB, comm_table, model_comm, parallel_shape, step_comm_bytes
from dhisparse_planner.specs import DSV32


def _cfg(**overrides) -> ModelConfig:
    family, extra = CONFIGS["glm_fsfs_sparse"]
    raw = {**BASE, **extra, **overrides, "model_type": family, "index_topk_pattern": None,
           "indexer_types": ["full", "shared", "full", "shared"]}
    return ModelConfig.from_hf_dict(raw)


def test_split_range_covers_everything_once() -> None:
    for total in (1, 7, 16, 97):
        for parts in (1, 2, 3, 8):
            ranges = [split_range(total, parts, i) for i in range(parts)]
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
            assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


def test_shape_checks_name_the_field() -> None:
    cfg = _cfg()
    ParallelShape(2, 1, True).check_model(cfg)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        ParallelShape(3).check_model(cfg)
    with pytest.raises(ConfigError, match="n_routed_experts"):
        ParallelShape(1, 3, True).check_model(cfg)
    with pytest.raises(ConfigError, match="cannot both"):
        ParallelShape(2, 2)
    with pytest.raises(ConfigError, match="attention split inside data-parallel groups"):
        EngineConfig(tensor_parallel_size=2, data_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="collective_timeout_s"):
        EngineConfig(collective_timeout_s=0)
    assert EngineConfig(data_parallel_size=4).world_size == 4


def _weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from dhisparse.model.weights import expected_shapes

    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g, dtype=torch.float64) for name, shape in
            expected_shapes(cfg).items()}


@pytest.mark.parametrize("shape", [ParallelShape(2), ParallelShape(1, 2), ParallelShape(2, 1, True),
                                   ParallelShape(1, 2, True), ParallelShape(4)], ids=str)
def test_weight_slices_add_back_up(shape: ParallelShape) -> None:
    """Concatenating the ranks' slices gives back each split tensor; a dense MLP's partial outputs sum to the whole
    MLP's output (column-parallel gate/up, row-parallel down)."""
    cfg = _cfg()
    whole = _weights(cfg)
    slices = [shard_weights(whole, cfg, shape, r) for r in range(shape.world_size)]
    a = "model.layers.0.self_attn."
    if shape.attention_split > 1:
        assert torch.equal(torch.cat([s[a + "q_b_proj.weight"] for s in slices]), whole[a + "q_b_proj.weight"])
        assert torch.equal(torch.cat([s[a + "o_proj.weight"] for s in slices], dim=1), whole[a + "o_proj.weight"])
        x = a + "indexer."
        assert torch.equal(torch.cat([s[x + "weights_proj.weight"] for s in slices]), whole[x + "weights_proj.weight"])
    else:
        assert all(s[a + "q_b_proj.weight"] is whole[a + "q_b_proj.weight"] for s in slices)
    assert all(s[a + "kv_a_proj_with_mqa.weight"] is whole[a + "kv_a_proj_with_mqa.weight"] for s in slices)
    m = "model.layers.0.mlp."
    x = torch.randn(5, cfg.hidden_size, dtype=torch.float64)
    names = (m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight")
    partial = sum(gated_mlp(x, *(s[n] for n in names)) for s in slices)
    torch.testing.assert_close(partial, gated_mlp(x, *(whole[n] for n in names)), rtol=1e-12, atol=1e-12)
    e = "model.layers.1.mlp.experts.gate_proj"
    if shape.expert_parallel:
        assert torch.equal(torch.cat([s[e] for s in slices]), whole[e])
    else:
        assert torch.equal(torch.cat([s[e] for s in slices], dim=1), whole[e])
    shared = "model.layers.1.mlp.shared_experts.gate_proj.weight"
    if shape.expert_parallel and shape.data_parallel:
        assert all(s[shared] is whole[shared] for s in slices)  # whole on every rank
    else:
        assert torch.equal(torch.cat([s[shared] for s in slices]), whole[shared])


def test_whole_indexer_under_tensor_parallelism() -> None:
    cfg = _cfg(index_n_heads=5)
    ParallelShape(2, split_indexer=False).check_model(cfg)  # the indexer's heads need not divide when not split
    with pytest.raises(ConfigError, match="index_n_heads"):
        ParallelShape(2).check_model(cfg)
    whole = _weights(_cfg())
    x = "model.layers.0.self_attn.indexer."
    for rank in range(2):
        mine = shard_weights(whole, _cfg(), ParallelShape(2, split_indexer=False), rank)
        assert mine[x + "wq_b.weight"] is whole[x + "wq_b.weight"]
        assert mine["model.layers.0.self_attn.q_b_proj.weight"].shape[0] * 2 == \
            whole["model.layers.0.self_attn.q_b_proj.weight"].shape[0]


def test_vocab_shard_pads_and_gathers_back() -> None:
    head = torch.randn(97, 8, dtype=torch.float64)
    shards = [vocab_shard(head, 2, r) for r in range(2)]
    assert shards[0].shape == shards[1].shape == (49, 8)
    h = torch.randn(3, 8, dtype=torch.float64)
    logits = torch.cat([torch.nn.functional.linear(h, s) for s in shards], dim=-1)[..., :97]
    # Each logit is still one dot product over the whole hidden size, but a matmul's kernel (its blocking) depends
    # on the matrix shape: equal to rounding, not necessarily to the bit (docs/parallel.md, Exactness).
    torch.testing.assert_close(logits, torch.nn.functional.linear(h, head), rtol=1e-13, atol=1e-13)


def test_combine_adds_experts_in_ascending_order_from_zero() -> None:
    """Slots hold experts 2, 0, 1: ascending order gives (1e16 + 1) - 1e16 = 0 in float64, slot order 1."""
    y = torch.tensor([[[-1e16], [1e16], [1.0]]], dtype=torch.float64)
    ids = torch.tensor([[2, 0, 1]])
    weights = torch.ones(1, 3)
    assert combine(y, weights, ids, torch.float64).item() == 0.0
    assert ((y[0, 0] + y[0, 1]) + y[0, 2]).item() == 1.0  # the order matters for the bits


def test_placement_by_kv_demand() -> None:
    assert least_loaded([0, 0], [0, 0]) == 0
    assert least_loaded([100, 40], [1, 3]) == 1
    assert least_loaded([40, 40], [2, 1]) == 1
    assert least_loaded([40, 40, 10], [0, 0, 9]) == 2


def test_statistics_aggregate_by_shape() -> None:
    r0 = {"generated_tokens": 10.0, "kv_pool_bytes": 100.0, "draft_tokens_proposed": 8.0,
          "draft_tokens_accepted": 4.0, "draft_acceptance_rate": 0.5, "comm_bytes_moe_all_reduce": 7.0,
          "process_id": 11.0, "spec_ring_bytes_per_request": 3.0}
    r1 = {**r0, "generated_tokens": 6.0, "draft_tokens_accepted": 8.0, "draft_acceptance_rate": 1.0,
          "process_id": 12.0}
    dp = aggregate(ParallelShape(1, 2), [r0, r1])
    assert dp["generated_tokens"] == 16 and dp["kv_pool_bytes"] == 200 and dp["draft_acceptance_rate"] == 12 / 16
    assert dp["spec_ring_bytes_per_request"] == 3 and "process_id" not in dp
    assert dp["rank0_process_id"] == 11 and dp["rank1_kv_pool_bytes"] == 100
    tp = aggregate(ParallelShape(2), [r0, r0])
    assert tp["generated_tokens"] == 10 and tp["comm_bytes_moe_all_reduce"] == 14  # requests replicated; traffic summed
    assert tp["parallel_device_pool_bytes"] == 200


def test_digest_ignores_the_clock_not_decisions() -> None:
    updates = [RequestUpdate("a", [1, 2], False)]
    base = digest(updates, {"kv_rows_host": 3.0, "kv_admission_wait_seconds": 0.1})
    assert base == digest(updates, {"kv_rows_host": 3.0, "kv_admission_wait_seconds": 0.7})
    assert base != digest(updates, {"kv_rows_host": 4.0, "kv_admission_wait_seconds": 0.1})
    assert base != digest([RequestUpdate("a", [1, 3], False)], {"kv_rows_host": 3.0, "kv_admission_wait_seconds": 0.1})


def test_local_ranks() -> None:
    assert parse_ranks("0-3", 8) == (0, 1, 2, 3)
    assert parse_ranks("0,2-3", 4) == (0, 2, 3)
    for bad in ("1-3", "0-8", "x"):
        with pytest.raises(ConfigError, match="DHISPARSE_LOCAL_RANKS"):
            parse_ranks(bad, 8)


def test_communication_model_arithmetic() -> None:
    cfg = _cfg()
    h, e, layers = cfg.hidden_size, 2, cfg.num_hidden_layers
    tp = forward_comm_bytes(cfg, ParallelShape(2), [ForwardShape(3, 1, 100)], e)
    assert tp[0] == tp[1]
    assert tp[0]["attention_all_reduce"] == layers * 3 * h * e
    assert tp[0]["indexer_all_reduce"] == len(cfg.indexer_layers) * 3 * 100 * 4  # 2 "full" layers of FSFS
    assert tp[0]["dense_all_reduce"] + tp[0]["moe_all_reduce"] == layers * 3 * h * e
    assert tp[0]["lm_head_all_gather"] == 3 * (cfg.vocab_size // 2) * e
    dp = forward_comm_bytes(cfg, ParallelShape(1, 2), [ForwardShape(3, 1, 50), ForwardShape(1, 1, 9)], e)
    assert dp[0]["dense_all_gather"] == dp[1]["dense_all_gather"] == 3 * h * e  # padded to the larger group
    assert dp[0]["dense_all_to_all"] == 1 * h * e and dp[1]["dense_all_to_all"] == 3 * h * e
    assert "attention_all_reduce" not in dp[0]
    ep = decode_comm_bytes(cfg, ParallelShape(1, 2, True), 4, 64, e)
    moe = sum(k != "dense" for k in cfg.mlp_layer_types)
    assert ep["moe_dispatch_all_to_all"] == moe * 4 * cfg.num_experts_per_tok * 0.5 * (h * e + 8)
    assert ep["sync_all_gather"] == 16 + DP_STEP_CLOSE_BYTES
    assert ep["total"] == pytest.approx(sum(v for k, v in ep.items() if k != "total"))
    assert forward_comm_bytes(cfg, ParallelShape(), [ForwardShape(1, 1, 1)], e) == [{}]
    whole = forward_comm_bytes(cfg, ParallelShape(2, split_indexer=False), [ForwardShape(3, 1, 100)], e)[0]
    assert "indexer_all_reduce" not in whole and whole["attention_all_reduce"] == tp[0]["attention_all_reduce"]
    # the planner's description of the same model gives the same figures
    described = ModelComm(hidden_size=h, vocab_size=cfg.vocab_size, num_layers=layers, dense_layers=1, moe_layers=3,
                          experts_per_token=cfg.num_experts_per_tok, indexer_rates=(1, 1))
    assert described == ModelComm.of(cfg)
    assert decode_comm_bytes(described, ParallelShape(2, 1, True), 8, 4096, e) == \
        decode_comm_bytes(cfg, ParallelShape(2, 1, True), 8, 4096, e)


def test_engine_config_round_trips_the_parallel_options(tmp_path) -> None:
    cfg = EngineConfig(tensor_parallel_size=2, expert_parallel=True, collective_timeout_s=5.0)
    (tmp_path / "runtime.json").write_text(cfg.to_json())
    loaded = EngineConfig.load(tmp_path / "runtime.json")
    assert dataclasses.asdict(loaded) == dataclasses.asdict(cfg)


def test_per_rank_statistics_are_labelled_gauges() -> None:
    """``rank{r}_<stat>`` → the gauge ``dhisparse_rank_<stat>{…, rank="r"}``: one family for every rank's series."""
    from dhisparse.serving.engine_metrics import EngineMetrics, per_rank

    assert per_rank("rank1_kv_pool_bytes", {"model": "m"}) == ("rank_kv_pool_bytes", {"model": "m", "rank": "1"})
    assert per_rank("kv_pool_bytes", {"model": "m"}) == ("kv_pool_bytes", {"model": "m"})

    class Family:
        GAUGE = "gauge"
        made: list[str] = []

        def __init__(self, name: str, description: str, kind: str) -> None:
            self.name, self.series = name, {}
            Family.made.append(name)

        def Metric(self, labels: dict) -> Family.Series:
            series = self.series[tuple(sorted(labels.items()))] = Family.Series()
            return series

        class Series:
            value = None

            def set(self, value: float) -> None:
                self.value = value

    class Pb:
        MetricFamily = Family

    metrics = EngineMetrics(Pb, {"model": "dhisparse"})
    metrics.update({"kv_pool_bytes": 200.0, "rank0_kv_pool_bytes": 100.0, "rank1_kv_pool_bytes": 100.0})
    assert sorted(Family.made) == ["dhisparse_kv_pool_bytes", "dhisparse_rank_kv_pool_bytes"]
    ranks = metrics._families["rank_kv_pool_bytes"].series
    assert {dict(k)["rank"]: s.value for k, s in ranks.items()} == {"0": 100.0, "1": 100.0}


def test_the_planner_prices_a_step_with_the_runtime_model() -> None:
    """dhisparse_planner.comm describes the planned model and deployment in the runtime's terms: the figures of
    docs/parallel.md's table (DeepSeek-V3.2, bfloat16, 8 GPUs, batch 32 per rank) and no shape the runtime lacks."""
    comm = model_comm(DSV32, *HIDDEN_AND_VOCAB[DSV32.name])
    assert (comm.dense_layers, comm.moe_layers, len(comm.indexer_rates)) == (3, 58, 61)
    assert parallel_shape(DSV32) == ParallelShape(8)
    assert parallel_shape(DSV32.with_(attention_dp=8), expert_parallel=True) == ParallelShape(1, 8, True)
    with pytest.raises(ValueError, match="inside data-parallel groups"):
        parallel_shape(DSV32.with_(attention_dp=2))
    step = step_comm_bytes(comm, DSV32, 32, 32768, 2)
    assert step == decode_comm_bytes(comm, ParallelShape(8), 32, 32768, 2)
    assert round(step["total"] / 2**20) == 298 and round(step["indexer_all_reduce"] / 2**20) == 244
    table = comm_table()
    for figures in ("| 298 MiB | 799 MiB |", "| 54 MiB | 54 MiB |", "| 214 MiB | 214 MiB |", "| 366 MiB | 366 MiB |"):
        assert figures in table

"""Deployment shape (issue 28, point 7): attention tensor-parallel over the instance (one KV pool holds every
request, the latent replicated) or data-parallel (each GPU its own requests and pool); MoE over all GPUs."""

from __future__ import annotations

import pytest

from dhisparse_planner.specs import DSV32, DSV32_PARAMS, GLM5, GLM5_PARAMS, H200
from dhisparse_planner.timing import StepLoad, decode_step_seconds, prefill_seconds, weight_bytes_read


def test_the_config_split_reproduces_the_model_cards() -> None:
    glm_total = GLM5_PARAMS["dense"] + 75 * 256 * GLM5_PARAMS["expert"] + 154880 * 6144
    assert glm_total == pytest.approx(744e9, rel=0.01)
    assert GLM5_PARAMS["dense"] + 75 * 8 * GLM5_PARAMS["expert"] == pytest.approx(40e9, rel=0.025)
    ds_total = DSV32_PARAMS["dense"] + 58 * 256 * DSV32_PARAMS["expert"] + 129280 * 7168
    assert ds_total == pytest.approx(671e9, rel=0.01)
    assert DSV32_PARAMS["dense"] + 58 * 8 * DSV32_PARAMS["expert"] == pytest.approx(37e9, rel=0.02)
    assert GLM5.attention_params == GLM5_PARAMS["attention"] and DSV32.dense_params == DSV32_PARAMS["dense"]


def test_data_parallel_attention_replicates_attention_weights_and_splits_the_rest() -> None:
    tp, dp = GLM5, GLM5.with_(attention_dp=8)
    assert (tp.attn_tp, dp.attn_tp) == (8, 1) and dp.heads_per_gpu == 64 and tp.heads_per_gpu == 8
    b = GLM5.weight_bytes_per_param
    assert tp.weight_bytes_per_gpu == pytest.approx(GLM5.total_params * b / 8)
    assert dp.weight_bytes_per_gpu == pytest.approx((GLM5.attention_params + (GLM5.total_params
                                                                              - GLM5.attention_params) / 8) * b)
    assert dp.kv_pool_bytes(H200) < tp.kv_pool_bytes(H200)
    # one rank's 16 tokens are the instance's 128 through the MoE: the experts touched are the instance's
    assert weight_bytes_read(dp, 16) - GLM5.attention_params * b * 7 / 8 == pytest.approx(weight_bytes_read(tp, 128))
    with pytest.raises(ValueError, match="attention_dp"):
        GLM5.with_(attention_dp=3)


def test_tensor_parallel_attention_keeps_the_former_step_cost() -> None:
    m = GLM5
    load = StepLoad(batch=32, query_tokens=32, attention_rows=32 * 2048.0 * 78, index_keys_scanned=32 * 32768.0 * 78,
                    index_keys_read=32 * 32768.0 * 78, host_bytes=0.0)
    got = decode_step_seconds(H200, m, load)
    flops = (2.0 * m.active_params / m.gpus * 32 + 2.0 * m.index_heads * m.index_head_dim * load.index_keys_scanned
             / m.gpus + m.attn_flops_per_head_row * m.attn_heads * load.attention_rows)
    assert got["flops_s"] == pytest.approx(flops / (H200.flops_per_s * H200.mfu))
    # data-parallel: 4 requests per rank, 8 ranks: the same instance work spread over the same 8 GPUs
    dp = m.with_(attention_dp=8)
    rank = StepLoad(batch=4, query_tokens=4, attention_rows=load.attention_rows / 8,
                    index_keys_scanned=load.index_keys_scanned / 8, index_keys_read=load.index_keys_read / 8,
                    host_bytes=0.0)
    assert decode_step_seconds(H200, dp, rank)["flops_s"] == pytest.approx(got["flops_s"])
    assert prefill_seconds(H200, dp, 32768) == pytest.approx(8 * prefill_seconds(H200, m, 32768))

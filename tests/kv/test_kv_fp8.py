"""FP8 KV rows: FlashMLA's 656-byte layout, a bounded quantization error, and a hierarchy that stays exact for the
quantized format (every policy gives the tokens of fully resident FP8 serving)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import random_prompts

from dhisparse import LLM, SamplingParams
from dhisparse.kv.footprint import request_footprint
from dhisparse.kv.fp8 import (
    dequantize_keys,
    dequantize_rows,
    fp8_key_bytes,
    fp8_row_bytes,
    quantize_keys,
    quantize_rows,
)


def test_glm_and_deepseek_rows_are_656_bytes_and_round_trip_within_fp8_precision() -> None:
    assert fp8_row_bytes(512, 64) == 656
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 7, 576, generator=g, dtype=torch.float32) * torch.rand(3, 7, 1, generator=g) * 10
    rows[0, 0, :128] = 0  # an all-zero group keeps scale 1
    packed = quantize_rows(rows, 512)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (3, 7, 656)
    back = dequantize_rows(packed, 512, torch.float32)
    latent, rope = rows[..., :512].reshape(3, 7, 4, 128), rows[..., 512:]
    err = (back[..., :512].reshape(3, 7, 4, 128) - latent).abs()
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the group's largest value (plus subnormal steps)
    assert bool((err <= latent.abs().amax(-1, keepdim=True) * 2**-4 + 1e-30).all())
    assert torch.equal(back[..., 512:], rope.to(torch.bfloat16).float())
    assert not bool(back[0, 0, :128].any())


def test_every_policy_gives_the_tokens_of_fully_resident_fp8(tiny_engine) -> None:
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    prompts = random_prompts([50, 97], 96, seed=7)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    resident = LLM(engine_dir, kv_policy="resident", kv_dtype="fp8", page_rows=4)
    assert resident.engine.kv.layout.row_bytes == 32 + 4 + 2 * 8  # tiny model: latent 32, rope 8
    expected = [o.token_ids for o in resident.generate(prompts, params)]
    layout, config = resident.engine.kv.layout, resident.engine.kv.config
    for policy, scale in (("hisparse", 1.0), ("adaptive", 2.5)):  # tight pools: host fetches, reclaim and refill
        smallest = request_footprint(layout, dataclasses.replace(config, policy=policy), 97, 10).required_bytes
        llm = LLM(engine_dir, kv_policy=policy, kv_dtype="fp8", page_rows=4, pool_bytes=int(scale * smallest))
        got = [o.token_ids for o in llm.generate(prompts, params)]
        assert got == expected, f"{policy} fp8 changed the tokens"
        assert llm.stats()["kv_rows_host"] > 0
        llm.engine.kv.check_invariants()


def test_fp8_needs_a_hierarchy_policy() -> None:
    from dhisparse.engine.config import EngineConfig
    from dhisparse.errors import ConfigError

    with pytest.raises(ConfigError, match="kv_dtype"):
        EngineConfig(kv_policy="dense", kv_dtype="fp8")


def test_fp8_indexer_keys_are_132_bytes_and_round_trip_within_fp8_precision() -> None:
    assert fp8_key_bytes(128) == 132
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(5, 9, 128, generator=g) * torch.rand(5, 9, 1, generator=g) * 4
    keys[0, 0] = 0  # an all-zero key keeps scale 1
    packed = quantize_keys(keys)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (5, 9, 132)
    back = dequantize_keys(packed, torch.float32)
    assert bool(((back - keys).abs() <= keys.abs().amax(-1, keepdim=True) * 2**-4 + 1e-30).all())
    assert not bool(back[0, 0].any())
    assert not bool(dequantize_keys(torch.zeros(3, 132, dtype=torch.uint8), torch.float32).any())  # padding


def test_every_policy_gives_the_tokens_of_fully_resident_fp8_keys(tiny_engine) -> None:
    """FP8 indexer keys (with FP8 rows and alone): stored as e4m3 + scale, scored dequantized; the hierarchy stays
    exact for them, and the footprint counts the stored key size."""
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    prompts = random_prompts([50, 97], 96, seed=8)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for kv_dtype in ("fp8", "auto"):
        resident = LLM(engine_dir, kv_policy="resident", kv_dtype=kv_dtype, index_key_dtype="fp8", page_rows=4)
        layout = resident.engine.kv.layout
        assert layout.index_key_bytes == 16 + 4  # tiny model: index_head_dim 16
        expected = [o.token_ids for o in resident.generate(prompts, params)]
        for policy in ("hisparse", "adaptive"):
            smallest = request_footprint(layout, dataclasses.replace(resident.engine.kv.config, policy=policy),
                                         97, 10).required_bytes
            llm = LLM(engine_dir, kv_policy=policy, kv_dtype=kv_dtype, index_key_dtype="fp8", page_rows=4,
                      pool_bytes=int(1.5 * smallest))
            got = [o.token_ids for o in llm.generate(prompts, params)]
            assert got == expected, f"{policy} (rows {kv_dtype}) with fp8 keys changed the tokens"
            llm.engine.kv.check_invariants()
    with pytest.raises(Exception, match="index_key_dtype"):
        LLM(engine_dir, kv_policy="dense", index_key_dtype="fp8")

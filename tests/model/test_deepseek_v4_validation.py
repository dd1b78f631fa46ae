"""DeepSeek-V4 config and checkpoint validation: every problem names its field or tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_v4 import make_v4_checkpoint

from dhisparse.errors import CheckpointError, ConfigError
from dhisparse.model.deepseek_v4.config import DeepseekV4Config
from dhisparse.model.loading import load_any_state_dict, read_any_config


@pytest.fixture(scope="module")
def raw_config(tiny_root):
    return json.loads((make_v4_checkpoint(tiny_root, "v4_small_topk") / "config.json").read_text())


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries"),
    ({"layer_types": ["sliding_attention", "dense", "sliding_attention", "sliding_attention"]}, "layer_types entries"),
    ({"mlp_layer_types": ["moe", "moe", "moe", "sparse"]}, "mlp_layer_types entries"),
    ({"o_groups": 3}, "o_groups"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"head_dim": None}, "'head_dim'"),
    ({"index_topk": 0}, "index_topk must be positive"),
    ({"kv_source_layers": [0, 1, 2, 4]}, r"kv_source_layers\[3\] = 4"),
    ({"kv_source_layers": [0, 1, 1, 3]}, r"kv_source_layers\[2\] = 1.*both be CSA or both be HCA"),
    ({"kv_source_layers": [0, 1, 2, 1], "kv_source_shares_topk": [False, True, False, True]},
     r"kv_source_shares_topk\[1\]"),
])
def test_config_errors_name_the_field(raw_config, change, message):
    with pytest.raises(ConfigError, match=message):
        DeepseekV4Config.from_hf_dict({**raw_config, **change})


def test_legacy_fields_fold_in_like_transformers(raw_config):
    legacy = {k: v for k, v in raw_config.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates")}
    cfg = DeepseekV4Config.from_hf_dict({**legacy, "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1})
    assert cfg.layer_types[2] == "heavily_compressed_attention" and cfg.compress_rate_hca == 128
    assert cfg.mlp_layer_types == ("hash_moe", "moe", "moe", "moe")


def test_missing_and_misshaped_tensors_are_all_listed(tiny_root):
    src = make_v4_checkpoint(tiny_root, "v4_small_topk", original_format=False)
    bad = tiny_root / "v4_broken"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(src, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.self_attn.compressor.indexer.position_bias"]
    del tensors["model.hc_head.hc_fn"]
    tensors["model.layers.2.self_attn.sinks"] = tensors["model.layers.2.self_attn.sinks"][:2].clone()
    save_file(tensors, str(bad / "model.safetensors"))
    cfg = read_any_config(bad)
    with pytest.raises(CheckpointError) as err:
        load_any_state_dict(bad, cfg, torch.float32)
    text = str(err.value)
    assert "model.layers.1.self_attn.compressor.indexer.position_bias: missing" in text
    assert "model.hc_head.hc_fn: missing" in text
    assert "model.layers.2.self_attn.sinks: shape [2], expected [4]" in text


def test_fp8_weights_are_refused_by_name(tiny_root):
    src = make_v4_checkpoint(tiny_root, "v4_small_topk", original_format=False)
    bad = tiny_root / "v4_fp8"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(src, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.self_attn.q_b_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"{name}: stored as torch.float8_e4m3fn"):
        load_any_state_dict(bad, read_any_config(bad), torch.float32)

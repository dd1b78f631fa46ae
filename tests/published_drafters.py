"""Random drafters in the published formats, sized for a given target (for end-to-end and packing tests).

Exactness against the publishers' code is ``tests/spec/test_published_fixtures.py`` (checkpoints written by that
code); these only need to be valid checkpoints of the right shapes, laid out as the publishers lay them out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dhisparse.spec.published.dspark_v4 import V4DSparkSpec, v4_expected_shapes
from dhisparse.spec.published.qwen_block import qwen_expected_shapes
from dhisparse.spec.published.qwen_config import parse_qwen_drafter

ARCH = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}


def qwen_drafter_config(fmt: str, *, hidden: int, vocab: int, target_layers: int, layer_ids: list[int],
                        block: int = 5, **extra: Any) -> dict[str, Any]:
    """A ``config.json`` of ``fmt`` (dflash, dflash2, dspark) as its publisher writes it."""
    cfg: dict[str, Any] = {
        "architectures": [ARCH[fmt]], "model_type": "qwen3", "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": vocab, "max_position_embeddings": 4096,
        "hidden_act": "silu", "attention_bias": False, "num_target_layers": target_layers,
        "layer_types": ["full_attention"] * 2, "sliding_window": None, "tie_word_embeddings": False,
    }
    if fmt == "dspark":
        cfg.update(block_size=block, mask_token_id=vocab - 1, target_layer_ids=layer_ids, num_anchors=8,
                   markov_rank=8, markov_head_type="vanilla", enable_confidence_head=True,
                   confidence_head_with_markov=True)
    else:
        cfg.update(block_size=block, dflash_config={"mask_token_id": vocab - 1, "target_layer_ids": layer_ids})
    if fmt == "dflash2":
        cfg["is_causal"] = False
        cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=6)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    return cfg


def _random(shape: tuple[int, ...], name: str, gen: torch.Generator) -> torch.Tensor:
    if name.endswith(("norm.weight", "_norm.weight")) or "layernorm" in name:
        return 1 + 0.2 * torch.randn(shape, generator=gen)
    if name.endswith(("hc_attn_base", "hc_ffn_base", "hc_head_base", "attn_sink", "gate.bias")):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith(("_scale",)):
        return 1 + 0.2 * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * (1.5 / max(1.0, shape[-1] ** 0.5))


def write_qwen_drafter(out: Path, config: dict[str, Any], target_hidden: int, seed: int = 0,
                       dtype: torch.dtype = torch.float32) -> Path:
    fmt = {v: k for k, v in ARCH.items()}[config["architectures"][0]]
    parsed = parse_qwen_drafter(config, fmt, "test drafter")
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: _random(s, n, gen).to(dtype) for n, s in qwen_expected_shapes(parsed, target_hidden).items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def add_v4_dspark(target_checkpoint: Path, out: Path, *, block: int = 5, markov_rank: int = 8,
                  layer_ids: tuple[int, ...] = (1, 2, 3), stages: int = 3, seed: int = 0) -> Path:
    """A copy of a tiny DeepSeek-V4 checkpoint that carries DSpark stages ``mtp.{0..stages-1}.*`` (DeepSeek's names)
    and the ``dspark_*`` config fields, as DeepSeek-V4-Flash-DSpark ships them."""
    import shutil

    from dhisparse.model.deepseek_v4.config import DeepseekV4Config

    if (out / "config.json").exists():
        return out
    shutil.copytree(target_checkpoint, out)
    raw = json.loads((out / "config.json").read_text())
    raw.update(dspark_block_size=block, dspark_noise_token_id=raw["vocab_size"] - 1,
               dspark_target_layer_ids=list(layer_ids), dspark_markov_rank=markov_rank)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    cfg = DeepseekV4Config.from_hf_dict(raw)
    spec = V4DSparkSpec.parse(raw, cfg, stages, "test")
    gen = torch.Generator().manual_seed(seed)
    save_file({n: _random(s, n, gen) for n, s in v4_expected_shapes(cfg, spec).items()},
              str(out / "mtp.safetensors"))
    index = out / "model.safetensors.index.json"
    if index.exists():  # keep a sharded checkpoint's index complete
        data = json.loads(index.read_text())
        data["weight_map"].update({n: "mtp.safetensors" for n in v4_expected_shapes(cfg, spec)})
        index.write_text(json.dumps(data))
    return out

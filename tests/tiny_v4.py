"""Tiny random-init DeepSeek-V4 checkpoints written by transformers' ``save_pretrained`` (the reference)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

CSA, HCA, SW = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

BASE: dict[str, Any] = dict(
    vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
    head_dim=32, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4, partial_rotary_factor=0.25,
    layer_types=[SW, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 8}, sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=16,
    index_head_dim=16, index_topk=3, hc_mult=4, hc_sinkhorn_iters=5, max_position_embeddings=512,
    initializer_range=0.2, bos_token_id=None, eos_token_id=None,
)

# Sizes the exactness tests sweep: top-k below and above the number of compressed entries, several
# compress/sliding sizes, yarn on the compress RoPE set, every layer and MLP type.
CONFIGS: dict[str, dict[str, Any]] = {
    "v4_small_topk": {},
    "v4_large_topk_yarn": dict(
        index_topk=64, sliding_window=5, compress_rates={CSA: 3, HCA: 7}, layer_types=[HCA, CSA, SW, CSA, HCA],
        num_hidden_layers=5, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1}),
}


def make_v4_checkpoint(root: Path, name: str, seed: int = 0, original_format: bool = True) -> Path:
    """Write the named tiny model to ``root/name`` (once; DeepSeek's names unless ``original_format=False``)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    out = root / (name if original_format else f"{name}_hf_names")
    if (out / "config.json").exists():
        return out
    cfg = DeepseekV4Config(**{**BASE, **CONFIGS[name]})
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg)
    with torch.no_grad():  # the reference initialises these to constants; randomise so they matter
        g = torch.Generator().manual_seed(seed + 1)
        for pname, p in [*model.named_parameters(), *model.named_buffers()]:
            if pname.endswith("tid2eid"):
                p.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                                     for _ in range(cfg.vocab_size)]))
            elif pname.endswith(("e_score_correction_bias", "sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif pname.endswith((".scale", "hc_scale")):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(out, save_original_format=original_format)
    return out


def load_v4_reference(path: Path, dtype: torch.dtype = torch.float64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    ).eval()

"""Tiny random-init DSA checkpoints written by transformers' ``save_pretrained`` (the reference models)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

BASE: dict[str, Any] = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, index_head_dim=16,
    index_n_heads=16, first_k_dense_replace=1, max_position_embeddings=1024, n_group=1, topk_group=1,
    initializer_range=0.1, bos_token_id=None, eos_token_id=None,
)

# Configurations the exactness tests sweep: both families, index_topk below and above the prompt lengths,
# a GLM sharing pattern, MoE (with and without expert groups) and dense-only layers, scaled RoPE variants.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "glm_fsfs_sparse": ("glm_moe_dsa", dict(index_topk=8, index_topk_pattern="FSFS")),
    "glm_fssf_linear": ("glm_moe_dsa", dict(index_topk=16, index_topk_pattern="FSSF", num_hidden_layers=4,
                                            rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 10000.0})),
    "dsv32_sparse_yarn": ("deepseek_v32", dict(
        index_topk=12, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 256, "beta_fast": 32,
                         "beta_slow": 1})),
    "dsv32_dense_topk_large": ("deepseek_v32", dict(index_topk=512, first_k_dense_replace=3, num_hidden_layers=3)),
}


# Depth variants of ``glm_fsfs_sparse`` (not part of the exactness sweep): host reads per step must not depend on
# the number of layers, and per-layer KV overhead is measured on a deeper model (scripts/bench_model.py).
DEPTH_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    f"glm_fsfs_{n}layer": ("glm_moe_dsa", dict(index_topk=8, index_topk_pattern="FS" * (n // 2), num_hidden_layers=n))
    for n in (2, 12, 16)
}


def make_checkpoint(root: Path, name: str, seed: int = 0) -> Path:
    """Write the named tiny model to ``root/name`` (once) and return the directory."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    out = root / name
    if (out / "config.json").exists():
        return out
    family, overrides = CONFIGS[name] if name in CONFIGS else DEPTH_VARIANTS[name]
    kwargs = {**BASE, **overrides}
    if family == "glm_moe_dsa":
        cfg, cls = GlmMoeDsaConfig(**kwargs), GlmMoeDsaForCausalLM
    else:
        kwargs.pop("index_topk_pattern", None)
        cfg, cls = DeepseekV32Config(**kwargs), DeepseekV32ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # non-zero router bias so the correction term is exercised
        for name_, p in model.named_buffers():
            if name_.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    return out


def load_reference(path: Path, dtype: torch.dtype = torch.float64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def build_spec_engine(root: Path, checkpoint: Path, dtype: str = "float64", vocab_size: int = 96,
                      target_hidden_size: int = 64) -> Path:
    """An engine of ``checkpoint`` (a tiny target whose layers 1 and 3 feed the drafters) packed with small
    random-init drafters of both kinds."""
    from dhisparse.spec.drafters import DFlash2Config, DFlash2Drafter, DSparkConfig, DSparkDrafter, save_drafter
    from dhisparse_builder import BuildOptions, build_engine

    if (root / "engine" / "runtime.json").exists():
        return root / "engine"
    torch.manual_seed(0)
    common = dict(vocab_size=vocab_size, target_hidden_size=target_hidden_size, hidden_size=32, num_layers=1,
                  num_heads=2, intermediate_size=64, max_block=8)
    save_drafter(DFlash2Drafter(DFlash2Config(target_layer_ids=(1, 3), window=16, **common)), root / "dflash2")
    save_drafter(DSparkDrafter(DSparkConfig(target_layer_ids=(3,), markov_rank=4, confidence_hidden=16, **common)),
                 root / "dspark")
    return build_engine(BuildOptions(checkpoint, root / "engine", {"dtype": dtype},
                                     drafters=(root / "dflash2", root / "dspark")), progress=lambda d, t: None)

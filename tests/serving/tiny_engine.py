"""A tiny random-init GLM-MoE-DSA engine with a byte-level BPE tokenizer, for serving tests.

Built from a transformers checkpoint through the real `dhisparse-build` path (`build_engine`). Takes a
few seconds on CPU; the serving tests build it once per session.
"""

from __future__ import annotations

import os
from pathlib import Path

from tiny_tokenizer import save_tokenizer

VOCAB_SIZE = 320
MAX_POSITIONS = 512


def build_checkpoint(directory: Path, seed: int = 0) -> Path:
    """Save a tiny random `GlmMoeDsaForCausalLM` (2 layers, 16 indexer heads, top-k 8) with a tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    config = GlmMoeDsaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_topk=8, index_head_dim=16,
        index_n_heads=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, max_position_embeddings=MAX_POSITIONS, eos_token_id=0,
        bos_token_id=None, pad_token_id=None, index_topk_pattern="FS",
    )
    model = GlmMoeDsaForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    save_tokenizer(directory, VOCAB_SIZE)
    return directory


def build_tiny_engine(directory: Path, **runtime: object) -> Path:
    """Checkpoint -> engine directory `directory/engine` (runtime.json fields from `runtime`)."""
    from dhisparse_builder.build import BuildOptions, build_engine

    checkpoint = build_checkpoint(directory / "checkpoint")
    return build_engine(BuildOptions(checkpoint, directory / "engine", dict(runtime), force=True))

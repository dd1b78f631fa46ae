"""Checkpoint reading and validation with the parameter names transformers uses for DSA models.

A checkpoint directory holds ``config.json`` and one or more ``*.safetensors`` files (sharded checkpoints carry a
``model.safetensors.index.json``). Routed experts may be stored one by one (``mlp.experts.{e}.gate_proj.weight`` —
what ``save_pretrained`` writes), stacked (``mlp.experts.gate_proj`` ``[E, I, H]``, the engine format) or fused as
transformers holds them in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from dhisparse.errors import CheckpointError
from dhisparse.model.config import ModelConfig

# Parameters that transformers keeps in float32 whatever the model dtype (``_keep_in_fp32_modules``).
FLOAT32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")


def _confined(checkpoint: Path, name: object) -> Path:
    """A shard named by the index: a plain ``*.safetensors`` file name inside the checkpoint directory (symbolic links
    resolved), never a path that leaves it (``../x``, ``/etc/x``)."""
    root = checkpoint.resolve()
    if not isinstance(name, str) or not name.endswith(".safetensors"):
        raise CheckpointError(f"{checkpoint}: the index names shard {name!r}, not a .safetensors file")
    path = (checkpoint / name).resolve()
    if path.parent != root and root not in path.parents:
        raise CheckpointError(f"{checkpoint}: the index names shard {name!r}, which lies outside the checkpoint "
                              "directory")
    return checkpoint / name


def safetensors_files(checkpoint: Path) -> list[Path]:
    """The weight files of a checkpoint directory, in shard order."""
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({_confined(checkpoint, name) for name in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{checkpoint}: shards listed in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{checkpoint}: no *.safetensors weight files found")
    return files


def iter_tensors(checkpoint: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor], tuple[int, ...]]]:
    """Yield ``(name, load, shape)`` for every tensor, loading lazily so shapes can be checked first."""
    for path in safetensors_files(checkpoint):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                shape = tuple(handle.get_slice(name).get_shape())
                yield name, (lambda h=path, n=name: _load_one(h, n)), shape


def _load_one(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(name)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the runtime needs, in the engine's canonical names (experts stacked)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                a + "q_a_proj.weight": (cfg.q_lora_rank, h),
                a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                a + "q_b_proj.weight": (heads * cfg.qk_head_dim, cfg.q_lora_rank),
                a + "kv_a_proj_with_mqa.weight": (cfg.row_dim, h),
                a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                a + "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                a + "o_proj.weight": (h, heads * cfg.v_head_dim),
            }
        )
        if cfg.attention_bias:
            shapes.update(
                {a + "q_a_proj.bias": (cfg.q_lora_rank,), a + "kv_a_proj_with_mqa.bias": (cfg.row_dim,),
                 a + "o_proj.bias": (h,)}
            )
        if cfg.indexer_types[i] == "full":
            x = a + "indexer."
            shapes.update(
                {
                    x + "wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
                    x + "wk.weight": (cfg.index_head_dim, h),
                    x + "k_norm.weight": (cfg.index_head_dim,),
                    x + "k_norm.bias": (cfg.index_head_dim,),
                    x + "weights_proj.weight": (cfg.index_n_heads, h),
                }
            )
        m = p + "mlp."
        if cfg.mlp_layer_types[i] == "dense":
            inter = cfg.intermediate_size
            shapes.update({m + "gate_proj.weight": (inter, h), m + "up_proj.weight": (inter, h),
                           m + "down_proj.weight": (h, inter)})
        else:
            e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
            shared = inter * cfg.n_shared_experts
            shapes.update(
                {
                    m + "gate.weight": (e, h),
                    m + "gate.e_score_correction_bias": (e,),
                    m + "experts.gate_proj": (e, inter, h),
                    m + "experts.up_proj": (e, inter, h),
                    m + "experts.down_proj": (e, h, inter),
                }
            )
            if cfg.n_shared_experts > 0:
                shapes.update({m + "shared_experts.gate_proj.weight": (shared, h),
                               m + "shared_experts.up_proj.weight": (shared, h),
                               m + "shared_experts.down_proj.weight": (h, shared)})
    return shapes


def load_state_dict(
    checkpoint: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Read, validate and convert a checkpoint into canonical names and ``dtype`` (float32 where transformers
    keeps float32). Raises ``CheckpointError`` naming missing or mis-shaped tensors."""
    expected = expected_shapes(cfg)
    found: dict[str, tuple[Callable[[], torch.Tensor], tuple[int, ...]]] = {}
    for name, load, shape in iter_tensors(checkpoint):
        found[name] = (load, shape)
    out: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    total = len(expected)
    for done, (name, shape) in enumerate(expected.items(), start=1):
        tensor = _fetch(name, shape, found, cfg, problems)
        if tensor is not None:
            keep32 = name.endswith(FLOAT32_SUFFIXES)
            out[name] = tensor.to(torch.float32 if keep32 else dtype).contiguous()
        if progress is not None:
            progress(done, total)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(f"{checkpoint}: checkpoint does not match its config.json:\n  {shown}{more}")
    return out


def _fetch(
    name: str,
    shape: tuple[int, ...],
    found: dict[str, tuple[Callable[[], torch.Tensor], tuple[int, ...]]],
    cfg: ModelConfig,
    problems: list[str],
) -> torch.Tensor | None:
    if name in found:
        load, got = found[name]
        if got != shape:
            problems.append(f"{name}: shape {list(got)}, expected {list(shape)}")
            return None
        return load()
    if ".mlp.experts." in name:
        return _fetch_experts(name, shape, found, problems)
    problems.append(f"{name}: missing")
    return None


def _fetch_experts(
    name: str,
    shape: tuple[int, ...],
    found: dict[str, tuple[Callable[[], torch.Tensor], tuple[int, ...]]],
    problems: list[str],
) -> torch.Tensor | None:
    prefix, kind = name.rsplit(".", 1)  # kind in gate_proj / up_proj / down_proj
    n_experts, inter = shape[0], (shape[1] if kind != "down_proj" else shape[2])
    fused = prefix + ".gate_up_proj"
    if kind in ("gate_proj", "up_proj") and fused in found:
        load, got = found[fused]
        if got != (n_experts, 2 * inter, shape[2]):
            problems.append(f"{fused}: shape {list(got)}, expected {[n_experts, 2 * inter, shape[2]]}")
            return None
        gate, up = load().chunk(2, dim=1)
        return gate if kind == "gate_proj" else up
    per_expert = [f"{prefix}.{e}.{kind}.weight" for e in range(n_experts)]
    missing = [n for n in per_expert if n not in found]
    if missing:
        problems.append(f"{name}: missing (neither stacked nor per-expert tensors such as {missing[0]})")
        return None
    parts = []
    for n in per_expert:
        load, got = found[n]
        if got != shape[1:]:
            problems.append(f"{n}: shape {list(got)}, expected {list(shape[1:])}")
            return None
        parts.append(load())
    return torch.stack(parts)


def read_raw_config(checkpoint: Path) -> dict:
    """``checkpoint/config.json`` as a dict (``CheckpointError`` when the directory, file or JSON is bad)."""
    path = checkpoint / "config.json"
    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint}: not a directory")
    if not path.exists():
        raise CheckpointError(f"{checkpoint}: config.json not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from exc


def read_config(checkpoint: Path) -> ModelConfig:
    """Parse ``checkpoint/config.json`` into a validated ``ModelConfig``."""
    return ModelConfig.from_hf_dict(read_raw_config(checkpoint))

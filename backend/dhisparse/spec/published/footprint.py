"""A drafter's device footprint per request, from its ``config.json`` alone (for the capacity planner).

The draft ring keeps, per request, the drafter's rows of the positions it can see: ``window_rows`` positions ×
``row_values`` values (K and V of every draft layer for DFlash / DFlash2 / Qwen3 DSpark, one latent row per stage
for DeepSeek-V4's DSpark, the target feature for our own DSpark-style drafter). ``ring_bytes`` is that window at
``row_bytes`` per position: ``row_values × bytes_per_value`` (what this runtime's ring holds), or, for DeepSeek-V4's
stages with ``v4_fp8_rows``, FlashMLA's FP8 row per stage (the row vLLM keeps V4's sliding-window cache in).
The engine's ring adds one discard row per request (``DraftRing``), not counted here: it is not a position the
drafter sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dhisparse.errors import ConfigError

from .formats import detect_format, family_of
from .qwen_config import parse_qwen_drafter


@dataclass(frozen=True)
class DrafterFootprint:
    """``window_rows`` (None: the whole history, bounded by ``max_context``), ``layers`` (draft layers or V4
    stages), ``row_values`` and ``row_bytes`` per position (all layers), ``max_gamma`` (drafts per proposal) and
    ``ring_bytes`` per request."""

    fmt: str
    family: str
    window_rows: int | None
    layers: int
    row_values: int
    max_gamma: int
    ring_bytes: int
    row_bytes: int

    def describe(self) -> str:
        window = "the whole history" if self.window_rows is None else f"{self.window_rows} positions"
        return (f"{self.fmt} drafter: {self.layers} layer(s), {self.row_values} values per position, window "
                f"{window}, up to {self.max_gamma} drafts: {self.ring_bytes / 2**30:.4f} GiB ring per request")


def v4_fp8_row_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of one DeepSeek-V4 latent row (one position, one layer) in FlashMLA's FP8 layout for V4: the
    ``head_dim - rope_dim`` values without RoPE as e4m3 (1 B each), the RoPE values as bfloat16 (2 B each), one
    e8m0 scale byte per 64 values without RoPE, the scales padded to 8 bytes. 512 / 64: 448 + 128 + 7 + 1 = 584 B,
    vLLM's ``_DEEPSEEK_V4_KV_BYTES_PER_TOKEN``."""
    nope = head_dim - rope_dim
    if rope_dim < 0 or nope <= 0 or nope % 64:
        raise ConfigError(f"drafter config: head_dim {head_dim} - qk_rope_head_dim {rope_dim} must be a positive "
                          "multiple of 64 for the FP8 V4 row")
    return nope + 2 * rope_dim + -(-(nope // 64) // 8) * 8


def drafter_footprint(config: dict[str, Any], *, max_context: int, bytes_per_value: int = 2,
                      target_hidden_size: int | None = None, v4_stages: int | None = None,
                      v4_fp8_rows: bool = False) -> DrafterFootprint:
    """Footprint of the drafter ``config`` declares. ``max_context`` bounds a full-attention drafter's window;
    ``target_hidden_size`` is needed for our own DSpark-style drafter (its ring holds the target feature);
    ``v4_stages`` overrides the DeepSeek-V4 stage count (default: the ``compress_ratios`` entries past the
    target's layers, else ``num_nextn_predict_layers``); ``v4_fp8_rows`` prices each V4 stage's row as
    :func:`v4_fp8_row_bytes` instead of ``head_dim × bytes_per_value``."""
    fmt = detect_format(config, "drafter config")
    row_bytes: int | None = None
    if fmt in ("dflash", "dflash2", "dspark"):
        cfg = parse_qwen_drafter(config, fmt, "drafter config")
        window, layers, row, gamma = cfg.context_window, cfg.num_layers, cfg.num_layers * cfg.kv_values, cfg.max_gamma
    elif fmt == "dspark-v4":
        ratios = config.get("compress_ratios") or []
        stages = v4_stages or max(len(ratios) - int(config["num_hidden_layers"]), 0) or int(
            config.get("num_nextn_predict_layers") or 0)
        if stages < 1:
            raise ConfigError("drafter config: cannot tell the number of DSpark stages; pass v4_stages")
        window, layers, row = int(config.get("sliding_window", 128)), stages, stages * int(config["head_dim"])
        gamma = int(config["dspark_block_size"])
        if v4_fp8_rows:  # the rope width as DeepseekV4Config reads it
            partial = config.get("partial_rotary_factor")
            head_dim = int(config["head_dim"])
            rope = int(head_dim * float(partial)) if partial is not None else int(
                config.get("qk_rope_head_dim", head_dim // 8))
            row_bytes = stages * v4_fp8_row_bytes(head_dim, rope)
    elif fmt == "ours-dflash2":
        window, layers = int(config.get("window", 64)), int(config["num_layers"])
        row, gamma = layers * 2 * int(config["hidden_size"]), int(config["max_block"])
    else:  # ours-dspark: one feature row
        hidden = target_hidden_size or int(config["target_hidden_size"])
        window, layers, row, gamma = 1, int(config["num_layers"]), len(config["target_layer_ids"]) * hidden, int(
            config["max_block"])
    if v4_fp8_rows and fmt != "dspark-v4":
        raise ConfigError(f"drafter config: v4_fp8_rows applies to DeepSeek-V4 DSpark stages, not to {fmt}")
    if row_bytes is None:
        row_bytes = row * bytes_per_value
    rows = max_context if window is None else min(window, max_context)
    return DrafterFootprint(fmt, family_of(fmt), window, layers, row, gamma, rows * row_bytes, row_bytes)

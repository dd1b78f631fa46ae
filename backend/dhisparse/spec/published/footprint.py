"""A drafter's device footprint per request, from its ``config.json`` alone (for the capacity planner).

The draft ring keeps, per request, the drafter's rows of the positions it can see: ``window_rows`` positions ×
``row_values`` values (K and V of every draft layer for DFlash / DFlash2 / Qwen3 DSpark, one latent row per stage
for DeepSeek-V4's DSpark, the target feature for our own DSpark-style drafter). ``ring_bytes`` is that window at
``bytes_per_value``; the engine's ring adds one spare row per request (``DraftRing``).
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
    stages), ``row_values`` per position, ``max_gamma`` (drafts per proposal) and ``ring_bytes`` per request."""

    fmt: str
    family: str
    window_rows: int | None
    layers: int
    row_values: int
    max_gamma: int
    ring_bytes: int

    def describe(self) -> str:
        window = "the whole history" if self.window_rows is None else f"{self.window_rows} positions"
        return (f"{self.fmt} drafter: {self.layers} layer(s), {self.row_values} values per position, window "
                f"{window}, up to {self.max_gamma} drafts: {self.ring_bytes / 2**30:.4f} GiB ring per request")


def drafter_footprint(config: dict[str, Any], *, max_context: int, bytes_per_value: int = 2,
                      target_hidden_size: int | None = None, v4_stages: int | None = None) -> DrafterFootprint:
    """Footprint of the drafter ``config`` declares. ``max_context`` bounds a full-attention drafter's window;
    ``target_hidden_size`` is needed for our own DSpark-style drafter (its ring holds the target feature);
    ``v4_stages`` overrides the DeepSeek-V4 stage count (default: the ``compress_ratios`` entries past the
    target's layers, else ``num_nextn_predict_layers``)."""
    fmt = detect_format(config, "drafter config")
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
    elif fmt == "ours-dflash2":
        window, layers = int(config.get("window", 64)), int(config["num_layers"])
        row, gamma = layers * 2 * int(config["hidden_size"]), int(config["max_block"])
    else:  # ours-dspark: one feature row
        hidden = target_hidden_size or int(config["target_hidden_size"])
        window, layers, row, gamma = 1, int(config["num_layers"]), len(config["target_layer_ids"]) * hidden, int(
            config["max_block"])
    rows = max_context if window is None else min(window, max_context)
    return DrafterFootprint(fmt, family_of(fmt), window, layers, row, gamma, rows * row * bytes_per_value)

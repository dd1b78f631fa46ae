"""The shapes of the published drafters the capacity planner prices, as their own ``config.json`` declare them.

``configs/<name>.json`` holds the fields of a published drafter's ``config.json`` that fix its shape (layers,
hidden size, attention heads, sliding window, KV width, block); :func:`drafter_footprint` reads it like any other
drafter config. The checkpoints themselves are not fetched by this project (``incoai/GLM-5.3-DFlash2`` is CC BY-NC-ND,
DeepSeek-V4's weights are hundreds of GB): each file is a transcription, and :data:`REFERENCE_CONFIGS` says of
what and from where. Fields the sources do not give are left out, never guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).with_name("configs")


@dataclass(frozen=True)
class ReferenceConfig:
    """``file`` under ``configs/``: the shape fields of ``checkpoint`` (a Hugging Face repository, at ``revision``
    where a source pins one), transcribed from ``sources``."""

    name: str
    file: str
    checkpoint: str
    revision: str
    sources: str

    def load(self) -> dict[str, Any]:
        data = json.loads((CONFIG_DIR / self.file).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{CONFIG_DIR / self.file}: not a JSON object")
        return data


REFERENCE_CONFIGS: dict[str, ReferenceConfig] = {c.name: c for c in (
    ReferenceConfig(
        "glm-5.3-dflash2", "glm-5.3-dflash2.json", "incoai/GLM-5.3-DFlash2",
        "425aa615ce320caac34400208b30808c8f14f76c",
        "every field as the glmrt GLM-5.3 runtime checks it, field by field, against that revision's config.json "
        "(sha256 f59e1da17d41d24a1aba588aecee1607788adb34a03805f2c883add8ca954e9b: six sliding_attention layers, "
        "window 2,048, 64 heads and 8 KV heads of 128, hidden 6,144, block 8); num_target_layers 78 as in "
        "tokenspeed's (LightSeek Foundation) draft-worker test of the GLM-5.3 pair; the same shape in a third, "
        "independent port's README ('hidden 6144, six sliding_attention layers, target_layer_ids [5, 19, 33, 47, 61, "
        "75]')"),
    ReferenceConfig(
        "deepseek-v4-flash-dspark", "deepseek-v4-flash-dspark.json", "deepseek-ai/DeepSeek-V4-Flash-DSpark", "",
        "the dspark_* fields, num_nextn_predict_layers 1 (the checkpoint nevertheless carries three mtp.{0,1,2} "
        "stages) and the 43 x 4096 target as fetched from the repository's config.json in a DSpark port's notes "
        "and checked by a serving contract script (EXPECTED_DSPARK_FIELDS, mtp.0-2 shards); the attention shape "
        "(head_dim 512, qk_rope_head_dim 64, sliding_window 128, 46 compress_ratios: 43 layers + 3 stages) from a "
        "planner's DeepSeek-V4-Flash DSpark fixture, matching transformers' DeepseekV4Config defaults "
        "(dhisparse_planner.deepseek_v4)"),
)}


def reference_config(name: str) -> dict[str, Any]:
    """The transcribed ``config.json`` of published drafter ``name`` (a key of :data:`REFERENCE_CONFIGS`)."""
    if name not in REFERENCE_CONFIGS:
        raise KeyError(f"no reference drafter config {name!r}; known: {sorted(REFERENCE_CONFIGS)}")
    return REFERENCE_CONFIGS[name].load()

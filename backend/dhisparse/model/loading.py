"""Model-family dispatch: read any supported checkpoint's config, load its weights, build its runtime model.

``deepseek_v32`` / ``glm_moe_dsa`` go to :class:`dhisparse.model.model.DSAModel`; ``deepseek_v4`` goes to
:class:`dhisparse.model.deepseek_v4.model.DeepseekV4Model`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from dhisparse.model import weights as dsa_weights
from dhisparse.model.config import ModelConfig
from dhisparse.model.deepseek_v4 import weights as v4_weights
from dhisparse.model.deepseek_v4.config import MODEL_TYPE as V4
from dhisparse.model.deepseek_v4.config import DeepseekV4Config
from dhisparse.model.deepseek_v4.model import DeepseekV4Model
from dhisparse.model.model import DSAModel

AnyConfig = ModelConfig | DeepseekV4Config


def read_any_config(checkpoint: Path) -> AnyConfig:
    """Parse ``checkpoint/config.json`` into the config of its family (``ConfigError`` names the problem)."""
    raw = dsa_weights.read_raw_config(checkpoint)
    if raw.get("model_type") == V4:
        return DeepseekV4Config.from_hf_dict(raw)
    return ModelConfig.from_hf_dict(raw)


def load_any_state_dict(checkpoint: Path, cfg: AnyConfig, dtype: torch.dtype,
                        progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    if isinstance(cfg, DeepseekV4Config):
        return v4_weights.load_state_dict(checkpoint, cfg, dtype, progress)
    return dsa_weights.load_state_dict(checkpoint, cfg, dtype, progress)


def build_model(cfg: AnyConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
                ) -> DSAModel | DeepseekV4Model:
    if isinstance(cfg, DeepseekV4Config):
        return DeepseekV4Model(cfg, weights, dtype, device)
    return DSAModel(cfg, weights, dtype, device)

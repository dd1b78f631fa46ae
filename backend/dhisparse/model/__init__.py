"""The DSA model runtime: configuration, weights, RoPE, MLA + lightning indexer, MoE, and the forward pass."""

from __future__ import annotations

from dhisparse.model.config import ModelConfig
from dhisparse.model.model import DSAModel

__all__ = ["DSAModel", "ModelConfig"]

"""Draft models for speculative decoding: a DFlash2-style block drafter and a DSpark-style drafter.

Engine-facing API (both drafters)::

    drafter = load_drafter(directory)                       # eval mode, float32, CPU by default
    tokens, probs, confidence = drafter.propose(context_features, last_tokens, gamma, temperature=0.0)

``context_features`` [B, L, F] float: the target's hidden states at the latest L context positions (oldest
first; the last row is the position just before ``last_tokens``), each row the outputs of the target decoder
layers ``drafter.config.target_layer_ids`` concatenated (F = ``drafter.config.feature_size``). Only the last
``drafter.window`` rows are read. ``last_tokens`` [B] int64: the last accepted token. See :class:`Proposal`.
"""

from __future__ import annotations

from .base import Proposal, choose_tokens
from .config import DFlash2Config, DrafterConfigBase, DSparkConfig
from .dflash2 import DFlash2Drafter
from .dspark import DSparkDrafter, confident_prefix_length
from .io import DRAFTERS, Drafter, load_drafter, save_drafter

__all__ = [
    "DRAFTERS",
    "DFlash2Config",
    "DFlash2Drafter",
    "DSparkConfig",
    "DSparkDrafter",
    "Drafter",
    "DrafterConfigBase",
    "Proposal",
    "choose_tokens",
    "confident_prefix_length",
    "load_drafter",
    "save_drafter",
]

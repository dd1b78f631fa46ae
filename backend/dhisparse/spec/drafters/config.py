"""Frozen, validated configurations of the two drafters (stored as ``config.json`` in a drafter directory)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class DrafterConfigBase:
    """Fields shared by both drafters.

    ``target_layer_ids`` name the target decoder layers whose *outputs* (the residual stream after layer
    ``l``, before the final norm -- for the last layer this differs from transformers' ``hidden_states[-1]``,
    which is after the norm) are concatenated, in this order, into
    the feature vector of one position: ``feature_size = len(target_layer_ids) * target_hidden_size``.
    """

    vocab_size: int
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_block: int  # the largest gamma (draft tokens per proposal) the drafter supports
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        for name in (
            "vocab_size",
            "target_hidden_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "max_block",
        ):
            _require(int(getattr(self, name)) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _require(len(self.target_layer_ids) >= 1, "target_layer_ids must name at least one target layer")
        _require(min(self.target_layer_ids) >= 0, f"target_layer_ids must be >= 0, got {self.target_layer_ids}")
        _require(
            len(set(self.target_layer_ids)) == len(self.target_layer_ids),
            f"target_layer_ids has duplicates: {self.target_layer_ids}",
        )
        _require(
            self.hidden_size % self.num_heads == 0,
            f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}",
        )
        _require(self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for RoPE")
        _require(self.rope_theta > 0 and self.rms_norm_eps > 0, "rope_theta and rms_norm_eps must be > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def feature_size(self) -> int:
        """Width of one position's conditioning feature: ``len(target_layer_ids) * target_hidden_size``."""
        return len(self.target_layer_ids) * self.target_hidden_size

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["target_layer_ids"] = list(self.target_layer_ids)
        return {"drafter_type": self.drafter_type, **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        data = dict(data)
        kind = data.pop("drafter_type", cls.drafter_type)
        _require(kind == cls.drafter_type, f"config is for drafter_type {kind!r}, not {cls.drafter_type!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        _require(not unknown, f"unknown {cls.drafter_type} config fields: {unknown}")
        return cls(**data)

    drafter_type = "base"


@dataclass(frozen=True)
class DFlash2Config(DrafterConfigBase):
    """DFlash2-style block drafter. ``window``: how many of the latest context positions it attends to; its
    per-position KV for those positions is what the engine keeps in the draft ring buffer."""

    window: int = 64

    drafter_type = "dflash2"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.window >= 1, f"window must be >= 1, got {self.window}")

    @property
    def ring_row_values(self) -> int:
        """Values one context position occupies in the ring buffer: K and V of every drafter layer."""
        return self.num_layers * 2 * self.hidden_size


@dataclass(frozen=True)
class DSparkConfig(DrafterConfigBase):
    """DSpark-style drafter: parallel backbone over ``max_block`` slots, a rank-``markov_rank`` Markov head
    and a confidence head of width ``confidence_hidden``. It reads only the latest context position."""

    markov_rank: int = 32
    confidence_hidden: int = 64

    drafter_type = "dspark"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.markov_rank >= 1, f"markov_rank must be >= 1, got {self.markov_rank}")
        _require(self.confidence_hidden >= 1, f"confidence_hidden must be >= 1, got {self.confidence_hidden}")

    @property
    def window(self) -> int:
        return 1

"""Engine (runtime) configuration: what ``runtime.json`` in an engine directory holds, overridable per ``LLM``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from dhisparse.errors import ConfigError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
KV_POLICIES = ("resident", "hisparse", "adaptive", "dense")
SPECULATIVE = (None, "dflash2", "dspark")
KV_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    """Serving defaults. Byte quantities are bytes; row quantities are KV rows (tokens of one source)."""

    dtype: str = "float32"
    device: str = "cpu"
    max_batch_size: int = 32
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    max_new_tokens_limit: int = 0  # 0: up to max_model_len
    prefill_chunk_tokens: int = 512
    max_prefill_tokens_per_step: int = 4096
    kv_policy: str = "adaptive"
    pool_bytes: int = 256 * 1024 * 1024  # 0 ("auto"): the device's free memory less the workspace bound
    hot_rows: int = 0  # 0: derived from index_topk (and the verification block when speculating)
    page_rows: int = 16
    reserve_bytes: int = 0
    host_bytes: int = 0  # 0: half of the machine's physical memory
    kv_dtype: str = "auto"  # "auto": rows in the model dtype; "fp8": FlashMLA's FP8 rows (hierarchy policies only)
    refill_pages_per_step: int = 64
    speculative: str | None = None
    num_draft_tokens: int = 4
    dspark_busy_batch: int = 8  # DSpark: a batch at least this large counts as busy
    dspark_min_confidence: float = 0.0  # DSpark: verify only the draft prefix this likely to be accepted …
    dspark_busy_confidence: float = 0.3  # … or this likely when the batch is busy (load-aware shortening)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_policy not in KV_POLICIES:
            raise ConfigError(f"kv_policy must be one of {', '.join(KV_POLICIES)}, got {self.kv_policy!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.kv_dtype == "fp8" and self.kv_policy == "dense":
            raise ConfigError("kv_dtype 'fp8' needs a KV hierarchy policy (resident, hisparse or adaptive), "
                              "not the dense reference store")
        if self.speculative not in SPECULATIVE:
            raise ConfigError(f"speculative must be None, 'dflash2' or 'dspark', got {self.speculative!r}")
        for name in ("max_batch_size", "prefill_chunk_tokens", "max_prefill_tokens_per_step", "page_rows",
                     "refill_pages_per_step", "num_draft_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "max_new_tokens_limit", "pool_bytes", "hot_rows", "reserve_bytes", "host_bytes",
                     "dspark_busy_batch"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("dspark_min_confidence", "dspark_busy_confidence"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return replace(self, **overrides)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def load(cls, path: Path) -> EngineConfig:
        """Read ``runtime.json`` (missing file: defaults)."""
        if not path.exists():
            return cls()
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: invalid JSON ({exc})") from exc
        return cls().with_overrides(**raw)

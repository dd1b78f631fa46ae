"""Engine (runtime) configuration: what ``runtime.json`` in an engine directory holds, overridable per ``LLM``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from dhisparse import defaults
from dhisparse.errors import ConfigError
from dhisparse.kv.config import KVConfig
from dhisparse.kv.policies import KVPolicy, policy_named

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SPECULATIVE = (None, "dflash", "dflash2", "dspark")  # drafter families (dhisparse.spec.published.formats)
KV_DTYPES = ("auto", "fp8")
KERNELS = ("auto", "cuda", "torch")  # dhisparse.kernels.selection


@dataclass(frozen=True)
class EngineConfig:
    """Serving defaults. Byte quantities are bytes; row quantities are KV rows (tokens of one source)."""

    dtype: str = defaults.DTYPE
    device: str = defaults.DEVICE
    max_batch_size: int = defaults.MAX_BATCH_SIZE
    max_model_len: int = defaults.MAX_MODEL_LEN  # 0: the model's max_position_embeddings
    max_new_tokens_limit: int = defaults.MAX_NEW_TOKENS_LIMIT  # 0: up to max_model_len
    prefill_chunk_tokens: int = defaults.PREFILL_CHUNK_TOKENS
    max_prefill_tokens_per_step: int = defaults.MAX_PREFILL_TOKENS_PER_STEP
    kv_policy: KVPolicy | str = defaults.KV_POLICY  # a name is turned into its policy object (validated)
    pool_bytes: int = defaults.POOL_BYTES  # 0 ("auto"): the device's free memory less the workspace bound
    hot_rows: int = defaults.HOT_ROWS  # 0: index_topk, with or without speculation (overflow goes to staging)
    page_rows: int = defaults.PAGE_ROWS
    reserve_bytes: int = defaults.RESERVE_BYTES
    host_bytes: int = defaults.HOST_BYTES  # 0: half of the machine's physical memory
    kv_dtype: str = defaults.KV_DTYPE  # "auto": rows in the model dtype; "fp8": FlashMLA's FP8 rows (hierarchy only)
    index_key_dtype: str = defaults.INDEX_KEY_DTYPE  # "auto": the model dtype; "fp8": e4m3 + a float32 scale per key
    stream_prefill: bool = defaults.STREAM_PREFILL  # prompts go to their host pages chunk by chunk (host-store, native)
    prefix_reuse: bool = defaults.PREFIX_REUSE  # prompts reuse cached complete pages of earlier sequences
    refill_pages_per_step: int = defaults.REFILL_PAGES_PER_STEP
    speculative: str | None = defaults.SPECULATIVE
    num_draft_tokens: int = defaults.NUM_DRAFT_TOKENS
    dspark_busy_batch: int = defaults.DSPARK_BUSY_BATCH  # DSpark: a batch at least this large counts as busy
    dspark_min_confidence: float = defaults.DSPARK_MIN_CONFIDENCE  # DSpark: verify the draft prefix this likely …
    dspark_busy_confidence: float = defaults.DSPARK_BUSY_CONFIDENCE  # … or this likely when the batch is busy
    fault_injection: str = defaults.FAULT_INJECTION  # drills and tests only: "site@n,…" (engine/faults.py); "" = off
    kernels: str = defaults.KERNELS  # auto | cuda | torch: CUDA kernels in the request path on a GPU (self-checked)
    tensor_parallel_size: int = defaults.TENSOR_PARALLEL_SIZE  # heads, indexer, dense layers split (engine/parallel)
    data_parallel_size: int = defaults.DATA_PARALLEL_SIZE  # data-parallel attention ranks (own requests and KV)
    expert_parallel: bool = defaults.EXPERT_PARALLEL  # MoE experts partitioned across ranks
    tp_split_indexer: bool = defaults.TP_SPLIT_INDEXER  # TP: indexer heads split (else replicated on every rank)
    collective_timeout_s: float = defaults.COLLECTIVE_TIMEOUT_S  # every collective between ranks fails after this
    agreed_copy_completion: bool = defaults.AGREED_COPY_COMPLETION  # KV copies complete by step, not event timing

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        policy = policy_named(self.kv_policy, "kv_policy")
        object.__setattr__(self, "kv_policy", policy)
        if self.kernels not in KERNELS:
            raise ConfigError(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.kv_dtype == "fp8" and policy.reference_store:
            raise ConfigError("kv_dtype 'fp8' needs a KV hierarchy policy (resident, hisparse or adaptive), "
                              "not the dense reference store")
        if self.index_key_dtype not in KV_DTYPES:
            raise ConfigError(f"index_key_dtype must be one of {', '.join(KV_DTYPES)}, got {self.index_key_dtype!r}")
        if self.index_key_dtype == "fp8" and policy.reference_store:
            raise ConfigError("index_key_dtype 'fp8' needs a KV hierarchy policy (resident, hisparse or adaptive), "
                              "not the dense reference store")
        if self.speculative not in SPECULATIVE:
            raise ConfigError(f"speculative must be None, 'dflash', 'dflash2' or 'dspark', got {self.speculative!r}")
        for name in ("max_batch_size", "prefill_chunk_tokens", "max_prefill_tokens_per_step", "page_rows",
                     "refill_pages_per_step", "num_draft_tokens", "tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "max_new_tokens_limit", "pool_bytes", "hot_rows", "reserve_bytes", "host_bytes",
                     "dspark_busy_batch"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.tensor_parallel_size > 1 and self.data_parallel_size > 1:
            raise ConfigError(f"tensor_parallel_size {self.tensor_parallel_size} with data_parallel_size "
                              f"{self.data_parallel_size}: attention split inside data-parallel groups is not "
                              "supported; use one of them (both combine with expert_parallel)")
        for name in ("dspark_min_confidence", "dspark_busy_confidence"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        """Ranks (processes, one device each) of one engine: ``tensor_parallel_size x data_parallel_size``."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def kv_config(self, max_query_len: int, draft_ring_bytes: int, max_model_len: int,
                  prefix_min_suffix_tokens: int = 1, prefix_model_key: str = "") -> KVConfig:
        """The KV hierarchy's budget and policy for this configuration (``max_query_len``: 1, or gamma + 1 when
        speculating; ``draft_ring_bytes``: the drafter's ring per request, required memory;
        ``prefix_min_suffix_tokens``: the drafter's window when speculating, else 1; ``prefix_model_key``: names the
        model in the prefix cache's page keys)."""
        return KVConfig(
            policy=self.kv_policy, pool_bytes=self.pool_bytes, hot_rows=self.hot_rows, page_rows=self.page_rows,
            reserve_bytes=self.reserve_bytes, refill_pages_per_step=self.refill_pages_per_step,
            max_query_len=max_query_len, draft_ring_bytes=draft_ring_bytes, host_bytes=self.host_bytes,
            prefix_reuse=self.prefix_reuse, prefix_min_suffix_tokens=prefix_min_suffix_tokens,
            prefix_model_key=prefix_model_key,
            # The persistent batch state (kv/batch_state.py) is allocated once for these.
            max_batch_size=self.max_batch_size, max_model_len=max_model_len)

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return replace(self, **overrides)

    @property
    def policy(self) -> KVPolicy:
        """The KV policy object (``kv_policy`` after validation)."""
        assert isinstance(self.kv_policy, KVPolicy)
        return self.kv_policy

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "kv_policy": self.policy.name}, indent=2, sort_keys=True)

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

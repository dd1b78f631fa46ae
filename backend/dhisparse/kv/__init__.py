"""The load-adaptive KV hierarchy: host store, device pool, hot caches, resolver and residency manager.

The engine talks to :class:`KVManager` only (see ``docs/kv.md``)."""

from __future__ import annotations

from dhisparse.kernels.resolver import HotCacheOverflowError, Resolution, resolve
from dhisparse.kv.config import KV_POLICIES, AdmissionError, KVConfig, KVLayout
from dhisparse.kv.invariants import InvariantError
from dhisparse.kv.manager import KVManager
from dhisparse.kv.step import StepKV

__all__ = [
    "KV_POLICIES",
    "AdmissionError",
    "HotCacheOverflowError",
    "InvariantError",
    "KVConfig",
    "KVLayout",
    "KVManager",
    "Resolution",
    "StepKV",
    "resolve",
]

"""The load-adaptive KV hierarchy: host store, device pool, hot caches, resolver and residency manager."""

from __future__ import annotations

from dhisparse.kv.resolver import HotCacheOverflowError, Resolution, resolve

__all__ = ["HotCacheOverflowError", "Resolution", "resolve"]

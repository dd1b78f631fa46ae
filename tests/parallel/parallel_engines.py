"""Helpers of the multi-rank tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from dhisparse import LLM


@contextlib.contextmanager
def parallel_llm(engine_dir: Path, **overrides) -> Iterator[LLM]:
    """An LLM over rank processes, closed (ranks stopped) at the end."""
    llm = LLM(engine_dir, **overrides)
    try:
        yield llm
    finally:
        llm.close()


def tight_pool(engine_dir: Path, longest: int, new_tokens: int, **overrides) -> int:
    """A pool (bytes) that holds about two of the longest requests' required memory: hisparse/adaptive fetch rows
    from the host store and requests wait for admission."""
    probe = LLM(engine_dir, **overrides, pool_bytes=1 << 30)
    need = probe.engine.kv.required_bytes(longest, new_tokens)
    return 2 * need + need // 2

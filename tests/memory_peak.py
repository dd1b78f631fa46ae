"""Peak of the bytes a piece of code allocates, from torch's profiler with memory profiling (works on CPU)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of the bytes allocated (and not yet freed) while ``fn`` runs: each operator's own allocations at its
    start, frees as ``[memory]`` events, in time order."""
    with torch.autograd.profiler.profile(profile_memory=True, use_kineto=False) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.function_events, key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak

"""Restarting a DeepSeek-V4 prefill after a cached prefix (prefix reuse, docs/prefix_reuse.md "DeepSeek-V4").

A V4 request's state after ``hit`` tokens (``kv_state.py``) is its compressed entries — CSA KV entries, CSA indexer
keys, HCA entries, one per complete window of ``rate`` tokens — plus what the pages of a prefix cache do not hold:
every layer's sliding window (the K=V rows of positions ``hit-W+1 … hit-1``) and the compressors' pending
projections (positions from ``(hit // rate - 1)·rate`` for CSA's overlapping windows, from ``(hit // rate)·rate`` for
HCA). Those are *recomputed*: the prefill restarts at :func:`restart_position` ``P <= hit`` over a state whose
entries of complete windows (``< hit // rate``) are the cached ones, kept while positions ``P … hit-1`` are computed
again (``V4RequestKV.restored``), and whose window and pending state start as zeros.

Why ``P`` lies ``num_layers · (W-1)`` (and a little) before ``hit``, not one window: the rows a layer adds to its
window are projections of that layer's *input*, which is exact at position ``t`` only if the layer below attended
to exact window rows ``t-W+1 … t``. Restarting at ``P`` with zero windows, layer 0's input is exact from ``P`` (the
embedding), its output from ``P + W - 1``, and layer ``l``'s input from ``a_l = P + l·(W-1)``; entries come from the
cache, so they are exact everywhere. The state at ``hit`` needs layer ``l``'s input exact from ``hit - (W-1)``
(window) and, for a compressor, from the first position its next entry pools; the smallest such ``P`` over all
layers is :func:`restart_position`. Everything from ``hit`` on is then computed as in a full prefill, so the tokens
are the same (values to rounding: the positions before ``hit`` were computed in other chunks, or by decoding).
"""

from __future__ import annotations

import torch

from dhisparse.model.deepseek_v4.config import CSA, DeepseekV4Config
from dhisparse.model.deepseek_v4.kv_state import Key, V4RequestKV


def restart_position(cfg: DeepseekV4Config, hit: int) -> int:
    """The first position a prefill must compute when every compressed entry complete within the first ``hit``
    tokens is restored (see the module docstring); ``0`` when the prefix is too short to save anything."""
    lag = cfg.sliding_window - 1  # how far each layer's exact region trails the one below
    start = hit
    for layer in range(cfg.num_hidden_layers):
        needed = hit - lag  # the window rows of positions hit-W+1 … hit-1
        if cfg.owns_compressor(layer):
            rate = cfg.compress_rate(layer)
            complete = hit // rate  # the next entry is window `complete`
            needed = min(needed, (complete - 1) * rate if cfg.layer_types[layer] == CSA else complete * rate)
        start = min(start, needed - layer * lag)
    return max(start, 0)


def restored_state(cfg: DeepseekV4Config, capacity: int, dtype: torch.dtype, device: torch.device, start: int,
                   hit: int, entries: dict[Key, torch.Tensor]) -> V4RequestKV:
    """A state a prefill restarts from at ``start`` (:func:`restart_position` of ``hit``): ``entries[key]`` holds the
    ``hit // rate`` cached entries of every compressor ``key`` (``[n, d]``), kept by the prefill; windows and pending
    projections are zeros (recomputed)."""
    state = V4RequestKV(cfg, max(capacity, hit), dtype, device)
    for key, rows in entries.items():
        n = hit // cfg.compress_rate(key[0])
        if rows.shape[0] != n:
            raise ValueError(f"restored entries of {key}: {rows.shape[0]} rows, {n} windows complete in {hit} tokens")
        state.reserve(key, n)[:n] = rows.to(device, dtype)
    missing = set(state.entries) - set(entries)
    if missing:
        raise ValueError(f"restored entries missing for {sorted(missing)}")
    state.length, state.restored = start, hit
    return state

"""Which host-fetch time a decode step can hide: the schedule of an index group, as our engine runs it.

A GLM-style index group is one *full* layer (it runs the indexer and computes the top-k) followed by
``s - 1`` *shared* layers that reuse that top-k. Per decode step and group:

1. The full layer's missing rows are known only once its own indexer has run, and its attention needs them
   at once: their copy is **exposed** (the compute stream waits for it).
2. The shared layers' rows are known at the same moment, so their copies are issued right after the full
   layer's (one host link: copies run one after another) and proceed **while the full layer's and the
   following layers' attention/MLP run**. Shared layer ``j`` may start only when its own rows have arrived.

So, with copy times ``h_0`` (full layer), ``h_1 .. h_{s-1}`` and layer compute times ``c_0 .. c_{s-1}``::

    link_j  = h_0 + h_1 + ... + h_j                     (when shared layer j's rows are on the device)
    start_0 = h_0;  start_j = max(start_{j-1} + c_{j-1}, link_j)
    exposed = start_{s-1} + c_{s-1} - sum(c)

With equal ``h`` and ``c`` this is ``h + (s - 1) * max(0, h - c)``: at most ``(s - 1) / s`` of the fetch time is
hidden (75% for groups of 4), and nothing when every layer has its own indexer (DeepSeek-V3.2, ``s = 1``).
Copies of the next group cannot start earlier (its top-k needs its own indexer), so groups add up.

Refills of optional pages are asynchronous (a page becomes visible only when its copy is done); they use the
same link, so a step lasts at least as long as the link is busy with fetches and refills together.

A real implementation hides somewhat less than the schedule allows (the side-stream copies compete with
attention for SMs and HBM): ``prefetch_efficiency`` (a :class:`HardwareSpec` constant, sourced from sglang's
measurements, see docs/planner.md) scales the hideable part: ``exposed = fetch - efficiency * (fetch - rule)``.

``host_overlap`` (hidden / total fetch time) is therefore an *outcome* of this rule, the index-sharing pattern
and the step's compute, never an input.
"""

from __future__ import annotations

from collections.abc import Sequence


def group_exposed_seconds(full_copy_s: float, shared_copy_s: Sequence[float],
                          layer_compute_s: Sequence[float]) -> float:
    """Exposed host-fetch time of one index group (s); ``layer_compute_s`` lists the full layer first."""
    if len(layer_compute_s) != len(shared_copy_s) + 1:
        raise ValueError(f"layer_compute_s needs {len(shared_copy_s) + 1} entries (full layer + shared layers), "
                         f"got {len(layer_compute_s)}")
    if full_copy_s < 0 or min(shared_copy_s, default=0.0) < 0 or min(layer_compute_s) < 0:
        raise ValueError("copy and compute times must be >= 0")
    start = link = float(full_copy_s)
    end = start + layer_compute_s[0]
    for copy_s, compute_s in zip(shared_copy_s, layer_compute_s[1:], strict=True):
        link += copy_s
        start = max(end, link)
        end = start + compute_s
    return end - float(sum(layer_compute_s))


def group_sizes(num_layers: int, index_group_size: int) -> list[int]:
    """Layers per index group, in order (the last group may be shorter)."""
    if num_layers < 1 or index_group_size < 1:
        raise ValueError("num_layers and index_group_size must be >= 1")
    return [min(index_group_size, num_layers - i) for i in range(0, num_layers, index_group_size)]


def exposed_fetch_seconds(fetch_s: float, compute_s: float, num_layers: int, index_group_size: int,
                          efficiency: float = 1.0) -> float:
    """Exposed part of a step's host-fetch time ``fetch_s`` given its layer compute ``compute_s`` (both s);
    ``efficiency`` scales the part the schedule can hide (1: all of it).

    Fetched rows and compute are spread evenly over the layers: the layers of a group share one selection and
    hence one miss pattern, and the planner's selection model is the same for every group."""
    if fetch_s <= 0.0:
        return 0.0
    h, c = fetch_s / num_layers, compute_s / num_layers
    sizes = group_sizes(num_layers, index_group_size)
    # closed form of group_exposed_seconds for equal h and c (tests check both agree)
    rule = sum(h + (s - 1) * max(0.0, h - c) for s in sizes)
    return fetch_s - efficiency * (fetch_s - rule)


def host_overlap(fetch_s: float, exposed_s: float) -> float:
    """Fraction of host-fetch time hidden behind compute (0 when nothing was fetched)."""
    return 0.0 if fetch_s <= 0.0 else 1.0 - exposed_s / fetch_s

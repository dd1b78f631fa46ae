"""The simulation core: the real :class:`KVManager` driven by the engine's scheduling rule, step by step.

This module knows nothing about time or scale; :mod:`dhisparse_planner.simulator` adds both. What it does is
what ``LLMEngine.step`` does, in the same order, with payload-free rows (zeros):

1. ``kv.poll()``;
2. admission in arrival order while requests wait, the batch has room (``max_batch_size``) and the prefill
   cap allows (``max_prefill_tokens_per_step``, never refusing the first prefill of a step): ``try_admit``;
   refused → stop admitting this step (the request stays first in the queue); admitted → ``import_prompt``
   with zero rows, one output token (the prefill's), finished at once if that was its budget;
3. one batched decode step over every running request: ``begin_step(ids, Q)``, per layer ``write`` then
   ``locations(positions)`` (what ``gather`` resolves and fetches, without reading the rows),
   ``end_step(accepted)``; then tokens are appended in batch order and finished
   requests ``release``d.

Every admission, reclaim, refill, hit and miss is therefore decided by ``dhisparse.kv``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dhisparse.kv import KVConfig, KVLayout, KVManager

COUNTERS = ("rows_direct", "rows_hot", "rows_host", "optional_pages_reclaimed", "reclaim_events",
            "optional_pages_refill_issued", "admissions", "releases")


@dataclass
class SimRequest:
    """One request in simulated units (``prompt_rows``, ``max_tokens``) plus bookkeeping."""

    request_id: str
    prompt_rows: int
    max_tokens: int
    arrival_s: float = 0.0
    generated: int = 0  # output tokens so far (simulated)
    admitted_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    waited: bool = False
    wait_reasons: set[str] = field(default_factory=set)  # what refused it: "device", "host" or "budget"

    @property
    def kv_length(self) -> int:
        """Rows in the KV history (the last sampled token is not written yet)."""
        return self.prompt_rows + self.generated - 1


@dataclass
class StepOutcome:
    """What one engine step did (simulated units). ``counters`` are the manager's cumulative counters after it."""

    admitted: list[str] = field(default_factory=list)
    refused: str | None = None
    batch: list[str] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)


# positions(batch requests, StepKV starts, query_lens, Q) -> {layer: [B, Q, K]}
PositionsFn = Callable[[list[SimRequest], torch.Tensor, torch.Tensor, int], dict[int, torch.Tensor]]
# (batch, query_lens) -> query lengths and accepted lengths
AcceptFn = Callable[[list[SimRequest], torch.Tensor], torch.Tensor]


class EngineCore:
    """One simulated engine over a real :class:`KVManager` (see the module docstring)."""

    def __init__(self, layout: KVLayout, config: KVConfig, max_batch_size: int, max_prefill_tokens_per_step: int,
                 positions: PositionsFn, prefill_tokens: Callable[[SimRequest], int] = lambda r: r.prompt_rows,
                 on_release: Callable[[SimRequest], None] = lambda r: None,
                 gate: Callable[[SimRequest], bool] | None = None) -> None:
        self.kv = KVManager(layout, config, "cpu")
        self.layout, self.config = layout, config
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens_per_step = max_prefill_tokens_per_step
        self.positions = positions
        self.prefill_tokens = prefill_tokens
        self.on_release = on_release
        self.gate = gate  # an admission rule besides the manager's (a baseline system's), None: the engine's only
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self.running: list[SimRequest] = []
        self.layers = list(range(layout.num_layers))
        self.indexers = set(layout.indexer_layers)
        self._zeros: dict[tuple[int, ...], torch.Tensor] = {}

    def _zero(self, *shape: int) -> torch.Tensor:
        t = self._zeros.get(shape)
        if t is None:
            t = self._zeros[shape] = torch.zeros(shape, dtype=self.layout.dtype)
        return t

    def counters(self) -> dict[str, float]:
        c = self.kv.counters
        out = {name: float(c[name]) for name in COUNTERS}
        out["required_bytes"] = float(self.kv.pool.required_bytes)
        out["optional_bytes"] = float(self.kv.pool.optional_bytes)
        return out

    # ------------------------------------------------------------------------------------------------ step
    def admit(self, out: StepOutcome, on_admit: Callable[[SimRequest], None]) -> None:
        prefilled = 0
        lay = self.layout
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            tokens = self.prefill_tokens(req)
            if prefilled and prefilled + tokens > self.max_prefill_tokens_per_step:
                break
            reason = None
            if self.gate is not None and not self.gate(req):
                reason = "budget"
            elif not self.kv.try_admit(req.request_id, req.prompt_rows, req.max_tokens):
                short = self.kv.host.free_pages < self.kv.host_pages_needed(req.prompt_rows, req.max_tokens)
                reason = "host" if short else "device"
            if reason is not None:
                req.waited = True
                req.wait_reasons.add(reason)
                out.refused = req.request_id
                break
            self.waiting.popleft()
            rows = self._zero(lay.num_sources, req.prompt_rows, lay.row_dim)
            keys = {layer: self._zero(req.prompt_rows, lay.index_key_dim) for layer in lay.indexer_layers}
            self.kv.import_prompt(req.request_id, rows, keys)
            prefilled += tokens
            self.running.append(req)
            out.admitted.append(req.request_id)
            on_admit(req)  # sets admitted / first-token times
            req.generated = 1
            if req.generated >= req.max_tokens:
                self._finish(req, out)

    def decode(self, out: StepOutcome, query_lens: torch.Tensor, accept: AcceptFn) -> None:
        batch = list(self.running)
        q = int(query_lens.max())
        ids = [r.request_id for r in batch]
        step = self.kv.begin_step(ids, q)
        positions = self.positions(batch, step.starts, query_lens, q)
        b = len(batch)
        for layer in self.layers:
            keys = self._zero(b, q, self.layout.index_key_dim) if layer in self.indexers else None
            step.write(layer, self._zero(b, q, self.layout.row_dim), keys)
            # the rows' locations: the same resolution, hot-cache update and host fetch as ``gather``, without
            # reading the payload-free rows back (they are zeros and nothing uses them)
            step.locations(layer, positions[layer])
        accepted = accept(batch, query_lens)
        remaining = torch.tensor([r.max_tokens - r.generated for r in batch], dtype=torch.int64)
        accepted = torch.minimum(accepted, remaining)
        self.kv.end_step({rid: int(a) for rid, a in zip(ids, accepted.tolist(), strict=True)})
        out.batch, out.query_lens, out.accepted = ids, query_lens.tolist(), accepted.tolist()
        for req, a in zip(batch, accepted.tolist(), strict=True):
            req.generated += a
            if req.generated >= req.max_tokens:
                self._finish(req, out)

    def _finish(self, req: SimRequest, out: StepOutcome) -> None:
        self.running.remove(req)
        self.kv.release(req.request_id)
        out.finished.append(req.request_id)
        self.on_release(req)

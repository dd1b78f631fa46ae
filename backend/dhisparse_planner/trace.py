"""Recording the real engine's KV decisions and selections, and replaying them through :class:`EngineCore`.

:class:`RecordingKV` wraps an ``LLMEngine``'s KV store (``LLM(..., wrap_kv=RecordingKV)``): it forwards every
call and records, per engine step, the admissions, the refused admission, the decode batch, the manager's
counters after the step, and every ``gather``'s positions per request and layer (the selection trace).
:func:`replay` runs the same requests through :class:`EngineCore` with those positions and returns its
per-step outcomes, which must equal the engine's (tests/planner/test_engine_agreement.py).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from dhisparse.kv import KVConfig, KVLayout
from dhisparse_planner.core import COUNTERS, EngineCore, SimRequest, StepOutcome
from dhisparse_planner.locality import ReplaySelector


class _RecordingStep:
    def __init__(self, step, recorder: RecordingKV) -> None:
        self._step, self._rec = step, recorder
        self._seen: dict[int, dict[int, torch.Tensor]] = {}

    def __getattr__(self, name: str):
        return getattr(self._step, name)

    def gather(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        # one clone per distinct positions tensor, so layers sharing a selection share it in the trace too
        per_request = self._seen.get(id(positions))
        if per_request is None:
            per_request = {b: positions[b].clone() for b in range(positions.shape[0])}
            self._seen[id(positions)] = per_request
        for b, rid in enumerate(self._rec.batch_ids):
            self._rec.selections[rid][-1][layer] = per_request[b]
        return self._step.gather(layer, positions)


class RecordingKV:
    """Transparent proxy over a ``KVManager`` that records decisions and selections (see module docstring)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.steps: list[StepOutcome] = []
        self.selections: dict[str, list[dict[int, torch.Tensor]]] = defaultdict(list)
        self.requests: dict[str, tuple[int, int]] = {}
        self.batch_ids: list[str] = []
        self._open: StepOutcome | None = None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def _counters(self) -> dict[str, float]:
        c = self.inner.counters
        out = {name: float(c[name]) for name in COUNTERS}
        out["required_bytes"] = float(self.inner.pool.required_bytes)
        out["optional_bytes"] = float(self.inner.pool.optional_bytes)
        return out

    def finish(self) -> None:
        """Close the last engine step's record (call after the engine's last ``step``)."""
        if self._open is not None:
            self._open.counters = self._counters()
            self.steps.append(self._open)
            self._open = None

    def poll(self) -> None:  # the engine polls first in every step: a new step record starts here
        self.finish()
        self._open = StepOutcome()
        self.inner.poll()

    def try_admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> bool:
        ok = self.inner.try_admit(request_id, prompt_len, max_new_tokens)
        self.requests.setdefault(request_id, (prompt_len, max_new_tokens))
        if self._open is not None:
            if ok:
                self._open.admitted.append(request_id)
            else:
                self._open.refused = request_id
        return ok

    def begin_step(self, request_ids: list[str], query_len: int):
        self.batch_ids = list(request_ids)
        if self._open is not None:
            self._open.batch = list(request_ids)
            self._open.query_lens = [query_len] * len(request_ids)
        for rid in request_ids:
            self.selections[rid].append({})
        return _RecordingStep(self.inner.begin_step(request_ids, query_len), self)

    def end_step(self, accepted: dict[str, int], report: list[int] | None = None) -> None:
        if self._open is not None:
            self._open.accepted = [int(accepted[r]) for r in self.batch_ids]
        self.inner.end_step(accepted, report=report)

    def release(self, request_id: str) -> None:
        if self._open is not None:
            self._open.finished.append(request_id)
        self.inner.release(request_id)


def replay(layout: KVLayout, config: KVConfig, requests: list[tuple[str, int, int]],
           selections: dict[str, list[dict[int, torch.Tensor]]], max_batch_size: int,
           max_prefill_tokens_per_step: int, check_invariants: bool = True) -> list[StepOutcome]:
    """Run ``requests`` (``(id, prompt_len, max_tokens)``, all arrived at once, in order) through
    :class:`EngineCore` with the recorded positions; returns one :class:`StepOutcome` per engine step."""
    selector = ReplaySelector(selections)
    core = EngineCore(layout, config, max_batch_size, max_prefill_tokens_per_step,
                      positions=lambda batch, starts, q, qmax: selector.select_layers(
                          [r.request_id for r in batch], list(range(layout.num_layers)), qmax),
                      on_release=lambda r: selector.forget(r.request_id))
    for rid, prompt, max_tokens in requests:
        core.waiting.append(SimRequest(rid, prompt, max_tokens))
    outcomes: list[StepOutcome] = []
    while core.waiting or core.running:
        out = StepOutcome()
        core.kv.poll()
        core.admit(out, lambda r: None)
        if core.running:
            core.decode(out, torch.ones(len(core.running), dtype=torch.int64),
                        lambda batch, q: torch.ones(len(batch), dtype=torch.int64))
        out.counters = core.counters()
        outcomes.append(out)
        if check_invariants:
            core.kv.check_invariants()
        if len(outcomes) > 100_000:
            raise RuntimeError("replay did not finish")
    return outcomes

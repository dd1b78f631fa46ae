"""The engine of several ranks, presented with ``LLMEngine``'s API (``LLM``, ``EngineLoop`` and the Triton model use
it unchanged): the driver owns the requests as the caller sees them, places each on a data-parallel group, and
forwards every operation and step to the ranks (``rank.py``), which run the scheduler, executor and KV store.

Per ``step``: the request operations queued since the last command go out with it; every rank applies its own,
steps its engine and replies; the driver checks that tensor-parallel ranks reached the same digest (tokens and KV
decisions), merges the groups' updates and applies them to its requests.

Faults: a rank that raises in a forward, whose collective fails or times out, or whose process exits makes the
engine *dead* within the supervision poll (tens of milliseconds) — every open request ends with an error, every
local rank is killed (a rank on another host sees its collectives fail and exits) — and ``step`` / ``add_request``
raise :class:`EngineDeadError`, as ``LLMEngine`` does after a fault it cannot recover from. A rank whose own engine
died (``LLMEngine.dead``) stops the whole engine the same way.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dhisparse.device import resolve_device
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.parallel.imports import RankImports
from dhisparse.engine.parallel.launch import RankFailure, RankProcesses, rendezvous
from dhisparse.engine.parallel.messages import (
    Abort,
    Add,
    Command,
    NeverAdmissible,
    Op,
    PollIdle,
    Ready,
    Reply,
    Shutdown,
    Step,
)
from dhisparse.engine.parallel.rank import RankLaunch, config_digest, drills_from_env
from dhisparse.engine.parallel.shape import ParallelShape
from dhisparse.engine.parallel.stats import aggregate
from dhisparse.engine.request import Request, RequestUpdate, Status, request_seed
from dhisparse.engine.validation import validate_request
from dhisparse.errors import EngineDeadError, InvalidRequestError
from dhisparse.model.loading import AnyConfig, read_any_config
from dhisparse.sampling import SamplingParams

READY_TIMEOUT_FLOOR_S = 600.0  # loading a model's slice may take minutes


@dataclass(frozen=True)
class ModelInfo:
    """What callers read of ``engine.model`` (the weights live in the ranks)."""

    cfg: AnyConfig
    device: torch.device


def least_loaded(demand: list[int], running: list[int]) -> int:
    """The data-parallel group a new request goes to: the least KV demand (rows its unfinished requests may hold:
    prompt + max_tokens each), then the fewest requests, then the lowest group."""
    return min(range(len(demand)), key=lambda g: (demand[g], running[g], g))


class ParallelEngine:
    """``LLMEngine``'s API over the ranks of ``config`` (``world_size > 1``). ``overrides``: runtime options the
    ranks apply to the engine directory's ``runtime.json`` (the same that made ``config``). ``imports``: the ranks'
    source of imported prompts (a disaggregated generation engine, ``engine/parallel/imports.py``); its requests
    are added with ``add_request(…, imported=…)``."""

    def __init__(self, engine_dir: str | Path, config: EngineConfig, overrides: dict[str, Any], threads: int = 1,
                 imports: RankImports | None = None) -> None:
        self.shape = ParallelShape.of(config)
        model_cfg = read_any_config(Path(engine_dir))
        self.shape.check_model(model_cfg)  # a clear error before any process starts
        self.model = ModelInfo(model_cfg, resolve_device(config.device))
        addr, port, local = rendezvous(self.shape.world_size)
        backend = "nccl" if resolve_device(config.device).type == "cuda" else "gloo"
        launch = RankLaunch(str(engine_dir), dict(overrides), self.shape, addr, port, config.collective_timeout_s,
                            threads, config_digest(engine_dir), local, drills_from_env(), backend, imports)
        self.ranks = RankProcesses(launch)
        self._step_timeout_s = max(READY_TIMEOUT_FLOOR_S, 20 * config.collective_timeout_s)
        self._lock = threading.Lock()  # one command in flight (the loop thread steps, submitters validate)
        self.requests: dict[str, Request] = {}
        self.dead: str | None = None
        self._ops: list[Op] = []
        self._ids = itertools.count()
        self._group: dict[str, int] = {}
        groups = self.shape.data_parallel_size
        self._demand, self._running = [0] * groups, [0] * groups
        self._never: dict[tuple[int, int], str | None] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self._closed = False
        try:
            readies: list[Ready] = self.ranks.wait(self._step_timeout_s)
        except BaseException:
            self.ranks.kill()
            raise
        if not isinstance(readies, list) or not all(isinstance(r, Ready) for r in readies):
            self.ranks.kill()
            raise RankFailure(f"unexpected first message from rank 0: {readies!r}")
        first = readies[0]
        self.cfg, self.workspace = first.config, first.workspace
        self.max_model_len, self.max_new_tokens_limit = first.max_model_len, first.max_new_tokens_limit
        self.eos_token_ids = set(model_cfg.eos_token_id)
        self.hosts = [r.host for r in readies]
        self._rank_stats = [r.stats for r in readies]
        self.imports_description = first.imports  # RankImports.describe of rank 0 (None: prompts prefilled)

    # ------------------------------------------------------------------------------------------- requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        validate_request(prompt_token_ids, params, self.model.cfg.vocab_size, self.max_model_len,
                         self.max_new_tokens_limit)
        key = (len(prompt_token_ids), params.max_tokens)
        if key not in self._never:  # depends on the sizes and the (fixed) pool only: asked once per size
            if len(self._never) >= 4096:
                self._never.clear()
            replies = self._command(NeverAdmissible(*key))
            self._never[key] = replies[0].answer
        if self._never[key] is not None:
            raise InvalidRequestError(f"this request can never fit the KV pool: {self._never[key]}")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    *, seed: int | None = None, imported: Any = None) -> str:
        """Queue a request (validated first) on the data-parallel group with the least KV demand; returns its id.
        ``imported``: a generation engine's request, the context phase its ranks import (``RankImports.queue``)."""
        prompt = [int(t) for t in prompt_token_ids]
        self.validate(prompt, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if seed is None:
            seed = request_seed(params, request_id)
        group = least_loaded(self._demand, self._running)
        self._group[request_id] = group
        self._demand[group] += len(prompt) + params.max_tokens
        self._running[group] += 1
        self.requests[request_id] = Request(request_id, prompt, params, seed)
        self._ops.append(Add(request_id, prompt, params, seed, group, imported))
        self.counters["requests_placed"] += 1
        return request_id

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        if reason not in ("abort", "stop"):
            raise ValueError(f"abort reason must be 'abort' or 'stop', got {reason!r}")
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return False
        self._ops.append(Abort(request_id, reason, self._group[request_id]))
        self._finish(req, reason)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._ops) or any(r.status is not Status.FINISHED for r in self.requests.values())

    def poll_idle(self) -> None:
        if self.dead is None:
            self._run(PollIdle(self._take_ops()))

    def pop_finished(self, request_id: str) -> Request:
        return self.requests.pop(request_id)

    def request_stats(self, req: Request) -> dict[str, float]:
        """The rank's figures from the request's finishing update (timing, counters, KV), else the driver's timing."""
        return dict(req.counters) if req.counters else req.timing()

    # ----------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestUpdate]:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        updates = self._run(Step(self._take_ops()))
        self.counters["steps"] += 1
        return updates

    def stats(self) -> dict[str, float]:
        out = aggregate(self.shape, self._rank_stats)
        out.update({f"driver_{k}": float(v) for k, v in self.counters.items()})
        out["engine_dead"] = float(self.dead is not None)
        return out

    def close(self) -> None:
        """Stop every rank (cleanly when they are healthy); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.dead is None:
            try:
                with self._lock:
                    self.ranks.send(Shutdown())
                self.ranks.stop()
                return
            except Exception:
                pass
        self.ranks.kill()

    # ------------------------------------------------------------------------------------------ internals
    def _take_ops(self) -> tuple[Op, ...]:
        ops, self._ops = tuple(self._ops), []
        return ops

    def _command(self, cmd: Command) -> list[Reply]:
        if self._closed:
            raise EngineDeadError(self.dead or "the engine is closed")
        with self._lock:
            try:
                self.ranks.send(cmd)
                replies: list[Reply] = self.ranks.wait(self._step_timeout_s)
            except RankFailure as exc:
                updates: list[RequestUpdate] = []
                self._die(str(exc), updates)
                raise EngineDeadError(self.dead) from exc
        return replies

    def _run(self, cmd: Step | PollIdle) -> list[RequestUpdate]:
        if self._closed:
            raise EngineDeadError(self.dead or "the engine is closed")
        updates: list[RequestUpdate] = []
        try:
            with self._lock:
                self.ranks.send(cmd)
                replies: list[Reply] = self.ranks.wait(self._step_timeout_s)
        except RankFailure as exc:
            self._die(str(exc), updates)
            return updates
        self._rank_stats = [r.stats for r in replies]
        if not self.shape.data_parallel:
            digests = {r.digest for r in replies}
            if len(digests) > 1:
                detail = ", ".join(f"rank {r.rank}: {r.digest}" for r in replies)
                self._die(f"tensor-parallel ranks diverged (tokens or KV decisions differ: {detail})", updates)
                return updates
            merged = replies[0].updates
        else:  # each data-parallel group's own requests (one rank per group: no attention split)
            merged = [u for r in replies for u in r.updates]
        updates.extend(self._absorb(merged))
        dead = next((r.dead for r in replies if r.dead is not None), None)
        if dead is not None:
            self._die(dead, updates)
        return updates

    def _absorb(self, updates: list[RequestUpdate]) -> list[RequestUpdate]:
        """Apply the ranks' updates to the driver's requests (those it already finished — aborted — are dropped)."""
        out = []
        now = time.perf_counter()
        for u in updates:
            req = self.requests.get(u.request_id)
            if req is None or req.status is Status.FINISHED:
                continue
            req.status = Status.RUNNING
            if u.new_token_ids and req.first_token_time is None:
                req.first_token_time = now
            req.output_token_ids.extend(u.new_token_ids)
            if u.new_log_probs:
                req.output_log_probs.extend(u.new_log_probs)
                req.cum_log_prob += sum(u.new_log_probs)
            if u.finished:
                req.counters = dict(u.stats)  # the rank's figures (timing, counters, KV) for request_stats
                self._finish(req, u.finish_reason or "error", u.error)
            out.append(u)
        return out

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.finish_reason, req.error, req.status = reason, error, Status.FINISHED
        req.finish_time = time.perf_counter()
        group = self._group.pop(req.request_id, None)
        if group is not None:
            self._demand[group] -= req.prompt_len + req.params.max_tokens
            self._running[group] -= 1

    def _die(self, reason: str, updates: list[RequestUpdate]) -> None:
        """Stop: kill every local rank, end every open request with an error (appended to ``updates``)."""
        if self.dead is not None:
            return
        self.dead = f"the engine stopped after a fault it could not recover from: {reason}"
        self._closed = True
        self.ranks.kill()
        self._ops.clear()
        for req in list(self.requests.values()):
            if req.status is not Status.FINISHED:
                self._finish(req, "error", self.dead)
                updates.append(RequestUpdate(req.request_id, [], True, "error", {}, error=self.dead))
        self.counters["rank_failures"] += 1


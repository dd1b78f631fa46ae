"""The engine: wires the KV store, the scheduler (who runs) and the executor (how it runs), and owns requests.

Each ``step`` (1) progresses the KV store and the prompts still arriving, (2) admits waiting requests as the
scheduler decides, bringing each one's prompt in (prefill, or a transfer), (3) runs one batched decode or
verification step for every running request; requests join and leave the batch at step boundaries.

Faults: an exception in a request's prefill (or its transfer) ends that request; one in the decode or
verification step (forward, drafter proposal, KV gather) rolls the open KV step back and ends the step's
requests; a failed KV copy ends the requests whose memory it touched (``KVStore.owners_of``; the others of an
interrupted step simply redo it next step, with unchanged output). Ended requests finish with reason ``"error"``
and a message, and their tiers are freed under the usual rules. If the KV invariants do not hold after that, the
engine is *dead*: every request ends with an error, and ``step``/``add_request`` raise :class:`EngineDeadError`.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import time
from collections.abc import Callable

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.executor import Executor, Model, Sampled
from dhisparse.engine.faults import FaultInjector
from dhisparse.engine.prompts import Arrival, LocalPrefill, PromptSource
from dhisparse.engine.request import Request, RequestUpdate, Status, request_seed
from dhisparse.engine.scheduler import Scheduler
from dhisparse.engine.validation import validate_request
from dhisparse.engine.workspace import plan_device
from dhisparse.errors import EngineDeadError, InvalidRequestError
from dhisparse.kv.factory import agree_copy_completion, make_kv_store
from dhisparse.kv.store import CopyError, KVStore
from dhisparse.sampling import SamplingParams, add_counts, initial_counts
from dhisparse.spec.speculator import Speculator

log = logging.getLogger("dhisparse")


class LLMEngine:
    """Owns the model's KV store, the scheduler, the executor and every request. Not thread-safe: one thread calls
    ``step`` (``EngineLoop`` serialises access for servers). ``prompts`` builds the source of imported histories from
    the executor (default :class:`LocalPrefill`; disaggregated decode passes its transfer source). ``wrap_kv`` wraps
    the KV store built here (an observer, e.g. the planner's trace recorder: a ``KVStore`` forwarding every call)."""

    def __init__(self, model: Model, cfg: EngineConfig, speculator: Speculator | None = None,
                 prompts: Callable[[Executor], PromptSource] = LocalPrefill,
                 wrap_kv: Callable[[KVStore], KVStore] | None = None) -> None:
        self.model, self.spec = model, speculator
        positions = model.cfg.max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or positions, positions)
        self.max_new_tokens_limit = cfg.max_new_tokens_limit or self.max_model_len
        self.eos_token_ids = set(model.cfg.eos_token_id)
        query_len = 1 + (speculator.gamma if speculator else 0)
        self.cfg, self.workspace, kv_config = plan_device(model.cfg, cfg, speculator, query_len, self.max_model_len)
        if self.workspace is not None:
            log.info("%s; KV pool %d bytes", self.workspace.describe(), self.cfg.pool_bytes)
        self.faults = FaultInjector(cfg.fault_injection)
        self.kv = make_kv_store(
            model.cfg, policy=cfg.kv_policy, dtype=cfg.torch_dtype, device=model.device, kv_config=kv_config,
            kernels=cfg.kernels, kv_dtype=cfg.kv_dtype, index_key_dtype=cfg.index_key_dtype,
            stream_prefill=cfg.stream_prefill, max_query_len=query_len, max_model_len=self.max_model_len,
            copy_fault_hook=self.faults.copy_hook if self.faults.enabled else None)
        if cfg.agreed_copy_completion:  # tensor-parallel ranks turn it on themselves (engine/parallel/rank.py)
            agree_copy_completion(self.kv)
        self.kv = wrap_kv(self.kv) if wrap_kv is not None else self.kv
        self.scheduler = Scheduler(
            self.kv, max_batch_size=cfg.max_batch_size, max_prefill_tokens_per_step=cfg.max_prefill_tokens_per_step,
            dspark_min_confidence=cfg.dspark_min_confidence, dspark_busy_confidence=cfg.dspark_busy_confidence,
            dspark_busy_batch=cfg.dspark_busy_batch)
        self.executor = Executor(model, self.kv, speculator, self.faults, tuple(self.eos_token_ids),
                                 cfg.prefill_chunk_tokens)
        self.prompts = prompts(self.executor)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.counters: collections.Counter[str] = collections.Counter()
        self.dead: str | None = None  # why the engine stopped, a message for clients (None: serving)

    # ------------------------------------------------------------------------------------------- requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` with a clear message if the request can never be served."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        validate_request(prompt_token_ids, params, self.model.cfg.vocab_size, self.max_model_len,
                         self.max_new_tokens_limit)
        reason = self.kv.never_admissible(len(prompt_token_ids), params.max_tokens)
        if reason is not None:
            raise InvalidRequestError(f"this request can never fit the KV pool: {reason}")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    *, seed: int | None = None) -> str:
        """Queue a request (validated first); returns its id. ``seed``: its random stream's int64 bit pattern
        (default: from ``params.seed`` or the request id)."""
        prompt = [int(t) for t in prompt_token_ids]
        self.validate(prompt, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if seed is None:
            seed = request_seed(params, request_id)
        req = Request(request_id, prompt, params, seed)
        if params.counts_tokens:
            req.token_counts = initial_counts(prompt, self.model.cfg.vocab_size, self.model.device)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.counters["requests_added"] += 1
        return request_id

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a request wherever it is and free everything it holds. Returns False if unknown/finished.
        ``reason`` ``"stop"`` ends it as finished (a caller-side stop sequence matched), not aborted."""
        if reason not in ("abort", "stop"):
            raise ValueError(f"abort reason must be 'abort' or 'stop', got {reason!r}")
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return False
        if self.prompts.cancel(req, reason):
            return True  # in flight: freed once its transfer ended
        self._finish(req, reason)
        if reason == "abort":
            self.counters["requests_aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def poll_idle(self) -> None:
        """Progress the KV store while no request runs (finishes deferred frees of released requests)."""
        self.kv.poll()

    def pop_finished(self, request_id: str) -> Request:
        return self.requests.pop(request_id)

    # ----------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestUpdate]:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        updates: list[RequestUpdate] = []
        try:
            self._guarded(self.kv.poll, [], updates)
            if self.scheduler.arriving:  # prompts still arriving (disaggregated decode): progress them
                for arrival in self.prompts.poll():
                    self._arrived(arrival, updates)
            for admission in self.scheduler.admit() if self.scheduler.waiting else ():
                if admission.error is not None:  # a copy it completed failed (its owners end), or it is at fault
                    self._fail(admission.error, [admission.request], updates)
                else:
                    self._guarded(functools.partial(self._start, admission.request, updates), [admission.request],
                                  updates)
            batch = self.scheduler.decode_batch()
            if batch:
                self._guarded(lambda: self._decode(batch, updates), batch, updates)
        except Exception as exc:  # recovery itself failed: the engine cannot go on
            self._die(f"{type(exc).__name__}: {exc}", updates)
        self.counters["steps"] += 1
        return updates

    def _start(self, req: Request, updates: list[RequestUpdate]) -> None:
        first = self.prompts.start(req)
        if first is None:  # its prompt is arriving: it holds a batch slot until then
            self.scheduler.arriving[req.request_id] = req
            return
        self.scheduler.start_running(req)
        self._append(req, first, updates)

    def _arrived(self, arrival: Arrival, updates: list[RequestUpdate]) -> None:
        req = arrival.request
        if arrival.cancelled is not None:
            self._finish(req, arrival.cancelled)
            if arrival.cancelled == "abort":
                self.counters["requests_aborted"] += 1
        elif arrival.error is not None or arrival.first is None:
            self._end_with_error(req, arrival.error or "the prompt did not arrive", updates)
        else:
            if self.spec is not None:
                assert arrival.features is not None
                req.spec_state = self.spec.start(arrival.features.to(self.model.device), req.prompt_len)
            req.num_computed = req.prompt_len
            self.scheduler.start_running(req)
            self._append(req, arrival.first, updates)

    def _decode(self, batch: list[Request], updates: list[RequestUpdate]) -> None:
        if self.spec is None:
            sampled = self.executor.decode(batch)
        else:
            sampled = self.executor.verify(batch, self.scheduler.verification_threshold(len(batch)))
        for req, new in zip(batch, sampled, strict=True):
            self._append(req, new, updates)

    # ---------------------------------------------------------------------------------------------- faults
    def _guarded(self, work: Callable[[], None], requests: list[Request], updates: list[RequestUpdate]) -> bool:
        """Run ``work``; on an exception end the requests it touched (see the module docstring)."""
        try:
            work()
            return True
        except Exception as exc:
            self._fail(exc, requests, updates)
            return False

    def _fail(self, exc: BaseException, requests: list[Request], updates: list[RequestUpdate]) -> None:
        self.counters["step_faults"] += 1
        if isinstance(exc, CopyError):  # owners first: a step's fetch belongs to the step's requests
            owners = set(self.kv.owners_of(exc))
            requests = [self.requests[rid] for rid in sorted(owners) if rid in self.requests]
        self.kv.abort_step()  # no-op when no step is open
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        for req in requests:
            if req.status is not Status.FINISHED:
                self._end_with_error(req, message, updates)
        self.kv.check_invariants()  # raises into step(): the engine dies

    def _end_with_error(self, req: Request, message: str, updates: list[RequestUpdate]) -> None:
        self._finish(req, "error", message)
        self.counters["requests_failed"] += 1
        updates.append(RequestUpdate(req.request_id, [], True, "error", self.request_stats(req), error=message))

    def _die(self, reason: str, updates: list[RequestUpdate]) -> None:
        """Invariants could not be restored: end every request with an error and refuse all further work."""
        message = self.dead = f"the engine stopped after a fault it could not recover from: {reason}"
        cancelled = self.prompts.close()
        for req in self.scheduler.clear():
            req.finish_reason, req.error, req.status = "error", message, Status.FINISHED
            req.finish_time = time.perf_counter()
            if req.request_id not in cancelled:
                updates.append(RequestUpdate(req.request_id, [], True, "error", {}, error=message))
                self.counters["requests_failed"] += 1

    # --------------------------------------------------------------------------------------------- outputs
    def _append(self, req: Request, sampled: Sampled, updates: list[RequestUpdate]) -> None:
        """Append a step's tokens up to and including the first stop token (EOS too unless ignored) or the length
        limit; stream them."""
        now = time.perf_counter()
        req.first_token_time = now if req.first_token_time is None else req.first_token_time
        stops = req.stop_ids if req.params.ignore_eos else req.stop_ids | self.eos_token_ids
        room = req.params.max_tokens - len(req.output_token_ids)
        new, reason = list(sampled.tokens), None
        for i, t in enumerate(sampled.tokens):
            if t in stops or i + 1 >= room:
                new, reason = sampled.tokens[: i + 1], "stop" if t in stops else "length"
                break
        req.output_token_ids.extend(new)
        self.counters["generated_tokens"] += len(new)
        req.last_token_time = now
        if req.token_counts is not None:
            add_counts(req.token_counts, new)
        update = RequestUpdate(req.request_id, new, reason is not None, reason)
        if req.params.logprobs and sampled.log_probs is not None:
            update.new_log_probs = [float(x) for x in sampled.log_probs[: len(new)]]
            req.output_log_probs.extend(update.new_log_probs)
            req.cum_log_prob += sum(update.new_log_probs)
        if req.params.generation_logits and sampled.logits is not None:
            update.new_logits = sampled.logits[: len(new)].float().cpu()
        if req.context_logits is not None:
            update.context_logits, req.context_logits = req.context_logits.float().cpu(), None
        if reason is not None:
            self._finish(req, reason)
        if reason is not None or req.params.perf_metrics:
            update.stats = self.request_stats(req)
        updates.append(update)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.finish_reason, req.error = reason, error
        req.finish_time = time.perf_counter()
        self.scheduler.remove(req)
        if req.kv_admitted or req.counters.get("waited"):  # a refused request may be queued by the store too
            if req.kv_admitted:
                req.counters.update(self.kv.request_stats(req.request_id))
                if reason != "error":  # its complete pages may serve later requests (prefix reuse)
                    self.kv.set_token_ids(req.request_id, req.prompt_token_ids + req.output_token_ids)
            req.kv_admitted = False
            self.kv.release(req.request_id)
        if self.spec is not None and req.spec_state is not None:
            self.spec.release(req.spec_state)
            req.spec_state = None
        req.status = Status.FINISHED
        self.counters["requests_finished"] += 1

    # ---------------------------------------------------------------------------------------------- stats
    def request_stats(self, req: Request) -> dict[str, float]:
        """Timing (``Request.timing``), counters, ``kv_pages``: the KV pages (``page_rows`` rows each, per KV source)
        the request's stored tokens span, and ``kv_prefix_reused_pages``: of those, found in the prefix cache."""
        pages = -(-req.num_computed // self.cfg.page_rows) if self.cfg.page_rows else 0
        reused = int(req.counters.get("prefill_tokens_reused", 0.0)) // self.cfg.page_rows
        return {**req.timing(), **req.counters, "kv_pages": float(pages), "kv_prefix_reused_pages": float(reused),
                "cum_log_prob": req.cum_log_prob}

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counters.items()}
        out["admissions_waited"] = float(self.scheduler.admissions_waited)
        out["requests_waiting"] = float(len(self.scheduler.waiting))
        out["requests_running"] = float(len(self.scheduler.running))
        out["engine_dead"] = float(self.dead is not None)
        out.update(self.executor.stats())
        out.update(self.prompts.stats())
        out.update(self.kv.stats())
        if self.workspace is not None:
            out["workspace_bound_bytes"] = float(self.workspace.total_bytes)
        return out


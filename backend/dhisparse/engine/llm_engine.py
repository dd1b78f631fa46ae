"""The engine: request queue, continuous batching, prefill, batched decode, sampling, streaming updates."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
import zlib
from collections.abc import Callable
from typing import NamedTuple

import torch

from dhisparse.device import resolve_device
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.faults import FaultInjector, FaultyStepKV
from dhisparse.engine.kv_factory import hierarchy_layout_config, make_kv_manager
from dhisparse.engine.prefill_stream import StreamedPrefillKV
from dhisparse.engine.request import Request, RequestUpdate, Status
from dhisparse.engine.workspace import auto_pool_bytes, kv_fixed_bytes, workspace_bound
from dhisparse.errors import ConfigError, EngineDeadError, InvalidRequestError
from dhisparse.host_values import to_device
from dhisparse.kv.copies import CopyError
from dhisparse.kv.policies import policy_named
from dhisparse.model.model import DSAModel
from dhisparse.sampling import (
    LogitsProcessor,
    SamplingParams,
    add_counts,
    filtered_probs,
    initial_counts,
    sample,
    seed_to_int64,
    token_log_probs,
    uniform,
)
from dhisparse.spec.acceptance import greedy_accept, rejection_accept
from dhisparse.spec.speculator import Speculator

log = logging.getLogger("dhisparse")


class BatchSampling(NamedTuple):
    """The sampling parameters of a batch as tensors ``[B]``, built once per step."""

    temperature: torch.Tensor  # float64
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float64
    seeds: torch.Tensor  # int64 bit patterns of the requests' random streams
    counters: torch.Tensor  # int64, tokens generated so far (the stream position)
    processor: LogitsProcessor | None  # penalties / bias / bad words / min_tokens of the rows that ask for them

    @classmethod
    def of(cls, batch: list[Request], device: torch.device, eos_token_ids: tuple[int, ...] = (),
           vocab: int = 0) -> BatchSampling:
        params = [r.params for r in batch]
        processor = LogitsProcessor.build(
            params, [(r.prompt_token_ids, r.output_token_ids) for r in batch], [r.token_counts for r in batch],
            eos_token_ids, vocab, device) if any(p.processes_logits for p in params) else None
        # Two copies per step (one per dtype), each row a view.
        temperature, top_p = to_device([[p.temperature for p in params], [p.top_p for p in params]], torch.float64,
                                       device).unbind(0)
        top_k, seeds, counters = to_device([[p.top_k for p in params], [r.seed for r in batch],
                                            [len(r.output_token_ids) for r in batch]], torch.int64, device).unbind(0)
        return cls(temperature, top_k, top_p, seeds, counters, processor)

    def process(self, logits: torch.Tensor, draft: torch.Tensor | None = None) -> torch.Tensor:
        """``logits [B, Q, V]`` after each row's logit processing (unchanged rows are not copied when none)."""
        return logits if self.processor is None else self.processor.apply(logits, draft)


class LLMEngine:
    """Owns the model, the KV manager and every request. Not thread-safe: one thread calls ``step``
    (``EngineLoop`` serialises access for servers).

    Each ``step`` (1) admits waiting requests in arrival order while the KV manager accepts them and the batch
    has room, prefilling each (chunked) and sampling its first token, then (2) runs one batched decode step
    for every running request. A request that cannot be admitted stays queued; requests join and leave the
    batch at step boundaries.

    Faults: an exception in a request's prefill ends that request; one in the decode or verification step
    (forward, drafter proposal, KV gather) rolls the open KV step back and ends the step's requests; a failed
    KV copy ends the requests whose memory it touched (the others of an interrupted step simply redo it next
    step, with unchanged output). Ended requests finish with reason ``"error"`` and a message, and their tiers
    are freed under the usual rules. If the KV invariants do not hold after that, the engine is *dead*:
    every request ends with an error, and ``step``/``add_request`` raise :class:`EngineDeadError`.
    """

    def __init__(self, model: DSAModel, cfg: EngineConfig, speculator: Speculator | None = None) -> None:
        self.model, self.cfg, self.spec = model, cfg, speculator
        mcfg = model.cfg
        self.max_model_len = min(cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        self.max_new_tokens_limit = cfg.max_new_tokens_limit or self.max_model_len
        self.eos_token_ids = set(mcfg.eos_token_id)
        self.query_len = 1 + (speculator.gamma if speculator else 0)
        is_v4 = getattr(mcfg, "model_type", None) == "deepseek_v4"
        # Prompts stream into their host pages chunk by chunk where the policy keeps a host store (native rows).
        self.streams_prefill = (cfg.stream_prefill and not is_v4 and isinstance(model, DSAModel)
                                and cfg.kv_dtype == "auto"
                                and policy_named(cfg.kv_policy, "kv_policy").uses_host)
        # The workspace bound models the DSA (GLM / DeepSeek-V3.2) forward; deepseek_v4 has none yet.
        ring = speculator.ring_bytes_per_request if speculator is not None else 0
        self.workspace = None if is_v4 else workspace_bound(
            mcfg, cfg.torch_dtype, max_batch_size=cfg.max_batch_size, prefill_chunk_tokens=cfg.prefill_chunk_tokens,
            query_len=self.query_len, max_model_len=self.max_model_len, page_rows=cfg.page_rows,
            hot_rows=cfg.hot_rows or mcfg.index_topk, streamed_prefill=self.streams_prefill,
            kv_fixed_bytes=self._kv_fixed_bytes(cfg, ring), keys_in_place=cfg.index_key_dtype != "fp8")
        if cfg.pool_bytes == 0:  # "auto"
            if self.workspace is None:
                raise ConfigError("pool_bytes 0 ('auto') needs the device workspace bound, which is not modelled "
                                  "for deepseek_v4; set pool_bytes")
            cfg = dataclasses.replace(cfg, pool_bytes=auto_pool_bytes(resolve_device(cfg.device), self.workspace))
            self.cfg = cfg
        if self.workspace is not None:
            log.info("%s; KV pool %d bytes", self.workspace.describe(), cfg.pool_bytes)
        self.kv = make_kv_manager(mcfg, cfg, self.query_len, draft_ring_bytes=ring)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.counters: collections.Counter[str] = collections.Counter()
        self.faults = FaultInjector(cfg.fault_injection)
        if self.faults.enabled and hasattr(self.kv, "copies"):
            self.kv.copies.fault_hook = self.faults.copy_hook
        self._fault_layer = mcfg.num_hidden_layers // 2
        self.dead: str | None = None  # why the engine stopped, a message for clients (None: serving)

    def _kv_fixed_bytes(self, cfg: EngineConfig, ring: int) -> int:
        """The KV side's fixed device state beside the arena (``engine/workspace.py``): the hierarchy's batch state,
        scratch and zero pages, and the draft ring's tensors (0 for the dense reference store)."""
        spec_bytes = 0 if self.spec is None else sum(t.numel() * t.element_size()
                                                     for t in (self.spec.ring.rows, self.spec.ring.count))
        if policy_named(cfg.kv_policy, "kv_policy").reference_store:
            return spec_bytes
        sized = dataclasses.replace(cfg, pool_bytes=max(cfg.pool_bytes, cfg.reserve_bytes + 1))
        layout, kv_cfg = hierarchy_layout_config(self.model.cfg, sized, self.query_len, ring)
        return kv_fixed_bytes(layout, kv_cfg, spec_bytes)

    # ------------------------------------------------------------------------------------------- requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` with a clear message if the request can never be served."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        if len(prompt_token_ids) == 0:
            raise InvalidRequestError("the prompt is empty: at least one token is required")
        vocab = self.model.cfg.vocab_size
        ids = torch.as_tensor(prompt_token_ids)
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise InvalidRequestError("prompt token ids must be integers")
        if bool(((ids < 0) | (ids >= vocab)).any()):
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_token_ids)} tokens; the engine's maximum is {self.max_model_len - 1}"
            )
        if params.max_tokens > self.max_new_tokens_limit:
            raise InvalidRequestError(
                f"max_tokens {params.max_tokens} exceeds the engine limit of {self.max_new_tokens_limit}"
            )
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"engine's max_model_len ({self.max_model_len})"
            )
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise InvalidRequestError(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {vocab})")
        bad_ids = [t for t in params.token_ids_used() if not 0 <= t < vocab]
        if bad_ids:
            raise InvalidRequestError(f"token id {bad_ids[0]} in bad_words / logit_bias is outside the vocabulary "
                                      f"[0, {vocab})")
        reason = self.kv.never_admissible(len(prompt_token_ids), params.max_tokens)
        if reason is not None:
            raise InvalidRequestError(f"this request can never fit the KV pool: {reason}")

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a request (validated first); returns its id."""
        prompt = [int(t) for t in prompt_token_ids]
        self.validate(prompt, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else zlib.crc32(request_id.encode())
        req = Request(request_id, prompt, params, seed_to_int64(seed))
        if params.counts_tokens:
            req.token_counts = initial_counts(prompt, self.model.cfg.vocab_size, self.model.device)
        self.requests[request_id] = req
        self.waiting.append(req)
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
        self._finish(req, reason)
        if reason == "abort":
            self.counters["requests_aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def poll_idle(self) -> None:
        """Progress the KV manager while no request runs (finishes deferred frees of released requests)."""
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
            self._admit_and_prefill(updates)
            if self.running:
                self._guarded(lambda: self._decode(updates), list(self.running), updates)
        except Exception as exc:  # recovery itself failed: the engine cannot go on
            self._die(f"{type(exc).__name__}: {exc}", updates)
        self.counters["steps"] += 1
        return updates

    # ---------------------------------------------------------------------------------------------- faults
    def _guarded(self, work: Callable[[], None], requests: list[Request], updates: list[RequestUpdate]) -> bool:
        """Run ``work``; on an exception end the requests it touched (see the class docstring)."""
        try:
            work()
            return True
        except Exception as exc:
            self._fail(exc, requests, updates)
            return False

    def _fail(self, exc: BaseException, requests: list[Request], updates: list[RequestUpdate]) -> None:
        self.counters["step_faults"] += 1
        if isinstance(exc, CopyError):  # owners first: a step's fetch belongs to the step's requests
            owners = set(self.kv.owners_of(exc.ticket))
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
        for req in [*self.waiting, *self.running]:
            req.finish_reason, req.error, req.status = "error", message, Status.FINISHED
            req.finish_time = time.perf_counter()
            updates.append(RequestUpdate(req.request_id, [], True, "error", {}, error=message))
        self.counters["requests_failed"] += len(self.waiting) + len(self.running)
        self.waiting.clear()
        self.running.clear()

    def _break_invariants(self) -> None:
        """Fault injection ``break_invariants``: corrupt the pool's byte accounting, then fail the step."""
        pool = getattr(self.kv, "pool", None)
        if pool is not None:
            pool.required_bytes += 1
        raise RuntimeError("injected fault at break_invariants (pool accounting corrupted)")

    def _admit_and_prefill(self, updates: list[RequestUpdate]) -> None:
        prefilled = 0
        while self.waiting and len(self.running) < self.cfg.max_batch_size:
            req = self.waiting[0]
            if prefilled and prefilled + req.prompt_len > self.cfg.max_prefill_tokens_per_step:
                break
            try:
                admitted = self.kv.try_admit(req.request_id, req.prompt_len, req.params.max_tokens)
            except Exception as exc:  # a copy it completed failed (its owners end), or this request is at fault
                self._fail(exc, [req], updates)
                continue
            if not admitted:
                if not req.counters.get("waited"):
                    req.counters["waited"] = 1.0
                    self.counters["admissions_waited"] += 1
                break
            self.waiting.popleft()
            req.kv_admitted = True
            req.admitted_time = time.perf_counter()
            req.status = Status.RUNNING
            self.running.append(req)
            prefilled += req.prompt_len
            self._guarded(lambda req=req: self._prefill(req, updates), [req], updates)

    def _prefill(self, req: Request, updates: list[RequestUpdate]) -> None:
        store = self._streamed_prefill_store(req)
        out = self.model.prefill(req.prompt_token_ids, chunk_tokens=self.cfg.prefill_chunk_tokens,
                                 capture_hidden=self.spec.layers if self.spec else (),
                                 all_logits=req.params.context_logits, on_chunk=self._prefill_chunk_hook,
                                 **({"store": store} if store is not None else {}))  # DSAModel only
        if req.params.context_logits:
            req.context_logits = out.all_logits
        if out.rows is None:  # streamed: the rows are in the request's host pages already (and the keys in place)
            assert store is not None
            self.kv.import_host_history(req.request_id, None if store.request_keys is not None else out.index_keys)
        else:
            self.kv.import_prompt(req.request_id, out.rows, out.index_keys)
        if self.spec is not None:
            req.spec_state = self.spec.start(self.spec.features(out.hidden))
        req.num_computed = req.prompt_len
        self.counters["prefill_tokens"] += req.prompt_len
        self._sample_and_append([req], out.logits.unsqueeze(0), updates)

    def _streamed_prefill_store(self, req: Request) -> StreamedPrefillKV | None:
        """The store that streams this prompt into its host pages (see ``engine/prefill_stream.py``), or ``None``
        to prefill over a ``LocalKV`` of the whole prompt (no host store, FP8 rows, the dense reference, V4)."""
        if not self.streams_prefill:
            return None
        row_index = self.kv.history_host_rows(req.request_id)
        if row_index is None:
            return None
        return StreamedPrefillKV(self.kv.layout, self.kv.host.rows, row_index, self.cfg.prefill_chunk_tokens,
                                 self.model.dtype, self.model.device, self.kv.request_keys(req.request_id))

    def _prefill_chunk_hook(self, start: int) -> None:
        self.faults.hit("prefill_chunk")

    def _decode(self, updates: list[RequestUpdate]) -> None:
        if self.faults.fires("break_invariants"):
            self._break_invariants()
        if self.spec is not None:
            self._speculative_decode(updates)
            return
        batch = self.running
        dev = self.model.device
        ids, positions = to_device([[[r.last_token] for r in batch], [[r.num_computed] for r in batch]], torch.int64,
                                   dev).unbind(0)  # one copy
        step_kv = self._faulty(self.kv.begin_step([r.request_id for r in batch], 1), "decode_forward")
        out = self.model.forward(ids, positions, step_kv)
        sampling = self._batch_sampling(batch)
        processed = sampling.process(out.logits[:, -1].unsqueeze(1))[:, 0]
        tokens_t = self._sample_tensor(batch, sampling, processed)
        # One host read per decode step: the sampled tokens together with the KV step's report.
        (tokens,), report = self._read_step(step_kv, tokens_t)
        self._end_step({r.request_id: 1 for r in batch}, report)
        self.counters["decode_steps"] += 1
        self.counters["decode_batch_rows"] += len(batch)
        for req in batch:
            req.num_computed += 1
        self._append_sampled(list(batch), sampling, processed, tokens_t, tokens, updates)

    def _speculative_decode(self, updates: list[RequestUpdate]) -> None:
        """Draft → one batched verification forward over ``1 + gamma`` positions → exact acceptance."""
        spec, batch, dev = self.spec, self.running, self.model.device
        assert spec is not None
        slots, last = to_device([[r.spec_state for r in batch], [r.last_token for r in batch]], torch.int64,
                                dev).unbind(0)  # one copy
        sampling = self._batch_sampling(batch)
        self.faults.hit("draft_propose")
        draft, q_draft, lengths, confidence = spec.propose(slots, last, len(batch), sampling.temperature,
                                                           sampling.seeds, sampling.counters)
        # Every request verifies its own `lengths[b]`; the batch pads to the max (without a confidence head every
        # request verifies all gamma drafts, known without reading the device).
        q_len = spec.gamma + 1 if confidence is None else self._read(lengths.max())[0][0] + 1
        draft, q_draft = draft[:, : q_len - 1], q_draft[:, : q_len - 1]
        ids = torch.cat([last.unsqueeze(1), draft], dim=1)
        base = to_device([r.num_computed for r in batch], torch.int64, dev)
        positions = base.unsqueeze(1) + torch.arange(q_len, device=dev)
        step_kv = self.kv.begin_step([r.request_id for r in batch], q_len)
        step_kv = self._faulty(step_kv, "verify_forward")
        out = self.model.forward(ids, positions, step_kv, all_logits=True, capture_hidden=spec.layers)
        logits = sampling.process(out.logits, draft)  # the same processing as the plain path, per position
        any_sampled = any(r.params.temperature > 0 for r in batch)
        accepted, next_tokens = self._accept(sampling, logits, draft, q_draft, lengths, any_sampled)
        emitted = torch.cat([draft, next_tokens.unsqueeze(1)], dim=1).scatter(  # [B, Q]: d_1 … d_n, next
            1, accepted.unsqueeze(1), next_tokens.unsqueeze(1))
        extras = self._token_extras(batch, sampling, logits, emitted)
        # One host read after verification: acceptance, next tokens, drafts and lengths with the KV step's report.
        (acc_l, next_l, draft_flat, len_l), report = self._read_step(step_kv, accepted, next_tokens, draft, lengths)
        kept_l = [n + 1 for n in acc_l]  # the last accepted token's row and the accepted drafts' rows stay
        self._end_step({r.request_id: k for r, k in zip(batch, kept_l, strict=True)}, report)
        spec.advance(slots, spec.features(out.hidden), accepted + 1)
        self.counters["verify_steps"] += 1
        self.counters["verify_rows"] += len(batch)
        self.counters["draft_tokens_proposed"] += sum(len_l)
        self.counters["draft_tokens_accepted"] += sum(acc_l)
        self.counters["draft_tokens_shortened"] += sum(spec.gamma - g for g in len_l)
        width = draft.shape[1]
        draft_l = [draft_flat[i * width:(i + 1) * width] for i in range(len(batch))]
        for b, (req, n, k, nxt, row, g) in enumerate(zip(list(batch), acc_l, kept_l, next_l, draft_l, len_l,
                                                         strict=True)):
            req.num_computed += k
            req.counters["draft_tokens_proposed"] = req.counters.get("draft_tokens_proposed", 0.0) + g
            req.counters["draft_tokens_accepted"] = req.counters.get("draft_tokens_accepted", 0.0) + n
            req.counters["verify_steps"] = req.counters.get("verify_steps", 0.0) + 1
            self._append_tokens(req, row[:n] + [nxt], updates, *(extra[b][: n + 1] if extra is not None else None
                                                                  for extra in extras))

    def _faulty(self, step_kv: object, site: str) -> object:
        return FaultyStepKV(step_kv, self.faults, site, self._fault_layer) if self.faults.enabled else step_kv

    # ------------------------------------------------------------------------------------------ host reads
    def _read(self, *tensors: torch.Tensor) -> list[list]:
        """Every tensor's values (flattened) in one host read, counted by the KV manager's ``HostSync`` where it
        has one (the deepseek_v4 managers do not: plain reads)."""
        sync = getattr(self.kv, "sync", None)
        if sync is None:
            return [t.reshape(-1).tolist() for t in tensors]
        return sync.read(*tensors)

    def _read_step(self, step_kv: object, *tensors: torch.Tensor) -> tuple[list[list], list[int] | None]:
        """``tensors`` and the KV step's deferred report (where its manager defers its checks) in one read."""
        report = getattr(step_kv, "report", None)
        if report is None or getattr(self.kv, "sync", None) is None:
            return self._read(*tensors), None
        *values, rep = self._read(*tensors, report())
        return values, rep

    def _end_step(self, accepted: dict[str, int], report: list[int] | None) -> None:
        if report is None:
            self.kv.end_step(accepted)
        else:
            self.kv.end_step(accepted, report=report)

    @staticmethod
    def _accept(sampling: BatchSampling, logits: torch.Tensor, draft: torch.Tensor, q_draft: torch.Tensor,
                lengths: torch.Tensor, any_sampled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy rows: prefix match. Sampled rows: rejection sampling against the drafts' proposal law ``q``.
        ``any_sampled``: whether a row has a temperature above 0 (known on the host)."""
        accepted, next_tokens = greedy_accept(logits, draft, lengths)
        sampled = sampling.temperature > 0
        if not any_sampled:
            return accepted, next_tokens
        b, q, v = logits.shape
        p = filtered_probs(logits.reshape(b * q, v), sampling.temperature.repeat_interleave(q),
                           sampling.top_k.repeat_interleave(q), sampling.top_p.repeat_interleave(q)).view(b, q, v)
        steps = sampling.counters.unsqueeze(1) + torch.arange(q - 1, device=logits.device)
        u_accept = uniform(sampling.seeds.unsqueeze(1).expand_as(steps), steps, stream=1)
        u_next = uniform(sampling.seeds, sampling.counters, stream=2)
        s_acc, s_next = rejection_accept(p, draft, q_draft, lengths, u_accept, u_next)
        return torch.where(sampled, s_acc, accepted), torch.where(sampled, s_next, next_tokens)

    def _batch_sampling(self, batch: list[Request]) -> BatchSampling:
        return BatchSampling.of(batch, self.model.device, tuple(self.eos_token_ids), self.model.cfg.vocab_size)

    @staticmethod
    def _sample_tensor(batch: list[Request], sampling: BatchSampling, processed: torch.Tensor) -> torch.Tensor:
        greedy = all(r.params.temperature <= 0 for r in batch)
        return sample(processed, *sampling[:5], all_greedy=greedy)

    def _sample_and_append(self, batch: list[Request], logits: torch.Tensor, updates: list[RequestUpdate]) -> None:
        """Sample one token per request from ``logits [B, V]`` (after its logit processing) and append it."""
        sampling = self._batch_sampling(batch)
        processed = sampling.process(logits.unsqueeze(1))[:, 0]
        tokens_t = self._sample_tensor(batch, sampling, processed)
        self._append_sampled(batch, sampling, processed, tokens_t, self._read(tokens_t)[0], updates)

    def _append_sampled(self, batch: list[Request], sampling: BatchSampling, processed: torch.Tensor,
                        tokens_t: torch.Tensor, tokens: list[int], updates: list[RequestUpdate]) -> None:
        extras = self._token_extras(batch, sampling, processed.unsqueeze(1), tokens_t.unsqueeze(1))
        for b, (req, token) in enumerate(zip(batch, tokens, strict=True)):
            self._append_tokens(req, [token], updates, *(extra[b] if extra is not None else None for extra in extras))

    @staticmethod
    def _token_extras(batch: list[Request], sampling: BatchSampling, logits: torch.Tensor, tokens: torch.Tensor
                      ) -> tuple[list[list[float]] | None, torch.Tensor | None]:
        """What requests asked to get with their tokens, for ``tokens [B, Q]`` chosen at ``logits [B, Q, V]``:
        log-probabilities (per request a list over Q; None when nobody asked) and the processed logits."""
        log_probs = None
        if any(r.params.logprobs for r in batch):
            q = tokens.shape[1]
            log_probs = token_log_probs(logits, sampling.temperature.unsqueeze(1).expand(-1, q), tokens).tolist()
        gen_logits = logits if any(r.params.generation_logits for r in batch) else None
        return log_probs, gen_logits

    def _append_tokens(self, req: Request, tokens: list[int], updates: list[RequestUpdate],
                       log_probs: list[float] | None = None, logits: torch.Tensor | None = None) -> None:
        """Append accepted tokens, stopping at a stop token or the length limit. ``log_probs`` / ``logits
        [len(tokens), V]`` come along when the request asked for them."""
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        new: list[int] = []
        reason = None
        stops = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            stops |= self.eos_token_ids
        for t in tokens:
            new.append(t)
            req.output_token_ids.append(t)
            if t in stops:
                reason = "stop"
                break
            if len(req.output_token_ids) >= req.params.max_tokens:
                reason = "length"
                break
        self.counters["generated_tokens"] += len(new)
        req.last_token_time = time.perf_counter()
        if req.token_counts is not None:
            add_counts(req.token_counts, new)
        update = RequestUpdate(req.request_id, new, reason is not None, reason)
        if req.params.logprobs and log_probs is not None:
            update.new_log_probs = [float(x) for x in log_probs[: len(new)]]
            req.output_log_probs.extend(update.new_log_probs)
            req.cum_log_prob += sum(update.new_log_probs)
        if req.params.generation_logits and logits is not None:
            update.new_logits = logits[: len(new)].float().cpu()
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
        if req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
            if req.counters.get("waited") and not req.kv_admitted:
                self.kv.release(req.request_id)  # the manager queued it when try_admit said no
        if req in self.running:
            self.running.remove(req)
        if req.kv_admitted:
            req.counters.update(self.kv.request_stats(req.request_id))
            req.kv_admitted = False
            self.kv.release(req.request_id)
        if self.spec is not None and req.spec_state is not None:
            self.spec.release(req.spec_state)
            req.spec_state = None
        req.status = Status.FINISHED
        self.counters["requests_finished"] += 1

    # ---------------------------------------------------------------------------------------------- stats
    def request_stats(self, req: Request) -> dict[str, float]:
        """Timing (``Request.timing``), counters, and ``kv_pages``: the KV pages (``page_rows`` rows each, per
        KV source) the request's stored tokens span."""
        pages = -(-req.num_computed // self.cfg.page_rows) if self.cfg.page_rows else 0
        return {**req.timing(), **req.counters, "kv_pages": float(pages), "cum_log_prob": req.cum_log_prob}

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counters.items()}
        out["requests_waiting"] = float(len(self.waiting))
        out["requests_running"] = float(len(self.running))
        out["engine_dead"] = float(self.dead is not None)
        out.update(self.kv.stats())
        if self.workspace is not None:
            out["workspace_bound_bytes"] = float(self.workspace.total_bytes)
        if self.spec is not None:
            out["spec_ring_bytes_per_request"] = float(self.spec.ring_bytes_per_request)
            out["spec_staging_bytes_per_request"] = float(getattr(self.kv, "staging_overflow_bytes_per_request", 0))
            proposed = out.get("draft_tokens_proposed", 0.0)
            out["draft_acceptance_rate"] = out.get("draft_tokens_accepted", 0.0) / proposed if proposed else 0.0
            steps = out.get("verify_rows", 0.0)
            out["tokens_per_verify_step"] = (out.get("draft_tokens_accepted", 0.0) + steps) / steps if steps else 0.0
        return out

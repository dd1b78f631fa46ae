"""The engine: request queue, continuous batching, prefill, batched decode, sampling, streaming updates."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
import zlib
from typing import NamedTuple

import torch

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.kv_factory import default_hot_rows, make_kv_manager
from dhisparse.engine.request import Request, RequestUpdate, Status
from dhisparse.engine.sampling import SamplingParams, filtered_probs, sample, seed_to_int64, uniform
from dhisparse.engine.workspace import auto_pool_bytes, workspace_bound
from dhisparse.errors import InvalidRequestError
from dhisparse.model.model import DSAModel
from dhisparse.spec.acceptance import greedy_accept, rejection_accept
from dhisparse.spec.speculator import Speculator
from dhisparse.spec.staging import VerificationStaging

log = logging.getLogger("dhisparse")


class BatchSampling(NamedTuple):
    """The sampling parameters of a batch as tensors ``[B]``, built once per step."""

    temperature: torch.Tensor  # float64
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float64
    seeds: torch.Tensor  # int64 bit patterns of the requests' random streams
    counters: torch.Tensor  # int64, tokens generated so far (the stream position)

    @classmethod
    def of(cls, batch: list[Request], device: torch.device) -> BatchSampling:
        return cls(
            torch.tensor([r.params.temperature for r in batch], dtype=torch.float64, device=device),
            torch.tensor([r.params.top_k for r in batch], dtype=torch.int64, device=device),
            torch.tensor([r.params.top_p for r in batch], dtype=torch.float64, device=device),
            torch.tensor([r.seed for r in batch], dtype=torch.int64, device=device),
            torch.tensor([len(r.output_token_ids) for r in batch], dtype=torch.int64, device=device),
        )


class LLMEngine:
    """Owns the model, the KV manager and every request. Not thread-safe: one thread calls ``step``
    (``EngineLoop`` serialises access for servers).

    Each ``step`` (1) admits waiting requests in arrival order while the KV manager accepts them and the batch
    has room, prefilling each (chunked) and sampling its first token, then (2) runs one batched decode step
    for every running request. A request that cannot be admitted stays queued; requests join and leave the
    batch at step boundaries.
    """

    def __init__(self, model: DSAModel, cfg: EngineConfig, speculator: Speculator | None = None) -> None:
        self.model, self.cfg, self.spec = model, cfg, speculator
        mcfg = model.cfg
        self.max_model_len = min(cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        self.max_new_tokens_limit = cfg.max_new_tokens_limit or self.max_model_len
        self.eos_token_ids = set(mcfg.eos_token_id)
        self.query_len = 1 + (speculator.gamma if speculator else 0)
        self.staging = None
        extra = 0
        if speculator is not None:
            groups = mcfg.index_groups
            self.staging = VerificationStaging(
                max(len(g) for g in groups), cfg.max_batch_size, self.query_len,
                min(mcfg.index_topk, self.max_model_len), mcfg.row_dim, cfg.torch_dtype, torch.device(cfg.device))
            self._staging_slot = tuple(g.index(i) for g in groups for i in g)
            extra = speculator.ring_bytes_per_request + self.staging.bytes_per_request()
        self.spec_bytes_per_request = extra
        self.workspace = workspace_bound(
            mcfg, cfg.torch_dtype, max_batch_size=cfg.max_batch_size, prefill_chunk_tokens=cfg.prefill_chunk_tokens,
            query_len=self.query_len, max_model_len=self.max_model_len, page_rows=cfg.page_rows,
            hot_rows=cfg.hot_rows or default_hot_rows(mcfg, self.query_len))
        if cfg.pool_bytes == 0:  # "auto"
            cfg = dataclasses.replace(cfg, pool_bytes=auto_pool_bytes(torch.device(cfg.device), self.workspace))
            self.cfg = cfg
        log.info("%s; KV pool %d bytes", self.workspace.describe(), cfg.pool_bytes)
        self.kv = make_kv_manager(mcfg, cfg, self.query_len, extra_required_bytes=extra)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.counters: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------------------------------- requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` with a clear message if the request can never be served."""
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
        self.requests[request_id] = req
        self.waiting.append(req)
        self.counters["requests_added"] += 1
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free everything it holds. Returns False if unknown/finished."""
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return False
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            if req.counters.get("waited"):
                self.kv.release(req.request_id)  # the manager queued it when try_admit said no
        self._finish(req, "abort")
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
        updates: list[RequestUpdate] = []
        self.kv.poll()
        self._admit_and_prefill(updates)
        if self.running:
            self._decode(updates)
        self.counters["steps"] += 1
        return updates

    def _admit_and_prefill(self, updates: list[RequestUpdate]) -> None:
        prefilled = 0
        while self.waiting and len(self.running) < self.cfg.max_batch_size:
            req = self.waiting[0]
            if prefilled and prefilled + req.prompt_len > self.cfg.max_prefill_tokens_per_step:
                break
            if not self.kv.try_admit(req.request_id, req.prompt_len, req.params.max_tokens):
                if not req.counters.get("waited"):
                    req.counters["waited"] = 1.0
                    self.counters["admissions_waited"] += 1
                break
            self.waiting.popleft()
            req.admitted_time = time.perf_counter()
            req.status = Status.RUNNING
            out = self.model.prefill(req.prompt_token_ids, chunk_tokens=self.cfg.prefill_chunk_tokens,
                                     capture_hidden=self.spec.layers if self.spec else ())
            self.kv.import_prompt(req.request_id, out.rows, out.index_keys)
            if self.spec is not None:
                req.spec_state = self.spec.start(self.spec.features(out.hidden))
            req.num_computed = req.prompt_len
            prefilled += req.prompt_len
            self.counters["prefill_tokens"] += req.prompt_len
            self.running.append(req)
            token = self._sample([req], out.logits.unsqueeze(0))[0]
            self._append_tokens(req, [token], updates)

    def _decode(self, updates: list[RequestUpdate]) -> None:
        if self.spec is not None:
            self._speculative_decode(updates)
            return
        batch = self.running
        dev = self.model.device
        ids = torch.tensor([[r.last_token] for r in batch], dtype=torch.int64, device=dev)
        positions = torch.tensor([[r.num_computed] for r in batch], dtype=torch.int64, device=dev)
        step_kv = self.kv.begin_step([r.request_id for r in batch], 1)
        out = self.model.forward(ids, positions, step_kv)
        # One host read per decode step: the sampled tokens together with the KV step's report.
        tokens, report = self.kv.sync.read(self._sample_tensor(batch, out.logits[:, -1]), step_kv.report())
        self.kv.end_step({r.request_id: 1 for r in batch}, report=report)
        self.counters["decode_steps"] += 1
        self.counters["decode_batch_rows"] += len(batch)
        for req, token in zip(list(batch), tokens, strict=False):
            req.num_computed += 1
            self._append_tokens(req, [token], updates)

    def _speculative_decode(self, updates: list[RequestUpdate]) -> None:
        """Draft → one batched verification forward over ``1 + gamma`` positions → exact acceptance."""
        spec, batch, dev = self.spec, self.running, self.model.device
        assert spec is not None and self.staging is not None
        slots = torch.tensor([r.spec_state for r in batch], dtype=torch.int64, device=dev)
        last = torch.tensor([r.last_token for r in batch], dtype=torch.int64, device=dev)
        sampling = BatchSampling.of(batch, dev)
        draft, q_draft, lengths, confidence = spec.propose(slots, last, len(batch), sampling.temperature,
                                                           sampling.seeds, sampling.counters)
        # Every request verifies its own `lengths[b]`; the batch pads to the max (without a confidence head every
        # request verifies all gamma drafts, known without reading the device).
        q_len = spec.gamma + 1 if confidence is None else self.kv.sync.read(lengths.max())[0][0] + 1
        draft, q_draft = draft[:, : q_len - 1], q_draft[:, : q_len - 1]
        ids = torch.cat([last.unsqueeze(1), draft], dim=1)
        base = torch.tensor([r.num_computed for r in batch], dtype=torch.int64, device=dev)
        positions = base.unsqueeze(1) + torch.arange(q_len, device=dev)
        inner = self.kv.begin_step([r.request_id for r in batch], q_len)
        step_kv = self.staging.wrap(inner, self._staging_slot)
        out = self.model.forward(ids, positions, step_kv, all_logits=True, capture_hidden=spec.layers)
        any_sampled = any(r.params.temperature > 0 for r in batch)
        accepted, next_tokens = self._accept(sampling, out.logits, draft, q_draft, lengths, any_sampled)
        # One host read after verification: acceptance, next tokens, drafts and lengths with the KV step's report.
        acc_l, next_l, draft_flat, len_l, report = self.kv.sync.read(accepted, next_tokens, draft, lengths,
                                                                     inner.report())
        kept_l = [n + 1 for n in acc_l]  # the last accepted token's row and the accepted drafts' rows stay
        self.kv.end_step({r.request_id: k for r, k in zip(batch, kept_l, strict=True)}, report=report)
        spec.advance(slots, spec.features(out.hidden), accepted + 1)
        self.counters["verify_steps"] += 1
        self.counters["verify_rows"] += len(batch)
        self.counters["draft_tokens_proposed"] += sum(len_l)
        self.counters["draft_tokens_accepted"] += sum(acc_l)
        self.counters["draft_tokens_shortened"] += sum(spec.gamma - g for g in len_l)
        width = q_len - 1
        draft_l = [draft_flat[i * width:(i + 1) * width] for i in range(len(batch))]
        for req, n, k, nxt, row, g in zip(list(batch), acc_l, kept_l, next_l, draft_l, len_l, strict=True):
            req.num_computed += k
            req.counters["draft_tokens_proposed"] = req.counters.get("draft_tokens_proposed", 0.0) + g
            req.counters["draft_tokens_accepted"] = req.counters.get("draft_tokens_accepted", 0.0) + n
            req.counters["verify_steps"] = req.counters.get("verify_steps", 0.0) + 1
            self._append_tokens(req, row[:n] + [nxt], updates)

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

    def _sample(self, batch: list[Request], logits: torch.Tensor) -> list[int]:
        return self.kv.sync.read(self._sample_tensor(batch, logits))[0]

    @staticmethod
    def _sample_tensor(batch: list[Request], logits: torch.Tensor) -> torch.Tensor:
        greedy = all(r.params.temperature <= 0 for r in batch)
        return sample(logits, *BatchSampling.of(batch, logits.device), all_greedy=greedy)

    def _append_tokens(self, req: Request, tokens: list[int], updates: list[RequestUpdate]) -> None:
        """Append accepted tokens, stopping at a stop token or the length limit."""
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
        if reason is not None:
            self._finish(req, reason)
        updates.append(RequestUpdate(req.request_id, new, reason is not None, reason,
                                     self.request_stats(req) if reason is not None else {}))

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        req.counters.update(self.kv.request_stats(req.request_id) if req.status is Status.RUNNING else {})
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.kv.release(req.request_id)
            if self.spec is not None and req.spec_state is not None:
                self.spec.release(req.spec_state)
                req.spec_state = None
        req.status = Status.FINISHED
        self.counters["requests_finished"] += 1

    # ---------------------------------------------------------------------------------------------- stats
    def request_stats(self, req: Request) -> dict[str, float]:
        return {**req.timing(), **req.counters}

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counters.items()}
        out["requests_waiting"] = float(len(self.waiting))
        out["requests_running"] = float(len(self.running))
        out.update(self.kv.stats())
        out["workspace_bound_bytes"] = float(self.workspace.total_bytes)
        if self.spec is not None:
            out["spec_ring_bytes_per_request"] = float(self.spec.ring_bytes_per_request)
            out["spec_staging_bytes_per_request"] = float(self.staging.bytes_per_request())
            proposed = out.get("draft_tokens_proposed", 0.0)
            out["draft_acceptance_rate"] = out.get("draft_tokens_accepted", 0.0) / proposed if proposed else 0.0
            steps = out.get("verify_rows", 0.0)
            out["tokens_per_verify_step"] = (out.get("draft_tokens_accepted", 0.0) + steps) / steps if steps else 0.0
        return out

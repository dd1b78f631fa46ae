"""The executor: how a step runs (model forward, sampling, draft/verify), apart from who runs (``scheduler.py``).

Each method opens the KV store's step for its batch, runs the model over it, reads the device once (the sampled
tokens together with the KV step's report) and closes the step; it returns what each request got
(:class:`Sampled`) and leaves stopping rules and streaming to the engine. Faults propagate: the engine rolls the
step back (``KVStore.abort_step``) and ends the requests it touched.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dhisparse.engine.faults import FaultInjector, FaultyStepKV
from dhisparse.engine.request import Request
from dhisparse.host_values import to_device
from dhisparse.kv.store import KVStep, KVStore
from dhisparse.model.deepseek_v4.model import DeepseekV4Model
from dhisparse.model.model import DSAModel
from dhisparse.sampling import (
    LogitsProcessor,
    filtered_probs,
    sample,
    token_log_probs,
    uniform,
)
from dhisparse.spec.acceptance import greedy_accept, rejection_accept
from dhisparse.spec.speculator import Speculator

Model = DSAModel | DeepseekV4Model


class BatchSampling(NamedTuple):
    """The sampling parameters of a batch as tensors ``[B]``, built once per step."""

    temperature: torch.Tensor  # float64
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float64
    seeds: torch.Tensor  # int64 bit patterns of the requests' random streams
    counters: torch.Tensor  # int64, tokens generated so far (the stream position)
    processor: LogitsProcessor | None  # penalties / bias / bad words / min_tokens of the rows that ask for them
    rows: tuple[torch.Tensor, ...] = ()  # the caller's own int64 rows ``[B]``, shipped in the same copy

    @classmethod
    def of(cls, batch: list[Request], device: torch.device, eos_token_ids: tuple[int, ...] = (),
           vocab: int = 0, rows: Sequence[Sequence[int | None]] = ()) -> BatchSampling:
        """``rows``: further int64 vectors of the step ``[B]`` (token ids, positions) that travel with the
        parameters' int64 copy (returned in ``rows``)."""
        params = [r.params for r in batch]
        processor = LogitsProcessor.build(
            params, [(r.prompt_token_ids, r.output_token_ids) for r in batch], [r.token_counts for r in batch],
            eos_token_ids, vocab, device) if any(r.processes_logits for r in batch) else None
        # Two copies per step (one per dtype), each row a view.
        temperature, top_p = to_device([[p.temperature for p in params], [p.top_p for p in params]], torch.float64,
                                       device).unbind(0)
        top_k, seeds, counters, *extra = to_device([[p.top_k for p in params], [r.seed for r in batch],
                                                    [len(r.output_token_ids) for r in batch], *rows], torch.int64,
                                                   device).unbind(0)
        return cls(temperature, top_k, top_p, seeds, counters, processor, tuple(extra))

    def process(self, logits: torch.Tensor, draft: torch.Tensor | None = None) -> torch.Tensor:
        """``logits [B, Q, V]`` after each row's logit processing (unchanged rows are not copied when none)."""
        return logits if self.processor is None else self.processor.apply(logits, draft)

    def sample(self, logits: torch.Tensor, all_greedy: bool) -> torch.Tensor:
        """One token per row of processed ``logits [B, V]`` (``all_greedy``: known on the host, argmax only)."""
        return sample(logits, self.temperature, self.top_k, self.top_p, self.seeds, self.counters,
                      all_greedy=all_greedy)


@dataclass
class Sampled:
    """What one request got from a step: its new tokens (the first ``n`` to keep are the engine's to decide by its
    stopping rules), and what the request asked to receive with them."""

    tokens: list[int]
    log_probs: list[float] | None = None  # per token (params.logprobs)
    logits: torch.Tensor | None = None  # [len(tokens), V] processed logits (params.generation_logits)


class Executor:
    """Runs prefill, decode and verification steps of one model over one KV store."""

    def __init__(self, model: Model, kv: KVStore, spec: Speculator | None, faults: FaultInjector,
                 eos_token_ids: tuple[int, ...], prefill_chunk_tokens: int) -> None:
        self.model, self.kv, self.spec, self.faults = model, kv, spec, faults
        self.eos_token_ids = eos_token_ids
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.fault_layer = model.cfg.num_hidden_layers // 2
        self.vocab = model.cfg.vocab_size
        self.device = model.device
        self.query_len = 1 + (spec.gamma if spec is not None else 0)
        self.counters: collections.Counter[str] = collections.Counter()  # steps, rows, prefill and draft tokens

    def batch_sampling(self, batch: list[Request], rows: Sequence[Sequence[int | None]] = ()) -> BatchSampling:
        return BatchSampling.of(batch, self.device, self.eos_token_ids, self.vocab, rows)

    # -------------------------------------------------------------------------------------------- prefill
    def prefill(self, req: Request) -> Sampled:
        """Prefill the admitted request's prompt into the KV store (chunk by chunk) and sample its first token.
        With a prefix hit (``KVStore.cached_prefix_tokens``) only the positions after the cached prefix are computed;
        the drafter's window lies among them (the store leaves that many tokens uncached)."""
        cached = self.kv.cached_prefix_tokens(req.request_id)
        store = self.kv.prefill_kv(req.request_id, self.prefill_chunk_tokens)
        options: dict[str, object] = {"store": store} if store is not None else {}  # the DSA model streams into it
        if cached:
            options["start"] = cached
        out = self.model.prefill(req.prompt_token_ids, chunk_tokens=self.prefill_chunk_tokens,
                                 capture_hidden=self.spec.layers if self.spec else (),
                                 all_logits=req.params.context_logits, on_chunk=self._prefill_chunk_hook,
                                 **options)  # type: ignore[arg-type]
        if req.params.context_logits:
            req.context_logits = out.all_logits
        self.kv.import_prompt(req.request_id, out.rows, out.index_keys)  # keys written in place: the store knows
        if self.spec is not None:
            req.spec_state = self.spec.start(self.spec.features(out.hidden), req.prompt_len)  # the computed positions
        req.num_computed = req.prompt_len
        self.counters["prefill_tokens"] += req.prompt_len - cached  # computed
        self.counters["prefill_tokens_reused"] += cached
        req.counters["prefill_tokens_reused"] = float(cached)
        return self.sample_one([req], out.logits.unsqueeze(0))[0]

    def _prefill_chunk_hook(self, start: int) -> None:
        if self.faults.enabled:
            self.faults.hit("prefill_chunk")

    def sample_one(self, batch: list[Request], logits: torch.Tensor) -> list[Sampled]:
        """One token per request from ``logits [B, V]`` (after its logit processing), read on the host."""
        sampling = self.batch_sampling(batch)
        processed = sampling.process(logits.unsqueeze(1))[:, 0]
        tokens_t = sampling.sample(processed, all(r.params.temperature <= 0 for r in batch))
        return self._sampled(batch, sampling, processed, tokens_t, self.kv.read(tokens_t)[0])

    # --------------------------------------------------------------------------------------------- decode
    def decode(self, batch: list[Request]) -> list[Sampled]:
        """One batched decode step: one new token per request."""
        if self.faults.enabled and self.faults.fires("break_invariants"):
            self.kv.corrupt_accounting()
            raise RuntimeError("injected fault at break_invariants (pool accounting corrupted)")
        # The token ids and positions travel with the sampling parameters' int64 copy.
        sampling = self.batch_sampling(batch, ([r.output_token_ids[-1] for r in batch],
                                               [r.num_computed for r in batch]))
        ids, positions = sampling.rows[0].unsqueeze(1), sampling.rows[1].unsqueeze(1)
        step = self._faulty(self.kv.begin_step([r.request_id for r in batch], 1), "decode_forward")
        out = self.model.forward(ids, positions, step)  # type: ignore[arg-type]
        processed = sampling.process(out.logits[:, -1].unsqueeze(1))[:, 0]
        tokens_t = sampling.sample(processed, all(r.params.temperature <= 0 for r in batch))
        # One host read per decode step: the sampled tokens together with the KV step's report.
        tokens, report = self.kv.read(tokens_t, step.report())
        self.kv.end_step(dict.fromkeys([r.request_id for r in batch], 1), report)
        for req in batch:
            req.num_computed += 1
        self.counters["decode_steps"] += 1
        self.counters["decode_batch_rows"] += len(batch)
        return self._sampled(batch, sampling, processed, tokens_t, tokens)

    def _sampled(self, batch: list[Request], sampling: BatchSampling, processed: torch.Tensor,
                 tokens_t: torch.Tensor, tokens: list[int]) -> list[Sampled]:
        log_probs, logits = self._extras(batch, sampling, processed.unsqueeze(1), tokens_t.unsqueeze(1))
        return [Sampled([token], log_probs[b] if log_probs is not None else None,
                        logits[b] if logits is not None else None) for b, token in enumerate(tokens)]

    # ------------------------------------------------------------------------------------------- speculate
    def verify(self, batch: list[Request], threshold: float) -> list[Sampled]:
        """Draft → one batched verification forward over ``1 + gamma`` positions → exact acceptance. ``threshold``:
        the confidence a DSpark draft prefix needs (the scheduler's load-aware choice). Each request gets its
        accepted drafts and the next token; its draft counters are updated."""
        spec, dev = self.spec, self.device
        assert spec is not None
        if self.faults.enabled and self.faults.fires("break_invariants"):
            self.kv.corrupt_accounting()
            raise RuntimeError("injected fault at break_invariants (pool accounting corrupted)")
        # The drafter's slots, the last tokens and the positions travel with the sampling parameters' int64 copy.
        sampling = self.batch_sampling(batch, ([r.spec_state for r in batch], [r.output_token_ids[-1] for r in batch],
                                               [r.num_computed for r in batch]))
        slots, last, base = sampling.rows
        if self.faults.enabled:
            self.faults.hit("draft_propose")
        draft, q_draft, lengths, confidence = spec.propose(slots, last, threshold, sampling.temperature,
                                                           sampling.seeds, sampling.counters)
        # Every request verifies its own `lengths[b]`; the batch pads to the max (without a confidence head every
        # request verifies all gamma drafts, known without reading the device).
        q_len = spec.gamma + 1 if confidence is None else self.kv.read(lengths.max())[0][0] + 1
        draft, q_draft = draft[:, : q_len - 1], q_draft[:, : q_len - 1]
        ids = torch.cat([last.unsqueeze(1), draft], dim=1)
        positions = base.unsqueeze(1) + torch.arange(q_len, device=dev)
        step = self._faulty(self.kv.begin_step([r.request_id for r in batch], q_len), "verify_forward")
        out = self.model.forward(ids, positions, step, all_logits=True,  # type: ignore[arg-type]
                                 capture_hidden=spec.layers)
        logits = sampling.process(out.logits, draft)  # the same processing as the plain path, per position
        any_sampled = any(r.params.temperature > 0 for r in batch)
        accepted, next_tokens = accept(sampling, logits, draft, q_draft, lengths, any_sampled)
        emitted = torch.cat([draft, next_tokens.unsqueeze(1)], dim=1).scatter(  # [B, Q]: d_1 … d_n, next
            1, accepted.unsqueeze(1), next_tokens.unsqueeze(1))
        log_probs, gen_logits = self._extras(batch, sampling, logits, emitted)
        # One host read after verification: acceptance, next tokens, drafts and lengths with the KV step's report.
        acc_l, next_l, draft_flat, len_l, report = self.kv.read(accepted, next_tokens, draft, lengths, step.report())
        kept_l = [n + 1 for n in acc_l]  # the last accepted token's row and the accepted drafts' rows stay
        self.kv.end_step({r.request_id: k for r, k in zip(batch, kept_l, strict=True)}, report)
        spec.advance(slots, spec.features(out.hidden), accepted + 1)
        width = draft.shape[1]
        counters = self.counters
        counters["verify_steps"] += 1
        counters["verify_rows"] += len(batch)
        counters["draft_tokens_proposed"] += sum(len_l)
        counters["draft_tokens_accepted"] += sum(acc_l)
        counters["draft_tokens_shortened"] += sum(spec.gamma - g for g in len_l)
        results = []
        for b, (req, n, k, nxt, g) in enumerate(zip(batch, acc_l, kept_l, next_l, len_l, strict=True)):
            req.num_computed += k
            for name, value in (("draft_tokens_proposed", g), ("draft_tokens_accepted", n), ("verify_steps", 1)):
                req.counters[name] = req.counters.get(name, 0.0) + value
            results.append(Sampled([*draft_flat[b * width:b * width + n], nxt],
                                   log_probs[b][: n + 1] if log_probs is not None else None,
                                   gen_logits[b][: n + 1] if gen_logits is not None else None))
        return results

    def stats(self) -> dict[str, float]:
        """Step, row and token counters; with a drafter its acceptance and its per-request memory (ring and
        verification staging, as each request is charged)."""
        out = {k: float(v) for k, v in self.counters.items()}
        if self.spec is not None:
            out["spec_ring_bytes_per_request"] = float(self.spec.ring_bytes_per_request)
            out["spec_staging_bytes_per_request"] = float(self.kv.memory().staging_bytes_per_request)
            proposed, accepted = out.get("draft_tokens_proposed", 0.0), out.get("draft_tokens_accepted", 0.0)
            out["draft_acceptance_rate"] = accepted / proposed if proposed else 0.0
            steps = out.get("verify_rows", 0.0)
            out["tokens_per_verify_step"] = (accepted + steps) / steps if steps else 0.0
        return out

    def _faulty(self, step: KVStep, site: str) -> KVStep:
        return FaultyStepKV(step, self.faults, site, self.fault_layer) if self.faults.enabled else step

    @staticmethod
    def _extras(batch: list[Request], sampling: BatchSampling, logits: torch.Tensor, tokens: torch.Tensor
                ) -> tuple[list[list[float]] | None, torch.Tensor | None]:
        """What requests asked to get with their tokens, for ``tokens [B, Q]`` chosen at ``logits [B, Q, V]``:
        log-probabilities (per request a list over Q; None when nobody asked) and the processed logits."""
        log_probs = None
        if any(r.params.logprobs for r in batch):
            q = tokens.shape[1]
            log_probs = token_log_probs(logits, sampling.temperature.unsqueeze(1).expand(-1, q), tokens).tolist()
        gen_logits = logits if any(r.params.generation_logits for r in batch) else None
        return log_probs, gen_logits


def accept(sampling: BatchSampling, logits: torch.Tensor, draft: torch.Tensor, q_draft: torch.Tensor,
           lengths: torch.Tensor, any_sampled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows: prefix match. Sampled rows: rejection sampling against the drafts' proposal law ``q``.
    ``any_sampled``: whether a row has a temperature above 0 (known on the host)."""
    accepted, next_tokens = greedy_accept(logits, draft, lengths)
    if not any_sampled:
        return accepted, next_tokens
    sampled = sampling.temperature > 0
    b, q, v = logits.shape
    p = filtered_probs(logits.reshape(b * q, v), sampling.temperature.repeat_interleave(q),
                       sampling.top_k.repeat_interleave(q), sampling.top_p.repeat_interleave(q)).view(b, q, v)
    steps = sampling.counters.unsqueeze(1) + torch.arange(q - 1, device=logits.device)
    u_accept = uniform(sampling.seeds.unsqueeze(1).expand_as(steps), steps, stream=1)
    u_next = uniform(sampling.seeds, sampling.counters, stream=2)
    s_acc, s_next = rejection_accept(p, draft, q_draft, lengths, u_accept, u_next)
    return torch.where(sampled, s_acc, accepted), torch.where(sampled, s_next, next_tokens)

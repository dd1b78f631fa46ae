"""Logit processing before sampling: embedding bias, repetition / presence / frequency penalties, bad words, and
min_tokens — batched over the requests that ask for any of them, and over every position of a speculative
verification window.

Speculation stays exact because the verifier processes position ``i`` of the window (the token after the last
accepted token and the drafts ``d_1 … d_i``) with exactly the history the plain path would have if those drafts
are accepted: the token counts include ``d_1 … d_i``, the bad-word context ends with them, and ``i`` more tokens
count as generated for min_tokens. Acceptance is a prefix rule, so every position whose output is kept saw its
true history; positions after the first rejection are discarded.

Order (TensorRT-LLM's): bias, repetition penalty, presence and frequency penalties, then the bans (bad words,
min_tokens) set logits to ``-inf``. Temperature, top-k and top-p come after (``sampler.filtered_probs``).
Arithmetic stays in the logits' dtype, element by element as transformers' logits processors do it.

A request's bad-word table, stop set and bias are built once (``request_tables.py``); a step only stacks them (a
device-side pad when rows differ in size) and gathers each row's last W tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dhisparse.host_values import to_device
from dhisparse.sampling.params import SamplingParams
from dhisparse.sampling.request_tables import tables_of


def _stack_padded(tables: list[torch.Tensor], value: int) -> torch.Tensor:
    """``[b, max n, max w]`` from ``[n_i, w_i]`` tensors: padded with ``value`` on the left of dim 1 (so prefixes stay
    right-aligned) and at the end of dim 0 (one device pad per row that differs; none when all agree)."""
    rows = max(t.shape[0] for t in tables)
    width = max(t.shape[1] for t in tables)
    return torch.stack([t if t.shape == (rows, width) else F.pad(t, (width - t.shape[1], 0, 0, rows - t.shape[0]),
                                                                   value=value) for t in tables])


def initial_counts(prompt: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Token counts ``[V]`` (float32) of a prompt, to which generated tokens are added (``add_counts``)."""
    ids = to_device(list(prompt), torch.int64, device)
    return torch.bincount(ids, minlength=vocab).to(torch.float32)


def add_counts(counts: torch.Tensor, tokens: Sequence[int]) -> None:
    """Count ``tokens`` into ``counts [V]`` in place."""
    if tokens:
        ids = to_device(list(tokens), torch.int64, counts.device)
        counts.index_add_(0, ids, torch.ones(len(tokens), dtype=counts.dtype, device=counts.device))


@dataclass
class LogitsProcessor:
    """The processing of the rows of one batch that ask for it (``rows``; others pass through untouched).

    Shapes (``b`` = processed rows, ``V`` vocabulary, ``K`` bad words, ``W`` longest bad-word prefix,
    ``S`` stop tokens): ``counts [b, V]`` or None, ``bias [b, V]`` or None, ``bad_prefix [b, K, W]`` (right
    aligned, -1 = any token), ``bad_last [b, K]`` (-1 = no word), ``tail [b, W]`` (the last W tokens of
    prompt + output, -1 padded on the left), ``stop_ids [b, S]`` (V = padding), per-row scalars ``[b]``.
    """

    rows: torch.Tensor
    vocab: int
    counts: torch.Tensor | None
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    bias: torch.Tensor | None
    bad_prefix: torch.Tensor | None
    bad_last: torch.Tensor | None
    tail: torch.Tensor | None
    stop_ids: torch.Tensor | None
    min_tokens: torch.Tensor
    generated: torch.Tensor

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
        counts: Sequence[torch.Tensor | None],
        eos_token_ids: Sequence[int],
        vocab: int,
        device: torch.device,
    ) -> LogitsProcessor | None:
        """For a batch: each row's ``params``, ``(prompt, output)`` token ids and token counts (None unless
        ``params.counts_tokens``). Returns None when no row processes logits (the common case costs nothing)."""
        rows = [i for i, p in enumerate(params) if p.processes_logits]
        if not rows:
            return None
        chosen = [params[i] for i in rows]
        row_counts = None
        if any(p.counts_tokens for p in chosen):
            zeros = torch.zeros(vocab, dtype=torch.float32, device=device)
            row_counts = torch.stack([counts[i] if counts[i] is not None else zeros for i in rows])
        tables = [tables_of(p) for p in chosen]
        bias = None
        if any(p.logit_bias for p in chosen):
            bias = torch.stack([t.bias(vocab, device) for t in tables])
        bad_prefix = bad_last = tail = None
        if any(p.bad_words for p in chosen):
            w = max(t.bad_width for t in tables)
            empty = (torch.full((0, 0), -1, dtype=torch.int64, device=device),
                     torch.full((0,), -1, dtype=torch.int64, device=device))
            words = [t.bad_word_tensors(device) if p.bad_words else empty for t, p in zip(tables, chosen, strict=True)]
            bad_prefix = _stack_padded([prefix for prefix, _ in words], -1)
            bad_last = _stack_padded([last.unsqueeze(1) for _, last in words], -1).squeeze(2)
            tails = []
            for i in rows:
                prompt, output = sequences[i]
                recent = list(output[-w:]) if w else []
                need = w - len(recent)
                if need > 0:
                    recent = list(prompt[max(0, len(prompt) - need):]) + recent
                tails.append([-1] * (w - len(recent)) + recent)
            tail = to_device(tails, torch.int64, device).view(len(rows), w)
        stop_ids = None
        if any(p.min_tokens > 0 for p in chosen):
            stops = [t.stop_ids(eos_token_ids, device) for t in tables]
            stop_ids = _stack_padded([s.unsqueeze(0) for s in stops], vocab).squeeze(1)
        return cls(
            rows=to_device(rows, torch.int64, device), vocab=vocab, counts=row_counts,
            repetition=to_device([p.repetition_penalty for p in chosen], torch.float64, device),
            presence=to_device([p.presence_penalty for p in chosen], torch.float64, device),
            frequency=to_device([p.frequency_penalty for p in chosen], torch.float64, device),
            bias=bias, bad_prefix=bad_prefix, bad_last=bad_last, tail=tail, stop_ids=stop_ids,
            min_tokens=to_device([p.min_tokens for p in chosen], torch.int64, device),
            generated=to_device([len(sequences[i][1]) for i in rows], torch.int64, device),
        )

    def apply(self, logits: torch.Tensor, draft: torch.Tensor | None = None) -> torch.Tensor:
        """Processed copy of ``logits [B, Q, V]``. Position ``q`` follows ``draft[:, :q]`` (``draft [B, Q-1]``,
        None when ``Q == 1``)."""
        b, q, v = len(self.rows), logits.shape[1], logits.shape[2]
        x = logits.index_select(0, self.rows)
        drafts = draft.index_select(0, self.rows)[:, : q - 1] if draft is not None and q > 1 else None
        dtype = x.dtype
        if self.bias is not None:
            x = x + self.bias.to(dtype).unsqueeze(1)
        if self.counts is not None:
            counts = self.counts.unsqueeze(1).expand(b, q, v)
            if drafts is not None:
                seen = torch.zeros(b, q, v, dtype=counts.dtype, device=x.device)
                seen[:, 1:].scatter_(2, drafts.unsqueeze(-1), 1.0)
                counts = counts + seen.cumsum(dim=1)
            present = counts > 0
            rep = self.repetition.to(dtype).view(b, 1, 1)
            x = torch.where(present, torch.where(x < 0, x * rep, x / rep), x)
            x = x - self.frequency.to(dtype).view(b, 1, 1) * counts.to(dtype)
            x = x - self.presence.to(dtype).view(b, 1, 1) * present.to(dtype)
        ban = torch.zeros(b, q, v + 1, dtype=torch.bool, device=x.device)
        if self.bad_last is not None and self.bad_prefix is not None and self.tail is not None:
            w = self.bad_prefix.shape[2]
            context = self.tail if drafts is None else torch.cat([self.tail, drafts], dim=1)  # [b, W + Q - 1]
            if w:
                windows = context.unfold(1, w, 1)  # [b, Q, W]: the W tokens before each position
                match = ((self.bad_prefix.unsqueeze(1) < 0)
                         | (windows.unsqueeze(2) == self.bad_prefix.unsqueeze(1))).all(dim=-1)  # [b, Q, K]
            else:
                match = torch.ones(b, q, self.bad_last.shape[1], dtype=torch.bool, device=x.device)
            last = self.bad_last.unsqueeze(1).expand_as(match)
            ban.scatter_(2, torch.where(match & (last >= 0), last, v), True)
        if self.stop_ids is not None:
            generated = self.generated.unsqueeze(1) + torch.arange(q, device=x.device)  # [b, Q]
            early = (generated < self.min_tokens.unsqueeze(1)).unsqueeze(-1)
            stops = self.stop_ids.unsqueeze(1).expand(b, q, self.stop_ids.shape[1])
            ban.scatter_(2, torch.where(early, stops, v), True)
        x = x.masked_fill(ban[..., :v], float("-inf"))
        out = logits.clone()
        out.index_copy_(0, self.rows, x)
        return out

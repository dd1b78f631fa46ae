"""The batched sampler (greedy, temperature, top-k, top-p) and the log-probabilities of chosen tokens.

Random draws come from a counter-based generator keyed by ``(seed, token index, stream)``, so a request's sampled
tokens do not depend on which other requests share its batch, and no per-request generator loop is needed.
"""

from __future__ import annotations

import torch


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 tensors (wrapping arithmetic; logical shifts emulated with masks)."""
    def shr(v: torch.Tensor, k: int) -> torch.Tensor:
        return (v >> k) & ((1 << (64 - k)) - 1)

    x = x + (0x9E3779B97F4A7C15 - (1 << 64))
    x = (x ^ shr(x, 30)) * (0xBF58476D1CE4E5B9 - (1 << 64))
    x = (x ^ shr(x, 27)) * (0x94D049BB133111EB - (1 << 64))
    return x ^ shr(x, 31)


def uniform(seeds: torch.Tensor, counters: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """Deterministic uniforms in [0, 1) (float64), one per element of ``seeds``/``counters`` (int64, same shape)."""
    x = _splitmix64(seeds ^ _splitmix64(counters * 4 + stream))
    return ((x >> 11) & ((1 << 53) - 1)).to(torch.float64) / float(1 << 53)


def seed_to_int64(seed: int) -> int:
    """Map a seed in [0, 2**64) to a signed int64 with the same bits."""
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Sampling distribution ``[B, V]`` (float64) after temperature, top-k and top-p; rows with temperature 0 get
    a one-hot at the argmax. ``temperature/top_p [B]`` float, ``top_k [B]`` int64 (0 = off)."""
    logits = logits.to(torch.float64)
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs_sorted = torch.softmax(sorted_logits, dim=-1)
    before = probs_sorted.cumsum(dim=-1) - probs_sorted
    probs_sorted = probs_sorted.masked_fill((before >= top_p.unsqueeze(-1)) & (rank > 0), 0.0)
    probs_sorted = probs_sorted / probs_sorted.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(probs_sorted).scatter_(-1, order, probs_sorted)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(-1), one_hot, probs)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: ``probs [B, V]``, ``u [B]`` in [0, 1) → token ids ``[B]``."""
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1).to(cdf.dtype), right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    seeds: torch.Tensor, counters: torch.Tensor, all_greedy: bool | None = None,
) -> torch.Tensor:
    """Next tokens ``[B]`` for ``logits [B, V]``; greedy rows take the argmax exactly. ``all_greedy``: whether
    every temperature is 0, if the caller knows it on the host (saves a device read)."""
    greedy_tokens = logits.argmax(dim=-1)
    if all_greedy if all_greedy is not None else bool((temperature <= 0).all()):
        return greedy_tokens
    probs = filtered_probs(logits, temperature, top_k, top_p)
    drawn = sample_from(probs, uniform(seeds, counters))
    return torch.where(temperature <= 0, greedy_tokens, drawn)


def token_log_probs(logits: torch.Tensor, temperature: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probabilities ``[...]`` (float64) of ``tokens [...]`` under ``log_softmax(logits / T)``, with ``T = 1``
    for greedy rows: ``logits [..., V]`` (already processed), ``temperature [...]``. This is the distribution
    before top-k / top-p truncation (TensorRT-LLM's unnormalised ``output_log_probs`` convention for sampling
    is the same logits scaled by temperature)."""
    safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(torch.float64)
    log_p = torch.log_softmax(logits.to(torch.float64) / safe_t.unsqueeze(-1), dim=-1)
    return log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def top_token_log_probs(logits: torch.Tensor, temperature: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each position and their log-probabilities, under the distribution
    ``token_log_probs`` uses (``log_softmax(logits / T)``, ``T = 1`` when greedy): ``logits [..., V]`` (processed)
    -> ``(ids [..., k] int64, log_probs [..., k] float64)``, most likely first (ties: lower id first).
    ``k`` is clamped to ``V``."""
    safe_t = temperature if temperature > 0 else 1.0
    log_p = torch.log_softmax(logits.to(torch.float64) / safe_t, dim=-1)
    k = min(k, log_p.shape[-1])
    # A stable descending sort orders ties by token id (torch.topk's tie order is unspecified).
    values, ids = torch.sort(log_p, dim=-1, descending=True, stable=True)
    return ids[..., :k], values[..., :k]

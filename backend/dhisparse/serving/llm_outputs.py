"""The `dhisparse` model's output tensors (tensorrtllm_backend's `tensorrt_llm` names), built per response.

One `ResponseBuilder` per generated sequence collects what the engine's updates carry. Shapes include Triton's
batch dimension (1: each response belongs to one prompt, named by `batch_index`, and one sequence of it,
`sequence_index`):

- output_ids [1, 1, T] int32, sequence_length [1, 1] int32: the new tokens (streaming), or every token, prompt
  first unless exclude_input_in_output (otherwise).
- cum_log_probs [1, 1] fp32 (sum so far), output_log_probs [1, 1, T] fp32 (this response's tokens): return_log_probs.
- context_logits [1, L, V] fp32: the prompt positions' logits, in the first response (return_context_logits).
- generation_logits [1, 1, T, V] fp32: processed logits of this response's tokens (return_generation_logits).
- batch_index, sequence_index [1, 1] int32: prompt row in the request, sample number (always).
- return_perf_metrics: kv_cache_alloc_total_blocks [1, 1] int32 = the KV pages (`page_rows` rows of every KV
  source) the request's stored tokens span; kv_cache_reused_blocks = of those, the pages its admission found in the
  prefix cache (docs/prefix_reuse.md); kv_cache_alloc_new_blocks = the others; arrival_time_ns, first_scheduled_time_ns,
  first_token_time_ns, last_token_time_ns [1, 1] int64 = wall clock, ns since the epoch (0 = not yet);
  acceptance_rate [1, 1] fp32, total_accepted_draft_tokens, total_draft_tokens [1, 1] int32 = speculation's
  accepted / proposed draft tokens so far (0 without a drafter).
- num_input_tokens / num_output_tokens [1, 1] int32: prompt length / tokens generated so far.
"""

from __future__ import annotations

import numpy as np

from dhisparse.engine.request import RequestUpdate
from dhisparse.serving.llm_request import LLMRequest

PERF_METRIC_OUTPUTS = (
    "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns",
    "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns", "acceptance_rate",
    "total_accepted_draft_tokens", "total_draft_tokens",
)


def _one(value: float | int, dtype: type) -> np.ndarray:
    return np.asarray([[value]], dtype=dtype)


def perf_metrics(stats: dict[str, float]) -> dict[str, np.ndarray]:
    """The perf-metrics outputs from a request's statistics (`LLMEngine.request_stats`)."""
    pages = int(stats.get("kv_pages", 0))
    reused = int(stats.get("kv_prefix_reused_pages", 0))  # prefix reuse: pages found cached at admission
    proposed, accepted = stats.get("draft_tokens_proposed", 0.0), stats.get("draft_tokens_accepted", 0.0)
    out = {
        "kv_cache_alloc_new_blocks": _one(pages - reused, np.int32),
        "kv_cache_reused_blocks": _one(reused, np.int32),
        "kv_cache_alloc_total_blocks": _one(pages, np.int32),
        "acceptance_rate": _one(accepted / proposed if proposed else 0.0, np.float32),
        "total_accepted_draft_tokens": _one(int(accepted), np.int32),
        "total_draft_tokens": _one(int(proposed), np.int32),
    }
    for name in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns"):
        out[name] = _one(int(stats.get(name, 0)), np.int64)
    return out


class ResponseBuilder:
    """Collects one sequence's updates and builds its responses (streamed chunks or the whole sequence)."""

    def __init__(self, request: LLMRequest, sequence_index: int = 0) -> None:
        self.request, self.sequence_index = request, sequence_index
        self.tokens: list[int] = []
        self.log_probs: list[float] = []
        self.logits: list[np.ndarray] = []
        self.context_logits: np.ndarray | None = None
        self.stats: dict[str, float] = {}
        self._chunk: tuple[list[int], list[float], np.ndarray | None] = ([], [], None)
        self._context_sent = False

    def add(self, update: RequestUpdate, keep: int | None = None) -> list[int]:
        """Take one engine update, keeping only its first `keep` tokens (a stop sequence ended); returns them."""
        tokens = list(update.new_token_ids if keep is None else update.new_token_ids[:keep])
        log_probs = list(update.new_log_probs or [])[: len(tokens)]
        logits = update.new_logits[: len(tokens)].numpy() if update.new_logits is not None else None
        self.tokens.extend(tokens)
        self.log_probs.extend(log_probs)
        if logits is not None:
            self.logits.append(logits)
        if update.context_logits is not None:
            self.context_logits = update.context_logits.numpy()
        if update.stats:
            self.stats = update.stats
        self._chunk = (tokens, log_probs, logits)
        return tokens

    def chunk(self) -> dict[str, np.ndarray]:
        """The streamed response for the tokens of the last `add` (only new tokens; never the prompt)."""
        tokens, log_probs, logits = self._chunk
        return self._arrays(tokens, log_probs, logits)

    def whole(self) -> dict[str, np.ndarray]:
        """The single response of a non-streaming request: every token (prompt first unless excluded)."""
        prefix = [] if self.request.exclude_input_in_output else list(self.request.prompt_token_ids)
        logits = np.concatenate(self.logits) if self.logits else None
        return self._arrays(prefix + self.tokens, self.log_probs, logits)

    def _arrays(self, ids: list[int], log_probs: list[float], logits: np.ndarray | None) -> dict[str, np.ndarray]:
        out = {
            "output_ids": np.asarray(ids, dtype=np.int32).reshape(1, 1, -1),
            "sequence_length": np.asarray([[len(ids)]], dtype=np.int32),
            "batch_index": _one(self.request.batch_index, np.int32),
            "sequence_index": _one(self.sequence_index, np.int32),
        }
        wanted = self.request.outputs
        if wanted.log_probs:
            out["cum_log_probs"] = _one(sum(self.log_probs), np.float32)
            out["output_log_probs"] = np.asarray(log_probs, dtype=np.float32).reshape(1, 1, -1)
        if wanted.context_logits and self.context_logits is not None and not self._context_sent:
            out["context_logits"] = self.context_logits.astype(np.float32)[np.newaxis]
            self._context_sent = True
        if wanted.generation_logits and logits is not None:
            out["generation_logits"] = logits.astype(np.float32)[np.newaxis, np.newaxis]
        if wanted.perf_metrics:
            out.update(perf_metrics(self.stats))
        if wanted.num_input_tokens:
            out["num_input_tokens"] = _one(len(self.request.prompt_token_ids), np.int32)
        if wanted.num_output_tokens:
            out["num_output_tokens"] = _one(len(self.tokens), np.int32)
        return out

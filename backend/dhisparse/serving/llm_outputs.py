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
  source) the request's stored tokens span; kv_cache_alloc_new_blocks = the same (every page is new: no prefix
  reuse across requests); kv_cache_reused_blocks = 0; arrival_time_ns, first_scheduled_time_ns,
  first_token_time_ns, last_token_time_ns [1, 1] int64 = wall clock, ns since the epoch (0 = not yet);
  acceptance_rate [1, 1] fp32, total_accepted_draft_tokens, total_draft_tokens [1, 1] int32 = speculation's
  accepted / proposed draft tokens so far (0 without a drafter).
  Also tensorrtllm_backend's `llmapi` model's KV-cache statistics: kv_cache_reused_block / kv_cache_missed_block
  [1, 1] int32 = the prompt's pages found in / missing from the prefix cache (a prompt of P tokens spans
  ceil(P / page_rows) pages; reused = `kv_prefix_reused_tokens` // page_rows, 0 while the engine has no prefix
  reuse), kv_cache_hit_rate [1, 1] fp32 = reused / (reused + missed); kv_cache_reused_blocks carries the same
  reused count.
  With return_final_perf_metrics instead, they ride on the sequence's last response only.
- num_input_tokens / num_output_tokens [1, 1] int32: prompt length / tokens generated so far.
- finish_reason [1, 1] bytes (return_finish_reason, the `llmapi` model's output): why the sequence ended, on its
  last response ("stop": EOS, an end id or a stop word; "length": max_tokens or the engine's limit; "abort"),
  empty before.
- top_token_ids [1, 1, T, K] int32 / top_log_probs [1, 1, T, K] fp32 (num_top_log_probs = K > 0): at each of this
  response's tokens, the K most likely tokens and their log-probabilities under the distribution of
  output_log_probs (`sampler.top_token_log_probs`), most likely first. Computed here from the processed logits,
  so only K values per token leave the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from dhisparse.engine.request import RequestUpdate
from dhisparse.sampling.sampler import top_token_log_probs
from dhisparse.serving.llm_request import LLMRequest

PERF_METRIC_OUTPUTS = (
    "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns",
    "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns", "acceptance_rate",
    "total_accepted_draft_tokens", "total_draft_tokens", "kv_cache_reused_block", "kv_cache_missed_block",
    "kv_cache_hit_rate",
)


def _one(value: float | int, dtype: type) -> np.ndarray:
    return np.asarray([[value]], dtype=dtype)


def prompt_page_counts(stats: dict[str, float], prompt_tokens: int, page_rows: int) -> tuple[int, int]:
    """``(reused, missed)`` pages of a prompt of ``prompt_tokens`` tokens: reused = full pages its prefix-cache hit
    covered (`kv_prefix_reused_tokens`, absent = 0), missed = the rest of the pages it spans."""
    reused = int(stats.get("kv_prefix_reused_tokens", 0)) // page_rows
    return reused, max(math.ceil(prompt_tokens / page_rows) - reused, 0)


def perf_metrics(stats: dict[str, float], prompt_tokens: int = 0, page_rows: int = 1) -> dict[str, np.ndarray]:
    """The perf-metrics outputs from a request's statistics (`LLMEngine.request_stats`)."""
    pages = int(stats.get("kv_pages", 0))
    proposed, accepted = stats.get("draft_tokens_proposed", 0.0), stats.get("draft_tokens_accepted", 0.0)
    reused, missed = prompt_page_counts(stats, prompt_tokens, page_rows)
    out = {
        "kv_cache_alloc_new_blocks": _one(pages - reused, np.int32),
        "kv_cache_reused_blocks": _one(reused, np.int32),
        "kv_cache_alloc_total_blocks": _one(pages, np.int32),
        "kv_cache_reused_block": _one(reused, np.int32),
        "kv_cache_missed_block": _one(missed, np.int32),
        "kv_cache_hit_rate": _one(reused / (reused + missed) if reused + missed else 0.0, np.float32),
        "acceptance_rate": _one(accepted / proposed if proposed else 0.0, np.float32),
        "total_accepted_draft_tokens": _one(int(accepted), np.int32),
        "total_draft_tokens": _one(int(proposed), np.int32),
    }
    for name in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns"):
        out[name] = _one(int(stats.get(name, 0)), np.int64)
    return out


class _Chunk:
    """Tokens with what came with them: log-probs, processed logits [T, V], top-K ids / log-probs [T, K]."""

    def __init__(self, tokens: list[int], log_probs: list[float], logits: np.ndarray | None,
                 top: tuple[np.ndarray, np.ndarray] | None) -> None:
        self.tokens, self.log_probs, self.logits, self.top = tokens, log_probs, logits, top

    def __add__(self, other: _Chunk) -> _Chunk:
        def cat(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
            return b if a is None else a if b is None else np.concatenate([a, b])

        top = other.top if self.top is None else self.top if other.top is None else (
            np.concatenate([self.top[0], other.top[0]]), np.concatenate([self.top[1], other.top[1]]))
        return _Chunk(self.tokens + other.tokens, self.log_probs + other.log_probs, cat(self.logits, other.logits), top)

    def split(self, n: int) -> tuple[_Chunk, _Chunk]:
        """The first `n` tokens (with their values) and the rest."""
        def part(sl: slice) -> _Chunk:
            top = None if self.top is None else (self.top[0][sl], self.top[1][sl])
            return _Chunk(self.tokens[sl], self.log_probs[sl], None if self.logits is None else self.logits[sl], top)

        return part(slice(None, n)), part(slice(n, None))


EMPTY = _Chunk([], [], None, None)


class ResponseBuilder:
    """Collects one sequence's updates and builds its responses (streamed chunks or the whole sequence).

    ``page_rows``: the engine's rows per KV page (the unit of the kv_cache_* block counts). ``whole_characters``:
    how many leading tokens of a list end at a UTF-8 character boundary (`TokenBytes.whole_character_prefix`); used
    when the request asks for `stream_whole_characters`."""

    def __init__(self, request: LLMRequest, sequence_index: int = 0, page_rows: int = 1,
                 whole_characters: Callable[[list[int]], int] | None = None) -> None:
        self.request, self.sequence_index, self.page_rows = request, sequence_index, page_rows
        self._whole = whole_characters if request.whole_characters else None
        self._pending = EMPTY  # added but not yet released (streaming: waits for its character to complete)
        self.tokens: list[int] = []
        self.log_probs: list[float] = []
        self.logits: list[np.ndarray] = []  # kept only when generation_logits are asked for
        self.top: list[tuple[np.ndarray, np.ndarray]] = []
        self.context_logits: np.ndarray | None = None
        self.stats: dict[str, float] = {}
        self.finish_reason = ""
        self.finished = False  # the sequence's last update has been added
        self._chunk = EMPTY
        self._context_sent = False

    def add(self, update: RequestUpdate, keep: int | None = None) -> list[int]:
        """Take one engine update, keeping only its first `keep` tokens (a stop sequence ended: the sequence
        finished with reason "stop"); returns them."""
        tokens = list(update.new_token_ids if keep is None else update.new_token_ids[:keep])
        log_probs = list(update.new_log_probs or [])[: len(tokens)]
        logits = update.new_logits[: len(tokens)] if update.new_logits is not None else None
        top = None
        if logits is not None and self.request.outputs.top_log_probs:
            ids, values = top_token_log_probs(logits, self.request.params.temperature,
                                              self.request.outputs.top_log_probs)
            top = (ids.numpy().astype(np.int32), values.numpy().astype(np.float32))
            self.top.append(top)
        logits = logits.numpy() if logits is not None and self.request.outputs.generation_logits else None
        self.tokens.extend(tokens)
        self.log_probs.extend(log_probs)
        if logits is not None:
            self.logits.append(logits)
        if update.context_logits is not None:
            self.context_logits = update.context_logits.numpy()
        if update.stats:
            self.stats = update.stats
        if keep is not None:
            self.finish_reason, self.finished = "stop", True
        elif update.finished:
            self.finish_reason, self.finished = update.finish_reason or "", True
        if self.request.streaming:
            self._pending = self._pending + _Chunk(tokens, log_probs, logits, top)
        return tokens

    def release(self, final: bool) -> int:
        """Streaming: make the pending tokens that may go now the next `chunk` (all of them when `final`, else those
        up to the last whole character when asked for); returns how many."""
        count = len(self._pending.tokens)
        if self._whole is not None and not final:
            count = self._whole(self._pending.tokens)
        self._chunk, self._pending = self._pending.split(count)
        return count

    def chunk(self) -> dict[str, np.ndarray]:
        """The streamed response for the tokens of the last `release` (only new tokens; never the prompt)."""
        return self._arrays(self._chunk.tokens, self._chunk, final=self.finished and not self._pending.tokens)

    def whole(self) -> dict[str, np.ndarray]:
        """The single response of a non-streaming request: every token (prompt first unless excluded)."""
        prefix = [] if self.request.exclude_input_in_output else list(self.request.prompt_token_ids)
        logits = np.concatenate(self.logits) if self.logits else None
        top = (np.concatenate([t[0] for t in self.top]), np.concatenate([t[1] for t in self.top])) if self.top else None
        return self._arrays(prefix + self.tokens, _Chunk(self.tokens, self.log_probs, logits, top), final=True)

    def _arrays(self, ids: list[int], chunk: _Chunk, final: bool) -> dict[str, np.ndarray]:
        out = {
            "output_ids": np.asarray(ids, dtype=np.int32).reshape(1, 1, -1),
            "sequence_length": np.asarray([[len(ids)]], dtype=np.int32),
            "batch_index": _one(self.request.batch_index, np.int32),
            "sequence_index": _one(self.sequence_index, np.int32),
        }
        wanted = self.request.outputs
        if wanted.log_probs:
            out["cum_log_probs"] = _one(sum(self.log_probs), np.float32)
            out["output_log_probs"] = np.asarray(chunk.log_probs, dtype=np.float32).reshape(1, 1, -1)
        if wanted.context_logits and self.context_logits is not None and not self._context_sent:
            out["context_logits"] = self.context_logits.astype(np.float32)[np.newaxis]
            self._context_sent = True
        if wanted.generation_logits and chunk.logits is not None:
            out["generation_logits"] = chunk.logits.astype(np.float32)[np.newaxis, np.newaxis]
        if wanted.top_log_probs:
            k = wanted.top_log_probs
            ids_, values = chunk.top if chunk.top is not None else (np.zeros((0, k), np.int32), np.zeros((0, k)))
            out["top_token_ids"] = ids_.astype(np.int32)[np.newaxis, np.newaxis]
            out["top_log_probs"] = values.astype(np.float32)[np.newaxis, np.newaxis]
        if wanted.finish_reason:
            out["finish_reason"] = np.asarray([[self.finish_reason.encode()]], dtype=object)
        if wanted.perf_metrics or (wanted.final_perf_metrics and final):
            out.update(perf_metrics(self.stats, len(self.request.prompt_token_ids), self.page_rows))
        if wanted.num_input_tokens:
            out["num_input_tokens"] = _one(len(self.request.prompt_token_ids), np.int32)
        if wanted.num_output_tokens:
            out["num_output_tokens"] = _one(len(self.tokens), np.int32)
        return out

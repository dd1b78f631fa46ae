"""The offline Python API, shaped like vLLM's: ``LLM(engine_dir).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dhisparse.engine.llm_engine import LLMEngine
from dhisparse.engine.loading import load_engine_config, load_engine_parts
from dhisparse.engine.parallel.driver import ParallelEngine
from dhisparse.engine.request import RequestOutput, RequestUpdate
from dhisparse.errors import ConfigError, RequestFailedError
from dhisparse.kv.store import KVStore
from dhisparse.sampling.params import SamplingParams


class LLM:
    """Load an engine directory (built by ``dhisparse-build``) or a Hugging Face checkpoint directory.

    ``runtime_overrides`` replace fields of the engine's ``runtime.json`` (see ``EngineConfig``), e.g.
    ``kv_policy="hisparse"``, ``pool_bytes=…``, ``hot_rows=…``, ``page_rows=…``, ``reserve_bytes=…``.
    ``wrap_kv``: see :class:`LLMEngine` (an observer of the KV store, e.g. a trace recorder).

    With ``tensor_parallel_size`` or ``data_parallel_size`` above 1 the engine runs on that many rank processes
    (``engine/parallel/``, docs/parallel.md) behind the same API; ``close()`` (or the end of the process) stops them.
    """

    def __init__(self, engine_dir: str | Path, *, wrap_kv: Callable[[KVStore], KVStore] | None = None,
                 **runtime_overrides: Any) -> None:
        self.engine_dir = Path(engine_dir)
        self.engine: LLMEngine | ParallelEngine
        config = load_engine_config(self.engine_dir, **runtime_overrides)
        if config.world_size > 1:
            if wrap_kv is not None:
                raise ConfigError("wrap_kv observes one process's KV store; it is not available with several ranks")
            self.engine = ParallelEngine(self.engine_dir, config, runtime_overrides)
            self.config = self.engine.cfg
            return
        self.config, model, speculator = load_engine_parts(self.engine_dir, **runtime_overrides)
        self.engine = LLMEngine(model, self.config, speculator, wrap_kv=wrap_kv)

    # ---------------------------------------------------------------------------------------- properties
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model.cfg.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        eos = self.engine.model.cfg.eos_token_id
        return eos[0] if eos else None

    @property
    def tokenizer_path(self) -> Path | None:
        path = self.engine_dir / "tokenizer.json"
        return path if path.exists() else None

    # ------------------------------------------------------------------------------------------ generate
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order. If engine work
        failed for some request (see ``LLMEngine``), the others still complete and ``RequestFailedError`` is
        raised with every output in its ``outputs`` (failed ones have ``finish_reason == "error"``)."""
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompt_token_ids)
        if len(plist) != len(prompt_token_ids):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompt_token_ids)} prompts")
        for p, sp in zip(prompt_token_ids, plist, strict=False):
            self.engine.validate([int(t) for t in p], sp)
        ids = [self.engine.add_request(list(p), sp) for p, sp in zip(prompt_token_ids, plist, strict=False)]
        while any(self.engine.requests[i].finish_reason is None for i in ids):
            self.engine.step()
        outputs = []
        for i in ids:
            req = self.engine.pop_finished(i)
            outputs.append(RequestOutput(i, req.prompt_token_ids, list(req.output_token_ids), req.finish_reason,
                                         self.engine.request_stats(req),
                                         list(req.output_log_probs) if req.params.logprobs else None,
                                         error=req.error))
        failed = [o for o in outputs if o.finish_reason == "error"]
        if failed:  # never hand back a silently empty output: the caller sees the failure (and every output)
            raise RequestFailedError(f"{len(failed)} of {len(outputs)} requests failed; the first, "
                                     f"{failed[0].request_id}: {failed[0].error}", outputs)
        return outputs

    def generate_stream(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None
                        ) -> Iterator[RequestUpdate]:
        """Yield this request's tokens as they are produced (drives the engine from the calling thread; other
        queued requests progress alongside)."""
        rid = self.engine.add_request(list(prompt_token_ids), params or SamplingParams())
        try:
            while True:
                for update in self.engine.step():
                    if update.request_id == rid:
                        yield update
                        if update.finished:
                            self.engine.pop_finished(rid)
                            return
        finally:
            if rid in self.engine.requests and self.engine.requests[rid].finish_reason is None:
                self.engine.abort_request(rid)
                self.engine.pop_finished(rid)

    def stats(self) -> dict[str, float]:
        """Engine-wide counters (requests, tokens, steps, and the KV hierarchy's statistics)."""
        return self.engine.stats()

    def close(self) -> None:
        """Stop the engine's rank processes (several ranks; nothing to do on one)."""
        if isinstance(self.engine, ParallelEngine):
            self.engine.close()

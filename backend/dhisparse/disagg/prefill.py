"""The context (prefill) role: compute a prompt's history and first token, publish the history over NIXL.

``PrefillEngine`` loads the same engine directory as a decode engine but no KV hierarchy: it runs the
model's chunked prefill over a local KV and returns the prompt's rows ``[num_sources, T, row_dim]``, the
indexer keys of every indexer layer, the drafter's context features (when the engine speculates: the last
``window`` positions, exactly what the decode side's draft ring starts from) and the first token, sampled
with the request's own random stream (position 0), so the decode side continues the co-located sequence.

``PrefillService`` is what one context process runs: ``run`` prefills, packs the history into one region,
registers it with the NIXL exporter and returns the :class:`ContextPhaseParams`; ``poll`` frees regions
whose transfer the decode side acknowledged (or whose hold deadline passed).
"""

from __future__ import annotations

import itertools
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dhisparse.disagg.nixl_transfer import NixlExporter
from dhisparse.disagg.params import ContextPhaseParams, RegionLayout, dtype_name, prompt_digest
from dhisparse.engine.executor import BatchSampling
from dhisparse.engine.loading import load_engine_parts
from dhisparse.engine.request import Request
from dhisparse.errors import InvalidRequestError
from dhisparse.sampling import SamplingParams, seed_to_int64


@dataclass
class ContextResult:
    """One prefilled prompt: rows ``[S, T, row_dim]``, keys ``{layer: [T, d]}``, drafter features ``[W, F]``."""

    first_token: int
    seed: int
    rows: torch.Tensor
    index_keys: dict[int, torch.Tensor]
    features: torch.Tensor | None
    prefill_s: float


class PrefillEngine:
    """Prefill-only engine over an engine directory (``runtime_overrides`` as for ``LLM``)."""

    def __init__(self, engine_dir: str | Path, **runtime_overrides: Any) -> None:
        self.config, self.model, self.spec = load_engine_parts(engine_dir, max_slots=1, **runtime_overrides)
        model_cfg = self.model.cfg
        self.max_model_len = min(self.config.max_model_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings)

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        vocab = self.model.cfg.vocab_size
        if not prompt:
            raise InvalidRequestError("the prompt is empty: at least one token is required")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                      f"the engine's max_model_len ({self.max_model_len})")

    def prefill(self, prompt: list[int], params: SamplingParams, request_id: str) -> ContextResult:
        """Prefill ``prompt``; the random stream is seeded as the co-located engine seeds ``request_id``."""
        self.validate(prompt, params)
        began = time.perf_counter()
        layers = self.spec.layers if self.spec is not None else ()
        out = self.model.prefill(prompt, chunk_tokens=self.config.prefill_chunk_tokens, capture_hidden=layers)
        seed = seed_to_int64(params.seed if params.seed is not None else zlib.crc32(request_id.encode()))
        req = Request(request_id, list(prompt), params, seed)
        # The co-located engine's first-token rule: its logit processing (penalties, bias, bans), then sampling.
        sampling = BatchSampling.of([req], out.logits.device, tuple(self.model.cfg.eos_token_id),
                                    self.model.cfg.vocab_size)
        first = int(sampling.sample(sampling.process(out.logits.view(1, 1, -1))[:, 0], params.temperature <= 0)[0])
        features = None
        if self.spec is not None:
            features = self.spec.features(out.hidden)[-self.spec.ring.window :]
        return ContextResult(first, seed, out.rows, out.index_keys, features, time.perf_counter() - began)


class PrefillService:
    """One context process: prefill + publish over NIXL (see the module docstring)."""

    def __init__(self, engine: PrefillEngine, exporter: NixlExporter) -> None:
        self.engine, self.exporter = engine, exporter
        self._keys = itertools.count()
        self.counters: dict[str, float] = {"context_requests": 0.0, "context_prefill_seconds": 0.0}

    def run(self, prompt: list[int], params: SamplingParams, request_id: str, arrival: float | None = None
            ) -> ContextPhaseParams:
        started = time.perf_counter()
        result = self.engine.prefill(prompt, params, request_id)
        cfg = self.engine.model.cfg
        layout = RegionLayout(
            num_sources=int(result.rows.shape[0]), prompt_len=len(prompt), row_dim=int(result.rows.shape[2]),
            rows_dtype=dtype_name(self.engine.config.torch_dtype), key_layers=tuple(sorted(result.index_keys)),
            index_key_dim=cfg.index_head_dim,
            feature_rows=0 if result.features is None else int(result.features.shape[0]),
            feature_dim=0 if result.features is None else int(result.features.shape[1]),
        )
        key = f"{self.exporter.name}/{next(self._keys)}/{request_id}"
        region, metadata = self.exporter.publish(key, layout.total_bytes)
        layout.pack(region, result.rows, result.index_keys, result.features)
        addr = region.data_ptr()
        self.counters["context_requests"] += 1
        self.counters["context_prefill_seconds"] += result.prefill_s
        return ContextPhaseParams(
            request_key=key, agent_name=self.exporter.name, region_addr=addr, layout=layout,
            first_token=result.first_token, seed=result.seed,
            queue_s=max(0.0, started - arrival) if arrival is not None else 0.0, prefill_s=result.prefill_s,
            hold_deadline_s=self.exporter.hold_timeout_s, prompt_sha256=prompt_digest(prompt), agent_metadata=metadata,
        )

    def poll(self) -> None:
        self.exporter.poll()

    def stats(self) -> dict[str, float]:
        return {**self.counters, **self.exporter.stats()}

    def close(self) -> None:
        self.exporter.close()

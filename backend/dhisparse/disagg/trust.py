"""The generation side's trust boundary: which context phases it imports, and what the import may do.

A request reaches the `generation` model only from the orchestrator (its ``dhisparse_auth`` token,
``internal_auth.py``), and its ``context_phase_params`` must be the context role's own output (their HMAC tag,
``params.py``). What is left to check here is that the params fit this engine and this request, before any memory
is reserved or any byte is read:

- the layout is exactly what this engine's own prefill would publish for a prompt of this length (sources, row
  width and dtype, indexer layers and key width, drafter features), so a READ can only land where the admission
  put the request's pages, and every unpack has the shape the engine expects;
- they were made for this prompt (their ``prompt_sha256``): another request's context phase, even a genuine one, is
  refused, so no request can import another's history; the first token is in the vocabulary;
- a context phase is imported at most once (``ImportLedger``): a replayed params blob is refused.

Everything raises :class:`InvalidRequestError` naming the field, so the request ends with that error and nothing
else is touched. The decode engine additionally ends (never crashes on) any import that fails later.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from dhisparse.disagg.params import ContextPhaseParams, RegionLayout, dtype_name, prompt_digest
from dhisparse.errors import InvalidRequestError
from dhisparse.kv.config import KVLayout


@dataclass(frozen=True)
class LayoutTemplate:
    """What a generation engine expects of every region, whatever the prompt's length: the layout without its
    length, and the vocabulary the first token must lie in. Picklable: a multi-rank generation engine's driver
    checks params against rank 0's template (``disagg/ranks.py``), and every rank checks them again."""

    num_sources: int
    row_dim: int
    rows_dtype: str
    key_layers: tuple[int, ...]
    index_key_dim: int
    feature_window: int  # drafter context rows kept (0: no drafter)
    feature_dim: int
    vocab_size: int

    def for_prompt(self, prompt_len: int) -> RegionLayout:
        return RegionLayout(num_sources=self.num_sources, prompt_len=prompt_len, row_dim=self.row_dim,
                            rows_dtype=self.rows_dtype, key_layers=self.key_layers, index_key_dim=self.index_key_dim,
                            feature_rows=min(prompt_len, self.feature_window), feature_dim=self.feature_dim)


def layout_template(engine: Any) -> LayoutTemplate:
    """The template of the regions this decode engine's own prefill would publish (an ``LLMEngine``)."""
    # The prefill publishes the model's rows: one source per layer, in the engine dtype (whatever the store keeps).
    kv_layout = KVLayout.from_model_config(engine.model.cfg, engine.cfg.torch_dtype)
    window = feature_dim = 0
    if engine.spec is not None:
        window = engine.spec.ring.window
        feature_dim = len(engine.spec.layers) * engine.model.cfg.hidden_size
    return LayoutTemplate(num_sources=kv_layout.num_sources, row_dim=kv_layout.row_dim,
                          rows_dtype=dtype_name(engine.cfg.torch_dtype),
                          key_layers=tuple(sorted(kv_layout.indexer_layers)), index_key_dim=kv_layout.index_key_dim,
                          feature_window=window, feature_dim=feature_dim, vocab_size=engine.model.cfg.vocab_size)


def expected_layout(engine: Any, prompt_len: int) -> RegionLayout:
    """The region layout this decode engine's own prefill would publish for a ``prompt_len``-token prompt (an
    ``LLMEngine``)."""
    return layout_template(engine).for_prompt(prompt_len)


def check_context(context: ContextPhaseParams, expected: LayoutTemplate, prompt: list[int]) -> None:
    """Refuse params that do not fit the engine whose template is ``expected`` (``layout_template``; a decode
    engine's ``layout_template``) or the request's ``prompt`` (module docstring); names the field."""
    if context.layout.prompt_len != len(prompt):
        raise InvalidRequestError(f"context_phase_params describe a {context.layout.prompt_len}-token prompt, the "
                                  f"request has {len(prompt)} tokens")
    if context.prompt_sha256 != prompt_digest(prompt):
        raise InvalidRequestError("context_phase_params were made for another prompt (prompt_sha256 differs): a "
                                  "context phase serves only the request it was computed for")
    want = expected.for_prompt(len(prompt))
    for name in ("num_sources", "row_dim", "rows_dtype", "key_layers", "index_key_dim", "feature_rows",
                 "feature_dim"):
        got, wanted = getattr(context.layout, name), getattr(want, name)
        if got != wanted:
            raise InvalidRequestError(f"context_phase_params: layout.{name} is {got!r}, this engine expects "
                                      f"{wanted!r} (run the context and generation roles on the same engine)")
    if not 0 <= context.first_token < expected.vocab_size:
        raise InvalidRequestError(f"context_phase_params: first token {context.first_token} is outside the "
                                  f"vocabulary [0, {expected.vocab_size})")


class ImportLedger:
    """The context phases already taken (request keys), each remembered until its hold deadline has passed: the
    context side frees the region then, so a later replay could only fail; within it, a replay is refused."""

    def __init__(self) -> None:
        self._taken: dict[str, float] = {}
        self._lock = threading.Lock()

    def take(self, context: ContextPhaseParams) -> None:
        now = time.monotonic()
        with self._lock:
            for key in [k for k, until in self._taken.items() if until < now]:
                del self._taken[key]
            if context.request_key in self._taken:
                raise InvalidRequestError(f"context_phase_params {context.request_key!r} were already imported "
                                          "(each context phase serves one generation request)")
            self._taken[context.request_key] = now + max(context.hold_deadline_s, 1.0) + 60.0

"""The engine's one view of KV storage: :class:`KVStore`, the contract every store implements.

Stores (all under ``dhisparse.kv``, built by :func:`dhisparse.kv.factory.make_kv_store`):

- :class:`~dhisparse.kv.manager.KVManager` — the hierarchy (``resident``, ``hisparse``, ``adaptive``);
- :class:`~dhisparse.kv.dense.DenseKVStore` — the unbounded reference (``dense``);
- :class:`~dhisparse.kv.deepseek_v4.V4DenseKVStore` / :class:`~dhisparse.kv.deepseek_v4.V4HierarchyKVStore` — the
  same two for DeepSeek-V4 models.

The engine never asks which one it holds. Call protocol (one thread, the engine loop)::

    never_admissible → set_token_ids → try_admit → cached_prefix_tokens, prefill_kv → (the model's prefill from
    there) → import_prompt
    → repeatedly: begin_step → (the model's forward over the step) → read(…, step.report()) → end_step | abort_step
    → poll … → release

At most one step is open at a time; ``try_admit`` and ``release`` may be called between steps. A request that
``try_admit`` refused stays queued by the caller and may be offered again; ``release`` forgets it either way.
Prefix reuse (a store that keeps a prefix cache, ``kv/prefix_reuse.py``): the caller names a request's token ids
(``set_token_ids``: the prompt before ``try_admit``, the whole sequence before ``release``); the admission may find
the prompt's first ``cached_prefix_tokens`` tokens cached, and the prefill computes only the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from dhisparse.kv.copies import CopyError
from dhisparse.kv.host_store import ChunkedRows
from dhisparse.kv.policies import KVPolicy
from dhisparse.model.deepseek_v4.kv_state import V4RequestKV
from dhisparse.model.kv_view import PrefillKV

__all__ = ["CopyError", "HostRowsTarget", "KVMemory", "KVStep", "KVStore", "PromptRows"]

PromptRows = torch.Tensor | V4RequestKV
"""What a prefill hands a store: rows ``[num_sources, T, row_dim]`` (DSA models) or a DeepSeek-V4 state."""


class KVStep(Protocol):
    """What the engine sees of one batched forward: its length and report. The model reads and writes the step through
    its own view of it (:class:`~dhisparse.model.kv_view.StepKV` for the DSA models, ``V4StepKV`` for DeepSeek-V4)."""

    query_len: int

    def report(self) -> torch.Tensor:
        """What :meth:`KVStore.end_step` reads from the device, as one int64 vector (empty when the store defers
        nothing). The engine reads it together with its sampled tokens (one transfer, :meth:`KVStore.read`) and
        passes the values to ``end_step(report=...)``."""
        ...


@dataclass(frozen=True)
class HostRowsTarget:
    """Where an external transfer (disaggregated decode) writes an admitted request's prompt rows.

    ``row_index [num_sources, prompt_len]`` int64 (CPU): the global row of ``rows`` for each prompt row (chunk
    ``r // rows.chunk_rows``; a page never straddles chunks and its rows are consecutive). ``page_rows``: rows per
    page. The chunks never move, so the rows stay where they are however many requests are admitted after.
    ``cached_rows``: prompt rows ``0 .. cached_rows-1`` (whole pages) are a prefix the store holds already (prefix
    reuse): their pages are shared and must not be written; the transfer brings the rows from there on."""

    row_index: torch.Tensor
    rows: ChunkedRows
    page_rows: int
    cached_rows: int = 0


@dataclass(frozen=True)
class KVMemory:
    """A store's device memory figures, in bytes (``0`` where a store has no such budget: the reference stores).

    ``staging_bytes_per_request`` / ``ring_bytes_per_request``: what each admitted request is charged for
    verification staging and the draft ring (its ``kv_staging_bytes`` / ``kv_ring_bytes``)."""

    pool_bytes: int = 0
    required_bytes: int = 0
    optional_bytes: int = 0
    reserve_bytes: int = 0
    staging_bytes_per_request: int = 0
    ring_bytes_per_request: int = 0


@runtime_checkable
class KVStore(Protocol):
    """The contract between the engine and a KV store (see the module docstring for the call order)."""

    @property
    def policy(self) -> KVPolicy:
        """The residency policy the store runs (its decisions are the policy's methods)."""
        ...

    # ------------------------------------------------------------------------------------ admission
    def never_admissible(self, prompt_len: int, max_new_tokens: int) -> str | None:
        """Why a request of this size could never be admitted, even with nothing else running (``None``: it can)."""
        ...

    def try_admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> bool:
        """Reserve the request's required memory; ``False``: not now (the caller keeps it queued and retries).
        Raises :class:`~dhisparse.kv.config.AdmissionError` when it could never be admitted, and
        :class:`CopyError` when a copy it completed on the way failed (:meth:`owners_of` names whose)."""
        ...

    def release(self, request_id: str) -> None:
        """Finish or cancel a request, admitted or refused: every tier it holds is freed under the safety rules
        (after its copies and the readers issued before now). Not for a request of the open step."""
        ...

    # ------------------------------------------------------------------------------------ prefix reuse
    def set_token_ids(self, request_id: str, token_ids: Sequence[int], reuse: bool = True) -> None:
        """The token ids of the request's rows (row ``p`` is the KV of ``token_ids[p]``): its prompt before
        ``try_admit`` (the admission looks up the longest cached prefix; ``reuse=False``: none, e.g. when every
        prompt position's logits are wanted), its whole sequence before ``release`` (its complete pages stay cached
        for later requests). A store without a prefix cache ignores it."""
        ...

    def cached_prefix_tokens(self, request_id: str) -> int:
        """Prompt tokens of the admitted request whose KV the admission found cached: its prefill starts at this
        position (0 without a hit). They are then in the store already (rows and indexer keys)."""
        ...

    # -------------------------------------------------------------------------------------- prompts
    def prefill_kv(self, request_id: str, chunk_tokens: int) -> PrefillKV | V4RequestKV | None:
        """A store the admitted request's prefill writes into chunk by chunk (the prompt streams into its host
        pages; DeepSeek-V4: the state a prefill after a cached prefix restarts from), or ``None``: prefill over a
        local store and hand the rows to :meth:`import_prompt`."""
        ...

    def import_target(self, request_id: str) -> HostRowsTarget | None:
        """Where an external transfer must write the admitted request's prompt rows before
        ``import_prompt(request_id, None, keys)``; ``None``: the store takes the rows in ``import_prompt``."""
        ...

    def import_prompt(self, request_id: str, rows: PromptRows | None,
                      index_keys: Mapping[int, torch.Tensor] | None) -> None:
        """Import the admitted request's prompt (its *imported history*): ``rows`` as its prefill or a transfer
        produced them, or ``None`` when they were written through :meth:`prefill_kv` / :meth:`import_target`;
        ``index_keys {layer: [T, d]}``, or ``None`` when the prefill wrote them in place."""
        ...

    # ---------------------------------------------------------------------------------------- steps
    def begin_step(self, request_ids: Sequence[str], query_len: int) -> KVStep:
        """Open a step of ``query_len`` new tokens for each request (positions ``len .. len + Q - 1``)."""
        ...

    def end_step(self, accepted: Mapping[str, int], report: Sequence[int] | None = None) -> None:
        """Keep the first ``accepted[r]`` new rows of each request of the open step; drop the rest. ``report``: the
        values of ``step.report()`` if the caller read them (else read here). A check the step failed raises."""
        ...

    def abort_step(self) -> None:
        """Roll the open step back after a fault (every provisional row dropped, nothing counted); no-op when no
        step is open. Requests stay admitted: the caller releases the ones that failed."""
        ...

    def owners_of(self, failure: CopyError) -> list[str]:
        """Requests whose memory a failed copy touched: the owner of an import, backup or refill, or every
        request of the open step for its row fetches (the engine ends exactly these)."""
        ...

    # ------------------------------------------------------------------------------ progress, reads, figures
    def poll(self) -> None:
        """Complete ready copies, free what is safe to free, refill optional pages (between steps, and idle)."""
        ...

    def read(self, *tensors: torch.Tensor) -> list[list[int]]:
        """Every (integer) tensor's values, flattened, in one counted device→host read (``kv_host_syncs``)."""
        ...

    def memory(self) -> KVMemory:
        """The store's device memory figures (see :class:`KVMemory`)."""
        ...

    def stats(self) -> dict[str, float]:
        """Engine-wide counters and gauges, every name prefixed ``kv_`` (docs/kv.md)."""
        ...

    def request_stats(self, request_id: str) -> dict[str, float]:
        """One admitted request's counters and gauges, prefixed ``kv_``."""
        ...

    def check_invariants(self) -> None:
        """Raise :class:`~dhisparse.kv.invariants.InvariantError` naming the first broken invariant."""
        ...

    def corrupt_accounting(self) -> None:
        """Fault drills only (``fault_injection=break_invariants``): break the byte accounting so that
        :meth:`check_invariants` fails and the engine must stop."""
        ...

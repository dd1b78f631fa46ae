"""What the step and its resolution implementations share: what a step works with (:class:`StepParts`), the step's
check flags, the per-source record (:class:`Resolved`), the interface (:class:`StepResolution`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from dhisparse.host_values import HostSync
from dhisparse.kernels.resolver import HotCacheOverflowError
from dhisparse.kv.batch_state import BatchState
from dhisparse.kv.config import KVLayout
from dhisparse.kv.copies import CopyEngine, CopyTicket
from dhisparse.kv.device_pool import DevicePool
from dhisparse.kv.host_store import HostStore

if TYPE_CHECKING:
    from dhisparse.kv.step import StepKV

# Error flags accumulated on the device during a step (read once, see ``StepKV.report``), with their messages and
# the error each raises.
FLAG_BAD_POSITION, FLAG_OVERFLOW, FLAG_UNMAPPED, FLAG_NO_HOST_COPY = range(4)
FLAG_MESSAGES = (
    "gather: a selected position is at or past the request's length",
    "the resolver's hot cache overflowed: a request misses more rows than its hot cache has evictable slots "
    "plus verification staging rows; raise hot_rows (B) to at least the number of distinct rows one step can "
    "select",
    "tail page of a new row is not mapped (begin_step broke its contract)",
    "a missed row has no host copy (its page was never backed up), or the step resolver was given a source, slot or "
    "staging slot out of range: the KV hierarchy's residency invariant is broken",
)
FLAG_ERRORS: tuple[type[Exception], ...] = (ValueError, HotCacheOverflowError, RuntimeError, RuntimeError)


@dataclass(frozen=True)
class StepParts:
    """What a step works with, handed over by the manager (the step reads none of the manager's state). The
    per-layer tables are the layout's, precomputed once so that a step's per-layer calls stay in the step."""

    layout: KVLayout
    pool: DevicePool
    host: HostStore
    copies: CopyEngine
    batch: BatchState  # persistent per-slot state (kv/batch_state.py)
    sync: HostSync  # every host read of the step goes through it
    device: torch.device
    uses_host: bool  # the policy keeps history in the host store
    debug_checks: bool  # read and raise each check at once
    attends_on_device: bool  # the resolution attends with a device kernel (StepResolution.attend)
    page_rows: int
    keys_per_page: int
    staging: bool  # verification staging rows exist (a speculative step under a policy with a hot cache)
    rows_as_is: bool  # native rows of the layout's dtype: stored as written, no encode / decode
    keys_as_is: bool  # native indexer keys: likewise
    key_layer: tuple[int, ...]  # per layer: its index among the indexer layers (the key pages' layer), or -1
    group_of_layer: tuple[tuple[int, ...], ...]  # per layer: the layers resolved with it when it leads a group
    staging_slot_of_layer: tuple[int, ...]  # per layer: the staging slot its source uses


@dataclass(frozen=True)
class StepSetup:
    """A step's per-step values, computed by the resolution's set-up from the batch state.

    ``starts`` / ``lengths`` ``[B]`` int64 (device): first new position and history length with the new tokens;
    ``page_table [B, S, M]``: the step's snapshot of its requests' page tables; ``write_rows``: per source ``[B*Q]``
    arena rows the new tokens' rows go to; ``key_write``: per indexer layer ``[B, Q]`` key pages and the offsets
    ``[B, Q]`` within them; ``slot_index``: the slots as a CPU tensor (for a resolution that reads the batch state
    by slot), else ``None``; ``unmapped``: a device flag set when a new row's page is not mapped (``None``: not
    checked)."""

    starts: torch.Tensor
    lengths: torch.Tensor
    page_table: torch.Tensor
    write_rows: tuple[torch.Tensor, ...]
    key_write: tuple[tuple[torch.Tensor, ...], torch.Tensor]
    slot_index: torch.Tensor | None = None
    unmapped: torch.Tensor | None = None


@dataclass
class Resolved:
    """One source's resolution in a step: reused by every layer that reads the source with the same selection."""

    positions: torch.Tensor  # [B, X, K] as passed by the model
    locations: torch.Tensor  # [B, X*K] arena row of every entry (-1 where unused: the arena's last row, zero)
    ticket: CopyTicket | None  # host→device copies of the misses (None when nothing is copied)
    staging_slot: int
    staged: bool  # rows may live in the staging slot (a later resolution reusing the slot drops this entry)


class StepResolution(Protocol):
    """One implementation of a step's resolution (see the module docstring)."""

    name: str

    def setup(self, step: StepKV, starts: list[int], width: int) -> StepSetup:
        """The step's per-step values from the batch state (:class:`StepSetup`), its page-table snapshot ``width``
        pages wide."""
        ...

    def resolve(self, step: StepKV, todo: list[tuple[int, int]], positions: torch.Tensor) -> None:
        """Resolve the sources ``todo`` (``(source, staging slot)``, an index group) selected by ``positions [B, X,
        K]``: record each one's :class:`Resolved` (``step.resolved``), add the counts into the step's report, flag its
        checks, issue its host fetches."""
        ...

    def settle(self, step: StepKV) -> None:
        """Settle what was deferred to the step's report (checks and counts), before it is read."""
        ...

    def attend(self, step: StepKV, locations: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor,
               softmax_scale: float) -> torch.Tensor | None:
        """Sparse MLA over arena rows ``locations [B, X, K]`` by a device kernel, or ``None`` (the model attends
        over ``StepKV.gather``)."""
        ...

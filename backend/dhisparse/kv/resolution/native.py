"""Resolution by the native CPU library (``libdhisparse_cpu.so``): the resolver shared with the CUDA kernels.

On a CPU device with the library built and self-checked (``kernels="auto"``), a step's set-up is one library call
(``native.step_setup``: starts, lengths, the page-table snapshot, the new tokens' arena rows and key pages) and each
index group's resolution is one call (``native.resolve_step``) that reads the step's state where it lives
(page-table snapshot by request; hot state and host page ids in the batch state's slots, the hot state updated
there in place), adds the counts (and staged rows) into the step's report and returns each source's exact host →
arena copy list, which a CPU caller may read: the group's lists go out as one copy (a group that misses nothing
issues none). A step whose every
history is direct is one direct-only call per group (page-table lookups, checks and counts in the library).
Verification staging is the library's too (the contract's step 4: ``staging_loc``, one staging slot per group
member). The checks become the step's flags, raised with the others when the report is read.
"""

from __future__ import annotations

import ctypes

import torch

from dhisparse.kernels import native
from dhisparse.kv.resolution.common import FLAG_BAD_POSITION, FLAG_OVERFLOW, FLAG_UNMAPPED, Resolved, StepSetup
from dhisparse.kv.step import StepKV

# The library's step flags and the step's own flag each sets.
_FLAGS = ((native.STEP_BAD_POSITION, FLAG_BAD_POSITION), (native.STEP_HOT_CACHE_OVERFLOW, FLAG_OVERFLOW),
          (native.STEP_UNMAPPED, FLAG_UNMAPPED))


class NativeResolution:
    """The CPU library's resolution (see the module docstring); ``lib`` is the loaded, self-checked library."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._sources: dict[tuple[int, ...], torch.Tensor] = {}  # an index group's sources as a CPU tensor
        self._checked: list[torch.Tensor | None] = []  # the batch-state tensors resolve_step last checked

    def setup(self, step: StepKV, starts: list[int], width: int) -> StepSetup:
        """The step's per-step values by one library call, as views of its output; an unmapped new row is flagged
        whatever the debug mode (the flag costs no device read here)."""
        m, state = step.parts, step.parts.batch
        query_len = step.query_len
        out, flags = native.step_setup(self.lib, starts, step.slots, state.page_table, state.key_pages, width,
                                       query_len, m.page_rows, m.keys_per_page)
        batch, sources, indexers = len(starts), state.page_table.shape[1], state.key_pages.shape[1]
        bq = batch * query_len
        at = 2 * batch + batch * sources * width
        rows_at = at + sources * bq
        return StepSetup(
            starts=out[:batch], lengths=out[batch: 2 * batch],
            page_table=out[2 * batch: at].view(batch, sources, width),
            write_rows=out[at: rows_at].view(sources, bq).unbind(0),
            key_write=(out[rows_at: rows_at + indexers * bq].view(indexers, batch, query_len).unbind(0),
                       out[rows_at + indexers * bq:].view(batch, query_len)),
            slot_index=torch.tensor(step.slots, dtype=torch.int64),  # the slots the library reads, by request
            unmapped=torch.ones((), dtype=torch.bool) if flags else None)

    def resolve(self, step: StepKV, todo: list[tuple[int, int]], positions: torch.Tensor) -> None:
        """One call for the group: direct-only when every history is direct (hot state untouched), else the full
        resolver with the group members' staging slots (a verification step's overflow rows)."""
        m, state = step.parts, step.parts.batch
        key = tuple(s for s, _ in todo)
        sources = self._sources.get(key)
        if sources is None:
            sources = self._sources[key] = torch.tensor(key, dtype=torch.int64)
        direct = step.all_direct
        assert step.slot_index is not None  # set by setup()
        staging = None
        if not direct:
            if m.staging:
                staging = (state.staging_loc, [slot for _, slot in todo], step.staged)
        out = native.resolve_step(self.lib, positions.reshape(len(step.requests), -1).contiguous(), step.lengths,
                                  sources, step.slot_index, step.page_table, state.hot_pos, state.hot_stamp,
                                  state.hot_loc, state.host_pages if m.uses_host else None, step.counts, step.stamp,
                                  m.page_rows, direct_only=direct, staging=staging, checked=self._checked)
        step.resolver_calls += len(todo)
        if out.flags & native.STEP_NO_HOST_COPY:
            raise RuntimeError("a missed row has no host copy (its page was never backed up): the KV hierarchy's "
                               "residency invariant is broken")
        for bit, flag in _FLAGS:  # raised with the step's other checks
            if out.flags & bit:
                step.flag(flag, torch.ones((), dtype=torch.bool))
        staged = staging is not None
        widths = list(out.fetch_count)
        ticket = None
        if not out.flags and any(widths):  # one copy for the group: every member's missed rows in one gather
            members = [g for g, width in enumerate(widths) if width]
            if len(members) == 1:
                g = members[0]
                ticket = step.issue_fetch(out.fetch_src[g, :widths[g]], out.fetch_dst[g, :widths[g]])
            else:
                ticket = step.issue_fetch(torch.cat([out.fetch_src[g, :widths[g]] for g in members]),
                                          torch.cat([out.fetch_dst[g, :widths[g]] for g in members]))
        for (source, slot), locations, width in zip(todo, out.locations.unbind(0), widths, strict=True):
            step.resolved[source] = Resolved(positions, locations, ticket if width else None, slot, staged)

    def settle(self, step: StepKV) -> None:
        return None  # nothing is deferred: every call checks and counts in the library

    def attend(self, step: StepKV, locations: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor,
               softmax_scale: float) -> None:
        return None  # the model attends over the gathered rows

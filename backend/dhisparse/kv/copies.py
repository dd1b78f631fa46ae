"""Two-phase copies between tiers (issued → done) and the reader fence that makes frees safe.

Every movement of rows between the host store, the device arena and staging tensors is a
:class:`CopyTicket`: ``dst[dst_rows] = src[src_rows]`` along dim 0. Issuing never makes the data visible;
the copy is *done* at a defined later point, and only then does its ``on_done`` callback run (which is
where the manager marks a host page valid, maps a refilled page, or retires a backed-up page).

- **CPU**: copies are deferred. They are performed, in issue order, by :meth:`CopyEngine.poll` (the
  manager's ``poll()``/step boundary) or by :meth:`CopyEngine.wait` (which completes every copy issued up
  to the awaited one, like a stream). Reading a destination before its copy is done therefore returns
  stale data, so a missing wait shows up as wrong rows in tests rather than going unnoticed.
- **CUDA**: copies run on a dedicated copy stream ordered after the work already issued on the current
  stream; a CUDA event marks completion. Device→host copies land in pinned staging and are scattered into the
  host store when done.
- **Copies out of the host store** (``src`` a :class:`~dhisparse.kv.host_store.ChunkedRows` with a view on the
  destination's device, :meth:`ChunkedRows.mapped`) are one gather from that view with the index where it was
  made — on CUDA the pinned store mapped into the device's address space, read directly by the gather on the
  copy stream, so a copy list made on the device is never read by the host; on CPU the same gather over the
  store's own chunks. Without such a view (a CUDA store that cannot be mapped) the rows are gathered on the host
  into pinned staging, and a copy list made on the device is read first (one counted :class:`HostSync` read).

:class:`ReaderFence` counts *reader epochs* (one per decode/verification step). A page retired at epoch
``e`` (``fence.issued`` at the decision) may be freed once ``fence.completed >= e``: every reader issued
before the decision has finished.

**Agreed completion** (``agreed = True`` on both; on automatically for tensor-parallel ranks, which must take the same
KV decisions): when a copy or a reader epoch counts as complete is a function of the engine's step sequence only,
never of event timing. The step boundary is the store's ``poll`` (:meth:`CopyEngine.poll`, :meth:`ReaderFence.tick`):
at boundary ``k`` every copy issued before boundary ``k - 1`` completes (its event is synchronised on if it has not
fired yet: a bounded stall, counted in ``agreed_stalls``) and no later copy does; between boundaries the fence counts
exactly the epochs that ended before the previous boundary as complete. Explicit waits (``wait``, ``wait_all``,
``ReaderFence.wait``) are already decided by the code path. Off (the default), completion follows the events'
``query()`` (as soon as a copy is done on the device). On CPU, where completion never depends on timing, the rule
applies to copies all the same (each completes one poll later than without it), so CPU runs exercise it; reader
epochs on CPU have no events and finish at ``end()`` either way.

``event_source`` (tests only): on a CPU engine, a factory of stand-in completion events (``query()`` /
``synchronize()``) given to every copy and reader epoch, so the CUDA-shaped completion path runs on CPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dhisparse.host_values import HostSync
from dhisparse.kv.host_store import ChunkedRows
from dhisparse.kv.mapped_host import MappedRows


@dataclass
class CopyTicket:
    """One issued copy. ``done`` turns true exactly once, right before ``on_done`` runs."""

    ticket_id: int
    kind: str
    num_rows: int
    on_done: Callable[[], None] | None = None
    done: bool = False
    error: BaseException | None = None  # the copy failed: it never becomes done and ``on_done`` never runs
    # CPU: the deferred operation; CUDA: completion event and tensors kept alive until then.
    _run: Callable[[], object] | None = field(default=None, repr=False)
    _event: object | None = field(default=None, repr=False)
    _finish: Callable[[], object] | None = field(default=None, repr=False)
    watched: torch.Tensor | None = field(default=None, repr=False)  # see CopyEngine.issue_gather


class CopyError(RuntimeError):
    """A copy failed. ``ticket`` is the failed copy (``ticket.error`` the cause); it has left the queue, so the
    copies behind it still complete. Its destination rows are undefined and its ``on_done`` never runs: the
    owner of the memory it touched has to be ended (the engine fails that work's requests)."""

    def __init__(self, ticket: CopyTicket) -> None:
        super().__init__(f"{ticket.kind} copy #{ticket.ticket_id} of {ticket.num_rows} rows failed: {ticket.error!r}")
        self.ticket = ticket


class CopyEngine:
    """Issues row copies between tiers and completes them at defined points (see module docstring).

    A copy that raises while completing is marked failed and raises :class:`CopyError` from the ``poll`` /
    ``wait`` / ``wait_all`` that completed it; a failed ticket is not live (its owner may be freed).
    ``fault_hook(kind)``, when set, is called before each copy completes (fault injection)."""

    def __init__(self, device: torch.device, sync: HostSync | None = None) -> None:
        self.fault_hook: Callable[[str], None] | None = None
        self.device = device
        self.sync = sync
        self.is_cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if self.is_cuda else None
        self._pending: deque[CopyTicket] = deque()
        self._next_id = 0
        self.rows_copied: dict[str, int] = {}
        self.copies_failed = 0
        self.mapped_copies = 0  # copies out of the host store that gathered from its mapped view
        self.agreed = False  # agreed completion (module docstring)
        self.agreed_stalls = 0  # agreed mode: copies completed by waiting on an event that had not fired yet
        self.event_source: Callable[[], object] | None = None  # tests: stand-in events on CPU (module docstring)
        self._cut = 0  # agreed mode: tickets with ids below this complete at the next poll

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def pending_kinds(self) -> list[str]:
        return [t.kind for t in self._pending]

    def issue(
        self,
        kind: str,
        dst: torch.Tensor | ChunkedRows,
        dst_rows: torch.Tensor,
        src: torch.Tensor | ChunkedRows,
        src_rows: torch.Tensor,
        on_done: Callable[[], None] | None = None,
    ) -> CopyTicket:
        """Issue ``dst[dst_rows] = src[src_rows]`` (rows along dim 0; index tensors int64, any device).

        ``src`` rows must not change and ``dst`` rows must not be read until the ticket is done.
        """
        ticket = CopyTicket(self._next_id, kind, int(dst_rows.numel()), on_done)
        self._next_id += 1
        mapped = _mapped_view(src, dst)
        if mapped is not None:
            self._issue_mapped(ticket, dst, _to_device(dst_rows, dst.device), mapped,
                               _to_device(src_rows, mapped.device))
            return self._queue(ticket)
        dst_rows = dst_rows.to(dst.device)
        if src.device.type == "cpu" and src_rows.device.type != "cpu":
            # A copy list produced on the device read by the host: a synchronisation, counted (only when the
            # host store has no view on the device, see the module docstring).
            src_rows = torch.tensor(self.sync.read(src_rows)[0], dtype=torch.int64) if self.sync else src_rows.cpu()
        src_rows = src_rows.to(src.device)
        if not self.is_cuda:
            ticket._run = lambda: dst.index_copy_(0, dst_rows, src.index_select(0, src_rows))
        else:
            self._issue_cuda(ticket, dst, dst_rows, src, src_rows)
        return self._queue(ticket)

    def _queue(self, ticket: CopyTicket) -> CopyTicket:
        if ticket._run is not None and self.event_source is not None:  # a CPU copy with a stand-in event (tests)
            ticket._event = (self.event_source(), ())
        self._pending.append(ticket)
        return ticket

    def _issue_mapped(self, ticket: CopyTicket, dst: torch.Tensor | ChunkedRows, dst_rows: torch.Tensor,
                      mapped: MappedRows,
                      src_rows: torch.Tensor) -> None:
        """``dst[dst_rows] = mapped.gather(src_rows)``: deferred on CPU, on the copy stream on CUDA."""
        self.mapped_copies += 1
        if not self.is_cuda:
            ticket._run = lambda: dst.index_copy_(0, dst_rows, mapped.gather(src_rows))
            return
        stream = self._stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self._record_on_copy_stream(dst, dst_rows, src_rows, mapped.first_row)
        with torch.cuda.stream(stream):
            rows = mapped.gather(src_rows)  # the gather kernel reads the pinned host rows directly
            dst.index_copy_(0, dst_rows, rows)
            event = torch.cuda.Event()
            event.record(stream)
        ticket._event = (event, (rows, mapped, src_rows, dst, dst_rows))

    def _issue_cuda(
        self, ticket: CopyTicket, dst: torch.Tensor | ChunkedRows, dst_rows: torch.Tensor,
        src: torch.Tensor | ChunkedRows, src_rows: torch.Tensor,
    ) -> None:
        stream = self._stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Stream safety: every tensor the copy stream touches stays referenced by the ticket until its event
        # has completed, and device tensors allocated on the current stream are recorded on the copy stream,
        # so the caching allocator cannot hand their memory to other work while the copy still reads them.
        self._record_on_copy_stream(dst, dst_rows, src, src_rows)
        with torch.cuda.stream(stream):
            if src.device.type == "cpu" and dst.device.type == "cpu":
                dst.index_copy_(0, dst_rows, src.index_select(0, src_rows))
                keep: tuple[torch.Tensor, ...] = ()
            elif src.device.type == "cpu":
                staged = src.index_select(0, src_rows).pin_memory()
                moved = staged.to(dst.device, non_blocking=True)
                dst.index_copy_(0, dst_rows, moved)
                keep = (staged, moved)
            elif dst.device.type == "cpu":
                gathered = src.index_select(0, src_rows)
                staged = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                staged.copy_(gathered, non_blocking=True)
                keep = (gathered, staged)
                ticket._finish = lambda: dst.index_copy_(0, dst_rows, staged)
            else:
                dst.index_copy_(0, dst_rows, src.index_select(0, src_rows))
                keep = ()
            event = torch.cuda.Event()
            event.record(stream)
        ticket._event = (event, (*keep, src, src_rows, dst, dst_rows))

    def _record_on_copy_stream(self, *tensors: torch.Tensor | ChunkedRows) -> None:
        assert self._stream is not None
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":  # a host store's chunks are never on CUDA
                t.record_stream(self._stream)

    def issue_gather(
        self,
        kind: str,
        dst: torch.Tensor,
        dst_rows: torch.Tensor,
        host: torch.Tensor,
        src_rows: torch.Tensor,
        launch: Callable[..., None],
        on_done: Callable[[], None] | None = None,
        watch: torch.Tensor | None = None,
    ) -> CopyTicket:
        """Issue ``dst[dst_rows[r, i]] = host[src_rows[r, i]]`` for every ``src_rows >= 0`` on the copy stream
        with ``launch(host, dst, src_rows, dst_rows, stream=…)`` (the CUDA row-copy kernel reading pinned
        ``host`` directly). ``src_rows`` / ``dst_rows`` ``[R, M]`` on the device, ``-1`` padded: the number of
        rows is counted on the device and known when the ticket is done, so issuing never waits for the host.
        ``watch`` (a small device tensor, e.g. the resolver's status column) is copied to pinned memory in the
        same stream order and exposed as ``ticket.watched`` once done. On CPU the copy is deferred as usual."""
        ticket = CopyTicket(self._next_id, kind, 0, on_done)
        self._next_id += 1
        stream = self._stream
        if stream is None:  # CPU: deferred like every CPU copy (lets tests drive this path with torch kernels)
            def run() -> None:
                launch(host, dst, src_rows, dst_rows, stream=None)
                ticket.num_rows = int((src_rows >= 0).sum())
                ticket.watched = None if watch is None else watch.clone()

            ticket._run = run
            return self._queue(ticket)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        extra = () if watch is None else (watch,)
        self._record_on_copy_stream(dst, dst_rows, src_rows, *extra)
        with torch.cuda.stream(stream):
            launch(host, dst, src_rows, dst_rows, stream=stream)
            count = torch.empty((), dtype=torch.int64, pin_memory=True)
            count.copy_((src_rows >= 0).sum(), non_blocking=True)
            watched = None
            if watch is not None:
                watched = torch.empty(watch.shape, dtype=watch.dtype, pin_memory=True)
                watched.copy_(watch, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)

        def finish() -> None:
            ticket.num_rows = int(count)
            ticket.watched = watched

        ticket._finish = finish
        ticket._event = (event, (host, dst, src_rows, dst_rows, count, *extra))
        return self._queue(ticket)

    def wait_for_read(self, ticket: CopyTicket | None) -> None:
        """Make the destination rows of ``ticket`` readable by work issued next on the current stream. CPU:
        :meth:`wait`. CUDA: the current stream waits for the ticket's event (no host synchronisation); the
        ticket completes (``on_done``) at a later ``poll`` / ``wait``."""
        if ticket is None or ticket.done:
            return
        if ticket._event is None or not self.is_cuda:
            self.wait(ticket)
            return
        torch.cuda.current_stream(self.device).wait_event(ticket._event[0])  # type: ignore[index]

    def _complete(self, ticket: CopyTicket) -> None:
        try:
            if self.fault_hook is not None:
                self.fault_hook(ticket.kind)
            if ticket._event is not None:
                ticket._event[0].synchronize()  # type: ignore[index]
            if ticket._run is not None:  # CPU: the deferred copy itself
                ticket._run()
            elif ticket._finish is not None:
                ticket._finish()
        except Exception as exc:
            ticket.error = exc
            ticket._run = ticket._event = ticket._finish = None
            self.copies_failed += 1
            raise CopyError(ticket) from exc
        ticket._run = ticket._event = ticket._finish = None
        ticket.done = True
        self.rows_copied[ticket.kind] = self.rows_copied.get(ticket.kind, 0) + ticket.num_rows
        if ticket.on_done is not None:
            ticket.on_done()

    def _ready(self, ticket: CopyTicket) -> bool:
        if ticket._event is None:
            return True  # CPU: every issued copy completes at the next poll
        return bool(ticket._event[0].query())  # type: ignore[index]

    def poll(self) -> int:
        """Complete the copies that are ready, oldest first (on CPU: all of them); in agreed mode exactly the copies
        issued before the previous poll (module docstring). Returns how many."""
        count = 0
        if self.agreed:
            cut, self._cut = self._cut, self._next_id
            while self._pending and self._pending[0].ticket_id < cut:
                ticket = self._pending.popleft()
                if not self._ready(ticket):
                    self.agreed_stalls += 1
                self._complete(ticket)
                count += 1
            return count
        while self._pending and self._ready(self._pending[0]):
            self._complete(self._pending.popleft())
            count += 1
        return count

    def wait(self, ticket: CopyTicket | None) -> None:
        """Block until ``ticket`` is done; every copy issued before it completes as well. Raises
        :class:`CopyError` if a copy completed here fails, or if ``ticket`` has failed before."""
        while ticket is not None and not ticket.done:
            if ticket.error is not None:
                raise CopyError(ticket)
            self._complete(self._pending.popleft())

    def wait_all(self) -> None:
        while self._pending:
            self._complete(self._pending.popleft())


def _to_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``index`` on ``device``; a host index bound for CUDA goes through pinned memory, so the copy does not wait
    for the device's queued work."""
    if index.device == device:
        return index
    if index.device.type == "cpu" and device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def _mapped_view(src: torch.Tensor | ChunkedRows, dst: torch.Tensor | ChunkedRows) -> MappedRows | None:
    """The host store's view on the destination's device when ``src`` is the host store and ``dst`` is not."""
    if not isinstance(src, ChunkedRows) or isinstance(dst, ChunkedRows):
        return None
    return src.mapped(dst.device)


class ReaderFence:
    """Counts reader epochs: ``begin()`` when a step's reads are issued, ``end()`` after its last read; ``tick()`` at
    each step boundary (the store's ``poll``), which only agreed mode uses (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self.device = device
        self.issued = 0
        self.completed = 0
        self.agreed = False
        self.agreed_stalls = 0  # agreed mode: epochs completed by waiting on an event that had not fired yet
        self.event_source: Callable[[], object] | None = None  # tests: stand-in events on CPU (module docstring)
        self._events: deque[tuple[int, object]] = deque()
        self._ended = 0  # the last epoch whose end() was called
        self._ended_at_tick = 0  # ``_ended`` at the last tick
        self._cut = 0  # agreed mode: epochs up to this count as complete (ended before the previous tick)

    @property
    def in_flight(self) -> bool:
        return self.completed < self.issued

    def begin(self) -> int:
        self.issued += 1
        return self.issued

    def end(self) -> None:
        """The current epoch's reads are all issued. On CPU they are also finished (reads are synchronous)."""
        self._ended = self.issued
        if self.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events.append((self.issued, event))
        elif self.event_source is not None:  # a stand-in event (tests)
            self._events.append((self.issued, self.event_source()))
        else:
            self.completed = self.issued

    def tick(self) -> None:
        """A step boundary: in agreed mode the epochs ended before the previous boundary now count as complete."""
        self._cut, self._ended_at_tick = self._ended_at_tick, self._ended

    def poll(self) -> None:
        if self.agreed:
            while self._events and self._events[0][0] <= self._cut:
                epoch, event = self._events.popleft()
                if not event.query():  # type: ignore[attr-defined]
                    self.agreed_stalls += 1
                event.synchronize()  # type: ignore[attr-defined]
                self.completed = epoch
            return
        while self._events and self._events[0][1].query():  # type: ignore[attr-defined]
            self.completed = self._events.popleft()[0]

    def finished(self, epoch: int) -> bool:
        """Whether every reader of epochs ``<= epoch`` has finished."""
        self.poll()
        return self.completed >= epoch

    def wait(self, epoch: int) -> None:
        while self.completed < epoch and self._events:
            epoch_done, event = self._events.popleft()
            event.synchronize()  # type: ignore[attr-defined]
            self.completed = epoch_done

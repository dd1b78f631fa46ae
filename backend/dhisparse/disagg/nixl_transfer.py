"""The two ends of a history transfer over NIXL (UCX backend; host memory here, VRAM where a GPU exists).

- :class:`NixlExporter` (prefill side) registers each prompt's region with its agent and holds it until
  the decode side's READ completes: NIXL delivers the READ's notification message (the request key) to
  this agent (``get_new_notifs``), and :meth:`NixlExporter.poll` then deregisters and frees the region.
  A region whose request was cancelled before the pull is freed at once by :meth:`NixlExporter.cancel` (the
  context model's ``cancel_request_id`` control request, sent by the orchestrator), or by a NIXL notification the
  decode side sends without reading (:meth:`NixlImporter.release_remote`). A region nobody reads or cancels is
  freed after ``hold_timeout_s`` (decode side gone).
- :class:`NixlImporter` (decode side) loads the exporter's agent metadata (shipped inside the context
  phase params: ``get_partial_agent_metadata`` / ``add_remote_agent``), keeps the host store's chunks
  registered (they never move) and registers a buffer per READ for the metadata part; one READ per request,
  with the request key as notification, posted and then polled (the decode engine steps other requests
  meanwhile) until it is done, failed, or ``timeout_s`` has passed.
- Several readers of one region (the tensor-parallel ranks of a generation engine each READ the same history): each
  reader's importer is told its place (``reader`` of ``readers``) and notifies with the request key plus
  :func:`reader_mark`; the exporter frees the region once every reader's notification arrived (a plain key, sent by
  a single reader or by :meth:`NixlImporter.release_remote`, frees it at once).

Failures raise :class:`TransferError` with the reason; nothing stays registered for a failed READ on the
decode side, and the exporter frees its region on the notification or the deadline, whichever first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dhisparse.disagg.arena import ArenaRanges
from dhisparse.disagg.params import ContextPhaseParams
from dhisparse.errors import DHiSparseError


class TransferError(DHiSparseError):
    """A history transfer failed or timed out; the message says which request and why."""


READER_MARK = "\x1freader="  # separates a request key from "<reader>/<readers>" in a READ's notification


def reader_mark(reader: int, readers: int) -> str:
    """The suffix one of several readers of a region adds to the request key in its READ's notification."""
    return f"{READER_MARK}{reader}/{readers}"


def parse_notification(message: str) -> tuple[str, int, int]:
    """``(request key, reader, readers)`` of a READ's notification (``(key, 0, 1)`` for a plain key)."""
    key, mark, part = message.rpartition(READER_MARK)
    if mark:
        reader, _, readers = part.partition("/")
        if reader.isdigit() and readers.isdigit() and int(reader) < int(readers):
            return key, int(reader), int(readers)
    return message, 0, 1


def _nixl() -> Any:
    try:
        from nixl import _api
    except ImportError as error:  # pragma: no cover - nixl is a declared dependency
        raise TransferError("disaggregated serving needs NIXL: pip install nixl==1.5.1 (see README)") from error
    return _api


def _agent(name: str) -> Any:
    api = _nixl()
    config = api.nixl_agent_config(backends=["UCX"])
    return api.nixl_agent(name, config)


class NixlExporter:
    """Prefill side: publish regions, free them on the consumer's notification or after ``hold_timeout_s``.

    Regions are carved out of arenas registered once (``arena_bytes`` each; a region larger than every free
    range gets a new arena of at least twice its size, within ``arena_limit_bytes`` in all: a region that cannot
    be placed then raises :class:`TransferError` and that prefill fails; arenas are never freed while the agent
    lives, because a peer may still hold their registration)."""

    def __init__(self, name: str, hold_timeout_s: float = 60.0, arena_bytes: int = 64 << 20,
                 arena_limit_bytes: int = 1 << 30) -> None:
        self.name = name
        self.hold_timeout_s = hold_timeout_s
        self.arena_bytes = min(arena_bytes, arena_limit_bytes)
        self.arena_limit_bytes = arena_limit_bytes
        self.agent = _agent(name)
        self._arenas: list[tuple[torch.Tensor, Any, bytes, ArenaRanges]] = []  # buffer, registration, metadata
        self._held: dict[str, tuple[int, int, int, float]] = {}  # key -> (arena, offset, bytes, deadline)
        self._readers_done: dict[str, set[int]] = {}  # key -> readers whose READ completed (several readers)
        self.counters = {"regions_published": 0.0, "regions_released": 0.0, "regions_expired": 0.0,
                         "regions_cancelled": 0.0, "bytes_published": 0.0}

    def _new_arena(self, nbytes: int) -> int:
        registered = sum(arena[0].numel() for arena in self._arenas)
        size = min(max(self.arena_bytes, 2 * nbytes), self.arena_limit_bytes - registered)
        if size < nbytes:
            raise TransferError(f"the context side holds {self.stats()['bytes_held']:.0f} bytes for transfer and its "
                                f"arenas reached arena_limit_bytes = {self.arena_limit_bytes}: a {nbytes}-byte history "
                                "does not fit now (retry later, or raise --nixl-arena-limit)")
        buffer = torch.zeros(size, dtype=torch.uint8)
        registration = self.agent.register_memory(buffer)
        if not registration:
            raise TransferError("could not register a transfer arena with NIXL")
        metadata = self.agent.get_partial_agent_metadata(registration, True, ["UCX"])
        self._arenas.append((buffer, registration, metadata, ArenaRanges(buffer.numel())))
        return len(self._arenas) - 1

    def publish(self, key: str, nbytes: int) -> tuple[torch.Tensor, bytes]:
        """Reserve a region of ``nbytes`` under ``key``: returns the writable uint8 view (fill it before handing
        out the params) and the agent's partial metadata of its arena (connection info + the arena's
        registration, ``get_partial_agent_metadata``)."""
        if key in self._held:
            raise ValueError(f"region {key!r} is already published")
        placed = None
        for i, arena in enumerate(self._arenas):
            offset = arena[3].allocate(nbytes)
            if offset is not None:
                placed = (i, offset)
                break
        if placed is None:
            i = self._new_arena(nbytes)
            placed = (i, self._arenas[i][3].allocate(nbytes))
        index, offset = placed
        assert offset is not None
        buffer, _, metadata, _ = self._arenas[index]
        self._held[key] = (index, offset, nbytes, time.monotonic() + self.hold_timeout_s)
        self.counters["regions_published"] += 1
        self.counters["bytes_published"] += nbytes
        return buffer[offset : offset + nbytes], metadata

    def poll(self) -> list[str]:
        """Release regions whose READ completed (notification; with several readers, every reader's) or whose
        deadline passed; returns the keys."""
        released = []
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                key, reader, readers = parse_notification(message.decode(errors="replace"))
                if readers > 1 and key in self._held:
                    done = self._readers_done.setdefault(key, set())
                    done.add(reader)
                    if len(done) < readers:
                        continue
                if self._release(key):
                    self.counters["regions_released"] += 1
                    released.append(key)
        now = time.monotonic()
        for key in [k for k, (_, _, _, deadline) in self._held.items() if deadline <= now]:
            self._release(key)
            self.counters["regions_expired"] += 1
            released.append(key)
        return released

    def cancel(self, suffix: str) -> list[str]:
        """Free at once the held regions whose key ends with ``/suffix`` (the request was cancelled before the
        generation side pulled it); returns their keys. Counted as ``regions_cancelled``."""
        keys = [key for key in self._held if key.endswith(f"/{suffix}")]
        for key in keys:
            self._release(key)
            self.counters["regions_cancelled"] += 1
        return keys

    def _release(self, key: str) -> bool:
        self._readers_done.pop(key, None)
        held = self._held.pop(key, None)
        if held is None:
            return False
        index, offset, nbytes, _ = held
        self._arenas[index][3].free(offset, nbytes)
        return True

    @property
    def held_keys(self) -> list[str]:
        return list(self._held)

    def stats(self) -> dict[str, float]:
        return {**self.counters, "regions_held": float(len(self._held)),
                "regions_partly_read": float(len(self._readers_done)),  # several readers, not all done yet
                "bytes_held": float(sum(n for _, _, n, _ in self._held.values())),
                "arena_bytes": float(sum(b.numel() for b, _, _, _ in self._arenas))}

    def close(self) -> None:
        for key in list(self._held):
            self._release(key)
        for _, registration, _, _ in self._arenas:
            self.agent.deregister_memory(registration)
        self._arenas.clear()


@dataclass
class PendingRead:
    """A READ in flight: its NIXL handle (None: it never started), the local buffers it writes, and its deadline."""

    context: ContextPhaseParams
    handle: Any
    deadline: float
    started: float
    buffers: list[torch.Tensor]  # per-transfer buffers (registered for this READ only)
    finished: bool = False  # NixlImporter.finish ran


class NixlImporter:
    """Decode side: READ regions of remote exporters into registered local memory (see module docstring).

    A READ is posted (:meth:`post`), polled (:meth:`check`) and finished (:meth:`finish`), so the decode engine
    can keep stepping other requests while it is in flight; :meth:`read` does the three in one call. Persistent
    memory (the host store's chunks, which never move) is registered once and stays registered; per-transfer
    buffers (:meth:`buffer`) are registered for one READ and deregistered when it is finished. ``reader`` of
    ``readers``: this importer's place among the importers that READ every region (tensor-parallel ranks)."""

    def __init__(self, name: str, timeout_s: float = 30.0, reader: int = 0, readers: int = 1) -> None:
        if not 0 <= reader < readers:
            raise ValueError(f"reader {reader} must lie in [0, readers = {readers})")
        self.name = name
        self.timeout_s = timeout_s
        self.mark = reader_mark(reader, readers) if readers > 1 else ""
        self.agent = _agent(name)
        self._remotes: dict[str, set[bytes]] = {}  # agent name -> the (partial) metadata loaded for it
        self._registered: dict[int, tuple[torch.Tensor, Any]] = {}  # data_ptr -> (tensor, registration)
        self._in_flight: dict[str, int] = {}  # agent name -> READs posted and not finished

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A fresh uint8 buffer of ``nbytes`` for one READ (registered when posted, deregistered by finish)."""
        return torch.zeros(max(nbytes, 1), dtype=torch.uint8)[:nbytes]

    @staticmethod
    def _base(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor._base is None else tensor._base

    def _register(self, tensors: list[torch.Tensor]) -> None:
        """Register the storage behind each tensor once (no-op for storage already registered)."""
        for tensor in tensors:
            base = self._base(tensor)
            known = self._registered.get(base.data_ptr())
            if known is not None and known[0] is base:
                continue
            if known is not None:  # the storage at this address was replaced
                self.agent.deregister_memory(self._registered.pop(base.data_ptr())[1])
            registration = self.agent.register_memory(base)
            if not registration:
                raise TransferError("could not register decode-side memory with NIXL")
            self._registered[base.data_ptr()] = (base, registration)

    def _deregister(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            known = self._registered.get(self._base(tensor).data_ptr())
            if known is not None and known[0] is self._base(tensor):
                self.agent.deregister_memory(self._registered.pop(self._base(tensor).data_ptr())[1])

    def _remote(self, context: ContextPhaseParams) -> str:
        """Load the exporter's partial metadata of the region's arena once (NIXL merges partial metadata into
        what it knows of that agent: connection info on first use, then each arena's registration)."""
        if not context.agent_metadata:
            raise TransferError(f"context_phase_params of {context.request_key!r} carry no NIXL agent metadata")
        if context.agent_metadata in self._remotes.get(context.agent_name, ()):
            return context.agent_name
        name = self.agent.add_remote_agent(context.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != context.agent_name:
            raise TransferError(f"NIXL metadata names agent {name!r}, the params say {context.agent_name!r}")
        self._remotes.setdefault(name, set()).add(context.agent_metadata)
        return name

    def post(self, context: ContextPhaseParams, persistent: list[torch.Tensor], buffers: list[torch.Tensor],
             local_addrs: np.ndarray, remote_offsets: np.ndarray, lengths: np.ndarray) -> PendingRead:
        """Start a READ of ``lengths[i]`` bytes at region offset ``remote_offsets[i]`` into local address
        ``local_addrs[i]`` (inside ``persistent`` or ``buffers``, which get registered), notifying the exporter
        with the request key when done. Raises TransferError when NIXL refuses it (nothing stays posted)."""
        if np.any(remote_offsets + lengths > context.layout.total_bytes) or np.any(remote_offsets < 0):
            raise TransferError(f"transfer of {context.request_key!r}: a descriptor lies outside the region")
        started = time.monotonic()
        try:
            self._register([*persistent, *buffers])
            remote_name = self._remote(context)
            count = len(lengths)
            zeros = np.zeros(count, dtype=np.int64)
            local = self.agent.get_xfer_descs(np.stack([local_addrs.astype(np.int64), lengths.astype(np.int64),
                                                        zeros], axis=1), "DRAM")
            remote = self.agent.get_xfer_descs(np.stack([(remote_offsets + context.region_addr).astype(np.int64),
                                                         lengths.astype(np.int64), zeros], axis=1), "DRAM")
            handle = self.agent.initialize_xfer("READ", local, remote, remote_name,
                                                (context.request_key + self.mark).encode())
        except TransferError:
            self._deregister(buffers)
            raise
        except Exception as error:
            self._deregister(buffers)
            # This READ's descriptors were refused. Reload the agent's metadata next time (it may be stale), unless
            # other READs from it are in flight: dropping the agent would make NIXL fail them too ("remote agent
            # was invalidated"), and a failed READ notifies nobody.
            if not self._in_flight.get(context.agent_name):
                self._drop_remote(context.agent_name)
            raise TransferError(f"transfer of {context.request_key!r} could not start: {error}") from error
        pending = PendingRead(context, handle, started + self.timeout_s, started, list(buffers))
        self._in_flight[context.agent_name] = self._in_flight.get(context.agent_name, 0) + 1
        try:
            state = self.agent.transfer(handle)
        except Exception as error:
            self.finish(pending)
            self._drop_remote(context.agent_name)
            raise TransferError(f"transfer of {context.request_key!r} from {context.agent_name!r} failed: "
                                f"{error}") from error
        if state not in ("PROC", "DONE"):
            self.finish(pending)
            self._drop_remote(context.agent_name)
            raise TransferError(f"transfer of {context.request_key!r} from {context.agent_name!r} failed "
                                f"(NIXL state {state})")
        return pending

    def check(self, pending: PendingRead) -> bool:
        """True once the READ is done; False while in flight. Raises TransferError when it failed or its deadline
        passed (call :meth:`finish` either way)."""
        context = pending.context
        try:
            state = self.agent.check_xfer_state(pending.handle)
        except Exception as error:
            self._drop_remote(context.agent_name)
            raise TransferError(f"transfer of {context.request_key!r} from {context.agent_name!r} failed: "
                                f"{error}") from error
        if state == "DONE":
            return True
        if state != "PROC":
            self._drop_remote(context.agent_name)
            raise TransferError(f"transfer of {context.request_key!r} from {context.agent_name!r} failed "
                                f"(NIXL state {state})")
        if time.monotonic() > pending.deadline:
            self._drop_remote(context.agent_name)
            raise TransferError(f"transfer of {context.request_key!r} from {context.agent_name!r} timed out "
                                f"after {self.timeout_s:g} s")
        return False

    def finish(self, pending: PendingRead) -> None:
        """Release the READ's handle and its per-transfer buffers' registrations (their content stays readable)."""
        if not pending.finished:
            pending.finished = True
            self._in_flight[pending.context.agent_name] -= 1
        if pending.handle is not None:  # None: a READ that never started (imports.py, tensor-parallel ranks)
            try:
                self.agent.release_xfer_handle(pending.handle)
            except Exception:
                pass  # a failed transfer's handle may already be gone; nothing else to free
        self._deregister(pending.buffers)

    def read(self, context: ContextPhaseParams, persistent: list[torch.Tensor], buffers: list[torch.Tensor],
             local_addrs: np.ndarray, remote_offsets: np.ndarray, lengths: np.ndarray) -> None:
        """:meth:`post`, wait until done (or failed, or timed out), :meth:`finish`."""
        pending = self.post(context, persistent, buffers, local_addrs, remote_offsets, lengths)
        try:
            while not self.check(pending):
                time.sleep(0.0002)
        finally:
            self.finish(pending)

    def _drop_remote(self, name: str) -> None:
        if self._remotes.pop(name, None) is not None:
            try:
                self.agent.remove_remote_agent(name)
            except Exception:
                pass  # already unusable; the next request reloads its metadata

    def release_remote(self, context: ContextPhaseParams) -> None:
        """Tell the exporter it may free a region that will never be read (cancelled before admission)."""
        try:
            remote_name = self._remote(context)
            self.agent.send_notif(remote_name, context.request_key.encode())
        except Exception:
            pass  # the exporter frees it at its hold deadline anyway

    def close(self) -> None:
        for ptr in list(self._registered):
            self.agent.deregister_memory(self._registered.pop(ptr)[1])

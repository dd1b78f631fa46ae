"""The two ends of a history transfer over NIXL (UCX backend; host memory here, VRAM where a GPU exists).

- :class:`NixlExporter` (prefill side) registers each prompt's region with its agent and holds it until
  the decode side's READ completes: NIXL delivers the READ's notification message (the request key) to
  this agent (``get_new_notifs``), and :meth:`NixlExporter.poll` then deregisters and frees the region.
  A region whose request was cancelled before the pull is freed at once by :meth:`NixlExporter.cancel` (the
  context model's ``cancel_request_id`` control request, sent by the orchestrator), or by a NIXL notification the
  decode side sends without reading (:meth:`NixlImporter.release_remote`). A region nobody reads or cancels is
  freed after ``hold_timeout_s`` (decode side gone).
- :class:`NixlImporter` (decode side) loads the exporter's agent metadata (shipped inside the context
  phase params: ``get_partial_agent_metadata`` / ``add_remote_agent``), keeps the host store and a scratch
  buffer registered (re-registering when the host store grows), and performs one READ per request with
  the request key as notification, waiting until it is done, failed, or ``timeout_s`` has passed.

Failures raise :class:`TransferError` with the reason; nothing stays registered for a failed READ on the
decode side, and the exporter frees its region on the notification or the deadline, whichever first.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from dhisparse.disagg.arena import ArenaRanges
from dhisparse.disagg.params import ContextPhaseParams
from dhisparse.errors import DHiSparseError


class TransferError(DHiSparseError):
    """A history transfer failed or timed out; the message says which request and why."""


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
    range gets a new arena of at least twice its size)."""

    def __init__(self, name: str, hold_timeout_s: float = 60.0, arena_bytes: int = 64 << 20) -> None:
        self.name = name
        self.hold_timeout_s = hold_timeout_s
        self.arena_bytes = arena_bytes
        self.agent = _agent(name)
        self._arenas: list[tuple[torch.Tensor, Any, bytes, ArenaRanges]] = []  # buffer, registration, metadata
        self._held: dict[str, tuple[int, int, int, float]] = {}  # key -> (arena, offset, bytes, deadline)
        self.counters = {"regions_published": 0.0, "regions_released": 0.0, "regions_expired": 0.0,
                         "regions_cancelled": 0.0, "bytes_published": 0.0}

    def _new_arena(self, nbytes: int) -> int:
        buffer = torch.zeros(max(self.arena_bytes, 2 * nbytes), dtype=torch.uint8)
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
        """Release regions whose READ completed (notification) or whose deadline passed; returns the keys."""
        released = []
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                key = message.decode(errors="replace")
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
                "bytes_held": float(sum(n for _, _, n, _ in self._held.values())),
                "arena_bytes": float(sum(b.numel() for b, _, _, _ in self._arenas))}

    def close(self) -> None:
        for key in list(self._held):
            self._release(key)
        for _, registration, _, _ in self._arenas:
            self.agent.deregister_memory(registration)
        self._arenas.clear()


class NixlImporter:
    """Decode side: READ regions of remote exporters into registered local memory (see module docstring)."""

    def __init__(self, name: str, timeout_s: float = 30.0) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.agent = _agent(name)
        self._remotes: dict[str, set[bytes]] = {}  # agent name -> the (partial) metadata loaded for it
        self._registered: dict[int, tuple[torch.Tensor, Any]] = {}  # data_ptr -> (tensor, registration)
        self._scratch = torch.zeros(0, dtype=torch.uint8)

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A registered uint8 buffer of at least ``nbytes`` (reused; its content lives until the next call)."""
        if self._scratch.numel() < max(nbytes, 1):
            self._scratch = torch.zeros(max(nbytes, 4096, 2 * self._scratch.numel()), dtype=torch.uint8)
        return self._scratch[:nbytes]

    def _ensure_registered(self, tensors: list[torch.Tensor]) -> None:
        """Register the storage behind each tensor once; drop registrations of storage no longer wanted (the host
        store grew, i.e. moved, or the scratch buffer was replaced)."""
        bases = {}
        for tensor in tensors:
            base = tensor if tensor._base is None else tensor._base
            bases[base.data_ptr()] = base
        for ptr in [p for p, (t, _) in self._registered.items() if bases.get(p) is not t]:
            self.agent.deregister_memory(self._registered.pop(ptr)[1])
        for ptr, base in bases.items():
            if ptr not in self._registered:
                registration = self.agent.register_memory(base)
                if not registration:
                    raise TransferError("could not register decode-side memory with NIXL")
                self._registered[ptr] = (base, registration)

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

    def read(self, context: ContextPhaseParams, tensors: list[torch.Tensor], local_addrs: np.ndarray,
             remote_offsets: np.ndarray, lengths: np.ndarray) -> None:
        """READ ``lengths[i]`` bytes at region offset ``remote_offsets[i]`` into local address ``local_addrs[i]``
        (inside ``tensors``, which get registered), notifying the exporter with the request key when done."""
        if np.any(remote_offsets + lengths > context.layout.total_bytes) or np.any(remote_offsets < 0):
            raise TransferError(f"transfer of {context.request_key!r}: a descriptor lies outside the region")
        try:
            self._ensure_registered(tensors)
            remote_name = self._remote(context)
            count = len(lengths)
            zeros = np.zeros(count, dtype=np.int64)
            local = self.agent.get_xfer_descs(np.stack([local_addrs.astype(np.int64), lengths.astype(np.int64),
                                                        zeros], axis=1), "DRAM")
            remote = self.agent.get_xfer_descs(np.stack([(remote_offsets + context.region_addr).astype(np.int64),
                                                         lengths.astype(np.int64), zeros], axis=1), "DRAM")
            handle = self.agent.initialize_xfer("READ", local, remote, remote_name, context.request_key.encode())
        except TransferError:
            raise
        except Exception as error:
            self._drop_remote(context.agent_name)
            raise TransferError(f"transfer of {context.request_key!r} could not start: {error}") from error
        try:
            self._wait(context, handle)
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:
                pass  # a failed transfer's handle may already be gone; nothing else to free

    def _wait(self, context: ContextPhaseParams, handle: Any) -> None:
        deadline = time.monotonic() + self.timeout_s
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"transfer of {context.request_key!r} from {context.agent_name!r} timed out "
                                        f"after {self.timeout_s:g} s")
                time.sleep(0.0002)
                state = self.agent.check_xfer_state(handle)
        except TransferError:
            self._drop_remote(context.agent_name)
            raise
        except Exception as error:
            self._drop_remote(context.agent_name)
            raise TransferError(f"transfer of {context.request_key!r} from {context.agent_name!r} failed: "
                                f"{error}") from error
        if state != "DONE":
            self._drop_remote(context.agent_name)
            raise TransferError(f"transfer of {context.request_key!r} from {context.agent_name!r} failed "
                                f"(NIXL state {state})")

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

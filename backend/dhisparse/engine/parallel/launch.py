"""Start and supervise the ranks of one engine on this host (``torch.multiprocessing``, forkserver).

Rendezvous: ``MASTER_ADDR`` / ``MASTER_PORT`` when set (ranks on several hosts; docs/parallel.md has the recipe),
otherwise loopback and a free port. ``DHISPARSE_LOCAL_RANKS`` names the ranks this host starts (``"0-3"``,
``"0,1"``; default every rank); rank 0 always runs here, beside the driver. The other hosts start theirs with
``dhisparse-rank`` (``engine/parallel/remote.py``) and the usual ``WORLD_SIZE`` / ``RANK`` variables.

:class:`RankProcesses` owns the local processes: it reports a rank that failed (the error queue, a process that
exited) and kills every local rank when the engine stops, so none is left waiting in a collective.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import sys
import time
from typing import Any

import torch.multiprocessing as mp

from dhisparse.engine.parallel.rank import FATAL_EXIT, Channel, RankLaunch, spawned_rank
from dhisparse.errors import ConfigError

PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "collectives are broken")


class RankFailure(RuntimeError):
    """A rank failed, exited, or did not answer in time: the engine stops."""


def parse_ranks(text: str, world: int) -> tuple[int, ...]:
    """``"0-3"`` / ``"0,2,5"`` / ``"0-1,4"`` → sorted ranks, each in ``[0, world)``; rank 0 must be among them."""
    ranks: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError as exc:
            raise ConfigError(f"DHISPARSE_LOCAL_RANKS: cannot read {part!r} (expected e.g. '0-3' or '0,1')") from exc
        ranks.update(range(first, last + 1))
    if not ranks or min(ranks) < 0 or max(ranks) >= world or 0 not in ranks:
        raise ConfigError(f"DHISPARSE_LOCAL_RANKS {text!r}: ranks must lie in [0, {world}) and include rank 0 "
                          "(it runs beside the engine)")
    return tuple(sorted(ranks))


def rendezvous(world: int) -> tuple[str, int, tuple[int, ...]]:
    """``(address, port, local ranks)`` from the environment, or loopback with a free port and every rank local."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    local = parse_ranks(os.environ.get("DHISPARSE_LOCAL_RANKS", f"0-{world - 1}"), world)
    if addr and port:
        return addr, int(port), local
    if len(local) != world:
        raise ConfigError("DHISPARSE_LOCAL_RANKS leaves ranks to other hosts: set MASTER_ADDR and MASTER_PORT to an "
                          "address those hosts reach")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1", s.getsockname()[1], local


def python_executable() -> str:
    """The interpreter rank processes start with (inside Triton's Python backend ``sys.executable`` is the stub)."""
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    return shutil.which("python3") or shutil.which("python") or sys.executable


class RankProcesses:
    """The ranks started on this host; rank 0 is the driver's link (``request`` / ``wait``)."""

    def __init__(self, launch: RankLaunch) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_executable(python_executable())
        # Ranks fork from a server process that imported the runtime once (the first engine of a process pays
        # torch's import, later ones start in about a second); nothing of the caller's process is inherited.
        ctx.set_forkserver_preload(["dhisparse.engine.parallel.rank"])
        world = launch.shape.world_size
        self.errors: Any = ctx.Queue()
        self.to_rank0: Any = ctx.Queue()
        self.from_rank0: Any = ctx.Queue()
        self.processes: dict[int, Any] = {}
        for index, rank in enumerate(launch.local_ranks):
            channel = Channel(errors=self.errors, parent_pid=os.getpid())
            if rank == 0:
                channel = Channel(self.to_rank0, self.from_rank0, self.errors, os.getpid())
            proc = ctx.Process(target=spawned_rank, args=(rank, world, launch, channel, index),
                               name=f"dhisparse-rank-{rank}", daemon=True)
            proc.start()
            self.processes[rank] = proc

    def send(self, message: object) -> None:
        self.to_rank0.put(message)

    def wait(self, timeout_s: float) -> Any:
        """Rank 0's next message; raises :class:`RankFailure` as soon as a local rank reports a failure or exits, or
        when ``timeout_s`` passes."""
        end = time.monotonic() + timeout_s
        while True:
            try:
                return self.from_rank0.get(timeout=0.02)
            except queue.Empty:
                pass
            self.check()
            if time.monotonic() > end:
                raise RankFailure(f"the ranks did not answer within {timeout_s:.0f} s")

    def check(self) -> None:
        """Raise :class:`RankFailure` if a local rank reported a failure or exited. When several did (one rank's
        failure breaks its peers' collectives), the message names the cause, not its echoes: a rank that died on
        its own (a signal, an unexpected exit code) first, then a failure that is not a lost peer connection."""
        reports = self._drain_errors()
        exited = {rank: proc.exitcode for rank, proc in self.processes.items() if not proc.is_alive()}
        if not reports and not exited:
            return
        time.sleep(0.1)  # the other ranks' reports of the same failure arrive within moments
        reports += self._drain_errors()
        exited = {rank: proc.exitcode for rank, proc in self.processes.items() if not proc.is_alive()}
        reported = {rank for rank, _ in reports}
        for rank, code in sorted(exited.items()):
            if code != FATAL_EXIT and rank not in reported:
                how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
                raise RankFailure(f"rank {rank} (pid {self.processes[rank].pid}) {how}")
        causes = [m for _, m in reports if not any(s in m for s in PEER_LOST)] or [m for _, m in reports]
        raise RankFailure(causes[0] if causes else f"rank {min(exited)} exited with code {exited[min(exited)]}")

    def _drain_errors(self) -> list[tuple[int, str]]:
        out = []
        while True:
            try:
                rank, message, _ = self.errors.get_nowait()
            except queue.Empty:
                return out
            out.append((rank, message if message.startswith("rank") else f"rank {rank}: {message}"))

    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self.processes.items()}

    def kill(self) -> None:
        """End every local rank now (none may be left waiting in a collective)."""
        for proc in self.processes.values():
            if proc.is_alive():
                proc.kill()
        for proc in self.processes.values():
            proc.join(5.0)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Let the ranks leave cleanly after a ``Shutdown`` was sent; kill what remains after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        for proc in self.processes.values():
            proc.join(max(0.0, end - time.monotonic()))
        self.kill()

"""Start and supervise the ranks of one engine on this host: one ``python -m dhisparse.engine.parallel.process``
process per rank, each connected back to the driver over ``multiprocessing.connection`` (loopback, authenticated).

Plain processes rather than ``multiprocessing``'s start methods: they work wherever the engine is embedded (Triton's
Python backend stub runs an interpreter whose ``multiprocessing`` resource tracker fails), inherit nothing of the
caller's process, and never import the caller's ``__main__``.

Rendezvous: ``MASTER_ADDR`` / ``MASTER_PORT`` when set (ranks on several hosts; docs/parallel.md has the recipe),
otherwise loopback and a free port. ``DHISPARSE_LOCAL_RANKS`` names the ranks this host starts (``"0-3"``,
``"0,1"``; default every rank); rank 0 always runs here, beside the driver. The other hosts start theirs with
``dhisparse-rank`` (``engine/parallel/remote.py``) and the usual ``WORLD_SIZE`` / ``RANK`` variables.

:class:`RankProcesses` owns the local processes: it reports a rank that failed (its error report, a process that
exited) and kills every local rank when the engine stops, so none is left waiting in a collective.
"""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any

import dhisparse
from dhisparse.engine.parallel.rank import FATAL_EXIT, RankLaunch
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


def rank_environment(threads: int) -> dict[str, str]:
    """The rank processes' environment: this one, this ``dhisparse`` first on the path, ``threads`` intra-op
    threads (0: unchanged)."""
    env = dict(os.environ)
    package_root = str(Path(dhisparse.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH", "")]))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


class RankProcesses:
    """The ranks started on this host; rank 0 is the driver's link (:meth:`send` / :meth:`wait`)."""

    def __init__(self, launch: RankLaunch, connect_timeout_s: float = 600.0) -> None:
        world = launch.shape.world_size
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self._listener.address
        env = {**rank_environment(launch.threads), "DHISPARSE_DRIVER_AUTHKEY": authkey.hex()}
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.links: dict[int, Connection] = {}
        self._reports: list[tuple[int, str]] = []
        accepted: queue.Queue[Connection | BaseException] = queue.Queue()

        def accept() -> None:
            for _ in launch.local_ranks:
                try:
                    accepted.put(self._listener.accept())
                except BaseException as exc:  # the listener closed (the engine gave up) or a bad client
                    accepted.put(exc)
                    return

        threading.Thread(target=accept, name="dhisparse-rank-accept", daemon=True).start()
        for index, rank in enumerate(launch.local_ranks):
            self.processes[rank] = subprocess.Popen(
                [python_executable(), "-m", "dhisparse.engine.parallel.process", "--rank", str(rank), "--world",
                 str(world), "--local-index", str(index), "--driver", f"{host}:{port}"],
                env=env, stdin=subprocess.DEVNULL)
        end = time.monotonic() + connect_timeout_s
        try:
            while len(self.links) < len(launch.local_ranks):
                try:
                    conn = accepted.get(timeout=0.05)
                except queue.Empty:
                    self._check_exits()
                    if time.monotonic() > end:
                        raise RankFailure(f"the ranks did not connect within {connect_timeout_s:.0f} s") from None
                    continue
                if isinstance(conn, BaseException):
                    raise RankFailure(f"a rank could not connect: {conn}")
                tag, rank, _pid = conn.recv()
                assert tag == "hello" and rank in self.processes and rank not in self.links, (tag, rank)
                self.links[rank] = conn
                conn.send(launch)
        except BaseException:
            self.kill()
            raise
        finally:
            self._listener.close()

    def send(self, message: object) -> None:
        try:
            self.links[0].send(message)
        except OSError as exc:
            self.check()
            raise RankFailure(f"rank 0 is unreachable: {exc}") from exc

    def wait(self, timeout_s: float) -> Any:
        """Rank 0's next ``ready``/``reply`` payload; raises :class:`RankFailure` as soon as a local rank reports a
        failure or exits, or when ``timeout_s`` passes."""
        end = time.monotonic() + timeout_s
        while True:
            for ready in wait(list(self.links.values()), timeout=0.05):
                rank = next(r for r, c in self.links.items() if c is ready)
                conn = self.links[rank]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    del self.links[rank]  # the rank exited; its exit code tells why
                    self.check()
                    raise RankFailure(f"rank {rank} closed its connection") from None
                if message[0] == "error":
                    self._reports.append((rank, str(message[2])))
                    self.check()
                elif rank == 0 and message[0] in ("ready", "reply"):
                    return message[1]
            self.check()
            if time.monotonic() > end:
                raise RankFailure(f"the ranks did not answer within {timeout_s:.0f} s")

    def _check_exits(self) -> None:
        if any(proc.poll() is not None for proc in self.processes.values()):
            self.check()

    def check(self) -> None:
        """Raise :class:`RankFailure` if a local rank reported a failure or exited. When several did (one rank's
        failure breaks its peers' collectives), the message names the cause, not its echoes: a rank that died on
        its own (a signal, an unexpected exit code) first, then a failure that is not a lost peer connection."""
        exited = {rank: proc.poll() for rank, proc in self.processes.items() if proc.poll() is not None}
        if not self._reports and not exited:
            return
        time.sleep(0.1)  # the other ranks' reports of the same failure arrive within moments
        for rank, conn in list(self.links.items()):
            try:
                while conn.poll():
                    message = conn.recv()
                    if message[0] == "error":
                        self._reports.append((rank, str(message[2])))
            except (EOFError, OSError):
                del self.links[rank]
        exited = {rank: proc.poll() for rank, proc in self.processes.items() if proc.poll() is not None}
        reported = {rank for rank, _ in self._reports}
        for rank, code in sorted(exited.items()):
            if code != FATAL_EXIT and rank not in reported:
                how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
                raise RankFailure(f"rank {rank} (pid {self.processes[rank].pid}) {how}")
        messages = [m for _, m in self._reports]
        causes = [m for m in messages if not any(s in m for s in PEER_LOST)] or messages
        if causes:
            raise RankFailure(causes[0])
        rank = min(exited)
        raise RankFailure(f"rank {rank} (pid {self.processes[rank].pid}) exited with code {exited[rank]}")

    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self.processes.items()}

    def kill(self) -> None:
        """End every local rank now (none may be left waiting in a collective)."""
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.processes.values():
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        for conn in self.links.values():
            conn.close()
        self.links.clear()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Let the ranks leave cleanly after a ``Shutdown`` was sent; kill what remains after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        for proc in self.processes.values():
            try:
                proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

"""Keeping one tritonserver child tied to its launcher: parent-death signal, private files, ports, shared memory.

* ``child_setup(parent_pid)`` runs in the forked child before ``exec``: ``umask 077`` (files it creates are private)
  and ``prctl(PR_SET_PDEATHSIG, SIGTERM)``: when the launcher dies (even by SIGKILL), the kernel sends tritonserver
  SIGTERM, which stops its stubs and frees its regions. The stubs watch tritonserver themselves and exit with it.
* ``ports_in_use`` finds the ports another process already listens on, so a start that cannot bind says so
  instead of probing someone else's server; ``listens`` tells whether a given process owns the listening socket
  of a port (Linux ``/proc``), so readiness is only believed from our own child.
* ``shm_regions`` / ``remove_shm_regions`` list and free the regions of one prefix (``/dev/shm``), and
  ``sweep_stale_regions`` frees those whose launcher is gone (a tritonserver that was SIGKILLed cannot).
  ``restrict_shm_regions`` makes them owner-only: the Python backend creates them with an explicit mode 0644
  (Boost.Interprocess sets it after creation, whatever the umask), so the launcher narrows them once they exist.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import signal
import socket
from collections.abc import Callable, Iterable
from pathlib import Path

PR_SET_PDEATHSIG = 1
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "dhisparse_"  # + "<launcher pid>_<grpc port>_": see TritonServer.shm_prefix

_LIBC = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None


def child_setup(parent_pid: int, death_signal: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: private umask and a parent-death signal (see module docstring).

    The child exits at once if its launcher died between ``fork`` and ``prctl`` (the signal would never come)."""

    def setup() -> None:
        os.umask(0o077)
        if _LIBC is not None:
            _LIBC.prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return setup


def _bindable(address: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # tritonserver binds with SO_REUSEADDR too: a port in TIME_WAIT is free for it, a listening one is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as error:
            if error.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
        return True


def ports_in_use(address: str, ports: Iterable[int]) -> list[int]:
    """The ports among ``ports`` that cannot be bound on ``address`` right now (someone listens there)."""
    return [port for port in ports if not _bindable(address, port)]


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes of the TCP sockets listening on ``port`` (any address), from /proc/net/tcp{,6}."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                inodes.add(inode)
    return inodes


def listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a socket listening on ``port``; None where /proc cannot tell (not Linux)."""
    inodes = _listening_inodes(port)
    fd_dir = Path(f"/proc/{pid}/fd")
    if not fd_dir.is_dir():
        return None
    try:
        links = [os.readlink(fd) for fd in fd_dir.iterdir()]
    except OSError:
        return None
    owned = {m.group(1) for link in links if (m := re.fullmatch(r"socket:\[(\d+)\]", link))}
    return bool(inodes & owned)


def shm_regions(prefix: str) -> list[Path]:
    """The shared-memory files whose name starts with ``prefix``."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


def remove_shm_regions(prefix: str) -> list[Path]:
    """Unlink every region of ``prefix``; returns what was removed."""
    removed = []
    for path in shm_regions(prefix):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def restrict_shm_regions(prefix: str) -> list[Path]:
    """chmod 0600 every region of ``prefix`` that is readable by group or others; returns what it changed."""
    changed = []
    for path in shm_regions(prefix):
        try:
            if path.stat().st_mode & 0o077:
                path.chmod(0o600)
                changed.append(path)
        except (FileNotFoundError, PermissionError):
            pass
    return changed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_regions() -> list[Path]:
    """Free the regions of launchers that no longer run (``dhisparse_<pid>_...`` with ``pid`` gone)."""
    removed = []
    for path in shm_regions(SHM_PREFIX):
        match = re.match(rf"{SHM_PREFIX}(\d+)_", path.name)
        if match and not _alive(int(match.group(1))):
            try:
                path.unlink()
                removed.append(path)
            except (FileNotFoundError, PermissionError):
                pass
    return removed


def group_processes(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in process group ``pgid`` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids

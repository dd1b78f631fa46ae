"""How much host memory the host store may have: the machine's, or its cgroup's when that is smaller.

A container's memory limit (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``, on this process's cgroup and
every ancestor) is what the kernel enforces: a host store sized from the physical memory alone would be killed long
before it is full. ``memory_limit_bytes`` is the smaller of the two; ``default_host_bytes`` half of it (the store's
capacity when none is configured); ``check_host_bytes`` refuses a configured capacity beyond it at start, naming
both figures. ``available_bytes`` (what is free now: ``MemAvailable``, and the cgroup's limit less its usage) is
reported, not enforced: host pages are allocated as requests need them, so a store may be sized for later.

Paths are parameters so tests can point them at a fake ``/proc`` and ``/sys/fs/cgroup``.
"""

from __future__ import annotations

import os
from pathlib import Path

from dhisparse.errors import ConfigError

UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge page-aligned number


def physical_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 32 << 30


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED else value


def _cgroup_dirs(proc_cgroup: Path, cgroup_root: Path) -> list[tuple[Path, str, str]]:
    """``(directory, limit file, usage file)`` of this process's memory cgroup and its ancestors, v2 then v1."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            base, limit, usage = cgroup_root, "memory.max", "memory.current"
            if not (base / "cgroup.controllers").exists():
                base = cgroup_root / "unified"
        elif "memory" in controllers.split(","):
            base, limit, usage = cgroup_root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        relative = Path(path.lstrip("/"))
        for parent in [relative, *relative.parents]:
            directory = base / parent
            if directory.is_dir():
                found.append((directory, limit, usage))
    return found


def cgroup_limit_bytes(proc_cgroup: Path = Path("/proc/self/cgroup"),
                       cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The smallest memory limit on this process's cgroup path (None: no limit)."""
    limits = [v for d, limit, _ in _cgroup_dirs(proc_cgroup, cgroup_root) if (v := _read_int(d / limit)) is not None]
    return min(limits) if limits else None


def memory_limit_bytes(proc_cgroup: Path = Path("/proc/self/cgroup"),
                       cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The physical memory, or the cgroup limit when smaller."""
    limit = cgroup_limit_bytes(proc_cgroup, cgroup_root)
    return min(physical_bytes(), limit) if limit is not None else physical_bytes()


def available_bytes(proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup"),
                    meminfo: Path = Path("/proc/meminfo")) -> int:
    """Memory free for new allocations now: ``MemAvailable``, and each limited cgroup's limit less its usage."""
    free = physical_bytes()
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for directory, limit, usage in _cgroup_dirs(proc_cgroup, cgroup_root):
        cap, used = _read_int(directory / limit), _read_int(directory / usage)
        if cap is not None and used is not None:
            free = min(free, max(0, cap - used))
    return free


def default_host_bytes() -> int:
    """The host store's capacity when none is configured: half of ``memory_limit_bytes``."""
    return memory_limit_bytes() // 2


def check_host_bytes(host_bytes: int, limit: int | None = None) -> None:
    """Refuse a host store larger than the memory this process may ever have (ConfigError naming both)."""
    limit = memory_limit_bytes() if limit is None else limit
    if host_bytes > limit:
        raise ConfigError(f"host_bytes {host_bytes} exceeds the memory this process may use ({limit} bytes: the "
                          f"machine's {physical_bytes()}, or its cgroup limit when smaller); lower host_bytes "
                          "(0: half of it)")

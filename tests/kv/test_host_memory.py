"""Host memory failures fail one request, never the engine.

* ``host_bytes`` beyond the memory this process may use is refused at start, naming it; the default and the check
  follow the cgroup limit when it is below the machine's memory (cgroup v1 and v2 trees, as the kernel lays them out).
* A chunk the OS refuses, for real (``RLIMIT_AS`` in a child process): the KV manager keeps a request waiting while
  others hold host pages and admits it once theirs come back; with none held the admission raises
  ``HostMemoryError`` with nothing taken. Through the engine: that request ends with an error naming the failure,
  and once memory is back the engine serves the next request with the reference's tokens.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kv_driver import make_layout, make_manager

from dhisparse.errors import ConfigError
from dhisparse.kv import host_memory

GIB = 1 << 30


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cgroup_v2_limit_is_the_smallest_on_the_path(tmp_path: Path) -> None:
    proc = _tree(tmp_path, {"proc/cgroup": "0::/kubepods/pod1/ctr\n"}) / "proc" / "cgroup"
    root = _tree(tmp_path / "cg", {"cgroup.controllers": "memory\n", "memory.max": "max\n",
                                   "kubepods/memory.max": str(64 * GIB), "kubepods/pod1/memory.max": str(8 * GIB),
                                   "kubepods/pod1/memory.current": str(GIB), "kubepods/pod1/ctr/memory.max": "max\n",
                                   "kubepods/pod1/ctr/memory.current": str(GIB)})
    assert host_memory.cgroup_limit_bytes(proc, root) == 8 * GIB
    assert host_memory.memory_limit_bytes(proc, root) == min(8 * GIB, host_memory.physical_bytes())
    meminfo = _tree(tmp_path, {"meminfo": f"MemAvailable: {12 * GIB // 1024} kB\n"}) / "meminfo"
    assert host_memory.available_bytes(proc, root, meminfo) == 7 * GIB  # the pod's 8 GiB less its 1 GiB in use


def test_cgroup_v1_limit_and_no_limit(tmp_path: Path) -> None:
    proc = _tree(tmp_path, {"proc/cgroup": "4:memory:/docker/abc\n0::/\n"}) / "proc" / "cgroup"
    root = _tree(tmp_path / "cg", {"memory/memory.limit_in_bytes": "9223372036854771712",
                                   "memory/docker/abc/memory.limit_in_bytes": str(2 * GIB)})
    assert host_memory.cgroup_limit_bytes(proc, root) == 2 * GIB
    unlimited = _tree(tmp_path / "cg2", {"memory/memory.limit_in_bytes": "9223372036854771712"})
    assert host_memory.cgroup_limit_bytes(proc, unlimited) is None
    assert host_memory.memory_limit_bytes(proc, unlimited) == host_memory.physical_bytes()


def test_host_bytes_beyond_the_machine_is_refused_at_start() -> None:
    layout = make_layout("glm")
    with pytest.raises(ConfigError, match=r"host_bytes 1000000000000000 exceeds the memory this process may use"):
        make_manager(layout, "hisparse", 1 << 20, host_bytes=10**15)
    with pytest.raises(ConfigError, match="host_bytes"):
        host_memory.check_host_bytes(3 * GIB, limit=2 * GIB)  # a cgroup limit of 2 GiB
    default = make_manager(layout, "hisparse", 1 << 20, host_bytes=0).host.host_bytes
    assert default == host_memory.memory_limit_bytes() // 2


def _run_child(code: str, *args: str) -> str:
    """Run ``code`` in a child (its own address-space limit); return its stdout, failing with its output."""
    tests = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                            timeout=300, env={"PYTHONPATH": f"{tests / 'kv'}:{tests}", "OMP_NUM_THREADS": "1",
                                              "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


LIMIT = '''
import re, resource
def limit_address_space(extra_bytes):
    """Soft RLIMIT_AS at the current size + extra: the next large allocation fails for real (ENOMEM)."""
    size = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + extra_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))
def unlimit():
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.getrlimit(resource.RLIMIT_AS)[1]))
'''


def test_refused_chunk_waits_while_others_hold_pages_and_fails_alone() -> None:
    out = _run_child(LIMIT + '''
import torch
torch.set_num_threads(1)
from dhisparse.kv import KVConfig, KVLayout, KVManager
from dhisparse.kv.host_store import HostMemoryError
layout = KVLayout(2, [0, 1], 4096, torch.float32, [0], 3, 4, [[0, 1]])  # 16 KiB rows: few pages per chunk
chunk = 128 << 20  # each chunk a real 128 MiB allocation
config = KVConfig(policy="hisparse", pool_bytes=1 << 24, hot_rows=8, page_rows=4, host_bytes=4 * chunk)
m = KVManager(layout, config, "cpu", host_chunk_bytes=chunk)
page_bytes = m.pool.page_bytes
tokens_per_chunk = (chunk // page_bytes // layout.num_sources) * m.config.page_rows
def tokens(fraction):  # a prompt whose host pages take this fraction of a chunk
    return int(fraction * tokens_per_chunk)
assert m.try_admit("a", tokens(0.7), 8)  # chunk 0, allocated before the limit
limit_address_space(80 << 20)  # room for bookkeeping, not for another chunk
assert not m.try_admit("b", tokens(0.5), 8)  # needs chunk 1: the OS refuses, a holds pages: b waits
m.check_invariants()
assert m.stats()["kv_requests_waiting"] == 1 and m.host.used_pages > 0 and len(m.host.rows.chunks) == 1
m.release("a"); m.poll()
assert m.try_admit("b", tokens(0.5), 8)  # a's pages came back (chunk 0): b is admitted without new memory
m.release("b"); m.poll()
try:
    m.try_admit("c", tokens(1.3), 8)  # needs more than chunk 0 with nothing held: fails, nothing taken
except HostMemoryError as error:
    print("refused:", error)
m.check_invariants()
assert m.host.used_pages == 0 and "c" not in m.requests and "c" not in m.waiting
unlimit()
assert m.try_admit("c", tokens(1.3), 8)
print("ok")
''')
    assert "refused: the host store could not allocate a chunk" in out and out.strip().endswith("ok")


def test_engine_fails_only_the_request_whose_host_memory_is_refused(tiny_engine) -> None:
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    out = _run_child(LIMIT + '''
import sys, torch
torch.set_num_threads(1)
from dhisparse import LLM, SamplingParams
from dhisparse.errors import RequestFailedError
llm = LLM(sys.argv[1], kv_policy="hisparse", host_bytes=64 << 20)  # one 64 MiB chunk, allocated at first use
reference = LLM(sys.argv[1], kv_policy="dense").generate([[3, 5, 7, 9]], SamplingParams(max_tokens=6))[0].token_ids
limit_address_space(24 << 20)
try:
    llm.generate([[3, 5, 7, 9]], SamplingParams(max_tokens=6))
except RequestFailedError as error:
    print("failed:", error.outputs[0].finish_reason, error)
unlimit()
assert llm.engine.dead is None
assert llm.generate([[3, 5, 7, 9]], SamplingParams(max_tokens=6))[0].token_ids == reference
llm.engine.kv.check_invariants()
print("ok")
''', str(engine_dir))
    assert "failed: error" in out and "HostMemoryError" in out, out
    assert out.strip().endswith("ok")

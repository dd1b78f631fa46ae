"""``dhisparse-rank``: start this host's ranks of an engine whose ranks span several hosts.

The host that serves (``dhisparse-serve`` / ``LLM``) runs rank 0 and the ranks ``DHISPARSE_LOCAL_RANKS`` names; every
other host runs ``dhisparse-rank ENGINE_DIR`` with the usual torch.distributed variables: ``MASTER_ADDR`` and
``MASTER_PORT`` (the serving host's rendezvous), ``WORLD_SIZE`` and ``RANK`` (this host's first rank; ``--nproc``
ranks from there, one device each). The ranks receive the engine's runtime options and parallel shape from rank 0;
``ENGINE_DIR`` is this host's copy of the engine directory (its ``config.json`` must match the serving host's).
The command exits 0 when the engine shuts down, and :data:`~dhisparse.engine.parallel.rank.FATAL_EXIT` when a rank
failed (its peers' collectives fail at once, or time out after the engine's ``collective_timeout_s``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from dhisparse.engine.parallel.launch import python_executable, rank_environment
from dhisparse.engine.parallel.rank import FATAL_EXIT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dhisparse-rank", description=__doc__.splitlines()[0])
    p.add_argument("engine_dir", help="this host's copy of the engine directory")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this host: RANK, RANK + 1, … (one device each)")
    args = p.parse_args(argv)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if not os.environ.get(name)]
    if missing:
        print(f"dhisparse-rank: error: set {', '.join(missing)} (torch.distributed's rendezvous)", file=sys.stderr)
        return 2
    world, first = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if not 0 < first or first + args.nproc > world:
        print(f"dhisparse-rank: error: ranks {first}..{first + args.nproc - 1} must lie in 1..{world - 1} "
              "(rank 0 runs beside the engine)", file=sys.stderr)
        return 2
    env = rank_environment(threads=0)
    procs = [subprocess.Popen([python_executable(), "-m", "dhisparse.engine.parallel.process", "--rank", str(first + i),
                               "--world", str(world), "--local-index", str(i), "--engine-dir", args.engine_dir],
                              env=env)
             for i in range(args.nproc)]
    def stop(signum: int, frame: object) -> None:  # the ranks end with this command
        for proc in procs:
            proc.terminate()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    codes = [proc.wait() for proc in procs]
    failed = [c for c in codes if c != 0]
    return FATAL_EXIT if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

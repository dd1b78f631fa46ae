"""``python -m dhisparse.engine.parallel.process``: one rank process (the engine starts one per local rank,
``dhisparse-rank`` one per rank on another host). A module of its own so that ``rank.py``'s classes keep their
names when the driver's pickled :class:`~dhisparse.engine.parallel.rank.RankLaunch` arrives."""

from __future__ import annotations

import argparse
import os
import sys
from multiprocessing.connection import Client

import torch

from dhisparse.engine.parallel.rank import Channel, RankLaunch, run_rank


def main(argv: list[str] | None = None) -> int:
    """One rank process. With ``--driver HOST:PORT`` (ranks the engine
    starts on its own host) it connects to the driver (authentication key in ``DHISPARSE_DRIVER_AUTHKEY``, hex),
    says hello and receives its :class:`RankLaunch`; without, it is a rank on another host (``dhisparse-rank``)."""
    p = argparse.ArgumentParser(prog="dhisparse-rank-process")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--local-index", type=int, default=0)
    p.add_argument("--driver", default="", metavar="HOST:PORT")
    p.add_argument("--engine-dir", default=None)
    args = p.parse_args(argv)
    channel, launch = Channel(), None
    if args.driver:
        host, _, port = args.driver.rpartition(":")
        channel.conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop("DHISPARSE_DRIVER_AUTHKEY")))
        channel.send("hello", args.rank, os.getpid())
        launch = channel.conn.recv()
        assert isinstance(launch, RankLaunch)
        if launch.threads:
            torch.set_num_threads(launch.threads)
    code = run_rank(args.rank, args.world, launch, channel, args.local_index, args.engine_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: a failed rank's threads (gloo) must not hold the process


if __name__ == "__main__":
    raise SystemExit(main())

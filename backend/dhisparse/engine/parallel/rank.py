"""One rank: a process holding its slice of the model, its own KV store and an ``LLMEngine`` over them.

Every rank runs the same engine code (scheduler, executor, KV store) on its slice: under tensor parallelism every
rank holds every request of the engine and must take the same decisions (their digests are compared every step by
the driver); under data-parallel attention each rank holds the requests of its own group. The control loop
(:func:`control_loop`) receives each command from rank 0 (which gets it from the driver), applies it to the
engine, and gathers the replies on rank 0 for the driver.

Fatal conditions — a collective failed or timed out, a forward stopped half-way (its collectives can no longer be
paired), the driver went away — end the process with :data:`FATAL_EXIT` after reporting on the error queue (local
ranks): the other ranks' collectives then fail at once (the peer's connections close) instead of waiting.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dhisparse.engine.llm_engine import LLMEngine
from dhisparse.engine.loading import load_engine_parts
from dhisparse.engine.parallel.group import CollectiveError, RankCollectives
from dhisparse.engine.parallel.imports import RankImports
from dhisparse.engine.parallel.messages import (
    Abort,
    Add,
    Command,
    Heartbeat,
    NeverAdmissible,
    Op,
    PollIdle,
    Ready,
    Reply,
    Shutdown,
    Step,
)
from dhisparse.engine.parallel.model import parallelize
from dhisparse.engine.parallel.shape import ParallelShape
from dhisparse.engine.parallel.sharding import shard_weights
from dhisparse.engine.prompts import LocalPrefill
from dhisparse.engine.request import RequestUpdate
from dhisparse.errors import EngineDeadError, InvalidRequestError
from dhisparse.kv.factory import agree_copy_completion

FATAL_EXIT = 70  # a rank that cannot go on
DRILL_ENV = "DHISPARSE_RANK_OVERRIDES"  # drills and tests only: {"<rank>": {runtime option: value}} for one rank
CONTROL_TIMEOUT_FLOOR_S = 600.0  # control collectives wait for the slowest rank's whole step or model load
# statistics that depend on the clock, not on decisions (stalls: agreed completion's waits on device events)
TIMING_STATS = ("seconds", "_s", "time", "stall")


@dataclass(frozen=True)
class RankLaunch:
    """What every rank is started with (rank 0 broadcasts it to ranks started on other hosts, which keep their own
    ``engine_dir``). ``threads``: intra-op threads per rank (0: torch's default)."""

    engine_dir: str
    overrides: dict[str, Any]
    shape: ParallelShape
    master_addr: str
    master_port: int
    timeout_s: float
    threads: int = 1
    config_digest: str = ""  # of the engine's config.json (ranks on other hosts check theirs against it)
    local_ranks: tuple[int, ...] = field(default=())
    drills: dict[str, dict[str, Any]] = field(default_factory=dict)  # DRILL_ENV of the driver: per-rank overrides
    backend: str = "gloo"  # the data collectives' backend: "nccl" when the engine's device is a GPU
    imports: RankImports | None = None  # a generation engine's source of imported prompts (None: prefill here)


def drills_from_env() -> dict[str, dict[str, Any]]:
    """The per-rank overrides of :data:`DRILL_ENV` (drills and tests only), read where the engine starts."""
    text = os.environ.get(DRILL_ENV, "")
    return json.loads(text) if text else {}


def config_digest(engine_dir: str | Path) -> str:
    return hashlib.sha256((Path(engine_dir) / "config.json").read_bytes()).hexdigest()[:16]


class RankWorker:
    """This rank's engine over its slice of the model (built in the constructor)."""

    def __init__(self, rank: int, launch: RankLaunch, local_index: int, group: Any = None) -> None:
        self.rank, self.shape = rank, launch.shape
        overrides = dict(launch.overrides)
        # Drills: one rank alone gets, e.g., a fault_injection spec (a rank that raises where the others do not).
        overrides.update(launch.drills.get(str(rank), {}))
        if launch.backend == "nccl":
            overrides["device"] = f"cuda:{local_index}"  # one device per local rank

        def shard(weights: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
            launch.shape.check_model(cfg)
            return shard_weights(weights, cfg, launch.shape, rank)

        config, model, speculator = load_engine_parts(launch.engine_dir, shard=shard, **overrides)
        self.comm = RankCollectives(launch.shape, rank, model.device, group)
        self.idle_forward = parallelize(model, launch.shape, self.comm)
        self.imports = launch.imports
        prompts = LocalPrefill if self.imports is None else self.imports.prompts(rank, self.comm)
        self.engine = LLMEngine(model, config, speculator, prompts=prompts)
        if launch.shape.tensor_parallel_size > 1:  # every rank must take the same KV decisions: not by event timing
            agree_copy_completion(self.engine.kv)
        self.group = launch.shape.dp_rank(rank)

    def ready(self) -> Ready:
        e = self.engine
        return Ready(self.rank, e.cfg, e.workspace, e.max_model_len, e.max_new_tokens_limit, self.stats(),
                     socket.gethostname(), None if self.imports is None else self.imports.describe(e))

    def stats(self) -> dict[str, float]:
        return {**self.engine.stats(), **self.comm.stats(), "process_id": float(os.getpid())}

    # ------------------------------------------------------------------------------------------ commands
    def handle(self, cmd: Command) -> Reply:
        if isinstance(cmd, NeverAdmissible):
            return Reply(self.rank, answer=self.engine.kv.never_admissible(cmd.prompt_len, cmd.max_new_tokens))
        assert isinstance(cmd, Step | PollIdle), cmd
        updates = self._apply(cmd.ops)
        engine = self.engine
        if isinstance(cmd, Step) and engine.dead is None and engine.has_unfinished():
            updates += engine.step()
        elif engine.dead is None:
            engine.poll_idle()
        try:
            if isinstance(cmd, Step):
                self.comm.drain(self.idle_forward)  # checks first that no forward of this step stopped half-way
            self.comm.usable()
        except CollectiveError as exc:  # name what interrupted the forward (the engine ended its requests with it)
            cause = next((u.error for u in updates if u.error), None)
            raise CollectiveError(f"{exc}; the step's error: {cause}" if cause else str(exc)) from exc
        for update in updates:
            if update.finished:
                engine.requests.pop(update.request_id, None)
        return Reply(self.rank, updates, digest(updates, engine.kv.stats()), self.stats(), dead=engine.dead)

    def _apply(self, ops: tuple[Op, ...]) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        for op in ops:
            if op.group != self.group:
                continue
            if isinstance(op, Add):
                try:
                    if op.imported is None:
                        self.engine.add_request(op.prompt, op.params, op.request_id, seed=op.seed)
                    elif self.imports is None:
                        raise InvalidRequestError("this engine prefills its prompts: it imports no context phase")
                    else:  # a generation engine's request: every rank that holds it checks its params again
                        self.imports.queue(self.engine, op.request_id, op.prompt, op.params, op.imported)
                except (InvalidRequestError, EngineDeadError) as exc:
                    updates.append(RequestUpdate(op.request_id, [], True, "error", error=str(exc)))
            elif isinstance(op, Abort) and self.engine.abort_request(op.request_id, op.reason):
                self.engine.pop_finished(op.request_id)
        return updates


def digest(updates: list[RequestUpdate], kv_stats: dict[str, float]) -> str:
    """A hash of a step's outcome that tensor-parallel ranks must agree on: every update's tokens, finish and error,
    and the KV store's decision counters and gauges (pages, bytes, resolution counts; not clock readings)."""
    h = hashlib.sha256()
    for u in updates:
        h.update(repr((u.request_id, u.new_token_ids, u.finished, u.finish_reason, u.error)).encode())
    for name in sorted(kv_stats):
        if not any(t in name for t in TIMING_STATS):
            h.update(f"{name}={kv_stats[name]!r};".encode())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ the loop
@dataclass
class Channel:
    """A rank's connection to the driver (``multiprocessing.connection``; ranks on the driver's host only): rank 0
    receives commands and sends replies over it, every local rank reports a fatal error on it before exiting.
    Messages are ``("hello", rank, pid)``, ``("ready" | "reply", [per-rank objects])``, ``("error", rank, message,
    traceback)`` from a rank, and a :class:`RankLaunch` then commands from the driver."""

    conn: Any = None

    def send(self, *message: Any) -> None:
        if self.conn is not None:
            self.conn.send(message)


def init_ranks(rank: int, world: int, launch_or_none: RankLaunch | None, addr: str, port: int
               ) -> tuple[RankLaunch, Any]:
    """Join the engine's ranks: the default process group (gloo) carries the control channel, with a timeout long
    enough for the slowest rank's model load or step; every rank gets rank 0's launch description over it; then the
    data group (``launch.backend``: NCCL on GPUs, gloo on CPU) with ``collective_timeout_s`` carries the model's
    collectives. Returns ``(launch, data group)``."""
    control_s = CONTROL_TIMEOUT_FLOOR_S if launch_or_none is None else max(CONTROL_TIMEOUT_FLOOR_S,
                                                                           10 * launch_or_none.timeout_s)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", world_size=world, rank=rank,
                            timeout=timedelta(seconds=control_s))
    box = [launch_or_none if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    launch = box[0]
    assert isinstance(launch, RankLaunch)
    data = dist.new_group(backend=launch.backend, timeout=timedelta(seconds=launch.timeout_s))
    return launch, data


def control_loop(rank: int, worker: RankWorker, channel: Channel, heartbeat_s: float) -> None:
    """Serve the driver's commands until ``Shutdown`` (the control channel is the default process group)."""
    world = worker.shape.world_size
    while True:
        cmd: Command | None = _next_command(channel, heartbeat_s) if rank == 0 else None
        box = [cmd]
        dist.broadcast_object_list(box, src=0)
        cmd = box[0]
        if isinstance(cmd, Heartbeat):
            continue
        if isinstance(cmd, Shutdown) or cmd is None:
            return
        reply = worker.handle(cmd)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(reply, gathered, dst=0)
        if rank == 0:
            channel.send("reply", gathered)


def _next_command(channel: Channel, heartbeat_s: float) -> Command:
    """The driver's next command; a heartbeat when none came within ``heartbeat_s``; ``Shutdown`` when the driver
    is gone (its connection closed)."""
    try:
        if not channel.conn.poll(heartbeat_s):
            return Heartbeat()
        cmd: Command = channel.conn.recv()
        return cmd
    except (EOFError, OSError):
        return Shutdown()


def run_rank(rank: int, world: int, launch: RankLaunch | None, channel: Channel, local_index: int = 0,
             engine_dir: str | None = None) -> int:
    """A rank's whole life: join, build, report ready, serve commands; returns its exit code (0, or
    :data:`FATAL_EXIT` after reporting a failure). ``launch`` None: a rank on another host (``engine_dir``: its
    copy of the engine directory; the rendezvous from ``MASTER_ADDR`` / ``MASTER_PORT``)."""
    try:
        addr = launch.master_addr if launch else os.environ["MASTER_ADDR"]
        port = launch.master_port if launch else int(os.environ["MASTER_PORT"])
        got, data = init_ranks(rank, world, launch, addr, port)
        if engine_dir is not None:  # a rank on another host: its own copy of the engine directory
            if config_digest(engine_dir) != got.config_digest:
                raise RuntimeError(f"rank {rank}: {engine_dir}/config.json differs from the engine host's copy")
            got = replace(got, engine_dir=engine_dir)
        if got.threads:
            torch.set_num_threads(got.threads)
        worker = RankWorker(rank, got, local_index, data)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(worker.ready(), gathered, dst=0)
        if rank == 0:
            channel.send("ready", gathered)
        control_loop(rank, worker, channel, heartbeat_s=min(5.0, got.timeout_s / 4))
        dist.destroy_process_group()
        return 0
    except BaseException as exc:  # noqa: B036 - a rank must never be left running after a failure
        message = f"rank {rank}: {type(exc).__name__}: {exc}"
        try:
            channel.send("error", rank, message, traceback.format_exc())
        except OSError:
            pass  # the driver is gone
        print(f"dhisparse {message}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return FATAL_EXIT

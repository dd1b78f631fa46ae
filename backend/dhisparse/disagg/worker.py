"""A context (prefill) engine in its own process, driven over a ``multiprocessing`` pipe.

The pipe carries only control messages (prompt in, :class:`ContextPhaseParams` bytes out); the history
itself moves over NIXL when the decode side READs it. The Triton deployment uses the same split with
Triton as the control channel (``context`` model); this worker serves tests and local tools.

Messages (parent → child): ``("prefill", variant, request_id, prompt, sampling_kwargs)`` → ``("ok", params_bytes)``
or ``("error", message)``; ``("stats",)`` → ``("ok", dict)``; ``("close",)``. A worker may host several *variants*
of the engine (runtime overrides, e.g. with and without a drafter), all publishing through its one NIXL agent.
Between messages the child polls its exporter, so regions are released as soon as the decode side's notification
arrives.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from dhisparse.disagg.params import ContextPhaseParams
from dhisparse.sampling import SamplingParams


def _serve(engine_dir: str, variants: dict[str, dict[str, Any]], agent_name: str, hold_timeout_s: float,
           conn: Connection, key: bytes) -> None:
    import torch

    from dhisparse.disagg.nixl_transfer import NixlExporter
    from dhisparse.disagg.prefill import PrefillEngine, PrefillService

    torch.set_num_threads(1)
    exporter = NixlExporter(agent_name, hold_timeout_s)
    services = {name: PrefillService(PrefillEngine(engine_dir, **overrides), exporter)
                for name, overrides in variants.items()}
    conn.send(("ready", agent_name))
    try:
        while True:
            exporter.poll()
            if not conn.poll(0.005):
                continue
            message = conn.recv()
            if message[0] == "close":
                break
            if message[0] == "stats":
                stats = {k: v for service in services.values() for k, v in service.stats().items()}
                conn.send(("ok", stats))
                continue
            _, variant, request_id, prompt, sampling = message
            try:
                params = services[variant].run(prompt, SamplingParams(**sampling), request_id,
                                               arrival=time.perf_counter())
                conn.send(("ok", params.to_bytes(key)))
            except Exception as error:
                conn.send(("error", f"{type(error).__name__}: {error}"))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        exporter.close()


class ContextWorker:
    """Parent-side handle of one context process (``spawn``: no state is inherited from the parent)."""

    def __init__(self, engine_dir: str | Path, agent_name: str = "context-0", hold_timeout_s: float = 60.0,
                 start_timeout_s: float = 120.0, variants: dict[str, dict[str, Any]] | None = None,
                 **overrides: Any) -> None:
        """``overrides`` configure the default variant ``""``; ``variants`` adds named ones."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.key = secrets.token_bytes(32)  # signs the params, as the deployment's internal key does
        args = (str(engine_dir), {"": overrides, **(variants or {})}, agent_name, hold_timeout_s, child, self.key)
        self.process = ctx.Process(target=_serve, args=args, name=f"dhisparse-{agent_name}", daemon=True)
        self.process.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.kill()
            raise RuntimeError(f"context worker {agent_name!r} did not start within {start_timeout_s:g} s")
        self._conn.recv()
        self.agent_name = agent_name

    def prefill(self, prompt: list[int], params: SamplingParams, request_id: str, variant: str = ""
                ) -> ContextPhaseParams:
        sampling = asdict(params)
        sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
        self._conn.send(("prefill", variant, request_id, [int(t) for t in prompt], sampling))
        status, payload = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"context phase of {request_id!r} failed: {payload}")
        return ContextPhaseParams.from_bytes(payload, self.key)

    def stats(self) -> dict[str, float]:
        self._conn.send(("stats",))
        return self._conn.recv()[1]

    def kill(self) -> None:
        """SIGKILL the process (failure tests): whatever it held is gone with it."""
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("close",))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(10)
            if self.process.is_alive():
                self.kill()
        self._conn.close()

"""When the server is going down: the models' view of a shutdown (SIGTERM of ``dhisparse-serve``, or its death).

The launcher creates the repository's drain file (``repository.drain_file``); a launcher that died without doing so
(SIGKILL) is noticed through its pid (``supervisor_pid``). From then on a model refuses new requests and lets its
open ones run for ``grace_s`` seconds; whatever is still open then is answered with an error
(:class:`ShuttingDownError`). The launcher waits until no model has an open request (``TritonServer.wait_drained``)
and only then sends tritonserver SIGTERM (not-ready, exit): a stopping tritonserver refuses the ensemble's internal
step requests, so an ensemble stream must have its answer before. (Orphaned by SIGKILL, tritonserver gets its
SIGTERM at once from the parent-death signal; its exit timeout exceeds the grace, so the engine models' streams are
still answered, while an ensemble stream may then end in a GOAWAY.)
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from dhisparse.errors import DHiSparseError


class ShuttingDownError(DHiSparseError):
    """The server is shutting down: the request was refused, or ended before it finished."""


class DrainWatch:
    """Polled by a model's supervisor thread: ``draining`` (refuse new requests), ``expired`` (end the open ones).

    Args:
        drain_file: the file whose existence means "drain" (None: only the supervisor pid counts).
        supervisor_pid: the launcher's pid; its disappearance means "drain" (0: not watched).
        grace_s: seconds open requests may still run after the drain began.
    """

    def __init__(self, drain_file: str | Path | None, supervisor_pid: int = 0, grace_s: float = 5.0) -> None:
        self.drain_file = Path(drain_file) if drain_file else None
        self.supervisor_pid = supervisor_pid
        self.grace_s = grace_s
        self.since: float | None = None  # monotonic time the drain was first seen
        self.reason = ""

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str]) -> DrainWatch:
        return cls(parameters.get("drain_file") or None, int(parameters.get("supervisor_pid", "0") or 0),
                   float(parameters.get("shutdown_grace_s", "5")))

    def _supervisor_gone(self) -> bool:
        if self.supervisor_pid <= 0:
            return False
        try:
            os.kill(self.supervisor_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def poll(self) -> None:
        """Look once for the drain signal (cheap: one stat and one kill(pid, 0))."""
        if self.since is not None:
            return
        if self.drain_file is not None and self.drain_file.exists():
            self.since, self.reason = time.monotonic(), "the server is shutting down"
        elif self._supervisor_gone():
            self.since, self.reason = time.monotonic(), "the server is shutting down (its launcher is gone)"

    @property
    def draining(self) -> bool:
        """Whether new requests are refused (as of the last poll)."""
        return self.since is not None

    @property
    def expired(self) -> bool:
        """Whether the grace is over and open requests must be answered with an error now."""
        return self.since is not None and time.monotonic() - self.since >= self.grace_s

    def refuse_new_requests(self) -> None:
        """Raise the refusal when the server drains (looks for the signal first: a request must not slip in between
        the drain file and the supervisor's next poll)."""
        self.poll()
        if self.draining:
            raise self.refusal()

    def refusal(self) -> ShuttingDownError:
        """The error a new request gets while draining."""
        return ShuttingDownError(f"{self.reason}: request refused")

    def stopped(self) -> ShuttingDownError:
        """The error an open request gets when the grace is over."""
        return ShuttingDownError(f"{self.reason}: the request was stopped before it finished "
                                 f"(shutdown grace {self.grace_s:g} s)")

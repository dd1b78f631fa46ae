"""Run `dhisparse-serve` as a child process and learn its endpoints from its `ready` line.

Used by `dhisparse-bench` (one server per KV policy) and by tests that need a server they can kill or
restart. The child runs the real CLI, so what is measured is what users run.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_READY = re.compile(r"dhisparse-serve: ready .*http=(\S+) grpc=(\S+) metrics=(\S+) pid=(\d+)")
_OPENAI = re.compile(r"dhisparse-serve: openai=(\S+) model=(\S+)")


class ServeError(RuntimeError):
    """`dhisparse-serve` exited or did not become ready; the message carries its output tail."""


@dataclass(frozen=True)
class Endpoints:
    """Where a started server listens."""

    http_url: str  # host:port
    grpc_url: str  # host:port
    metrics_url: str  # full URL of /metrics
    triton_pid: int
    openai_url: str | None = None  # base URL of the OpenAI API (http://host:port/v1) with --openai-port
    openai_model: str | None = None  # its model id


def serve_command() -> list[str]:
    """The `dhisparse-serve` command of this environment (console script, else the module)."""
    script = Path(sys.executable).with_name("dhisparse-serve")
    if script.exists():
        return [str(script)]
    found = shutil.which("dhisparse-serve")
    return [found] if found else [sys.executable, "-m", "dhisparse.serving.cli"]


class ServeProcess:
    """`dhisparse-serve --engine ENGINE` on free loopback ports; a context manager that stops it cleanly.

    Args:
        engine: engine directory.
        engine_options: runtime overrides, passed as `--engine-option KEY=VALUE` (e.g. kv_policy, pool_bytes).
        log_path: file for tritonserver's log (the launcher's own lines are kept in memory).
        extra_args: further `dhisparse-serve` flags.
    """

    def __init__(self, engine: Path, engine_options: Mapping[str, object] | None = None,
                 log_path: Path | None = None, extra_args: Sequence[str] = ()) -> None:
        self.engine = Path(engine)
        self.engine_options = dict(engine_options or {})
        self.log_path = log_path
        self.extra_args = tuple(extra_args)
        self.endpoints: Endpoints | None = None
        self._process: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._output: list[str] = []

    @property
    def pid(self) -> int | None:
        """Process id of `dhisparse-serve` (None when not running)."""
        return self._process.pid if self._process is not None else None

    def command(self) -> list[str]:
        """The full `dhisparse-serve` command line."""
        cmd = [*serve_command(), "--engine", str(self.engine), "--http-port", "0", "--grpc-port", "0",
               "--metrics-port", "0"]
        for key, value in self.engine_options.items():
            text = value if isinstance(value, str) else repr(value).lower() if isinstance(value, bool) else value
            cmd += ["--engine-option", f"{key}={text}"]
        if self.log_path is not None:
            cmd += ["--log-file", str(self.log_path)]
        return [*cmd, *self.extra_args]

    def start(self, timeout_s: float = 300.0) -> Endpoints:
        """Start the server and wait for its ready line; raises ServeError on exit or timeout."""
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        self._process = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         env=env, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        openai: tuple[str | None, str | None] = (None, None)
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise ServeError(f"dhisparse-serve not ready after {timeout_s:.0f} s\n{self.output_tail()}") from None
            if line is None:
                code = self._process.wait()
                self.stop()
                raise ServeError(f"dhisparse-serve exited with code {code}\n{self.output_tail()}")
            if match := _OPENAI.search(line):
                openai = match.groups()
            match = _READY.search(line)
            if match:
                http, grpc, metrics, pid = match.groups()
                self.endpoints = Endpoints(http, grpc, metrics, int(pid), *openai)
                return self.endpoints

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            self._output.append(line.rstrip("\n"))
            self._lines.put(line)
        self._lines.put(None)

    def output_tail(self, lines: int = 30) -> str:
        """The launcher's last output lines, then the tritonserver log's (when logged to a file)."""
        text = "\n".join(self._output[-lines:])
        if self.log_path is not None and self.log_path.exists():
            text += "\n" + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return text

    def wait(self, timeout_s: float) -> int:
        """Block until `dhisparse-serve` exits on its own (raises `subprocess.TimeoutExpired`); its exit code."""
        if self._process is None:
            raise RuntimeError("dhisparse-serve is not running")
        return self._process.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT (the launcher then stops tritonserver cleanly), SIGKILL the group after `timeout_s`."""
        process, self._process = self._process, None
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        return process.returncode

    def __enter__(self) -> ServeProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

"""Start, watch and stop one real `tritonserver` process.

Used by `dhisparse-serve` and by the serving tests' session fixture. The process runs CPU-only
(`--allow-gpu-metrics=false --pinned-memory-pool-byte-size=0`), binds HTTP, gRPC and metrics to a
loopback address, and loads a complete model repository (`--disable-auto-complete-config`). The
Python backend stub must import this virtualenv's packages, so the interpreter's `bin` directory goes
first on `PATH` (the stub runs the first `python3` it finds there; `PYTHONPATH` alone is not enough).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dhisparse.serving.triton_install import TritonInstall


class ServerStartError(RuntimeError):
    """tritonserver exited or did not become ready in time; the message carries its log tail."""


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Return `count` distinct TCP ports that were free on `host` a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(frozen=True)
class ServerConfig:
    """How to run tritonserver.

    Attributes:
        model_repository: a filled model repository (see `dhisparse.serving.repository`).
        backend_dir: a backend directory (see `triton_install.prepare_backend_dir`).
        http_port, grpc_port, metrics_port: distinct TCP ports on `address`.
        address: interface every endpoint binds to; loopback by default.
        log_verbose: tritonserver `--log-verbose` level (0 = quiet).
        extra_args: further tritonserver flags, appended verbatim.
    """

    model_repository: Path
    backend_dir: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    address: str = "127.0.0.1"
    log_verbose: int = 0
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        ports = (self.http_port, self.grpc_port, self.metrics_port)
        for port in ports:
            if not 1 <= port <= 65535:
                raise ValueError(f"port {port} is outside 1..65535")
        if len(set(ports)) != 3:
            raise ValueError(f"http, grpc and metrics ports must differ, got {ports}")
        if self.log_verbose < 0:
            raise ValueError(f"log_verbose must be >= 0, got {self.log_verbose}")

    @property
    def http_url(self) -> str:
        """`host:port` of the HTTP endpoint (the form tritonclient expects)."""
        return f"{self.address}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """`host:port` of the gRPC endpoint."""
        return f"{self.address}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """Full URL of the Prometheus metrics page."""
        return f"http://{self.address}:{self.metrics_port}/metrics"


class TritonServer:
    """One tritonserver child process; a context manager that stops it on exit.

    The child gets its own process group, so a terminal's Ctrl-C reaches only the parent, which then
    forwards one SIGTERM (`stop`) and waits for a clean shutdown before escalating to SIGKILL.
    """

    def __init__(self, config: ServerConfig, install: TritonInstall | None = None,
                 log_path: Path | None = None) -> None:
        self.config = config
        self.install = install or TritonInstall.locate()
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file = None

    def command(self) -> list[str]:
        """The full tritonserver command line."""
        c = self.config
        return [
            str(self.install.server_binary),
            f"--model-repository={c.model_repository}",
            f"--backend-directory={c.backend_dir}",
            f"--http-address={c.address}", f"--http-port={c.http_port}",
            f"--grpc-address={c.address}", f"--grpc-port={c.grpc_port}",
            f"--metrics-address={c.address}", f"--metrics-port={c.metrics_port}",
            "--allow-gpu-metrics=false",
            "--pinned-memory-pool-byte-size=0",
            "--disable-auto-complete-config",
            "--strict-readiness=true",
            # Explicit model control (every model loaded at start): lets a model whose engine died unload itself,
            # so that its readiness turns false (see dhisparse.serving.llm_service).
            "--model-control-mode=explicit", "--load-model=*",
            "--exit-timeout-secs=15",
            f"--log-verbose={c.log_verbose}",
            # Each server needs its own shared-memory names or two servers on one host collide.
            f"--backend-config=python,shm-region-prefix-name=dhisparse_{os.getpid()}_{c.grpc_port}_",
            *c.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        """Environment for the child: this interpreter's bin first on PATH, Triton's libraries loadable."""
        env = dict(os.environ)
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
        libs = [str(self.install.library_dir)] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else [])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
        return env

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or None before `start`."""
        return self._process.pid if self._process else None

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the server and block until `/v2/health/ready` answers 200 (all models loaded)."""
        if self._process is not None:
            raise RuntimeError("server already started")
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "wb")
        self._process = subprocess.Popen(
            self.command(), env=self.environment(), stdout=self._log_file, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            if self._process.poll() is not None:
                code = self._process.returncode
                self.stop()
                raise ServerStartError(f"tritonserver exited with code {code}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"tritonserver not ready after {timeout_s:.0f} s\n{self.log_tail()}")
            time.sleep(0.1)

    def is_ready(self) -> bool:
        """True when the server answers its readiness probe."""
        url = f"http://{self.config.http_url}/v2/health/ready"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def model_ready(self, model: str) -> bool:
        """True when `/v2/models/<model>/ready` answers 200."""
        url = f"http://{self.config.http_url}/v2/models/{model}/ready"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def poll(self) -> int | None:
        """Exit code if the server process has exited, else None (also None before `start`)."""
        return self._process.poll() if self._process is not None else None

    def wait(self) -> int:
        """Block until the server exits; return its exit code."""
        if self._process is None:
            raise RuntimeError("server not started")
        return self._process.wait()

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL the process group. Returns the exit code."""
        process, self._process = self._process, None
        code = None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            code = process.returncode
            # Stubs are children of the server; make sure none outlives it.
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def log_tail(self, lines: int = 40) -> str:
        """Last `lines` lines of the server log (empty when the log goes to the terminal)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

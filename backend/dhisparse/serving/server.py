"""Start, watch and stop one real `tritonserver` process.

Used by `dhisparse-serve` and by the serving tests' session fixture. The process runs CPU-only
(`--allow-gpu-metrics=false --pinned-memory-pool-byte-size=0`), binds HTTP, gRPC and metrics to a
loopback address, and loads a complete model repository (`--disable-auto-complete-config`). The
Python backend stub must import this virtualenv's packages, so the interpreter's `bin` directory goes
first on `PATH` (the stub runs the first `python3` it finds there; `PYTHONPATH` alone is not enough).

Hardening (docs/security.md): the administrative APIs are restricted (`triton_security.SecurityOptions`); only
the named models are loaded; the child gets a parent-death signal and a private umask (`process_guard`); a start
whose ports are taken fails saying so, and readiness is believed only from a socket our child owns; `stop` signals
the models to drain (the repository's drain file: new requests refused, open ones answered within the grace), waits
until no model has an open request, then SIGTERMs tritonserver (not-ready, exit), then makes sure no process of its
group and none of its shared-memory regions are left. The drain comes first because a stopping tritonserver 2.51
refuses the ensemble's internal step requests: an ensemble stream still open then would stall until the exit
timeout and end in a GOAWAY instead of its answer.
"""

from __future__ import annotations

import json
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

from dhisparse.serving import process_guard
from dhisparse.serving.repository import drain_file
from dhisparse.serving.triton_install import TritonInstall
from dhisparse.serving.triton_security import SecurityOptions


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
        security: restricted APIs and TLS (`triton_security.SecurityOptions`; admin APIs restricted by default).
        load_models: the models to load (empty: every folder of the repository with a config.pbtxt, hidden ones
            excepted; never Triton's `*`, which would also try the repository's private `.dhisparse/` folder).
        http_address / metrics_address: per-endpoint addresses ("" = `address`), e.g. HTTP on loopback behind a
            TLS proxy while gRPC (with TLS) faces the network.
        exit_timeout_s: tritonserver's `--exit-timeout-secs` (how long it waits for in-flight requests at exit).
        drain_timeout_s: at `stop`, the longest wait for the models to answer their open requests (the shutdown grace
            and a margin) before tritonserver gets SIGTERM.
    """

    model_repository: Path
    backend_dir: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    address: str = "127.0.0.1"
    log_verbose: int = 0
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    security: SecurityOptions = field(default_factory=SecurityOptions)
    load_models: tuple[str, ...] = ()
    http_address: str = ""
    metrics_address: str = ""
    exit_timeout_s: int = 8  # the default shutdown grace (5 s) + 3 s: see dhisparse.serving.cli
    drain_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.exit_timeout_s < 1:
            raise ValueError(f"exit_timeout_s must be >= 1, got {self.exit_timeout_s}")
        if not self.security.allow_http and self.security.grpc_tls is not None and self.security.grpc_tls.mutual:
            raise ValueError("with mutual gRPC TLS keep HTTP on (bind it to loopback with http_address): the launcher "
                             "probes readiness over it")
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
        return f"{self.http_address or self.address}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """`host:port` of the gRPC endpoint."""
        return f"{self.address}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """Full URL of the Prometheus metrics page."""
        return f"http://{self.metrics_address or self.address}:{self.metrics_port}/metrics"

    def bound_ports(self) -> list[tuple[str, int]]:
        """``(address, port)`` of every endpoint tritonserver will listen on."""
        out = [(self.address, self.grpc_port), (self.metrics_address or self.address, self.metrics_port)]
        if self.security.allow_http:
            out.insert(0, (self.http_address or self.address, self.http_port))
        return out


class TritonServer:
    """One tritonserver child process; a context manager that stops it on exit.

    The child gets its own process group, so a terminal's Ctrl-C reaches only the parent, which then
    forwards one SIGTERM (`stop`) and waits for a clean shutdown before escalating to SIGKILL. It also gets a
    parent-death signal (SIGTERM when this process dies, however) and umask 077.
    """

    def __init__(self, config: ServerConfig, install: TritonInstall | None = None,
                 log_path: Path | None = None) -> None:
        self.config = config
        self.install = install or TritonInstall.locate()
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self.version = ""  # tritonserver's version, from its metadata once ready

    def command(self) -> list[str]:
        """The full tritonserver command line."""
        c = self.config
        names = c.load_models or tuple(sorted(p.name for p in Path(c.model_repository).iterdir()
                                              if not p.name.startswith(".") and (p / "config.pbtxt").is_file()))
        loads = [f"--load-model={name}" for name in names]
        return [
            str(self.install.server_binary),
            f"--model-repository={c.model_repository}",
            f"--backend-directory={c.backend_dir}",
            f"--http-address={c.http_address or c.address}", f"--http-port={c.http_port}",
            f"--grpc-address={c.address}", f"--grpc-port={c.grpc_port}",
            f"--metrics-address={c.metrics_address or c.address}", f"--metrics-port={c.metrics_port}",
            "--allow-gpu-metrics=false",
            "--pinned-memory-pool-byte-size=0",
            "--disable-auto-complete-config",
            "--strict-readiness=true",
            # Explicit model control (our models loaded at start): lets a model whose engine died unload itself,
            # so that its readiness turns false (see dhisparse.serving.llm_service). Clients cannot load or unload:
            # the model-repository API is restricted (c.security).
            "--model-control-mode=explicit", *loads,
            "--exit-on-error=true",
            f"--exit-timeout-secs={c.exit_timeout_s}",
            f"--log-verbose={c.log_verbose}",
            # Each server needs its own shared-memory names or two servers on one host collide.
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *c.security.args(),
            *c.extra_args,
        ]

    @property
    def shm_prefix(self) -> str:
        """Name prefix of this server's Python-backend shared-memory regions (launcher pid and gRPC port)."""
        return f"{process_guard.SHM_PREFIX}{os.getpid()}_{self.config.grpc_port}_"

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
        """Start the server and block until `/v2/health/ready` answers 200 (all models loaded) from our child.

        Raises ServerStartError when a port is taken (naming it), when the child exits, or on timeout."""
        if self._process is not None:
            raise RuntimeError("server already started")
        process_guard.sweep_stale_regions()
        taken = [f"{address}:{port}" for address, port in self.config.bound_ports()
                 if process_guard.ports_in_use(address, [port])]
        if taken:
            raise ServerStartError(f"port {', '.join(taken)} is already in use (another server, or a tritonserver "
                                   "left over from an earlier run?); choose other ports or stop it")
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "wb")
        self._process = subprocess.Popen(
            self.command(), env=self.environment(), stdout=self._log_file, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=process_guard.child_setup(os.getpid()),
        )
        deadline = time.monotonic() + timeout_s
        while not self._ready_from_child():
            if self._process.poll() is not None:
                code = self._process.returncode
                self.stop()
                raise ServerStartError(f"tritonserver exited with code {code}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"tritonserver not ready after {timeout_s:.0f} s\n{self.log_tail()}")
            time.sleep(0.1)
        self.version = self._server_version()
        self.secure_shared_memory()

    def secure_shared_memory(self) -> None:
        """Make this server's shared-memory regions owner-only (the Python backend creates them world-readable;
        `dhisparse-serve` calls this again while it runs, for regions made later)."""
        process_guard.restrict_shm_regions(self.shm_prefix)

    def _ready_from_child(self) -> bool:
        """Ready, and the answer came from our child (it owns the listening socket): never another server's."""
        if not self.is_ready():
            return False
        port = self.config.http_port if self.config.security.allow_http else self.config.grpc_port
        return self._process is not None and process_guard.listens(self._process.pid, port) is not False

    def _probe(self, path: str) -> bool:
        """GET ``path`` over HTTP (200 = true), or its gRPC equivalent when HTTP is off."""
        if not self.config.security.allow_http:
            return self._grpc_probe(path)
        try:
            with urllib.request.urlopen(f"http://{self.config.http_url}{path}", timeout=1.0) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def _grpc_probe(self, path: str) -> bool:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        tls = self.config.security.grpc_tls
        root = str(tls.root_cert or tls.server_cert) if tls is not None else None
        try:
            client = grpcclient.InferenceServerClient(self.config.grpc_url, ssl=tls is not None,
                                                      root_certificates=root)
            try:
                if path.startswith("/v2/models/"):
                    return bool(client.is_model_ready(path.split("/")[3], client_timeout=1.0))
                return bool(client.is_server_ready(client_timeout=1.0))
            finally:
                client.close()
        except (InferenceServerException, OSError, ValueError):
            return False

    def is_ready(self) -> bool:
        """True when the server answers its readiness probe."""
        return self._probe("/v2/health/ready")

    def model_ready(self, model: str) -> bool:
        """True when `/v2/models/<model>/ready` answers 200."""
        return self._probe(f"/v2/models/{model}/ready")

    def _server_version(self) -> str:
        if not self.config.security.allow_http:
            return ""
        try:
            with urllib.request.urlopen(f"http://{self.config.http_url}/v2", timeout=2.0) as response:
                return str(json.loads(response.read()).get("version", ""))
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
            return ""

    def poll(self) -> int | None:
        """Exit code if the server process has exited, else None (also None before `start`)."""
        return self._process.poll() if self._process is not None else None

    def wait(self) -> int:
        """Block until the server exits; return its exit code."""
        if self._process is None:
            raise RuntimeError("server not started")
        return self._process.wait()

    def begin_drain(self) -> None:
        """Tell the models the server is going down: they refuse new requests and answer the open ones (finished
        within the grace, or with an error after it). Idempotent."""
        marker = drain_file(self.config.model_repository)
        if marker.parent.is_dir():
            marker.touch()

    def open_requests(self) -> float | None:
        """Requests with an open stream in our models (the sum of their `dhisparse_serving_active_requests` gauges),
        None when the metrics endpoint does not answer."""
        try:
            with urllib.request.urlopen(self.config.metrics_url, timeout=1.0) as response:
                text = response.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("dhisparse_serving_active_requests{"))

    def wait_drained(self, timeout_s: float, settle_s: float = 0.5) -> bool:
        """After `begin_drain`: wait until no model has an open request, seen twice `settle_s` apart (the gauges are
        refreshed every metrics interval), or `timeout_s` passed. True when drained."""
        deadline = time.monotonic() + timeout_s
        idle_since = None
        while time.monotonic() < deadline and self.poll() is None:
            if self.open_requests() == 0:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= settle_s:
                    return True
            else:
                idle_since = None
            time.sleep(0.05)
        return False

    def stop(self, timeout_s: float | None = None) -> int | None:
        """Drain (at most `drain_timeout_s`), SIGTERM, wait up to `timeout_s` (default: the exit timeout + 15 s), then
        SIGKILL the process group; then make sure no process of the group and no shared-memory region of this server
        is left. Returns the exit code."""
        process = self._process
        if process is not None and process.poll() is None:
            self.begin_drain()
            self.wait_drained(self.config.drain_timeout_s)
        self._process = None
        code = None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=timeout_s if timeout_s is not None else self.config.exit_timeout_s + 15)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            code = process.returncode
            # Stubs are children of the server; make sure none outlives it.
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 10.0
            while process_guard.group_processes(process.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            process_guard.remove_shm_regions(self.shm_prefix)
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

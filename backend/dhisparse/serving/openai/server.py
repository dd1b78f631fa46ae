"""Run the OpenAI-compatible front end beside Triton: uvicorn on its own thread and event loop.

`dhisparse-serve --openai-port N` starts it once tritonserver is ready (`add_arguments` / `from_arguments` are the
two calls `serving/cli.py` makes) and stops it before tritonserver. It calls the Triton server's gRPC endpoint, so
it serves whatever deployment that server runs (co-located `dhisparse`, or the disaggregated orchestrator).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from dhisparse.serving.limits import RequestLimits
from dhisparse.serving.openai.app import create_app
from dhisparse.serving.openai.chat_template import ChatTemplate
from dhisparse.serving.openai.engine_client import EngineClient
from dhisparse.serving.openai.serving import EngineLimits, OpenAIServing


@dataclass(frozen=True)
class OpenAIOptions:
    """Attributes:
        port: TCP port of the HTTP API (0: a free one, chosen at start).
        address: interface it binds to.
        model_name: the model id clients use (default: the engine directory's name).
        chat_template: a chat template file overriding the engine's own.
        add_special_tokens: as the ensemble's preprocessing (completions prompts).
    """

    port: int
    address: str = "127.0.0.1"
    model_name: str | None = None
    chat_template: Path | None = None
    add_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--openai-port must be in 0..65535, got {self.port}")
        if self.model_name is not None and not self.model_name.strip():
            raise ValueError("--served-model-name must not be empty")


class OpenAIServer:
    """The front end for `engine_dir` served by the Triton server at `grpc_url`; `start` blocks until it listens.

    `request_limits` are the per-request limits the Triton models apply (`RepositorySpec.resolved_limits`), checked
    here too, at the OpenAI edge (`edge_limits`); default: the defaults. Raises ValueError from the constructor when
    the engine has no tokenizer or the chat template is unusable."""

    def __init__(self, engine_dir: Path, grpc_url: str, options: OpenAIOptions,
                 engine_overrides: Mapping[str, object] | None = None,
                 request_limits: RequestLimits | None = None) -> None:
        self.options = options
        engine_dir = Path(engine_dir)
        if not (engine_dir / "tokenizer.json").is_file():
            raise ValueError(f"the OpenAI API needs the engine's tokenizer: {engine_dir / 'tokenizer.json'} is missing")
        template = ChatTemplate.load(engine_dir, options.chat_template)
        name = options.model_name or engine_dir.resolve().name
        self.serving = OpenAIServing(EngineClient(grpc_url), engine_dir, name,
                                     EngineLimits.load(engine_dir, dict(engine_overrides or {})), template,
                                     options.add_special_tokens, request_limits)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL of the API (``http://address:port/v1``), once started."""
        return f"http://{self.options.address}:{self.port}/v1"

    @property
    def port(self) -> int:
        if self._server is None or not self._server.servers:
            return self.options.port
        port: int = self._server.servers[0].sockets[0].getsockname()[1]
        return port

    def start(self, timeout_s: float = 30.0) -> None:
        serving = self.serving

        @asynccontextmanager
        async def lifespan(_app: object) -> AsyncIterator[None]:
            await serving.engine.ready()  # connects and learns the model's tensors (retried per request if not yet)
            yield
            await serving.engine.close()

        app = create_app(serving)
        app.router.lifespan_context = lifespan
        config = uvicorn.Config(app, host=self.options.address, port=self.options.port, log_level="warning",
                                access_log=False, lifespan="on", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="dhisparse-openai", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the OpenAI API did not start on {self.options.address}:{self.options.port} "
                                   "(port taken?)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI API did not start within {timeout_s:.0f} s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=15)
        self._server = self._thread = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dhisparse-serve`'s OpenAI flags."""
    g = parser.add_argument_group("OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models)")
    g.add_argument("--openai-port", type=int, default=None, metavar="N",
                   help="serve the OpenAI API on this port beside Triton (0: a free port); off when not given")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id of the OpenAI API (default: the engine directory's name)")
    g.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="Jinja2 chat template overriding the engine tokenizer's (chat_template.jinja or "
                        "tokenizer_config.json's chat_template)")


def from_arguments(args: argparse.Namespace, engine_dir: Path, grpc_url: str, overrides: Mapping[str, object],
                   request_limits: RequestLimits | None = None) -> OpenAIServer | None:
    """The server `args` ask for (None without --openai-port), checking `request_limits` (``--limit``); not started.
    Raises ValueError on bad flags."""
    if args.openai_port is None:
        if args.served_model_name is not None or args.chat_template is not None:
            raise ValueError("--served-model-name and --chat-template need --openai-port")
        return None
    options = OpenAIOptions(args.openai_port, args.address, args.served_model_name, args.chat_template)
    return OpenAIServer(engine_dir, grpc_url, options, overrides, request_limits)


def stop(server: OpenAIServer | None) -> None:
    """Stop `server` when there is one (before tritonserver, so no request is left mid-way)."""
    if server is not None:
        server.stop()

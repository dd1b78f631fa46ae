"""Serving tests: a real tritonserver serving a tiny engine, started once per session on free loopback ports.

The engine is a random-init GLM-MoE-DSA model built through `dhisparse-build`'s code path. Its KV policy
comes from `DHISPARSE_SERVING_KV_POLICY` (default: `adaptive`) with a device pool of `POOL_BYTES`, small
enough that 16 concurrent requests wait for admission and have their optional pages reclaimed. The server
is stopped at session end, and also at interpreter exit should the session die first.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

KV_POLICY = os.environ.get("DHISPARSE_SERVING_KV_POLICY", "adaptive")
POOL_BYTES = 160 * 1024
MAX_MODEL_LEN = 512
PROMPT = "To be, or not"  # a prompt whose greedy continuation runs LONG tokens without EOS
LONG = 480  # long enough that a cancellation almost always lands mid-request


@dataclass(frozen=True)
class ServedEngine:
    """A running server and what tests need to talk to it."""

    engine_dir: Path
    overrides: dict
    http_url: str
    grpc_url: str
    metrics_url: str
    server: object

    def client(self, model: str = "ensemble"):
        from dhisparse_client import DHiSparseClient

        return DHiSparseClient(self.grpc_url, self.http_url, self.metrics_url, model=model, timeout_s=120.0)


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_engine import build_tiny_engine

    return build_tiny_engine(tmp_path_factory.mktemp("tiny"), max_model_len=MAX_MODEL_LEN)


def start_triton(work: Path, fill) -> tuple[object, object, list[str]]:
    """``fill(repo_dir)`` writes a model repository (returns its model names); start tritonserver on it on free
    loopback ports (stopped at interpreter exit too). Returns ``(ServerConfig, TritonServer, models)``."""
    from dhisparse.serving.server import ServerConfig, TritonServer, free_ports
    from dhisparse.serving.triton_install import TritonInstall, prepare_backend_dir

    models = fill(work / "repo")
    install = TritonInstall.locate()
    http, grpc, metrics = free_ports(3)
    config = ServerConfig(work / "repo", prepare_backend_dir(install, work / "backends"), http, grpc, metrics)
    server = TritonServer(config, install, work / "server.log")
    atexit.register(server.stop)
    server.start(timeout_s=180)
    return config, server, models


@pytest.fixture(scope="session")
def served(tiny_engine: Path, tmp_path_factory: pytest.TempPathFactory):
    from dhisparse.serving.repository import RepositorySpec, fill_model_repository

    # pages of 16 rows (the shared default is 64, sized for GPU-scale models): POOL_BYTES holds ~3 requests
    overrides = {"kv_policy": KV_POLICY, "pool_bytes": POOL_BYTES, "page_rows": 16}
    spec = RepositorySpec(tiny_engine, overrides, metrics_interval_ms=100)
    config, server, _ = start_triton(tmp_path_factory.mktemp("triton"), lambda repo: fill_model_repository(spec, repo))
    try:
        yield ServedEngine(tiny_engine, overrides, config.http_url, config.grpc_url, config.metrics_url, server)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def offline_llm(tiny_engine: Path):
    """The same engine in-process, for reference outputs."""
    from dhisparse import LLM

    return LLM(tiny_engine, kv_policy="dense")  # the reference every policy must match


@pytest.fixture(scope="session")
def tokenizer(tiny_engine: Path):
    from dhisparse.serving.tokenization import load_tokenizer

    return load_tokenizer(tiny_engine)


@pytest.fixture(scope="session")
def prompt_runs_long(offline_llm, tokenizer) -> list[int]:
    """Precondition of the cancellation tests: greedy generation from PROMPT does not stop early on EOS."""
    from dhisparse import SamplingParams

    ids = tokenizer.encode(PROMPT).ids
    out = offline_llm.generate([ids], SamplingParams(max_tokens=LONG))[0]
    assert out.finish_reason == "length", "pick another PROMPT: this one hits EOS early"
    return ids

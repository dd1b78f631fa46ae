from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tiny models: one intra-op thread is fastest and avoids oversubscription when test processes overlap.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_root: Path):
    """``tiny_checkpoint(name)`` → path of a tiny transformers checkpoint from ``tiny_models.CONFIGS``."""
    from tiny_models import make_checkpoint

    return lambda name: make_checkpoint(tiny_root, name)


@pytest.fixture(scope="session")
def tiny_engine(tiny_root: Path, tiny_checkpoint):
    """``tiny_engine(name, dtype)`` → an engine directory built by ``dhisparse-build`` from a tiny checkpoint."""
    from dhisparse_builder import BuildOptions, build_engine

    def make(name: str, dtype: str = "float64") -> Path:
        out = tiny_root / f"engine-{name}-{dtype}"
        if not out.exists():
            build_engine(BuildOptions(tiny_checkpoint(name), out, {"dtype": dtype}), progress=lambda d, t: None)
        return out

    return make

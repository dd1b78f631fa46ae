"""Shared engines and helpers for the multi-rank tests (gloo, 2 ranks, one thread each).

Every multi-rank engine starts rank processes (spawn), so the tests share one engine per configuration (module
fixtures) and run several checks on it. The tiny models divide evenly over 2 ranks: 4 attention heads, 16 indexer
heads, deepseek_v4's 2 output groups, 4 or 8 routed experts, MLP widths 96/32/16; deepseek_v4's vocabulary (97) does
not, which exercises the padded vocabulary shard.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import build_spec_engine
from tiny_v4 import make_v4_checkpoint


@pytest.fixture(scope="session")
def v4_engine(tiny_root: Path) -> Path:
    from dhisparse_builder import BuildOptions, build_engine

    out = tiny_root / "engine-v4_small_topk-float64"
    if not out.exists():
        build_engine(BuildOptions(make_v4_checkpoint(tiny_root, "v4_small_topk"), out, {"dtype": "float64"}),
                     progress=lambda d, t: None)
    return out


@pytest.fixture(scope="session")
def spec_engine(tiny_root: Path, tiny_checkpoint) -> Path:
    return build_spec_engine(tiny_root / "parallel-spec", tiny_checkpoint("glm_fsfs_sparse"))

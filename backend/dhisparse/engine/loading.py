"""Load what an engine is built from, from an engine directory: its runtime config, the model and (optionally) the
drafter (``LLM`` and both disaggregated roles)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dhisparse.device import resolve_device
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.executor import Model
from dhisparse.errors import CheckpointError, ConfigError
from dhisparse.model.loading import AnyConfig, build_model, load_any_state_dict, read_any_config
from dhisparse.spec.speculator import Speculator

Shard = Callable[[dict[str, torch.Tensor], AnyConfig], dict[str, torch.Tensor]]


def load_engine_config(engine_dir: str | Path, **runtime_overrides: Any) -> EngineConfig:
    """The engine directory's ``runtime.json`` with ``runtime_overrides`` applied (``ConfigError`` names a bad one)."""
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise CheckpointError(f"{engine_dir}: engine directory not found")
    return EngineConfig.load(engine_dir / "runtime.json").with_overrides(**runtime_overrides)


def load_engine_parts(engine_dir: str | Path, max_slots: int | None = None, shard: Shard | None = None,
                      **runtime_overrides: Any) -> tuple[EngineConfig, Model, Speculator | None]:
    """``(config, model, speculator)`` for an engine directory (built by ``dhisparse-build``) or a Hugging Face
    checkpoint directory; ``runtime_overrides`` replace fields of its ``runtime.json``. ``max_slots`` sizes the
    drafter's ring (default: ``max_batch_size``). ``shard``: this rank's slice of the weights, taken before the
    model is built on the device (``engine/parallel/sharding.py``)."""
    engine_dir = Path(engine_dir)
    config = load_engine_config(engine_dir, **runtime_overrides)
    if config.world_size > 1 and shard is None:
        raise ConfigError(f"tensor_parallel_size {config.tensor_parallel_size} x data_parallel_size "
                          f"{config.data_parallel_size}: several ranks are started by LLM / dhisparse-serve and "
                          "by the disaggregated generation role (engine/parallel, disagg/ranks.py); this component "
                          "(e.g. the context role) runs one process")
    model_cfg = read_any_config(engine_dir)
    device = resolve_device(config.device)
    weights = load_any_state_dict(engine_dir, model_cfg, config.torch_dtype)
    if shard is not None:
        weights = shard(weights, model_cfg)
    model = build_model(model_cfg, weights, config.torch_dtype, device)
    speculator = None
    if config.speculative:
        speculator = Speculator(engine_dir / "drafters" / config.speculative, config.num_draft_tokens,
                                max_slots or config.max_batch_size, model_cfg, device, target_model=model,
                                max_context=config.max_model_len)
    return config, model, speculator

"""Load what both roles need from an engine directory: its runtime config, the model and (optionally) the drafter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dhisparse.device import resolve_device
from dhisparse.engine.config import EngineConfig
from dhisparse.errors import CheckpointError
from dhisparse.model.model import DSAModel
from dhisparse.model.weights import load_state_dict, read_config
from dhisparse.spec.speculator import Speculator


def load_engine_parts(engine_dir: str | Path, max_slots: int | None = None, **runtime_overrides: Any
                      ) -> tuple[EngineConfig, DSAModel, Speculator | None]:
    """``(config, model, speculator)`` as ``LLM(engine_dir, **runtime_overrides)`` builds them, without a KV
    manager. ``max_slots`` sizes the drafter's ring (default: ``max_batch_size``)."""
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise CheckpointError(f"{engine_dir}: engine directory not found")
    config = EngineConfig.load(engine_dir / "runtime.json").with_overrides(**runtime_overrides)
    model_cfg = read_config(engine_dir)
    device = resolve_device(config.device)
    model = DSAModel(model_cfg, load_state_dict(engine_dir, model_cfg, config.torch_dtype), config.torch_dtype, device)
    speculator = None
    if config.speculative:
        speculator = Speculator(
            engine_dir / "drafters" / config.speculative, config.num_draft_tokens,
            max_slots or config.max_batch_size, model_cfg, device, min_confidence=config.dspark_min_confidence,
            busy_confidence=config.dspark_busy_confidence, busy_batch=config.dspark_busy_batch)
    return config, model, speculator

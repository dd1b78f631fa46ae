"""Load what an engine is built from, from an engine directory: its runtime config, the model and (optionally) the
drafter (``LLM`` and both disaggregated roles)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dhisparse.device import resolve_device
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.executor import Model
from dhisparse.errors import CheckpointError
from dhisparse.model.loading import build_model, load_any_state_dict, read_any_config
from dhisparse.spec.speculator import Speculator


def load_engine_parts(engine_dir: str | Path, max_slots: int | None = None, **runtime_overrides: Any
                      ) -> tuple[EngineConfig, Model, Speculator | None]:
    """``(config, model, speculator)`` for an engine directory (built by ``dhisparse-build``) or a Hugging Face
    checkpoint directory; ``runtime_overrides`` replace fields of its ``runtime.json``. ``max_slots`` sizes the
    drafter's ring (default: ``max_batch_size``)."""
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise CheckpointError(f"{engine_dir}: engine directory not found")
    config = EngineConfig.load(engine_dir / "runtime.json").with_overrides(**runtime_overrides)
    model_cfg = read_any_config(engine_dir)
    device = resolve_device(config.device)
    model = build_model(model_cfg, load_any_state_dict(engine_dir, model_cfg, config.torch_dtype), config.torch_dtype,
                        device)
    speculator = None
    if config.speculative:
        speculator = Speculator(engine_dir / "drafters" / config.speculative, config.num_draft_tokens,
                                max_slots or config.max_batch_size, model_cfg, device, target_model=model,
                                max_context=config.max_model_len)
    return config, model, speculator

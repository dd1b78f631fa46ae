"""Drafter checkpoint directories: ``config.json`` (with ``drafter_type``) + ``model.safetensors``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import DFlash2Config, DSparkConfig
from .dflash2 import DFlash2Drafter
from .dspark import DSparkDrafter

Drafter = DFlash2Drafter | DSparkDrafter

DRAFTERS: dict[str, tuple[type, type]] = {
    "dflash2": (DFlash2Config, DFlash2Drafter),
    "dspark": (DSparkConfig, DSparkDrafter),
}
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def save_drafter(drafter: Drafter, directory: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (float32 as held) into ``directory``; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(drafter.config.to_dict(), indent=2) + "\n")
    tensors = {name: t.detach().contiguous().cpu() for name, t in drafter.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"drafter_type": drafter.drafter_type})
    return directory


def load_drafter(
    directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Drafter:
    """Load a drafter directory written by :func:`save_drafter`, in eval mode, on ``device`` in ``dtype``.

    Raises ValueError naming the problem for a missing file, an unknown ``drafter_type``, an invalid config,
    or missing / unexpected / mis-shaped tensors.
    """
    directory = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise ValueError(f"drafter directory {directory} has no {name}")
    data = json.loads((directory / CONFIG_FILE).read_text())
    kind = data.get("drafter_type")
    if kind not in DRAFTERS:
        raise ValueError(f"{directory / CONFIG_FILE}: unknown drafter_type {kind!r}; known: {sorted(DRAFTERS)}")
    config_cls, model_cls = DRAFTERS[kind]
    model = model_cls(config_cls.from_dict(data))
    tensors = load_file(str(directory / WEIGHTS_FILE))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{directory / WEIGHTS_FILE}: missing tensors {missing}, unexpected tensors {unexpected}")
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{directory / WEIGHTS_FILE}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"config implies {tuple(expected[name].shape)}"
            )
    model.load_state_dict(tensors)
    return model.to(device=device, dtype=dtype).eval()

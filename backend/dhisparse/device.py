"""Which torch device an engine runs on: ``device="auto"`` (the default) is the GPU when torch sees one.

One resolver for every entry point (``LLM``, ``dhisparse-build``'s ``runtime.json``, ``dhisparse-serve``, the
benches): ``auto`` → ``cuda`` (torch's current device) when ``torch.cuda.is_available()``, else ``cpu``; any other
name is a torch device string (``cpu``, ``cuda``, ``cuda:1``). The Triton model configuration follows the same
decision (:func:`triton_instance_group`): a GPU engine's model instance is ``KIND_GPU`` on that GPU.
"""

from __future__ import annotations

import torch

from dhisparse.errors import ConfigError

AUTO = "auto"


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch device of an engine option ``device`` (see the module docstring).

    Raises:
        ConfigError: ``name`` is neither ``auto`` nor a torch device string.
    """
    if isinstance(name, torch.device):
        return name
    if name == AUTO:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}") from exc
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}")
    return device


def triton_instance_group(device: torch.device) -> str:
    """The ``instance_group`` of a Triton model that runs an engine on ``device``: one ``KIND_GPU`` instance on that
    GPU, or one ``KIND_CPU`` instance."""
    if device.type == "cuda":
        return f"[ {{ count: 1 kind: KIND_GPU gpus: [ {device.index or 0} ] }} ]"
    return "[ { count: 1 kind: KIND_CPU } ]"

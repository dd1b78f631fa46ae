"""Packing a drafter into an engine directory (``dhisparse-build --drafter DIR``): recognise its format, check it
against the target with the same loader the engine serves it with, and write it under ``drafters/<family>/``.

A drafter that ships inside its target's checkpoint (DeepSeek-V4's ``mtp.*`` DSpark stages) is written as the
target's ``config.json`` plus only the drafter's tensors; any other drafter directory is copied as it is.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dhisparse.errors import CheckpointError, ConfigError
from dhisparse.model.weights import safetensors_files
from dhisparse.spec.drafters import load_drafter
from dhisparse.spec.published import PUBLISHED, family_of, load_published, read_drafter_config


def check_own_drafter(directory: Path, target: Any) -> None:
    """Our own drafter format against ``target``: tensors vs config (``load_drafter``), then sizes vs target."""
    try:
        drafter = load_drafter(directory)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc
    cfg, where = drafter.config, directory / "config.json"
    if cfg.target_hidden_size != target.hidden_size:
        raise ConfigError(f"{where}: target_hidden_size is {cfg.target_hidden_size}, the target's hidden size is "
                          f"{target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"{where}: vocab_size is {cfg.vocab_size}, the target's is {target.vocab_size}")
    bad = [i for i in cfg.target_layer_ids if i >= target.num_hidden_layers]
    if bad:
        raise ConfigError(f"{where}: target_layer_ids {list(cfg.target_layer_ids)} name layers {bad}; the target "
                          f"has {target.num_hidden_layers}")


def pack_drafter(source: Path, drafters_dir: Path, target: Any) -> Path:
    """Validate ``source`` against ``target`` (a parsed target config) and write it to ``drafters_dir/<family>``;
    returns that directory. ``ConfigError`` / ``CheckpointError`` name the field or tensor at fault; an unknown
    format is refused with the list of supported ones."""
    source = Path(source)
    raw, fmt = read_drafter_config(source)
    dest = drafters_dir / family_of(fmt)
    if dest.exists():
        raise CheckpointError(f"two drafters of family {family_of(fmt)!r} given ({source} is a {fmt} drafter)")
    if fmt in PUBLISHED:
        zeros = torch.zeros(target.vocab_size, target.hidden_size)  # the target's head is not needed to validate
        load_published(source, target, embed=zeros, lm_head=zeros)
    else:
        check_own_drafter(source, target)
    if fmt != "dspark-v4":
        shutil.copytree(source, dest)
        return dest
    dest.mkdir(parents=True)
    shutil.copy2(source / "config.json", dest / "config.json")
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(source):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if name.startswith(("mtp.", "model.mtp.")):
                    tensors[name] = handle.get_tensor(name)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt", "drafter": fmt})
    return dest

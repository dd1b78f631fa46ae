"""Loading a published drafter directory against its target: config, tensors, and the checks that tie them.

``load_published`` is the one path both ``dhisparse-build --drafter`` (validation before packing) and the
engine (serving) take, so a drafter that packs is a drafter that serves. Every refusal names the field or tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from dhisparse.errors import CheckpointError, ConfigError
from dhisparse.model.deepseek_v4.config import DeepseekV4Config
from dhisparse.model.weights import iter_tensors

from .dflash import DFlashDrafter
from .dspark import QwenDSparkDrafter
from .dspark_v4 import V4DSparkDrafter, V4DSparkSpec, v4_expected_shapes, v4_float32
from .formats import detect_format
from .qwen_block import qwen_expected_shapes
from .qwen_config import QwenDrafterConfig, parse_qwen_drafter
from .runtime_types import PublishedDrafter
from .tensors import read_tensors

_STAGE = re.compile(r"^(?:model\.)?mtp\.(\d+)\.attn_norm\.weight$")


def read_drafter_config(directory: Path) -> tuple[dict[str, Any], str]:
    """``(config.json as a dict, its format)``; ``CheckpointError`` / ``ConfigError`` naming the problem."""
    path = directory / "config.json"
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: drafter directory not found")
    if not path.is_file():
        raise CheckpointError(f"{directory}: drafter config.json not found")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from exc
    return raw, detect_format(raw, str(path))


def check_target_layers(ids: tuple[int, ...], field: str, target: Any, where: str, *, allow_last: bool) -> None:
    """Every id names a target layer (and, unless ``allow_last``, not the last one: transformers' hidden states
    give that layer after the final norm, which is what Qwen3-style drafters were trained on and what this runtime
    does not capture)."""
    n = target.num_hidden_layers
    limit = n if allow_last else n - 1
    bad = [i for i in ids if not 0 <= i < limit]
    if bad:
        rule = f"0..{limit - 1}" + ("" if allow_last else f" (not the final layer {n - 1}, nor -1: the embedding)")
        raise ConfigError(f"{where}: {field} {list(ids)} names layers {bad}; the {n}-layer target offers {rule}")


def _check_qwen(cfg: QwenDrafterConfig, target: Any, where: str) -> None:
    field = "target_layer_ids" if cfg.fmt == "dspark" else "dflash_config.target_layer_ids"
    check_target_layers(cfg.target_layer_ids, field, target, where, allow_last=False)
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_hidden_layers:
        raise ConfigError(f"{where}: num_target_layers is {cfg.num_target_layers}, the target has "
                          f"{target.num_hidden_layers} layers")
    if cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"{where}: vocab_size is {cfg.vocab_size}, the target's is {target.vocab_size}")
    if cfg.fmt != "dspark" and cfg.hidden_size != target.hidden_size:
        raise ConfigError(f"{where}: hidden_size is {cfg.hidden_size}, the target's is {target.hidden_size} "
                          "(the drafter runs on the target's embedding and LM head)")


def _v4_stages(directory: Path) -> int:
    stages = {int(m.group(1)) for name, _, _ in iter_tensors(directory) if (m := _STAGE.match(name))}
    if stages and stages != set(range(len(stages))):
        raise CheckpointError(f"{directory}: mtp stages {sorted(stages)} are not numbered 0..{len(stages) - 1}")
    return len(stages)


def load_published(directory: str | Path, target: Any, *, embed: torch.Tensor | None, lm_head: torch.Tensor | None,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> PublishedDrafter:
    """Load the published drafter in ``directory`` for ``target`` (a ``ModelConfig`` or ``DeepseekV4Config``).

    ``embed`` / ``lm_head`` are the target's ``[V, H]`` tensors (DFlash, DFlash2 and V4 DSpark run on them; for a
    build-time check, zeros of the right shape do). Raises ``ConfigError`` / ``CheckpointError`` naming the field or
    tensor at fault."""
    directory = Path(directory)
    raw, fmt = read_drafter_config(directory)
    where = str(directory / "config.json")
    if fmt.startswith("ours-"):
        raise ConfigError(f"{where}: {fmt} is this project's own format; load it with dhisparse.spec.drafters")
    needs_target_head = fmt != "dspark"
    if needs_target_head and (embed is None or lm_head is None):
        raise ConfigError(f"{where}: a {fmt} drafter runs on the target's embedding and LM head; none were given")
    if fmt == "dspark-v4":
        if not isinstance(target, DeepseekV4Config):
            raise ConfigError(f"{where}: a DeepSeek-V4 DSpark drafter needs a deepseek_v4 target (its features are "
                              f"the mean of V4's residual streams), got {getattr(target, 'model_type', type(target))}")
        cfg = DeepseekV4Config.from_hf_dict(raw)
        for name in ("hidden_size", "vocab_size", "num_hidden_layers", "hc_mult"):
            if getattr(cfg, name) != getattr(target, name):
                raise ConfigError(f"{where}: {name} is {getattr(cfg, name)}, the target's is {getattr(target, name)}")
        spec = V4DSparkSpec.parse(raw, cfg, _v4_stages(directory), where)
        check_target_layers(spec.target_layer_ids, "dspark_target_layer_ids", target, where, allow_last=True)
        w = read_tensors(directory, v4_expected_shapes(cfg, spec), dtype, keep=lambda n: n.startswith("mtp."),
                         float32=v4_float32)
        w = {k: v.to(device) for k, v in w.items()}
        assert embed is not None and lm_head is not None
        return V4DSparkDrafter(cfg, spec, w, embed.to(device), lm_head.to(device))
    qcfg = parse_qwen_drafter(raw, fmt, where)
    _check_qwen(qcfg, target, where)
    w = read_tensors(directory, qwen_expected_shapes(qcfg, target.hidden_size), dtype)
    w = {k: v.to(device) for k, v in w.items()}
    if fmt == "dspark":
        return QwenDSparkDrafter(qcfg, w)
    assert embed is not None and lm_head is not None
    return DFlashDrafter(qcfg, w, embed.to(device), lm_head.to(device))

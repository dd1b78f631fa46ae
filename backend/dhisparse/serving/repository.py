"""Fill the `model_repository/` templates for one engine.

The templates are tensorrtllm_backend-style: each model is `<name>/config.pbtxt` with `${placeholders}`
plus `<name>/1/model.py`. Filling copies the chosen models into an output directory and substitutes
every placeholder (a missing value is an error, never a silent blank). Runtime options for the engine
(`kv_policy`, `pool_bytes`, `speculative`, ...) become `parameters { key: "engine.<option>" ... }`
entries of the `dhisparse` model; its model.py parses each value as JSON when it can (numbers,
booleans), as a plain string otherwise, and passes them to `LLM(engine_dir, **overrides)`.
"""

from __future__ import annotations

import json
import shutil
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

import dhisparse
from dhisparse.device import resolve_device, triton_instance_group
from dhisparse.engine.config import EngineConfig
from dhisparse.serving.tokenization import TOKENIZER_FILE

LLM_MODEL = "dhisparse"
TEXT_MODELS = ("preprocessing", "postprocessing", "ensemble", "dhisparse_bls")


def default_templates_dir() -> Path:
    """The repository's `model_repository/` (next to `backend/`), where the templates live."""
    return Path(dhisparse.__file__).resolve().parents[2] / "model_repository"


def _pbtxt_string(value: str) -> str:
    """Escape `value` for use inside a double-quoted protobuf text-format string."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _override_text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def parse_override(text: str) -> object:
    """Inverse of the encoding used for `engine.<option>` parameters: JSON when it parses, else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@dataclass(frozen=True)
class RepositorySpec:
    """What to fill the templates with.

    Attributes:
        engine_dir: the engine directory (`config.json`, `runtime.json`, weights, optional `tokenizer.json`).
        engine_overrides: keyword overrides for `LLM(engine_dir, **overrides)`; values str/int/float/bool.
        triton_max_batch_size: `max_batch_size` of every model (the most prompts one request may carry).
        metrics_interval_ms: how often the metrics thread copies engine statistics to `/metrics`.
        add_special_tokens: whether preprocessing adds the tokenizer's special tokens (e.g. BOS).
        skip_special_tokens: whether postprocessing drops special tokens from the text.
        text_instance_count: instances of preprocessing, postprocessing and the BLS model each.
        exclude_input_in_output: the LLM model's default when a request does not send `exclude_input_in_output`
            (tensorrtllm_backend's model parameter of that name): true = outputs hold only generated tokens.
    """

    engine_dir: Path
    engine_overrides: Mapping[str, object] = field(default_factory=dict)
    triton_max_batch_size: int = 8
    metrics_interval_ms: int = 250
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    text_instance_count: int = 1
    exclude_input_in_output: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_dir", Path(self.engine_dir).resolve())
        object.__setattr__(self, "engine_overrides", dict(self.engine_overrides))
        if self.triton_max_batch_size < 1:
            raise ValueError(f"triton_max_batch_size must be >= 1, got {self.triton_max_batch_size}")
        if self.metrics_interval_ms < 10:
            raise ValueError(f"metrics_interval_ms must be >= 10, got {self.metrics_interval_ms}")
        if self.text_instance_count < 1:
            raise ValueError(f"text_instance_count must be >= 1, got {self.text_instance_count}")
        for key, value in self.engine_overrides.items():
            if not key.isidentifier():
                raise ValueError(f"engine override name {key!r} is not an identifier")
            if not isinstance(value, (str, int, float, bool)):
                raise TypeError(f"engine override {key}={value!r} must be a str, int, float or bool")

    @property
    def has_tokenizer(self) -> bool:
        """True when the engine ships `tokenizer.json`, so the text models can be served."""
        return (self.engine_dir / TOKENIZER_FILE).is_file()

    @property
    def engine_device(self) -> torch.device:
        """The device the engine will run on: the ``device`` override, else ``runtime.json``'s (default ``auto``:
        the GPU when this machine has one), resolved here the way ``LLM`` resolves it."""
        device = self.engine_overrides.get("device")
        if device is None:
            device = EngineConfig.load(self.engine_dir / "runtime.json").device
        return resolve_device(str(device))

    def values(self) -> dict[str, str]:
        """Placeholder name -> text for every template placeholder."""
        engine_parameters = "\n".join(
            f'parameters {{ key: "engine.{key}" value: {{ string_value: "{_pbtxt_string(_override_text(value))}" }} }}'
            for key, value in sorted(self.engine_overrides.items())
        )
        python_path = str(Path(dhisparse.__file__).resolve().parents[1])
        return {
            "triton_max_batch_size": str(self.triton_max_batch_size),
            "engine_dir": _pbtxt_string(str(self.engine_dir)),
            "tokenizer_dir": _pbtxt_string(str(self.engine_dir)),
            "engine_parameters": engine_parameters,
            "metrics_interval_ms": str(self.metrics_interval_ms),
            "add_special_tokens": str(self.add_special_tokens).lower(),
            "skip_special_tokens": str(self.skip_special_tokens).lower(),
            "python_path": _pbtxt_string(python_path),
            "preprocessing_instance_count": str(self.text_instance_count),
            "postprocessing_instance_count": str(self.text_instance_count),
            "bls_instance_count": str(self.text_instance_count),
            "exclude_input_in_output": str(self.exclude_input_in_output).lower(),
            "engine_instance_group": triton_instance_group(self.engine_device),
        }


def fill_model_repository(spec: RepositorySpec, output_dir: Path, templates_dir: Path | None = None,
                          models: tuple[str, ...] | None = None) -> list[str]:
    """Write a ready-to-serve model repository to `output_dir` and return the model names in it.

    By default the LLM model is always included and the text models (preprocessing, postprocessing,
    ensemble, BLS) only when the engine has a tokenizer. `output_dir` is replaced model by model; other
    entries in it are left alone.
    """
    templates = templates_dir or default_templates_dir()
    if models is None:
        models = (LLM_MODEL, *TEXT_MODELS) if spec.has_tokenizer else (LLM_MODEL,)
    values = spec.values()
    for name in models:
        source = templates / name
        if not (source / "config.pbtxt").is_file():
            raise FileNotFoundError(f"no template {source / 'config.pbtxt'}")
        target = output_dir / name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        template = string.Template((source / "config.pbtxt").read_text())
        try:
            (target / "config.pbtxt").write_text(template.substitute(values))
        except KeyError as error:
            raise ValueError(f"{source / 'config.pbtxt'} uses unknown placeholder {error}") from error
        (target / "1").mkdir(exist_ok=True)  # an ensemble's version directory is empty (git drops it)
    return list(models)

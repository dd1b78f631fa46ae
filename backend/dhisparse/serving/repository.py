"""Fill the `model_repository/` templates for one engine.

The templates are tensorrtllm_backend-style: each model is `<name>/config.pbtxt` with `${placeholders}`
plus `<name>/1/model.py`. Filling copies the chosen models into an output directory and substitutes
every placeholder (a missing value is an error, never a silent blank). Runtime options for the engine
(`kv_policy`, `pool_bytes`, `speculative`, ...) become `parameters { key: "engine.<option>" ... }`
entries of the `dhisparse` model; its model.py parses each value as JSON when it can (numbers,
booleans), as a plain string otherwise, and passes them to `LLM(engine_dir, **overrides)`.

Every Python model also gets the deployment's server parameters (`server_parameters`): the per-request limits
(`limit.<name>`, resolved against the engine), the internal key file (`auth_key_file`, a fresh random key in
`<repository>/.dhisparse/` unless one is given), the drain file the launcher creates on SIGTERM (`drain_file`), the
launcher's pid (`supervisor_pid`: the models drain when it is gone too) and the shutdown grace. The `.dhisparse/`
folder (mode 0700) also marks the repository as ours (`claim_repository`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

import dhisparse
from dhisparse.device import resolve_device, triton_instance_group
from dhisparse.engine.config import EngineConfig
from dhisparse.serving.internal_auth import KEY_FILE_PARAMETER, read_key_file, write_key_file
from dhisparse.serving.limits import RequestLimits
from dhisparse.serving.tokenization import TOKENIZER_FILE

LLM_MODEL = "dhisparse"
TEXT_MODELS = ("preprocessing", "postprocessing", "ensemble", "dhisparse_bls")
SERVER_DIR = ".dhisparse"  # inside the repository: ownership marker, internal key, drain file
MARKER, KEY_FILE, DRAIN_FILE = "repository", "internal.key", "drain"


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
        limits: per-request limits (`dhisparse.serving.limits`); 0-valued ones are derived from the engine.
        auth_key_file: the deployment's internal key (mode 0600); None: a fresh one in the repository. Give the
            same file to both servers of a two-host disaggregated deployment.
        shutdown_grace_s: on SIGTERM, how long open requests may still finish before they are answered with an error.
        allow_stop_by_request_id: honour tensorrtllm's `stop` input (stop the open request with this request id).
            Off by default: request ids are chosen by clients, so any client could stop another's request;
            clients cancel their own streams instead.
    """

    engine_dir: Path
    engine_overrides: Mapping[str, object] = field(default_factory=dict)
    triton_max_batch_size: int = 8
    metrics_interval_ms: int = 250
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    text_instance_count: int = 1
    exclude_input_in_output: bool = True
    limits: RequestLimits = RequestLimits()
    auth_key_file: Path | None = None
    shutdown_grace_s: float = 5.0
    allow_stop_by_request_id: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.shutdown_grace_s <= 3600:
            raise ValueError(f"shutdown_grace_s must be in [0, 3600], got {self.shutdown_grace_s}")
        if self.auth_key_file is not None:
            read_key_file(self.auth_key_file)  # ValueError naming the file when it is unusable
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

    def resolved_limits(self) -> RequestLimits:
        """`limits` with the derived values taken from the engine directory (max_model_len, vocabulary)."""
        def load(name: str) -> dict:
            path = self.engine_dir / name
            return json.loads(path.read_text()) if path.is_file() else {}

        model, runtime = load("config.json"), {**load("runtime.json"), **self.engine_overrides}
        positions = int(model.get("max_position_embeddings", 0) or 0)
        length = int(runtime.get("max_model_len", 0) or 0) or positions
        length = min(length, positions) if positions else length
        return self.limits.resolved(length, int(model.get("vocab_size", 0) or 0), self.triton_max_batch_size)

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
    server_parameters(spec, output_dir, models)
    return list(models)


def set_parameter(config: Path, key: str, value: str) -> None:
    """Set model parameter ``key`` of a filled ``config.pbtxt`` (replace its line, or append one)."""
    text = config.read_text()
    line = f'parameters {{ key: "{key}" value: {{ string_value: "{_pbtxt_string(value)}" }} }}'
    pattern = re.compile(rf'^parameters \{{ key: "{re.escape(key)}" value: \{{ string_value: "[^"]*" \}} \}}$', re.M)
    text, count = pattern.subn(lambda _: line, text)
    config.write_text(text if count else text.rstrip("\n") + "\n" + line + "\n")


def server_dir(output_dir: Path) -> Path:
    """The repository's private folder (mode 0700): marker, internal key, drain file."""
    path = Path(output_dir) / SERVER_DIR
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def server_parameters(spec: RepositorySpec, output_dir: Path, models: tuple[str, ...] | list[str]) -> None:
    """Write the private folder (marker, key unless given; a stale drain file removed) and set the server
    parameters (module docstring) on every Python model among ``models``."""
    private = server_dir(output_dir)
    (private / MARKER).write_text("a dhisparse-serve model repository: dhisparse-serve may replace what is here\n")
    (private / DRAIN_FILE).unlink(missing_ok=True)
    key_file = Path(spec.auth_key_file).resolve() if spec.auth_key_file else write_key_file(private / KEY_FILE)
    values = {KEY_FILE_PARAMETER: str(key_file), "drain_file": str((private / DRAIN_FILE).resolve()),
              "supervisor_pid": str(os.getpid()), "shutdown_grace_s": f"{spec.shutdown_grace_s:g}",
              "allow_stop_by_request_id": str(spec.allow_stop_by_request_id).lower(),
              **spec.resolved_limits().parameters()}
    for name in models:
        config = Path(output_dir) / name / "config.pbtxt"
        if 'backend: "python"' not in config.read_text():
            continue  # the ensemble
        for key, value in values.items():
            set_parameter(config, key, value)


def drain_file(model_repository: Path) -> Path:
    """Where the launcher signals a drain (SIGTERM) to the models of ``model_repository``."""
    return Path(model_repository) / SERVER_DIR / DRAIN_FILE


def claim_repository(output_dir: Path, models: tuple[str, ...] | list[str]) -> None:
    """Make ``output_dir`` fit to receive ``models``: it must be new, empty, or written by us before (its
    `.dhisparse/repository` marker); in ours, every entry that is not among ``models`` is removed (a model left from
    another configuration would be served too). ValueError for a foreign directory, which is never touched."""
    output_dir = Path(output_dir)
    if not output_dir.exists():
        return
    if not output_dir.is_dir():
        raise ValueError(f"--model-repo {output_dir} is not a directory")
    entries = list(output_dir.iterdir())
    if entries and not (output_dir / SERVER_DIR / MARKER).is_file():
        raise ValueError(f"--model-repo {output_dir} is not empty and was not written by dhisparse-serve (no "
                         f"{SERVER_DIR}/{MARKER}): give a new or empty directory")
    for entry in entries:
        if entry.name == SERVER_DIR or entry.name in models:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()

"""Engine building: checkpoint → engine directory.

An engine directory holds ``config.json`` (the model's Hugging Face config, unchanged), ``model.safetensors``
(weights validated and converted to the engine dtype, routed experts stacked per layer), ``runtime.json`` (the
KV/serving defaults, an ``EngineConfig``), the tokenizer files when the checkpoint has them, and
``drafters/<family>/`` for each drafter packed with the target (``dhisparse.spec.packing``: recognised by format,
validated against the target, refused with the supported formats when unknown).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from dhisparse.engine.config import EngineConfig
from dhisparse.errors import CheckpointError
from dhisparse.model.loading import load_any_state_dict, read_any_config
from dhisparse.spec.packing import pack_drafter

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # Hugging Face's file name; the OpenAI API's chat template


@dataclass(frozen=True)
class BuildOptions:
    checkpoint: Path
    output: Path
    runtime: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields (dtype, kv_policy, …)
    drafters: tuple[Path, ...] = ()
    force: bool = False
    chat_template: Path | None = None  # a Jinja2 chat template file, written as the engine's chat_template.jinja


def _stderr_progress(label: str) -> Callable[[int, int], None]:
    state = {"last": 0.0}

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - state["last"] > 0.5:
            state["last"] = now
            print(f"\r{label}: {done}/{total} tensors ({100 * done // total}%)", end="", file=sys.stderr,
                  flush=True)
            if done == total:
                print(file=sys.stderr)

    return report


def build_engine(opts: BuildOptions, progress: Callable[[int, int], None] | None = None) -> Path:
    """Build the engine; raises ``CheckpointError``/``ConfigError`` with the reason on bad input. The output is
    written to a temporary directory next to ``output`` and moved into place only when complete."""
    output = opts.output
    if opts.chat_template is not None and not opts.chat_template.is_file():
        raise CheckpointError(f"chat template file {opts.chat_template} not found")
    if output.exists() and not opts.force:
        raise CheckpointError(f"{output} already exists; pass --force to overwrite it")
    if output.exists():
        refuse_to_replace(output)
    runtime = EngineConfig().with_overrides(**opts.runtime)  # validates the options before the long work
    cfg = read_any_config(opts.checkpoint)
    weights = load_any_state_dict(opts.checkpoint, cfg, runtime.torch_dtype,
                              progress=progress or _stderr_progress("converting"))
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        raw_config = json.loads((opts.checkpoint / "config.json").read_text())
        (staging / "config.json").write_text(json.dumps(raw_config, indent=2, sort_keys=True))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(staging / "model.safetensors"),
                  metadata={"format": "pt", "producer": "dhisparse-build"})
        (staging / "runtime.json").write_text(runtime.to_json())
        for name in TOKENIZER_FILES:
            if (opts.checkpoint / name).exists():
                shutil.copy2(opts.checkpoint / name, staging / name)
        if opts.chat_template is not None:
            shutil.copy2(opts.chat_template, staging / CHAT_TEMPLATE_FILE)
        for drafter in opts.drafters:
            pack_drafter(drafter, staging / "drafters", cfg)
        if runtime.speculative and not (staging / "drafters" / runtime.speculative).is_dir():
            raise CheckpointError(f"speculative={runtime.speculative!r} needs a drafter of that family; pack one "
                                  "with --drafter DIR")
        if output.exists():
            shutil.rmtree(output)
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


ENGINE_FILES = ("config.json", "runtime.json", "model.safetensors")  # what every engine directory holds


def refuse_to_replace(output: Path) -> None:
    """``--force`` replaces an engine directory only: anything else (a file, a link, a directory without an engine's
    files, or with anything but an engine's entries) is refused with CheckpointError, and left untouched."""
    if output.is_symlink() or not output.is_dir():
        raise CheckpointError(f"--force replaces only an engine directory; {output} is not a directory")
    missing = [name for name in ENGINE_FILES if not (output / name).is_file()]
    if missing:
        raise CheckpointError(f"--force replaces only an engine directory; {output} has no {missing[0]} (choose "
                              "another --output, or remove it yourself)")
    known = {*ENGINE_FILES, *TOKENIZER_FILES, "drafters"}
    foreign = sorted(p.name for p in output.iterdir() if p.name not in known)
    if foreign:
        raise CheckpointError(f"--force replaces only an engine directory; {output} also holds {foreign[0]!r}")


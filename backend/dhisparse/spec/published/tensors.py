"""Reading a drafter checkpoint's tensors by name, checked against the shapes its config implies.

Every problem is collected and reported at once, each line naming the tensor (missing, mis-shaped, stored in a
dtype the runtime does not read, or unexpected); names may carry a ``model.`` prefix (some exporters add one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from dhisparse.errors import CheckpointError
from dhisparse.model.weights import iter_tensors

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent buffers some exporters still write


def read_tensors(directory: Path, expected: dict[str, tuple[int, ...]], dtype: torch.dtype, *,
                 keep: Callable[[str], bool] = lambda name: True, prefixes: Iterable[str] = ("", "model."),
                 float32: Callable[[str], bool] = lambda name: False) -> dict[str, torch.Tensor]:
    """Load exactly the tensors of ``expected`` (name -> shape) from ``directory``'s safetensors files into
    ``dtype`` (``float32(name)`` keeps a tensor in float32). Tensors for which ``keep(name)`` is false are not this
    drafter's (a target checkpoint's own weights) and are skipped; any other tensor not in ``expected`` is an
    error. Raises ``CheckpointError`` listing every problem."""
    found: dict[str, tuple[Callable[[], torch.Tensor], tuple[int, ...], str]] = {}
    problems: list[str] = []
    prefixes = tuple(prefixes)
    for stored, load, shape in iter_tensors(directory):
        name = stored
        for prefix in sorted(prefixes, key=len, reverse=True):
            if prefix and stored.startswith(prefix) and stored[len(prefix):] in expected:
                name = stored[len(prefix):]
                break
        if name in expected:
            if name in found:
                problems.append(f"{stored}: stored twice (also as {found[name][2]})")
            found[name] = (load, shape, stored)
        elif keep(name) and not name.endswith(IGNORED_SUFFIXES):
            problems.append(f"{stored}: unexpected tensor for this drafter's config")
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"{name}: missing")
            continue
        load, got, stored = found[name]
        if tuple(got) != tuple(shape):
            problems.append(f"{stored}: shape {list(got)}, the config implies {list(shape)}")
            continue
        tensor = load()
        if not tensor.is_floating_point() or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            problems.append(f"{stored}: stored as {tensor.dtype}; drafter weights must be float16/bfloat16/float32 "
                            "(dequantise the checkpoint first)")
            continue
        out[name] = tensor.to(torch.float32 if float32(name) else dtype).contiguous()
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(f"{directory}: drafter tensors do not match its config.json:\n  {shown}{more}")
    return out

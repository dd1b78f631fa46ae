"""Measured GPU figures in place of modelled ones (``--measured FILE``; issue 28 with the keys of issue 25).

``scripts/gpu_check.py --bench-only`` writes ``docs/results/gpu_check/<date>.json``. The planner reads from it:

- ``gather_gbps``: host gathers by row bytes and batch (``{"656": {"128": 31.5, ...}, ...}``); the largest batch's
  figure for the model's row size replaces the modelled effective host link (``HardwareSpec.host_link_bytes_per_s``).
  Without it, ``mapped_host.mapped_gather_<row bytes>B`` (the gather of rows from the host store mapped into the
  device, records ``{"rows", "us", "gb_s"}``: what the committed ``docs/results/gpu_check/gpu_check.json`` has)
  gives the rate the same way, at its largest row count.
- ``glm5_stack``: the paper's experiment per layer on real hardware, as records ``{"policy": "hisparse",
  "speculative": null | "dflash2", "batch": 128, "history": 32768, "layer_step_ms": 0.61, "host_share": 0.13}``
  (a list, or the same nested by policy label / batch / history). A record gives the measured decode (or
  verification) time of one layer of the GLM-5-shaped stack, KV side and attention included; the step of the whole
  model is then ``num_layers x layer_step_ms`` plus what the stack did not run, modelled: the step overhead and the
  MoE / dense weights (:func:`measured_step_s`).

:func:`measured_claims` turns the records into the headline ratios they allow (same batch and history for both
sides; speculative output per step from the speculation model), so the claims table can say which rows rest on
measurements. ``commit`` names the code the figures came from ("not recorded" when the file has none). A file
needs ``glm5_stack`` or a gather rate for the model's rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dhisparse_planner.specs import HardwareSpec, ModelSpec
from dhisparse_planner.speculation import SpeculationModel
from dhisparse_planner.timing import weight_bytes_read

NO_COMMIT = "not recorded"


@dataclass(frozen=True)
class StackPoint:
    """One measured point of the GLM-5-shaped stack (see the module docstring)."""

    label: str  # policy[+drafter]
    batch: int
    history: int
    layer_step_ms: float
    host_share: float


@dataclass(frozen=True)
class Measured:
    """What the planner takes from one GPU check: its ``commit``, ``source`` file, the measured host-gather rate
    for the model's rows (bytes/s, or None), where that rate comes from (``gather_note``: key and row count) and
    the stack's points."""

    commit: str
    source: str
    gather_bytes_per_s: float | None
    stack: tuple[StackPoint, ...]
    gather_note: str = ""

    def point(self, label: str, batch: int, history: int) -> StackPoint | None:
        return next((p for p in self.stack if (p.label, p.batch, p.history) == (label, batch, history)), None)


def _records(stack: object) -> list[dict]:
    """``glm5_stack`` as a list of records (a list as is; a mapping label -> batch -> history -> values flattened)."""
    if isinstance(stack, list):
        return [dict(r) for r in stack]
    if not isinstance(stack, dict):
        raise ValueError("glm5_stack must be a list of records or a mapping label -> batch -> history -> values")
    out = []
    for label, by_batch in stack.items():
        policy, _, drafter = str(label).partition("+")
        for batch, by_history in by_batch.items():
            for history, values in by_history.items():
                out.append({"policy": policy, "speculative": drafter or None, "batch": int(batch),
                            "history": int(history), **values})
    return out


def gather_rate(data: dict, row_bytes: int) -> tuple[float, str] | None:
    """The measured host-gather rate for rows of ``row_bytes`` (bytes/s) and where it comes from, or None:
    ``gather_gbps`` at its largest batch, else ``mapped_host.mapped_gather_<row_bytes>B`` at its largest row count."""
    by_rows = data.get("gather_gbps", {}).get(str(row_bytes))
    if by_rows:
        batch = max(by_rows, key=lambda b: int(b))
        return 1e9 * float(by_rows[batch]), f"gather_gbps[{row_bytes}][{batch}]"
    mapped = (data.get("mapped_host") or {}).get(f"mapped_gather_{row_bytes}B")
    if mapped:
        for i, r in enumerate(mapped):
            if "rows" not in r or "gb_s" not in r or not float(r["gb_s"]) > 0:
                raise ValueError(f"mapped_host.mapped_gather_{row_bytes}B record {i} needs rows and gb_s > 0, got {r}")
        top = max(mapped, key=lambda r: int(r["rows"]))
        return 1e9 * float(top["gb_s"]), f"mapped_host.mapped_gather_{row_bytes}B at {int(top['rows']):,} rows"
    return None


def load_measured(path: Path, row_bytes: int) -> Measured:
    """Read a GPU check's JSON; ValueError naming the key at fault when it lacks what the planner needs
    (``glm5_stack`` or a gather rate for ``row_bytes`` rows)."""
    data = json.loads(Path(path).read_text())
    rate = gather_rate(data, row_bytes)
    if "glm5_stack" not in data and rate is None:
        raise ValueError(f"{path}: no glm5_stack and no gather rate for {row_bytes}-byte rows (issue 25's keys: "
                         f"commit, gather_gbps, glm5_stack; or mapped_host.mapped_gather_{row_bytes}B)")
    points = []
    for i, r in enumerate(_records(data.get("glm5_stack", []))):
        for key in ("policy", "batch", "history", "layer_step_ms"):
            if key not in r:
                raise ValueError(f"{path}: glm5_stack record {i} has no {key!r}")
        if not float(r["layer_step_ms"]) > 0:
            raise ValueError(f"{path}: glm5_stack record {i}: layer_step_ms must be > 0, got {r['layer_step_ms']}")
        label = str(r["policy"]) + (f"+{r['speculative']}" if r.get("speculative") else "")
        points.append(StackPoint(label, int(r["batch"]), int(r["history"]), float(r["layer_step_ms"]),
                                 float(r.get("host_share", float("nan")))))
    gather, note = rate if rate is not None else (None, "")
    return Measured(str(data.get("commit", NO_COMMIT)), str(path), gather, tuple(points), note)


def with_measured_link(hw: HardwareSpec, measured: Measured) -> HardwareSpec:
    """``hw`` with the measured host-gather rate as its effective host link (unchanged when none was measured)."""
    if measured.gather_bytes_per_s is None:
        return hw
    return replace(hw, host_link_bytes_per_s=measured.gather_bytes_per_s)


def measured_step_s(hw: HardwareSpec, model: ModelSpec, point: StackPoint) -> float:
    """One decode / verification step of the whole model at the point's batch: the measured layers plus what the
    stack did not run (step overhead; the MoE / dense weights the batch reads, over HBM)."""
    weights = weight_bytes_read(model, point.batch) - model.attention_params * model.weight_bytes_per_param \
        / model.attn_tp
    return model.num_layers * point.layer_step_ms * 1e-3 + hw.step_overhead_s + weights / hw.hbm_bytes_per_s


def tokens_per_step(label: str, history: int, speculation: SpeculationModel) -> float:
    """Mean output tokens per request and step: 1, or the speculation model's accepted length at ``history``."""
    drafter = label.partition("+")[2]
    if not drafter:
        return 1.0
    spec = speculation.with_drafter(drafter)
    return float(spec.mean_accepted(torch.tensor([history]))[0])


def measured_claims(measured: Measured, hw: HardwareSpec, model: ModelSpec,
                    speculation: SpeculationModel) -> dict[str, float]:
    """The headline output ratios the measured points allow: ``num / den`` output at the same batch and history
    (``<num> / <den> output, <history>K C<batch> (measured per-layer step)``)."""
    out: dict[str, float] = {}
    pairs = (("adaptive+dflash2", "hisparse"), ("adaptive", "hisparse"), ("adaptive+dflash2", "adaptive"),
             ("resident+dflash2", "adaptive+dflash2"))
    for num, den in pairs:
        for p in measured.stack:
            if p.label != num:
                continue
            q = measured.point(den, p.batch, p.history)
            if q is None:
                continue
            rate = tokens_per_step(num, p.history, speculation) / measured_step_s(hw, model, p)
            base = tokens_per_step(den, q.history, speculation) / measured_step_s(hw, model, q)
            out[f"{num} / {den} output, {p.history // 1024}K C{p.batch} (measured per-layer step)"] = rate / base
    return out


def newest_gpu_check(folder: Path, row_bytes: int | None = None) -> Path | None:
    """The newest ``*.json`` of ``folder`` that carries ``glm5_stack`` or, given ``row_bytes``, a gather rate for
    such rows (None: nothing measured yet)."""
    found = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            if "glm5_stack" in data or (row_bytes is not None and gather_rate(data, row_bytes) is not None):
                found.append(path)
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return found[-1] if found else None

"""The paper's experiments (see ``/work/shared/seeds`` and DESIGN.md "Baselines"), run with the planner.

Shared setup: one H200 (:data:`~dhisparse_planner.specs.H200`), GLM-5.x IndexShare NVFP4 (the paper's GLM-5.3
is not public), page 64 rows, B = 4096 rows (HiSparse's published ``device_buffer_size``) with and without a
drafter (the rows of a verification step that the hot cache cannot take go to verification staging), SGLang's
reference command's limits (480 running, 65,536 prefill tokens per step), drafter DFlash2 verifying its block of 8
(gamma = 7, acceptance from the published figures: speculation.py), the HiSparse baseline admitting by SGLang's
token budget (admission.py), 2 closed-loop requests per client (claims read the steady state), token scale g = 64;
the locality is the calibrated one the caller passes (``locality.CALIBRATED``; ``OVERLAPS`` are the older defaults
of the functions below).

Experiments:

- :func:`glm_32k` — 32K in / 8K out at C8 ... C128, the five configurations;
- :func:`glm_100k` — 100K in / 8K out at C128;
- :func:`tpot_bounds` — throughput and concurrency sustained under mean-TPOT bounds (from :func:`glm_32k`);
- :func:`load_step` — closed-loop clients 4 -> 64 -> 4: host-fetched share per phase, memory split over time;
- :func:`deepseek_500k` — DeepSeek-V3.2, 500K context at C512 with a DSpark drafter: what fits, and the largest
  concurrency that does, simulated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dhisparse.kv import KVConfig
from dhisparse.kv.footprint import request_footprint
from dhisparse_planner.admission import TokenBudget
from dhisparse_planner.batch import Job
from dhisparse_planner.claims import DP, LONG
from dhisparse_planner.locality import LocalityModel
from dhisparse_planner.report import (
    PlanGrid,
    grid_points,
    label_uses_host,
    parse_config,
    recommend,
    run_grid,
    run_one,
)
from dhisparse_planner.scale import ScaleSpec, build_scaled_kv
from dhisparse_planner.simulator import SimResult, simulate
from dhisparse_planner.specs import DRAFTERS, DSV32, GLM5_INDEXSHARE_NVFP4, H200, HardwareSpec, ModelSpec
from dhisparse_planner.speculation import ACCEPTANCE, SpeculationModel
from dhisparse_planner.workload import ServingSpec, WorkloadSpec

CONFIGS = ("resident", "resident+dflash2", "hisparse", "adaptive", "adaptive+dflash2")
OVERLAPS = (0.6, 0.8, 0.95)
# The paper's setup where it departs from the engine's defaults (dhisparse.defaults), named, with its source.
# SGLang's reference HiSparse command for one 8xH200 instance (LMSYS blog "HiSparse: Turbocharging Sparse Attention
# with Hierarchical Memory", 2026-04-10): --max-running-requests 480 --chunked-prefill-size 65536, device_buffer_size
# 4096 (B). The engine's defaults (32 running, 4096 prefill tokens per step) would cap the paper's C64 / C128.
PAPER_MAX_RUNNING_REQUESTS = 480
PAPER_PREFILL_TOKENS_PER_STEP = 65536
PAPER_HOT_ROWS = 4096
PAPER_GAMMA = ACCEPTANCE["dflash2"].gamma  # DFlash2's block of 8: 7 drafts + the bonus token (speculation.py)
BASE = ServingSpec(hot_rows=PAPER_HOT_ROWS, max_batch_size=PAPER_MAX_RUNNING_REQUESTS,
                   max_prefill_tokens_per_step=PAPER_PREFILL_TOKENS_PER_STEP)
SPEC = SpeculationModel(drafter="dflash2", gamma=PAPER_GAMMA)
# The HiSparse baseline is SGLang's HiSparse: it admits by SGLang's token budget (admission.py), with the reference
# 8xH200 command's host_to_device_ratio of 8 (the PD decode command and sglang PR #33075 use 10).
PAPER_HOST_TO_DEVICE_RATIO = 8.0
# Closed-loop clients send this many requests each (waves): claims read the steady state between the first completion
# and the last issue (metrics.py), TTFT including the wait for admission.
PAPER_REQUESTS_PER_CLIENT = 2
ADMISSION = (("hisparse", TokenBudget(host_to_device_ratio=PAPER_HOST_TO_DEVICE_RATIO)),)
SCALE = ScaleSpec(token_scale=64)
GIB = 2.0**30
Row = dict[str, float | str]


def glm_grid(input_tokens: int, concurrencies: tuple[int, ...], overlaps: tuple[float, ...] = OVERLAPS,
             configs: tuple[str, ...] = CONFIGS, locality: LocalityModel | None = None,
             speculation: SpeculationModel = SPEC, admission: tuple[tuple[str, TokenBudget], ...] = ADMISSION,
             requests_per_client: int = PAPER_REQUESTS_PER_CLIENT) -> PlanGrid:
    base = BASE if locality is None else dataclasses.replace(BASE, locality=locality)
    return PlanGrid(configs=configs, concurrencies=concurrencies, overlaps=overlaps, input_tokens=input_tokens,
                    output_tokens=8192, requests_per_client=requests_per_client, base_serving=base,
                    speculation=speculation, admission=admission, scale=SCALE)


@dataclass(frozen=True)
class Sweep:
    """One sweep of the paper setup: ``configs`` x instance ``concurrencies`` at ``input_tokens`` / 8K out and one
    ``locality``, with attention tensor-parallel over the 8 GPUs (``attention_dp`` 1) or data-parallel (8: each
    GPU's pool serves ``C / 8`` of the instance's requests). Its rows carry the instance's concurrency and labels
    suffixed :data:`~dhisparse_planner.claims.LONG` (100K) and :data:`~dhisparse_planner.claims.DP`.

    ``hw``, ``speculation``, ``admission`` and ``requests_per_client`` are the paper scenario's unless changed (the
    ablation, ``scripts/planner_ablation.py``, reverts one fix of issue 28 at a time through them)."""

    input_tokens: int
    configs: tuple[str, ...]
    concurrencies: tuple[int, ...]
    locality: LocalityModel
    attention_dp: int = 1
    hw: HardwareSpec = H200
    speculation: SpeculationModel = SPEC
    admission: tuple[tuple[str, TokenBudget], ...] = ADMISSION
    requests_per_client: int = PAPER_REQUESTS_PER_CLIENT

    @property
    def model(self) -> ModelSpec:
        return GLM5_INDEXSHARE_NVFP4.with_(attention_dp=self.attention_dp)

    @property
    def suffix(self) -> str:
        return (LONG if self.input_tokens > 32768 else "") + (DP if self.attention_dp > 1 else "")

    def grid(self) -> PlanGrid:
        per_rank = tuple(c // self.attention_dp for c in self.concurrencies)
        if min(per_rank) < 1 or any(c % self.attention_dp for c in self.concurrencies):
            raise ValueError(f"Sweep: concurrencies {self.concurrencies} must be multiples of {self.attention_dp}")
        return glm_grid(self.input_tokens, per_rank, (self.locality.overlap,), self.configs, self.locality,
                        self.speculation, self.admission, self.requests_per_client)

    def jobs(self) -> list[Job]:
        return [Job(self.hw, self.model, s, w, SCALE) for _, _, _, s, w, new in grid_points(self.grid(), self.model)
                if new]

    def run(self, log: bool = False) -> tuple[list[Row], dict[tuple[str, int, float], SimResult]]:
        rows, results = run_grid(self.hw, self.model, self.grid(), log=log)
        dp, sfx = self.attention_dp, self.suffix
        out = [dict(r, label=f"{r['label']}{sfx}", concurrency=int(float(r["concurrency"])) * dp) for r in rows]
        return out, {(k[0] + sfx, k[1] * dp, k[2]): v for k, v in results.items()}


SWEEP_CONCURRENCIES = (8, 16, 32, 64, 128)
HOST_CONFIGS = ("hisparse", "adaptive", "adaptive+dflash2")


def reproduction_sweeps(locality: LocalityModel, corners: tuple[LocalityModel, LocalityModel],
                        quick: bool = False) -> dict[str, Sweep]:
    """The sweeps ``scripts/reproduce_paper.py`` runs: every configuration at 32K and the host-backed ones at 100K
    over C8-C128 (tensor-parallel attention, the calibrated locality); the headline points again at the calibrated
    box's two corners (``corners``: least and most locality); the claims' points with data-parallel attention."""
    if quick:
        return {"32K": Sweep(32768, CONFIGS, (8, 16), locality)}
    headline = (8, 32, 64, 128)
    sweeps = {"32K": Sweep(32768, CONFIGS, SWEEP_CONCURRENCIES, locality),
              "100K": Sweep(102400, HOST_CONFIGS, SWEEP_CONCURRENCIES, locality)}
    for corner, tag in zip(corners, ("low", "high"), strict=True):
        sweeps[f"32K {tag} locality"] = Sweep(32768, HOST_CONFIGS, headline, corner)
        sweeps[f"100K {tag} locality"] = Sweep(102400, HOST_CONFIGS, (128,), corner)
    sweeps["32K DP8"] = Sweep(32768, ("resident+dflash2",) + HOST_CONFIGS, headline, locality, attention_dp=8)
    sweeps["100K DP8"] = Sweep(102400, HOST_CONFIGS, (128,), locality, attention_dp=8)
    return sweeps


def glm_32k(concurrencies: tuple[int, ...] = (8, 16, 32, 64, 128), overlaps: tuple[float, ...] = OVERLAPS,
            log: bool = False, locality: LocalityModel | None = None
            ) -> tuple[list[Row], dict[tuple[str, int, float], SimResult]]:
    return run_grid(H200, GLM5_INDEXSHARE_NVFP4, glm_grid(32768, concurrencies, overlaps, locality=locality), log=log)


def glm_100k(overlaps: tuple[float, ...] = OVERLAPS, log: bool = False, locality: LocalityModel | None = None,
             configs: tuple[str, ...] = CONFIGS) -> tuple[list[Row], dict[tuple[str, int, float], SimResult]]:
    return run_grid(H200, GLM5_INDEXSHARE_NVFP4, glm_grid(102400, (128,), overlaps, configs, locality), log=log)


def ratio_table(rows: list[Row], num: str, den: str, metric: str = "output_tok_per_s_per_gpu") -> list[Row]:
    """``metric(num) / metric(den)`` per concurrency and overlap."""
    index = {(r["label"], r["concurrency"], r["overlap"]): float(r[metric]) for r in rows}
    out: list[Row] = []
    for (label, c, overlap), value in index.items():
        if label == num and (den, c, overlap) in index and index[(den, c, overlap)] > 0:
            out.append({"num": num, "den": den, "metric": metric, "concurrency": c, "overlap": overlap,
                        "ratio": value / index[(den, c, overlap)]})
    return out


def tpot_bounds(rows: list[Row], bounds_s: tuple[float, ...] = (0.02, 0.03, 0.05, 0.1)) -> list[Row]:
    """Per bound and config: the best per-GPU output (and its concurrency) whose mean TPOT stays within the
    bound at the worst overlap; ``output_tok_per_s_per_gpu = 0`` when no concurrency meets it."""
    out: list[Row] = []
    for bound in bounds_s:
        for label in dict.fromkeys(str(r["label"]) for r in rows):
            best = recommend([r for r in rows if r["label"] == label], bound)
            out.append({"tpot_bound_ms": 1e3 * bound, "label": label,
                        "concurrency": 0 if best is None else best["concurrency"],
                        "output_tok_per_s_per_gpu": 0.0 if best is None else best["output_tok_per_s_per_gpu"]})
    return out


def load_step(overlaps: tuple[float, ...] = OVERLAPS, low: int = 4, high: int = 64, up_s: float = 40.0,
              down_s: float = 120.0, log: bool = False,
              locality: LocalityModel = LocalityModel()) -> tuple[list[Row], dict[str, SimResult]]:
    """Clients ``low`` until ``up_s``, ``high`` until ``down_s``, then ``low`` again (32K / 8K, no drafter).

    Phases (by step time): ``low-before`` (t < up_s), ``high`` (up_s <= t < end of the last high-phase request's
    admission + its decode), ``low-after`` (batch back at <= ``low``, after ``down_s``). The host-fetched share of a
    phase is the batch-weighted mean of its steps' shares.
    """
    rows: list[Row] = []
    results: dict[str, SimResult] = {}
    total = 2 * low + high
    for policy in ("hisparse", "adaptive"):
        for overlap in overlaps:
            serving = dataclasses.replace(parse_config(policy, BASE, SPEC, ADMISSION),
                                          locality=dataclasses.replace(locality, overlap=overlap))
            work = WorkloadSpec(32768, 8192, concurrency=low, num_requests=total,
                                concurrency_schedule=((up_s, high), (down_s, low)))
            res = simulate(H200, GLM5_INDEXSHARE_NVFP4, serving, work, SCALE)
            results[f"{policy} overlap {overlap:g}"] = res
            phases = {"low-before": [p for p in res.timeline if p.time_s < up_s],
                      "high": [p for p in res.timeline if up_s <= p.time_s and p.batch > low],
                      "low-after": [p for p in res.timeline if p.time_s >= down_s and p.batch <= low]}
            for phase, pts in phases.items():
                weight = sum(p.batch for p in pts)
                rows.append({"label": policy, "overlap": overlap, "phase": phase, "steps": len(pts),
                             "host_share": sum(p.host_share * p.batch for p in pts) / weight if weight else 0.0,
                             "mean_optional_gib": sum(p.optional_bytes for p in pts) / max(1, len(pts)) / GIB,
                             "reclaim_events": res.counters["reclaim_events"]})
                if log:
                    print(f"  load-step {policy:>8} overlap {overlap:.2f} {phase:>10}: host "
                          f"{100 * float(rows[-1]['host_share']):5.2f}% over {len(pts)} steps", flush=True)
    return rows, results


def footprints(model: ModelSpec, input_tokens: int, output_tokens: int, gamma: int) -> list[Row]:
    """Required device bytes per request under each policy (analytic, real units) and how many fit one GPU."""
    drafter = DRAFTERS["dspark"]
    pool = model.kv_pool_bytes(H200, drafter.weight_bytes)
    out: list[Row] = []
    for policy, q in (("resident", gamma + 1), ("hisparse", 1), ("adaptive", gamma + 1)):
        ring = drafter.ring_bytes if q > 1 else 0.0
        probe = build_scaled_kv(model, ScaleSpec(), policy, pool, max(4096, model.index_topk), 64, 0, 0, q, ring)
        cfg: KVConfig = probe.real_config
        fp = request_footprint(probe.real_layout, cfg, input_tokens, output_tokens)
        out.append({"model": model.name, "policy": policy, "query_len": q, "required_gib": fp.required_bytes / GIB,
                    "speculative_gib": fp.speculative_bytes / GIB,
                    "index_key_gib": fp.index_key_bytes / GIB, "pool_gib": pool / GIB,
                    "max_concurrency": int(pool // fp.required_bytes)})
    return out


def deepseek_500k(concurrency: int = 0, output_tokens: int = 2048, overlaps: tuple[float, ...] = OVERLAPS,
                  log: bool = False, locality: LocalityModel = LocalityModel()) -> tuple[list[Row], list[Row]]:
    """DeepSeek-V3.2 at 500K: the footprints (C512 does not fit any policy), then resident+dspark, hisparse and
    adaptive+dspark simulated at ``concurrency`` (0: the largest that adaptive admits at once)."""
    prompt = 500_000
    spec = SpeculationModel.for_drafter("dspark", gamma=ACCEPTANCE["dspark"].gamma)  # DSpark's block of 5
    fits = footprints(DSV32, prompt, output_tokens, spec.gamma)
    c = concurrency or int(next(r for r in fits if r["policy"] == "adaptive")["max_concurrency"])
    rows: list[Row] = []
    for label in ("resident+dspark", "hisparse", "adaptive+dspark"):
        for overlap in overlaps if label_uses_host(label) else overlaps[:1]:
            serving = dataclasses.replace(parse_config(label, BASE, spec, ADMISSION),
                                          locality=dataclasses.replace(locality, overlap=overlap))
            work = WorkloadSpec(prompt, output_tokens, concurrency=c, num_requests=c)
            row, _ = run_one(H200, DSV32, serving, work, SCALE)
            rows.append(row)
            if log:
                print(f"  DSV3.2 500K C{c} {label:>16} overlap {overlap:.2f}: "
                      f"{float(row['output_tok_per_s_per_gpu']):7.2f} tok/s/GPU, running {int(float(row['max_batch']))}"
                      f", host {100 * float(row['host_share']):.1f}% ({float(row['wall_s']):.1f} s)", flush=True)
    return fits, rows

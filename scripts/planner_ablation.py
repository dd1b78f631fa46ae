#!/usr/bin/env python
"""Which of issue 28's fixes moved which claim, and by how much: the headline points with one fix reverted at a time.

    OMP_NUM_THREADS=1 python scripts/planner_ablation.py [--out docs/results] [--workers 2]

The points are the nominal ones ``scripts/reproduce_paper.py`` runs (its committed calibration and
``paper.reproduction_sweeps``): GLM-5 IndexShare NVFP4, 32K in / 8K out at C8, C32, C64 and 100K in at C128, for
hisparse, adaptive and adaptive+dflash2. Each fix is reverted through a switch the planner has
(``paper.Sweep``'s fields, ``LocalityModel.query_overlap``, ``SpeculationModel.unsourced_alpha``, the run log's
step loads); everything else stays at the current model. A fix with no small switch is listed as such.
Writes ``ablation.md`` (the table, with the command, date and wall time) and ``ablation.csv``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import importlib.util
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dhisparse.kv.host_memory import default_host_bytes
from dhisparse_planner import batch, paper
from dhisparse_planner.claims import BY_NAME, DP, LONG, headline_claims
from dhisparse_planner.paper import HOST_CONFIGS, SCALE, Sweep
from dhisparse_planner.report import markdown_table
from dhisparse_planner.retime import retime
from dhisparse_planner.scale import byte_factor
from dhisparse_planner.sensitivity import rows_of
from dhisparse_planner.simulator import SimResult
from dhisparse_planner.specs import GLM5_INDEXSHARE_NVFP4, H200
from dhisparse_planner.speculation import DecayingAlpha
from dhisparse_planner.timing import StepLoad

Row = dict[str, float | str]
Results = dict[tuple[str, int, float], SimResult]
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
SPEC_LABEL = "adaptive+dflash2"
# the claims at the headline points, system reading first (names and paper figures: dhisparse_planner.claims), with
# the runs each one reads
CLAIMS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    [(f"adaptive+dflash2 / hisparse output, 32K C{c}", (SPEC_LABEL, "hisparse")) for c in (8, 32, 64)]
    + [("adaptive+dflash2 / hisparse output, 100K C128", (SPEC_LABEL, "hisparse")),
       ("adaptive+dflash2 / adaptive output, 100K C128", (SPEC_LABEL, "adaptive")),
       ("hisparse / adaptive+dflash2 mean TTFT, 100K C128", (SPEC_LABEL, "hisparse")),
       ("adaptive+dflash2 output per GPU, 100K C128 (tok/s)", (SPEC_LABEL,)),
       ("adaptive+dflash2 decode-only output per decode GPU, 100K C128 (tok/s)", (SPEC_LABEL,))]
    + [(f"adaptive / hisparse output, 32K C{c}", ("adaptive", "hisparse")) for c in (8, 32, 64)])
# the pre-fix selector's verification query overlap (constants.py before issue 28: 0.9, range 0.7-0.98, no source)
OLD_QUERY_OVERLAP = 0.9
OLD_GAMMA = 4  # the paper scenario's draft tokens per block before issue 28


def _reproduce_paper():  # scripts/ is not a package: load reproduce_paper.py by path, for its definitions
    path = Path(__file__).resolve().with_name("reproduce_paper.py")
    spec = importlib.util.spec_from_file_location("reproduce_paper", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def headline_sweeps() -> dict[str, Sweep]:
    """reproduce_paper.py's sweeps at its committed calibration, cut to the headline points (host-backed configs)."""
    cal = _reproduce_paper().expected_calibration()
    from dhisparse_planner.paper_uncertainty import locality_corners

    plan = paper.reproduction_sweeps(cal.nominal, locality_corners(cal))
    cut = {"32K": (8, 32, 64), "100K": (128,), "32K DP8": (8, 32, 64), "100K DP8": (128,)}
    return {name: dataclasses.replace(plan[name], configs=HOST_CONFIGS, concurrencies=conc)
            for name, conc in cut.items()}


@dataclass(frozen=True)
class Fix:
    """One fix of issue 28 and how it is reverted.

    Attributes:
        point: the issue's point.
        name: the fix, in words.
        without: what the reverted model does instead, in words.
        switch: the switch used (or why there is none).
        labels: the runs the fix can change (claims reading none of them are not listed).
        revert: the reverted sweeps from the current ones (simulated), or None (``derive`` computes the claims).
        derive: claims without the fix from the current runs (no simulation), or None.
    """

    point: int
    name: str
    without: str
    switch: str
    labels: tuple[str, ...]
    revert: Callable[[dict[str, Sweep]], dict[str, Sweep]] | None = None
    derive: Callable[[Results], dict[str, float]] | None = None


def _tp(sweeps: dict[str, Sweep]) -> dict[str, Sweep]:
    return {k: v for k, v in sweeps.items() if "DP8" not in k}


def _each(change: Callable[[Sweep], Sweep]) -> Callable[[dict[str, Sweep]], dict[str, Sweep]]:
    return lambda sweeps: {k: change(v) for k, v in _tp(sweeps).items()}


def _only(labels: tuple[str, ...], change: Callable[[Sweep], Sweep]) -> Callable[[dict[str, Sweep]], dict[str, Sweep]]:
    return _each(lambda s: change(dataclasses.replace(s, configs=labels)))


def local_host_bytes(sweep: Sweep) -> float:
    """The host store before the fix, in real bytes: the runtime's default store (half of *this* machine's memory
    limit) held the simulated bytes, each standing for ``F`` real ones."""
    return default_host_bytes() * byte_factor(sweep.model, SCALE)


def _old_selector(s: Sweep) -> Sweep:
    return dataclasses.replace(s, locality=dataclasses.replace(s.locality, query_overlap=OLD_QUERY_OVERLAP))


def _old_selector_structure(s: Sweep) -> Sweep:
    return dataclasses.replace(s, locality=dataclasses.replace(s.locality, query_overlap=s.locality.overlap))


def _old_acceptance(s: Sweep) -> Sweep:
    return dataclasses.replace(s, speculation=dataclasses.replace(s.speculation, gamma=OLD_GAMMA,
                                                                  unsourced_alpha=DecayingAlpha()))


def _admit_like_adaptive(s: Sweep) -> Sweep:
    return dataclasses.replace(s, admission=())


def _one_wave(s: Sweep) -> Sweep:
    return dataclasses.replace(s, requests_per_client=1)


def _local_host(s: Sweep) -> Sweep:
    return dataclasses.replace(s, hw=dataclasses.replace(s.hw, host_bytes_per_gpu=local_host_bytes(s)))


def _comparator(results: Results) -> dict[str, float]:
    """The claims read for non-speculative adaptive (the headline reading before the fix)."""
    rows = rows_of(results, GLM5_INDEXSHARE_NVFP4.attn_tp)
    idx = {(str(r["label"]), int(float(r["concurrency"]))): r for r in rows}
    out: dict[str, float] = {}

    def ratio(name: str, a: str, b: str, c: int, metric: str = "output_tok_per_s_per_gpu") -> None:
        ra, rb = idx.get((a, c)), idx.get((b, c))
        if ra is not None and rb is not None and float(rb[metric]) > 0:
            out[name] = float(ra[metric]) / float(rb[metric])

    for c in (8, 32, 64):
        ratio(f"adaptive+dflash2 / hisparse output, 32K C{c}", "adaptive", "hisparse", c)
    ratio("adaptive+dflash2 / hisparse output, 100K C128", "adaptive" + LONG, "hisparse" + LONG, 128)
    ratio("hisparse / adaptive+dflash2 mean TTFT, 100K C128", "hisparse" + LONG, "adaptive" + LONG, 128, "mean_ttft_s")
    spec = idx.get(("adaptive" + LONG, 128))
    if spec is not None:
        out["adaptive+dflash2 output per GPU, 100K C128 (tok/s)"] = float(spec["output_tok_per_s_per_gpu"])
        out["adaptive+dflash2 decode-only output per decode GPU, 100K C128 (tok/s)"] = float(
            spec["decode_tok_per_s_per_gpu"])
    return out


def keys_read_per_query(result: SimResult) -> SimResult:
    """``result`` re-timed with every indexer key read from HBM once per *query* (the time model before the fix:
    a step's keys read as often as they are scored); the KV decisions do not depend on time (retime.py)."""
    log = [(kind, dataclasses.replace(obj, index_keys_read=obj.index_keys_scanned)
            if kind == "decode" and isinstance(obj, StepLoad) else obj) for kind, obj in result.log or []]
    return retime(dataclasses.replace(result, log=log), H200, GLM5_INDEXSHARE_NVFP4)


def _keys_per_query(results: Results) -> dict[str, float]:
    return claims_of({k: keys_read_per_query(v) if k[0].startswith(SPEC_LABEL) else v for k, v in results.items()})


def fixes() -> tuple[Fix, ...]:
    spec, tiB = (SPEC_LABEL,), default_host_bytes() * byte_factor(GLM5_INDEXSHARE_NVFP4, SCALE) / 2**40
    return (
        Fix(1, "comparator: the speculative system (adaptive+dflash2)",
            "non-speculative adaptive read as Adaptive DHiSparse", "the claim read off the other run (both computed)",
            ("adaptive", SPEC_LABEL), derive=_comparator),
        Fix(2, "verification selections belong to positions",
            f"each query drawn anew (query j keeps {OLD_QUERY_OVERLAP:g} of query j-1), re-verified positions drawn "
            "again, next step anchored on the last query", f"LocalityModel.query_overlap = {OLD_QUERY_OVERLAP:g}",
            spec, _only(spec, _old_selector)),
        Fix(2, "verification selections belong to positions (structure only)",
            "as above with query j keeping the per-token overlap of query j-1 (no unsourced constant)",
            "LocalityModel.query_overlap = the calibrated overlap", spec, _only(spec, _old_selector_structure)),
        Fix(3, "indexer keys read once per request and step", "keys read from HBM once per verification query",
            "re-timed: StepLoad.index_keys_read = index_keys_scanned", spec, derive=_keys_per_query),
        Fix(4, "sourced acceptance, DFlash2 block 8 (gamma 7)",
            f"gamma {OLD_GAMMA}, alpha = 0.75 - 0.03 per doubling of context beyond 4K (no source); drafter shape "
            "kept", f"SpeculationModel(gamma={OLD_GAMMA}, unsourced_alpha=DecayingAlpha())", spec,
            _only(spec, _old_acceptance)),
        Fix(5, "HiSparse admits by SGLang's token budget", "hisparse admits like adaptive (required memory only)",
            "Sweep.admission = ()", ("hisparse",), _only(("hisparse",), _admit_like_adaptive)),
        Fix(6, "steady state: 2 requests per client", "one wave at t = 0 (1 request per client, whole-run metrics)",
            "Sweep.requests_per_client = 1", HOST_CONFIGS, _each(_one_wave)),
        Fix(7, "DP8 attention reading (GLM-5 production, HiSparse's reference commands)",
            "TP8 attention, the latent replicated (the headline reading, and the only one before the fix)",
            "Sweep.attention_dp = 8 (with) vs 1 (without)", HOST_CONFIGS),
        Fix(8, "host store of the simulated rank (256 GiB per GPU)",
            f"half of this machine's memory limit as the simulated store ({tiB:.1f} TiB per rank in real bytes here)",
            "Sweep.hw.host_bytes_per_gpu", HOST_CONFIGS, _each(_local_host)),
    )


NOT_SWITCHED = (
    (4, "drafter shapes (DFlash2 ring 48 MiB, 2.34 GB weights; before issue 28: 3 MiB, 2 GB)",
     "no switch: the drafter is DRAFTERS[...] (specs.py), not a field of the sweep's PlanGrid / run_grid; plumbing "
     "one through is not a small switch. Its memory effect per session: speculative_state.csv."),
    (7, "dense / attention parameters from GLM-5.3's config.json (before: 12B / 11B assumed)",
     "not reverted: they size the weights per GPU and so the KV pool (a ModelSpec change, specs.py, another "
     "worker's file)."),
)


def claims_of(results: Results) -> dict[str, float]:
    """headline_claims of tensor-parallel runs (their labels carry the sweeps' suffixes)."""
    return headline_claims(rows_of(results, GLM5_INDEXSHARE_NVFP4.attn_tp))


def run_sweeps(sweeps: dict[str, Sweep]) -> Results:
    """Every sweep's runs (from the ones done ahead), keyed as Sweep.run keys them."""
    out: Results = {}
    for sweep in sweeps.values():
        out.update(sweep.run()[1])
    return out


def waits_rows(results: Results, variant: str) -> list[Row]:
    rows = rows_of(results, GLM5_INDEXSHARE_NVFP4.attn_tp)
    return [{"model": variant, "label": r["label"], "concurrency": r["concurrency"],
             "requests_done": r["requests_done"], "admissions_waited": r["admissions_waited"],
             "waited_for_device": r["waited_for_device"], "waited_for_host": r["waited_for_host"],
             "waited_for_budget": r["waited_for_budget"], "max_batch": r["max_batch"]} for r in rows]


def _fmt(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.3g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--workers", type=int, default=2, help="processes that run the simulations (default 2)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc)
    current = headline_sweeps()
    plan = fixes()
    reverted = {f"{i}": f.revert(current) for i, f in enumerate(plan) if f.revert is not None}
    jobs = [j for s in current.values() for j in s.jobs()]
    jobs += [j for sweeps in reverted.values() for s in sweeps.values() for j in s.jobs()]
    print(f"Ablation of issue 28's fixes: {len(jobs)} runs ({len({j.key for j in jobs})} distinct) in "
          f"{args.workers} processes", flush=True)
    if args.workers > 1:
        with batch.executor(args.workers) as pool:
            pending = batch.submit(pool, jobs)
            done = [0]

            def progress(line: str) -> None:
                done[0] += 1
                print(f"  [{done[0]}/{len(pending)}, {time.perf_counter() - t0:.0f} s]{line.removeprefix(' ')}",
                      flush=True)

            worker_s = batch.collect(pending, progress)
    else:
        worker_s = batch.run_ahead(jobs, workers=1)
    base = run_sweeps(_tp(current))
    with_fix = claims_of(base)
    # data-parallel rows as the sweeps make them (output per GPU over each rank's attn_tp = 1, not the TP's 8)
    dp_rows = [r for k, v in current.items() if "DP8" in k for r in v.run()[0]]
    rows: list[Row] = []
    for i, fix in enumerate(plan):
        if fix.point == 7:
            have = {k.removesuffix(", DP8 attention"): v for k, v in headline_claims(dp_rows, DP).items()}
            without = with_fix
        elif fix.derive is not None:
            have, without = with_fix, fix.derive(base)
        else:  # the reverted runs in place of the current ones (a fix that changes only some runs keeps the others)
            have, without = with_fix, claims_of({**base, **run_sweeps(reverted[f"{i}"])})
        for claim, labels in CLAIMS:
            if not set(labels) & set(fix.labels) or claim not in have or claim not in without:
                continue
            a, b = have[claim], without[claim]
            rows.append({"point": fix.point, "fix": fix.name, "without": fix.without, "switch": fix.switch,
                         "claim": claim, "paper": BY_NAME[claim].paper, "with the fix": a, "without the fix": b,
                         "delta": a - b})
        print(f"  {fix.name}: done", flush=True)
    host = next(str(i) for i, f in enumerate(plan) if f.point == 8)
    waits = waits_rows(base, "current") + waits_rows(run_sweeps(reverted[host]), "host of this machine")
    wall = time.perf_counter() - t0
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    write(args.out, rows, waits, started, wall, cpu, worker_s, len({j.key for j in jobs}))
    print(f"wrote {args.out / 'ablation.md'} and ablation.csv ({wall:.0f} s wall)", flush=True)
    return 0


CSV_COLUMNS = ("point", "fix", "without", "switch", "claim", "paper", "with the fix", "without the fix", "delta")


def write(out: Path, rows: list[Row], waits: list[Row], started: datetime.datetime, wall: float, cpu: float,
          worker_s: float, runs: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "ablation.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in rows:
            w.writerow([r[c] if isinstance(r[c], str | int) else f"{float(r[c]):.6g}" for c in CSV_COLUMNS])
    table = [{"fix (issue 28 point)": f"{r['fix']} ({r['point']})", "without it": str(r["without"]),
              "claim": str(r["claim"]), "paper": str(r["paper"]), "with the fix": _fmt(float(r["with the fix"])),
              "without": _fmt(float(r["without the fix"])), "Δ": f"{float(r['delta']):+.3g}"} for r in rows]
    movers = []
    for claim, _ in CLAIMS:
        mine = [r for r in rows if r["claim"] == claim and r["point"] != 7]  # 7 is a second reading, not a fix
        if mine:
            top = sorted(mine, key=lambda r: -abs(float(r["delta"])))[:2]
            movers.append({"claim": claim, "paper": BY_NAME[claim].paper, "now": _fmt(float(top[0]["with the fix"])),
                           "moved most by": "; ".join(f"{r['fix']} ({r['point']}): {float(r['delta']):+.3g}"
                                                      for r in top)})
    switches = "\n".join(f"- {f.name} ({f.point}): {f.switch}." for f in fixes())
    missing = "\n".join(f"- {name} ({point}): {why}" for point, name, why in NOT_SWITCHED)
    load = os.getloadavg()
    text = (
        "# Ablation of issue 28's fixes (generated by scripts/planner_ablation.py)\n\n"
        f"Command: `OMP_NUM_THREADS=1 python scripts/planner_ablation.py` — run {started:%Y-%m-%d %H:%M} UTC, "
        f"**{wall:.0f} s wall** on {os.cpu_count()} cores ({runs} distinct simulations, {worker_s:.0f} worker-seconds; "
        f"CPU {cpu:.0f} s; load average at the end {load[0]:.1f}).\n\n"
        "The nominal points of `scripts/reproduce_paper.py` (its committed calibration and sweeps: GLM-5 IndexShare "
        "NVFP4 on H200, 32K in / 8K out at C8 / C32 / C64, 100K in at C128, tensor-parallel attention, 2 requests "
        "per client) with the current model (*with the fix*: equal to `summary.md`'s nominal) and with **one fix "
        "reverted at a time**, everything else current (*without*). Δ = with − without: what that fix moved. The "
        "fixes do not add up: each is reverted alone. A claim is listed under a fix only when the fix can change "
        "one of its runs.\n\n"
        + markdown_table(table, list(table[0]))
        + "\n\n## The fixes that moved each claim most (|Δ|; the DP8 reading left out: it is a second reading)\n\n"
        + markdown_table(movers, list(movers[0]))
        + "\n\nSwitches:\n" + switches
        + "\n\nNot switched:\n" + missing
        + "\n\n## Admission waits by cause at these points (`metrics.py`)\n\n"
        "With the simulated rank's 256 GiB host store (*current*) and with the store before the fix (*host of this "
        "machine*): requests refused at least once at the head of the queue, by what refused them (a request may be "
        "refused by several; those queued behind it waited too, uncounted); `max_batch`: the most that ran at once. "
        "The host store binds where `waited_for_host` > 0.\n\n"
        + markdown_table(waits, list(waits[0])) + "\n")
    (out / "ablation.md").write_text(text)


if __name__ == "__main__":
    sys.exit(main())

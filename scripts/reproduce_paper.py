#!/usr/bin/env python
"""Reproduce the HiSparse validation and the paper's experiments with the planner; write docs/results/.

    OMP_NUM_THREADS=1 python scripts/reproduce_paper.py [--out docs/results] [--quick]

Every number in ``summary.md`` is computed here from the runs (see dhisparse_planner/paper.py and
validation.py for the setups). Order: the locality model is calibrated first (published resolution shares +
selection traces of our engine, ``calibration.csv``); every throughput claim is then *predicted* at the fitted
locality and its plausible range; finally each headline claim's sensitivity to every constant of
``dhisparse_planner.constants`` is computed (``sensitivity.csv``, ``sensitivity.png``, ``constants.md``), one
constant at a time and with every time-only constant at its adverse / favourable end at once
(``sensitivity_joint.csv``). The TTFT claims are reported co-located and disaggregated (``disaggregated_ttft.md``,
:mod:`dhisparse_planner.ttft_modes`).
Every simulation is independent of the others once the locality is calibrated: they run in ``--workers``
processes (default 2) while the calibration runs (:mod:`dhisparse_planner.batch`), each distinct run once; the
results are the same as simulating them one after another (tests/planner/test_batch.py).
``--quick`` runs a reduced grid (for smoke tests only, not for the docs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dhisparse_planner import batch, paper, paper_uncertainty, ttft_modes, validation
from dhisparse_planner.constants import Setup, table_markdown
from dhisparse_planner.locality import CALIBRATED, CALIBRATED_OVERLAP_RANGE, CALIBRATED_RECENT_RANGE
from dhisparse_planner.report import grid_points, markdown_table, plot_grid, plot_memory, write_csv
from dhisparse_planner.sensitivity import claim_ranges, joint_time_ranges, plot_sensitivity, sensitivity
from dhisparse_planner.specs import DRAFTERS, GLM5_INDEXSHARE_NVFP4, H200

Row = dict[str, float | str]


def _span(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return fmt.format(lo) if abs(hi - lo) < 5e-3 else f"{fmt.format(lo)}–{fmt.format(hi)}"


def _ratios(rows: list[Row], num: str, den: str, cs: tuple[int, ...], metric: str = "output_tok_per_s_per_gpu",
            invert: bool = False) -> list[float]:
    vals = [float(r["ratio"]) for r in paper.ratio_table(rows, num, den, metric) if int(r["concurrency"]) in cs]
    return [1.0 / v for v in vals] if invert else vals


def plot_validation(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(validation.BATCHES, validation.PUBLISHED_RATIO, "k-o", label=f"published ({validation.PR})")
    for variant, overlap in sorted({(str(r["variant"]), float(r["overlap"])) for r in rows}):
        pts = [r for r in rows if r["variant"] == variant and r["overlap"] == overlap]
        ax.plot([float(r["batch"]) for r in pts], [float(r["ratio"]) for r in pts], marker=".",
                ls="--" if "x4" in variant else "-", label=f"planner {variant}, overlap {overlap:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("target batch")
    ax.set_ylabel("HiSparse / no-HiSparse decode throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/results"))
    p.add_argument("--quick", action="store_true", help="reduced grid (smoke test; not the documented results)")
    p.add_argument("--workers", type=int, default=2, help="processes that run the simulations (default 2)")
    args = p.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    cs = (8, 16) if args.quick else (8, 16, 32, 64, 128)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(name: str, start: float) -> None:
        timings[name] = time.perf_counter() - start
        print(f"[{name}: {timings[name]:.0f} s, total {time.perf_counter() - t0:.0f} s]", flush=True)

    # Every simulation below is independent of the others once the locality is calibrated. They start at once, in
    # `workers` processes, at the committed calibration (locality.CALIBRATED*), while the calibration runs here;
    # a run is used only if its specs equal the ones the stages ask for (dhisparse_planner.batch), so should the
    # calibration come out differently the stages simply simulate their runs again.
    guess = _expected_calibration()
    pool = batch.executor(args.workers) if args.workers > 1 else None
    pending = batch.submit(pool, simulation_jobs(guess, args.quick, cs)) if pool else []
    stages = submit_stages(pool, guess, args.quick) if pool else {}

    s = time.perf_counter()
    print("Locality calibration (published shares + engine traces)", flush=True)
    cal, cal_rows = calibrate()
    write_csv(cal_rows, out / "calibration.csv", list(cal_rows[0]))
    loc = cal.nominal
    overlaps = _overlaps(cal, args.quick)
    print(f"  nominal {loc}, overlaps {overlaps}", flush=True)
    same = (loc, cal.overlap_range, cal.recent_range) == (guess.nominal, guess.overlap_range, guess.recent_range)
    if not same:
        print("  calibration differs from locality.CALIBRATED*: the runs started ahead are not used", flush=True)
        stages = {}
    lap("calibration", s)

    s = time.perf_counter()
    if pool is not None:
        timings["simulations in workers (sum)"] = batch.collect(pending) + sum(
            f.result()[1] for f in stages.values())
        pool.shutdown()
    lap("simulations ahead (wall)", s)

    s = time.perf_counter()
    print("HiSparse validation (sglang PR #33075)", flush=True)
    val = (stages["validation"].result()[0] if "validation" in stages else
           validation.run_validation(overlaps=overlaps, token_scale=64 if args.quick else 32, log=True, locality=loc))
    val_err = validation.error_summary(val)
    write_csv(val, out / "validation_pr33075.csv", list(val[0]))
    write_csv(val_err, out / "validation_error.csv", list(val_err[0]))
    plot_validation(val, out / "validation_pr33075.png")
    lap("validation", s)

    s = time.perf_counter()
    print("GLM 32K/8K grid", flush=True)
    g32, res32 = paper.glm_32k(cs, overlaps, log=True, locality=loc)
    write_csv(g32, out / "glm_32k.csv")
    plot_grid(g32, out, prefix="glm_32k_")
    lap("glm_32k", s)

    s = time.perf_counter()
    print("GLM 100K/8K at C128", flush=True)
    g100, res100 = (paper.glm_100k(overlaps, log=True, locality=loc, configs=LONG_CONFIGS)
                    if not args.quick else ([], {}))
    if g100:
        write_csv(g100, out / "glm_100k_c128.csv")
    lap("glm_100k", s)

    bounds = paper.tpot_bounds(g32)
    write_csv(bounds, out / "tpot_bounds.csv", list(bounds[0]))

    s = time.perf_counter()
    print("TTFT: co-located vs disaggregated (C128)", flush=True)
    ttft_c = DISAGG_CONCURRENCY if not args.quick else 16
    ttft = ttft_modes.ttft_rows(loc, DISAGG_INPUTS if not args.quick else (32768,), ttft_c)
    ttft_modes.write_markdown(ttft, out / "disaggregated_ttft.md", loc, ttft_c)
    lap("disaggregated_ttft", s)

    s = time.perf_counter()
    print("load step 4 -> 64 -> 4 clients", flush=True)
    ls_rows, ls_res = (stages["load_step"].result()[0] if "load_step" in stages
                       else paper.load_step((loc.overlap,), log=True, locality=loc))
    write_csv(ls_rows, out / "load_step.csv", list(ls_rows[0]))
    plot_memory(ls_res, out / "load_step_memory.png")
    lap("load_step", s)

    s = time.perf_counter()
    print("DeepSeek-V3.2 500K", flush=True)
    fits, ds = (stages["deepseek_500k"].result()[0] if "deepseek_500k" in stages
                else paper.deepseek_500k(overlaps=overlaps, log=True, locality=loc))
    write_csv(fits, out / "deepseek_500k_footprint.csv", list(fits[0]))
    write_csv(ds, out / "deepseek_500k.csv")
    lap("deepseek_500k", s)

    s = time.perf_counter()
    v4_runs: list[Row] = []
    if not args.quick:
        print("DeepSeek-V4-Flash 500K C512 (scripts/deepseek_v4_500k.py)", flush=True)
        v4_runs = _deepseek_v4_script().main(out)
    lap("deepseek_v4_500k", s)

    s = time.perf_counter()
    print("Sensitivity of the headline claims", flush=True)
    constants = paper_uncertainty.calibrated_constants(cal)
    (out / "constants.md").write_text("# Planner constants (generated by scripts/reproduce_paper.py)\n\n"
                                      + table_markdown(constants) + "\n")
    sens, joint = run_sensitivity(res32, res100, overlaps, loc, constants, args.quick)
    write_csv(sens, out / "sensitivity.csv", list(sens[0]))
    write_csv(joint, out / "sensitivity_joint.csv", list(joint[0]))
    plot_sensitivity(sens, out / "sensitivity.png", [c for c in paper_uncertainty.PAPER
                                                     if any(r["claim"] == c for r in sens)])
    lap("sensitivity", s)

    summary = build_summary(g32, g100, bounds, ls_rows, fits, ds, val_err, cs)
    summary += ttft_modes.claims(ttft) + v4_claims(v4_runs)
    claims = claims_table(sens, joint) + ttft_modes.claim_rows(ttft)
    timings["total"] = time.perf_counter() - t0
    text = ("# Reproduction summary (generated by scripts/reproduce_paper.py)\n\n"
            f"Locality (calibrated, `calibration.csv`): overlap {loc.overlap:g} (range {cal.overlap_range[0]:g}–"
            f"{cal.overlap_range[1]:g}), recent fraction {loc.recent_fraction:g} (range {cal.recent_range[0]:g}–"
            f"{cal.recent_range[1]:g}).\n\n## Headline claims: nominal prediction and range over every constant\n\n"
            + markdown_table(claims, list(claims[0]))
            + "\n\n## Claims over the calibrated overlap range\n\n" + markdown_table(summary, list(summary[0]))
            + "\n\n## TTFT, co-located vs disaggregated (nominal locality, `disaggregated_ttft.md`)\n\n"
            + markdown_table(ttft, list(ttft[0]))
            + "\n\n## Locality calibration\n\n" + markdown_table(cal_rows, list(cal_rows[0]))
            + "\n\n## HiSparse validation error (ratio vs published, over batches 1–54)\n\n"
        + markdown_table(val_err, list(val_err[0])) + "\n\n## Throughput under mean-TPOT bounds (worst overlap)\n\n"
        + markdown_table(bounds, list(bounds[0])) + "\n\n## DeepSeek-V3.2 500K footprints\n\n"
        + markdown_table(fits, list(fits[0])) + "\n\nRun times (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()) + "\n")
    if not args.quick:
        (out / "summary.md").write_text(text)
    print(text)
    del res32
    return 0


LONG_CONFIGS = ("hisparse", "adaptive", "adaptive+dflash2")
DISAGG_INPUTS = (32768, 102400)
DISAGG_CONCURRENCY = 128


def _expected_calibration() -> paper_uncertainty.LocalityCalibration:
    """The committed calibration (``locality.CALIBRATED*``, tested equal to ``calibration.csv``)."""
    return paper_uncertainty.LocalityCalibration(None, None, CALIBRATED, CALIBRATED_OVERLAP_RANGE,  # type: ignore[arg-type]
                                                 CALIBRATED_RECENT_RANGE)


def _overlaps(cal: paper_uncertainty.LocalityCalibration, quick: bool) -> tuple[float, ...]:
    return (cal.nominal.overlap,) if quick else (cal.overlap_range[0], cal.nominal.overlap, cal.overlap_range[1])


def simulation_jobs(cal: paper_uncertainty.LocalityCalibration, quick: bool, cs: tuple[int, ...]) -> list[batch.Job]:
    """Every simulation the stages below ask for at calibration ``cal`` (grids, TTFT modes, sensitivity re-runs)."""
    loc, overlaps = cal.nominal, _overlaps(cal, quick)
    model = GLM5_INDEXSHARE_NVFP4
    grids = [paper.glm_grid(32768, cs, overlaps, locality=loc)]
    if not quick:
        grids.append(paper.glm_grid(102400, (128,), overlaps, LONG_CONFIGS, loc))
    jobs = [batch.Job(H200, model, serving, work, paper.SCALE) for grid in grids
            for _, _, _, serving, work, new in grid_points(grid, model) if new]
    jobs += ttft_modes.jobs(loc, DISAGG_INPUTS if not quick else (32768,), DISAGG_CONCURRENCY if not quick else 16)
    constants = paper_uncertainty.calibrated_constants(cal)
    if quick:
        constants = tuple(c for c in constants if c.retime or c.field == "overlap")
    keys = [(label, c, loc.overlap) for label, c in paper_uncertainty.RERUN_KEYS
            if not (quick and label.endswith(paper_uncertainty.LONG)) and c in cs]
    setup = Setup(H200, model, DRAFTERS["dflash2"], paper.SPEC, loc)
    return jobs + paper_uncertainty.rerun_jobs(keys, setup, constants)


def submit_stages(pool, cal: paper_uncertainty.LocalityCalibration, quick: bool) -> dict:  # type: ignore[no-untyped-def]
    """The smaller experiments, each as one task (their runs are their own)."""
    loc, overlaps = cal.nominal, _overlaps(cal, quick)
    return {"validation": pool.submit(_timed_call, validation.run_validation, overlaps=overlaps,
                                      token_scale=64 if quick else 32, locality=loc),
            "load_step": pool.submit(_timed_call, paper.load_step, (loc.overlap,), locality=loc),
            "deepseek_500k": pool.submit(_timed_call, paper.deepseek_500k, overlaps=overlaps, locality=loc)}


def _timed_call(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    return fn(*args, **kwargs), time.perf_counter() - start


def calibrate() -> tuple[paper_uncertainty.LocalityCalibration, list[Row]]:
    """Fit the locality model; rows: every published target (fitted / predicted, residual) and the trace fit."""
    trace = None
    path = Path("docs/results/engine_trace.json")
    if path.exists():  # recorded by `python -m dhisparse_planner.engine_trace` (minutes on CPU, run separately)
        trace = json.loads(path.read_text())
    else:
        print(f"  no {path}: calibrating on published shares only", flush=True)
    cal = paper_uncertainty.calibrate_locality(trace, log=True)
    rows: list[Row] = [{"evidence": "published shares (paper setup, 1 request, 32K/8K)", "statistic": r["target"],
                        "observed": float(r["published"]), "planner": float(r["planner"]),
                        "residual": float(r["residual"]), "role": r["role"]} for r in cal.published.rows]
    if cal.trace is not None:
        t = cal.trace
        label = f"engine trace ({path}: demo model, {t.observed.pairs} step pairs, window 2*top-k)"
        for name, obs, fit in (("kept share (consecutive steps)", t.observed.kept, t.fitted.kept),
                               ("recent share of new positions", t.observed.recent, t.fitted.recent)):
            rows.append({"evidence": label, "statistic": name, "observed": obs, "planner": fit,
                         "residual": fit - obs, "role": "fitted"})
    for name, value, rng in (("overlap", cal.nominal.overlap, cal.overlap_range),
                             ("recent_fraction", cal.nominal.recent_fraction, cal.recent_range)):
        fits = f"published {getattr(cal.published, name):.3f}" + (
            f", engine trace {getattr(cal.trace, name):.3f}" if cal.trace else "")
        rows.append({"evidence": f"result: {name} ({fits})", "statistic": "nominal / range", "observed": value,
                     "planner": rng[0], "residual": rng[1], "role": "low / high in planner / residual columns"})
    return cal, rows


def run_sensitivity(res32: dict, res100: dict, overlaps: tuple[float, ...], loc, constants, quick: bool
                    ) -> tuple[list[Row], list[Row]]:
    nominal = loc.overlap
    long = paper_uncertainty.LONG
    base = {k: v for k, v in res32.items() if k[2] == nominal}
    base.update({(k[0] + long, k[1], k[2]): v for k, v in res100.items() if k[2] == nominal})
    by_overlap = {}
    for ov in overlaps:
        grid = {k: v for k, v in res32.items() if k[2] == ov}
        grid.update({(k[0] + long, k[1], k[2]): v for k, v in res100.items() if k[2] == ov})
        by_overlap[round(ov, 6)] = grid
    setup = Setup(H200, GLM5_INDEXSHARE_NVFP4, DRAFTERS["dflash2"], paper.SPEC, loc)
    rerun = paper_uncertainty.make_rerun(base, by_overlap, log=True)
    if quick:
        constants = tuple(c for c in constants if c.retime or c.field == "overlap")
    claims = paper_uncertainty.headline_claims
    gpus = GLM5_INDEXSHARE_NVFP4.gpus
    sens = sensitivity(base, setup, claims, gpus, rerun, constants, workers=1)  # its re-simulations were run ahead
    return sens, joint_time_ranges(base, setup, claims, gpus, sens, constants)


def claims_table(sens: list[Row], joint: list[Row]) -> list[Row]:
    """Per headline claim: the paper's number, our nominal prediction, the range over every constant's ends
    (one at a time), the range with every time-only constant at its adverse / favourable end at once, and the
    constants that move it most."""
    ranges = claim_ranges(sens)
    together = {str(r["claim"]): (float(r["joint_low"]), float(r["joint_high"])) for r in joint}
    out: list[Row] = []
    for claim, paper_value in paper_uncertainty.PAPER.items():
        if claim not in ranges:
            continue
        nom, lo, hi = ranges[claim]
        rows = sorted((r for r in sens if r["claim"] == claim and r["swing"] == r["swing"]),
                      key=lambda r: -float(r["swing"]))
        top = "; ".join(f"{r['constant']} {float(r['at_low']):.3g}–{float(r['at_high']):.3g}" for r in rows[:2])
        jlo, jhi = together.get(claim, (float("nan"), float("nan")))
        out.append({"claim": claim, "paper": paper_value, "planner nominal": f"{nom:.3g}",
                    "planner range": f"{lo:.3g}–{hi:.3g}", "time-only constants jointly": f"{jlo:.3g}–{jhi:.3g}",
                    "depends most on (value at low–high end)": top})
    return out


def _deepseek_v4_script():  # scripts/ is not a package: load the V4 experiment's script by path
    import importlib.util

    path = Path(__file__).resolve().with_name("deepseek_v4_500k.py")
    spec = importlib.util.spec_from_file_location("deepseek_v4_500k", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def v4_claims(runs: list[Row]) -> list[Row]:
    """The paper's 1.85x (adaptive+DSpark over resident+DSpark, V4.1-Flash, 500K, C512) on our V4 time model, per
    reading of C512 (see docs/results/deepseek_v4_500k.md): range over the locality overlaps and KV-read conventions."""
    rows: list[Row] = []
    for reading in dict.fromkeys(str(r["reading"]) for r in runs):
        run_r, full_r = [], []
        for kv_read in dict.fromkeys(str(r["kv_read"]) for r in runs if r["reading"] == reading):
            sel = [r for r in runs if r["reading"] == reading and r["kv_read"] == kv_read]
            res = [r for r in sel if r["label"] == "resident+dspark"]
            for a in (r for r in sel if r["label"] == "adaptive+dspark"):
                base = next((b for b in res if b["overlap"] == a["overlap"]), res[0] if res else None)
                if base is None:
                    continue
                run_r.append(float(a["output_tok_per_s_per_gpu"]) / float(base["output_tok_per_s_per_gpu"]))
                full_r.append(float(a["full_batch_tok_per_s_per_gpu"]) / float(base["full_batch_tok_per_s_per_gpu"]))
        rows.append({"claim": f"adaptive+dspark / resident+dspark output, DeepSeek-V4-Flash 500K, {reading}",
                     "paper": "1.85× (V4.1-Flash, C512)",
                     "planner (range over the calibrated overlaps)": _span(run_r),
                     "note": "V4 time model (deepseek_v4_500k.md); whole run; at full batch " + _span(full_r)
                     + "; range over overlaps 0.604/0.858 and the KV-read convention; prefill not modelled"})
    return rows


def build_summary(g32: list[Row], g100: list[Row], bounds: list[Row], ls_rows: list[Row], fits: list[Row],
                  ds: list[Row], val_err: list[Row], cs: tuple[int, ...]) -> list[Row]:
    low_c = tuple(c for c in cs if c <= 64)
    small_c = tuple(c for c in cs if c <= 32)
    lines: list[Row] = []

    def add(claim: str, paper_value: str, ours: str, note: str = "") -> None:
        lines.append({"claim": claim, "paper": paper_value, "planner (range over the calibrated overlaps)": ours,
                      "note": note})

    add("adaptive / hisparse output, 32K/8K, C8–C64", "1.7–1.9×", _span(_ratios(g32, "adaptive", "hisparse", low_c)))
    add("adaptive+dflash2 / hisparse output, 32K/8K, C8–C64", "(1.7–1.9× is the system's)",
        _span(_ratios(g32, "adaptive+dflash2", "hisparse", low_c)))
    add("adaptive / hisparse output, 32K/8K, C128", "1.45×", _span(_ratios(g32, "adaptive", "hisparse", (128,))))
    add("hisparse / adaptive mean TTFT, 32K/8K, C128", "2.3× lower",
        _span(_ratios(g32, "hisparse", "adaptive", (128,), "mean_ttft_s")))
    if g100:
        add("adaptive+dflash2 / hisparse output, 100K/8K, C128", "1.45×",
            _span(_ratios(g100, "adaptive+dflash2", "hisparse", (128,))))
        add("adaptive / hisparse output, 100K/8K, C128", "(not stated)",
            _span(_ratios(g100, "adaptive", "hisparse", (128,))))
        add("adaptive+dflash2 output per GPU, 100K/8K, C128 (tok/s)", "793",
            _span([float(r["output_tok_per_s_per_gpu"]) for r in g100 if r["label"] == "adaptive+dflash2"],
                  "{:.0f}"))
        add("hisparse / adaptive+dflash2 mean TTFT, 100K, C128", "2.1× lower",
            _span(_ratios(g100, "hisparse", "adaptive+dflash2", (128,), "mean_ttft_s")))
        add("adaptive+dflash2 / adaptive output, 100K, C128", "1.27×",
            _span(_ratios(g100, "adaptive+dflash2", "adaptive", (128,))))
    add("resident+dflash2 / adaptive+dflash2 output, C≤32", "1.05–1.09×",
        _span(_ratios(g32, "resident+dflash2", "adaptive+dflash2", small_c)))
    add("resident+dflash2 / adaptive+dflash2 output, C64 / C128", "stops scaling at C64",
        _span(_ratios(g32, "resident+dflash2", "adaptive+dflash2", tuple(c for c in cs if c >= 64))))
    best = {}
    for r in bounds:
        best.setdefault(r["tpot_bound_ms"], {})[r["label"]] = float(r["output_tok_per_s_per_gpu"])
    ratios = [max(v.get("adaptive", 0), v.get("adaptive+dflash2", 0)) / v["hisparse"]
              for v in best.values() if v.get("hisparse", 0) > 0]
    add("best adaptive(+dflash2) / hisparse output under TPOT bounds", "2.3–3.7×", _span(ratios),
        "bounds " + ", ".join(f"{b:g} ms" for b in best) + "; hisparse meets " +
        str(sum(1 for v in best.values() if v.get("hisparse", 0) > 0)) + " of them")
    for policy in ("hisparse", "adaptive"):
        vals = [100 * float(r["host_share"]) for r in ls_rows if r["label"] == policy and r["phase"] != "high"]
        high = [100 * float(r["host_share"]) for r in ls_rows if r["label"] == policy and r["phase"] == "high"]
        add(f"load step: host-fetched share at low load, {policy}", "14.2%" if policy == "hisparse" else "1.4%",
            _span(vals, "{:.1f}%"), f"high-load phase {_span(high, '{:.1f}%')}")
    need = [f"{r['policy']} {float(r['required_gib']):.2f} GiB/request, max C{r['max_concurrency']}" for r in fits]
    add("DeepSeek 500K C512: fits?", "(V4.1-Flash, compressed KV)", "no", "; ".join(need))
    c = int(float(ds[0]["concurrency"]))
    res = next(r for r in ds if r["label"] == "resident+dspark")
    ada = [r for r in ds if r["label"] == "adaptive+dspark"]
    add(f"adaptive+dspark / resident+dspark output, DeepSeek-V3.2 500K, C{c}", "1.85× (V4.1-Flash, C512)",
        _span([float(a["output_tok_per_s_per_gpu"]) / float(res["output_tok_per_s_per_gpu"]) for a in ada]),
        "decode throughput only (prefill excluded): "
        + _span([float(a["decode_tok_per_s"]) / float(res["decode_tok_per_s"]) for a in ada]))
    add("HiSparse PR #33075 ratio curve: mean |error|", "0",
        _span([float(e["mean_abs_ratio_error"]) * 100 for e in val_err if e["variant"] == "hisparse"], "{:.0f}%"),
        "pool x4: " + _span([float(e["mean_abs_ratio_error"]) * 100 for e in val_err if e["variant"] != "hisparse"],
                            "{:.0f}%"))
    return lines


if __name__ == "__main__":
    sys.exit(main())

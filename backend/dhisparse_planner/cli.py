"""``dhisparse-plan``: simulate a workload on one decode GPU over a grid of configurations and recommend one.

Example (GLM-class, 32K in / 8K out, H200)::

    dhisparse-plan --model glm5-indexshare-nvfp4 --hardware h200 --input-tokens 32768 --output-tokens 8192 \\
        --configs resident hisparse adaptive adaptive+dflash2 --concurrency 8 16 32 \\
        --tpot-bound-ms 50 --out plan_out        # locality: the calibrated range by default

Writes ``plan.csv``, ``plan.md`` (table + recommendation) and PNG plots into ``--out`` and prints the table.
``dhisparse-plan footprint …`` prints one session's required / optional / speculative bytes instead
(:mod:`dhisparse_planner.footprint_cli`); ``dhisparse-plan multi-turn …`` models prefix reuse in multi-turn chat
(:mod:`dhisparse_planner.multi_turn_cli`).
``--sensitivity`` adds ``sensitivity.csv`` / ``sensitivity.md`` / ``sensitivity.png``: for the first config
against each other one, output and TTFT ratios at every concurrency with each constant of
``dhisparse_planner.constants`` at the ends of its plausible range (one bar per constant).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from dhisparse import defaults
from dhisparse_planner.constants import CONSTANTS, Constant, Setup, affects
from dhisparse_planner.locality import CALIBRATED, CALIBRATED_OVERLAP_RANGE
from dhisparse_planner.measured import load_measured, measured_claims, with_measured_link
from dhisparse_planner.report import (
    PlanGrid,
    markdown_table,
    parse_config,
    plot_grid,
    plot_memory,
    recommend,
    result_row,
    run_grid,
    write_csv,
)
from dhisparse_planner.retime import retime
from dhisparse_planner.scale import ScaleSpec
from dhisparse_planner.sensitivity import COLUMNS as SENS_COLUMNS
from dhisparse_planner.sensitivity import plot_sensitivity, ratio_claims, sensitivity
from dhisparse_planner.simulator import SimResult, simulate
from dhisparse_planner.specs import DRAFTERS, HARDWARE_PRESETS, MODEL_PRESETS, HardwareSpec, ModelSpec
from dhisparse_planner.speculation import SpeculationModel
from dhisparse_planner.workload import ServingSpec, WorkloadSpec

GIB = 2.0**30


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dhisparse-plan", description=__doc__.split("\n")[0])
    p.add_argument("--hardware", choices=sorted(HARDWARE_PRESETS), default="h200")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="glm5-indexshare-nvfp4")
    p.add_argument("--hbm-gib", type=float, default=0.0, help="override the GPU's memory (GiB)")
    p.add_argument("--host-link-gbps", type=float, default=0.0, help="override effective host link (GB/s)")
    p.add_argument("--input-tokens", type=int, default=32768)
    p.add_argument("--output-tokens", type=int, default=8192)
    p.add_argument("--configs", nargs="+", default=["resident", "hisparse", "adaptive"],
                   help="policy[+drafter]: resident|hisparse|adaptive, drafter dflash2|dspark")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--overlap", type=float, nargs="+",
                   default=[CALIBRATED_OVERLAP_RANGE[0], CALIBRATED.overlap, CALIBRATED_OVERLAP_RANGE[1]],
                   help="locality overlaps (report a range, never one tuned value; default: the calibrated "
                        "range, docs/results/calibration.csv)")
    p.add_argument("--recent-fraction", type=float, default=CALIBRATED.recent_fraction,
                   help="share of fresh selections drawn from the recent window (default: calibrated)")
    p.add_argument("--hot-rows", type=int, default=defaults.HOT_ROWS,
                   help="B per request and layer (0: index_topk, with or without a drafter)")
    p.add_argument("--page-rows", type=int, default=defaults.PAGE_ROWS)
    p.add_argument("--reserve-gib", type=float, default=0.0)
    p.add_argument("--max-batch-size", type=int, default=defaults.MAX_BATCH_SIZE,
                   help="most requests running at once (the engine's max_batch_size)")
    p.add_argument("--max-prefill-tokens-per-step", type=int, default=defaults.MAX_PREFILL_TOKENS_PER_STEP,
                   help="prompt tokens prefilled per engine step (the engine's max_prefill_tokens_per_step)")
    p.add_argument("--gamma", type=int, default=defaults.NUM_DRAFT_TOKENS, help="draft tokens per block")
    p.add_argument("--accept-len-short", type=float, default=None,
                   help="DFlash2: mean accepted tokens per step at <= 8K context (default: the published 6.0)")
    p.add_argument("--accept-len-long", type=float, default=None,
                   help="DFlash2: mean accepted tokens per step at 172K context (default: the published 2.65)")
    p.add_argument("--busy-batch", type=int, default=defaults.DSPARK_BUSY_BATCH,
                   help="DSpark shortens verification from this batch (the engine's dspark_busy_batch)")
    p.add_argument("--token-scale", type=int, default=64, help="g of the scale model (see docs/planner.md)")
    p.add_argument("--index-groups", type=int, default=1, help="index groups simulated")
    p.add_argument("--tpot-bound-ms", type=float, default=50.0, help="latency bound for the recommendation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("plan_out"))
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--sensitivity", action="store_true",
                   help="vary every planner constant over its plausible range (first config vs the others)")
    p.add_argument("--measured", type=Path, default=None,
                   help="a GPU check's JSON (docs/results/gpu_check/, issue 25's keys): re-time the runs with its "
                        "measured host-gather rate and add the ratios its measured per-layer steps give")
    p.add_argument("--sensitivity-time-only", action="store_true",
                   help="with --sensitivity: only the constants that re-timing covers (no new simulations)")
    return p


def speculation_of(args: argparse.Namespace) -> SpeculationModel:
    """The speculation model of the CLI's flags (acceptance flags override DFlash2's published figures; a DSpark
    config uses DSpark's own)."""
    spec = SpeculationModel(gamma=args.gamma, busy_batch=args.busy_batch)
    if args.accept_len_short is not None:
        spec = spec.replace(accept_len_short=args.accept_len_short)
    if args.accept_len_long is not None:
        spec = spec.replace(accept_len_long=args.accept_len_long)
    return spec


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "footprint":
        from dhisparse_planner.footprint_cli import main as footprint_main

        return footprint_main(argv[1:])
    if argv and argv[0] == "multi-turn":
        from dhisparse_planner.multi_turn_cli import main as multi_turn_main

        return multi_turn_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        hw = HARDWARE_PRESETS[args.hardware]
        if args.hbm_gib > 0:
            hw = dataclasses.replace(hw, hbm_bytes=args.hbm_gib * GIB)
        if args.host_link_gbps > 0:
            hw = dataclasses.replace(hw, host_link_bytes_per_s=args.host_link_gbps * 1e9)
        model = MODEL_PRESETS[args.model]
        grid = PlanGrid(
            configs=tuple(args.configs), concurrencies=tuple(args.concurrency), overlaps=tuple(args.overlap),
            input_tokens=args.input_tokens, output_tokens=args.output_tokens,
            requests_per_client=args.requests_per_client,
            base_serving=ServingSpec(hot_rows=args.hot_rows, page_rows=args.page_rows,
                                     reserve_bytes=args.reserve_gib * GIB, max_batch_size=args.max_batch_size,
                                     max_prefill_tokens_per_step=args.max_prefill_tokens_per_step,
                                     locality=dataclasses.replace(CALIBRATED, recent_fraction=args.recent_fraction)),
            speculation=speculation_of(args),
            scale=ScaleSpec(token_scale=args.token_scale, index_groups=args.index_groups), seed=args.seed)
    except ValueError as e:
        print(f"dhisparse-plan: {e}", file=sys.stderr)
        return 2
    print(f"{model.name} on {hw.name}: {args.input_tokens} in / {args.output_tokens} out, "
          f"KV pool {model.kv_pool_bytes(hw) / GIB:.1f} GiB per GPU, g={args.token_scale}", flush=True)
    start = time.perf_counter()
    try:
        rows, results = run_grid(hw, model, grid, log=True)
    except (ValueError, RuntimeError) as e:
        print(f"dhisparse-plan: {e}", file=sys.stderr)
        return 2
    best = recommend(rows, args.tpot_bound_ms / 1e3)
    if best is None:
        rec = f"No configuration meets mean TPOT <= {args.tpot_bound_ms:g} ms."
    else:
        rec = (f"Recommended under mean TPOT <= {args.tpot_bound_ms:g} ms (worst overlap of {list(args.overlap)}): "
               f"{best['label']} at C{int(float(best['concurrency']))}: "
               f"{float(best['output_tok_per_s_per_gpu']):.1f} output tok/s per GPU, "
               f"mean TPOT {1e3 * float(best['mean_tpot_s']):.1f} ms.")
    table = markdown_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "plan.csv")
    (args.out / "plan.md").write_text(f"# dhisparse-plan\n\n{model.name} on {hw.name}\n\n{table}\n\n{rec}\n")
    if not args.no_plots:
        plot_grid(rows, args.out)
        top_c, mid = max(args.concurrency), args.overlap[len(args.overlap) // 2]
        plot_memory({f"{lab} C{top_c} overlap {mid:g}": results[(lab, top_c, mid)] for lab in args.configs},
                    args.out / "memory_split.png")
    print(table)
    print(rec)
    if args.measured is not None:
        try:
            write_measured(args, hw, model, grid, results)
        except (OSError, ValueError) as e:
            print(f"dhisparse-plan: --measured: {e}", file=sys.stderr)
            return 2
    if args.sensitivity:
        if len(args.configs) < 2:
            print("dhisparse-plan: --sensitivity needs at least two --configs", file=sys.stderr)
            return 2
        sens = run_sensitivity(args, hw, model, grid, results)
        write_csv(sens, args.out / "sensitivity.csv", SENS_COLUMNS)
        (args.out / "sensitivity.md").write_text("# dhisparse-plan --sensitivity\n\n"
                                                 + markdown_table(sens, SENS_COLUMNS) + "\n")
        if not args.no_plots:
            plot_sensitivity(sens, args.out / "sensitivity.png")
        print(markdown_table(sens, SENS_COLUMNS))
    print(f"wrote {args.out}/ in {time.perf_counter() - start:.1f} s")
    return 0


def write_measured(args: argparse.Namespace, hw: HardwareSpec, model: ModelSpec, grid: PlanGrid,
                   results: dict[tuple[str, int, float], SimResult]) -> None:
    """``--measured``: every run re-timed with the measured host link (``plan_measured.csv``), and the output ratios
    the measured per-layer steps give (``plan_measured.md``), both next to the modelled table."""
    measured = load_measured(args.measured, model.row_bytes)
    hw_m = with_measured_link(hw, measured)
    rows = [result_row(retime(res, hw_m, model), label, c, ov, model.attn_tp) for (label, c, ov), res in results.items()
            if res.log is not None]
    write_csv(rows, args.out / "plan_measured.csv")
    claims = measured_claims(measured, hw, model, grid.speculation)
    lines = [f"# dhisparse-plan --measured\n\nGPU check {measured.source} (commit {measured.commit}); host link "
             f"{hw_m.host_link_bytes_per_s * 1e-9:.3g} GB/s (modelled {hw.host_link_bytes_per_s * 1e-9:.3g}"
             + (f"; measured: {measured.gather_note}" if measured.gather_note else "; no gather rate measured")
             + ").\n",
             "| claim | measured |", "| --- | --- |"] + [f"| {k} | {v:.3g} |" for k, v in claims.items()]
    (args.out / "plan_measured.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def run_sensitivity(args: argparse.Namespace, hw: HardwareSpec, model: ModelSpec, grid: PlanGrid,
                    results: dict[tuple[str, int, float], SimResult]) -> list[dict[str, float | str]]:
    """``--sensitivity``: base = the grid at its middle overlap; the overlap's range is the grid's own overlaps
    (their results are reused); other decision constants are simulated again, time constants re-timed."""
    mid = args.overlap[len(args.overlap) // 2]
    base = {k: v for k, v in results.items() if k[2] == mid}
    drafter = next((DRAFTERS[c.partition("+")[2]] for c in args.configs if "+" in c), None)
    setup = Setup(hw, model, drafter, grid.speculation, dataclasses.replace(grid.base_serving.locality, overlap=mid))
    constants = []
    for c in CONSTANTS:
        if c.target == "locality" and c.field == "overlap":
            c = dataclasses.replace(c, value=mid, low=min(args.overlap), high=max(args.overlap))
        if c.retime or not args.sensitivity_time_only:
            constants.append(c)

    def rerun(c: Constant, changed: Setup) -> dict[tuple[str, int, float], SimResult] | None:
        if c.target == "locality" and c.field == "overlap":
            ov = changed.locality.overlap
            return {(k[0], k[1], mid): v for k, v in results.items() if k[2] == ov} or None
        admitted = tuple(policy for policy, _ in grid.admission)
        out = {k: v for k, v in base.items() if not affects(c, k[0], admitted)}
        if len(out) == len(base):
            return out  # no config depends on this constant
        for label, conc, _ in base:
            if not affects(c, label, admitted):
                continue
            spec = changed.speculation or grid.speculation
            serving = dataclasses.replace(parse_config(label, grid.base_serving, spec, grid.admission),
                                          locality=changed.locality)
            work = WorkloadSpec(grid.input_tokens, grid.output_tokens, concurrency=conc,
                                num_requests=conc * grid.requests_per_client, seed=grid.seed)
            out[(label, conc, mid)] = simulate(changed.hw, changed.model, serving, work, grid.scale)
        print(f"  sensitivity: {c.name} = {changed.current(c) * c.scale:.3g} re-simulated", flush=True)
        return out

    claims = ratio_claims([(args.configs[0], other) for other in args.configs[1:]], args.concurrency)
    return sensitivity(base, setup, claims, model.attn_tp, rerun, constants)


if __name__ == "__main__":
    raise SystemExit(main())

"""``dhisparse-plan multi-turn``: prefix reuse on vs off for multi-turn chat (:mod:`dhisparse_planner.multi_turn`).

Example (the committed table, ``docs/results/prefix_reuse/planner/``)::

    dhisparse-plan multi-turn --model glm5 --context 32768 65536 102400 --turn-tokens 1024 4096 \\
        --clients 16 64 --out docs/results/prefix_reuse/planner

For every context, turn size and client count it runs the workload with reuse on and off and writes one row per
turn: prompt, prefill tokens off / on, hit rate, mean TTFT off / on and their ratio, plus the host memory the cached
pages hold (``multi_turn.md`` / ``multi_turn.csv``).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from dhisparse import defaults
from dhisparse_planner.multi_turn import MultiTurnSpec, per_turn, simulate_multi_turn, with_reuse
from dhisparse_planner.specs import HARDWARE_PRESETS, MODEL_PRESETS, HardwareSpec, ModelSpec

GIB = 2.0**30
COLUMNS = ("context", "turn_tokens", "clients", "turn", "prompt_tokens", "prefill_off", "prefill_on", "hit_rate",
           "ttft_off_s", "ttft_on_s", "ttft_ratio", "cached_gib_mean", "cached_gib_max", "evicted_pages")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dhisparse-plan multi-turn", description=__doc__.split("\n")[0])
    p.add_argument("--hardware", choices=sorted(HARDWARE_PRESETS), default="h200")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="glm5")
    p.add_argument("--context", type=int, nargs="+", default=[32768, 65536, 102400], help="turn 1's prompt")
    p.add_argument("--turn-tokens", type=int, nargs="+", default=[1024, 4096], help="new user message per turn")
    p.add_argument("--reply-tokens", type=int, default=512, help="tokens generated per turn (ASSUMED)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--clients", type=int, nargs="+", default=[16], help="closed-loop clients (sessions at once)")
    p.add_argument("--sessions-per-client", type=int, default=2, help="sessions per client (the first: warm-up)")
    p.add_argument("--host-gib", type=float, default=0.0, help="host store per rank (default: the hardware's)")
    p.add_argument("--page-rows", type=int, default=defaults.PAGE_ROWS)
    p.add_argument("--max-prefill-tokens-per-step", type=int, default=defaults.MAX_PREFILL_TOKENS_PER_STEP)
    p.add_argument("--think-s", type=float, default=0.0,
                   help="mean user time between a reply and the next turn (exponential; seconds)")
    p.add_argument("--seed", type=int, default=0, help="seed of the think times")
    p.add_argument("--out", type=Path, default=None, help="write multi_turn.md / multi_turn.csv here")
    return p


def rows_for(hw: HardwareSpec, model: ModelSpec, spec: MultiTurnSpec) -> list[dict[str, float | str]]:
    """One row per turn: ``spec`` with reuse off and on (the same workload, two simulations)."""
    off, on = simulate_multi_turn(hw, model, with_reuse(spec, False)), simulate_multi_turn(hw, model, spec)
    rows: list[dict[str, float | str]] = []
    for a, b in zip(per_turn(off), per_turn(on), strict=True):
        rows.append({"context": spec.context_tokens, "turn_tokens": spec.turn_tokens, "clients": spec.clients,
                     "turn": a["turn"], "prompt_tokens": a["prompt_tokens"], "prefill_off": a["prefill_tokens"],
                     "prefill_on": b["prefill_tokens"], "hit_rate": b["hit_rate"], "ttft_off_s": a["mean_ttft_s"],
                     "ttft_on_s": b["mean_ttft_s"], "ttft_ratio": a["mean_ttft_s"] / b["mean_ttft_s"],
                     "cached_gib_mean": on.cached_bytes_mean / GIB, "cached_gib_max": on.cached_bytes_max / GIB,
                     "evicted_pages": on.evicted_pages})
    return rows


def _fmt(v: float | str) -> str:
    if isinstance(v, str):
        return v
    return f"{v:.0f}" if float(v).is_integer() or abs(v) >= 100 else f"{v:.3g}"


def markdown(rows: list[dict[str, float | str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    hw, model = HARDWARE_PRESETS[args.hardware], MODEL_PRESETS[args.model]
    start = time.perf_counter()
    rows: list[dict[str, float | str]] = []
    try:
        for clients in args.clients:
            for context in args.context:
                for turn_tokens in args.turn_tokens:
                    spec = MultiTurnSpec(context, turn_tokens, reply_tokens=args.reply_tokens, turns=args.turns,
                                         clients=clients, sessions_per_client=args.sessions_per_client,
                                         page_rows=args.page_rows,
                                         max_prefill_tokens_per_step=args.max_prefill_tokens_per_step,
                                         host_bytes=args.host_gib * GIB if args.host_gib > 0 else None,
                                         think_s=args.think_s, seed=args.seed)
                    rows += rows_for(hw, model, spec)
    except (ValueError, RuntimeError) as e:
        print(f"dhisparse-plan multi-turn: {e}", file=sys.stderr)
        return 2
    host = args.host_gib if args.host_gib > 0 else hw.host_bytes_per_gpu / GIB
    header = (f"{model.name} on {hw.name}, one rank: host store {host:g} GiB, page_rows {args.page_rows}, "
              f"prefill budget {args.max_prefill_tokens_per_step} tokens/step, {args.turns} turns, reply "
              f"{args.reply_tokens} tokens (ASSUMED), think time {args.think_s:g} s (mean, exponential, seed "
              f"{args.seed}), {args.sessions_per_client} sessions per client (the first left out of the means). "
              "prefill_* = mean prompt tokens prefilled per turn (reuse off / on); hit_rate = reused / prompt "
              "tokens; ttft_* = mean TTFT (admission wait + lane queue + prefill); ttft_ratio = off / on; "
              "cached_gib_* = host memory of cached pages with reuse on (time mean / max over the run).")
    table = markdown(rows)
    print(header + "\n\n" + table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "multi_turn.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
        cmd = "dhisparse-plan multi-turn " + " ".join(sys.argv[2:] if argv is None else argv)
        (args.out / "multi_turn.md").write_text(f"# Prefix reuse in multi-turn chat (planner)\n\n`{cmd}`\n\n"
                                                f"{header}\n\n{table}\n")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0

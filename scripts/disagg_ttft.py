"""TTFT and decode throughput, co-located vs disaggregated (planner), at the paper's GLM settings.

Co-located: every prefill runs on the decode GPU inside the engine step (the current planner mode). Disaggregated:
prefill on separate GPUs (``--prefill-gpus``), history over a link (``--link-gbps``), the decode GPU only decodes
(``dhisparse_planner.disaggregated``). Same workload, scale and locality for both, one row per configuration.
Writes a markdown table (``--out``). Usage: ``python scripts/disagg_ttft.py --out docs/results/disaggregated_ttft.md``
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from dhisparse_planner.disaggregated import DisaggregatedSimulator, DisaggregationSpec
from dhisparse_planner.paper import ADMISSION, BASE, SCALE, SPEC
from dhisparse_planner.report import parse_config
from dhisparse_planner.simulator import simulate
from dhisparse_planner.specs import GLM5_INDEXSHARE_NVFP4, H200
from dhisparse_planner.workload import WorkloadSpec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input-tokens", type=int, nargs="+", default=[32768, 102400])
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--configs", nargs="+", default=["hisparse", "adaptive", "adaptive+dflash2"])
    p.add_argument("--overlap", type=float, default=0.8)
    p.add_argument("--prefill-gpus", type=int, default=8)
    p.add_argument("--link-gbps", type=float, default=400.0, help="link bandwidth, Gb/s")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["co-located", "disaggregated"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    link = DisaggregationSpec(args.prefill_gpus, args.link_gbps * 1e9 / 8)
    lines = ["| input | config | mode | mean TTFT (s) | prefill queue (s) | prefill (s) | transfer (s) | "
             "decode admission wait (s) | out tok/s per decode GPU | mean TPOT (ms) |", "|---" * 10 + "|"]
    for tokens in args.input_tokens:
        for label in args.configs:
            base = parse_config(label, BASE, SPEC, ADMISSION)
            serving = dataclasses.replace(base, locality=dataclasses.replace(base.locality, overlap=args.overlap))
            workload = WorkloadSpec(tokens, 8192, concurrency=args.concurrency,
                                    num_requests=args.concurrency * args.requests_per_client, seed=0)
            for mode in args.modes:
                started = time.perf_counter()
                if mode == "co-located":
                    result = simulate(H200, GLM5_INDEXSHARE_NVFP4, serving, workload, SCALE)
                else:
                    result = DisaggregatedSimulator(H200, GLM5_INDEXSHARE_NVFP4, serving, workload, SCALE,
                                                    disaggregation=link).run()
                s = result.summary()
                per_gpu = s["output_tok_per_s"] / GLM5_INDEXSHARE_NVFP4.gpus
                split = [s.get(k, float("nan")) for k in ("mean_prefill_queue_s", "mean_prefill_s", "mean_transfer_s",
                                                          "mean_decode_admission_wait_s")]
                row = (f"| {tokens // 1024}K | {label} | {mode} | {s['mean_ttft_s']:.2f} | "
                       + " | ".join("–" if mode == "co-located" else f"{v:.3f}" for v in split)
                       + f" | {per_gpu:.0f} | {1e3 * s['mean_tpot_s']:.1f} |")
                lines.append(row)
                print(row, f"({time.perf_counter() - started:.0f} s)", flush=True)
    header = (f"GLM-5 IndexShare NVFP4 on H200, C{args.concurrency}, 8K out, overlap {args.overlap}, token scale "
              f"{SCALE.token_scale}; disaggregated: {args.prefill_gpus} prefill GPUs, "
              f"{args.link_gbps:g} Gb/s link.\n\n")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

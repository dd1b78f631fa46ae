"""The paper's TTFT claims in both deployment modes: co-located (prefill inside the decode GPU's engine step) and
disaggregated (prefill on separate GPUs, history imported over a link: :mod:`dhisparse_planner.disaggregated`).

Same setup as the paper grids (:mod:`dhisparse_planner.paper`: H200, GLM-5.x IndexShare NVFP4, one closed-loop
request per client, 8K out, token scale 64) at the calibrated locality; the co-located runs are the grid's own
runs (same specs, simulated once). Disaggregated: :class:`~dhisparse_planner.disaggregated.DisaggregationSpec`
defaults (8 prefill GPUs, 400 Gb/s = 50 GB/s link, 20 µs per transfer).

In the disaggregated mode TTFT = prefill queue + prefill + transfer does not depend on the decode GPU's KV policy
(the first token comes from the context phase); the policy shows in how long an imported history waits for
admission on the decode GPU (``decode admission wait``), so both TTFT and TTFT + admission wait (the time until
the request decodes) are reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from dhisparse_planner.batch import Job, run_job
from dhisparse_planner.disaggregated import DisaggregationSpec
from dhisparse_planner.locality import LocalityModel
from dhisparse_planner.paper import ADMISSION, BASE, PAPER_REQUESTS_PER_CLIENT, SCALE, SPEC
from dhisparse_planner.report import markdown_table, parse_config
from dhisparse_planner.specs import GLM5_INDEXSHARE_NVFP4, H200
from dhisparse_planner.workload import WorkloadSpec

Row = dict[str, float | str]
MODES = ("co-located", "disaggregated")
LINK = DisaggregationSpec()
# (input tokens, numerator config, denominator config, the paper's number): "<num> / <den> mean TTFT"
CLAIMS = ((32768, "hisparse", "adaptive", "2.3×"), (102400, "hisparse", "adaptive+dflash2", "2.1×"))


def configs(tokens: int) -> tuple[str, ...]:
    return ("hisparse", "adaptive") + (("adaptive+dflash2",) if tokens > 32768 else ())


def jobs(locality: LocalityModel, inputs: Sequence[int], concurrency: int,
         link: DisaggregationSpec = LINK) -> list[Job]:
    """The runs of :func:`ttft_rows`: per input and config, co-located and disaggregated."""
    model = GLM5_INDEXSHARE_NVFP4
    out = []
    for tokens in inputs:
        for label in configs(tokens):
            serving = dataclasses.replace(parse_config(label, BASE, SPEC, ADMISSION), locality=locality)
            work = WorkloadSpec(tokens, 8192, concurrency=concurrency,
                                num_requests=concurrency * PAPER_REQUESTS_PER_CLIENT)  # the grid's
            out += [Job(H200, model, serving, work, SCALE), Job(H200, model, serving, work, SCALE, disaggregation=link)]
    return out


def ttft_rows(locality: LocalityModel, inputs: Sequence[int], concurrency: int,
              link: DisaggregationSpec = LINK) -> list[Row]:
    """One row per input, config and mode: mean TTFT and its split, decode admission wait, output, TPOT (the closed
    loop's steady state, :mod:`dhisparse_planner.metrics`; the split and the wait are over every request)."""
    rows: list[Row] = []
    for job in jobs(locality, inputs, concurrency, link):
        s = run_job(job).summary()
        disagg = job.disaggregation is not None
        wait = s.get("mean_decode_admission_wait_s", 0.0) if disagg else 0.0
        rows.append({"input": f"{job.workload.input_tokens // 1024}K", "concurrency": job.workload.concurrency,
                     "config": job.serving.label,
                     "mode": MODES[disagg], "mean_ttft_s": s["steady_mean_ttft_s"],
                     "prefill_queue_s": s["mean_prefill_queue_s"] if disagg else "–",
                     "prefill_s": s["mean_prefill_s"] if disagg else "–",
                     "transfer_s": s["mean_transfer_s"] if disagg else "–",
                     "decode_admission_wait_s": wait if disagg else "–",
                     "ttft_plus_admission_wait_s": s["steady_mean_ttft_s"] + wait,
                     "output_tok_per_s_per_decode_gpu": s["steady_output_tok_per_s"] / job.model.attn_tp,
                     "mean_tpot_ms": 1e3 * s["steady_mean_tpot_s"]})
    return rows


def _ratio(rows: Sequence[Row], tokens: int, num: str, den: str, mode: str, metric: str) -> float:
    get = {(r["input"], r["config"], r["mode"]): float(r[metric]) for r in rows}
    key = f"{tokens // 1024}K"
    a, b = get.get((key, num, mode)), get.get((key, den, mode))
    return a / b if a is not None and b else float("nan")


def claims(rows: Sequence[Row]) -> list[Row]:
    """The TTFT claims per mode, in the summary's "claims over the calibrated overlap range" format."""
    out: list[Row] = []
    for tokens, num, den, paper in CLAIMS:
        for mode in MODES:
            conc = [r["concurrency"] for r in rows if r["input"] == f"{tokens // 1024}K" and r["mode"] == mode]
            if not conc:
                continue
            ttft = _ratio(rows, tokens, num, den, mode, "mean_ttft_s")
            note = "nominal locality"
            if mode == "disaggregated":
                wait = _ratio(rows, tokens, num, den, mode, "ttft_plus_admission_wait_s")
                note += f"; TTFT + decode admission wait: {wait:.2f}"
            out.append({"claim": f"{num} / {den} mean TTFT, {tokens // 1024}K C{conc[0]}, {mode}", "paper": paper,
                        "planner (range over the calibrated overlaps)": f"{ttft:.2f}", "note": note})
    return out


def claim_rows(rows: Sequence[Row]) -> list[Row]:
    """The same claims in the headline table's format (not varied over the constants)."""
    return [{"claim": r["claim"], "paper": r["paper"],
             "planner nominal": r["planner (range over the calibrated overlaps)"], "planner range": "not varied",
             "time-only constants jointly": "not varied", "depends most on (value at low–high end)": r["note"]}
            for r in claims(rows)]


def write_markdown(rows: Sequence[Row], path: Path, locality: LocalityModel, concurrency: int,
                   link: DisaggregationSpec = LINK) -> Path:
    header = (f"# TTFT, co-located vs disaggregated (generated by scripts/reproduce_paper.py)\n\n"
              f"GLM-5 IndexShare NVFP4 on H200, C{concurrency}, one request per client, 8K out, locality overlap "
              f"{locality.overlap:g} / recent fraction {locality.recent_fraction:g} (calibrated), token scale "
              f"{SCALE.token_scale}; disaggregated: {link.prefill_gpus} prefill GPUs, "
              f"{link.link_bytes_per_s * 8e-9:g} Gb/s link, {link.link_latency_s * 1e6:g} µs per transfer. "
              "Disaggregated TTFT = prefill queue + prefill + transfer (independent of the decode policy); the "
              "decode admission wait is how long the imported history then waits for the decode GPU.\n\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + markdown_table(rows, list(rows[0])) + "\n\n" + markdown_table(claims(rows), list(
        claims(rows)[0])) + "\n")
    return path

"""`dhisparse-bench`: throughput, TTFT and inter-token latency per KV policy, measured by the real perf_analyzer
or by AIPerf.

It starts one `dhisparse-serve` per KV policy (same engine, same pool budget) and warms each up; then, for
every concurrency level and repeat, it runs perf_analyzer 2.51 with `--streaming` over gRPC against each
policy's ensemble in turn (long Shakespeare prompts cut to `--prompt-tokens`, `max_tokens` fixed; the
policy order rotates per repeat), stops the servers, and prints a table of medians with ratios against
the baseline policy measured side by side, and writes `bench.csv` and `bench.png` (plus every
perf_analyzer report and server log) to `--output-dir`. With `--aiperf` the servers also serve the OpenAI API
(`--openai-port`) and AIPerf 0.13 measures it instead (`dhisparse_client.aiperf`: synthetic prompts, or
multi-turn conversations with `--aiperf-workload multi-turn`); rows, table and plot are the same. argparse lives
only here.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dhisparse_client.aiperf import WORKLOADS, AIPerfError, Workload, find_aiperf, run_aiperf
from dhisparse_client.bench_report import (
    BenchRow,
    add_ratios,
    combine_repeats,
    format_table,
    plot,
    residency_deltas,
    write_csv,
)
from dhisparse_client.client import DHiSparseClient, GenerationError, GenerationOptions
from dhisparse_client.genai_perf import GenaiPerfError, find_genai_perf, run_genai_perf
from dhisparse_client.perf import PerfAnalyzerError, find_perf_analyzer, run_level, with_token_count, write_input_data
from dhisparse_client.prompts import cut_prompts, engine_limits, shakespeare_text
from dhisparse_client.serve_process import ServeError, ServeProcess

DISAGG_SUFFIX = "+disagg"


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dhisparse-bench", description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True, type=Path, help="engine directory built by dhisparse-build")
    p.add_argument("--policies", default="adaptive,hisparse,resident",
                   help="KV policies to compare, comma-separated (resident, hisparse, adaptive, dense); a "
                        f"'{DISAGG_SUFFIX}' suffix (e.g. adaptive{DISAGG_SUFFIX}) serves that policy disaggregated "
                        "(dhisparse-serve --disaggregated: context and generation engines joined by NIXL)")
    p.add_argument("--baseline", default="hisparse", help="policy the ratios are computed against")
    p.add_argument("--pool-bytes", type=int, default=None, help="device KV pool budget for every policy")
    p.add_argument("--concurrency", type=_int_list, default=[1, 4, 8], help="levels, e.g. 1,4,8")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level and repeat (default: max(8, 2 x concurrency))")
    p.add_argument("--repeats", type=int, default=3, help="measurements per level and policy (medians reported)")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length (capped to fit the engine)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts perf_analyzer cycles through")
    p.add_argument("--prompt-file", type=Path, default=None, help="text to cut prompts from (default: Hamlet)")
    p.add_argument("--model", default="ensemble", help="model perf_analyzer drives (ensemble or dhisparse_bls)")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="runtime option for every server (e.g. speculative=dflash2); repeatable")
    p.add_argument("--output-dir", type=Path, default=Path("build/bench"), help="where reports and plots go")
    p.add_argument("--perf-analyzer", type=Path, default=None, help="perf_analyzer 2.51 binary")
    p.add_argument("--level-timeout", type=float, default=600.0, help="seconds allowed per perf_analyzer run")
    p.add_argument("--genai-perf", action="store_true",
                   help="also run genai-perf 0.0.8 at every level (WITH_GENAI_PERF=1 scripts/setup_triton.sh)")
    p.add_argument("--genai-perf-interval-ms", type=int, default=4000, help="genai-perf measurement window")
    a = p.add_argument_group("AIPerf against the OpenAI API (WITH_AIPERF=1 scripts/setup_triton.sh)")
    a.add_argument("--aiperf", action="store_true",
                   help="measure with AIPerf 0.13 against each server's OpenAI API instead of perf_analyzer")
    a.add_argument("--aiperf-workload", choices=WORKLOADS, default="synthetic",
                   help="synthetic prompts, or multi-turn chat conversations (each turn appends to the history)")
    a.add_argument("--turns", type=int, default=3, help="turns per conversation (multi-turn)")
    a.add_argument("--aiperf-endpoint", choices=("chat", "completions"), default="chat",
                   help="OpenAI endpoint of the synthetic workload (multi-turn always uses chat)")
    a.add_argument("--aiperf-binary", type=Path, default=None, help="the aiperf command")
    a.add_argument("--chat-template", type=Path, default=None,
                   help="chat template for the servers (dhisparse-serve --chat-template), for engines without one")
    return p.parse_args(argv)


def _engine_options(args: argparse.Namespace, policy: str) -> dict[str, object]:
    options: dict[str, object] = {}
    for item in args.engine_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-option expects KEY=VALUE, got {item!r}")
        options[key] = value
    options["kv_policy"] = policy.removesuffix(DISAGG_SUFFIX)
    if args.pool_bytes is not None:
        options["pool_bytes"] = args.pool_bytes
    return options


def _log(message: str) -> None:
    print(f"[dhisparse-bench] {message}", file=sys.stderr, flush=True)


def _genai_perf(args: argparse.Namespace, grpc_url: str, concurrency: int, out: Path) -> dict[str, float]:
    """genai-perf's figures for one level, or {} (with a log line) when it is off or fails."""
    if not args.genai_perf:
        return {}
    try:
        return run_genai_perf(find_genai_perf(), grpc_url, args.engine, concurrency, args.prompt_tokens_used,
                              args.max_tokens, out, args.model, args.genai_perf_interval_ms, args.level_timeout)
    except GenaiPerfError as error:
        _log(f"genai-perf at concurrency {concurrency} failed: {error}")
        return {}


@dataclass
class PolicyServer:
    """A running server for one policy; `failed` is set when one of its levels failed (it is then skipped)."""

    policy: str
    server: ServeProcess
    client: DHiSparseClient
    grpc_url: str
    out: Path
    failed: bool = False
    openai_url: str | None = None
    openai_model: str | None = None


def start_server(args: argparse.Namespace, policy: str, warm_prompt: str) -> PolicyServer | None:
    """Start and warm up `dhisparse-serve` for `policy`; None (logged) when it does not come up."""
    out = args.output_dir / policy
    out.mkdir(parents=True, exist_ok=True)
    extra: tuple[str, ...] = ("--disaggregated",) if policy.endswith(DISAGG_SUFFIX) else ()
    if args.aiperf:
        extra += ("--openai-port", "0") + (("--chat-template", str(args.chat_template)) if args.chat_template else ())
    server = ServeProcess(args.engine, _engine_options(args, policy), log_path=out / "server.log", extra_args=extra)
    started = time.monotonic()
    try:
        endpoints = server.start()
        client = DHiSparseClient(endpoints.grpc_url, endpoints.http_url, endpoints.metrics_url, model=args.model)
        list(client.stream(warm_prompt, GenerationOptions(max_tokens=4)))  # first-request costs out of the way
        time.sleep(0.6)  # let /metrics count the warm-up before the first level reads its baseline
    except (ServeError, GenerationError) as error:
        server.stop()
        _log(f"{policy}: server failed: {error}")
        return None
    _log(f"{policy}: server ready in {time.monotonic() - started:.1f} s (grpc {endpoints.grpc_url})")
    return PolicyServer(policy, server, client, endpoints.grpc_url, out, openai_url=endpoints.openai_url,
                        openai_model=endpoints.openai_model)


def measure(args: argparse.Namespace, target: PolicyServer, binary: Path, input_data: Path, concurrency: int,
            repeat: int) -> BenchRow | None:
    """One perf_analyzer run (and genai-perf on the first repeat) against one server; None when it failed."""
    count = args.requests or max(8, 2 * concurrency)
    before = target.client.metrics()
    level_start = time.monotonic()
    try:
        if args.aiperf:
            if target.openai_url is None or target.openai_model is None:
                raise AIPerfError(f"{target.policy}: the server printed no OpenAI endpoint")
            result, _ = run_aiperf(binary, target.openai_url, target.openai_model, args.engine, args.workload,
                                   concurrency, count, target.out, f"aiperf-c{concurrency}-r{repeat}",
                                   args.level_timeout)
        else:
            result = run_level(binary, target.grpc_url, input_data, concurrency, count, target.out, args.model,
                               args.level_timeout, tag=f"c{concurrency}-r{repeat}")
    except (PerfAnalyzerError, AIPerfError) as error:
        target.failed = True
        _log(f"{target.policy}: concurrency {concurrency} failed, skipping this policy from now on: {error}")
        return None
    time.sleep(0.6)  # metrics are refreshed every 250 ms by the server
    after = target.client.metrics()
    residency = residency_deltas(before, after)
    if "generated_tokens" in after and not args.aiperf:  # AIPerf counts the server's tokens itself (usage)
        result = with_token_count(result, after["generated_tokens"] - before.get("generated_tokens", 0.0))
    _log(f"{target.policy}: concurrency {concurrency} repeat {repeat}: {result.token_throughput:.1f} tok/s, "
         f"TTFT {result.ttft_ms:.0f} ms, ITL {result.itl_ms:.1f} ms ({time.monotonic() - level_start:.0f} s)")
    gp = _genai_perf(args, target.grpc_url, concurrency, target.out) if repeat == 0 else {}
    return BenchRow(target.policy, result, **residency, genai_perf=gp)


def run_all(args: argparse.Namespace, policies: list[str], binary: Path, input_data: Path, warm_prompt: str
            ) -> list[BenchRow]:
    """All servers up at once; every (level, repeat) measures each policy in turn, the order rotating per
    repeat, so that slow drifts of a shared machine hit every policy alike. Medians over repeats."""
    servers: list[PolicyServer] = []
    measured: dict[tuple[str, int], list[BenchRow]] = {}
    try:
        for policy in policies:
            started = start_server(args, policy, warm_prompt)
            if started is not None:
                servers.append(started)
        for concurrency in args.concurrency:
            for repeat in range(args.repeats):
                shift = repeat % max(1, len(servers))
                for target in servers[shift:] + servers[:shift]:
                    row = None if target.failed else measure(args, target, binary, input_data, concurrency, repeat)
                    if row is not None:
                        measured.setdefault((target.policy, concurrency), []).append(row)
    finally:
        for target in servers:
            target.server.stop()
    return [combine_repeats(measured[(p, c)]) for p in policies for c in args.concurrency if (p, c) in measured]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    baseline = args.baseline if args.baseline in policies else policies[0]
    try:
        binary = find_aiperf(args.aiperf_binary) if args.aiperf else find_perf_analyzer(args.perf_analyzer)
        max_len, max_new = engine_limits(args.engine)
        if not 1 <= args.max_tokens <= max_new:
            raise ValueError(f"--max-tokens must be in 1..{max_new} for this engine")
        prompt_tokens = min(args.prompt_tokens, max_len - args.max_tokens - 2)  # room for BOS
        if args.aiperf:
            turns = args.turns if args.aiperf_workload == "multi-turn" else 1
            # room for the whole conversation, and for a chat template's few tokens per message
            prompt_tokens = min(prompt_tokens, (max_len - 8) // turns - args.max_tokens - 16)
            args.workload = Workload(args.aiperf_workload, max(prompt_tokens, 1), args.max_tokens, args.turns,
                                     "chat" if args.aiperf_workload == "multi-turn" else args.aiperf_endpoint)
        if prompt_tokens < 1:
            raise ValueError(f"--max-tokens {args.max_tokens} leaves no room for a prompt (max_model_len {max_len})")
        text = args.prompt_file.read_text() if args.prompt_file else shakespeare_text()
        prompts = cut_prompts(text, args.engine / "tokenizer.json", args.prompts, prompt_tokens)
        args.prompt_tokens_used = prompt_tokens
    except (PerfAnalyzerError, AIPerfError, ValueError, OSError) as error:
        print(f"dhisparse-bench: error: {error}", file=sys.stderr)
        return 2
    args.output_dir.mkdir(parents=True, exist_ok=True)
    input_data = write_input_data(args.output_dir / "input_data.json", prompts, args.max_tokens)
    setup = {"engine": str(args.engine), "policies": policies, "baseline": baseline, "pool_bytes": args.pool_bytes,
             "concurrency": args.concurrency, "repeats": args.repeats, "prompt_tokens": prompt_tokens,
             "max_tokens": args.max_tokens,
             "model": args.model, "engine_options": args.engine_option,
             **({"aiperf": str(binary)} if args.aiperf else {"perf_analyzer": str(binary)}),
             "genai_perf": args.genai_perf, "tool": "aiperf" if args.aiperf else "perf_analyzer",
             "aiperf_workload": vars(args.workload) if args.aiperf else None, "command": sys.argv}
    (args.output_dir / "setup.json").write_text(json.dumps(setup, indent=2) + "\n")
    _log(f"{len(policies)} policies x {len(args.concurrency)} levels x {args.repeats} repeats, prompts of "
         f"{prompt_tokens} tokens, max_tokens {args.max_tokens}, output in {args.output_dir}")
    rows = run_all(args, policies, binary, input_data, prompts[0])
    if not rows:
        print("dhisparse-bench: error: nothing was measured (see the logs above)", file=sys.stderr)
        return 1
    rows = add_ratios(rows, baseline)
    print(format_table(rows, baseline))
    csv_path = write_csv(rows, args.output_dir / "bench.csv")
    pool = f"pool {args.pool_bytes / 2**20:.2f} MiB" if args.pool_bytes else "engine's pool"
    if args.aiperf:
        workload = args.workload
        what = (f"AIPerf {workload.kind}, {workload.turns} turns of {prompt_tokens} tokens" if
                workload.kind == "multi-turn" else f"AIPerf {workload.endpoint}, {prompt_tokens}-token prompts")
        xlabel = f"concurrency (AIPerf, OpenAI /v1/{'chat/' if workload.endpoint == 'chat' else ''}completions, SSE)"
    else:
        what, xlabel = f"{prompt_tokens}-token prompts", "concurrency (perf_analyzer --streaming, gRPC)"
    png_path = plot(rows, args.output_dir / "bench.png",
                    f"{args.engine.name}: {what}, {args.max_tokens} new tokens, {pool}", xlabel)
    print(f"wrote {csv_path} and {png_path}")
    measured = {(row.policy, row.result.concurrency) for row in rows}
    missing = [(p, c) for p in policies for c in args.concurrency if (p, c) not in measured]
    if missing or any(math.isnan(row.result.ttft_ms) for row in rows):
        print(f"dhisparse-bench: not measured: {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

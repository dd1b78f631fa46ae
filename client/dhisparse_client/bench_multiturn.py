"""`dhisparse-bench --workload multi-turn`: prefix reuse measured through Triton.

Two `dhisparse-serve` processes over the same engine — `prefix_reuse` on and off, otherwise identical — serve
`--sessions` conversations of `--turns` turns: each turn appends a user message of `--turn-tokens` token ids to the
whole history (every earlier message and reply) and asks for a `--max-tokens` reply from the `dhisparse` model
(token ids in and out, tensorrtllm_backend's `input_ids` / `output_ids`, greedy), with `return_perf_metrics`. Every
turn of every session goes to both servers in turn (the order alternates), one request at a time. Per request: TTFT
(the client's time to the first response carrying tokens), `kv_cache_reused_blocks` (pages found in the server's
prefix cache) and so the prompt tokens its prefill computed (prompt − reused pages × `page_rows`). Both servers'
replies must be equal, or the run fails. Written to `--output-dir`: `multiturn.csv` (every request),
`multiturn.json` (setup, per-turn medians, both servers' `/metrics` prefix counters), `multiturn.png` (per turn).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
import time
from pathlib import Path

from dhisparse_client.client import DHiSparseClient, GenerationError, _grpc_inputs
from dhisparse_client.serve_process import ServeError, ServeProcess

MODES = ("reuse", "no_reuse")


def _engine_json(engine: Path, name: str) -> dict:
    path = engine / name
    return json.loads(path.read_text()) if path.exists() else {}


def one_request(client: DHiSparseClient, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """``(reply token ids, TTFT in s, reused pages)`` of one greedy request to the `dhisparse` model."""
    values: dict[str, object] = {"input_ids": prompt, "input_lengths": len(prompt), "request_output_len": max_tokens,
                                 "streaming": True, "temperature": 0.0, "return_perf_metrics": True}
    started = time.perf_counter()
    ttft, tokens, reused = float("nan"), [], 0
    for arrays in client.stream_results("dhisparse", _grpc_inputs(values)):
        new = arrays.get("output_ids")
        if new is not None and new.size:
            if not tokens:
                ttft = time.perf_counter() - started
            tokens.extend(int(t) for t in new.reshape(-1))
        if "kv_cache_reused_blocks" in arrays:
            reused = int(arrays["kv_cache_reused_blocks"].reshape(-1)[0])
    return tokens, ttft, reused


def run_multiturn(args: argparse.Namespace) -> int:
    """The workload (see the module docstring); returns the exit code."""
    runtime = _engine_json(args.engine, "runtime.json")
    options = {}
    for item in args.engine_option:
        key, _, value = item.partition("=")
        options[key] = value
    page_rows = int(options.get("page_rows", runtime.get("page_rows", 64)))
    vocab = int(_engine_json(args.engine, "config.json").get("vocab_size", 0))
    if vocab < 2:
        print("dhisparse-bench: error: the engine's config.json names no vocab_size", file=sys.stderr)
        return 2
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    servers: dict[str, ServeProcess] = {}
    clients: dict[str, DHiSparseClient] = {}
    try:
        for mode in MODES:
            server = ServeProcess(args.engine, {**options, "prefix_reuse": mode == "reuse"},
                                  log_path=out / f"server-{mode}.log")
            endpoints = server.start()
            servers[mode] = server
            clients[mode] = DHiSparseClient(endpoints.grpc_url, endpoints.http_url, endpoints.metrics_url)
        rng = random.Random(0)
        for client in clients.values():  # first-request costs out of the way (a prompt no session shares)
            one_request(client, [rng.randrange(vocab) for _ in range(8)], 2)
        rows, histories = [], [[] for _ in range(args.sessions)]
        for turn in range(args.turns):
            for s in range(args.sessions):
                prompt = histories[s] + [rng.randrange(vocab) for _ in range(args.turn_tokens)]
                order = MODES if (turn + s) % 2 == 0 else MODES[::-1]
                got = {mode: one_request(clients[mode], prompt, args.max_tokens) for mode in order}
                if got["reuse"][0] != got["no_reuse"][0]:
                    print(f"dhisparse-bench: error: session {s} turn {turn + 1}: replies differ with and without "
                          "prefix reuse", file=sys.stderr)
                    return 1
                row = {"turn": turn + 1, "session": s, "prompt_tokens": len(prompt)}
                for mode in MODES:
                    _, ttft, reused = got[mode]
                    row[f"ttft_ms_{mode}"] = ttft * 1e3
                    row[f"reused_tokens_{mode}"] = reused * page_rows
                    row[f"prefill_tokens_{mode}"] = len(prompt) - reused * page_rows
                rows.append(row)
                histories[s] = prompt + got["reuse"][0]
                print(f"turn {turn + 1} session {s}: {len(prompt)} tokens, TTFT {row['ttft_ms_no_reuse']:.0f} -> "
                      f"{row['ttft_ms_reuse']:.0f} ms, prefill {row['prefill_tokens_no_reuse']} -> "
                      f"{row['prefill_tokens_reuse']} tokens", flush=True)
        time.sleep(0.6)  # /metrics refreshes every 250 ms
        metrics = {mode: {k: v for k, v in clients[mode].metrics().items() if "prefix" in k or k.startswith("prefill")}
                   for mode in MODES}
    except (ServeError, GenerationError) as error:
        print(f"dhisparse-bench: error: {error}", file=sys.stderr)
        return 1
    finally:
        for server in servers.values():
            server.stop()
    summary = summarize(rows, args.turns)
    with open(out / "multiturn.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    setup = {"workload": "multi-turn", "engine": str(args.engine), "sessions": args.sessions, "turns": args.turns,
             "turn_tokens": args.turn_tokens, "max_tokens": args.max_tokens, "page_rows": page_rows,
             "engine_options": args.engine_option, "summary": summary, "metrics": metrics}
    (out / "multiturn.json").write_text(json.dumps(setup, indent=2) + "\n")
    print(f"{'turn':>4} {'prompt':>7} {'TTFT off':>9} {'TTFT on':>8} {'ratio':>6} {'prefill off':>12} "
          f"{'prefill on':>11}")
    for r in summary:
        print(f"{r['turn']:>4} {r['prompt_tokens']:>7.0f} {r['ttft_ms_no_reuse']:>6.0f} ms "
              f"{r['ttft_ms_reuse']:>5.0f} ms {r['ttft_ratio']:>5.2f}x "
              f"{r['prefill_tokens_no_reuse']:>12.0f} {r['prefill_tokens_reuse']:>11.0f}")
    plot(summary, out / "multiturn.png", f"{args.engine.name}: {args.sessions} sessions, {args.turn_tokens}-token "
                                          f"turns, {args.max_tokens}-token replies (Triton)")
    print(f"wrote {out / 'multiturn.csv'}, {out / 'multiturn.json'} and {out / 'multiturn.png'}")
    return 0


def summarize(rows: list[dict], turns: int) -> list[dict]:
    """Per turn: medians over sessions, and the median of the per-session TTFT ratios (off ÷ on)."""
    summary = []
    for turn in range(1, turns + 1):
        these = [r for r in rows if r["turn"] == turn]
        med = {k: statistics.median(r[k] for r in these) for k in these[0] if k not in ("turn", "session")}
        ratio = statistics.median(r["ttft_ms_no_reuse"] / r["ttft_ms_reuse"] for r in these)
        summary.append({"turn": turn, **med, "ttft_ratio": ratio})
    return summary


def plot(summary: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in summary]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, label in (("no_reuse", "prefix_reuse off"), ("reuse", "prefix_reuse on")):
        ax1.plot(turns, [r[f"ttft_ms_{mode}"] for r in summary], "o-", label=label)
        ax2.plot(turns, [r[f"prefill_tokens_{mode}"] for r in summary], "o-", label=label)
    ax1.set(xlabel="turn", ylabel="TTFT (ms, median)", title="time to first token")
    ax2.set(xlabel="turn", ylabel="prompt tokens computed (median)", title="prefill work")
    ax1.legend()
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

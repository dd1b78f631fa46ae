"""Multi-turn prefix reuse: TTFT and prefill work per turn, with and without ``prefix_reuse``, in one run.

    python scripts/bench_prefix.py [--engine DIR] [--sessions 4] [--turns 6] [--turn-tokens 1024] [--max-tokens 32]
                                   [--policy adaptive] [--output-dir docs/results/prefix_reuse]

Workload: ``--sessions`` conversations; each turn appends a user message of ``--turn-tokens`` tokens to the whole
history (every earlier message and reply) and generates a ``--max-tokens`` reply, so turn ``k``'s prompt is about
``(k + 1) * turn_tokens`` tokens of which only the new message and the previous reply are new.

Method. Two engines over the same weights — ``prefix_reuse`` on and off, otherwise identical — serve the same
requests in lockstep: every turn of every session goes to both (the order alternates), one request at a time, so
load from other processes falls on both alike and each TTFT is a request alone in its engine. TTFT is the wall time
from ``add_request`` to the first token (admission, prefill, first sampling) in process CPU time (the run is
single-threaded, so a shared machine's preemption does not count; wall time is recorded and its ratio printed
beside, as ``scripts/bench_model.py`` does); prefill work is
the tokens the prefill computed (the executor's ``prefill_tokens`` counter). Exactness: both engines' replies must be
equal (greedy), or the bench stops with an error; the history is built from them. Reported per turn: medians over
sessions of TTFT, their ratio (without ÷ with), prefill tokens computed, the new tokens of the turn; a CSV, a JSON
with the setup and a plot per turn go to ``--output-dir``.

Without ``--engine`` a small random GLM-style model (``glm_moe_dsa``, 8 layers, hidden 512, top-k 256, a 16-head
indexer of 32 dims, float32) is built in a temporary directory. What reuse saves depends on where a prefill's time
goes: per token, the projections, attention over its top-k rows and the MLP cost the same at any position, while the
indexer scores every earlier key (its cost grows with the position). Without reuse turn ``k`` computes all ``k``
turns' tokens, with reuse only the last turn's, at the *latest* positions. The TTFT ratio is therefore the token
ratio where per-token work dominates (real DSA models: a few-head FP8 indexer beside 6K-wide layers, up to ~100K
tokens) and less where the indexer does (a tiny model at long context); the docs give both measurements.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def build_model(root: Path, layers: int, hidden: int, max_positions: int, index_head_dim: int = 32) -> Path:
    """A random GLM-style checkpoint (transformers' ``save_pretrained``) and its engine, in ``root``."""
    from tiny_models import BASE
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from dhisparse_builder import BuildOptions, build_engine

    kwargs = {**BASE, "hidden_size": hidden, "intermediate_size": 2 * hidden, "moe_intermediate_size": hidden // 2,
              "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 8, "kv_lora_rank": 128,
              "q_lora_rank": 192, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
              "index_head_dim": index_head_dim, "index_n_heads": 16, "index_topk": 256,
              "index_topk_pattern": "FS" * (layers // 2),
              "max_position_embeddings": max_positions, "vocab_size": 4096}
    torch.manual_seed(0)
    checkpoint = root / "checkpoint"
    GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**kwargs)).save_pretrained(checkpoint)
    return build_engine(BuildOptions(checkpoint, root / "engine", {"dtype": "float32"}), progress=lambda d, t: None)


def serve_one(llm, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float, float]:
    """Run one request alone: its reply, TTFT in process CPU time and in wall time (s), and the prompt tokens its
    prefill computed."""
    from dhisparse import SamplingParams

    engine = llm.engine
    before = engine.executor.counters["prefill_tokens"]
    cpu = time.process_time()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.requests[rid].first_token_time is None:
        engine.step()
    ttft_cpu = time.process_time() - cpu
    while engine.requests[rid].finish_reason is None:
        engine.step()
    req = engine.pop_finished(rid)
    computed = float(engine.executor.counters["prefill_tokens"] - before)
    return list(req.output_token_ids), ttft_cpu, req.timing()["ttft_s"], computed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, default=None, help="engine directory (default: a random model built here)")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-tokens", type=int, default=1024, help="tokens of each user message")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens of each reply")
    p.add_argument("--policy", default="adaptive", help="KV policy of both engines (hisparse or adaptive)")
    p.add_argument("--page-rows", type=int, default=64)
    p.add_argument("--layers", type=int, default=8, help="built model: decoder layers")
    p.add_argument("--hidden", type=int, default=512, help="built model: hidden size")
    p.add_argument("--index-head-dim", type=int, default=32, help="built model: indexer head size (16 heads)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--output-dir", type=Path, default=Path("build/bench_prefix"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from dhisparse import LLM

    tmp = tempfile.TemporaryDirectory()
    positions = (args.turns + 1) * (args.turn_tokens + args.max_tokens) + 64
    engine_dir = args.engine or build_model(Path(tmp.name), args.layers, args.hidden, max(positions, 2048),
                                            args.index_head_dim)
    options = dict(kv_policy=args.policy, page_rows=args.page_rows, device=args.device, max_batch_size=4,
                   max_model_len=positions)
    engines = {"reuse": LLM(engine_dir, **options), "no_reuse": LLM(engine_dir, prefix_reuse=False, **options)}
    vocab = engines["reuse"].vocab_size
    gen = torch.Generator().manual_seed(0)
    warm = torch.randint(0, vocab, (args.turn_tokens,), generator=gen).tolist()
    for llm in engines.values():  # untimed warm-up (allocator, first-call costs)
        serve_one(llm, warm, 2)

    rows = []
    histories: list[list[int]] = [[] for _ in range(args.sessions)]
    for turn in range(args.turns):
        for s in range(args.sessions):
            message = torch.randint(0, vocab, (args.turn_tokens,), generator=gen).tolist()
            prompt = histories[s] + message
            order = ["reuse", "no_reuse"] if (turn + s) % 2 == 0 else ["no_reuse", "reuse"]
            out = {name: serve_one(engines[name], prompt, args.max_tokens) for name in order}
            if out["reuse"][0] != out["no_reuse"][0]:
                print(f"bench_prefix: error: session {s} turn {turn}: replies differ with and without reuse",
                      file=sys.stderr)
                return 1
            new = len(prompt) - (len(histories[s]) - len(out["reuse"][0]) if turn else 0)
            rows.append({"turn": turn + 1, "session": s, "prompt_tokens": len(prompt), "new_tokens": new,
                         "ttft_reuse_s": out["reuse"][1], "ttft_no_reuse_s": out["no_reuse"][1],
                         "ttft_wall_reuse_s": out["reuse"][2], "ttft_wall_no_reuse_s": out["no_reuse"][2],
                         "prefill_reuse": out["reuse"][3], "prefill_no_reuse": out["no_reuse"][3]})
            histories[s] = prompt + out["reuse"][0]
            print(f"turn {turn + 1} session {s}: {len(prompt)} tokens, TTFT {out['no_reuse'][1] * 1e3:.0f} -> "
                  f"{out['reuse'][1] * 1e3:.0f} ms CPU ({out['no_reuse'][2] * 1e3:.0f} -> {out['reuse'][2] * 1e3:.0f} "
                  f"ms wall), prefill {out['no_reuse'][3]:.0f} -> {out['reuse'][3]:.0f} tokens", flush=True)

    summary = []
    for turn in range(1, args.turns + 1):
        these = [r for r in rows if r["turn"] == turn]
        med = {k: statistics.median(r[k] for r in these) for k in these[0] if k not in ("turn", "session")}
        ratios = [r["ttft_no_reuse_s"] / r["ttft_reuse_s"] for r in these]
        wall = [r["ttft_wall_no_reuse_s"] / r["ttft_wall_reuse_s"] for r in these]
        summary.append({"turn": turn, **med, "ttft_ratio": statistics.median(ratios), "ttft_ratio_min": min(ratios),
                        "ttft_ratio_max": max(ratios), "ttft_wall_ratio": statistics.median(wall)})
    print(f"\n{'turn':>4} {'prompt':>7} {'new':>6} {'TTFT no reuse':>14} {'TTFT reuse':>11} {'ratio':>6} "
          f"{'(min-max)':>12} {'prefill no reuse':>17} {'prefill reuse':>14} {'wall ratio':>10}   (TTFT: CPU time)")
    for r in summary:
        print(f"{r['turn']:>4} {r['prompt_tokens']:>7.0f} {r['new_tokens']:>6.0f} "
              f"{r['ttft_no_reuse_s'] * 1e3:>11.1f} ms {r['ttft_reuse_s'] * 1e3:>8.1f} ms "
              f"{r['ttft_ratio']:>5.2f}x {r['ttft_ratio_min']:>5.2f}-"
              f"{r['ttft_ratio_max']:<5.2f} {r['prefill_no_reuse']:>17.0f} {r['prefill_reuse']:>14.0f} "
              f"{r['ttft_wall_ratio']:>9.2f}x")

    out_dir = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "requests.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    setup = {"command": "python scripts/bench_prefix.py " + " ".join(argv if argv is not None else sys.argv[1:]),
             "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
             "machine": platform.platform(), "torch": torch.__version__, "threads": args.threads,
             "engine": str(args.engine) if args.engine else f"random glm_moe_dsa, {args.layers} layers, hidden "
                                                              f"{args.hidden}, indexer 16 x {args.index_head_dim} "
                                                              "(built by the script)",
             **{k: v for k, v in vars(args).items() if k not in ("engine", "output_dir")},
             "summary": summary}
    (out_dir / "summary.json").write_text(json.dumps(setup, indent=2) + "\n")
    plot(summary, out_dir / "prefix_reuse.png", f"{args.sessions} sessions, {args.turn_tokens}-token turns, "
                                                   f"{args.max_tokens}-token replies, {args.policy}")
    print(f"wrote {out_dir}/requests.csv, summary.json, prefix_reuse.png")
    return 0


def plot(summary: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in summary]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(turns, [r["ttft_no_reuse_s"] * 1e3 for r in summary], "o-", label="prefix_reuse off")
    ax1.plot(turns, [r["ttft_reuse_s"] * 1e3 for r in summary], "o-", label="prefix_reuse on")
    for r in summary:
        ax1.annotate(f"{r['ttft_ratio']:.1f}x", (r["turn"], r["ttft_reuse_s"] * 1e3), textcoords="offset points",
                     xytext=(0, 8), ha="center", fontsize=8)
    ax1.set(xlabel="turn", ylabel="TTFT (ms of process CPU time, median over sessions)", title="time to first token")
    ax1.legend()
    width = 0.27
    ax2.bar([t - width for t in turns], [r["prefill_no_reuse"] for r in summary], width, label="computed, off")
    ax2.bar(turns, [r["prefill_reuse"] for r in summary], width, label="computed, on")
    ax2.bar([t + width for t in turns], [r["new_tokens"] for r in summary], width, label="new tokens")
    ax2.set(xlabel="turn", ylabel="prompt tokens", title="prefill work")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())

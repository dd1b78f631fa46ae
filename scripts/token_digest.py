"""Greedy and seeded tokens of the demo engine under every KV policy and drafter, as one JSON document.

    python scripts/token_digest.py [--engine DIR] [--out FILE] [--compare FILE]

A behaviour check for refactors: run it before a change (``--out before.json``) and after it (``--compare
before.json``); any token that differs is listed and the exit code is 1. Each configuration generates from the same
random prompts (irregular lengths, a pool tight enough that hisparse and adaptive fetch rows from host) with greedy
and with seeded sampling. The engine directory defaults to the one ``scripts/trace_step.py`` builds from
``models/demo``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("dense", "resident", "hisparse", "adaptive")
DRAFTERS = (None, "dflash2", "dspark")
PROMPT_LENGTHS = (37, 301, 150)


def ensure_engine(engine: Path) -> None:
    if engine.is_dir():
        return
    subprocess.run([sys.executable, "-m", "dhisparse_builder.cli", "--checkpoint", str(ROOT / "models/demo/target"),
                    "--output", str(engine), "--drafter", str(ROOT / "models/demo/dflash2"),
                    "--drafter", str(ROOT / "models/demo/dspark")], check=True, stdout=subprocess.DEVNULL)


def digest(engine: Path, max_tokens: int) -> dict[str, list[list[int]]]:
    import torch

    from dhisparse import LLM, SamplingParams

    out: dict[str, list[list[int]]] = {}
    for policy in POLICIES:
        for drafter in DRAFTERS:
            overrides: dict = {"kv_policy": policy}
            if policy in ("hisparse", "adaptive"):
                overrides.update(page_rows=16, pool_bytes=600_000)
            if drafter:
                overrides["speculative"] = drafter
            llm = LLM(str(engine), **overrides)
            vocab = llm.engine.model.cfg.vocab_size
            g = torch.Generator().manual_seed(7)
            prompts = [torch.randint(0, vocab - 2, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
            for mode, params in (("greedy", SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                                 ("seeded", SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                           temperature=0.8, top_p=0.9, seed=11))):
                outs = llm.generate(prompts, params)
                out[f"{policy}/{drafter or 'none'}/{mode}"] = [list(o.token_ids) for o in outs]
            llm.close()
            print(f"  {policy:9s} {drafter or 'none':8s} done", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default=str(ROOT / "out" / "trace_engine"))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", default=None, help="write the tokens to this JSON file")
    parser.add_argument("--compare", default=None, help="compare with a JSON file written earlier")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    engine = Path(args.engine)
    ensure_engine(engine)
    tokens = digest(engine, args.max_tokens)
    if args.out:
        Path(args.out).write_text(json.dumps(tokens) + "\n")
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        differ = sorted(k for k in before.keys() | tokens.keys() if before.get(k) != tokens.get(k))
        print(f"{len(tokens)} configurations, {len(differ)} differ" + (": " + ", ".join(differ) if differ else ""))
        return 1 if differ else 0
    print(f"{len(tokens)} configurations recorded")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

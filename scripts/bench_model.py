"""Prefill and decode throughput of tiny DSA models: the adaptive hierarchy against the dense reference store.

    python scripts/bench_model.py [--engine DIR] [--models glm_fsfs_sparse glm_fsfs_16layer] [--repeats 5]

Without ``--engine`` tiny random GLM-style models are built in a temporary directory: the test configuration
``glm_fsfs_sparse`` (4 layers) and its 16-layer variant ``glm_fsfs_16layer``. Batch 1 and 8, prompts of 256 tokens,
32 decode steps. Each repeat runs the dense reference store and the adaptive hierarchy back to back (same prompts),
so their ratio is measured side by side; medians over repeats. The per-layer KV overhead is the adaptive decode
step's extra time over the dense one divided by the number of layers. Absolute numbers depend on the machine;
compare rows within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

POLICIES = ("dense", "adaptive")


def _time_decode(llm, prompts: list[list[int]], decode_steps: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds of ``decode_steps`` steps) for one batch of prompts."""
    from dhisparse import SamplingParams

    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    t1 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True))
    t2 = time.perf_counter()
    return t1 - t0, max((t2 - t1) - (t1 - t0), 1e-9)


def bench(engine: Path, name: str, repeats: int, prompt_len: int, decode_steps: int, page_rows: int = 0) -> None:
    from dhisparse import LLM

    extra = {"page_rows": page_rows} if page_rows else {}
    llms = {p: LLM(engine, kv_policy=p, max_batch_size=8, pool_bytes=256 << 20, **extra) for p in POLICIES}
    layers = llms["dense"].engine.model.cfg.num_hidden_layers
    vocab = llms["dense"].vocab_size
    print(f"\nmodel {name} ({layers} layers): prompt {prompt_len} tokens, {decode_steps} decode steps, "
          f"page_rows {llms['adaptive'].engine.cfg.page_rows}, median of {repeats}")
    print(f"{'batch':>5s} {'kv policy':10s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'vs dense':>9s} "
          f"{'KV overhead / layer / step':>27s}")
    for batch in (1, 8):
        prefill: dict[str, list[float]] = {p: [] for p in POLICIES}
        decode: dict[str, list[float]] = {p: [] for p in POLICIES}
        ratios: list[float] = []
        overheads: list[float] = []
        for r in range(repeats):
            g = torch.Generator().manual_seed(r)
            prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
            step_s = {}
            for p in POLICIES:
                pre, dec = _time_decode(llms[p], prompts, decode_steps)
                prefill[p].append(batch * prompt_len / pre)
                decode[p].append(batch * decode_steps / dec)
                step_s[p] = dec / decode_steps
            ratios.append(step_s["dense"] / step_s["adaptive"])
            overheads.append((step_s["adaptive"] - step_s["dense"]) / layers)
        for p in POLICIES:
            extra = ""
            if p == "adaptive":
                extra = f"{statistics.median(ratios):8.2f}x {statistics.median(overheads) * 1e6:24.0f} us"
            print(f"{batch:5d} {p:10s} {statistics.median(prefill[p]):14.0f} {statistics.median(decode[p]):13.0f} "
                  f"{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path)
    ap.add_argument("--models", nargs="+", default=["glm_fsfs_sparse", "glm_fsfs_16layer"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--page-rows", type=int, default=0,
                    help="KV page size (0: the default); with pages smaller than the decode steps, decode pages leave "
                         "the tail and every later step runs the full resolver (hot cache, host fetches)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.engine is not None:
        bench(args.engine, str(args.engine), args.repeats, args.prompt_len, args.decode_steps, args.page_rows)
        return
    from tiny_models import make_checkpoint

    from dhisparse_builder import BuildOptions, build_engine

    tmp = Path(tempfile.mkdtemp())
    for name in args.models:
        engine = build_engine(BuildOptions(make_checkpoint(tmp, name), tmp / f"engine-{name}", {"dtype": "float32"}),
                              progress=lambda d, t: None)
        bench(engine, name, args.repeats, args.prompt_len, args.decode_steps, args.page_rows)


if __name__ == "__main__":
    main()

"""Prefill and decode throughput of a tiny DSA model on this machine (tokens/s, median of repeats).

    python scripts/bench_model.py [--engine DIR] [--repeats 5]

Without ``--engine`` a tiny random GLM-style model (the test configuration ``glm_fsfs_sparse``) is built in a
temporary directory. Batch 1 and 8, prompts of 256 tokens, 32 decode steps, dense reference KV and the adaptive
hierarchy with a generous pool. Absolute numbers depend on the machine; compare rows within one run.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from dhisparse import LLM, SamplingParams

    engine = args.engine
    if engine is None:
        from tiny_models import make_checkpoint

        from dhisparse_builder import BuildOptions, build_engine

        tmp = Path(tempfile.mkdtemp())
        engine = build_engine(BuildOptions(make_checkpoint(tmp, "glm_fsfs_sparse"), tmp / "engine",
                                           {"dtype": "float32"}), progress=lambda d, t: None)
    print(f"engine: {engine}   prompt {args.prompt_len} tokens, {args.decode_steps} decode steps, "
          f"median of {args.repeats}")
    print(f"{'kv policy':10s} {'batch':>5s} {'prefill tok/s':>14s} {'decode tok/s':>13s}")
    for policy in ("dense", "adaptive"):
        llm = LLM(engine, kv_policy=policy, max_batch_size=8, pool_bytes=256 << 20)
        vocab = llm.vocab_size
        for batch in (1, 8):
            prefill, decode = [], []
            for r in range(args.repeats):
                g = torch.Generator().manual_seed(r)
                prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(batch)]
                t0 = time.perf_counter()
                llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
                t1 = time.perf_counter()
                llm.generate(prompts, SamplingParams(max_tokens=args.decode_steps + 1, ignore_eos=True))
                t2 = time.perf_counter()
                prefill.append(batch * args.prompt_len / (t1 - t0))
                decode.append(batch * args.decode_steps / max((t2 - t1) - (t1 - t0), 1e-9))
            print(f"{policy:10s} {batch:5d} {statistics.median(prefill):14.0f} {statistics.median(decode):13.0f}")


if __name__ == "__main__":
    main()

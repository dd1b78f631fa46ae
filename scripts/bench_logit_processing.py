"""Cost of logit processing and log probs on the decode path: the same batch generated plain, with log probs, and
with every processing feature, side by side in one run (median of repeats, ratios to plain).

    python scripts/bench_logit_processing.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from tiny_models import make_checkpoint, random_prompts

    from dhisparse import LLM, SamplingParams
    from dhisparse_builder import BuildOptions, build_engine

    root = Path(tempfile.mkdtemp())
    engine = build_engine(BuildOptions(make_checkpoint(root, "glm_fsfs_sparse"), root / "engine", {"dtype": "float32"}),
                          progress=lambda done, total: None)
    llm = LLM(engine, kv_policy="adaptive", page_rows=8)
    prompts = random_prompts([64] * 8, 96, seed=1)
    cases = {
        "plain": SamplingParams(max_tokens=48, ignore_eos=True),
        "logprobs": SamplingParams(max_tokens=48, ignore_eos=True, logprobs=True),
        "penalties+bad_words+bias+min_tokens": SamplingParams(
            max_tokens=48, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
            bad_words=((3,), (4, 5)), logit_bias={7: 1.0}, min_tokens=10),
    }
    llm.generate(prompts, cases["plain"])  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, params in cases.items():
            start = time.perf_counter()
            llm.generate(prompts, params)
            seconds[name].append(time.perf_counter() - start)
    base = statistics.median(seconds["plain"])
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values):.3f} s, {statistics.median(values) / base:.2f}x plain")


if __name__ == "__main__":
    main()

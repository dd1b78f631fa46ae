"""Where a decode step's time goes: torch-profiler operation counts and times of two KV policies, side by side.

    python scripts/profile_step_ops.py [--device cuda] [--kernels auto] [--batch 1] [--baseline resident]

Builds the tiny 4-layer GLM-style model (``glm_fsfs_sparse``, bfloat16 by default), runs ``--steps`` decode steps of
each policy with 16-row pages (decode pages leave the tail, so the adaptive hierarchy's later steps run the full
resolver, as in ``bench_model.py --page-rows 16``) under ``torch.profiler``, and prints per step: the number of
dispatched operations, their self CPU time and (on a GPU) their device time, then the operations whose self CPU time
and device time grow most from the baseline to the adaptive hierarchy. A profiler inflates every operation's cost,
so read counts and differences, not absolute times; ``bench_model.py`` measures throughput.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def per_step(device: str, kernels: str, policy: str, engine: Path, batch: int, steps: int) -> dict[str, tuple]:
    """``{operation: (calls, self CPU µs, self device µs)}`` per decode step of one policy."""
    from tiny_models import random_prompts

    from dhisparse import LLM, SamplingParams
    from dhisparse.device import resolve_device

    llm = LLM(engine, kv_policy=policy, max_batch_size=8, pool_bytes=256 << 20, page_rows=16, device=device,
              kernels=kernels)
    eng = llm.engine
    for prompt in random_prompts([256] * batch, 96, seed=1):
        eng.add_request(prompt, SamplingParams(max_tokens=steps + 16, ignore_eos=True))
    for _ in range(4):  # admission, prefill and the first decode steps, untimed
        eng.step()
    cuda = resolve_device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
    return {ev.key: (ev.count / steps, ev.self_cpu_time_total / steps, ev.self_device_time_total / steps)
            for ev in prof.key_averages()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="engine device (auto: the GPU when there is one)")
    ap.add_argument("--kernels", default="auto", choices=("auto", "cuda", "torch"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--baseline", default="resident", choices=("resident", "dense"))
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from tiny_models import make_checkpoint

    from dhisparse_builder import BuildOptions, build_engine

    tmp = Path(tempfile.mkdtemp())
    engine = build_engine(BuildOptions(make_checkpoint(tmp, "glm_fsfs_sparse"), tmp / "engine", {"dtype": args.dtype}),
                          progress=lambda d, t: None)
    runs = {p: per_step(args.device, args.kernels, p, engine, args.batch, args.steps)
            for p in (args.baseline, "adaptive")}
    for policy, ops in runs.items():
        print(f"{policy:9s} per step: {sum(v[0] for v in ops.values()):7.0f} operations, self CPU "
              f"{sum(v[1] for v in ops.values()):8.0f} µs, device {sum(v[2] for v in ops.values()):7.0f} µs")
    base, adaptive = runs[args.baseline], runs["adaptive"]
    none = (0.0, 0.0, 0.0)
    for column, title in ((1, "self CPU µs"), (2, "device µs")):
        if column == 2 and args.device != "cuda":
            break
        print(f"\nlargest growth in {title} per step ({args.baseline} → adaptive): calls, {title}")
        def growth(key: str, column: int = column) -> float:
            return adaptive.get(key, none)[column] - base.get(key, none)[column]

        grown = sorted(set(base) | set(adaptive), key=growth, reverse=True)
        for key in grown[: args.top]:
            a, b = adaptive.get(key, none), base.get(key, none)
            print(f"  {a[column] - b[column]:+8.1f}  {key[:64]:64s} {b[0]:6.1f} → {a[0]:6.1f}  {b[column]:8.1f} → "
                  f"{a[column]:8.1f}")


if __name__ == "__main__":
    main()

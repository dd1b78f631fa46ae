"""Prefill and decode throughput of tiny DSA models: the adaptive hierarchy against the dense reference store.

    python scripts/bench_model.py [--engine DIR] [--models glm_fsfs_sparse glm_fsfs_16layer] [--repeats 7]

Without ``--engine`` tiny random GLM-style models are built in a temporary directory: the test configuration
``glm_fsfs_sparse`` (4 layers) and its 16-layer variant ``glm_fsfs_16layer``. Batch 1 and 8, prompts of 256 tokens,
48 decode steps. With the default 64-row pages every decode row stays in the prompt's last tail page, so every step
resolves on the direct path (a page-table lookup); ``--page-rows 16`` makes decode pages leave the tail, and the
steps after that run the full resolver (hot cache, host fetches). The "direct steps" column gives the share of the
adaptive hierarchy's timed steps that took the direct path.

Method. Both engines (dense reference store and adaptive hierarchy, same weights, same prompts) are driven through
``LLMEngine.add_request`` / ``step`` in lockstep: each admits and prefills its prompts in one step (timed as
prefill), then they take their decode steps in turn — dense, adaptive, dense, adaptive… (adaptive first on odd
repeats) — so load from other processes on the machine falls on both alike. Every step is timed on its own, in
process CPU time (what the step costs the process; a shared machine's preemption does not count) and in wall time.
A run's decode step time is the mean over its pure decode steps (a throughput: occasional costly steps count in
full). One untimed warm-up repeat per batch comes first. Reported, as medians over repeats: tokens/s (wall), the
decode step's CPU time, the ratio dense step ÷ adaptive step in CPU time ("vs dense": adaptive decode tokens/s ÷
dense when each has a core to itself; min–max over repeats beside it) and in wall time, and the per-layer KV
overhead ((adaptive − dense) decode step CPU time ÷ layers). Exactness: the adaptive hierarchy's greedy tokens must
equal the dense store's in every run, or the bench stops with an error. Absolute numbers depend on the machine;
compare rows within one run.

Options for a GPU: ``--device cuda`` (step times are then dominated by the GPU and its launches: compare the wall
column), ``--dtype bfloat16``, ``--kernels auto|cuda|torch``. The dense reference store always attends with torch;
with the CUDA kernels (sparse MLA) the adaptive hierarchy's bfloat16 logits round differently, so compare it with
``--baseline resident`` (the hierarchy's fully resident policy, same kernels), whose tokens it must equal.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

POLICIES = ("dense", "adaptive")  # (baseline, measured); --baseline resident replaces the first


@dataclass
class Run:
    """One engine's timed generation of a batch of prompts."""

    prefill_s: float = 0.0  # wall time of the step that admitted the prompts (their prefill and first decode)
    decode_wall_s: list[float] = field(default_factory=list)  # every pure decode step, in order
    decode_cpu_s: list[float] = field(default_factory=list)
    decode_tokens: int = 0  # tokens those steps produced
    direct_steps: int = 0  # pure decode steps whose every request resolved on the direct path
    tokens: list[list[int]] = field(default_factory=list)  # greedy output of each prompt

    @property
    def step_cpu_s(self) -> float:
        return sum(self.decode_cpu_s) / len(self.decode_cpu_s)

    @property
    def step_wall_s(self) -> float:
        return sum(self.decode_wall_s) / len(self.decode_wall_s)


class _TimedEngine:
    """Steps one engine and times each step; notes whether its KV step took the direct path."""

    def __init__(self, llm) -> None:
        self.engine = llm.engine
        self.paths: list[bool] = []

    def start(self, prompts: list[list[int]], decode_steps: int) -> tuple[Run, list[str]]:
        """Queue the prompts and take the admitting step: ``decode_steps + 2`` tokens per prompt, so that
        ``decode_steps`` pure decode steps follow (prefill gives one token, the admitting step decodes one)."""
        from dhisparse import SamplingParams

        params = SamplingParams(max_tokens=decode_steps + 2, ignore_eos=True)
        ids = [self.engine.add_request(p, params) for p in prompts]
        run = Run()
        while self.engine.scheduler.waiting:  # every prompt admitted in one step unless the prefill budget splits
            t0 = time.perf_counter()
            self.engine.step()
            run.prefill_s += time.perf_counter() - t0
        return run, ids

    def step(self, run: Run) -> None:
        batch = len(self.engine.scheduler.running)
        kv = self.engine.kv
        begin = kv.begin_step
        self.paths.clear()

        def begin_step(*args, **kwargs):
            step = begin(*args, **kwargs)
            self.paths.append(bool(getattr(step, "all_direct", True)))  # the dense store: no hierarchy
            return step

        kv.begin_step = begin_step
        try:
            w0, c0 = time.perf_counter(), time.process_time()
            self.engine.step()
            c1, w1 = time.process_time(), time.perf_counter()
        finally:
            del kv.begin_step  # back to the class's method
        run.decode_wall_s.append(w1 - w0)
        run.decode_cpu_s.append(c1 - c0)
        run.decode_tokens += batch
        run.direct_steps += all(self.paths)

    def finish(self, run: Run, ids: list[str]) -> None:
        for rid in ids:
            req = self.engine.pop_finished(rid)
            if req.finish_reason == "error":
                raise SystemExit(f"request {rid} failed: {req.error}")
            run.tokens.append(list(req.output_token_ids))
        if not run.decode_cpu_s:
            raise SystemExit("no pure decode step was timed: raise --decode-steps")


def run_lockstep(engines: dict[str, _TimedEngine], prompts: list[list[int]], decode_steps: int,
                 order: tuple[str, ...]) -> dict[str, Run]:
    """Prefill ``prompts`` on every engine, then step the engines in turn (in ``order``) until all finish."""
    started = {p: engines[p].start(prompts, decode_steps) for p in order}
    gc.collect()
    while any(engines[p].engine.has_unfinished() for p in order):
        for p in order:
            if engines[p].engine.has_unfinished():
                engines[p].step(started[p][0])
    for p in order:
        engines[p].finish(*started[p])
    return {p: started[p][0] for p in order}


def _load() -> str:
    return "load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg())


def bench(engine: Path, name: str, repeats: int, prompt_len: int, decode_steps: int, page_rows: int = 0,
          device: str = "auto", kernels: str = "auto", baseline: str = "dense") -> None:
    from dhisparse import LLM

    policies = (baseline, "adaptive")

    extra = {"page_rows": page_rows} if page_rows else {}
    llms = {p: LLM(engine, kv_policy=p, max_batch_size=8, pool_bytes=256 << 20, device=device, kernels=kernels,
                   **extra) for p in policies}
    engines = {p: _TimedEngine(llm) for p, llm in llms.items()}
    layers = llms[baseline].engine.model.cfg.num_hidden_layers
    vocab = llms[baseline].vocab_size
    selection = llms["adaptive"].engine.kv.kernels
    print(f"\nmodel {name} ({layers} layers, {llms[baseline].engine.model.dtype}) on {device}, kernels {kernels} "
          f"({selection.name}{', native resolver' if selection.native_resolver is not None else ''}): prompt "
          f"{prompt_len} tokens, {decode_steps} decode steps each timed, page_rows "
          f"{llms['adaptive'].engine.cfg.page_rows}, median of {repeats} repeats, steps interleaved ({_load()})")
    print(f"{'batch':>5s} {'kv policy':10s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'step CPU ms':>12s} "
          f"{'vs ' + baseline:>9s} {'(min-max)':>12s} {'wall':>6s} {'KV overhead / layer / step':>27s} "
          f"{'direct steps':>12s}")
    for batch in (1, 8):
        prefill: dict[str, list[float]] = {p: [] for p in policies}
        decode: dict[str, list[float]] = {p: [] for p in policies}
        step_ms: dict[str, list[float]] = {p: [] for p in policies}
        ratios: list[float] = []
        wall_ratios: list[float] = []
        overheads: list[float] = []
        direct = [0, 0]  # the adaptive hierarchy's timed steps on the direct path, of all
        for r in range(-1, repeats):  # repeat -1: warm-up, not counted
            g = torch.Generator().manual_seed(max(r, 0))
            prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
            runs = run_lockstep(engines, prompts, decode_steps, policies if r % 2 == 0 else policies[::-1])
            if runs["adaptive"].tokens != runs[baseline].tokens:
                raise SystemExit(f"{name} batch {batch} repeat {r}: the adaptive hierarchy's tokens differ from "
                                 f"the {baseline} baseline's")
            if r < 0:
                continue
            for p, run in runs.items():
                prefill[p].append(batch * prompt_len / run.prefill_s)
                decode[p].append(run.decode_tokens / sum(run.decode_wall_s))
                step_ms[p].append(run.step_cpu_s * 1e3)
            dense, adaptive = runs[baseline], runs["adaptive"]
            ratios.append(dense.step_cpu_s / adaptive.step_cpu_s)
            wall_ratios.append(dense.step_wall_s / adaptive.step_wall_s)
            overheads.append((adaptive.step_cpu_s - dense.step_cpu_s) / layers)
            direct[0] += adaptive.direct_steps
            direct[1] += len(adaptive.decode_cpu_s)
        for p in policies:
            extra_cols = ""
            if p == "adaptive":
                spread = f"({min(ratios):.2f}-{max(ratios):.2f})"
                extra_cols = (f"{statistics.median(ratios):8.2f}x {spread:>12s} {statistics.median(wall_ratios):5.2f}x "
                              f"{statistics.median(overheads) * 1e6:24.0f} us {direct[0] / direct[1]:12.0%}")
            print(f"{batch:5d} {p:10s} {statistics.median(prefill[p]):14.0f} {statistics.median(decode[p]):13.0f} "
                  f"{statistics.median(step_ms[p]):12.2f} {extra_cols}", flush=True)
    print(f"tokens: adaptive == {baseline} in every run ({_load()})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path)
    ap.add_argument("--models", nargs="+", default=["glm_fsfs_sparse", "glm_fsfs_16layer"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=48, help="pure decode steps timed per run")
    ap.add_argument("--page-rows", type=int, default=0,
                    help="KV page size (0: the default); with pages smaller than the decode steps, decode pages leave "
                         "the tail and every later step runs the full resolver (hot cache, host fetches)")
    ap.add_argument("--device", default="auto",
                    help="engine device (auto: the GPU when there is one; cpu, cuda); on a GPU compare the wall column")
    ap.add_argument("--kernels", default="auto", choices=("auto", "cuda", "torch"))
    ap.add_argument("--baseline", default="dense", choices=("dense", "resident"),
                    help="the engine compared against: the dense reference store (torch attention, whatever the "
                         "kernels) or the hierarchy's fully resident policy (same kernels as the adaptive one)")
    ap.add_argument("--dtype", default="float32", help="weights and activations of the built tiny models")
    args = ap.parse_args()
    if args.repeats < 1 or args.decode_steps < 1:
        ap.error("--repeats and --decode-steps must be at least 1")
    torch.set_num_threads(1)
    if args.engine is not None:
        bench(args.engine, str(args.engine), args.repeats, args.prompt_len, args.decode_steps, args.page_rows,
              args.device, args.kernels, args.baseline)
        return
    from tiny_models import make_checkpoint

    from dhisparse_builder import BuildOptions, build_engine

    tmp = Path(tempfile.mkdtemp())
    for name in args.models:
        engine = build_engine(BuildOptions(make_checkpoint(tmp, name), tmp / f"engine-{name}", {"dtype": args.dtype}),
                              progress=lambda d, t: None)
        bench(engine, name, args.repeats, args.prompt_len, args.decode_steps, args.page_rows, args.device,
              args.kernels, args.baseline)


if __name__ == "__main__":
    main()

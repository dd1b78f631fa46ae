"""Trace one decode step and print the project files and functions it enters (the house's shape, measured).

    python scripts/trace_step.py [--engine DIR] [--policy adaptive] [--speculative dflash2|dspark] \
        [--page-rows 16] [--batch 2] [--kernels auto] [--json OUT]

Builds an engine over the demo target (``models/demo/target``, or ``--engine``), admits ``--batch`` prompts, takes a
few decode steps untraced (prefill and warm-up), then traces one ``LLMEngine.step()`` that only decodes with
``sys.settrace``. Counted are the Python frames whose file lies in this repository (``backend/``, ``engine_builder/``,
``client/``): the distinct files and functions entered, and the **switches between files** — how often the innermost
project frame changes file, on a call into another file or a return back into one (C code and torch's own Python
are transparent). With ``--page-rows 16`` decode rows leave the tail, so the step runs the full resolver (hot cache
and host fetches) rather than the direct path.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT_DIRS = tuple(str(ROOT / d) + os.sep for d in ("backend", "engine_builder", "client"))


class StepTracer:
    """``sys.settrace`` hook counting project files, functions and file switches."""

    def __init__(self) -> None:
        self.files: collections.Counter[str] = collections.Counter()
        self.functions: collections.Counter[tuple[str, str]] = collections.Counter()
        self.switches = 0
        self.call_switches = 0  # calls from a project frame into a function of another project file
        self.edges: collections.Counter[tuple[str, str]] = collections.Counter()  # (caller file, callee function)
        self.stack: list[str | None] = []  # the file of every live frame (None: outside the project)
        self._current: str | None = None

    def _file(self, frame) -> str | None:
        name = frame.f_code.co_filename
        return os.path.relpath(name, ROOT) if name.startswith(PROJECT_DIRS) else None

    def _innermost(self) -> str | None:
        for f in reversed(self.stack):
            if f is not None:
                return f
        return None

    def _moved(self) -> None:
        now = self._innermost()
        if now is not None and self._current is not None and now != self._current:
            self.switches += 1
        if now is not None:
            self._current = now

    def __call__(self, frame, event, arg):
        if event == "call":
            f = self._file(frame)
            caller = self._innermost()
            self.stack.append(f)
            if f is not None and caller is not None and caller != f:
                self.call_switches += 1
                self.edges[(caller, f"{f}:{frame.f_code.co_qualname}")] += 1
            if f is not None:
                self.files[f] += 1
                self.functions[(f, frame.f_code.co_qualname)] += 1
            self._moved()
            return self._local
        return None

    def _local(self, frame, event, arg):
        if event == "return":
            if self.stack:
                self.stack.pop()
            self._moved()
        return self._local


def build_engine(args: argparse.Namespace):
    from dhisparse import LLM

    overrides = {"kv_policy": args.policy, "kernels": args.kernels, "max_batch_size": max(8, args.batch)}
    if args.page_rows:
        overrides["page_rows"] = args.page_rows
    if args.pool_bytes:
        overrides["pool_bytes"] = args.pool_bytes
    if args.speculative:
        overrides["speculative"] = args.speculative
    return LLM(args.engine, **overrides).engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default=str(ROOT / "out" / "trace_engine"),
                        help="engine directory (built from models/demo with dhisparse-build when it does not exist)")
    parser.add_argument("--policy", default="adaptive")
    parser.add_argument("--speculative", choices=("dflash2", "dspark"), default=None)
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--page-rows", type=int, default=0)
    parser.add_argument("--pool-bytes", type=int, default=0)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--warm-steps", type=int, default=6)
    parser.add_argument("--top", type=int, default=40, help="functions listed (most entered first)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not Path(args.engine).is_dir():  # built from the demo model pair
        import subprocess

        subprocess.run([sys.executable, "-m", "dhisparse_builder.cli", "--checkpoint", str(ROOT / "models/demo/target"),
                        "--output", args.engine, "--drafter", str(ROOT / "models/demo/dflash2"),
                        "--drafter", str(ROOT / "models/demo/dspark")], check=True, stdout=subprocess.DEVNULL)

    import torch

    from dhisparse import SamplingParams

    torch.manual_seed(0)
    engine = build_engine(args)
    vocab = engine.model.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    for b in range(args.batch):
        prompt = torch.randint(0, vocab - 2, (args.prompt_tokens + 7 * b,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=args.warm_steps * 8 + 64, ignore_eos=True))
    for _ in range(args.warm_steps):
        engine.step()
    if engine.scheduler.waiting or len(engine.scheduler.running) != args.batch:
        raise SystemExit(f"expected {args.batch} running requests after warm-up, got "
                         f"{len(engine.scheduler.running)} (waiting {len(engine.scheduler.waiting)})")
    tracer = StepTracer()
    sys.settrace(tracer)
    try:
        engine.step()
    finally:
        sys.settrace(None)
    figures = {
        "config": {k: getattr(args, k) for k in ("policy", "speculative", "kernels", "page_rows", "batch")},
        "files": len(tracer.files),
        "functions": len(tracer.functions),
        "function_calls": sum(tracer.functions.values()),
        "file_switches": tracer.switches,
        "calls_into_other_files": tracer.call_switches,
        "files_entered": dict(sorted(tracer.files.items(), key=lambda kv: (-kv[1], kv[0]))),
    }
    print(f"one decode step ({args.policy}, {args.speculative or 'no drafter'}, batch {args.batch}, kernels "
          f"{args.kernels}{', page_rows ' + str(args.page_rows) if args.page_rows else ''}):")
    print(f"  files entered: {figures['files']}   functions: {figures['functions']}   calls: "
          f"{figures['function_calls']}")
    print(f"  switches between files: {figures['file_switches']} (calls into another file: "
          f"{figures['calls_into_other_files']})")
    print("  files (calls into each):")
    for name, calls in figures["files_entered"].items():
        print(f"    {calls:6d}  {name}")
    print(f"  calls into another file (top {args.top}, caller file -> function):")
    for (caller, callee), calls in tracer.edges.most_common(args.top):
        print(f"    {calls:6d}  {caller} -> {callee}")
    print(f"  functions (top {args.top} by calls):")
    for (name, fn), calls in tracer.functions.most_common(args.top):
        print(f"    {calls:6d}  {name}:{fn}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

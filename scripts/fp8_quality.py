"""Quality cost of FP8 KV rows and/or FP8 indexer keys against the model dtype, on the demo model (or any engine).

    python scripts/fp8_quality.py [--engine DIR] [--prompts 8] [--prompt-len 200] [--new-tokens 64]
                                  [--fp8 rows|keys|both]

Both runs use the fully resident policy, so the only difference is the row (``kv_dtype``) and/or indexer key
(``index_key_dtype``) format. Reported:
- teacher-forced logits: the model-dtype run's greedy continuation is fed to both; per decode step the max and mean
  absolute logit difference (and relative to the logits' standard deviation) and whether the argmax agrees;
- teacher-forced top-k agreement: per decode step and indexer layer, the share of the model-dtype run's selected
  positions the FP8 run selects too;
- free-running greedy tokens: the share of positions where the FP8 run emits the same token, and the mean
  length of the common prefix.
Without ``--engine`` the demo target (models/demo/target) is built in a temporary directory (``--dtype``, default
bfloat16: FP8 rows against bf16 rows).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _teacher_forced(llm, prompt: list[int], continuation: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits ``[len(continuation), vocab]`` of each decode step when ``continuation`` is fed token by token, and
    per step the indexer layers' selections ``[layers, K]``."""
    engine, kv, model = llm.engine, llm.engine.kv, llm.engine.model
    rid = "probe"
    assert kv.try_admit(rid, len(prompt), len(continuation) + 1)
    out = model.prefill(prompt, chunk_tokens=engine.cfg.prefill_chunk_tokens)
    kv.import_prompt(rid, out.rows, out.index_keys)
    indexers = [i for i, a in enumerate(model.attn) if a.has_indexer]
    logits, selections = [], []
    for i, token in enumerate(continuation):
        step = kv.begin_step([rid], 1)
        res = model.forward(torch.tensor([[token]]), torch.tensor([[len(prompt) + i]]), step, record_selections=True)
        kv.end_step({rid: 1})
        logits.append(res.logits[0, -1])
        selections.append(torch.stack([res.selections[j][0, 0] for j in indexers]))
    kv.release(rid)
    kv.poll()
    return torch.stack(logits), selections


def _topk_agreement(want: torch.Tensor, got: torch.Tensor) -> float:
    """Share of ``want``'s selected positions (``[layers, K]``, −1 unused) that ``got`` selects in the same layer."""
    hits = total = 0
    for w, g in zip(want, got, strict=True):
        w = w[w >= 0]
        hits += int(torch.isin(w, g[g >= 0]).sum())
        total += w.numel()
    return hits / max(total, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", help="model (and native row) dtype of the built demo engine")
    ap.add_argument("--fp8", choices=("rows", "keys", "both"), default="rows",
                    help="what the FP8 run quantizes: KV rows, indexer keys, or both")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from dhisparse import LLM, SamplingParams

    engine = args.engine
    if engine is None:
        from dhisparse_builder import BuildOptions, build_engine

        tmp = Path(tempfile.mkdtemp())
        engine = build_engine(BuildOptions(ROOT / "models/demo/target", tmp / "engine", {"dtype": args.dtype}),
                              progress=lambda d, t: None)
    native = LLM(engine, kv_policy="resident")
    fp8 = LLM(engine, kv_policy="resident", kv_dtype="fp8" if args.fp8 in ("rows", "both") else "auto",
              index_key_dtype="fp8" if args.fp8 in ("keys", "both") else "auto")
    g = torch.Generator().manual_seed(0)
    vocab = native.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    ref = [o.token_ids for o in native.generate(prompts, params)]
    got = [o.token_ids for o in fp8.generate(prompts, params)]
    max_abs, mean_abs, rel, agree, topk = [], [], [], [], []
    for prompt, cont in zip(prompts, ref, strict=True):
        a, sel_a = _teacher_forced(native, prompt, cont[:-1])
        b, sel_b = _teacher_forced(fp8, prompt, cont[:-1])
        topk.extend(_topk_agreement(x, y) for x, y in zip(sel_a, sel_b, strict=True))
        diff = (a - b).abs()
        max_abs.append(float(diff.max()))
        mean_abs.append(float(diff.mean()))
        rel.append(float(diff.mean() / a.std()))
        agree.append(float((a.argmax(-1) == b.argmax(-1)).float().mean()))
    same = sum(x == y for r, f in zip(ref, got, strict=True) for x, y in zip(r, f, strict=True))
    total = sum(len(r) for r in ref)
    prefix = []
    for r, f in zip(ref, got, strict=True):
        n = 0
        while n < min(len(r), len(f)) and r[n] == f[n]:
            n += 1
        prefix.append(n)
    la, lb = native.engine.kv.layout, fp8.engine.kv.layout
    print(f"engine {engine}: {args.prompts} prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens, "
          f"FP8 {args.fp8}: row bytes {la.row_bytes} -> {lb.row_bytes}, indexer key bytes {la.index_key_bytes} -> "
          f"{lb.index_key_bytes}")
    print(f"teacher-forced logits: max |diff| {max(max_abs):.4f}, mean |diff| {statistics.mean(mean_abs):.5f} "
          f"({statistics.mean(rel):.4%} of the logits' std), argmax agreement {statistics.mean(agree):.4f}, "
          f"top-k agreement {statistics.mean(topk):.4f}")
    print(f"free-running greedy tokens: {same}/{total} equal ({same / total:.4f}), mean common prefix "
          f"{statistics.mean(prefix):.1f} of {args.new_tokens}")


if __name__ == "__main__":
    main()

"""Acceptance per verification step of each published drafter format, measured from the engine's stats on the tiny
test targets, under every KV policy (docs/results/published_drafters_acceptance.csv).

The drafters are the random checkpoints the end-to-end tests pack (``tests/published_drafters.py``): z-lab DFlash,
DFlash2 (sliding window 12, so the ring wraps) and DeepSpec's Qwen3 DSpark with the tiny GLM-style target
``glm_fsfs_sparse``, and DeepSeek-V4 ``mtp.*`` DSpark stages in a tiny V4 checkpoint. Random drafters seldom agree
with the target, so the figure is near 1 token per step (the bonus token): it shows what the engine reports and that
it does not depend on the KV policy (verification is exact), not what a trained drafter reaches.

    python scripts/published_acceptance.py [--out docs/results/published_drafters_acceptance.csv]

About 15 s on two cores (float64; 3 prompts on the GLM-style target, 5 on V4; 24 new tokens each).
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

POLICIES = ("dense", "resident", "hisparse", "adaptive")
# verify_steps: engine steps that verified; verify_rows: request-steps (tokens_per_verify_step is per request and step)
COLUMNS = ("format", "target", "kv_policy", "num_draft_tokens", "requests", "verify_steps", "verify_rows",
           "draft_tokens_proposed", "draft_tokens_accepted", "tokens_per_verify_step", "draft_acceptance_rate",
           "greedy_equals_target")


def _engines(root: Path) -> dict[str, Path]:
    from published_drafters import add_v4_dspark, qwen_drafter_config, write_qwen_drafter
    from tiny_models import make_checkpoint
    from tiny_v4 import make_v4_checkpoint

    from dhisparse_builder import BuildOptions, build_engine

    drafters = []
    for i, fmt in enumerate(("dflash", "dflash2", "dspark")):
        extra = dict(layer_types=["sliding_attention"] * 2, sliding_window=12) if fmt == "dflash2" else {}
        cfg = qwen_drafter_config(fmt, hidden=64, vocab=96, target_layers=4, layer_ids=[0, 2], **extra)
        drafters.append(write_qwen_drafter(root / fmt, cfg, 64, seed=i))
    glm = build_engine(BuildOptions(make_checkpoint(root, "glm_fsfs_sparse"), root / "glm_engine", {"dtype": "float64"},
                                    drafters=tuple(drafters)), progress=lambda d, t: None)
    v4_checkpoint = add_v4_dspark(make_v4_checkpoint(root, "v4_small_topk"), root / "v4_dspark")
    v4 = build_engine(BuildOptions(v4_checkpoint, root / "v4_engine", {"dtype": "float64"}, drafters=(v4_checkpoint,)),
                      progress=lambda d, t: None)
    return {"glm": glm, "v4": v4}


def measure() -> list[dict[str, object]]:
    from tiny_models import random_prompts

    from dhisparse import LLM, SamplingParams

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="published-acceptance-") as work:
        engines = _engines(Path(work))
        cases = [("dflash", "dflash", "glm", 4), ("dflash2", "dflash2", "glm", 4), ("dspark", "dspark", "glm", 4),
                 ("dspark-v4", "dspark", "v4", 5)]
        prompts = {"glm": random_prompts([7, 23, 50], 96, seed=3),
                   "v4": random_prompts([1, 13, 30, 45, 7], 97, seed=11)}
        alone = {t: [o.token_ids for o in LLM(e, kv_policy="dense", max_batch_size=8).generate(prompts[t], params)]
                 for t, e in engines.items()}
        for fmt, family, target, gamma in cases:
            for policy in POLICIES:
                extra = {} if policy == "dense" else {"pool_bytes": 1 << 22, "page_rows": 4}
                llm = LLM(engines[target], kv_policy=policy, speculative=family, num_draft_tokens=gamma,
                          max_batch_size=8, **extra)
                outs = llm.generate(prompts[target], params)
                stats = llm.stats()
                rows.append({"format": fmt, "target": "tiny GLM-5 style" if target == "glm" else "tiny DeepSeek-V4",
                             "kv_policy": policy, "num_draft_tokens": gamma, "requests": len(outs),
                             "verify_steps": int(stats["verify_steps"]), "verify_rows": int(stats["verify_rows"]),
                             "draft_tokens_proposed": int(stats["draft_tokens_proposed"]),
                             "draft_tokens_accepted": int(stats["draft_tokens_accepted"]),
                             "tokens_per_verify_step": round(stats["tokens_per_verify_step"], 4),
                             "draft_acceptance_rate": round(stats["draft_acceptance_rate"], 4),
                             "greedy_equals_target": [o.token_ids for o in outs] == alone[target]})
                print(", ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/results/published_drafters_acceptance.csv"))
    args = p.parse_args(argv)
    rows = measure()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return 0 if all(r["greedy_equals_target"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""``dhisparse-plan footprint``: one session's device memory at GPU scale, from the code the KV manager admits with.

Example (GLM-5, 32K context, DFlash2 with gamma = 7)::

    dhisparse-plan footprint --model glm5 --context 32768 --speculative dflash2 --num-draft-tokens 7

prints the session's required bytes (never lent: hot cache, tail, metadata, indexer keys, and with a drafter the
speculative state = draft ring + verification staging), its optional bytes (complete prompt pages a policy with
optional residency may keep while memory is spare) and the split of the speculative state. The numbers are
:func:`dhisparse.kv.footprint.request_footprint` of the real (unscaled) layout and config, i.e. what
``KVManager.try_admit`` reserves.
"""

from __future__ import annotations

import argparse
import json
import sys

from dhisparse import defaults
from dhisparse.kv.footprint import Footprint, request_footprint
from dhisparse.kv.policies import KV_POLICIES
from dhisparse_planner.scale import ScaleSpec, build_scaled_kv
from dhisparse_planner.specs import DRAFTERS, MODEL_PRESETS, ModelSpec

GIB = 2.0**30


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dhisparse-plan footprint", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="glm5")
    p.add_argument("--context", type=int, required=True, help="prompt (imported history) tokens")
    p.add_argument("--output-tokens", type=int, default=8192, help="output budget of the session")
    p.add_argument("--policy", choices=KV_POLICIES, default=defaults.KV_POLICY)
    p.add_argument("--hot-rows", type=int, default=defaults.HOT_ROWS, help="B per layer (0: index_topk)")
    p.add_argument("--page-rows", type=int, default=defaults.PAGE_ROWS)
    p.add_argument("--speculative", choices=sorted(DRAFTERS), default=None, help="drafter (default: none)")
    p.add_argument("--num-draft-tokens", type=int, default=defaults.NUM_DRAFT_TOKENS, help="gamma")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def session_footprint(model: ModelSpec, context: int, output_tokens: int, policy: str, hot_rows: int,
                      page_rows: int, drafter: str | None, gamma: int,
                      ring_bytes: float | None = None) -> dict[str, float | int | str]:
    """Required / optional / speculative bytes of one session (real units); ``ring_bytes`` replaces the drafter
    preset's ring (another drafter shape)."""
    if context < 1 or output_tokens < 1 or gamma < 1:
        raise ValueError("--context, --output-tokens and --num-draft-tokens must be >= 1")
    query_len = gamma + 1 if drafter else 1
    ring = (DRAFTERS[drafter].ring_bytes if ring_bytes is None else ring_bytes) if drafter else 0.0
    kv = build_scaled_kv(model, ScaleSpec(), policy, 1e15, hot_rows, page_rows, 0, 0, query_len, ring)
    fp: Footprint = request_footprint(kv.real_layout, kv.real_config, context, output_tokens)
    optional_pages = kv.real_config.kv_policy.optional_prompt_pages(context, page_rows)
    optional = kv.real_layout.num_sources * optional_pages * fp.page_bytes
    return {
        "model": model.name, "policy": policy, "context_tokens": context, "output_tokens": output_tokens,
        "drafter": drafter or "", "num_draft_tokens": gamma if drafter else 0,
        "hot_rows": kv.real_config.hot_rows_for(kv.real_layout), "page_rows": page_rows,
        "required_bytes": fp.required_bytes, "non_speculative_bytes": fp.base_bytes,
        "optional_bytes": optional, "speculative_bytes": fp.speculative_bytes, "ring_bytes": fp.ring_bytes,
        "staging_bytes": fp.staging_bytes, "staging_overflow_bytes": fp.staging_overflow_bytes,
        "staging_block_bytes": fp.staging_block_bytes, "staging_slots": fp.staging_slots,
        "staging_rows_per_slot": fp.staging_rows,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = session_footprint(MODEL_PRESETS[args.model], args.context, args.output_tokens, args.policy,
                                args.hot_rows, args.page_rows, args.speculative, args.num_draft_tokens)
    except ValueError as e:
        print(f"dhisparse-plan footprint: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    spec = f", {out['drafter']} gamma={out['num_draft_tokens']}" if out["drafter"] else ""
    print(f"{out['model']}, {out['policy']}, {out['context_tokens']} in / {out['output_tokens']} out, "
          f"B={out['hot_rows']}, page {out['page_rows']}{spec}")
    for name in ("required_bytes", "non_speculative_bytes", "speculative_bytes", "ring_bytes", "staging_bytes",
                 "staging_overflow_bytes", "staging_block_bytes", "optional_bytes"):
        print(f"  {name:<24} {int(out[name]):>14,d} B  {float(out[name]) / GIB:9.4f} GiB")
    if out["drafter"]:
        print(f"  staging: {out['staging_slots']} slot(s) x {out['staging_rows_per_slot']} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Command line of the engine builder (argparse lives only here)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dhisparse.engine.config import DTYPES
from dhisparse.errors import DHiSparseError
from dhisparse.kv.policies import ENGINE_POLICIES
from dhisparse_builder.build import BuildOptions, build_engine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="dhisparse-build",
        description="Validate a Hugging Face DSA checkpoint (deepseek_v32 / glm_moe_dsa) and build an engine.",
    )
    p.add_argument("--checkpoint", required=True, type=Path, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--output", required=True, type=Path, help="engine directory to create")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight/compute dtype")
    p.add_argument("--force", action="store_true", help="overwrite an existing engine directory")
    p.add_argument("--drafter", action="append", type=Path, default=[],
                   help="drafter checkpoint to pack (repeatable): ours, z-lab DFlash, DFlash2, DeepSpec DSpark or a "
                        "DeepSeek-V4 checkpoint with DSpark stages; packed under drafters/<family>")
    p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="Jinja2 chat template for the OpenAI API's chat completions (written as chat_template.jinja; "
                        "default: the checkpoint's chat_template.jinja or tokenizer_config.json entry, if any)")
    g = p.add_argument_group("runtime defaults (runtime.json; each can be overridden by LLM(...) / dhisparse-serve)")
    g.add_argument("--kv-policy", choices=ENGINE_POLICIES, default=None)
    g.add_argument("--pool-bytes", type=lambda v: 0 if v == "auto" else int(v), default=None,
                   help="device KV pool budget in bytes, or 'auto' (sized from the free device memory at start)")
    g.add_argument("--hot-rows", type=int, default=None, help="hot-cache rows B per request and source")
    g.add_argument("--page-rows", type=int, default=None, help="rows per KV page")
    g.add_argument("--reserve-bytes", type=int, default=None, help="admission reserve in bytes")
    g.add_argument("--max-batch-size", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--speculative", choices=["dflash", "dflash2", "dspark"], default=None,
                   help="drafter family served by default (packed with --drafter)")
    g.add_argument("--num-draft-tokens", type=int, default=None)
    g.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="ranks splitting attention heads, the indexer and the MLPs (docs/parallel.md)")
    g.add_argument("--data-parallel-size", type=int, default=None,
                   help="data-parallel attention ranks, each with its own requests and KV")
    g.add_argument("--expert-parallel", action="store_const", const=True, default=None,
                   help="partition MoE experts across the ranks")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime = {"dtype": args.dtype}
    for name in ("kv_policy", "pool_bytes", "hot_rows", "page_rows", "reserve_bytes", "max_batch_size",
                 "max_model_len", "speculative", "num_draft_tokens", "tensor_parallel_size", "data_parallel_size",
                 "expert_parallel"):
        value = getattr(args, name)
        if value is not None:
            runtime[name] = value
    try:
        out = build_engine(BuildOptions(args.checkpoint, args.output, runtime, tuple(args.drafter), args.force,
                                        args.chat_template))
    except DHiSparseError as exc:
        print(f"dhisparse-build: error: {exc}", file=sys.stderr)
        return 2
    print(f"engine written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

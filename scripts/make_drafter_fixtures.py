"""Build tiny random drafter checkpoints in each published format with the publishers' own code, and record that
code's proposals next to them (``tests/fixtures/drafters/<case>/``: ``checkpoint/`` in the published format,
``target.safetensors`` the target's part, ``expected.*`` the reference's proposals), for
``tests/spec/test_published_fixtures.py``.

The reference code is read from checkouts given on the command line and run, never copied into this project:

* ``--dflash``: z-lab/dflash (``dflash/model.py``: ``DFlashDraftModel``, ``Qwen3DFlashAttention``);
* ``--deepspec``: deepseek-ai/DeepSpec (``deepspec/modeling/dspark``, ``deepspec/eval/dspark/draft_ops.py``);
* ``--vllm``: a tree holding vLLM's ``vllm/model_executor/models/qwen3_dflash2.py`` (PR #52816). Its plain-torch
  parts are executed from that file (``_grouped_conv``, ``DFlashGroupedConv``, ``_score_edges``,
  ``CandidateSelector``, ``_topk``) over the z-lab DFlash backbone in the layer order of
  ``DFlash2Qwen3DecoderLayer.forward``; the candidate scaling and the greedy walk follow
  ``DFlash2Qwen3ForCausalLM.compute_candidates`` and ``_selector_walk_kernel`` (Triton, not runnable here).

Each case replays several verification steps per sequence with the reference's own draft cache (context grows,
the block is cropped away), so the fixtures pin the incremental context handling as well as one forward.
Each reference runs under the transformers its publisher pins (z-lab/dflash: 4.57.1, DeepSpec: 5.10.2; their
draft caches rely on ``DynamicCache.crop(length)``, which 5.24 no longer accepts), with the project's torch.
Regenerate (see docs/drafters.md for the commits used)::

    python -m venv /tmp/tf457 && /tmp/tf457/bin/pip install torch==2.13.0 transformers==4.57.1 safetensors
    python -m venv /tmp/tf510 && /tmp/tf510/bin/pip install torch==2.13.0 transformers==5.10.2 safetensors
    /tmp/tf457/bin/python scripts/make_drafter_fixtures.py --cases dflash,dflash2 --dflash DFLASH --vllm VLLM
    /tmp/tf510/bin/python scripts/make_drafter_fixtures.py --cases dspark --deepspec DEEPSPEC
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

VOCAB, HIDDEN, TARGET_LAYERS, FEATURE_IDS = 64, 32, 4, [0, 2]
PROMPTS = [5, 9, 14]  # one sequence each, irregular lengths
STEPS = 4


def _commit(path: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def _randomize(module: nn.Module, gen: torch.Generator, scale: float = 0.35) -> None:
    """Random weights large enough that the drafters' choices are decisive (no near-ties)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / max(1.0, p.shape[-1] ** 0.5) * 4)


def _qwen3_config(**extra: Any):
    from transformers import Qwen3Config

    fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                  max_position_embeddings=256, rope_theta=10000.0, attention_bias=False)
    cfg = Qwen3Config(**{**fields, **extra})
    cfg._attn_implementation = "eager"
    return cfg


def _schedule(gen: torch.Generator, max_accept: int) -> list[list[int]]:
    return [torch.randint(0, max_accept + 1, (STEPS,), generator=gen).tolist() for _ in PROMPTS]


def _target(gen: torch.Generator, total: int) -> dict[str, torch.Tensor]:
    """The target's part: embedding, LM head, and per sequence the token ids and target features of every
    position (the drafter reads nothing else of the target)."""
    return {"embed": torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64),
            "lm_head": torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) * 0.5,
            "tokens": torch.randint(0, VOCAB - 1, (len(PROMPTS), total), generator=gen),
            "features": torch.randn(len(PROMPTS), total, len(FEATURE_IDS) * HIDDEN, generator=gen,
                                    dtype=torch.float64)}


def _write(out: Path, config: dict[str, Any], weights: dict[str, torch.Tensor], target: dict[str, torch.Tensor],
           expected: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    (out / "checkpoint").mkdir(parents=True, exist_ok=True)  # the drafter directory, in the published format
    (out / "checkpoint" / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().float().contiguous() for k, v in weights.items()},
              str(out / "checkpoint" / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in target.items()}, str(out / "target.safetensors"))
    save_file({k: v.contiguous() for k, v in expected.items()}, str(out / "expected.safetensors"))
    (out / "expected.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}: {sum(p.stat().st_size for p in out.rglob('*') if p.is_file())} bytes")


def _stack(steps: list[list[torch.Tensor]]) -> torch.Tensor:
    """``steps[seq][step]`` tensors ``[1, ...]`` -> ``[seq, step, ...]``."""
    return torch.stack([torch.cat(s, dim=0) for s in steps])


# ------------------------------------------------------------------------------------------------ DFlash
def _replay_block_drafter(forward, target: dict[str, torch.Tensor], schedule: list[list[int]], block: int,
                          mask_token: int, scale: float = 1.0):
    """Drive a DFlash-style drafter as ``dflash_generate`` does, one sequence at a time: yield per step the block
    output ``[1, block - 1, H]`` after the crop."""
    from transformers import DynamicCache

    results = []
    for b, prompt in enumerate(PROMPTS):
        cache = DynamicCache()
        hidden = target["features"][b:b + 1, :prompt]
        start, per_step = prompt, []
        for accepted in schedule[b]:
            ids = torch.full((1, block), mask_token, dtype=torch.long)
            ids[0, 0] = target["tokens"][b, start]
            noise = F.embedding(ids, target["embed"]) * scale
            positions = torch.arange(cache.get_seq_length(), start + block).unsqueeze(0)
            out = forward(hidden, noise, positions, cache, start)
            cache.crop(start)
            per_step.append(out[:, 1 - block:, :])
            hidden = target["features"][b:b + 1, start:start + accepted + 1]
            start += accepted + 1
        results.append(per_step)
    return results


def make_dflash(dflash_root: Path, out: Path, gen: torch.Generator) -> None:
    sys.path.insert(0, str(dflash_root))
    from dflash.model import DFlashDraftModel

    block = 5
    cfg = _qwen3_config(block_size=block, num_target_layers=TARGET_LAYERS,
                        dflash_config={"mask_token_id": VOCAB - 1, "target_layer_ids": FEATURE_IDS})
    model = DFlashDraftModel(cfg).double().eval()
    _randomize(model, gen)
    schedule = _schedule(gen, block - 1)
    target = _target(gen, max(PROMPTS) + STEPS * block + 1)

    def forward(hidden, noise, positions, cache, start):
        return model(target_hidden=hidden, noise_embedding=noise, position_ids=positions, past_key_values=cache,
                     use_cache=True, is_causal=False)

    expected: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, size in (("full", block), ("short", 3)):  # the checkpoint's block, and block_size=3 (gamma 2)
            h = _replay_block_drafter(forward, target, schedule, size, VOCAB - 1)
            logits = _stack([[F.linear(x, target["lm_head"]) for x in seq] for seq in h])
            expected[f"{name}.tokens"] = logits.argmax(-1)
            expected[f"{name}.probs"] = torch.softmax(logits, dim=-1)
    config = model.config.to_dict()
    config["architectures"] = ["DFlashDraftModel"]
    _write(out, config, model.state_dict(), target, expected, {
        "reference": "z-lab/dflash", "commit": _commit(dflash_root), "schedule": schedule, "prompts": PROMPTS,
        "gammas": {"full": block - 1, "short": 2}, "rule": "dflash_generate's draft step, block [last, mask...]"})


# ----------------------------------------------------------------------------------------------- DFlash2
def _load_vllm_parts(vllm_root: Path) -> dict[str, Any]:
    """Execute the plain-torch definitions of vLLM's ``qwen3_dflash2.py`` (the file itself imports vLLM)."""
    path = vllm_root / "vllm" / "model_executor" / "models" / "qwen3_dflash2.py"
    tree = ast.parse(path.read_text())
    wanted = {"_topk", "_grouped_conv", "DFlashGroupedConv", "_score_edges", "CandidateSelector"}
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted]
    for n in nodes:
        n.decorator_list = []  # @support_torch_compile: a vLLM compilation hook
    if {n.name for n in nodes} != wanted:
        raise SystemExit(f"{path}: expected definitions {sorted(wanted)}, found {sorted(n.name for n in nodes)}")

    class ReplicatedLinear(nn.Linear):  # vLLM's unsharded linear, as a plain torch linear
        def __init__(self, in_features: int, out_features: int, bias: bool = False, **_: Any) -> None:
            super().__init__(in_features, out_features, bias=bias)

    namespace: dict[str, Any] = {"torch": torch, "F": F, "nn": nn, "ReplicatedLinear": ReplicatedLinear,
                                 "maybe_prefix": lambda prefix, name: f"{prefix}.{name}" if prefix else name,
                                 "_flashinfer_topk": lambda: None}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    namespace["path"] = path
    return namespace


def make_dflash2(dflash_root: Path, vllm_root: Path, out: Path, gen: torch.Generator, *, sliding: bool) -> None:
    sys.path.insert(0, str(dflash_root))
    from dflash.model import DFlashDraftModel

    v = _load_vllm_parts(vllm_root)
    block, taps, group, rank, top_k, window = 5, 2, 8, 8, 6, 6
    extra = (dict(layer_types=["sliding_attention"] * 2, sliding_window=window, use_sliding_window=True) if sliding
             else {"is_causal": False})
    dflash_config = {"mask_token_id": VOCAB - 1, "target_layer_ids": FEATURE_IDS, "block_size": block,
                     "conv_kernel_size": taps, "conv_group_size": group, "selector_rank": rank,
                     "selector_top_k": top_k, "output_multiplier": 0.8, "final_logit_softcapping": 12.0,
                     "input_embedding_scale": 1.25}
    cfg = _qwen3_config(num_target_layers=TARGET_LAYERS, block_size=block, dflash_config=dflash_config, **extra)
    model = DFlashDraftModel(cfg).double().eval()
    convs = nn.ModuleDict({
        f"{i}_{kind}": v["DFlashGroupedConv"](HIDDEN, taps, group, block, torch.float64, f"layers.{i}.{kind}")
        for i in range(2) for kind in ("attention_conv", "mlp_conv")}).double()
    selector = v["CandidateSelector"](HIDDEN, VOCAB, rank, top_k, torch.float64, "candidate_selector").double()
    for module in (model, convs, selector):
        _randomize(module, gen)
    schedule = _schedule(gen, block - 1)
    target = _target(gen, max(PROMPTS) + STEPS * block + 1)

    def mask_for(layer: int, kv_len: int, start: int) -> torch.Tensor | None:
        # Sliding layers see keys k > q - W and, causal by vLLM's default for sliding layers, k <= q in the block.
        if not sliding:
            return None
        q = torch.arange(start, start + block).view(-1, 1)
        k = torch.arange(kv_len).view(1, -1)
        visible = (k > q - window) & (k <= q)
        return torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, float("-inf"))[None, None]

    def forward(hidden, noise, positions, cache, start):
        # DFlash2Qwen3DecoderLayer.forward's order over z-lab's DFlash layer modules.
        x = noise
        context = model.hidden_norm(model.fc(hidden))
        rope = model.rotary_emb(x, positions)
        for i, layer in enumerate(model.layers):
            kv_len = start + block
            residual, h = x, layer.input_layernorm(x)
            h, coeff = convs[f"{i}_attention_conv"].prepare(h.reshape(-1, HIDDEN))
            h = layer.self_attn(hidden_states=h.view(1, block, HIDDEN), target_hidden=context, position_embeddings=rope,
                                attention_mask=mask_for(i, kv_len, start), past_key_values=cache)[0]
            x = residual + convs[f"{i}_attention_conv"].finish(h.reshape(-1, HIDDEN), coeff).view(1, block, HIDDEN)
            residual, h = x, layer.post_attention_layernorm(x)
            h, coeff = convs[f"{i}_mlp_conv"].prepare(h.reshape(-1, HIDDEN))
            h = layer.mlp(h)
            x = residual + convs[f"{i}_mlp_conv"].finish(h, coeff).view(1, block, HIDDEN)
        return model.norm(x)

    with torch.no_grad():
        h = _replay_block_drafter(forward, target, schedule, block, VOCAB - 1, dflash_config["input_embedding_scale"])
        ids_all, realized_all, tokens_all = [], [], []
        for seq, last_positions in zip(h, _last_positions(schedule), strict=True):
            ids_seq, realized_seq, tokens_seq = [], [], []
            for x, position in zip(seq, last_positions, strict=True):
                logits = F.linear(x, target["lm_head"])  # compute_candidates: the target head, top-K, scaled, capped
                values, ids = v["_topk"](logits, top_k)
                values = values.float() * dflash_config["output_multiplier"]
                cap = dflash_config["final_logit_softcapping"]
                values = torch.tanh(values / cap) * cap
                anchor = target["tokens"][len(ids_all), position].view(1)
                scores = selector(ids, values, x, anchor)  # [1, gamma, K, K]
                previous, realized, tokens = 0, [], []
                for step in range(block - 1):  # _selector_walk_kernel, greedy branch: first maximum, from 0
                    row = scores[0, step, previous]
                    previous = int(row.argmax())
                    realized.append(row)
                    tokens.append(ids[0, step, previous])
                ids_seq.append(ids)
                realized_seq.append(torch.stack(realized)[None])
                tokens_seq.append(torch.stack(tokens)[None])
            ids_all.append(ids_seq)
            realized_all.append(realized_seq)
            tokens_all.append(tokens_seq)
    weights = dict(model.state_dict())
    for i in range(2):
        for kind in ("attention_conv", "mlp_conv"):
            for k, t in convs[f"{i}_{kind}"].state_dict().items():
                weights[f"layers.{i}.{kind}.{k}"] = t
    weights.update({f"candidate_selector.{k}": t for k, t in selector.state_dict().items()})
    config = model.config.to_dict()
    config["architectures"] = ["DFlash2DraftModel"]
    expected = {"tokens": _stack(tokens_all), "candidates": _stack(ids_all),
                "probs": torch.softmax(_stack(realized_all).double(), dim=-1)}
    _write(out, config, weights, target, expected, {
        "reference": "z-lab/dflash (backbone) + vllm-project/vllm qwen3_dflash2.py (PR #52816)",
        "commit": {"dflash": _commit(dflash_root)}, "schedule": schedule,
        "prompts": PROMPTS, "gammas": {"full": block - 1},
        "rule": "DFlash2: conv-wrapped sublayers, top-K candidates, edge scores, greedy walk from candidate 0",
        "sliding": sliding})


def _last_positions(schedule: list[list[int]]) -> list[list[int]]:
    out = []
    for prompt, steps in zip(PROMPTS, schedule, strict=True):
        start, seq = prompt, []
        for accepted in steps:
            seq.append(start)
            start += accepted + 1
        out.append(seq)
    return out


# ------------------------------------------------------------------------------------------------ DSpark
class _Args(dict):
    __getattr__ = dict.__getitem__


def make_dspark(deepspec_root: Path, out: Path, gen: torch.Generator, head: str, confidence: str) -> None:
    sys.path.insert(0, str(deepspec_root))
    from deepspec.eval.dspark.draft_ops import (
        _predict_confidence_logits,
        build_dspark_proposal,
        forward_dspark_draft_block,
    )
    from deepspec.modeling.dspark.qwen3.config import build_draft_config
    from deepspec.modeling.dspark.qwen3.modeling import Qwen3DSparkModel
    from transformers import DynamicCache

    block = 4
    args = _Args(num_draft_layers=2, target_layer_ids=FEATURE_IDS, block_size=block, mask_token_id=VOCAB - 1,
                 num_anchors=8, markov_rank=6, markov_head_type=head,
                 confidence_head_alpha=0.0 if confidence == "none" else 1.0,
                 confidence_head_with_markov=confidence == "markov")
    target_cfg = _qwen3_config(num_hidden_layers=TARGET_LAYERS)
    cfg = build_draft_config(target_cfg, args)
    cfg._attn_implementation = "eager"
    model = Qwen3DSparkModel(cfg).double().eval()
    _randomize(model, gen)
    schedule = _schedule(gen, block)
    target = _target(gen, max(PROMPTS) + STEPS * (block + 1) + 1)
    thresholds = [0.3, 0.5, 0.7]
    rows: dict[str, list[list[torch.Tensor]]] = {k: [] for k in ("tokens", "probs", "confidence", "cut")}
    with torch.no_grad():
        for b, prompt in enumerate(PROMPTS):
            cache = DynamicCache()
            hidden = target["features"][b:b + 1, :prompt]
            positions = torch.arange(prompt + STEPS * (block + 1) + block).unsqueeze(0)
            start = prompt
            seq: dict[str, list[torch.Tensor]] = {k: [] for k in rows}
            for accepted in schedule[b]:
                ids = torch.full((1, block), VOCAB - 1, dtype=torch.long)
                ids[0, 0] = target["tokens"][b, start]
                h = forward_dspark_draft_block(model, draft_input_ids=ids, position_ids=positions,
                                               past_key_values_draft=cache, target_hidden_states=hidden, start=start,
                                               block_size=block)
                proposal_h = h[:, :block]
                tokens, logits = model.sample_draft_tokens(model.compute_logits(proposal_h),
                                                           first_prev_token_ids=ids[:, 0], temperature=0.0,
                                                           hidden_states=proposal_h)
                seq["tokens"].append(tokens)
                seq["probs"].append(torch.softmax(logits, dim=-1))
                conf = _predict_confidence_logits(model, proposal_hidden_states=proposal_h, draft_input_ids=ids,
                                                  sampled_tokens=tokens, block_size=block)
                seq["confidence"].append(conf if conf is not None else torch.zeros(1, block))
                seq["cut"].append(torch.tensor([[build_dspark_proposal(
                    model, draft_input_ids=ids, block_hidden=h, block_size=block, temperature=0.0,
                    confidence_threshold=t).draft_token_count for t in thresholds]]))
                hidden = target["features"][b:b + 1, start:start + accepted + 1]
                start += accepted + 1
            for k in rows:
                rows[k].append(seq[k])
    config = model.config.to_dict()
    config["architectures"] = ["Qwen3DSparkModel"]
    config.pop("_attn_implementation", None)
    _write(out, config, model.state_dict(), target, {k: _stack(v) for k, v in rows.items()}, {
        "reference": "deepseek-ai/DeepSpec", "commit": _commit(deepspec_root), "schedule": schedule,
        "prompts": PROMPTS, "gammas": {"full": block}, "thresholds": thresholds, "markov_head_type": head,
        "confidence": confidence,
        "rule": ("forward_dspark_draft_block + sample_draft_tokens + _predict_confidence_logits + "
                 "build_dspark_proposal")})


def main(argv: list[str] | None = None) -> int:
    import transformers

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="dflash,dflash2,dspark", help="comma-separated: dflash, dflash2, dspark")
    p.add_argument("--dflash", type=Path, help="z-lab/dflash checkout (dflash, dflash2)")
    p.add_argument("--deepspec", type=Path, help="deepseek-ai/DeepSpec checkout (dspark)")
    p.add_argument("--vllm", type=Path, help="tree with vllm/model_executor/models/qwen3_dflash2.py (dflash2)")
    p.add_argument("--vllm-commit", default="unknown", help="the vLLM commit that file comes from (recorded)")
    p.add_argument("--out", type=Path, default=Path("tests/fixtures/drafters"))
    args = p.parse_args(argv)
    cases = set(args.cases.split(","))
    sources_path = args.out / "SOURCES.json"
    sources = json.loads(sources_path.read_text()) if sources_path.exists() else {}
    tf = transformers.__version__
    if "dflash" in cases:
        make_dflash(args.dflash, args.out / "dflash", torch.Generator().manual_seed(30))
        sources["dflash"] = {"repository": "z-lab/dflash", "commit": _commit(args.dflash), "transformers": tf}
    if "dflash2" in cases:
        make_dflash2(args.dflash, args.vllm, args.out / "dflash2", torch.Generator().manual_seed(31), sliding=False)
        make_dflash2(args.dflash, args.vllm, args.out / "dflash2_swa", torch.Generator().manual_seed(32), sliding=True)
        sources["dflash2"] = {"backbone": {"repository": "z-lab/dflash", "commit": _commit(args.dflash)},
                              "selector_and_conv": {"repository": "vllm-project/vllm", "commit": args.vllm_commit,
                                                    "file": "vllm/model_executor/models/qwen3_dflash2.py"},
                              "transformers": tf}
    if "dspark" in cases:
        for seed, (name, head, confidence) in enumerate((("dspark_vanilla", "vanilla", "markov"),
                                                         ("dspark_gated", "gated", "plain"),
                                                         ("dspark_rnn", "rnn", "none"))):
            make_dspark(args.deepspec, args.out / name, torch.Generator().manual_seed(40 + seed), head, confidence)
        sources["dspark"] = {"repository": "deepseek-ai/DeepSpec", "commit": _commit(args.deepspec), "transformers": tf}
    args.out.mkdir(parents=True, exist_ok=True)
    sources_path.write_text(json.dumps(sources, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

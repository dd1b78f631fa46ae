"""DeepSeek-V4 checkpoint tensors: the expected shapes (in transformers' own names, the engine's canonical
names) and reading a checkpoint written under either naming transformers 5.24 uses for this model.

* transformers' names (``save_pretrained(..., save_original_format=False)`` and engine directories):
  ``model.layers.N.self_attn.q_a_proj.weight``, ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``attn_hc.fn`` …
* DeepSeek's original names (transformers' default ``save_pretrained``, and DeepSeek's own release, with or
  without the ``model.`` prefix): ``layers.N.attn.wq_a.weight``, ``ffn.experts.K.w1.weight``,
  ``hc_attn_fn``, ``attn.compressor.ape``, ``attn.indexer.compressor.wkv.weight``, ``head.weight`` …
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from dhisparse.errors import CheckpointError
from dhisparse.model.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from dhisparse.model.weights import iter_tensors

# transformers keeps these in float32 whatever the model dtype (``_keep_in_fp32_modules_strict``).
_FLOAT32 = re.compile(r"(attn_hc|ffn_hc|hc_head)\.|(sinks|position_bias|e_score_correction_bias)$|"
                      r"(q_a_norm|kv_norm|input_layernorm|post_attention_layernorm)\.weight$|^model\.norm\.weight$")
_INTEGER = re.compile(r"tid2eid$")

# Suffix renames inside one layer, transformers' name -> DeepSeek's name (longest first where they overlap).
_LAYER_RENAMES: tuple[tuple[str, str], ...] = (
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("input_layernorm.weight", "attn_norm.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"), ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"), ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.norm.weight"), ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"), ("self_attn.sinks", "attn.attn_sink"),
    ("mlp.gate.weight", "ffn.gate.weight"), ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
)
_TOP_RENAMES = {
    "model.embed_tokens.weight": ("embed.weight",), "lm_head.weight": ("head.weight",),
    "model.norm.weight": ("norm.weight",), "model.hc_head.hc_fn": ("hc_head_fn",),
    "model.hc_head.hc_base": ("hc_head_base",), "model.hc_head.hc_scale": ("hc_head_scale",),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def original_names(name: str) -> tuple[str, ...]:
    """The DeepSeek-style names a tensor may carry instead of transformers' ``name`` (with and without the
    ``model.`` prefix), most likely first."""
    out: list[str] = []
    for alias in _TOP_RENAMES.get(name, ()):
        out += [f"model.{alias}", alias]
    match = _LAYER.match(name)
    if match:
        layer, rest = match.groups()
        for ours, theirs in _LAYER_RENAMES:
            if rest == ours:
                out += [f"model.layers.{layer}.{theirs}", f"layers.{layer}.{theirs}"]
    return tuple(out)


def expected_shapes(cfg: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the runtime needs, in transformers' names (routed experts stacked as transformers holds
    them: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)."""
    h, heads, hd, qr = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    hc, inter, e = cfg.hc_mult, cfg.moe_intermediate_size, cfg.n_routed_experts
    mix = (2 + hc) * hc
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
        "model.hc_head.hc_fn": (hc, hc * h), "model.hc_head.hc_base": (hc,), "model.hc_head.hc_scale": (1,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for hc_name in ("attn_hc", "ffn_hc"):
            shapes.update({f"{p}{hc_name}.fn": (mix, hc * h), f"{p}{hc_name}.base": (mix,),
                           f"{p}{hc_name}.scale": (3,)})
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            a + "q_a_proj.weight": (qr, h), a + "q_a_norm.weight": (qr,), a + "q_b_proj.weight": (heads * hd, qr),
            a + "kv_proj.weight": (hd, h), a + "kv_norm.weight": (hd,), a + "sinks": (heads,),
            a + "o_a_proj.weight": (cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups),
            a + "o_b_proj.weight": (h, cfg.o_groups * cfg.o_lora_rank),
        })
        kind = cfg.layer_types[i]
        if kind != SLIDING and cfg.owns_compressor(i):
            c = a + "compressor."
            width = 2 * hd if kind == CSA else hd
            rate = cfg.compress_rate(i)
            shapes.update({c + "kv_proj.weight": (width, h), c + "gate_proj.weight": (width, h),
                           c + "position_bias": (rate, width), c + "kv_norm.weight": (hd,)})
            if kind == CSA:
                x, ihd = c + "indexer.", cfg.index_head_dim
                shapes.update({x + "kv_proj.weight": (2 * ihd, h), x + "gate_proj.weight": (2 * ihd, h),
                               x + "position_bias": (rate, 2 * ihd), x + "kv_norm.weight": (ihd,)})
        if kind == CSA and cfg.owns_indexer(i):
            x = a + "compressor.indexer."
            shapes.update({x + "q_b_proj.weight": (cfg.index_n_heads * cfg.index_head_dim, qr),
                           x + "scorer.weights_proj.weight": (cfg.index_n_heads, h)})
        m = p + "mlp."
        shapes[m + "gate.weight"] = (e, h)
        if cfg.mlp_layer_types[i] == "hash_moe":
            shapes[m + "gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
        else:
            shapes[m + "gate.e_score_correction_bias"] = (e,)
        shapes.update({m + "experts.gate_up_proj": (e, 2 * inter, h), m + "experts.down_proj": (e, h, inter),
                       m + "shared_experts.gate_proj.weight": (inter, h),
                       m + "shared_experts.up_proj.weight": (inter, h),
                       m + "shared_experts.down_proj.weight": (h, inter)})
    return shapes


Found = dict[str, tuple[Callable[[], torch.Tensor], tuple[int, ...]]]


def load_state_dict(
    checkpoint: Path, cfg: DeepseekV4Config, dtype: torch.dtype, progress: Callable[[int, int], None] | None = None
) -> dict[str, torch.Tensor]:
    """Read, validate and convert a checkpoint into transformers' names and ``dtype`` (float32 where transformers
    keeps float32, int64 for the hash-routing tables). Raises ``CheckpointError`` listing every missing or
    mis-shaped tensor."""
    expected = expected_shapes(cfg)
    found: Found = {name: (load, shape) for name, load, shape in iter_tensors(checkpoint)}
    out: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for done, (name, shape) in enumerate(expected.items(), start=1):
        tensor = _fetch(name, shape, found, problems)
        if tensor is not None:
            if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                problems.append(f"{name}: stored as {tensor.dtype} (block-scaled FP8); dequantise the checkpoint "
                                "first — FP8 weights with scale tensors are not read")
                continue
            if _INTEGER.search(name):
                tensor = tensor.to(torch.int64)
                if bool(((tensor < 0) | (tensor >= cfg.n_routed_experts)).any()):
                    problems.append(f"{name}: expert ids outside [0, {cfg.n_routed_experts})")
            else:
                tensor = tensor.to(torch.float32 if _FLOAT32.search(name) else dtype)
            out[name] = tensor.contiguous()
        if progress is not None:
            progress(done, len(expected))
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(f"{checkpoint}: checkpoint does not match its config.json:\n  {shown}{more}")
    return out


def _fetch(name: str, shape: tuple[int, ...], found: Found, problems: list[str]) -> torch.Tensor | None:
    for candidate in (name, *original_names(name)):
        if candidate in found:
            load, got = found[candidate]
            if got != shape:
                problems.append(f"{candidate}: shape {list(got)}, expected {list(shape)}")
                return None
            return load()
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return _fetch_original_experts(name, shape, found, problems)
    problems.append(f"{name}: missing" + (f" (also looked for {original_names(name)[0]})"
                                          if original_names(name) else ""))
    return None


def _fetch_original_experts(name: str, shape: tuple[int, ...], found: Found, problems: list[str]
                            ) -> torch.Tensor | None:
    """Stack DeepSeek's per-expert ``ffn.experts.K.w1/w3/w2.weight`` into transformers' layout."""
    layer = _LAYER.match(name)
    assert layer is not None
    n_experts = shape[0]
    kinds = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
    part_shape = (shape[1] // 2, shape[2]) if len(kinds) == 2 else (shape[1], shape[2])
    stacks = []
    for kind in kinds:
        parts = []
        for e in range(n_experts):
            names = [f"{prefix}layers.{layer.group(1)}.ffn.experts.{e}.{kind}.weight" for prefix in ("model.", "")]
            hit = next((n for n in names if n in found), None)
            if hit is None:
                problems.append(f"{name}: missing (neither stacked nor per-expert tensors such as {names[0]})")
                return None
            load, got = found[hit]
            if got != part_shape:
                problems.append(f"{hit}: shape {list(got)}, expected {list(part_shape)}")
                return None
            parts.append(load())
        stacks.append(torch.stack(parts))
    return torch.cat(stacks, dim=1) if len(stacks) == 2 else stacks[0]

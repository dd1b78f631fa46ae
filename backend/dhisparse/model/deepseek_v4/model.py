"""The DeepSeek-V4 causal LM forward pass (transformers 5.24's ``DeepseekV4ForCausalLM``) over ``V4StepKV``.

The residual is ``hc_mult`` parallel streams ``[B, Q, N, hidden]``; each block collapses them (mHC ``pre``),
runs attention or the MoE on the collapsed state, and writes back ``post ⊗ out + combᵀ · streams``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from dhisparse.host_values import to_device
from dhisparse.model.collectives import LOCAL, Collectives
from dhisparse.model.deepseek_v4.attention import V4Attention
from dhisparse.model.deepseek_v4.config import DeepseekV4Config
from dhisparse.model.deepseek_v4.kv_state import V4RequestKV, V4StepKV
from dhisparse.model.deepseek_v4.layers import HyperConnection, Rotary, V4MoE, hyper_head, hyper_merge, rms_norm
from dhisparse.model.deepseek_v4.weights import load_state_dict
from dhisparse.model.weights import read_raw_config


@dataclass
class V4ForwardOutput:
    """``logits [B, Q or 1, vocab]`` float32; ``hidden {layer: [B, Q, hidden]}``: the mean of that layer's
    ``hc_mult`` output streams (the feature drafters read); ``selections {layer: [B, Q, K]}`` CSA entries."""

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    selections: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class V4PrefillOutput:
    """One prompt prefilled: last position's ``logits [vocab]``, the request's KV state after the prompt
    (``state``, also exposed as ``rows`` for the engine's ``import_prompt``), and optionally every logit."""

    logits: torch.Tensor
    state: V4RequestKV
    all_logits: torch.Tensor | None = None
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def rows(self) -> V4RequestKV:
        return self.state


class DeepseekV4Model:
    """Inference-only model; weights in transformers' names (see ``weights.expected_shapes``)."""

    def __init__(self, cfg: DeepseekV4Config, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        w = {k: v.to(device) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.final_norm = w["model.norm.weight"]
        self.collectives: Collectives = LOCAL  # engine/parallel installs its own (vocabulary-split lm_head)
        self.head = (w["model.hc_head.hc_fn"], w["model.hc_head.hc_base"], w["model.hc_head.hc_scale"])
        self.rotary = {name: Rotary(view, device) for name, view in cfg.rope_sets.items()}
        n = cfg.num_hidden_layers
        self.attn = [V4Attention(cfg, i, w) for i in range(n)]
        self.attn_hc = [HyperConnection(*(w[f"model.layers.{i}.attn_hc.{k}"] for k in ("fn", "base", "scale")), cfg)
                        for i in range(n)]
        self.ffn_hc = [HyperConnection(*(w[f"model.layers.{i}.ffn_hc.{k}"] for k in ("fn", "base", "scale")), cfg)
                       for i in range(n)]
        self.input_norm = [w[f"model.layers.{i}.input_layernorm.weight"] for i in range(n)]
        self.post_norm = [w[f"model.layers.{i}.post_attention_layernorm.weight"] for i in range(n)]
        self.mlp = [V4MoE(w, f"model.layers.{i}.mlp.", cfg, cfg.mlp_layer_types[i] == "hash_moe") for i in range(n)]

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
                        ) -> DeepseekV4Model:
        path = Path(path)
        raw = read_raw_config(path)
        if raw.get("model_type") != "deepseek_v4":
            raise TypeError(f"{path} is not a deepseek_v4 checkpoint")
        cfg = DeepseekV4Config.from_hf_dict(raw)
        return cls(cfg, load_state_dict(path, cfg, dtype), dtype, torch.device(device))

    def new_state(self, capacity: int) -> V4RequestKV:
        """Empty KV state, its entry tables sized for ``capacity`` tokens."""
        return V4RequestKV(self.cfg, capacity, self.dtype, self.device)

    # --------------------------------------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor | None, kv: V4StepKV, *,
                all_logits: bool = False, capture_hidden: tuple[int, ...] = (), record_selections: bool = False
                ) -> V4ForwardOutput:
        """Run ``token_ids [B, Q]`` at ``positions [B, Q]`` (``None``: ``kv.positions``, which they must equal);
        the caller commits ``kv`` afterwards."""
        cfg = self.cfg
        self.collectives.begin_forward(token_ids.numel())
        if positions is None:
            positions = kv.positions
        elif not torch.equal(positions.to(kv.positions.device), kv.positions):
            raise ValueError("positions must continue each request's history (kv.positions)")
        streams = self.embed[token_ids].unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
        out = V4ForwardOutput(logits=torch.empty(0))
        selections: dict[int, torch.Tensor] = {}
        for i in range(cfg.num_hidden_layers):
            post, comb, collapsed = self.attn_hc[i](streams)
            shared = selections.get(cfg.source_of(i)) if cfg.reuses_topk(i) else None
            a, sel = self.attn[i](rms_norm(collapsed, self.input_norm[i], cfg.rms_norm_eps), positions, kv,
                                  self.rotary, shared)
            if sel is not None:
                selections[i] = sel
            streams = hyper_merge(streams, a, post, comb)
            post, comb, collapsed = self.ffn_hc[i](streams)
            m = self.mlp[i](rms_norm(collapsed, self.post_norm[i], cfg.rms_norm_eps), token_ids)
            streams = hyper_merge(streams, m, post, comb)
            if i in capture_hidden:
                out.hidden[i] = streams.mean(dim=2)
        if record_selections:
            out.selections = selections
        h = streams if all_logits else streams[:, -1:]
        h = rms_norm(hyper_head(h, *self.head, cfg), self.final_norm, cfg.rms_norm_eps)
        out.logits = self.collectives.vocab_logits(F.linear(h, self.lm_head), cfg.vocab_size).float()
        return out

    @torch.inference_mode()
    def prefill(self, token_ids: list[int] | torch.Tensor, *, chunk_tokens: int = 512,
                capture_hidden: tuple[int, ...] = (), all_logits: bool = False, capacity: int | None = None,
                on_chunk: Callable[[int], None] | None = None, store: V4RequestKV | None = None, start: int = 0
                ) -> V4PrefillOutput:
        """Prefill one prompt chunk by chunk into a fresh state (entry tables sized for ``capacity`` tokens,
        default the prompt; they grow). Chunking does not change results beyond float32 rounding of the
        reference's own float32 parts (mHC, norms). ``on_chunk(start)`` is called before each chunk's forward
        (the engine's fault injection).

        ``store``/``start`` (prefix reuse, ``prefix.py``): continue ``store``, a state of ``start`` tokens whose
        restored entries it keeps (``prefix.restored_state``); only positions ``start ..`` are computed, in chunks on
        the grid of ``chunk_tokens`` a full prefill uses (the first ends at the next multiple), and hidden states and
        logits cover those positions only."""
        ids = to_device(token_ids, torch.int64, self.device).view(-1)
        total = ids.numel()
        if not 0 <= start < total:
            raise ValueError(f"prefill start {start} must be in 0 .. {total - 1} (at least one token is computed)")
        if store is None and start:
            raise ValueError("a prefill after a cached prefix needs the restored state (prefix.restored_state)")
        if store is not None and store.length != start:
            raise ValueError(f"the restored state holds {store.length} tokens, the prefill starts at {start}")
        state = store if store is not None else self.new_state(capacity or total)
        parts: list[torch.Tensor] = []
        hidden: dict[int, list[torch.Tensor]] = {i: [] for i in capture_hidden}
        result = None
        bounds = [start, *range((start // chunk_tokens + 1) * chunk_tokens, total, chunk_tokens), total]
        for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
            if on_chunk is not None:
                on_chunk(begin)
            chunk = ids[begin:end]
            step = V4StepKV([state], chunk.numel(), self.device)
            result = self.forward(chunk.unsqueeze(0), None, step, all_logits=all_logits, capture_hidden=capture_hidden)
            step.commit()
            if all_logits:
                parts.append(result.logits[0])
            for i in capture_hidden:
                hidden[i].append(result.hidden[i][0])
        assert result is not None
        return V4PrefillOutput(logits=result.logits[0, -1], state=state,
                               all_logits=torch.cat(parts) if all_logits else None,
                               hidden={i: torch.cat(v) for i, v in hidden.items()})

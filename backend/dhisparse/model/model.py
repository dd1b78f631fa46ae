"""The DSA causal LM forward pass (both families), over any ``StepKV`` store."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from dhisparse.host_values import to_device
from dhisparse.model.attention import IndexedMLA
from dhisparse.model.collectives import LOCAL, Collectives
from dhisparse.model.config import ModelConfig
from dhisparse.model.kv_view import LocalKV, PrefillKV, StepKV
from dhisparse.model.layers import MoE, RotaryEmbedding, gated_mlp
from dhisparse.model.weights import load_state_dict, read_config


@dataclass
class ForwardOutput:
    """``logits [B, Q or 1, vocab]`` (float32); ``hidden {layer: [B, Q, hidden]}`` for requested layers
    (output of that decoder layer); ``selections {layer: [B, Q, K]}`` when recording."""

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    selections: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class PrefillOutput:
    """Result of prefilling one prompt of ``T`` tokens: the last position's logits ``[vocab]``, the prompt's
    rows ``[num_layers, T, row_dim]`` (``None`` when a streamed store took them chunk by chunk), indexer keys
    ``{layer: [T, d]}`` and captured hidden states ``[T, hidden]``."""

    logits: torch.Tensor
    rows: torch.Tensor | None
    index_keys: dict[int, torch.Tensor]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    all_logits: torch.Tensor | None = None
    selections: dict[int, torch.Tensor] = field(default_factory=dict)


class DSAModel:
    """Inference-only model. Weights are plain tensors in canonical names (see ``weights.expected_shapes``)."""

    def __init__(
        self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        w = {k: v.to(device) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.final_norm = w["model.norm.weight"]
        self.collectives: Collectives = LOCAL  # engine/parallel installs its own (vocabulary-split lm_head)
        self.rope = RotaryEmbedding(cfg, device)
        self.attn = [IndexedMLA(cfg, i, w) for i in range(cfg.num_hidden_layers)]
        self.input_norm = [w[f"model.layers.{i}.input_layernorm.weight"] for i in range(cfg.num_hidden_layers)]
        self.post_norm = [w[f"model.layers.{i}.post_attention_layernorm.weight"] for i in range(cfg.num_hidden_layers)]
        self.mlp: list = []
        for i, kind in enumerate(cfg.mlp_layer_types):
            m = f"model.layers.{i}.mlp."
            if kind == "dense":
                dense = (w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
                self.mlp.append(lambda x, d=dense: gated_mlp(x, *d))
            else:
                self.mlp.append(
                    MoE(w, m, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                        norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
                        has_shared=cfg.n_shared_experts > 0)
                )

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> DSAModel:
        """Load a Hugging Face checkpoint directory (or an engine directory, which uses the same layout)."""
        path = Path(path)
        cfg = read_config(path)
        return cls(cfg, load_state_dict(path, cfg, dtype), dtype, torch.device(device))

    # --------------------------------------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: StepKV,
        *,
        all_logits: bool = False,
        capture_hidden: tuple[int, ...] = (),
        record_selections: bool = False,
    ) -> ForwardOutput:
        """Run ``token_ids [B, Q]`` at ``positions [B, Q]`` against ``kv``. Logits of the last query only unless
        ``all_logits`` (speculative verification needs every position)."""
        local = self.collectives is LOCAL  # one rank: no collective is called
        if not local:
            self.collectives.begin_forward(token_ids.numel())
        h = self.embed[token_ids]
        # RMSNorms as DeepseekV3RMSNorm (float32, cast back, then scaled: ``layers.rms_norm``), written with torch's
        # fused op in place: a decode step runs 2 per layer (``tests/model/test_layers.py`` checks the equality).
        eps = self.cfg.rms_norm_eps
        cos, sin = self.rope(positions, self.dtype)
        out = ForwardOutput(logits=torch.empty(0))
        selection = None
        for i in range(self.cfg.num_hidden_layers):
            attn_out, selection = self.attn[i](
                self.input_norm[i] * F.rms_norm(h.float(), self.input_norm[i].shape, eps=eps).to(h.dtype),
                positions, cos, sin, kv,
                None if self.attn[i].has_indexer else selection,
            )
            h = h + attn_out
            normed = self.post_norm[i] * F.rms_norm(h.float(), self.post_norm[i].shape, eps=eps).to(h.dtype)
            h = h + self.mlp[i](normed)
            if i in capture_hidden:
                out.hidden[i] = h
            if record_selections:
                out.selections[i] = selection
        h = h if all_logits else h[:, -1:]
        h = self.final_norm * F.rms_norm(h.float(), self.final_norm.shape, eps=eps).to(h.dtype)
        logits = F.linear(h, self.lm_head)
        out.logits = (logits if local else self.collectives.vocab_logits(logits, self.cfg.vocab_size)).float()
        return out

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: list[int] | torch.Tensor,
        *,
        chunk_tokens: int = 512,
        capture_hidden: tuple[int, ...] = (),
        all_logits: bool = False,
        record_selections: bool = False,
        capacity: int | None = None,
        on_chunk: Callable[[int], None] | None = None,
        store: PrefillKV | None = None,
        start: int = 0,
    ) -> PrefillOutput:
        """Prefill one prompt chunk by chunk over a local KV; chunking bounds the attention workspace and does
        not change results (each chunk's queries see every earlier row). ``on_chunk(start)`` is called before each
        chunk's forward (the engine's fault injection). ``store`` replaces the default ``LocalKV`` of the whole
        prompt (the engine streams rows into the KV hierarchy's host pages: ``kv/prefill_stream.py``).

        ``start``: positions ``0 .. start-1`` are a cached prefix already in ``store`` (prefix reuse: their rows and
        indexer keys); only positions ``start ..`` are computed, in chunks on the same grid of ``chunk_tokens`` as a
        full prefill (the first one ends at the next multiple), and hidden states, logits and selections cover those
        positions only."""
        ids = to_device(token_ids, torch.int64, self.device).view(-1)
        total = ids.numel()
        cfg = self.cfg
        if not 0 <= start < total:
            raise ValueError(f"prefill start {start} must be in 0 .. {total - 1} (at least one token is computed)")
        if start and store is None:
            raise ValueError("a prefill after a cached prefix needs the store that holds the prefix")
        local = store if store is not None else LocalKV(
            cfg.num_hidden_layers, cfg.indexer_layers, capacity or total, cfg.row_dim, cfg.index_head_dim,
            self.dtype, self.device)
        hidden: dict[int, list[torch.Tensor]] = {i: [] for i in capture_hidden}
        logits_parts: list[torch.Tensor] = []
        selections: dict[int, list[torch.Tensor]] = {}
        result = None
        bounds = [start, *range((start // chunk_tokens + 1) * chunk_tokens, total, chunk_tokens), total]
        for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
            if on_chunk is not None:
                on_chunk(begin)
            chunk = ids[begin:end]
            positions = torch.arange(begin, end, device=self.device).unsqueeze(0)
            result = self.forward(chunk.unsqueeze(0), positions, local.begin(chunk.numel()), all_logits=all_logits,
                                  capture_hidden=capture_hidden, record_selections=record_selections)
            local.end()
            for i in capture_hidden:
                hidden[i].append(result.hidden[i][0])
            if all_logits:
                logits_parts.append(result.logits[0])
            for i, sel in result.selections.items():
                selections.setdefault(i, []).append(sel[0])
        assert result is not None
        return PrefillOutput(
            logits=result.logits[0, -1],
            rows=local.rows[:, :total] if isinstance(local, LocalKV) else None,
            index_keys={i: k[:total] for i, k in local.keys.items()},
            hidden={i: torch.cat(v) for i, v in hidden.items()},
            all_logits=torch.cat(logits_parts) if all_logits else None,
            selections={i: _pad_cat(v) for i, v in selections.items()},
        )


def _pad_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate ``[Q_i, K_i]`` selections along queries, padding K with −1."""
    width = max(p.shape[-1] for p in parts)
    return torch.cat([F.pad(p, (0, width - p.shape[-1]), value=-1) for p in parts])

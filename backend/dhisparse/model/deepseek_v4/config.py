"""DeepSeek-V4 model configuration, parsed from a Hugging Face ``config.json`` (transformers 5.24's
``DeepseekV4Config``, including the legacy fields that config folds in at load time).

Layer schedule: ``layer_types[i]`` is ``sliding_attention`` (window only), ``compressed_sparse_attention``
(CSA: window + compressed entries every ``compress_rate_csa`` tokens, of which the lightning indexer picks the
top-k) or ``heavily_compressed_attention`` (HCA: window + every compressed entry, one per ``compress_rate_hca``
tokens). ``mlp_layer_types[i]`` is ``hash_moe`` (experts chosen by a token-id table) or ``moe``.

Shared KV source (DeepSeek-V4.1 style, not in transformers 5.24): ``kv_source_layers[i]`` names the layer whose
compressed KV layer ``i`` reads (``i`` itself for an owner); ``kv_source_shares_topk[i]`` says whether it also
reuses that layer's top-k selection. See ``docs/deepseek_v4.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dhisparse.errors import ConfigError

MODEL_TYPE = "deepseek_v4"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
ROPE_TYPES = ("default", "linear", "yarn", "llama3")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class RopeView:
    """The fields ``dhisparse.model.layers.inverse_frequencies`` reads, for one of V4's two RoPE sets."""

    rope_parameters: dict[str, Any]
    qk_rope_head_dim: int
    max_position_embeddings: int

    @property
    def rope_type(self) -> str:
        return str(self.rope_parameters.get("rope_type", "default"))


@dataclass(frozen=True)
class DeepseekV4Config:
    """Architecture of a DeepSeek-V4 model (field names as in transformers' ``DeepseekV4Config``)."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    num_experts_per_tok: int
    n_routed_experts: int
    scoring_func: str
    routed_scaling_factor: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    compress_rate_csa: int
    compress_rate_hca: int
    rope_main: dict[str, Any]
    rope_compress: dict[str, Any]
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None
    kv_source_layers: tuple[int, ...] = ()
    kv_source_shares_topk: tuple[bool, ...] = ()
    model_type: str = MODEL_TYPE

    # ----------------------------------------------------------------------------------------------- derived
    @property
    def csa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == CSA)

    @property
    def hca_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == HCA)

    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed entry of ``layer`` (0 for a sliding-only layer)."""
        kind = self.layer_types[layer]
        return self.compress_rate_csa if kind == CSA else self.compress_rate_hca if kind == HCA else 0

    def source_of(self, layer: int) -> int:
        """The layer whose compressed KV ``layer`` reads (itself unless it reuses a shared source)."""
        return self.kv_source_layers[layer] if self.kv_source_layers else layer

    def reuses_topk(self, layer: int) -> bool:
        return bool(self.kv_source_shares_topk and self.kv_source_shares_topk[layer])

    def owns_compressor(self, layer: int) -> bool:
        return self.layer_types[layer] != SLIDING and self.source_of(layer) == layer

    def owns_indexer(self, layer: int) -> bool:
        return self.layer_types[layer] == CSA and not self.reuses_topk(layer)

    @property
    def rope_sets(self) -> dict[str, RopeView]:
        """``main`` (sliding-only layers) and ``compress`` (CSA/HCA layers, their compressors and indexers)."""
        return {name: RopeView(params, self.qk_rope_head_dim, self.max_position_embeddings)
                for name, params in (("main", self.rope_main), ("compress", self.rope_compress))}

    # ----------------------------------------------------------------------------------------------- parsing
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> DeepseekV4Config:
        """Parse and validate a ``config.json`` dict; raise ``ConfigError`` naming the field at fault."""
        if raw.get("model_type") != MODEL_TYPE:
            raise ConfigError(f"model_type must be {MODEL_TYPE!r}, got {raw.get('model_type')!r}")

        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise ConfigError(f"config.json of a deepseek_v4 model lacks the required field {key!r}")
            return raw[key]

        n = int(need("num_hidden_layers"))
        head_dim = int(need("head_dim"))
        rates = dict(raw.get("compress_rates") or {CSA: 4, HCA: 128})
        if raw.get("compress_rate_csa") is not None:
            rates[CSA] = raw["compress_rate_csa"]
        if raw.get("compress_rate_hca") is not None:
            rates[HCA] = raw["compress_rate_hca"]
        layer_types = raw.get("layer_types")
        if layer_types is None and raw.get("compress_ratios") is not None:
            try:
                layer_types = [_RATIO_TO_TYPE[int(r)] for r in raw["compress_ratios"]]
            except KeyError as exc:
                raise ConfigError(f"compress_ratios entries must be 0, 4 or 128, got {exc.args[0]}") from exc
        if layer_types is None:
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(raw.get("num_hash_layers", 3))
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        partial = raw.get("partial_rotary_factor")
        if partial is None:
            rope_dim = int(raw.get("qk_rope_head_dim", head_dim // 8))
        else:
            rope_dim = int(head_dim * float(partial))
        main, compress = _rope_sets(raw)
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),))
        sources = raw.get("kv_source_layers")
        shares = raw.get("kv_source_shares_topk")
        cfg = cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_hidden_layers=n,
            num_attention_heads=int(need("num_attention_heads")),
            head_dim=head_dim,
            q_lora_rank=int(need("q_lora_rank")),
            qk_rope_head_dim=rope_dim,
            num_experts_per_tok=int(need("num_experts_per_tok")),
            n_routed_experts=int(raw.get("n_routed_experts", raw.get("num_local_experts")) or need("n_routed_experts")),
            scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
            max_position_embeddings=int(need("max_position_embeddings")),
            layer_types=tuple(str(t) for t in layer_types[:n]),
            compress_rate_csa=int(rates.get(CSA, 4)),
            compress_rate_hca=int(rates.get(HCA, 128)),
            rope_main=main,
            rope_compress=compress,
            hc_mult=int(raw.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(raw.get("hc_eps", 1e-6)),
            mlp_layer_types=tuple(str(t) for t in mlp_types[:n]),
            swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
            sliding_window=int(raw.get("sliding_window", 128)),
            o_groups=int(raw.get("o_groups", 8)),
            o_lora_rank=int(raw.get("o_lora_rank", 1024)),
            index_n_heads=int(raw.get("index_n_heads", 64)),
            index_head_dim=int(raw.get("index_head_dim", 128)),
            index_topk=int(raw.get("index_topk", 512)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            hidden_act=str(raw.get("hidden_act", "silu")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
            pad_token_id=raw.get("pad_token_id"),
            kv_source_layers=tuple(int(s) for s in sources) if sources is not None else (),
            kv_source_shares_topk=tuple(bool(s) for s in shares) if shares is not None else (),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Check internal consistency; raise ``ConfigError`` naming the offending fields."""
        positive = (
            "vocab_size hidden_size moe_intermediate_size num_hidden_layers num_attention_heads head_dim "
            "q_lora_rank qk_rope_head_dim num_experts_per_tok n_routed_experts max_position_embeddings hc_mult "
            "hc_sinkhorn_iters sliding_window o_groups o_lora_rank index_n_heads index_head_dim index_topk "
            "compress_rate_csa compress_rate_hca"
        ).split()
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"config field {name} must be positive, got {getattr(self, name)}")
        n = self.num_hidden_layers
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES)):
            if len(types) != n:
                raise ConfigError(f"{name} has {len(types)} entries for num_hidden_layers={n}")
            bad = sorted(set(types) - set(allowed))
            if bad:
                raise ConfigError(f"{name} entries must be one of {allowed}, got {bad}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise ConfigError(f"qk_rope_head_dim ({self.qk_rope_head_dim}, = head_dim x partial_rotary_factor) "
                              f"must be even and at most head_dim ({self.head_dim})")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim "
                              f"({self.qk_rope_head_dim})")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError(f"o_groups ({self.o_groups}) must divide num_attention_heads x head_dim "
                              f"({self.num_attention_heads * self.head_dim})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                              f"({self.n_routed_experts})")
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func {self.scoring_func!r} is not supported; supported: {SCORING_FUNCS}")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        for name, params in (("rope_parameters.main", self.rope_main), ("rope_parameters.compress",
                                                                         self.rope_compress)):
            kind = params.get("rope_type", "default")
            if kind not in ROPE_TYPES:
                raise ConfigError(f"{name}.rope_type {kind!r} is not supported; supported: {ROPE_TYPES}")
            if kind != "default" and "factor" not in params:
                raise ConfigError(f"{name} of type {kind!r} needs a 'factor'")
        self._validate_sources()

    def _validate_sources(self) -> None:
        n = self.num_hidden_layers
        if self.kv_source_shares_topk and not self.kv_source_layers:
            raise ConfigError("kv_source_shares_topk needs kv_source_layers")
        if not self.kv_source_layers:
            return
        if len(self.kv_source_layers) != n:
            raise ConfigError(f"kv_source_layers has {len(self.kv_source_layers)} entries for num_hidden_layers={n}")
        if self.kv_source_shares_topk and len(self.kv_source_shares_topk) != n:
            raise ConfigError(f"kv_source_shares_topk has {len(self.kv_source_shares_topk)} entries for "
                              f"num_hidden_layers={n}")
        for i, src in enumerate(self.kv_source_layers):
            kind = self.layer_types[i]
            if src == i:
                if self.reuses_topk(i):
                    raise ConfigError(f"kv_source_shares_topk[{i}] is set but layer {i} is its own KV source")
                continue
            if not 0 <= src < i:
                raise ConfigError(f"kv_source_layers[{i}] = {src}: a layer reuses the compressed KV of an earlier "
                                  "layer (0 <= source < layer)")
            if kind == SLIDING or self.layer_types[src] != kind:
                raise ConfigError(f"kv_source_layers[{i}] = {src}: layer {i} ({kind}) and its source "
                                  f"({self.layer_types[src]}) must both be CSA or both be HCA")
            if self.kv_source_layers[src] != src:
                raise ConfigError(f"kv_source_layers[{i}] = {src}, but layer {src} itself reads layer "
                                  f"{self.kv_source_layers[src]}: name the owning layer")
            if self.reuses_topk(i) and kind != CSA:
                raise ConfigError(f"kv_source_shares_topk[{i}]: only CSA layers select a top-k")


def _rope_sets(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``main`` and ``compress`` RoPE parameter sets as transformers' ``DeepseekV4Config`` derives them."""
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return dict(rp["main"]), dict(rp["compress"])
    scaling = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    main = {"rope_type": "default", "rope_theta": float(raw.get("rope_theta", 10000.0))}
    compress = {**scaling, "rope_theta": float(raw.get("compress_rope_theta", 160000.0))}
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin by YaRN's mscale
    return main, compress

"""Model configuration for the two DSA families, parsed from a Hugging Face ``config.json``.

Field names follow transformers 5.24's ``DeepseekV32Config`` / ``GlmMoeDsaConfig`` so that a checkpoint's
``config.json`` maps onto this dataclass one to one. Derived values are properties.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dhisparse.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a DSA model (MLA attention + lightning indexer + dense/MoE MLP)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict[str, Any]
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None

    # ----------------------------------------------------------------------------------------------- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def row_dim(self) -> int:
        """Values in one latent KV row: normalised compressed KV followed by the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def rope_type(self) -> str:
        return str(self.rope_parameters.get("rope_type", "default"))

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """Layers that run their own indexer (every layer for deepseek_v32, the "full" ones for GLM)."""
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def index_groups(self) -> tuple[tuple[int, ...], ...]:
        """Each group: a layer with an indexer followed by the "shared" layers that reuse its top-k."""
        groups: list[list[int]] = []
        for i, t in enumerate(self.indexer_types):
            if t == "full":
                groups.append([i])
            else:
                groups[-1].append(i)
        return tuple(tuple(g) for g in groups)

    @property
    def selection_layer_of(self) -> tuple[int, ...]:
        """For each layer, the layer whose indexer selection it uses."""
        out = []
        for group in self.index_groups:
            out.extend([group[0]] * len(group))
        return tuple(out)

    @property
    def indexer_interleaved_rope(self) -> bool:
        """GLM's indexer uses interleaved RoPE; DeepSeek-V3.2's uses the half-split layout."""
        return self.model_type == "glm_moe_dsa"

    # ----------------------------------------------------------------------------------------------- parsing
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse and validate a transformers ``config.json`` dict; raise ``ConfigError`` naming the problem."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ConfigError(f"config.json of a {model_type} model lacks the required field {key!r}")
            return raw[key]

        n_layers = int(need("num_hidden_layers"))
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            n_dense = min(int(raw.get("first_k_dense_replace", 3)), n_layers)
            mlp_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
        indexer_types = raw.get("indexer_types")
        if indexer_types is None:
            pattern = raw.get("index_topk_pattern")
            if model_type == "glm_moe_dsa" and pattern is not None:
                indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern]
            else:
                indexer_types = ["full"] * n_layers
        eos = raw.get("eos_token_id")
        eos_ids = tuple() if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),))
        rope = dict(raw.get("rope_parameters") or {})
        if not rope and raw.get("rope_scaling"):
            rope = dict(raw["rope_scaling"])
            rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default") if "type" in rope else "default")
        rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
        n_routed = raw.get("n_routed_experts", raw.get("num_local_experts"))
        cfg = cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=int(need("num_attention_heads")),
            q_lora_rank=int(need("q_lora_rank")),
            kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            index_topk=int(need("index_topk")),
            index_head_dim=int(need("index_head_dim")),
            index_n_heads=int(need("index_n_heads")),
            n_routed_experts=int(n_routed if n_routed is not None else need("n_routed_experts")),
            n_shared_experts=int(raw.get("n_shared_experts", 1)),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            n_group=int(raw.get("n_group", 1)),
            topk_group=int(raw.get("topk_group", 1)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(need("max_position_embeddings")),
            rope_parameters=rope,
            mlp_layer_types=tuple(mlp_types),
            indexer_types=tuple(indexer_types),
            hidden_act=str(raw.get("hidden_act", "silu")),
            attention_bias=bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
            pad_token_id=raw.get("pad_token_id"),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Check internal consistency; raise ``ConfigError`` with the offending fields."""
        positive = (
            "vocab_size hidden_size num_hidden_layers num_attention_heads q_lora_rank kv_lora_rank "
            "qk_nope_head_dim qk_rope_head_dim v_head_dim index_topk index_head_dim index_n_heads "
            "max_position_embeddings num_experts_per_tok n_group topk_group"
        ).split()
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(
                f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim ({self.qk_rope_head_dim})"
            )
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"mlp_layer_types has {len(self.mlp_layer_types)} entries for {self.num_hidden_layers} layers"
            )
        if set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ConfigError(f"mlp_layer_types entries must be 'dense' or 'sparse': {self.mlp_layer_types}")
        if len(self.indexer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"indexer_types has {len(self.indexer_types)} entries for {self.num_hidden_layers} layers"
            )
        if set(self.indexer_types) - {"full", "shared"}:
            raise ConfigError(f"indexer_types entries must be 'full' or 'shared': {self.indexer_types}")
        if self.indexer_types[0] != "full":
            raise ConfigError("the first layer must run its own indexer (indexer_types[0] == 'full')")
        if self.model_type == "deepseek_v32" and "shared" in self.indexer_types:
            raise ConfigError("deepseek_v32 has an indexer in every layer; 'shared' layers are a GLM feature")
        if "sparse" in self.mlp_layer_types:
            if self.n_routed_experts <= 0 or self.moe_intermediate_size <= 0:
                raise ConfigError("MoE layers need n_routed_experts > 0 and moe_intermediate_size > 0")
            if self.n_routed_experts % self.n_group:
                raise ConfigError(f"n_routed_experts ({self.n_routed_experts}) must divide by n_group ({self.n_group})")
            if self.topk_group > self.n_group:
                raise ConfigError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ConfigError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                    f"({self.n_routed_experts})"
                )
            per_group = self.n_routed_experts // self.n_group
            if self.n_group > 1 and per_group < 2:
                raise ConfigError("grouped routing scores the top-2 experts of each group: need >= 2 experts per group")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope_type {self.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.rope_type in ("linear", "yarn", "llama3") and "factor" not in self.rope_parameters:
            raise ConfigError(f"rope_parameters of type {self.rope_type!r} need a 'factor'")

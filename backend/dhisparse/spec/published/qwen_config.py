"""The configuration of the Qwen3-backbone block drafters (DFlash, DFlash2, Qwen3 DSpark), read from their own
``config.json``: a Qwen3 config plus the drafter's fields, at the places each publisher puts them.

Where a field lives:

* DFlash (z-lab): ``block_size`` and ``num_target_layers`` at the top, ``dflash_config: {mask_token_id,
  target_layer_ids}``; without ``target_layer_ids`` the layers are spread evenly over the target (z-lab's rule:
  one draft layer reads the middle target layer, else ``round(1 + i (N - 4) / (L - 1))`` for ``i < L``).
* DFlash2 (vLLM PR #52816): as DFlash, plus ``dflash_config: {conv_kernel_size, conv_group_size,
  selector_rank, selector_top_k}`` and optionally ``output_multiplier``, ``final_logit_softcapping``,
  ``input_embedding_scale``; ``block_size`` may sit inside ``dflash_config``.
* DSpark (DeepSpec): ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``markov_rank``,
  ``markov_head_type`` (vanilla / gated / rnn), ``enable_confidence_head``, ``confidence_head_with_markov`` at
  the top.

Attention of draft layer ``i`` (vLLM's resolution, which the published DFlash2 checkpoints rely on): sliding with
window ``W`` when ``layer_types[i] == "sliding_attention"`` (or every layer when ``dflash_config.use_swa``;
``dflash_config.swa_window_size`` overrides ``sliding_window``); causal inside the block when ``is_causal``
(top level) or ``dflash_config.causal`` says so, else when the layer is sliding. A query at position ``p`` sees a
key at ``k`` iff ``k > p - W`` (sliding) and, inside the block, ``k <= p`` (causal). DSpark's layers are full and
non-causal (its block is one bidirectional query set).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dhisparse.errors import ConfigError

SLIDING = "sliding_attention"
MARKOV_HEADS = ("vanilla", "gated", "rnn")


def spread_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab DFlash's default target layers when ``dflash_config.target_layer_ids`` is absent."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = (num_target_layers - 3) - 1
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclass(frozen=True)
class QwenDrafterConfig:
    """A Qwen3-backbone block drafter. Sizes in elements; ``layer_windows[i]`` is ``None`` for a full layer."""

    fmt: str  # "dflash" | "dflash2" | "dspark"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    mask_token_id: int
    block_size: int
    layer_windows: tuple[int | None, ...]
    layer_causal: tuple[bool, ...]
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    markov_rank: int = 0
    markov_head_type: str | None = None
    confidence_head: bool = False
    confidence_with_markov: bool = False

    @property
    def max_gamma(self) -> int:
        """Drafts one proposal can carry: DFlash blocks hold the last token + mask slots; every DSpark slot drafts."""
        return self.block_size if self.fmt == "dspark" else self.block_size - 1

    @property
    def context_window(self) -> int | None:
        """Context positions a proposal can read (the draft ring's rows): ``None`` when a layer is full (the whole
        history), else ``W - 1`` for the widest sliding window (the block's first query sees ``p - W < k < p``)."""
        if any(w is None for w in self.layer_windows):
            return None
        return max(w for w in self.layer_windows if w is not None) - 1

    @property
    def kv_values(self) -> int:
        """Values of one context position in one draft layer: its K and V heads."""
        return 2 * self.num_kv_heads * self.head_dim


def _int(data: dict[str, Any], key: str, where: str, default: int | None = None, minimum: int = 1,
         prefix: str = "") -> int:
    value = data.get(key, default)
    if value is None:
        raise ConfigError(f"{where}: required field {prefix}{key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: field {prefix}{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(data: dict[str, Any], key: str, where: str, default: float, prefix: str = "") -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{where}: field {prefix}{key} must be a positive number, got {value!r}")
    return float(value)


def _rope_theta(data: dict[str, Any], where: str) -> float:
    params = data.get("rope_parameters") or {}
    scaling = data.get("rope_scaling")
    kind = params.get("rope_type", "default") if isinstance(params, dict) else None
    if kind != "default" or scaling not in (None, {}):
        raise ConfigError(f"{where}: rope_parameters/rope_scaling {params or scaling!r}: only the default RoPE "
                          "(rope_type 'default') is supported for drafters")
    theta = params.get("rope_theta", data.get("rope_theta", 1_000_000.0))
    return _float({"rope_theta": theta}, "rope_theta", where, 1_000_000.0)


def _layer_attention(data: dict[str, Any], sub: dict[str, Any], n: int, where: str
                     ) -> tuple[tuple[int | None, ...], tuple[bool, ...]]:
    types = data.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != n):
        raise ConfigError(f"{where}: layer_types must list one entry per draft layer ({n}), got {types!r}")
    bad = sorted({t for t in types or [] if t not in ("full_attention", SLIDING)})
    if bad:
        raise ConfigError(f"{where}: layer_types entries must be 'full_attention' or {SLIDING!r}, got {bad}")
    use_swa = bool(sub.get("use_swa", False))
    any_sliding = any(t == SLIDING for t in types or [])
    explicit = data.get("is_causal", sub.get("causal"))
    windows: list[int | None] = []
    causal: list[bool] = []
    for i in range(n):
        sliding = use_swa if types is None or (use_swa and not any_sliding) else types[i] == SLIDING
        window = None
        if sliding:
            window = sub.get("swa_window_size", data.get("sliding_window"))
            if isinstance(window, bool) or not isinstance(window, int) or window < 2:
                raise ConfigError(f"{where}: sliding layer {i} needs sliding_window (or dflash_config."
                                  f"swa_window_size) >= 2, got {window!r}")
        windows.append(window)
        causal.append(bool(explicit) if explicit is not None else sliding)
    return tuple(windows), tuple(causal)


def parse_qwen_drafter(data: dict[str, Any], fmt: str, where: str) -> QwenDrafterConfig:
    """Validate ``data`` (a DFlash / DFlash2 / DSpark ``config.json``); ``ConfigError`` names the field at fault."""
    if data.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {data.get('hidden_act')!r} is not supported (only 'silu')")
    sub = (data.get("dflash_config") or {}) if fmt != "dspark" else data
    if not isinstance(sub, dict):
        raise ConfigError(f"{where}: dflash_config must be a JSON object")
    sub_name = "dflash_config." if fmt != "dspark" else ""
    hidden = _int(data, "hidden_size", where)
    heads = _int(data, "num_attention_heads", where)
    n = _int(data, "num_hidden_layers", where)
    head_dim = _int(data, "head_dim", where, default=hidden // heads)
    kv_heads = _int(data, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise ConfigError(f"{where}: head_dim {head_dim} must be even for RoPE")
    num_target = data.get("num_target_layers")
    if num_target is not None:
        num_target = _int(data, "num_target_layers", where)
    ids = sub.get("target_layer_ids")
    if ids is None and fmt != "dspark" and num_target is not None:
        ids = list(spread_target_layers(num_target, n))
    if not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ConfigError(f"{where}: {sub_name}target_layer_ids must be a non-empty list of layer indices, "
                          f"got {ids!r}")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{where}: {sub_name}target_layer_ids has duplicates: {ids}")
    block = sub.get("block_size", data.get("block_size")) if fmt == "dflash2" else data.get("block_size")
    if fmt == "dflash2" and "block_size" in sub and "block_size" in data and sub["block_size"] != data["block_size"]:
        raise ConfigError(f"{where}: block_size {data['block_size']} and dflash_config.block_size "
                          f"{sub['block_size']} disagree")
    block = _int({"block_size": block}, "block_size", where, minimum=1 if fmt == "dspark" else 2)
    vocab = _int(data, "vocab_size", where)
    mask = _int(sub, "mask_token_id", where, minimum=0, prefix=sub_name)
    if mask >= vocab:
        raise ConfigError(f"{where}: {sub_name}mask_token_id {mask} is outside the vocabulary ({vocab})")
    windows, causal = _layer_attention(data, sub if fmt != "dspark" else {}, n, where)
    if fmt == "dspark":
        causal = (False,) * n  # the DSpark block is one bidirectional query set (is_causal=False, no mask)
    extra: dict[str, Any] = {}
    if fmt == "dflash2":
        d = "dflash_config."
        extra = dict(conv_kernel_size=_int(sub, "conv_kernel_size", where, prefix=d),
                     conv_group_size=_int(sub, "conv_group_size", where, prefix=d),
                     selector_rank=_int(sub, "selector_rank", where, prefix=d),
                     selector_top_k=_int(sub, "selector_top_k", where, prefix=d),
                     output_multiplier=_float(sub, "output_multiplier", where, 1.0, prefix=d),
                     input_embedding_scale=_float(sub, "input_embedding_scale", where, 1.0, prefix=d))
        cap = sub.get("final_logit_softcapping")
        extra["final_logit_softcapping"] = _float(sub, "final_logit_softcapping", where, 1.0, d) if cap else None
        if hidden % extra["conv_group_size"]:
            raise ConfigError(f"{where}: dflash_config.conv_group_size {extra['conv_group_size']} must divide "
                              f"hidden_size {hidden}")
        if extra["selector_top_k"] > vocab:
            raise ConfigError(f"{where}: dflash_config.selector_top_k exceeds the vocabulary ({vocab})")
    if fmt == "dspark":
        rank = _int(data, "markov_rank", where, minimum=0)
        kind = data.get("markov_head_type") if rank else None
        if rank and kind not in MARKOV_HEADS:
            raise ConfigError(f"{where}: markov_head_type must be one of {MARKOV_HEADS}, got {kind!r}")
        confidence = bool(data.get("enable_confidence_head", False))
        with_markov = confidence and bool(data.get("confidence_head_with_markov", False))
        if with_markov and not rank:
            raise ConfigError(f"{where}: confidence_head_with_markov needs markov_rank > 0")
        extra = dict(markov_rank=rank, markov_head_type=kind, confidence_head=confidence,
                     confidence_with_markov=with_markov)
    return QwenDrafterConfig(
        fmt=fmt, hidden_size=hidden, intermediate_size=_int(data, "intermediate_size", where), num_layers=n,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
        rms_norm_eps=_float(data, "rms_norm_eps", where, 1e-6), rope_theta=_rope_theta(data, where),
        attention_bias=bool(data.get("attention_bias", False)), target_layer_ids=tuple(ids),
        num_target_layers=num_target, mask_token_id=mask, block_size=block, layer_windows=windows,
        layer_causal=causal, **extra)

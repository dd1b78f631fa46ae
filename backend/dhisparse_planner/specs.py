"""Hardware and model descriptions for the planner, with presets whose sources are cited.

Every quantity carries its unit in its name (``_bytes``, ``_bytes_per_s``, ``_flops``, ``_s``). Presets
quote the public figure they come from; values that are *assumptions* (not published) say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dhisparse.kv.fp8 import fp8_key_bytes, fp8_row_bytes
from dhisparse.spec.published import DrafterFootprint, drafter_footprint, reference_config


def _positive(obj: object, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) > 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be > 0, got {getattr(obj, name)}")


@dataclass(frozen=True)
class HardwareSpec:
    """One decode GPU and its host link.

    Attributes:
        name: label.
        hbm_bytes: device memory (bytes).
        hbm_bytes_per_s: device memory bandwidth (bytes/s).
        host_link_bytes_per_s: *effective* host→device bandwidth for gathered KV rows (bytes/s).
        flops_per_s: dense tensor FLOP rate at the serving precision (FLOP/s).
        mfu: fraction of ``flops_per_s`` reached by decode/prefill kernels (0..1).
        step_overhead_s: fixed time per decode step: launches, collectives, sampling, scheduling (s).
        prefetch_efficiency: fraction of the host-fetch time that the index-group schedule *could* hide which a
            real implementation does hide (copies contend with attention for SMs and HBM); see overlap.py.
        host_bytes_per_gpu: host memory for the KV host store of one GPU rank (bytes; default: an 8-GPU H200
            server's 2 TiB over its 8 GPUs).
        source: where the figures come from.
    """

    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    host_link_bytes_per_s: float
    flops_per_s: float
    mfu: float = 0.4
    step_overhead_s: float = 0.012
    prefetch_efficiency: float = 0.93
    host_bytes_per_gpu: float = 2.0 * 2**40 / 8
    source: str = ""

    def __post_init__(self) -> None:
        _positive(self, "hbm_bytes", "hbm_bytes_per_s", "host_link_bytes_per_s", "flops_per_s", "mfu",
                  "host_bytes_per_gpu")
        if not 0.0 <= self.prefetch_efficiency <= 1.0:
            raise ValueError(f"HardwareSpec.prefetch_efficiency must be in [0, 1], got "
                             f"{self.prefetch_efficiency}")
        if self.step_overhead_s < 0 or self.mfu > 1.0:
            raise ValueError(f"HardwareSpec.step_overhead_s must be >= 0 and mfu <= 1, got "
                             f"{self.step_overhead_s}, {self.mfu}")


@dataclass(frozen=True)
class ModelSpec:
    """A DSA model as one GPU of its deployment sees it.

    Attributes:
        name: label.
        num_layers: decoder layers (one KV source each).
        index_group_size: layers per index group (1: every layer has its own indexer, DeepSeek-V3.2;
            4: GLM IndexShare, the first layer of each group computes the top-k, the others reuse it).
        index_topk: positions one query selects per layer.
        row_bytes: bytes of one KV row (one token, one layer) in the serving layout.
        index_key_bytes: bytes of one indexer key (one token, one indexer layer).
        attn_heads: query heads per GPU when attention is tensor-parallel over all ``gpus`` (MLA absorbed
            decode); with data-parallel attention a GPU holds ``attn_heads * gpus / attn_tp`` of them.
        attn_flops_per_head_row: FLOPs per head and selected row (score + value accumulation).
        index_heads: indexer heads; index_head_dim: their width (indexer FLOPs = 2*heads*dim per key).
        total_params / active_params: parameters (all / activated per token).
        dense_params: parameters every token reads (attention, dense layers, shared experts, embeddings).
        moe_layers, num_experts, experts_per_token: routed-expert structure.
        weight_bytes_per_param: weight precision (1.0 FP8, 0.5625 NVFP4 with scales).
        gpus: GPUs of one instance: MoE / dense layers split over all of them (EP/TP).
        attention_params: attention parameters of every layer (projections and indexers), part of
            ``dense_params``; they are replicated across data-parallel attention ranks.
        attention_dp: data-parallel attention ranks of the instance (1: attention tensor-parallel over all
            ``gpus``, every GPU holds the instance's whole KV, the MLA latent being replicated; ``gpus``: each GPU
            attends its own requests with its own KV pool). Each rank's KV pool serves ``1 / attention_dp`` of
            the instance's requests and its output is shared by its ``attn_tp = gpus / attention_dp`` GPUs.
        workspace_bytes: activations, CUDA graphs, communication buffers per GPU (assumption).
        source: where the figures come from.
    """

    name: str
    num_layers: int
    index_group_size: int
    index_topk: int
    row_bytes: int
    index_key_bytes: int
    attn_heads: int
    index_heads: int
    index_head_dim: int
    total_params: float
    active_params: float
    dense_params: float
    moe_layers: int
    num_experts: int
    experts_per_token: int
    weight_bytes_per_param: float = 1.0
    gpus: int = 8
    attention_params: float = 0.0
    attention_dp: int = 1
    workspace_bytes: float = 10e9
    attn_flops_per_head_row: float = 2.0 * (576 + 512)
    source: str = ""

    def __post_init__(self) -> None:
        _positive(self, "num_layers", "index_group_size", "index_topk", "row_bytes", "index_key_bytes",
                  "attn_heads", "index_heads", "index_head_dim", "total_params", "active_params",
                  "weight_bytes_per_param", "gpus", "num_experts", "experts_per_token")
        if self.index_group_size > self.num_layers or self.experts_per_token > self.num_experts:
            raise ValueError("index_group_size must be <= num_layers and experts_per_token <= num_experts")
        if self.dense_params > self.active_params or self.active_params > self.total_params:
            raise ValueError("need dense_params <= active_params <= total_params")
        if not 0 <= self.attention_params <= self.dense_params:
            raise ValueError(f"ModelSpec.attention_params must be in [0, dense_params], got {self.attention_params}")
        if self.attention_dp < 1 or self.gpus % self.attention_dp:
            raise ValueError(f"ModelSpec.attention_dp ({self.attention_dp}) must divide gpus ({self.gpus})")

    @property
    def num_indexers(self) -> int:
        """Layers that own an indexer (first layer of each index group)."""
        return -(-self.num_layers // self.index_group_size)

    @property
    def attn_tp(self) -> int:
        """GPUs one request's attention is split over (and that share one KV pool)."""
        return self.gpus // self.attention_dp

    @property
    def heads_per_gpu(self) -> float:
        return self.attn_heads * self.gpus / self.attn_tp

    @property
    def weight_bytes_per_gpu(self) -> float:
        """Attention weights split over ``attn_tp`` GPUs (replicated across attention ranks), the rest over all."""
        attn = self.attention_params / self.attn_tp
        rest = (self.total_params - self.attention_params) / self.gpus
        return (attn + rest) * self.weight_bytes_per_param

    @property
    def expert_params(self) -> float:
        """Parameters of one routed expert (from the total minus the dense part)."""
        return (self.total_params - self.dense_params) / (self.moe_layers * self.num_experts)

    def kv_pool_bytes(self, hw: HardwareSpec, extra_weight_bytes: float = 0.0) -> float:
        """Device KV budget per GPU: HBM minus weights, drafter weights and workspace (bytes)."""
        pool = hw.hbm_bytes - self.weight_bytes_per_gpu - extra_weight_bytes - self.workspace_bytes
        if pool <= 0:
            raise ValueError(f"{self.name} on {hw.name}: weights and workspace leave no KV pool ({pool:.3g} B)")
        return pool

    def resident_bytes_per_token(self) -> int:
        """Device bytes of one token of history under ``resident``: rows of all layers + indexer keys."""
        return self.num_layers * self.row_bytes + self.num_indexers * self.index_key_bytes

    def with_(self, **changes: object) -> ModelSpec:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class DrafterSpec:
    """A draft model as the time model sees it.

    Attributes:
        name: ``dflash2`` (block drafter, one forward per proposal) or ``dspark`` (parallel backbone with a
            confidence head that a busy scheduler uses to shorten verification).
        weight_bytes: drafter weights per GPU (bytes), read once per draft pass.
        pass_overhead_s: fixed time of one draft pass (s).
        flops_per_token: drafter FLOPs per proposed token.
        ring_bytes: the draft ring buffer of one request (bytes): the drafter's visible window of context rows;
            with verification staging it is the request's speculative state (required memory).
        max_draft_tokens: drafts one verification step can carry (the drafter's block; 0: not given).
        confidence_head: whether the drafter scores its own drafts (DSpark), so a busy scheduler can verify only
            the confident prefix (:meth:`dhisparse_planner.speculation.SpeculationModel.verify_lengths`).
        source: where the figures come from.
    """

    name: str
    weight_bytes: float
    pass_overhead_s: float = 0.002
    flops_per_token: float = 2 * 1.0e9
    extra: dict = field(default_factory=dict, compare=False)
    ring_bytes: float = 0.0
    confidence_head: bool = False
    max_draft_tokens: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        if self.name not in ("dflash2", "dspark"):
            raise ValueError(f"drafter name must be 'dflash2' or 'dspark', got {self.name!r}")
        if (self.weight_bytes < 0 or self.pass_overhead_s < 0 or self.flops_per_token < 0 or self.ring_bytes < 0
                or self.max_draft_tokens < 0):
            raise ValueError("drafter weight_bytes, pass_overhead_s, flops_per_token, ring_bytes and max_draft_tokens "
                             "must be >= 0")


def mla_moe_params(hidden: int, layers: int, heads: int, q_lora: int, kv_lora: int, qk_nope: int, qk_rope: int,
                   v_head: int, index_heads: int, index_head_dim: int, indexer_layers: int, dense_layers: int,
                   intermediate: int, moe_intermediate: int, shared_experts: int, vocab: int) -> dict[str, float]:
    """Parameter split of an MLA + DSA + MoE model from its config.json: ``attention`` (q/kv down and up
    projections, output projection, indexers), ``dense`` (what every token reads: attention, dense MLP layers,
    shared experts, the LM head; the embedding is a lookup) and ``expert`` (one routed expert)."""
    per_layer = (hidden * q_lora + q_lora * heads * (qk_nope + qk_rope) + hidden * (kv_lora + qk_rope)
                 + kv_lora * heads * (qk_nope + v_head) + heads * v_head * hidden)
    indexer = q_lora * index_heads * index_head_dim + hidden * index_head_dim + hidden * index_heads
    attention = layers * per_layer + indexer_layers * indexer
    expert = 3 * hidden * moe_intermediate
    dense = (attention + dense_layers * 3 * hidden * intermediate + (layers - dense_layers) * shared_experts * expert
             + vocab * hidden)
    return {"attention": float(attention), "dense": float(dense), "expert": float(expert)}


# GLM-5.3's config.json (hidden 6144, 78 layers, 64 heads, q_lora 2048, kv_lora 512, qk 192 + 64, v 256, indexer
# 32 x 128, 3 dense layers of 12288, MoE 2048 with 256 experts top-8 + 1 shared, vocab 154,880), as transcribed from
# HawkBearPig/GLM-5.3-Int4-Int8Mix-RTN-g64's config: it reproduces the card's 744B total / 40B active within 1%.
_GLM = dict(hidden=6144, layers=78, heads=64, q_lora=2048, kv_lora=512, qk_nope=192, qk_rope=64, v_head=256,
            index_heads=32, index_head_dim=128, dense_layers=3, intermediate=12288, moe_intermediate=2048,
            shared_experts=1, vocab=154880)
GLM5_PARAMS = mla_moe_params(indexer_layers=78, **_GLM)
GLM5_INDEXSHARE_PARAMS = mla_moe_params(indexer_layers=20, **_GLM)
# DeepSeek-V3.2-Exp's config.json (hidden 7168, 61 layers, 128 heads, q_lora 1536, kv_lora 512, qk 128 + 64, v 128,
# indexer 64 x 128 on every layer, 3 dense layers of 18432, MoE 2048 with 256 experts top-8 + 1 shared, vocab 129,280)
DSV32_PARAMS = mla_moe_params(hidden=7168, layers=61, heads=128, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64,
                              v_head=128, index_heads=64, index_head_dim=128, indexer_layers=61, dense_layers=3,
                              intermediate=18432, moe_intermediate=2048, shared_experts=1, vocab=129280)


H200 = HardwareSpec(
    name="H200",
    hbm_bytes=141e9,
    hbm_bytes_per_s=4.8e12,
    host_link_bytes_per_s=25e9,
    flops_per_s=1979e12,
    source=("NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e, 4.8 TB/s, FP8 1,979 TFLOPS dense (3,958 with "
            "sparsity); host link PCIe Gen5 x16 (64 GB/s per direction nominal). ASSUMED: 25 GB/s effective for "
            "scattered 656-byte row gathers, step overhead 12 ms (TP8 collectives + launches), mfu 0.4; prefetch "
            "efficiency 0.93 (sglang PR #29637). Host memory 2 TB per 8-GPU server (MLCommons inference v4.1, "
            "NVIDIA H200-SXM-141GBx8: host_memory_capacity 2 TB, 32x 64 GB): 256 GiB per GPU rank. Ranges and "
            "sources: dhisparse_planner.constants."),
)

RTX_PRO_6000 = HardwareSpec(
    name="RTX PRO 6000 Blackwell",
    hbm_bytes=96e9,
    hbm_bytes_per_s=1.792e12,
    host_link_bytes_per_s=20e9,
    flops_per_s=1000e12,
    source=("NVIDIA RTX PRO 6000 Blackwell Server Edition: 96 GB GDDR7, 1.792 TB/s, PCIe Gen5 x16. ASSUMED: "
            "~1 PFLOPS FP8 dense, 20 GB/s effective row-gather host bandwidth, 256 GiB host memory per GPU; step "
            "overhead is fitted (see docs/planner.md, HiSparse validation)."),
)

GLM5 = ModelSpec(
    name="GLM-5",
    num_layers=78,
    index_group_size=1,
    index_topk=2048,
    row_bytes=fp8_row_bytes(512, 64),  # FlashMLA's FP8 MLA row: 656 bytes (dhisparse.kv.fp8)
    index_key_bytes=fp8_key_bytes(128),  # DeepSeek-V3.2's FP8 indexer key: 132 bytes (dhisparse.kv.fp8)
    attn_heads=64 // 8,
    index_heads=32,
    index_head_dim=128,
    total_params=744e9,
    active_params=40e9,
    dense_params=GLM5_PARAMS["dense"],
    attention_params=GLM5_PARAMS["attention"],
    moe_layers=75,
    num_experts=256,
    experts_per_token=8,
    weight_bytes_per_param=1.0,
    gpus=8,
    source=("zai-org/GLM-5 model card: 744B total / 40B active parameters, 78 layers, DSA index_topk 2048, "
            "MLA kv_lora_rank 512 + rope 64, 256 routed experts top-8; sglang PR #31992: FP8 MLA row 656 "
            "bytes/layer/token and indexer key 132 bytes/layer/token (92,352 B/token for 78 layers at "
            "host_to_device_ratio 4). Dense (18.1B) and attention (13.6B) parameters from GLM-5.3's config.json "
            "(mla_moe_params). ASSUMED: 10 GB workspace."),
)

GLM5_INDEXSHARE_NVFP4 = GLM5.with_(
    name="GLM-5.x IndexShare NVFP4",
    index_group_size=4,
    dense_params=GLM5_INDEXSHARE_PARAMS["dense"],
    attention_params=GLM5_INDEXSHARE_PARAMS["attention"],
    weight_bytes_per_param=0.5625,
    source=(GLM5.source + " IndexShare (indexer on 1 of 4 layers): NVIDIA/cudnn-frontend issue #827 (GLM-5.2). "
            "ASSUMED NVFP4 weights (0.5 B/param + scales) for every layer; with these "
            "assumptions ~33 32K+8K histories fit one H200, matching the paper's 'fits up to C32'."),
)

DSV32 = ModelSpec(
    name="DeepSeek-V3.2",
    num_layers=61,
    index_group_size=1,
    index_topk=2048,
    row_bytes=fp8_row_bytes(512, 64),  # FlashMLA's FP8 MLA row: 656 bytes (dhisparse.kv.fp8)
    index_key_bytes=fp8_key_bytes(128),  # DeepSeek-V3.2's FP8 indexer key: 132 bytes (dhisparse.kv.fp8)
    attn_heads=128 // 8,
    index_heads=64,
    index_head_dim=128,
    total_params=671e9,
    active_params=37e9,
    dense_params=DSV32_PARAMS["dense"],
    attention_params=DSV32_PARAMS["attention"],
    moe_layers=58,
    num_experts=256,
    experts_per_token=8,
    weight_bytes_per_param=1.0,
    gpus=8,
    source=("deepseek-ai/DeepSeek-V3.2-Exp config/model card: 671B total / 37B active, 61 layers (3 dense), 128 "
            "heads, MLA 512+64, 256 routed experts top-8, indexer 64 heads x 128, index_topk 2048; FP8 row 656 "
            "B and indexer key 132 B as in sglang's DSA pool (PR #31992). Dense (16.9B) and attention (12.3B) "
            "parameters from its config.json (mla_moe_params)."),
)

# Drafter shapes from the published drafters' own config.json (dhisparse.spec.published.reference_configs, sources
# there): ring = the positions the drafter can see x its layers x its KV row, priced by the runtime's
# drafter_footprint (what the engine's ring holds, less its one discard row), and the block (drafts per verification
# step, which sizes the staging).
# DFlash2 for GLM-5.x: incoai/GLM-5.3-DFlash2, six sliding_attention layers of 8 KV heads x 128 (bf16 K and V) over
# sliding_window 2,048. Under vLLM's and transformers' window rule a query sees itself and the 2,047 positions before
# it; the block's first query is the last token (a block row), so the ring holds 2,047 context positions:
# 6 x 2,047 x 2 x 8 x 128 x 2 B = 50,307,072 B (48 MiB). Block 8: 7 drafts.
# DSpark for DeepSeek-V4: deepseek-ai/DeepSeek-V4-Flash-DSpark, three mtp stages, each a V4 attention layer over
# sliding_window 128 of one K=V latent row (head_dim 512, 64 RoPE). Served V4 keeps that window in FlashMLA's FP8 row
# (448 e4m3 + 64 bf16 + 8 scale bytes = 584 B, the row the V4 target preset prices too), so 3 x 128 x 584 B =
# 224,256 B; this runtime keeps the rows in the model dtype (3 x 128 x 512 x 2 B: docs/drafters.md). Block 5.
# Weights and pass costs below are not from the configs: 2.34 GB is incoai/GLM-5.3-*Flash*-DFlash2's file (the full
# GLM-5.3-DFlash2 above is 4.92 GB, not used here yet); the DSpark figures are assumptions.
_BF16 = 2
_DRAFTER_MAX_CONTEXT = 1 << 20  # bounds a full-attention drafter's ring; both drafters here are window-bounded
DFLASH2_FOOTPRINT = drafter_footprint(reference_config("glm-5.3-dflash2"), max_context=_DRAFTER_MAX_CONTEXT,
                                      bytes_per_value=_BF16)
DSPARK_FOOTPRINT = drafter_footprint(reference_config("deepseek-v4-flash-dspark"), max_context=_DRAFTER_MAX_CONTEXT,
                                     v4_fp8_rows=True)


def _window_rows(fp: DrafterFootprint) -> int:
    if fp.window_rows is None:
        raise ValueError(f"{fp.fmt} drafter has a full-attention layer: its ring is not window-bounded")
    return fp.window_rows


DFLASH2_LAYERS, DFLASH2_WINDOW = DFLASH2_FOOTPRINT.layers, _window_rows(DFLASH2_FOOTPRINT)  # window: ring positions
DFLASH2_KV_DIM = DFLASH2_FOOTPRINT.row_values // (2 * DFLASH2_LAYERS)  # K (or V) values of one layer and position
DFLASH2_RING_BYTES = DFLASH2_FOOTPRINT.ring_bytes
DSPARK_STAGES, DSPARK_WINDOW = DSPARK_FOOTPRINT.layers, _window_rows(DSPARK_FOOTPRINT)
DSPARK_ROW_BYTES = DSPARK_FOOTPRINT.row_bytes // DSPARK_STAGES
DSPARK_RING_BYTES = DSPARK_FOOTPRINT.ring_bytes
DRAFTERS = {
    "dflash2": DrafterSpec("dflash2", weight_bytes=2.34e9, pass_overhead_s=0.002, flops_per_token=2 * 1.17e9,
                           ring_bytes=DFLASH2_RING_BYTES, max_draft_tokens=DFLASH2_FOOTPRINT.max_gamma,
                           source=("DFlash2 shape from incoai/GLM-5.3-DFlash2's config: 6 sliding-window layers, "
                                   "window 2,048 (2,047 context positions), 8 KV heads x 128, bf16 (48 MiB ring), "
                                   "block 8; 2.34 GB of weights (incoai/GLM-5.3-Flash-DFlash2). ASSUMED: 2 ms per "
                                   "draft pass")),
    "dspark": DrafterSpec("dspark", weight_bytes=1.5e9, pass_overhead_s=0.0015, flops_per_token=2 * 0.75e9,
                          ring_bytes=DSPARK_RING_BYTES, max_draft_tokens=DSPARK_FOOTPRINT.max_gamma,
                          confidence_head=True,
                          source=("DSpark shape from deepseek-ai/DeepSeek-V4-Flash-DSpark's config: 3 stages over "
                                  "a 128-token window of 584-byte FP8 rows (219 KiB ring), block 5. ASSUMED: 1.5 GB "
                                  "of weights, 1.5 ms per draft pass")),
}

HARDWARE_PRESETS = {"h200": H200, "rtx-pro-6000": RTX_PRO_6000}
MODEL_PRESETS = {"glm5": GLM5, "glm5-indexshare-nvfp4": GLM5_INDEXSHARE_NVFP4, "dsv32": DSV32}

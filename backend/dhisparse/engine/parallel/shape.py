"""The parallel shape of one engine: how many ranks, what each splits, and which slice a rank holds.

- ``tensor_parallel_size`` (TP) ranks split the attention heads, the indexer heads, the vocabulary of the output
  head and every MLP (dense and MoE) across ranks; MLA's latent KV row is one row shared by all heads, so every rank
  computes, stores and resolves the *same* rows and makes the same residency decisions (checked every step).
- ``data_parallel_size`` (DP attention) ranks each own their requests, their KV hierarchy and a whole copy of the
  attention weights; the MLP layers (dense and MoE) still span all ranks: tokens are gathered from every rank, each
  rank applies its slice of the MLP, and each rank gets its own tokens' sums back.
- ``expert_parallel`` (EP): MoE experts are partitioned across all ranks instead of split in their intermediate
  dimension; under DP attention tokens go to their experts' ranks with all-to-all (and come back the same way), under
  TP every rank already holds every token and applies its own experts.

The world is ``tensor_parallel_size x data_parallel_size`` ranks; TP and DP are not combined (one of them is 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse.engine.config import EngineConfig
from dhisparse.errors import ConfigError
from dhisparse.model.config import ModelConfig
from dhisparse.model.deepseek_v4.config import DeepseekV4Config


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``total`` items are cut into ``parts`` contiguous parts whose sizes
    differ by at most one (the first ``total % parts`` parts hold one more)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class ParallelShape:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel: bool = False
    split_indexer: bool = True  # TP: the indexer's heads are split too (False: every rank runs the whole indexer)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tensor_parallel_size > 1 and self.data_parallel_size > 1:
            raise ConfigError("tensor_parallel_size and data_parallel_size cannot both be above 1")

    @classmethod
    def of(cls, cfg: EngineConfig) -> ParallelShape:
        return cls(cfg.tensor_parallel_size, cfg.data_parallel_size, cfg.expert_parallel, cfg.tp_split_indexer)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def data_parallel(self) -> bool:
        """Whether ranks hold different requests (DP attention), so MLP layers exchange tokens."""
        return self.data_parallel_size > 1

    @property
    def attention_split(self) -> int:
        """Ranks one layer's attention heads are split across (1 under DP attention: each rank holds them all)."""
        return self.tensor_parallel_size

    @property
    def indexer_split(self) -> int:
        """Ranks one layer's indexer heads are split across: the attention split, or 1 when the indexer is
        replicated (its scores then need no all-reduce: each rank computes them all)."""
        return self.attention_split if self.split_indexer else 1

    def indexer_slice(self, total: int, rank: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``total`` indexer heads."""
        return split_range(total, self.indexer_split, rank % self.indexer_split)

    def describe(self) -> str:
        parts = [f"TP {self.tensor_parallel_size}"] if self.tensor_parallel_size > 1 else []
        parts += [f"DP attention {self.data_parallel_size}"] if self.data_parallel else []
        parts += ["EP"] if self.expert_parallel else []
        return f"{self.world_size} ranks ({', '.join(parts) or 'one rank'})"

    def dp_rank(self, rank: int) -> int:
        """The data-parallel group (request owner) of ``rank``."""
        return rank // self.tensor_parallel_size

    def attention_slice(self, total: int, rank: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``total`` attention or indexer heads (all of them under DP)."""
        return split_range(total, self.attention_split, rank % self.attention_split)

    def mlp_slice(self, total: int, rank: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of an MLP's ``total`` intermediate channels (split over all ranks)."""
        return split_range(total, self.world_size, rank)

    def expert_slice(self, num_experts: int, rank: int) -> tuple[int, int]:
        """The experts ``[start, stop)`` ``rank`` owns under expert parallelism."""
        return split_range(num_experts, self.world_size, rank)

    def check_model(self, cfg: ModelConfig | DeepseekV4Config) -> None:
        """Raise :class:`ConfigError` naming the field when the model cannot be split this way."""
        tp, world = self.tensor_parallel_size, self.world_size
        if world == 1:
            return
        needs = [("num_attention_heads", cfg.num_attention_heads, tp), ("index_n_heads", cfg.index_n_heads,
                                                                         self.indexer_split)]
        if isinstance(cfg, DeepseekV4Config):
            needs.append(("o_groups", cfg.o_groups, tp))
            if cfg.num_attention_heads % cfg.o_groups:
                raise ConfigError(f"tensor parallelism splits deepseek_v4 attention by output group: num_attention_"
                                  f"heads ({cfg.num_attention_heads}) must be a multiple of o_groups ({cfg.o_groups})")
        for name, value, parts in needs:
            if value % parts:
                raise ConfigError(f"{name} ({value}) must be divisible by tensor_parallel_size ({parts})")
        mlp = [("moe_intermediate_size", cfg.moe_intermediate_size)]
        if isinstance(cfg, ModelConfig):
            mlp.append(("intermediate_size", cfg.intermediate_size))
        for name, value in mlp:
            if value < world:
                raise ConfigError(f"{name} ({value}) must be at least the number of ranks ({world}): every rank "
                                  "holds a slice of each MLP")
        if self.expert_parallel and cfg.n_routed_experts % world:
            raise ConfigError(f"expert_parallel: n_routed_experts ({cfg.n_routed_experts}) must be divisible by the "
                              f"number of ranks ({world})")

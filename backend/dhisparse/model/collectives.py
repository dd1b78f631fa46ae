"""What a model layer asks of the other ranks it is split across: the seam between the model and
``engine/parallel`` (which implements it over ``torch.distributed``).

One rank (the default, :data:`LOCAL`) makes every call the identity, and the DSA layers skip the calls when they
hold ``LOCAL`` (a single-process decode step pays nothing for the seam). Under tensor parallelism each rank holds a
slice of the attention heads, of the indexer heads and of the vocabulary (``engine/parallel/sharding.py``); the
layers produce *partial* results that these calls complete. Every implementation must return bit-identical tensors
on every rank of the group (the ranks then make identical top-k, sampling and KV residency decisions).
"""

from __future__ import annotations

import torch


class Collectives:
    """The single-rank implementation: nothing to combine."""

    def begin_forward(self, tokens: int) -> None:
        """Called once at the start of every forward of ``tokens`` query rows (data-parallel ranks pair up their
        forwards here)."""

    def attention_output(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum over the attention group of each rank's output projection of its own heads ``[..., hidden]``."""
        return partial

    def indexer_scores(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum over the attention group of each rank's indexer scores over its own indexer heads ``[B, q, keys]``."""
        return partial

    def vocab_logits(self, shard: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The full ``[..., vocab_size]`` logits from each rank's vocabulary shard ``[..., shard]`` (concatenated)."""
        return shard


LOCAL = Collectives()

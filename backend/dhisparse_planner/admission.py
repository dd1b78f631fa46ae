"""SGLang HiSparse's admission rule, for the HiSparse baseline (issue 28, point 5).

Our engine admits a request when its required device memory fits (``KVManager.try_admit``). SGLang's HiSparse, the
paper's comparator, admits by a *token budget* instead (``PrefillAdder`` over
``HiSparseTokenToKVPoolAllocator.scheduling_available_size``): a *logical* token pool of ``host_to_device_ratio``
times the device pool's tokens (the device pool sized as if fully resident, its indexer-key buffer
``host_to_device_ratio`` times larger: ``HiSparseNSATokenToKVPool(index_buf_size=size * host_to_device_ratio)``),
from which every running request holds its current length plus an estimate of what it will still write, and a new
request needs its prompt plus its (clipped) output budget::

    used    = sum(prompt + generated)                                       over running requests
    reserve = sum(min(max_new - generated, clip) * new_token_ratio)          over running requests
    admit   iff used + reserve + prompt + min(max_new, clip) <= logical tokens

Sources: sgl-project/sglang ``test_hisparse_capacity`` (admission uses ``scheduling_available_size``, the logical /
host capacity, not the hot buffer), ``hisparse_memory_pool.py`` (``_size_full = size * host_to_device_ratio``),
``schedule_policy.py`` (``CLIP_MAX_NEW_TOKENS`` 4096 by default; running requests reserve their remaining tokens
times ``new_token_ratio``), ``global_config`` (``new_token_ratio`` starts at 0.7 and decays to 0.7 x 0.14 = 0.098 while
decoding goes well). The host pool holds the same ``host_to_device_ratio`` x device tokens and must fit the host's
memory (SGLang refuses to start otherwise): :meth:`TokenBudget.logical_tokens` takes the smaller of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse_planner.specs import ModelSpec


@dataclass(frozen=True)
class TokenBudget:
    """SGLang HiSparse's admission (module docstring).

    Attributes:
        host_to_device_ratio: logical (and host) tokens per device token (the reference 8xH200 command: 8).
        new_token_ratio: share of a running request's remaining output reserved (SGLang's decayed floor 0.098).
        clip_max_new_tokens: output tokens counted at most per request (SGLang's default 4096).
    """

    host_to_device_ratio: float = 8.0
    new_token_ratio: float = 0.7 * 0.14
    clip_max_new_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.host_to_device_ratio < 1 or not 0.0 <= self.new_token_ratio <= 1.0 or self.clip_max_new_tokens < 1:
            raise ValueError("TokenBudget: need host_to_device_ratio >= 1, new_token_ratio in [0, 1] and "
                             f"clip_max_new_tokens >= 1, got {self.host_to_device_ratio}, {self.new_token_ratio}, "
                             f"{self.clip_max_new_tokens}")

    def device_tokens(self, model: ModelSpec, pool_bytes: float) -> float:
        """Tokens of the device pool as SGLang sizes it: every layer's row and the indexer keys of
        ``host_to_device_ratio`` tokens per token slot."""
        per_token = model.num_layers * model.row_bytes + self.host_to_device_ratio * model.num_indexers \
            * model.index_key_bytes
        return pool_bytes / per_token

    def logical_tokens(self, model: ModelSpec, pool_bytes: float, host_bytes: float = float("inf")) -> float:
        """The admission budget: ``host_to_device_ratio`` x device tokens, at most what the host pool can hold
        (``host_bytes`` of rows of every layer per token)."""
        host_tokens = host_bytes / (model.num_layers * model.row_bytes)
        return min(self.host_to_device_ratio * self.device_tokens(model, pool_bytes), host_tokens)

    def admits(self, running: list[tuple[int, int, int]], prompt: int, max_new: int, logical_tokens: float) -> bool:
        """Whether a request of ``prompt`` / ``max_new`` tokens is admitted while ``running`` holds
        ``(prompt, generated, max_new)`` per request (real tokens)."""
        used = sum(p + g for p, g, _ in running)
        reserve = sum(min(max(0, m - g), self.clip_max_new_tokens) for _, g, m in running) * self.new_token_ratio
        return used + reserve + prompt + min(max_new, self.clip_max_new_tokens) <= logical_tokens

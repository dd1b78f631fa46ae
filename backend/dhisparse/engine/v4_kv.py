"""KV manager for DeepSeek-V4 models: every request's V4 state (sliding-window rows, compressor pending state,
compressed entries and indexer keys) held whole on the device, no budget, no tiers — the ``dense`` policy.
The states of running requests are slots of one :class:`V4StatePool` (batched, updated in place).

Same manager interface as ``DenseKVManager`` / ``dhisparse.kv.KVManager``; ``import_prompt`` takes the state
``DeepseekV4Model.prefill`` returned (its ``rows``). The hierarchy's policies do not serve V4 yet.
"""

from __future__ import annotations

import torch

from dhisparse.model.deepseek_v4.config import DeepseekV4Config
from dhisparse.model.deepseek_v4.kv_state import V4RequestKV
from dhisparse.model.deepseek_v4.state_pool import V4PooledStepKV, V4StatePool


class V4DenseKVManager:
    """Unbounded reference manager for V4: admits everything, keeps each request's state."""

    policy = "dense"

    def __init__(self, cfg: DeepseekV4Config, device: torch.device, max_query_len: int = 1) -> None:
        self.cfg, self.device, self.max_query_len = cfg, device, max_query_len
        self.pool: V4StatePool | None = None  # created at the first import (the model's dtype)
        self.slots: dict[str, int] = {}
        self._step: tuple[list[str], V4PooledStepKV] | None = None

    def never_admissible(self, prompt_len: int, max_new_tokens: int) -> str | None:
        return None

    def try_admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> bool:
        return True

    def import_prompt(self, request_id: str, rows: V4RequestKV, index_keys: dict[int, torch.Tensor]) -> None:
        if not isinstance(rows, V4RequestKV):
            raise TypeError("a deepseek_v4 request imports the V4RequestKV its prefill produced")
        if self.pool is None:
            self.pool = V4StatePool(self.cfg, rows.window[0].dtype, self.device)
        self.slots[request_id] = self.pool.load(rows)

    def begin_step(self, request_ids: list[str], query_len: int) -> V4PooledStepKV:
        assert self.pool is not None
        step = V4PooledStepKV(self.pool, [self.slots[r] for r in request_ids], query_len, self.device)
        self._step = (list(request_ids), step)
        return step

    def end_step(self, accepted: dict[str, int]) -> None:
        assert self._step is not None
        request_ids, step = self._step
        step.commit([accepted.get(r, step.query_len) for r in request_ids])
        self._step = None

    def abort_step(self) -> None:
        """Drop the open step after a fault; the engine ends every request of it (their state is not restored)."""
        self._step = None

    def owners_of(self, ticket: object) -> list[str]:
        return []  # the dense store issues no copies

    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None and self.pool is not None:
            self.pool.release(slot)

    def poll(self) -> None:
        return None

    def stats(self) -> dict[str, float]:
        return {"kv_requests": float(len(self.slots))}

    def request_stats(self, request_id: str) -> dict[str, float]:
        slot = self.slots.get(request_id)
        if slot is None or self.pool is None:
            return {}
        return {f"kv_{k}_bytes": float(v) for k, v in self.pool.nbytes(slot).items()}

    def check_invariants(self) -> None:
        return None

"""Reference KV store: every request's full history in its own dense tensors, no budget, no tiers.

It implements :class:`~dhisparse.kv.store.KVStore` like the hierarchy (:class:`~dhisparse.kv.manager.KVManager`)
and is the obviously correct baseline the tests compare every policy against. It loops over the requests of a
batch (never over rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dhisparse.host_values import HostSync, to_device
from dhisparse.kv.copies import CopyError
from dhisparse.kv.policies import DENSE, KVPolicy
from dhisparse.kv.store import HostRowsTarget, KVMemory, PromptRows
from dhisparse.model.config import ModelConfig


class _Store:
    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows = torch.zeros(cfg.num_hidden_layers, capacity, cfg.row_dim, dtype=dtype, device=device)
        self.keys = {i: torch.zeros(capacity, cfg.index_head_dim, dtype=dtype, device=device)
                     for i in cfg.indexer_layers}
        self.length = 0


class DenseStepKV:
    """The :class:`~dhisparse.kv.store.KVStep` over the dense stores of a batch."""

    query_tiled_gather = False
    device_attention = False

    def __init__(self, stores: list[_Store], query_len: int, device: torch.device) -> None:
        self.stores, self.query_len = stores, query_len
        self.lengths = to_device([s.length + query_len for s in stores], torch.int64, device)
        self.max_length = max(s.length for s in stores) + query_len

    def write(self, layer: int, rows: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        for b, s in enumerate(self.stores):
            s.rows[layer, s.length:s.length + self.query_len] = rows[b]
            if index_keys is not None:
                s.keys[layer][s.length:s.length + self.query_len] = index_keys[b]

    def index_keys(self, layer: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.max_length if stop is None else stop
        out = []
        for s in self.stores:
            k = s.keys[layer][start:stop]
            if k.shape[0] < stop - start:
                k = torch.nn.functional.pad(k, (0, 0, 0, stop - start - k.shape[0]))
            out.append(k)
        keys = torch.stack(out)
        t = torch.arange(start, stop, device=keys.device)
        return keys.masked_fill((t.unsqueeze(0) >= self.lengths.unsqueeze(1)).unsqueeze(-1), 0)

    def report(self) -> torch.Tensor:
        """Nothing to check: an empty report (same interface as the hierarchy's ``StepKV``)."""
        return torch.zeros(0, dtype=torch.int64, device=self.lengths.device)

    def attend(self, layer: int, positions: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor,
               softmax_scale: float) -> None:
        return None  # the model attends over the gathered rows

    def gather(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        out = torch.stack([s.rows[layer][positions[b].clamp(min=0)] for b, s in enumerate(self.stores)])
        return out.masked_fill((positions < 0).unsqueeze(-1), 0)


class DenseKVStore:
    """Unbounded reference store: admits everything, stores everything densely."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_query_len: int = 1) -> None:
        self.cfg, self.dtype, self.device, self.max_query_len = cfg, dtype, device, max_query_len
        self.stores: dict[str, _Store] = {}
        self.sync = HostSync()
        self._step: tuple[list[str], int] | None = None

    @property
    def policy(self) -> KVPolicy:
        return DENSE

    def never_admissible(self, prompt_len: int, max_new_tokens: int) -> str | None:
        return None

    def try_admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> bool:
        capacity = prompt_len + max_new_tokens + self.max_query_len
        self.stores[request_id] = _Store(self.cfg, capacity, self.dtype, self.device)
        return True

    def prefill_kv(self, request_id: str, chunk_tokens: int) -> None:
        return None  # the prefill's local rows are imported whole

    def import_target(self, request_id: str) -> HostRowsTarget | None:
        return None  # no host store: the rows come with import_prompt

    def import_prompt(self, request_id: str, rows: PromptRows | None,
                      index_keys: Mapping[int, torch.Tensor] | None) -> None:
        if not isinstance(rows, torch.Tensor):
            raise TypeError("the dense store imports the prompt's rows [num_layers, T, row_dim]")
        s = self.stores[request_id]
        t = rows.shape[1]
        s.rows[:, :t] = rows
        for layer, k in (index_keys or {}).items():
            s.keys[layer][:t] = k
        s.length = t

    def begin_step(self, request_ids: Sequence[str], query_len: int) -> DenseStepKV:
        self._step = (list(request_ids), query_len)
        return DenseStepKV([self.stores[r] for r in request_ids], query_len, self.device)

    def end_step(self, accepted: Mapping[str, int], report: Sequence[int] | None = None) -> None:
        assert self._step is not None
        request_ids, query_len = self._step
        for r in request_ids:
            s = self.stores[r]
            keep = accepted.get(r, query_len)
            # Rows past the accepted ones are dead: zero them so no trace of rejected tokens stays behind.
            s.rows[:, s.length + keep:s.length + query_len] = 0
            for k in s.keys.values():
                k[s.length + keep:s.length + query_len] = 0
            s.length += keep
        self._step = None

    def abort_step(self) -> None:
        """Roll back the open step: every provisional row is dropped."""
        if self._step is not None:
            self.end_step(dict.fromkeys(self._step[0], 0))

    def owners_of(self, failure: CopyError) -> list[str]:
        return []  # the dense store issues no copies

    def release(self, request_id: str) -> None:
        self.stores.pop(request_id, None)

    def poll(self) -> None:
        return None

    def read(self, *tensors: torch.Tensor) -> list[list[int]]:
        return self.sync.read(*tensors)

    def memory(self) -> KVMemory:
        return KVMemory()  # no budget: nothing is reserved, lent or charged

    def corrupt_accounting(self) -> None:
        """No byte accounting to break (the drill's step still fails)."""

    def stats(self) -> dict[str, float]:
        return {"kv_requests": float(len(self.stores)), "kv_host_syncs": float(self.sync.reads)}

    def request_stats(self, request_id: str) -> dict[str, float]:
        return {}

    def check_invariants(self) -> None:
        return None

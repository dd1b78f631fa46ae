"""Workloads and serving configurations the planner simulates (real units: tokens, bytes, seconds)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhisparse import defaults
from dhisparse.kv.policies import KV_POLICIES, policy_named
from dhisparse_planner.admission import TokenBudget
from dhisparse_planner.locality import LocalityModel
from dhisparse_planner.speculation import SpeculationModel


@dataclass(frozen=True)
class WorkloadSpec:
    """Attributes:
        input_tokens / output_tokens: prompt length and output budget per request (real tokens).
        concurrency: closed loop: this many clients, each sending its next request when one finishes.
        num_requests: requests in the run (0: ``2 * concurrency``).
        concurrency_schedule: optional ``((start_s, clients), ...)`` load steps (closed loop).
        arrival_rate_per_s: open loop (Poisson) when ``concurrency == 0``.
        seed: RNG seed of arrivals, selections and acceptance.
    """

    input_tokens: int
    output_tokens: int
    concurrency: int = 8
    num_requests: int = 0
    concurrency_schedule: tuple[tuple[float, int], ...] = ()
    arrival_rate_per_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.input_tokens < 1 or self.output_tokens < 2:
            raise ValueError("input_tokens must be >= 1 and output_tokens >= 2")
        if self.concurrency < 0 or self.num_requests < 0 or self.arrival_rate_per_s < 0:
            raise ValueError("concurrency, num_requests and arrival_rate_per_s must be >= 0")
        if self.concurrency == 0 and (self.arrival_rate_per_s == 0 or self.num_requests == 0):
            raise ValueError("an open-loop workload (concurrency 0) needs arrival_rate_per_s and num_requests")
        for start, clients in self.concurrency_schedule:
            if start < 0 or clients < 0:
                raise ValueError("concurrency_schedule entries must be (start_s >= 0, clients >= 0)")

    @property
    def total_requests(self) -> int:
        return self.num_requests or 2 * self.concurrency

    def clients_at(self, t: float) -> int:
        """Closed-loop clients at time ``t`` (s)."""
        clients = self.concurrency
        for start, value in self.concurrency_schedule:
            if t >= start:
                clients = value
        return clients

    def poisson_arrivals(self) -> list[float]:
        gen = torch.Generator().manual_seed(self.seed + 7919)
        gaps = torch.empty(self.total_requests, dtype=torch.float64).exponential_(generator=gen)
        return torch.cumsum(gaps / self.arrival_rate_per_s, 0).tolist()


@dataclass(frozen=True)
class ServingSpec:
    """How the GPU serves: KV policy and budget knobs, batch limits, speculation (real units). Every default is
    the engine's (``dhisparse.defaults``); a scenario that models another setup names its values (``paper.py``).

    Attributes:
        policy: ``resident``, ``hisparse`` or ``adaptive``.
        hot_rows: ``B`` per request and layer (0: ``index_topk``, with or without speculation: the rows of a
            verification step that the hot cache cannot take go to verification staging).
        page_rows: rows per page.
        reserve_bytes: admission reserve.
        refill_pages_per_step: optional pages (one layer each) refilled per decode step.
        max_batch_size: most requests in a decode batch.
        max_prefill_tokens_per_step: the engine's prefill cap per step (tokens).
        speculation: acceptance/shortening model, or None.
        locality: the selection model.
        admission: an admission rule besides the KV manager's (None: the engine's own; a
            :class:`~dhisparse_planner.admission.TokenBudget` for SGLang's HiSparse baseline).
    """

    policy: str = defaults.KV_POLICY
    hot_rows: int = defaults.HOT_ROWS
    page_rows: int = defaults.PAGE_ROWS
    reserve_bytes: float = float(defaults.RESERVE_BYTES)
    refill_pages_per_step: int = defaults.REFILL_PAGES_PER_STEP
    max_batch_size: int = defaults.MAX_BATCH_SIZE
    max_prefill_tokens_per_step: int = defaults.MAX_PREFILL_TOKENS_PER_STEP
    speculation: SpeculationModel | None = None
    locality: LocalityModel = LocalityModel()
    admission: TokenBudget | None = None

    def __post_init__(self) -> None:
        policy_named(self.policy, "ServingSpec.policy", KV_POLICIES)  # ConfigError is a ValueError
        if self.hot_rows < 0 or self.page_rows < 1 or self.reserve_bytes < 0 or self.refill_pages_per_step < 0:
            raise ValueError("hot_rows >= 0, page_rows >= 1, reserve_bytes >= 0, refill_pages_per_step >= 0")
        if self.max_batch_size < 1 or self.max_prefill_tokens_per_step < 1:
            raise ValueError("max_batch_size and max_prefill_tokens_per_step must be >= 1")

    @property
    def max_query_len(self) -> int:
        return 1 if self.speculation is None else self.speculation.max_query_len

    def hot_rows_for(self, index_topk: int) -> int:
        """``B``: ``hot_rows``, or ``index_topk`` when 0 (independent of speculation)."""
        return self.hot_rows or index_topk

    @property
    def uses_host(self) -> bool:
        return policy_named(self.policy, "ServingSpec.policy", KV_POLICIES).uses_host

    @property
    def label(self) -> str:
        return self.policy + ("" if self.speculation is None else f"+{self.speculation.drafter}")

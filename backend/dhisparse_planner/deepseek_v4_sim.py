"""Entry-granular stepping of DeepSeek-V4 serving on one KV pool (one GPU, or one TP attention group).

A separate, small simulator for V4 (the DSA simulator, :mod:`dhisparse_planner.simulator`, steps a
token-granular ``KVManager``). What it keeps from the planner: the locality model
(:class:`~dhisparse_planner.locality.SyntheticSelector`), the speculation model
(:class:`~dhisparse_planner.speculation.SpeculationModel`), the hardware presets, and admission from the V4
manager's own footprint (:func:`dhisparse_planner.deepseek_v4.request_split`: ``request_footprint`` over the
layout ``V4HierarchyKVStore`` builds + ``tail_state_bytes``). The time of a step is
:func:`dhisparse_planner.deepseek_v4_time.v4_step_seconds`.

Model of a run (closed loop, ``clients`` requests issued at t = 0, one per client; prefill not modelled: the
prompts arrive prefilled, as from a disaggregated prefill tier, and a request's first token is stamped at its
admission):

1. Admission in order while ``pool - sum(required of running) >= required``. ``adaptive`` lends the rest of the
   pool to complete prompt pages (optional memory), page-major from the oldest page, in admission order; an
   admission that needs that memory reclaims whole requests' optional pages, fewest remaining tokens first
   (the manager's order). Freed memory is refilled at most ``refill_pages_per_step`` pages (one CSA layer each)
   per real step, in admission order, and the refilled bytes load the host link.
2. One decode / verification step over every running request: DSpark's verify length, positions from the
   locality model over *CSA entries* (one selectable row per ``compress_rate_csa`` tokens), one representative
   CSA layer standing for all of them (the same statistics per layer, as the DSA simulator's index groups).
   Each distinct selected entry of the step is ``direct`` (resident policy; an optional page on device; the
   tail: the page being written), ``hot`` (in the request's LRU hot cache of ``hot_rows`` entries per CSA
   layer, filled by host fetches and refreshed by hits) or ``host`` (fetched, then cached). With one token per
   entry this split agrees with the real ``KVManager``'s resolver in the DSA simulator (host share within 10%;
   ``tests/planner/test_deepseek_v4_time.py``).
3. Accepted lengths from the speculation model; finished requests release their memory.

Scale: one simulated row is ``entry_scale`` CSA entries and one simulated step stands for ``step_scale`` real
steps with the same selection shares and accepted lengths (the DSA simulator's token scale, on entries).
Fetched bytes per real step: distinct host rows x ``entry_scale`` x row bytes x CSA layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dhisparse.kv.policies import KV_POLICIES, KVPolicy, policy_named
from dhisparse.model.deepseek_v4.config import DeepseekV4Config
from dhisparse_planner.deepseek_v4 import FP8_INDEX_KEY_BYTES, FP8_ROW_BYTES, kv_pool_bytes, request_split
from dhisparse_planner.deepseek_v4_time import V4Costs, V4Deployment, V4StepLoad, v4_step_seconds
from dhisparse_planner.locality import CALIBRATED, LocalityModel, SyntheticSelector
from dhisparse_planner.specs import DRAFTERS, HardwareSpec
from dhisparse_planner.speculation import SpeculationModel

WAITING, RUNNING, DONE = 0, 1, 2
# complete pages counted as tail before the page being written (0: complete pages, prompt or decode, are
# host-backed unless optional; what the KVManager's hisparse gives, see the agreement test)
TAIL_COMPLETE_PAGES = 0


@dataclass(frozen=True)
class V4Serving:
    """``policy`` (resident / hisparse / adaptive), ``speculation`` (None: plain decode), ``hot_rows`` and
    ``page_rows`` in CSA entries, ``refill_pages_per_step`` (pages of one CSA layer), ``locality``."""

    policy: str
    speculation: SpeculationModel | None = None
    hot_rows: int = 4096
    page_rows: int = 64
    refill_pages_per_step: int = 64
    locality: LocalityModel = CALIBRATED

    def __post_init__(self) -> None:
        policy_named(self.policy, "V4Serving.policy", KV_POLICIES)  # ConfigError (a ValueError) naming the field

    @property
    def kv_policy(self) -> KVPolicy:
        """The policy object whose decisions the stepping follows (``dhisparse.kv.policies``)."""
        return policy_named(self.policy, "V4Serving.policy", KV_POLICIES)

    @property
    def label(self) -> str:
        return self.policy + ("" if self.speculation is None else "+" + self.speculation.drafter)


@dataclass(frozen=True)
class V4Scale:
    """``entry_scale``: CSA entries per simulated row (must divide page_rows, hot_rows and index_topk);
    ``step_scale``: real steps per simulated step."""

    entry_scale: int = 8
    step_scale: int = 32


class V4Sim:
    """One run on one KV pool (see the module docstring)."""

    def __init__(self, hw: HardwareSpec, cfg: DeepseekV4Config, dep: V4Deployment, serving: V4Serving,
                 clients: int, prompt_tokens: int, output_tokens: int, *, pool_bytes: float | None = None,
                 scale: V4Scale = V4Scale(), seed: int = 0, requests_per_client: int = 1) -> None:
        ge = scale.entry_scale
        for name, value in (("page_rows", serving.page_rows), ("hot_rows", serving.hot_rows),
                            ("index_topk", cfg.index_topk)):
            if value % ge:
                raise ValueError(f"V4Scale.entry_scale {ge} must divide {name} ({value})")
        if clients < 1 or output_tokens < 2:
            raise ValueError(f"clients must be >= 1 and output_tokens >= 2, got {clients}, {output_tokens}")
        spec = serving.speculation
        self.hw, self.cfg, self.dep, self.serving, self.scale = hw, cfg, dep, serving, scale
        self.policy = serving.kv_policy
        self.drafter = DRAFTERS[spec.drafter] if spec is not None else None
        self.costs = V4Costs.of(cfg, FP8_ROW_BYTES, FP8_INDEX_KEY_BYTES)
        self.pool = float(pool_bytes if pool_bytes is not None else kv_pool_bytes(hw, spec.drafter if spec else None))
        q_max = 1 if spec is None else spec.max_query_len
        self.split = request_split(cfg, serving.policy, prompt_tokens, output_tokens, hot_rows=serving.hot_rows,
                                   page_rows=serving.page_rows, pool_bytes=self.pool, max_query_len=q_max,
                                   draft_ring_bytes=int(self.drafter.ring_bytes) if self.drafter else 0)
        self.required = self.split["required_bytes"]
        # the host store of this pool's rank holds every host-backed request's CSA entries (prompt + output)
        self.host_need = self.split["all_csa_entries_bytes"] if self.policy.uses_host else 0.0
        self.host_bytes = hw.host_bytes_per_gpu
        self.host_waits = 0
        self.rate, self.n_csa = cfg.compress_rate_csa, len(cfg.csa_layers)
        self.prompt, self.output, self.n = prompt_tokens, output_tokens, clients
        entries = prompt_tokens // self.rate
        self.complete_entries = entries // serving.page_rows * serving.page_rows  # optional candidates / host
        self.page_bytes = serving.page_rows * FP8_ROW_BYTES  # one CSA layer's page
        rows = (prompt_tokens + output_tokens) // self.rate // ge + 3 + q_max  # + a zero sink column
        self.last_used = torch.zeros(clients if self.policy.hot_cache else 1, rows, dtype=torch.int32)
        self.selector = SyntheticSelector(serving.locality, cfg.index_topk // ge, 1, self.rate * ge, seed)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.ctx = torch.full((clients,), prompt_tokens, dtype=torch.int64)
        self.generated = torch.zeros(clients, dtype=torch.int64)
        self.status = torch.full((clients,), WAITING, dtype=torch.int64)
        self.optional_pages = torch.zeros(clients, dtype=torch.int64)  # per CSA layer, from the oldest page
        self.admit_order = torch.full((clients,), -1, dtype=torch.int64)
        self.first_s = torch.full((clients,), math.nan, dtype=torch.float64)
        self.finish_s = torch.full((clients,), math.nan, dtype=torch.float64)
        self.clock, self.stamp, self.admitted = 0.0, 0, 0
        if requests_per_client < 1:
            raise ValueError(f"requests_per_client must be >= 1, got {requests_per_client}")
        self.left = torch.full((clients,), requests_per_client - 1, dtype=torch.int64)  # requests still to send
        self.finished: list[tuple[float, float]] = []  # (first token, finish) of every finished request
        self.tokens: list[tuple[float, float]] = [(0.0, 0.0)]  # (clock, real output tokens so far)
        self.last_issue_s = 0.0
        self.rows = {"direct": 0.0, "hot": 0.0, "host": 0.0}
        self.steps: list[tuple[int, float, float]] = []  # (batch, real step s, real tokens per real step)
        self.fetch_s = self.refill_bytes = self.reclaimed_pages = 0.0

    # ------------------------------------------------------------------------------------------- memory
    def _optional_bytes(self) -> float:
        return float(self.optional_pages.sum()) * self.n_csa * self.page_bytes

    def _required_in_use(self) -> float:
        return float((self.status == RUNNING).sum()) * self.required

    def _admit(self) -> None:
        while bool((self.status == WAITING).any()):
            if self.pool - self._required_in_use() < self.required:
                return
            if self.host_need * (float((self.status == RUNNING).sum()) + 1) > self.host_bytes:
                self.host_waits += 1  # the host store is full: wait for a release (the manager's rule)
                return
            i = int(torch.nonzero(self.status == WAITING)[0])
            self._reclaim(self.pool - self._required_in_use() - self.required)
            self.status[i] = RUNNING
            self.admit_order[i] = self.admitted
            self.admitted += 1
            self.generated[i] = 1  # the prefill's token
            self.first_s[i] = self.clock
            candidates = self.policy.optional_prompt_pages(self.complete_entries, self.serving.page_rows)
            if candidates:  # resident-first admission: spare memory keeps complete prompt pages on device
                spare = self.pool - self._required_in_use() - self._optional_bytes()
                pages = int(spare // (self.n_csa * self.page_bytes))
                self.optional_pages[i] = max(0, min(pages, candidates))

    def _reclaim(self, allowed_optional: float) -> None:
        """Free whole requests' optional pages, fewest remaining tokens first (ties: latest admitted)."""
        while self._optional_bytes() > allowed_optional:
            holders = torch.nonzero((self.status == RUNNING) & (self.optional_pages > 0)).flatten()
            remaining = self.output - self.generated[holders]
            key = remaining * (self.n + 1) - self.admit_order[holders]
            victim = int(holders[int(torch.argmin(key))])
            self.reclaimed_pages += float(self.optional_pages[victim]) * self.n_csa
            self.optional_pages[victim] = 0

    def _refill(self) -> float:
        """Refill optional pages into spare memory; returns the bytes moved per real step."""
        if not self.policy.refills or bool((self.status == WAITING).any()):
            return 0.0
        budget = self.serving.refill_pages_per_step * self.scale.step_scale  # layer pages this simulated step
        spare_pages = int((self.pool - self._required_in_use() - self._optional_bytes()) // self.page_bytes)
        budget = min(budget, spare_pages)
        full = self.policy.optional_prompt_pages(self.complete_entries, self.serving.page_rows)
        moved = 0
        for i in torch.argsort(torch.where(self.status == RUNNING, self.admit_order, self.n + 1)).tolist():
            if budget < self.n_csa or self.status[i] != RUNNING:
                break
            take = min(full - int(self.optional_pages[i]), budget // self.n_csa)
            if take > 0:
                self.optional_pages[i] += take
                budget -= take * self.n_csa
                moved += take * self.n_csa
        return moved * self.page_bytes / self.scale.step_scale

    # ------------------------------------------------------------------------------------------- step
    def _classify(self, idx: torch.Tensor, sel: torch.Tensor) -> tuple[int, int, int]:
        """Direct / hot / host counts of the distinct selected simulated rows ``sel [B, N]`` (-1 padded) of
        requests ``idx``; updates the hot caches."""
        ge = self.scale.entry_scale
        s, _ = torch.sort(sel, dim=1)
        valid = s >= 0
        valid[:, 1:] &= s[:, 1:] != s[:, :-1]
        opt_rows = (self.optional_pages[idx] * self.serving.page_rows // ge).unsqueeze(1)
        page = self.serving.page_rows
        entries = torch.div(self.ctx[idx], self.rate, rounding_mode="floor")
        tail_rows = (torch.clamp(torch.div(entries, page, rounding_mode="floor") - TAIL_COMPLETE_PAGES, min=0)
                     * page // ge).unsqueeze(1)
        direct = valid & ((s < opt_rows) | (s >= tail_rows))
        cache = self.last_used[idx]
        cap = self.serving.hot_rows // ge
        thr = torch.topk(cache, min(cap, cache.shape[1]), dim=1).values[:, -1:].clamp(min=1)
        seen = cache.gather(1, s.clamp(min=0))
        miss_path = valid & ~direct
        hot = miss_path & (seen >= thr)
        host = miss_path & ~hot
        self.stamp += 1
        sink = torch.full_like(s, cache.shape[1] - 1)  # never selected, stays 0
        cache.scatter_(1, torch.where(miss_path, s, sink), torch.where(miss_path, self.stamp, 0).to(cache.dtype))
        self.last_used[idx] = cache
        return int(direct.sum()), int(hot.sum()), int(host.sum())

    def step(self) -> None:
        self._admit()
        idx = torch.nonzero(self.status == RUNNING).flatten()
        if len(idx) == 0:
            raise RuntimeError("V4 simulation stalled: requests wait but none fits the pool")
        refill = self._refill()
        spec, ge, g = self.serving.speculation, self.scale.entry_scale, self.scale.step_scale
        ctx = self.ctx[idx]
        b = len(idx)
        q = torch.ones(b, dtype=torch.int64) if spec is None else spec.verify_lengths(ctx, b)
        q_max = int(q.max())
        if not self.policy.uses_host:  # every entry on device: no selection needed for the time model
            picks = torch.clamp(ctx // (self.rate * ge), max=self.cfg.index_topk // ge)
            direct, hot, host = int((q * picks).sum()), 0, 0
        else:
            starts = torch.div(ctx, self.rate * ge, rounding_mode="floor") - 1
            sel = self.selector.select([str(i) for i in idx.tolist()], starts, q, q_max)[0]  # [B, Q, K]
            direct, hot, host = self._classify(idx, sel.reshape(b, -1))
        self.rows["direct"] += direct
        self.rows["hot"] += hot
        self.rows["host"] += host
        host_bytes = host * ge * FP8_ROW_BYTES * self.n_csa
        draft = 0 if spec is None else spec.gamma * b
        load = V4StepLoad(ctx, q, host_bytes=host_bytes, refill_bytes=refill, draft_tokens=draft)
        parts = v4_step_seconds(self.hw, self.costs, self.dep, load, self.drafter)
        accepted = torch.ones(b, dtype=torch.int64) if spec is None else spec.sample_accepted(q, ctx, self.gen)
        emitted = torch.minimum(accepted * g, self.output - self.generated[idx])
        self.clock += parts["total"] * g
        self.fetch_s += parts["fetch"] * g
        self.refill_bytes += refill * g
        self.generated[idx] += emitted
        self.ctx[idx] += emitted
        self.steps.append((b, parts["total"], float(emitted.sum()) / g))
        done = idx[self.generated[idx] >= self.output]
        self.status[done] = DONE
        self.finish_s[done] = self.clock
        self.optional_pages[done] = 0
        self.tokens.append((self.clock, self.tokens[-1][1] + float(emitted.sum())))
        for i in done.tolist():
            self.selector.forget(str(i))
            self.finished.append((float(self.first_s[i]), self.clock))
        if self.policy.hot_cache:
            self.last_used[done] = 0
        again = done[self.left[done] > 0]  # closed loop: the client sends its next request
        if len(again):
            self.left[again] -= 1
            self.status[again], self.ctx[again], self.generated[again] = WAITING, self.prompt, 0
            self.first_s[again] = math.nan
            self.last_issue_s = self.clock

    def run(self, max_steps: int = 1_000_000) -> dict[str, float]:
        """Run to completion; returns the summary (per GPU: the pool's output divided over ``attn_tp`` GPUs)."""
        if self.required > self.pool:
            raise ValueError(f"{self.serving.label}: one request needs {self.required / 2**30:.2f} GiB, the pool "
                             f"is {self.pool / 2**30:.2f} GiB")
        if self.host_need > self.host_bytes:
            raise ValueError(f"{self.serving.label}: one request needs {self.host_need / 2**30:.2f} GiB of host "
                             f"store, the rank has {self.host_bytes / 2**30:.2f} GiB")
        while bool((self.status != DONE).any()) and len(self.steps) < max_steps:
            self.step()
        tp = self.dep.attn_tp
        tpot = torch.tensor([(f - s) / (self.output - 1) for s, f in self.finished])
        peak = max(b for b, _, _ in self.steps)
        full = [(t, tok) for b, t, tok in self.steps if b == peak]
        sel = sum(self.rows.values())
        total = self.tokens[-1][1]
        steady = total / self.clock
        start = min(f for _, f in self.finished)
        if self.last_issue_s > start:  # several waves: the window from the first completion to the last issue
            at = dict(self.tokens)
            steady = (at[self.last_issue_s] - at[start]) / (self.last_issue_s - start)
        return {
            "output_tok_per_s_per_gpu": steady / tp,
            "run_output_tok_per_s_per_gpu": total / self.clock / tp,
            "full_batch_tok_per_s_per_gpu": sum(tok for _, tok in full) / sum(t for t, _ in full) / tp,
            "mean_tpot_s": float(tpot.mean()), "makespan_s": self.clock, "max_batch": float(peak),
            "required_gib": self.required / 2**30, "pool_gib": self.pool / 2**30,
            "host_share": self.rows["host"] / sel if sel else 0.0,
            "hot_share": self.rows["hot"] / sel if sel else 0.0,
            "direct_share": self.rows["direct"] / sel if sel else 0.0,
            "mean_step_s": sum(t for _, t, _ in self.steps) / len(self.steps),
            "sim_steps": float(len(self.steps)), "reclaimed_pages": self.reclaimed_pages,
            "fetch_s": self.fetch_s, "host_waits": float(self.host_waits),
        }


def simulate_v4(hw: HardwareSpec, cfg: DeepseekV4Config, dep: V4Deployment, serving: V4Serving, clients: int,
                prompt_tokens: int, output_tokens: int, **kwargs: object) -> dict[str, float]:
    """Build a :class:`V4Sim` and run it (keyword arguments: ``pool_bytes``, ``scale``, ``seed``)."""
    return V4Sim(hw, cfg, dep, serving, clients, prompt_tokens, output_tokens, **kwargs).run()  # type: ignore[arg-type]


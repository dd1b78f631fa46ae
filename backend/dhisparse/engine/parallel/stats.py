"""Engine statistics of a multi-rank engine, from each rank's own ``LLMEngine.stats()``.

Under tensor parallelism every rank holds every request and the same KV rows, so the engine's figures are rank 0's
(the others are equal: their decisions are checked each step), and device figures are also given per rank. Under
data-parallel attention each rank holds its own requests and KV: counters, byte gauges and request counts add up
over ranks, ratios are recomputed from the sums, per-request figures are the largest rank's. Per-rank figures that
matter for capacity, and each rank's communication volume (``comm_*``), are kept as ``rank{r}_<name>``; the
engine's ``comm_*`` figures are the sums over ranks (bytes every rank contributed).
"""

from __future__ import annotations

from collections.abc import Sequence

from dhisparse.engine.parallel.shape import ParallelShape

PER_RANK = ("process_id", "kv_pool_bytes", "kv_required_bytes", "kv_optional_bytes", "kv_spare_bytes",
            "kv_host_pages_used", "requests_running", "requests_waiting", "workspace_bound_bytes",
            "transfers", "transfer_bytes", "transfers_failed")  # a generation engine's READs: each rank its own
RANK_ONLY = ("process_id",)  # a rank's own figures, never summed into the engine's
LARGEST = ("spec_ring_bytes_per_request", "spec_staging_bytes_per_request", "engine_dead")


def aggregate(shape: ParallelShape, per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """The engine's statistics from each rank's (module docstring)."""
    if not shape.data_parallel:
        out = {name: value for name, value in per_rank[0].items()
               if not name.startswith("comm_") and name not in RANK_ONLY}
    else:
        out = {}
        for stats in per_rank:
            for name, value in stats.items():
                if name in RANK_ONLY:
                    continue
                if name in LARGEST:
                    out[name] = max(out.get(name, value), value)
                else:
                    out[name] = out.get(name, 0.0) + value
        proposed, accepted = out.get("draft_tokens_proposed", 0.0), out.get("draft_tokens_accepted", 0.0)
        if "draft_acceptance_rate" in out:
            out["draft_acceptance_rate"] = accepted / proposed if proposed else 0.0
        if "tokens_per_verify_step" in out:
            rows = out.get("verify_rows", 0.0)
            out["tokens_per_verify_step"] = (accepted + rows) / rows if rows else 0.0
    for rank, stats in enumerate(per_rank):
        for name, value in stats.items():
            if name in PER_RANK or name.startswith("comm_"):
                out[f"rank{rank}_{name}"] = value
            if name.startswith("comm_") and not shape.data_parallel:  # every rank's traffic, summed
                out[name] = out.get(name, 0.0) + value
    out["parallel_world_size"] = float(shape.world_size)
    out["parallel_tensor_parallel_size"] = float(shape.tensor_parallel_size)
    out["parallel_data_parallel_size"] = float(shape.data_parallel_size)
    out["parallel_expert_parallel"] = float(shape.expert_parallel)
    out["parallel_device_pool_bytes"] = float(sum(s.get("kv_pool_bytes", 0.0) for s in per_rank))
    return out

"""Names of the KV statistics (documented with units in docs/kv.md)."""

from __future__ import annotations

from dhisparse.kv.request_state import OPT_BACKING_UP, OPT_READY, RequestKV

# Cumulative engine-wide counters kept by the manager (stats() adds the gauges below).
ENGINE_COUNTERS = (
    "steps",  # end_step calls
    "steps_aborted",  # abort_step calls (a fault in the step's forward rolled it back)
    "rows_direct",  # distinct selected rows resolved at step 1 (tail or ready optional page)
    "rows_hot",  # ... at step 2 (hot cache hit)
    "rows_host",  # ... at step 3 (copied from host) == host-fetched rows
    "rows_staged",  # ... of which copied into verification staging (the hot cache could not take them)
    "resolved_rows",  # rows_direct + rows_hot + rows_host
    "host_fetched_rows",  # == rows_host
    "host_fetched_bytes",  # rows_host * row bytes
    "resolver_calls",  # resolve() calls (one per step, source and distinct positions tensor)
    "admissions",  # requests admitted
    "staging_bytes_charged",  # verification staging bytes charged at admission, summed over admissions
    "admissions_waited",  # admitted after at least one try_admit returned False
    "admission_wait_seconds",  # total wall time those admissions waited
    "admission_wait_steps",  # total decode steps those admissions waited
    "reclaim_events",  # requests whose optional pages were reclaimed (one event per request)
    "optional_pages_reclaimed",  # optional pages taken by reclaims
    "optional_pages_refill_issued",  # refill copies issued
    "optional_pages_refilled",  # refill copies completed (pages made visible)
    "tail_pages_backed_up",  # tail pages (per source) whose host backup was issued
    "releases",  # release() of admitted requests
    "batch_slots_moved",  # requests moved to other batch-state slots so a step's slots are consecutive
)

# Cumulative per-request counters.
REQUEST_COUNTERS = (
    "rows_direct",
    "rows_hot",
    "rows_host",
    "rows_staged",
    "resolved_rows",
    "host_fetched_rows",
    "host_fetched_bytes",
    "optional_pages_reclaimed",
    "optional_pages_refilled",
    "admission_wait_seconds",
)


def request_gauges(req: RequestKV) -> dict[str, float]:
    """Current values for one request: length, memory in use and resident optional pages."""
    page_bytes = req.footprint.page_bytes
    resident = int(((req.opt_state == OPT_READY) | (req.opt_state == OPT_BACKING_UP)).sum())
    return {
        "length": float(req.length),
        "required_bytes": float(req.footprint.required_bytes),
        "speculative_bytes": float(req.footprint.speculative_bytes),  # ring + staging (0 without a drafter)
        "ring_bytes": float(req.footprint.ring_bytes),
        "staging_bytes": float(req.footprint.staging_bytes),
        "optional_pages_resident": float(resident),
        "optional_pages_on_device": float(req.optional_pages_on_device()),
        "optional_bytes": float(req.optional_pages_on_device() * page_bytes),
    }

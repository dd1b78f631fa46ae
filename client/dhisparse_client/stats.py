"""A readable summary of a server's residency and speculation statistics (from `DHiSparseClient.metrics`).

Counters are cumulative since the server started (names as in docs/kv.md and `LLMEngine.stats`, without the
`dhisparse_` metric prefix). Sections whose statistics the server does not report (e.g. speculation when
it is off, the KV hierarchy under the `dense` policy) are left out.
"""

from __future__ import annotations

from collections.abc import Mapping


def _share(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def summarize(metrics: Mapping[str, float]) -> str:
    """Multi-line text: resolver step shares, host fetches, optional pages, admission waits, drafts."""
    m = metrics
    lines = []
    if "kv_resolved_rows" in m:
        total = m["kv_resolved_rows"]
        direct, hot, host = m.get("kv_rows_direct", 0.0), m.get("kv_rows_hot", 0.0), m.get("kv_rows_host", 0.0)
        lines += [
            "residency (KV hierarchy, since the server started):",
            f"  selected rows resolved: {total:.0f}  (resolver step 1 direct: {_share(direct, total)}, "
            f"step 2 hot cache: {_share(hot, total)}, step 3 host fetch: {_share(host, total)})",
            f"  host-fetched rows: {m.get('kv_host_fetched_rows', 0.0):.0f} "
            f"({m.get('kv_host_fetched_bytes', 0.0) / 2**20:.2f} MiB)",
            f"  optional pages: {m.get('kv_optional_pages_resident', 0.0):.0f} resident now, "
            f"{m.get('kv_optional_pages_reclaimed', 0.0):.0f} reclaimed in {m.get('kv_reclaim_events', 0.0):.0f} "
            f"reclaim event(s), {m.get('kv_optional_pages_refilled', 0.0):.0f} refilled",
            f"  admissions: {m.get('kv_admissions', 0.0):.0f}, of which waited for memory: "
            f"{m.get('kv_admissions_waited', 0.0):.0f}; requests waiting now: {m.get('requests_waiting', 0.0):.0f}",
            f"  device pool: {m.get('kv_pool_bytes', 0.0) / 2**20:.2f} MiB "
            f"(required now {m.get('kv_required_bytes', 0.0) / 2**20:.2f} MiB, "
            f"optional now {m.get('kv_optional_bytes', 0.0) / 2**20:.2f} MiB)",
        ]
    if m.get("draft_tokens_proposed"):
        lines += [
            "speculation (since the server started):",
            f"  draft tokens proposed: {m['draft_tokens_proposed']:.0f}, accepted: "
            f"{m.get('draft_tokens_accepted', 0.0):.0f} (acceptance {m.get('draft_acceptance_rate', 0.0):.3f})",
            f"  tokens per verification step: {m.get('tokens_per_verify_step', 0.0):.2f} "
            f"over {m.get('verify_rows', 0.0):.0f} request-steps",
        ]
    if "generated_tokens" in m:
        lines.append(f"requests finished: {m.get('requests_finished', 0.0):.0f}, aborted: "
                     f"{m.get('requests_aborted', 0.0):.0f}; tokens generated: {m['generated_tokens']:.0f}")
    return "\n".join(lines)

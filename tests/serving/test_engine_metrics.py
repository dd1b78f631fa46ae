"""Derived metrics computed from engine statistics snapshots (no server)."""

from __future__ import annotations

import pytest

from dhisparse.serving.engine_metrics import RATIOS, interval_ratios, metric_name


def test_interval_ratios_use_the_increments_of_the_real_stat_names():
    previous = {"kv_rows_direct": 10.0, "kv_rows_hot": 5.0, "kv_rows_host": 5.0, "kv_resolved_rows": 20.0,
                "kv_resolver_calls": 2.0, "draft_tokens_proposed": 8.0, "draft_tokens_accepted": 4.0,
                "verify_rows": 2.0, "kv_prefix_reused_tokens": 10.0, "kv_prefix_lookup_tokens": 20.0}
    current = {"kv_rows_direct": 16.0, "kv_rows_hot": 7.0, "kv_rows_host": 7.0, "kv_resolved_rows": 30.0,
               "kv_resolver_calls": 4.0, "draft_tokens_proposed": 16.0, "draft_tokens_accepted": 10.0,
               "verify_rows": 4.0, "kv_prefix_reused_tokens": 40.0, "kv_prefix_lookup_tokens": 60.0}
    ratios = interval_ratios(previous, current)
    assert ratios == pytest.approx({
        "kv_rows_direct_share": 0.6, "kv_rows_hot_share": 0.2, "kv_rows_host_share": 0.2,
        "resolved_rows_per_resolver_call": 5.0, "draft_acceptance_rate_interval": 0.75,
        "tokens_per_verify_step_interval": 4.0, "kv_prefix_hit_rate_interval": 0.75,
    })
    assert interval_ratios(current, current) == {}  # nothing happened: no ratio, not a division by zero
    assert set(ratios) == set(RATIOS)


def test_metric_names_are_prometheus_safe():
    assert metric_name("kv_rows_host") == "dhisparse_kv_rows_host"
    assert metric_name("a.b-c") == "dhisparse_a_b_c"


def test_client_summary_names_every_tier_and_the_drafts():
    from dhisparse_client.stats import summarize

    metrics = {"kv_resolved_rows": 200.0, "kv_rows_direct": 150.0, "kv_rows_hot": 40.0, "kv_rows_host": 10.0,
               "kv_host_fetched_rows": 10.0, "kv_host_fetched_bytes": 2**20, "kv_optional_pages_resident": 3.0,
               "kv_reclaim_events": 1.0, "draft_tokens_proposed": 8.0, "draft_tokens_accepted": 6.0,
               "draft_acceptance_rate": 0.75, "tokens_per_verify_step": 4.0, "verify_rows": 2.0,
               "generated_tokens": 8.0}
    text = summarize(metrics)
    assert "step 1 direct: 75.0%" in text and "step 2 hot cache: 20.0%" in text and "host fetch: 5.0%" in text
    assert "host-fetched rows: 10 (1.00 MiB)" in text and "3 resident now" in text
    assert "acceptance 0.750" in text and "tokens per verification step: 4.00" in text
    assert "speculation" not in summarize({k: v for k, v in metrics.items() if not k.startswith(("draft", "verify"))})

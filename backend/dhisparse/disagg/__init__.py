"""Prefill/decode disaggregation: a context engine computes a prompt's history, a generation engine imports it
over NIXL (``docs/disaggregated.md``)."""

"""Compatibility alias: sampling moved to ``dhisparse.sampling`` (shared by the engine and the verifier)."""

from __future__ import annotations

from dhisparse.sampling import SamplingParams, filtered_probs, sample, sample_from, seed_to_int64, uniform

__all__ = ["SamplingParams", "filtered_probs", "sample", "sample_from", "seed_to_int64", "uniform"]

"""Sampling shared by the engine and the speculative verifier: parameters, logit processing, the batched sampler.

Below both ``dhisparse.engine`` and ``dhisparse.spec`` (neither imports the other through it).
"""

from __future__ import annotations

from dhisparse.sampling.params import SamplingParams
from dhisparse.sampling.processing import LogitsProcessor, add_counts, initial_counts
from dhisparse.sampling.sampler import filtered_probs, sample, sample_from, seed_to_int64, token_log_probs, uniform

__all__ = [
    "LogitsProcessor", "SamplingParams", "add_counts", "filtered_probs", "initial_counts", "sample", "sample_from",
    "seed_to_int64", "token_log_probs", "uniform",
]

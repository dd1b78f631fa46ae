"""Adaptive DHiSparse: a serving backend for long-context DSA models over a load-adaptive GPU/host KV hierarchy."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):  # lazy, so that importing a submodule does not build the engine stack
    if name == "LLM":
        from dhisparse.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dhisparse.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)

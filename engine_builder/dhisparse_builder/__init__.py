"""``dhisparse-build``: validate a Hugging Face DSA checkpoint and convert it into an engine directory."""

from __future__ import annotations

from dhisparse_builder.build import BuildOptions, build_engine

__all__ = ["BuildOptions", "build_engine"]

"""Deterministic fault injection: raise at the n-th time the engine reaches a named site.

Operators use it to drill failure handling on a live server (``--engine-option fault_injection=SPEC``); the
fault tests use it to show that a failed step costs only the requests in it. ``SPEC`` is a comma-separated
list of ``site@n`` (the n-th hit of ``site``, counting from 1, since the engine started) or ``site@n+`` (every
hit from the n-th on). Sites:

| site                | where the fault is raised                                                    |
| ------------------- | ---------------------------------------------------------------------------- |
| ``prefill_chunk``   | before each chunk of a prompt's prefill forward                              |
| ``decode_forward``  | inside a plain decode forward, at the gather of the middle layer             |
| ``verify_forward``  | inside a speculative verification forward, at the gather of the middle layer |
| ``draft_propose``   | in the drafter's proposal, before it runs                                    |
| ``copy.<kind>``     | when a KV copy of that kind completes (``fetch`` = host→device rows of a     |
|                     | step; ``import``, ``tail_backup``, ``reclaim_backup``, ``refill``)           |
| ``break_invariants``| at the start of a decode step: corrupts the KV pool's byte accounting, then  |
|                     | raises, so the engine cannot restore its invariants (tests the dead path)    |
"""

from __future__ import annotations

import collections
from typing import Any

from dhisparse.errors import ConfigError

SITES = ("prefill_chunk", "decode_forward", "verify_forward", "draft_propose", "break_invariants",
         "copy.fetch", "copy.import", "copy.tail_backup", "copy.reclaim_backup", "copy.refill")


class InjectedFault(RuntimeError):
    """The fault a :class:`FaultInjector` raises."""


class FaultInjector:
    """Counts hits per site and raises :class:`InjectedFault` where the spec says so (no spec: never)."""

    def __init__(self, spec: str = "") -> None:
        self.rules: dict[str, tuple[int, bool]] = {}
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            site, sep, when = part.partition("@")
            if site not in SITES or not sep:
                raise ConfigError(f"fault_injection: {part!r} is not SITE@N; sites: {', '.join(SITES)}")
            onwards = when.endswith("+")
            try:
                n = int(when.removesuffix("+"))
            except ValueError:
                raise ConfigError(f"fault_injection: {part!r}: N must be a whole number") from None
            if n < 1:
                raise ConfigError(f"fault_injection: {part!r}: N counts from 1")
            self.rules[site] = (n, onwards)
        self.enabled = bool(self.rules)  # no spec: the engine skips every hook
        self.hits: collections.Counter[str] = collections.Counter()
        self.raised: collections.Counter[str] = collections.Counter()

    def fires(self, site: str) -> bool:
        """Count a hit of ``site``; whether the spec says this hit fails."""
        if site not in self.rules:
            return False
        self.hits[site] += 1
        n, onwards = self.rules[site]
        fire = self.hits[site] == n or (onwards and self.hits[site] > n)
        if fire:
            self.raised[site] += 1
        return fire

    def hit(self, site: str) -> None:
        if self.fires(site):
            raise InjectedFault(f"injected fault at {site} (hit {self.hits[site]})")

    def copy_hook(self, kind: str) -> None:
        self.hit(f"copy.{kind}")


class FaultyStepKV:
    """Wraps a step's KV view so that the gather of ``layer`` raises at ``site`` (mid-forward: earlier layers
    have written provisional rows and resolved/fetched theirs)."""

    def __init__(self, inner: Any, faults: FaultInjector, site: str, layer: int) -> None:
        self._inner, self._faults, self._site, self._layer = inner, faults, site, layer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def gather(self, layer: int, positions: Any) -> Any:
        if layer == self._layer:
            self._faults.hit(self._site)
        return self._inner.gather(layer, positions)

"""KV policies as objects: each policy owns its decisions, and adding one means adding a class here.

A policy answers, for the KV manager, its residency operations, the footprint and capacity models:

- ``uses_host``: whether the full history lives in the host store (host copies exist, the hot cache and the
  resolver's host step are in play). ``resident`` keeps everything on device and has neither.
- ``hot_cache``: whether a request has a hot cache of ``B`` rows per source (and verification staging when
  speculating).
- ``optional_prompt_pages(prompt_len, page_rows)``: complete prompt pages a request may keep on device as
  *optional* (lendable) memory after admission: resident-first admission.
- ``reclaims`` / ``refills``: whether optional pages are reclaimed for admissions that do not fit and
  repopulated from host when memory frees up.
- ``tail_first_page(prompt_len, page_rows)``: first page of the imported prompt that stays in the tail (the
  tail holds every page under ``resident``).
- ``reference_store``: the unbounded dense reference (``dense``), served by the engine's own store rather
  than by :class:`~dhisparse.kv.manager.KVManager`.
- ``admission_hint``: what to suggest when a request can never fit the pool under this policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse.errors import ConfigError


@dataclass(frozen=True)
class KVPolicy:
    """Base policy: the HiSparse rules (fixed hot cache, host is the source of truth, nothing optional)."""

    name: str = "hisparse"
    uses_host: bool = True
    hot_cache: bool = True
    reclaims: bool = False
    refills: bool = False
    reference_store: bool = False
    admission_hint: str = ""

    def optional_prompt_pages(self, prompt_len: int, page_rows: int) -> int:
        """Complete prompt pages that may stay on device as optional memory (0: none)."""
        return 0

    def tail_first_page(self, prompt_len: int, page_rows: int) -> int:
        """First page of an imported prompt of ``prompt_len`` rows that belongs to the tail."""
        return prompt_len // page_rows

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class ResidentPolicy(KVPolicy):
    """Everything on device; a request is admitted only if all of its KV fits."""

    name: str = "resident"
    uses_host: bool = False
    hot_cache: bool = False
    admission_hint: str = ", or use kv policy 'adaptive' / 'hisparse'"

    def tail_first_page(self, prompt_len: int, page_rows: int) -> int:
        return 0


@dataclass(frozen=True)
class HiSparsePolicy(KVPolicy):
    """Fixed per-request hot cache ``B`` at every load; the host store is the source of truth (eager backup)."""

    name: str = "hisparse"


@dataclass(frozen=True)
class AdaptivePolicy(KVPolicy):
    """HiSparse plus optional device residency of imported pages while memory is spare (resident-first
    admission, whole-request reclaim under pressure, bounded refill when load drains)."""

    name: str = "adaptive"
    reclaims: bool = True
    refills: bool = True

    def optional_prompt_pages(self, prompt_len: int, page_rows: int) -> int:
        return prompt_len // page_rows


@dataclass(frozen=True)
class DensePolicy(KVPolicy):
    """The unbounded reference store: every request's history in its own dense tensors, no budget, no tiers."""

    name: str = "dense"
    uses_host: bool = False
    hot_cache: bool = False
    reference_store: bool = True

    def tail_first_page(self, prompt_len: int, page_rows: int) -> int:
        return 0


DENSE = DensePolicy()
_ALL = (ResidentPolicy(), HiSparsePolicy(), AdaptivePolicy(), DENSE)
POLICIES: dict[str, KVPolicy] = {p.name: p for p in _ALL}
KV_POLICIES = tuple(p.name for p in _ALL if not p.reference_store)  # served by the hierarchy (KVManager)
ENGINE_POLICIES = tuple(POLICIES)  # everything an engine accepts, the reference included


def policy_named(name: str | KVPolicy, field: str = "kv policy", allowed: tuple[str, ...] = ENGINE_POLICIES
                 ) -> KVPolicy:
    """The policy called ``name`` (a policy object is checked the same way); ``ConfigError`` naming ``field`` and
    the choices otherwise."""
    key = name.name if isinstance(name, KVPolicy) else name
    if key not in allowed:
        raise ConfigError(f"{field} must be one of {', '.join(allowed)}, got {key!r}")
    return POLICIES[key]

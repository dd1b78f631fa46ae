"""Which drafter checkpoint format a ``config.json`` declares, and the engine family it is served as.

A packed drafter lives in ``<engine>/drafters/<family>/``; ``EngineConfig.speculative`` names the family
(``dflash``, ``dflash2`` or ``dspark``). Each family is served by whichever format its directory holds: our own
DFlash2-style / DSpark-style drafters or the published formats below. Detection reads only ``config.json``:

=================  =========  ==========================================================================
format             family     declared by
=================  =========  ==========================================================================
``dflash``         dflash     ``architectures: ["DFlashDraftModel"]`` (z-lab/dflash)
``dflash2``        dflash2    ``architectures: ["DFlash2DraftModel"]`` (Inco AI / z-lab DFlash 2)
``dspark``         dspark     ``architectures: ["Qwen3DSparkModel"]`` (deepseek-ai/DeepSpec)
``dspark-v4``      dspark     ``model_type: "deepseek_v4"`` with ``dspark_*`` fields (``mtp.{0,1,…}.*``)
``ours-dflash2``   dflash2    ``drafter_type: "dflash2"`` (this project's DFlash2-style drafter)
``ours-dspark``    dspark     ``drafter_type: "dspark"`` (this project's DSpark-style drafter)
=================  =========  ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dhisparse.errors import ConfigError


@dataclass(frozen=True)
class DrafterFormat:
    """One checkpoint format: its ``name``, the engine ``family`` it is served as, how ``config.json`` declares it
    and where its proposal rule comes from."""

    name: str
    family: str
    declared_by: str
    reference: str


FORMATS: dict[str, DrafterFormat] = {f.name: f for f in (
    DrafterFormat("dflash", "dflash", 'architectures ["DFlashDraftModel"]', "z-lab/dflash dflash/model.py"),
    DrafterFormat("dflash2", "dflash2", 'architectures ["DFlash2DraftModel"]',
                  "vLLM PR #52816 qwen3_dflash2.py over the z-lab DFlash backbone"),
    DrafterFormat("dspark", "dspark", 'architectures ["Qwen3DSparkModel"]',
                  "deepseek-ai/DeepSpec deepspec/modeling/dspark + deepspec/eval/dspark"),
    DrafterFormat("dspark-v4", "dspark", 'model_type "deepseek_v4" with dspark_block_size / dspark_target_layer_ids',
                  "DeepSeek-V4 DSpark (mtp.{0,1,..}.* stages), as described in docs/drafters.md"),
    DrafterFormat("ours-dflash2", "dflash2", 'drafter_type "dflash2"', "dhisparse.spec.drafters.dflash2"),
    DrafterFormat("ours-dspark", "dspark", 'drafter_type "dspark"', "dhisparse.spec.drafters.dspark"),
)}
FAMILIES = ("dflash", "dflash2", "dspark")
PUBLISHED = ("dflash", "dflash2", "dspark", "dspark-v4")
_ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2", "Qwen3DSparkModel": "dspark"}


def supported_formats() -> str:
    """One line per format, for error messages."""
    return "; ".join(f"{f.name} ({f.declared_by})" for f in FORMATS.values())


def detect_format(config: dict[str, Any], where: str) -> str:
    """The format ``config`` (a parsed ``config.json``) declares; ``ConfigError`` listing the supported formats
    when it declares none of them (or several)."""
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: config.json must hold a JSON object")
    found: list[str] = []
    kind = config.get("drafter_type")
    if kind is not None:
        if kind not in ("dflash2", "dspark"):
            raise ConfigError(f"{where}: drafter_type {kind!r} is not a drafter this runtime reads; supported "
                              f"formats: {supported_formats()}")
        found.append(f"ours-{kind}")
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigError(f"{where}: architectures must be a list, got {archs!r}")
    found += [_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES]
    if config.get("model_type") == "deepseek_v4" and config.get("dspark_block_size") is not None:
        found.append("dspark-v4")
    found = sorted(set(found))
    if len(found) > 1:
        raise ConfigError(f"{where}: config.json declares several drafter formats {found}; it must declare one")
    if not found:
        raise ConfigError(f"{where}: not a drafter format this runtime reads (architectures {archs!r}, model_type "
                          f"{config.get('model_type')!r}); supported formats: {supported_formats()}")
    return found[0]


def family_of(fmt: str) -> str:
    return FORMATS[fmt].family

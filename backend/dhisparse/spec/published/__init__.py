"""Published drafters in their own checkpoint formats: z-lab DFlash, DFlash2 (vLLM / SGLang), DeepSpec's Qwen3
DSpark and DeepSeek-V4's DSpark stages. See ``docs/drafters.md``."""

from __future__ import annotations

from .footprint import DrafterFootprint, drafter_footprint, v4_fp8_row_bytes
from .formats import FAMILIES, FORMATS, PUBLISHED, detect_format, family_of, supported_formats
from .loading import load_published, read_drafter_config
from .reference_configs import REFERENCE_CONFIGS, ReferenceConfig, reference_config
from .runtime_types import DraftOutput, ProposalContext, PublishedDrafter
from .session import PublishedSpeculation

__all__ = [
    "FAMILIES", "FORMATS", "PUBLISHED", "REFERENCE_CONFIGS", "DraftOutput", "DrafterFootprint", "ProposalContext",
    "PublishedDrafter", "PublishedSpeculation", "ReferenceConfig", "detect_format", "drafter_footprint", "family_of",
    "load_published", "read_drafter_config", "reference_config", "supported_formats", "v4_fp8_row_bytes",
]

"""Which drafter shape explains the paper's speculative state of 0.060 GiB per GLM session (issue 28, point 4).

A session's speculative state is its draft ring (the drafter's visible window of KV) plus its verification staging
(:func:`dhisparse.kv.footprint.request_footprint`: the rows of a verification step's union of selections that the
hot cache cannot take, sized for one layer group and reused). Each candidate below is a published drafter shape (or
the planner's earlier assumption); :func:`speculative_state_rows` prices it with the code the KV manager admits
with, on GLM-5 (an indexer on every layer: one staging slot) and GLM-5.x with IndexShare (groups of four: four
slots), at the paper's 32K context, next to the paper's figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse_planner.footprint_cli import session_footprint
from dhisparse_planner.specs import DFLASH2_KV_DIM, DFLASH2_LAYERS, DFLASH2_WINDOW, MODEL_PRESETS

PAPER_SPECULATIVE_GIB = 0.060  # the paper's whole speculative state per GLM session (ring + staging)
GIB = 2.0**30
Row = dict[str, float | str]


@dataclass(frozen=True)
class DrafterShape:
    """``layers`` draft layers keeping a ``window`` of K and V rows of ``kv_dim`` values of ``value_bytes`` each;
    ``gamma`` drafts per verification step."""

    name: str
    layers: int
    window: int
    kv_dim: int
    value_bytes: int
    gamma: int
    source: str

    @property
    def ring_bytes(self) -> int:
        return self.layers * self.window * 2 * self.kv_dim * self.value_bytes


CANDIDATES = (
    DrafterShape("DFlash2, block 8", DFLASH2_LAYERS, DFLASH2_WINDOW, DFLASH2_KV_DIM, 2, 7,
                 "5 sliding-window layers, window 2,048, 8 KV heads x 128, bf16; block 8 (specs.py)"),
    DrafterShape("DFlash2 layers, block 16", DFLASH2_LAYERS, DFLASH2_WINDOW, DFLASH2_KV_DIM, 2, 15,
                 "the same layers with DFlash's block of 16 (z-lab DFlash configs: block_size 16)"),
    DrafterShape("DFlash2 layers, gamma 4", DFLASH2_LAYERS, DFLASH2_WINDOW, DFLASH2_KV_DIM, 2, 4,
                 "the same layers verifying 4 drafts (the engine's default gamma)"),
    DrafterShape("earlier planner assumption", 2, 64, 6144, 2, 7,
                 "2 layers at GLM's hidden 6144, window 64 (the engine's demo DFlash2Config): no source"),
)


def speculative_state_rows(context: int = 32768, output_tokens: int = 8192,
                           models: tuple[str, ...] = ("glm5", "glm5-indexshare-nvfp4")) -> list[Row]:
    """One row per model and candidate: ring, staging and their sum (GiB) against the paper's 0.060 GiB."""
    rows: list[Row] = []
    for key in models:
        model = MODEL_PRESETS[key]
        for shape in CANDIDATES:
            fp = session_footprint(model, context, output_tokens, "adaptive", 0, 64, "dflash2", shape.gamma,
                                   ring_bytes=shape.ring_bytes)
            total = float(fp["speculative_bytes"]) / GIB
            rows.append({"model": model.name, "drafter shape": shape.name, "gamma": shape.gamma,
                         "ring_gib": round(shape.ring_bytes / GIB, 4),
                         "staging_gib": round(float(fp["staging_bytes"]) / GIB, 4),
                         "staging_slots": int(fp["staging_slots"]), "speculative_gib": round(total, 4),
                         "vs_paper": round(total / PAPER_SPECULATIVE_GIB, 2)})
    return rows

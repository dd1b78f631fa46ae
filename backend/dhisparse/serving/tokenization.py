"""Tokenizer helpers for the `preprocessing` and `postprocessing` Triton models.

The tokenizer is the engine directory's `tokenizer.json` (Hugging Face `tokenizers` format).

Streaming detokenisation in an ensemble is stateless: `postprocessing` sees each streamed chunk of
token ids on its own. Decoding chunks separately with `Tokenizer.decode` would turn a multi-byte
character split across two chunks into two U+FFFD replacement characters. Instead `TokenBytes` maps
every token id to the exact bytes it contributes, so the concatenation of the streamed chunks is
byte-for-byte the UTF-8 text of the whole sequence (Triton's STRING type is raw bytes). Clients decode
the concatenated stream, or decode incrementally (`codecs.getincrementaldecoder("utf-8")`).
This is exact for byte-level tokenizers (GPT-2 style `ByteLevel` decoders) and SentencePiece-style
ones (`Metaspace`/`Replace("▁", " ")` with `ByteFallback` tokens `<0xNN>`); other decoders fall back
to decoding each chunk as a whole.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from dhisparse.errors import InvalidRequestError

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(engine_dir: str | Path) -> Tokenizer:
    """Load `<engine_dir>/tokenizer.json`; raise FileNotFoundError naming the path if absent."""
    path = Path(engine_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the engine has no tokenizer, serve token ids instead")
    return Tokenizer.from_file(str(path))


def engine_token_bytes(engine_dir: str | Path, skip_special_tokens: bool = True) -> TokenBytes | None:
    """`TokenBytes` of the engine's tokenizer, or None when the engine has no `tokenizer.json`."""
    if not (Path(engine_dir) / TOKENIZER_FILE).is_file():
        return None
    return TokenBytes(load_tokenizer(engine_dir), skip_special_tokens)


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of GPT-2's `bytes_to_unicode`: printable stand-in character -> byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: b for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = 256 + shift
            shift += 1
    return {chr(code): b for b, code in mapping.items()}


def _decoder_kinds(decoder: dict | None) -> set[str]:
    if decoder is None:
        return set()
    if decoder.get("type") == "Sequence":
        return {kind for sub in decoder.get("decoders", []) for kind in _decoder_kinds(sub)}
    return {decoder.get("type", "")}


class TokenBytes:
    """Exact per-token byte strings of a tokenizer, for stateless streaming detokenisation.

    `decode(ids)` returns UTF-8 bytes; for supported decoders (see module docstring)
    `decode(a) + decode(b) == decode(a + b)` for any split, and decoding a whole sequence equals
    `tokenizer.decode(ids).encode()` whenever that text is valid UTF-8 (modulo decoder clean-ups such
    as stripping the first Metaspace space).

    Args:
        tokenizer: the `tokenizers.Tokenizer`.
        skip_special_tokens: map special (added, `special=True`) tokens to empty bytes.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        spec = json.loads(tokenizer.to_str())
        kinds = _decoder_kinds(spec.get("decoder"))
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        self._table: list[bytes] | None = None
        if "ByteLevel" in kinds:
            alphabet = _byte_level_alphabet()
            self._table = [self._byte_level(tokenizer, i, alphabet, special) for i in range(self.vocab_size)]
        elif "ByteFallback" in kinds or "Metaspace" in kinds:
            self._table = [self._sentencepiece(tokenizer, i, special) for i in range(self.vocab_size)]

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def exact(self) -> bool:
        """Whether chunk-wise decoding is exact for this tokenizer (a per-token table exists)."""
        return self._table is not None

    def _special_bytes(self, token: str) -> bytes:
        return b"" if self.skip_special_tokens else token.encode()

    def _byte_level(self, tok: Tokenizer, i: int, alphabet: dict[str, int], special: set[int]) -> bytes:
        token = tok.id_to_token(i)
        if token is None:
            return b""
        if i in special:
            return self._special_bytes(token)
        if all(ch in alphabet for ch in token):
            return bytes(alphabet[ch] for ch in token)
        return token.encode()  # an added (non-special) token stored as plain text

    def _sentencepiece(self, tok: Tokenizer, i: int, special: set[int]) -> bytes:
        token = tok.id_to_token(i)
        if token is None:
            return b""
        if i in special:
            return self._special_bytes(token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace("▁", " ").encode()

    def decode(self, token_ids: list[int] | np.ndarray) -> bytes:
        """UTF-8 bytes of `token_ids` (int sequence); ids outside the vocabulary raise InvalidRequestError."""
        ids = [int(i) for i in token_ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if self._table is None:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens).encode()
        return b"".join(self._table[i] for i in ids)

    def whole_character_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` (which start at a character boundary) end at one: the longest
        prefix whose bytes leave no character incomplete. The rest waits for the tokens that complete its
        character; bytes that can never become valid UTF-8 do not wait (they decode to U+FFFD either way).
        Splitting there keeps `decode(a) + decode(b)` equal to `decode(a + b)` for a replacing UTF-8 decoder."""
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        whole = 0
        for n, token in enumerate(token_ids, start=1):
            utf8.decode(self.decode([token]))
            if not utf8.getstate()[0]:  # nothing buffered: a character boundary
                whole = n
        return whole


class TextDecoder:
    """Token ids -> text in whole characters, across chunks (holds back an incomplete UTF-8 tail)."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: list[int] | np.ndarray) -> str:
        """Text completed by these tokens (may be empty)."""
        return self._utf8.decode(self._token_bytes.decode(token_ids))

    def flush(self) -> str:
        """Whatever is held back (a truncated character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def encode_prompt(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; raise InvalidRequestError for an empty prompt."""
    if not text:
        raise InvalidRequestError("text_input is empty: send a non-empty prompt")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    if not ids:
        raise InvalidRequestError("text_input tokenizes to zero tokens: send a non-empty prompt")
    return ids


def word_list(tokenizer: Tokenizer, words: list[str]) -> np.ndarray:
    """Encode stop/bad words into tensorrtllm_backend's `[2, L]` int32 word-list format.

    Row 0 holds the concatenated token ids of all words, row 1 the exclusive end offset of each word,
    padded with -1 to length L. No words gives shape `[2, 0]`; a word that encodes to no tokens is
    dropped (an empty string cannot stop anything).
    """
    ids: list[int] = []
    offsets: list[int] = []
    for word in words:
        tokens = tokenizer.encode(word, add_special_tokens=False).ids
        if tokens:
            ids.extend(tokens)
            offsets.append(len(ids))
    out = np.full((2, max(len(ids), len(offsets))), -1, dtype=np.int32)
    out[0, : len(ids)] = ids
    out[1, : len(offsets)] = offsets
    return out


def split_word_list(word_list_array: np.ndarray) -> list[tuple[int, ...]]:
    """Inverse of `word_list`: `[2, L]` int32 -> list of token-id tuples. Raises on malformed input."""
    array = np.asarray(word_list_array)
    if array.ndim != 2 or array.shape[0] != 2:
        raise InvalidRequestError(f"a word list must have shape [2, L], got {list(array.shape)}")
    ids, offsets = array[0].tolist(), [int(o) for o in array[1] if o >= 0]
    words, start = [], 0
    for end in offsets:
        if not start < end <= len(ids):
            raise InvalidRequestError(f"word list offsets {offsets} are not increasing within [1, {len(ids)}]")
        words.append(tuple(int(i) for i in ids[start:end]))
        start = end
    return words

"""Token-to-bytes detokenisation and the tensorrtllm word-list format, without a server."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_tokenizer import build_tokenizer

from dhisparse.errors import InvalidRequestError
from dhisparse.serving.tokenization import TokenBytes, encode_prompt, split_word_list, word_list

TEXTS = ["To be, or not to be", "naïve café — 日本語 🙂!", "a\nb\tc  d", "🙂🙂🙂"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_chunked_decoding_is_exact_at_every_split(tokenizer, text):
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode(text).ids
    assert token_bytes.exact
    assert token_bytes.decode(ids) == text.encode()
    for split in range(len(ids) + 1):
        assert token_bytes.decode(ids[:split]) + token_bytes.decode(ids[split:]) == text.encode()


def test_single_token_of_a_multibyte_character_is_a_fragment(tokenizer):
    token_bytes = TokenBytes(tokenizer)
    pieces = [token_bytes.decode([i]) for i in tokenizer.encode("🙂").ids]
    assert len(pieces) > 1 and b"".join(pieces) == "🙂".encode()
    assert tokenizer.decode(tokenizer.encode("🙂").ids[:1]) == "\ufffd"  # what per-chunk decode would give


def test_special_tokens_are_skipped_or_kept(tokenizer):
    eos = tokenizer.token_to_id("<eos>")
    ids = tokenizer.encode("hi").ids + [eos]
    assert TokenBytes(tokenizer).decode(ids) == b"hi"
    assert TokenBytes(tokenizer, skip_special_tokens=False).decode(ids) == b"hi<eos>"


def test_out_of_vocabulary_ids_are_rejected(tokenizer):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        TokenBytes(tokenizer).decode([1, tokenizer.get_vocab_size(), -1])


def test_empty_prompt_is_rejected(tokenizer):
    with pytest.raises(InvalidRequestError, match="empty"):
        encode_prompt(tokenizer, "")


def test_word_list_round_trip(tokenizer):
    words = ["the", " be", "", "🙂"]
    array = word_list(tokenizer, words)
    assert array.dtype == np.int32 and array.shape[0] == 2
    expected = [tuple(tokenizer.encode(w, add_special_tokens=False).ids) for w in words if w]
    assert split_word_list(array) == expected
    assert word_list(tokenizer, []).shape == (2, 0)
    assert split_word_list(np.zeros((2, 0), dtype=np.int32)) == []


def test_malformed_word_list_is_rejected():
    with pytest.raises(InvalidRequestError, match=r"\[2, L\]"):
        split_word_list(np.zeros((3, 2), dtype=np.int32))
    with pytest.raises(InvalidRequestError, match="offsets"):
        split_word_list(np.array([[5, 6], [2, 1]], dtype=np.int32))


def test_stop_sequence_within_min_tokens_does_not_count():
    from dhisparse.serving.stop_sequences import StopSequenceMatcher

    assert StopSequenceMatcher([(4, 5)]).feed([4, 5, 9]) == 2
    held = StopSequenceMatcher([(4, 5)], min_tokens=2)
    assert held.feed([4, 5, 9]) is None  # completed at token 2: too early
    assert held.feed([4, 5]) == 2  # completed at token 5

"""Greedy outputs through the real server equal offline `LLM.generate`, with 16 concurrent clients."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from dhisparse import SamplingParams
from dhisparse.serving.tokenization import TokenBytes
from dhisparse_client import GenerationOptions

WORDS = ["To be, or not to be", "the question", "Whether 'tis nobler", "naïve café", "the slings and arrows",
         "of outrageous fortune", "Or to take arms", "against a sea of troubles", "日本語", "🙂 emoji"]
PROMPTS = [f"{WORDS[i % len(WORDS)]} {WORDS[(3 * i + 1) % len(WORDS)]} #{i}" for i in range(16)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def expected(offline_llm, tokenizer):
    """Reference token ids and text bytes per prompt (greedy, offline)."""
    prompt_ids = [tokenizer.encode(p).ids for p in PROMPTS]
    outputs = offline_llm.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS))
    token_bytes = TokenBytes(tokenizer)
    pairs = zip(prompt_ids, outputs, strict=True)
    return [(ids, out.token_ids, token_bytes.decode(out.token_ids)) for ids, out in pairs]


def _concurrently(function, count: int) -> list:
    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(function, range(count)))


def test_ensemble_streaming_matches_offline_with_16_concurrent_clients(served, expected):
    options = GenerationOptions(max_tokens=MAX_TOKENS)
    before = served.client().metrics()

    def run(i: int) -> list[bytes]:
        return list(served.client("ensemble").stream(PROMPTS[i], options))

    for (_, _, text), chunks in zip(expected, _concurrently(run, 16), strict=True):
        for chunk in chunks:
            chunk.decode("utf-8")  # valid UTF-8 on its own (tensorrtllm_backend's clients decode every chunk)
        # chunks end at character boundaries, so they concatenate to the whole text's decoding (invalid bytes of
        # the random model become U+FFFD)
        assert b"".join(chunks) == text.decode("utf-8", "replace").encode()
        assert len(chunks) > 1  # really streamed, not one final blob
    assert any(tokens for _, tokens, _ in expected)
    after = served.client().metrics()
    # The pool is small: residency really mattered (reclaims or admission waits) and rows came from every tier.
    pressure = ("kv_reclaim_events", "kv_admissions_waited")
    assert sum(after[k] - before.get(k, 0.0) for k in pressure) > 0, {k: after[k] for k in pressure}
    assert after["kv_rows_host"] > before.get("kv_rows_host", 0.0)


def test_ensemble_http_non_streaming_matches_offline(served, expected):
    client = served.client("ensemble")
    for prompt, (_, _, text) in list(zip(PROMPTS, expected, strict=True))[:4]:
        whole = text.decode("utf-8", "replace").encode()  # text_output is valid UTF-8
        assert client.generate(prompt, GenerationOptions(max_tokens=MAX_TOKENS)) == whole


def test_bls_streams_whole_characters_matching_offline(served, expected):
    def run(i: int) -> list[bytes]:
        return list(served.client("dhisparse_bls").stream(PROMPTS[i], GenerationOptions(max_tokens=MAX_TOKENS)))

    for (_, _, text), chunks in zip(expected, _concurrently(run, 16), strict=True):
        for chunk in chunks:
            chunk.decode("utf-8")  # every chunk is whole characters
        assert b"".join(chunks).decode() == text.decode("utf-8", "replace")


def test_llm_model_token_ids_match_offline(served, expected):
    def run(i: int) -> list[int]:
        prompt_ids = expected[i][0]
        return [t for chunk in served.client().stream_token_ids(prompt_ids, GenerationOptions(max_tokens=MAX_TOKENS))
                for t in chunk]

    for (_, tokens, _), served_tokens in zip(expected, _concurrently(run, 16), strict=True):
        assert served_tokens == tokens

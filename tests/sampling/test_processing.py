"""Logit processing against transformers' own logits processors, and the verification window against the plain
path position by position (what keeps speculative decoding exact)."""

from __future__ import annotations

import pytest
import torch
from reference_processing import reference_process

from dhisparse.sampling import LogitsProcessor, SamplingParams, initial_counts

VOCAB = 40
EOS = 3


CASES = {
    "repetition": SamplingParams(repetition_penalty=1.7),
    "repetition_below_one": SamplingParams(repetition_penalty=0.6),
    "presence_frequency": SamplingParams(presence_penalty=0.8, frequency_penalty=0.3),
    "bad_words": SamplingParams(bad_words=((7,), (5, 9), (1, 2, 11))),
    "min_tokens": SamplingParams(min_tokens=4, stop_token_ids=(12,)),
    "bias": SamplingParams(logit_bias={4: 2.5, 17: -1.25}),
    "everything": SamplingParams(repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1,
                                 bad_words=((5, 9), (8,)), min_tokens=3, logit_bias={6: 1.0}),
}


def _sequences(seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 12, (9,), generator=g).tolist() + [5, 1, 2]
    output = torch.randint(0, 12, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
    return prompt, output


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_processing_equals_transformers_processors(name, dtype):
    params = CASES[name]
    batch = [_sequences(seed) for seed in range(5)]
    mixed = [params, SamplingParams(), params, params, SamplingParams(temperature=0.5)]
    logits = torch.randn(len(batch), 1, VOCAB, dtype=dtype, generator=torch.Generator().manual_seed(1)) * 3
    counts = [initial_counts(p + o, VOCAB, torch.device("cpu")) if q.counts_tokens else None
              for (p, o), q in zip(batch, mixed, strict=True)]
    processor = LogitsProcessor.build(mixed, batch, counts, (EOS,), VOCAB, torch.device("cpu"))
    assert processor is not None
    out = processor.apply(logits)[:, 0]
    for row, ((prompt, output), p) in enumerate(zip(batch, mixed, strict=True)):
        expected = reference_process(logits[row, 0], prompt + output, len(prompt), p, (EOS,)) if p.processes_logits \
            else logits[row, 0]
        assert torch.equal(out[row], expected), (name, row)


def test_nothing_to_process_builds_nothing():
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=3)]
    assert LogitsProcessor.build(params, [([1], [])] * 2, [None, None], (EOS,), VOCAB, torch.device("cpu")) is None


@pytest.mark.parametrize("name", list(CASES))
def test_verification_window_equals_plain_path_per_position(name):
    """Position i of a window over drafts d_1..d_{Q-1} is processed exactly as the plain path would process the
    token after appending d_1..d_i (counts, bad-word context and min_tokens all move with the drafts)."""
    params = CASES[name]
    batch = [_sequences(seed) for seed in range(10, 14)]
    g = torch.Generator().manual_seed(2)
    q = 5
    draft = torch.randint(0, 12, (len(batch), q - 1), generator=g)
    draft[0, :2] = torch.tensor([1, 2])  # walks into the multi-token bad word (1, 2, 11)
    logits = torch.randn(len(batch), q, VOCAB, generator=g) * 3
    counts = [initial_counts(p + o, VOCAB, torch.device("cpu")) if params.counts_tokens else None for p, o in batch]
    window = LogitsProcessor.build([params] * len(batch), batch, counts, (EOS,), VOCAB, torch.device("cpu"))
    out = window.apply(logits, draft)
    for i in range(q):
        grown = [(p, o + draft[b, :i].tolist()) for b, (p, o) in enumerate(batch)]
        grown_counts = [initial_counts(p + o, VOCAB, torch.device("cpu")) if params.counts_tokens else None
                        for p, o in grown]
        plain = LogitsProcessor.build([params] * len(batch), grown, grown_counts, (EOS,), VOCAB, torch.device("cpu"))
        assert torch.equal(out[:, i], plain.apply(logits[:, i:i + 1])[:, 0]), (name, i)

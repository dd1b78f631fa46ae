"""Penalties, bad words, min_tokens and embedding bias in the engine: greedy tokens equal a reference that applies
transformers' logits processors to transformers' own logits, step by step; log probs equal the log-softmax of the
model's logits at the chosen tokens."""

from __future__ import annotations

import pytest
import torch
from reference_processing import reference_process
from tiny_models import load_reference, random_prompts

from dhisparse import LLM, SamplingParams

NEW_TOKENS = 8
CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=0.7),
    "bad_words": dict(bad_words=((84,), (4, 8), (11, 12, 13))),
    "min_tokens": dict(min_tokens=6, stop_token_ids=(84, 8)),
    "bias": dict(logit_bias={5: 4.0, 9: 3.0, 30: -2.0}),
}


def _reference_greedy(ref, prompt: list[int], params: SamplingParams, eos: tuple[int, ...]) -> list[int]:
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = ref(torch.tensor([sequence])).logits[0, -1]
            token = int(reference_process(logits, sequence, len(prompt), params, eos).argmax())
            sequence.append(token)
            if token in params.stop_token_ids or (token in eos and not params.ignore_eos):
                break
    return sequence[len(prompt):]


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tiny_engine):
    name = "glm_fsfs_sparse"
    return load_reference(tiny_checkpoint(name)), LLM(tiny_engine(name), kv_policy="adaptive", page_rows=8)


@pytest.mark.parametrize("case", list(CASES))
def test_processed_greedy_equals_transformers_reference(setup, case):
    ref, llm = setup
    prompts = random_prompts([9, 23], 96, seed=5)
    prompts[1][-2:] = [11, 12]  # the prompt ends inside a multi-token bad word
    params = SamplingParams(max_tokens=NEW_TOKENS, **CASES[case])
    eos = tuple(llm.engine.eos_token_ids)
    plain = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))]
    expected = [_reference_greedy(ref, p, params, eos) for p in prompts]
    assert expected != plain, "the processing changes nothing here: the test would be weak"
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_log_probs_are_the_log_softmax_of_the_chosen_tokens(setup):
    _, llm = setup
    prompt = random_prompts([17], 96, seed=8)[0]
    for params in (SamplingParams(max_tokens=8, logprobs=True),
                   SamplingParams(max_tokens=8, logprobs=True, temperature=0.7, seed=3)):
        out = llm.generate([prompt], params)[0]
        sequence = prompt + out.token_ids
        logits = llm.engine.model.prefill(sequence[:-1], all_logits=True).all_logits[len(prompt) - 1:]
        t = params.temperature or 1.0
        expected = torch.log_softmax(logits.double() / t, dim=-1).gather(
            1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
        assert out.log_probs is not None and len(out.log_probs) == len(out.token_ids)
        assert torch.allclose(torch.tensor(out.log_probs, dtype=torch.float64), expected, atol=1e-6)
        assert out.stats["cum_log_prob"] == pytest.approx(sum(out.log_probs))

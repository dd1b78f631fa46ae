"""The LLM API: validation, sampling determinism, streaming, continuous batching, cancellation, the loop."""

from __future__ import annotations

import time

import pytest
import torch
from tiny_models import random_prompts

from dhisparse import LLM, SamplingParams
from dhisparse.engine.loop import EngineLoop
from dhisparse.errors import ConfigError, InvalidRequestError
from dhisparse.sampling.sampler import filtered_probs, sample_from, uniform


@pytest.fixture(scope="module")
def llm(tiny_engine):
    return LLM(tiny_engine("glm_fsfs_sparse", "float32"), kv_policy="dense", max_batch_size=3,
               max_model_len=200, max_new_tokens_limit=100)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k must be an integer >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"seed": -1}, "seed must be an integer"),
    ],
)
def test_sampling_params_validate(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "prompt is empty"),
        ([1, 2, 96], SamplingParams(), r"token id 96 is outside the vocabulary \[0, 96\)"),
        ([1, -3], SamplingParams(), "token id -3"),
        (list(range(90)) * 3, SamplingParams(), "engine's maximum is 199"),
        ([1, 2], SamplingParams(max_tokens=150), "exceeds the engine limit of 100"),
        (list(range(90)) * 2 + [1] * 10, SamplingParams(max_tokens=50), "exceeds the engine's max_model_len"),
        ([1, 2], SamplingParams(stop_token_ids=(500,)), "stop token id 500"),
    ],
)
def test_bad_requests_are_refused_and_nothing_is_lost(llm, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([prompt], params)
    assert not llm.engine.has_unfinished()
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids


def test_unknown_override_is_a_config_error(tiny_engine):
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(tiny_engine("glm_fsfs_sparse", "float32"), kv_polcy="dense")


def test_sampling_is_seeded_and_independent_of_batch(llm):
    prompts = random_prompts([9, 30, 17, 44], 96, seed=4)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=1234, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, p)]
    alone = [llm.generate([q], p)[0].token_ids for q in prompts]
    assert together == alone
    other_seed = llm.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.9, seed=99,
                                                           ignore_eos=True))[0].token_ids
    assert other_seed != together[0]
    greedy = llm.generate([prompts[1]], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    assert llm.generate([prompts[1]], SamplingParams(max_tokens=12, temperature=1.0, top_k=1,
                                                     ignore_eos=True))[0].token_ids == greedy


def test_sampler_matches_its_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 10)
    probs = filtered_probs(logits, torch.tensor([0.8]), torch.tensor([6]), torch.tensor([0.9]))
    assert int((probs > 0).sum()) <= 6 and abs(float(probs.sum()) - 1) < 1e-12
    n = 20000
    u = uniform(torch.full((n,), 7, dtype=torch.int64), torch.arange(n))
    draws = sample_from(probs.expand(n, -1), u)
    freq = torch.bincount(draws, minlength=10).double() / n
    assert (freq - probs[0]).abs().sum().item() < 0.03  # total variation bound for 20k draws


def test_stop_tokens_and_streaming(llm):
    prompt = random_prompts([25], 96, seed=8)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    stop = full[4]
    first = full.index(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop"
    streamed = list(llm.generate_stream(prompt, SamplingParams(max_tokens=10, ignore_eos=True)))
    assert [t for u in streamed for t in u.new_token_ids] == full
    assert streamed[-1].finished and streamed[-1].finish_reason == "length"
    assert streamed[-1].stats["output_tokens"] == 10 and "ttft_s" in streamed[-1].stats


def test_continuous_batching_respects_max_batch_and_queues(llm):
    prompts = random_prompts([5, 40, 12, 33, 8, 21, 60], 96, seed=9)
    eng = llm.engine
    ids = [eng.add_request(p, SamplingParams(max_tokens=6 + i, ignore_eos=True)) for i, p in enumerate(prompts)]
    max_running = 0
    while eng.has_unfinished():
        eng.step()
        max_running = max(max_running, len(eng.scheduler.running))
    assert max_running == 3
    outs = [eng.pop_finished(i) for i in ids]
    assert [len(o.output_token_ids) for o in outs] == [6 + i for i in range(7)]
    solo = [llm.generate([p], SamplingParams(max_tokens=6 + i, ignore_eos=True))[0].token_ids
            for i, p in enumerate(prompts)]
    assert [o.output_token_ids for o in outs] == solo


def test_engine_loop_serves_concurrent_streams_and_cancels(llm):
    prompts = random_prompts([11, 27, 6, 19], 96, seed=12)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]  # before the loop owns the engine
    loop = EngineLoop(llm)
    try:
        streams = [loop.submit(p, params) for p in prompts]
        got = [[t for u in s for t in u.new_token_ids] for s in streams]
        assert got == expected
        with pytest.raises(InvalidRequestError):
            loop.submit([], params)
        long = loop.submit(prompts[0], SamplingParams(max_tokens=90, ignore_eos=True))
        it = iter(long)
        next(it)
        long.cancel()
        rest = list(it)
        assert rest and rest[-1].finish_reason == "abort"
        for _ in range(100):  # the loop publishes stats after its next iteration
            if loop.stats().get("requests_running", 0) == 0:
                break
            time.sleep(0.02)
        assert loop.stats()["requests_running"] == 0 and loop.stats()["requests_aborted"] >= 1
    finally:
        loop.close()


def test_request_that_can_never_fit_the_pool_is_refused_up_front(tiny_engine):
    llm = LLM(tiny_engine("glm_fsfs_sparse", "float32"), kv_policy="resident", page_rows=8)
    small = llm.engine.kv.required_bytes(20, 4)
    llm = LLM(tiny_engine("glm_fsfs_sparse", "float32"), kv_policy="resident", page_rows=8, pool_bytes=small + 1024)
    with pytest.raises(InvalidRequestError, match="can never fit the KV pool.*raise pool_bytes"):
        llm.generate([list(range(90))], SamplingParams(max_tokens=40))
    assert llm.generate([list(range(20))], SamplingParams(max_tokens=4))[0].token_ids  # the engine still serves

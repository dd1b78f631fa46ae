"""DeepSeek-V4 runtime against transformers 5.24's ``DeepseekV4ForCausalLM`` (float64 tiny random models).

Both configs cover every attention layer type (sliding, CSA, HCA) and both MLP types (hash-routed, top-k), the
first with ``index_topk`` below the number of compressed entries, the second above it with yarn on the compress
RoPE set and rates 3/7. Prompt lengths are irregular and cross compression boundaries; decoding crosses more.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompts
from tiny_v4 import CONFIGS, load_v4_reference, make_v4_checkpoint

from dhisparse import LLM, SamplingParams
from dhisparse.model.deepseek_v4.kv_state import V4StepKV
from dhisparse.model.deepseek_v4.model import DeepseekV4Model

NAMES = sorted(CONFIGS)
LENGTHS = [1, 13, 30]  # irregular; the longest crosses several CSA and HCA windows
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def v4_checkpoint(tiny_root):
    return lambda name, original=True: make_v4_checkpoint(tiny_root, name, original_format=original)


def _reference_greedy(ref, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _batched_greedy(model: DeepseekV4Model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Prefill each prompt, then decode all of them together in one batch (different lengths)."""
    states, tokens = [], []
    for p in prompts:
        out = model.prefill(p, chunk_tokens=5)
        states.append(out.state)
        tokens.append([int(out.logits.argmax())])
    for _ in range(n - 1):
        step = V4StepKV(states, 1, model.device)
        logits = model.forward(torch.tensor([[t[-1]] for t in tokens]), None, step).logits[:, -1]
        step.commit()
        for t, nxt in zip(tokens, logits.argmax(-1).tolist(), strict=True):
            t.append(nxt)
    return tokens


@pytest.mark.parametrize("name", NAMES)
def test_prefill_logits_close_in_float64(name, v4_checkpoint):
    path = v4_checkpoint(name)
    ref = load_v4_reference(path)
    ours = DeepseekV4Model.from_checkpoint(path, dtype=torch.float64)
    prompt = random_prompts([43], ref.config.vocab_size, seed=3)[0]
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    for chunk in (64, 9):  # one pass; chunks that split compression windows
        got = ours.prefill(prompt, chunk_tokens=chunk, all_logits=True).all_logits
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_transformers_alone_and_batched(name, v4_checkpoint):
    path = v4_checkpoint(name)
    ref = load_v4_reference(path)
    prompts = random_prompts(LENGTHS, ref.config.vocab_size, seed=11)
    expected = [_reference_greedy(ref, p, NEW_TOKENS) for p in prompts]
    assert any(len(set(e)) > 4 for e in expected), "reference output is degenerate; the test would be weak"
    ours = DeepseekV4Model.from_checkpoint(path, dtype=torch.float64)
    assert _batched_greedy(ours, prompts[-1:], NEW_TOKENS) == expected[-1:]
    assert _batched_greedy(ours, prompts, NEW_TOKENS) == expected


def test_both_tensor_namings_load_the_same_weights(v4_checkpoint):
    from dhisparse.model.deepseek_v4.weights import load_state_dict
    from dhisparse.model.loading import read_any_config

    original, hf_names = v4_checkpoint("v4_small_topk"), v4_checkpoint("v4_small_topk", original=False)
    cfg = read_any_config(original)
    a = load_state_dict(original, cfg, torch.float64)
    b = load_state_dict(hf_names, cfg, torch.float64)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64
    assert a["model.layers.1.attn_hc.fn"].dtype == torch.float32  # kept in float32 as transformers does


def test_engine_build_and_llm_generate_match_transformers(v4_checkpoint, tiny_root):
    from dhisparse_builder import BuildOptions, build_engine

    path = v4_checkpoint("v4_large_topk_yarn")
    engine = build_engine(BuildOptions(path, tiny_root / "engine-v4", {"dtype": "float64"}),
                          progress=lambda d, t: None)
    ref = load_v4_reference(path)
    prompts = random_prompts([9, 22], ref.config.vocab_size, seed=5)
    expected = [_reference_greedy(ref, p, 12) for p in prompts]
    for policy in ("dense", "adaptive"):  # the reference store; the engine's default policy
        llm = LLM(engine, max_batch_size=4, kv_policy=policy)
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        assert [o.token_ids for o in outs] == expected
    assert outs[0].stats["kv_window_bytes"] > 0


def test_shared_kv_source_layers_read_the_source_and_keep_no_state(v4_checkpoint):
    """Layer 3 (CSA) reuses layer 1's compressed KV and top-k: it holds no compressor state or entries, its
    selection is layer 1's, and prefill (one pass) agrees with token-by-token decoding over the shared source."""
    import dataclasses

    from dhisparse.model.deepseek_v4.weights import load_state_dict
    from dhisparse.model.loading import read_any_config

    path = v4_checkpoint("v4_small_topk")
    base = read_any_config(path)
    cfg = dataclasses.replace(base, kv_source_layers=(0, 1, 2, 1), kv_source_shares_topk=(False, False, False, True))
    cfg.validate()
    weights = load_state_dict(path, cfg, torch.float64)
    assert not any(k.startswith("model.layers.3.self_attn.compressor.") for k in weights)
    model = DeepseekV4Model(cfg, weights, torch.float64, torch.device("cpu"))
    prompt = random_prompts([29], cfg.vocab_size, seed=2)[0]
    full = model.prefill(prompt, chunk_tokens=64, all_logits=True)
    assert {layer for layer, _ in full.state.entries} == {1, 2}
    state = model.new_state(64)
    for t, token in enumerate(prompt):
        step = V4StepKV([state], 1, model.device)
        out = model.forward(torch.tensor([[token]]), None, step, record_selections=True)
        step.commit()
        torch.testing.assert_close(out.logits[0, -1].double(), full.all_logits[t].double(), rtol=1e-5, atol=1e-5)
    assert out.selections[3] is out.selections[1]  # reused, not recomputed
    assert not torch.equal(full.all_logits, DeepseekV4Model.from_checkpoint(path, torch.float64)
                           .prefill(prompt, all_logits=True).all_logits)  # the reuse really changes the model

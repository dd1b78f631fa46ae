"""Speculative sampling keeps the target's output distribution, measured end to end through the engine.

With the demo pair and temperature 1 / top-k 4, the first token comes from prefill and the second from a
verification step (drafts drawn from the drafter's own softmax q, accepted with probability min(1, p/q), else
resampled from the residual). The exact joint law of the first two tokens is p(t1)·p(t2 | t1), computed from the
target's logits. Bound: total variation between the empirical joint over 16 outcomes from N = 800 seeded requests
and the exact one < 0.1 (measured ≈ 0.03); any emitted pair outside the target's support fails at once. The demo
drafter's q is close to p here, so subtle acceptance biases are left to the unit test in test_acceptance.py
(200k draws with q far from p, TV < 0.02).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dhisparse import LLM, SamplingParams
from dhisparse.sampling.sampler import filtered_probs

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
N = 800


@pytest.fixture(scope="module")
def demo_engine(tmp_path_factory) -> Path:
    if not (DEMO / "target" / "config.json").exists():
        pytest.skip("demo models not present")
    from dhisparse_builder import BuildOptions, build_engine

    return build_engine(BuildOptions(DEMO / "target", tmp_path_factory.mktemp("demo") / "engine", {},
                                     drafters=(DEMO / "dflash2", DEMO / "dspark")), progress=lambda d, t: None)


def _probs(llm: LLM, tokens: list[int], params: SamplingParams) -> torch.Tensor:
    logits = llm.engine.model.prefill(tokens).logits.unsqueeze(0)
    one = torch.ones(1, dtype=torch.float64)
    return filtered_probs(logits, one * params.temperature, torch.tensor([params.top_k]), one * params.top_p)[0]


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_two_token_joint_distribution_is_the_targets(demo_engine, kind):
    prompt = list(b"ROMEO. But soft, what light through yonder window breaks? It is the east, and ")
    params = [SamplingParams(max_tokens=2, temperature=1.0, top_k=4, seed=s, ignore_eos=True) for s in range(N)]
    llm = LLM(demo_engine, kv_policy="adaptive", speculative=kind, num_draft_tokens=3, max_batch_size=64,
              dspark_busy_batch=1 << 20)
    outs = llm.generate([prompt] * N, params)
    stats = llm.stats()
    assert stats["draft_tokens_accepted"] > 0.2 * N  # the accept path really runs, not only resampling
    p1 = _probs(llm, prompt, params[0])
    exact: dict[tuple[int, int], float] = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = _probs(llm, prompt + [t1], params[0])
        for t2 in torch.nonzero(p2).flatten().tolist():
            exact[(t1, t2)] = float(p1[t1] * p2[t2])
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        key = (o.token_ids[0], o.token_ids[1])
        assert key in exact, f"sampled {key}, which has probability 0"
        counts[key] = counts.get(key, 0) + 1
    tv = 0.5 * sum(abs(counts.get(k, 0) / N - v) for k, v in exact.items())
    assert tv < 0.1, tv

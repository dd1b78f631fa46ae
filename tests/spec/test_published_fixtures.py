"""Published drafters are exact against their reference implementations.

``tests/fixtures/drafters/<case>/`` holds a tiny random checkpoint in a published format, written by the publisher's
own code, and that code's proposals over several verification steps of three sequences (made by
``scripts/make_drafter_fixtures.py``; the references are not in this repository). Here the checkpoint is loaded by
our runtime through the engine's ``Speculator`` (draft ring, batched over the three sequences) and every proposal
must match: the tokens exactly, the probabilities the choices were made from, the confidence logits and the
confidence cut.

The target is represented by what a drafter reads of it (the fixture's embedding, LM head, token ids and per-position
features), with the fixture's sizes as its config; the end-to-end tests run the drafters over real targets.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from dhisparse.spec.proposal_law import confident_length
from dhisparse.spec.speculator import Speculator

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "drafters"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").exists()) if FIXTURES.is_dir() else []


def _setup(case: str, gamma: int | None = None):
    root = FIXTURES / case
    meta = json.loads((root / "expected.json").read_text())
    target = load_file(str(root / "target.safetensors"))
    expected = load_file(str(root / "expected.safetensors"))
    vocab, hidden = target["embed"].shape
    cfg = SimpleNamespace(hidden_size=hidden, vocab_size=vocab, num_hidden_layers=4, max_position_embeddings=256)
    model = SimpleNamespace(embed=target["embed"], lm_head=target["lm_head"], dtype=torch.float64)
    gamma = gamma or meta["gammas"]["full"]
    spec = Speculator(root / "checkpoint", gamma, len(meta["prompts"]), cfg, torch.device("cpu"), target_model=model)
    return meta, target, expected, spec


def _replay(meta, target, spec):
    """Yield ``(step, DraftOutput)`` for every verification step of the three sequences, batched."""
    prompts, schedule = meta["prompts"], meta["schedule"]
    b = len(prompts)
    slots = torch.tensor([spec.start(target["features"][i, :p]) for i, p in enumerate(prompts)])
    starts = list(prompts)
    published = spec.published
    assert published is not None
    zeros = torch.zeros(b, dtype=torch.float64)
    for step in range(len(schedule[0])):
        last = torch.stack([target["tokens"][i, s] for i, s in enumerate(starts)])
        u = torch.zeros(b, spec.gamma, dtype=torch.float64)
        out = published.drafter.propose(published.context(slots), last, spec.gamma, zeros, u)
        yield step, out
        kept = torch.tensor([schedule[i][step] + 1 for i in range(b)])
        width = int(kept.max())
        features = torch.stack([target["features"][i, s:s + width] for i, s in enumerate(starts)])
        spec.advance(slots, features, kept)
        starts = [s + int(k) for s, k in zip(starts, kept, strict=True)]


@pytest.mark.skipif(not CASES, reason="no drafter fixtures (scripts/make_drafter_fixtures.py)")
@pytest.mark.parametrize("case", CASES)
def test_proposals_equal_the_reference(case):
    meta, target, expected, spec = _setup(case)
    for step, out in _replay(meta, target, spec):
        prefix = "full." if "full.tokens" in expected else ""
        assert torch.equal(out.tokens, expected[f"{prefix}tokens"][:, step, :spec.gamma]), (case, step)
        probs = torch.softmax(out.scores, dim=-1)
        want = expected[f"{prefix}probs"][:, step, :spec.gamma]
        if "candidates" in expected:  # DFlash2: the realized selector row over the K candidates
            ids = expected["candidates"][:, step, :spec.gamma]
            probs = probs.gather(-1, ids)
        torch.testing.assert_close(probs, want, atol=5e-6, rtol=0)  # measured <= 6.2e-7 (float32 norms, softmax)
        if "confidence" in expected and meta.get("confidence") != "none":
            assert out.confidence is not None
            torch.testing.assert_close(out.confidence.double(), expected["confidence"][:, step].double(),
                                       atol=1e-5, rtol=0)
            for j, threshold in enumerate(meta["thresholds"]):
                cut = confident_length(out.confidence, threshold)
                assert cut.tolist() == expected["cut"][:, step, j].tolist(), (case, step, threshold)
        elif "confidence" in expected:
            assert out.confidence is None


@pytest.mark.skipif("dflash" not in CASES, reason="no DFlash fixture")
def test_dflash_shorter_block_equals_the_reference_with_that_block():
    """γ below the checkpoint's block runs a block of 1 + γ queries (vLLM's num_speculative_tokens = γ; z-lab's
    reference with block_size = 1 + γ)."""
    meta, target, expected, spec = _setup("dflash", gamma=meta_gamma("dflash", "short"))
    for step, out in _replay(meta, target, spec):
        assert torch.equal(out.tokens, expected["short.tokens"][:, step]), step
        torch.testing.assert_close(torch.softmax(out.scores, dim=-1), expected["short.probs"][:, step], atol=5e-6,
                                   rtol=0)


def meta_gamma(case: str, key: str) -> int:
    return json.loads((FIXTURES / case / "expected.json").read_text())["gammas"][key]

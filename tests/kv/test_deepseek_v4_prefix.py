"""DeepSeek-V4 prefix reuse below the engine: a prefill restarted after a cached prefix equals a full one.

``model/deepseek_v4/prefix.py``: with every compressed entry complete within the hit restored, the prefill restarts at
``restart_position(hit)`` and recomputes the sliding windows and the compressors' pending projections; from the hit on
its logits are transformers' (float64, 16 indexer heads: no ``relu`` ties at the top-k boundary) and its final state
is the full prefill's. Restarting one position later, or one window before the hit, is not exact (the margin is
needed). ``kv/prefix_v4.py``: a page's packed state (indexer keys, HCA entries of the windows its span completes)
unpacks to exactly the entries it was saved from.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompts
from tiny_v4 import CONFIGS, load_v4_reference, make_v4_checkpoint

from dhisparse.kv.prefix_v4 import V4PrefixRows
from dhisparse.model.deepseek_v4.model import DeepseekV4Model
from dhisparse.model.deepseek_v4.prefix import restart_position, restored_state

NAMES = sorted(CONFIGS)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models(tiny_root):
    out = {}
    for name in NAMES:
        path = make_v4_checkpoint(tiny_root, name)
        out[name] = (DeepseekV4Model.from_checkpoint(path, dtype=torch.float64), load_v4_reference(path))
    return out


def _restarted(model: DeepseekV4Model, prompt: list[int], hit: int, start: int, chunk: int = 16):
    """Prefill ``prompt`` from ``start`` over the entries a prefill of its first ``hit`` tokens completed."""
    cached = model.prefill(prompt[:hit], chunk_tokens=chunk).state
    cfg = model.cfg
    entries = {k: t[: hit // cfg.compress_rate(k[0])].clone() for k, t in cached.entries.items()}
    state = restored_state(cfg, len(prompt), torch.float64, CPU, start, hit, entries)
    return model.prefill(prompt, chunk_tokens=chunk, store=state, start=start, all_logits=True)


def test_restart_position_by_hand() -> None:
    """v4_small_topk: layers sliding, CSA (rate 4), HCA (rate 8), CSA; window 8, so each layer's exact region trails the
    one below by 7 and layer 3 needs its input exact from min(hit - 7, (hit // 4 - 1) * 4): restart at that - 3 * 7
    (the window binds: hit - 28)."""
    from tiny_v4 import BASE

    from dhisparse.model.deepseek_v4.config import DeepseekV4Config

    cfg = DeepseekV4Config.from_hf_dict({**BASE, "model_type": "deepseek_v4"})
    assert [restart_position(cfg, h) for h in (12, 28, 44, 45, 60)] == [0, 0, 16, 17, 32]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("hit", [24, 41, 60])
def test_restarted_prefill_equals_transformers_after_the_hit(models, name, hit) -> None:
    model, ref = models[name]
    prompt = random_prompts([83], model.cfg.vocab_size, seed=hit)[0]
    start = restart_position(model.cfg, hit)
    out = _restarted(model, prompt, hit, start)
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    assert out.all_logits.shape[0] == len(prompt) - start  # only the positions from the restart are computed
    torch.testing.assert_close(out.all_logits[hit - start:].double(), expected[hit:], rtol=1e-5, atol=1e-5)
    full = model.prefill(prompt, chunk_tokens=16).state
    for a, b in zip(out.state.window, full.window, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for key, (kv, gate) in full.pending.items():
        torch.testing.assert_close(out.state.pending[key][0], kv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.state.pending[key][1], gate, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_a_later_restart_is_not_exact(models, name) -> None:
    """The margin is needed: restarting one window before the hit, or halfway from the restart position to the hit,
    changes the logits after it (by far more than rounding)."""
    model, _ = models[name]
    prompt = random_prompts([83], model.cfg.vocab_size, seed=5)[0]
    hit = 60
    start = restart_position(model.cfg, hit)
    exact = _restarted(model, prompt, hit, start).all_logits[hit - start:]
    for later in (hit - model.cfg.sliding_window, (start + hit) // 2):
        got = _restarted(model, prompt, hit, later).all_logits[hit - later:]
        assert (got - exact).abs().max() > 1e-3, later


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("page_rows", [2, 4])
def test_page_state_round_trip(models, name, page_rows) -> None:
    """Each page's packed state holds the indexer keys and HCA entries of the windows its span completes (HCA
    windows straddle pages: rate 7 over spans of 3-token entries); a hit on ``n`` pages gets every one back."""
    model, _ = models[name]
    cfg = model.cfg
    tables = {k: torch.randn(50, t.shape[1], dtype=torch.float64) for k, t in model.new_state(200).entries.items()
              if not (k[1] == "kv" and cfg.compress_rate(k[0]) == cfg.compress_rate_csa)}
    rows = V4PrefixRows(cfg, page_rows, lambda rid: tables, lambda rid: None)
    n = 5
    rows.load_state("r", torch.stack([rows.save_state("r", i) for i in range(n)]))
    hit, entries = rows.take_hit("r")
    assert hit == (n * page_rows - 1) * cfg.compress_rate_csa
    assert set(entries) == set(tables)
    for key, got in entries.items():
        assert torch.equal(got, tables[key][: hit // cfg.compress_rate(key[0])])
    assert rows.take_hit("r") is None  # once

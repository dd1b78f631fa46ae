"""Every allocation a forward makes beside the KV pool stays within the workspace bound computed at start from the
configuration (measured with torch's memory profiler on CPU, prefill and decode at several context lengths), and
at a long context the untiled indexer scoring, or prefill attention untiled over queries, of earlier versions
would exceed it; tiling changes no token. Prompts stream into the hierarchy's host pages chunk by chunk, so
the prefill's own device KV is one chunk (a LocalKV of the whole prompt holds every row)."""

from __future__ import annotations

import pytest
import torch
from memory_peak import peak_bytes
from tiny_models import random_prompts

from dhisparse import LLM, SamplingParams
from dhisparse.engine.workspace import workspace_bound
from dhisparse.kv.prefill_stream import StreamedPrefillKV
from dhisparse.model import attention
from dhisparse.model.weights import read_config

TILE = 16


def _llm(engine_dir, pool_bytes: int, chunk: int = 32) -> LLM:
    return LLM(engine_dir, kv_policy="hisparse", max_batch_size=2, prefill_chunk_tokens=chunk, page_rows=16,
               pool_bytes=pool_bytes, max_model_len=320)


def test_forward_allocations_stay_within_pool_plus_workspace_bound(tiny_engine, monkeypatch) -> None:
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    monkeypatch.setattr(attention, "INDEX_TILE_TOKENS", TILE)  # several tiles at these context lengths
    pool = _llm(engine_dir, 1 << 30).engine.kv.required_bytes(256, 2) * 2  # one long request fits
    llm = _llm(engine_dir, pool)
    bound = llm.engine.workspace.total_bytes
    assert llm.stats()["workspace_bound_bytes"] == bound
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate(random_prompts([20], 96, seed=1), params)  # allocates the host store's chunk (host memory)
    assert llm.engine.kv.stream_prefill  # hisparse: prompts stream into their host pages chunk by chunk
    for length in (64, 256):
        prompt = random_prompts([length], 96, seed=length)
        peak = peak_bytes(lambda p=prompt: llm.generate(p, params))
        assert peak <= pool + bound, f"context {length}: peak {peak} > pool {pool} + bound {bound}"
    # The same long request with the whole context scored at once (the untiled indexer) exceeds it.
    monkeypatch.setattr(attention, "INDEX_TILE_TOKENS", 1 << 30)
    untiled = peak_bytes(lambda: llm.generate(random_prompts([256], 96, seed=256), params))
    assert untiled > pool + bound


@pytest.mark.parametrize("tile", [7])
def test_tiled_indexer_selects_what_one_tile_selects(tiny_engine, monkeypatch, tile) -> None:
    """Greedy tokens with the indexer tiled (keys and queries, prefill attention over query tiles) equal the dense
    store's single-tile tokens (distinct scores: same top-k, same order)."""
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    prompts = random_prompts([150, 97], 96, seed=11)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in LLM(engine_dir, kv_policy="dense").generate(prompts, params)]
    monkeypatch.setattr(attention, "INDEX_TILE_TOKENS", tile)
    monkeypatch.setattr(attention, "QUERY_TILE_TOKENS", tile)
    got = [o.token_ids for o in LLM(engine_dir, kv_policy="adaptive", page_rows=4).generate(prompts, params)]
    assert got == want
    assert torch.equal(torch.tensor([len(g) for g in got]), torch.tensor([6, 6]))


def test_prefill_attention_tiled_over_queries_stays_within_the_bound(tiny_engine, monkeypatch) -> None:
    """A whole 256-token prompt in one prefill chunk, every query attending to every earlier row (index_topk 512):
    attention over one query tile at a time stays within pool + bound, the same prompt with all queries at once
    (earlier versions) exceeds it, and both give the same tokens."""
    engine_dir = tiny_engine("dsv32_dense_topk_large", "float32")
    monkeypatch.setattr(attention, "INDEX_TILE_TOKENS", 8 * TILE)
    monkeypatch.setattr(attention, "QUERY_TILE_TOKENS", 2 * TILE)
    pool = _llm(engine_dir, 1 << 30, 256).engine.kv.required_bytes(256, 2) * 2
    llm = _llm(engine_dir, pool, 256)
    bound = llm.engine.workspace.total_bytes
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.generate(random_prompts([20], 96, seed=1), params)  # allocates the host store's chunk (host memory)
    outputs: dict[str, list[int]] = {}
    prompt = random_prompts([256], 96, seed=256)
    peak = peak_bytes(lambda: outputs.__setitem__("tiled", llm.generate(prompt, params)[0].token_ids))
    assert peak <= pool + bound, f"peak {peak} > pool {pool} + bound {bound}"
    monkeypatch.setattr(attention, "QUERY_TILE_TOKENS", 1 << 30)  # the indexer's keys stay tiled
    untiled = peak_bytes(lambda: outputs.__setitem__("untiled", llm.generate(prompt, params)[0].token_ids))
    assert untiled > pool + bound
    assert outputs["tiled"] == outputs["untiled"] and len(outputs["tiled"]) == 3


def test_streamed_prefill_holds_one_chunk_of_rows_on_the_device(tiny_engine, monkeypatch) -> None:
    """A prompt streamed into its host pages chunk by chunk gives the LocalKV prefill's logits, keys and rows exactly,
    and its peak is lower by the rows of every chunk but one (a LocalKV holds the whole prompt's rows)."""
    monkeypatch.setattr(attention, "INDEX_TILE_TOKENS", TILE)
    llm = _llm(tiny_engine("glm_fsfs_sparse", "float32"), 1 << 24)
    kv, model = llm.engine.kv, llm.engine.model
    length, chunk = 160, 32
    prompt = random_prompts([length], 96, seed=3)[0]
    assert kv.try_admit("r", length, 2)
    target = kv.import_target("r")
    row_index = target.row_index
    store = StreamedPrefillKV(kv.layout, target.rows, row_index, chunk, model.dtype, model.device)
    got: list = []
    streamed = peak_bytes(lambda: got.append(model.prefill(prompt, chunk_tokens=chunk, store=store)))
    local = peak_bytes(lambda: got.append(model.prefill(prompt, chunk_tokens=chunk)))
    out, want = got
    assert out.rows is None and torch.equal(out.logits, want.logits)
    assert all(torch.equal(out.index_keys[i][:length], want.index_keys[i]) for i in want.index_keys)
    host_rows = kv.host.rows.index_select(0, row_index.reshape(-1)).view_as(want.rows)
    assert torch.equal(host_rows, want.rows)
    rows_past_one_chunk = (length - chunk) * model.cfg.num_hidden_layers * model.cfg.row_dim * 4
    assert local - streamed >= 0.9 * rows_past_one_chunk, (local, streamed, rows_past_one_chunk)
    kv.import_prompt("r", None, out.index_keys)
    kv.release("r")
    kv.check_invariants()


def test_bound_grows_with_max_model_len_only_by_the_prompts_indexer_keys(tiny_checkpoint) -> None:
    """With a streamed prefill the indexer, attention and activation terms do not depend on max_model_len, and the
    prefill's KV grows only by the prompt's indexer keys when they are held until import (FP8 keys), not at all
    when they are written into the request's key pages (native keys); a LocalKV prefill grows by every layer's rows
    too."""
    cfg = read_config(tiny_checkpoint("glm_fsfs_sparse"))
    e, keys_per_token = 4, len(cfg.indexer_layers) * cfg.index_head_dim * 4

    def bound(length: int, streamed: bool, keys_in_place: bool = False):
        return workspace_bound(cfg, torch.float32, max_batch_size=2, prefill_chunk_tokens=32, query_len=1,
                               max_model_len=length, page_rows=16, hot_rows=8, streamed_prefill=streamed,
                               keys_in_place=keys_in_place)
    assert bound(4096, True, True).prefill_kv_bytes == bound(65536, True, True).prefill_kv_bytes
    short, long = bound(4096, True), bound(65536, True)
    assert (short.indexer_bytes, short.attention_bytes, short.activation_bytes) == (
        long.indexer_bytes, long.attention_bytes, long.activation_bytes)
    assert long.prefill_kv_bytes - short.prefill_kv_bytes == (65536 - 4096) * keys_per_token
    rows_per_token = cfg.num_hidden_layers * cfg.row_dim * e
    local_growth = bound(65536, False).prefill_kv_bytes - bound(4096, False).prefill_kv_bytes
    assert local_growth == (65536 - 4096) * (keys_per_token + rows_per_token)

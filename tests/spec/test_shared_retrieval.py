"""Shared missing-row retrieval: the γ+1 verification queries of a request select overlapping rows, and a row
selected by several of them is copied from host at most once per step (counter-based)."""

from __future__ import annotations

import torch

from dhisparse.kv import KVConfig, KVLayout, KVManager


def _manager(policy: str = "hisparse") -> KVManager:
    layout = KVLayout(num_layers=2, source_of_layer=(0, 1), row_dim=4, dtype=torch.float64, indexer_layers=(0,),
                      index_key_dim=2, index_topk=4, index_groups=((0, 1),))
    config = KVConfig(policy=policy, pool_bytes=1 << 20, hot_rows=20, page_rows=4, max_query_len=5)
    return KVManager(layout, config, torch.device("cpu"))


def test_union_of_verification_selections_is_fetched_once():
    m = _manager()
    prompt = 40
    rows = torch.randn(2, prompt, 4, dtype=torch.float64)
    assert m.try_admit("r", prompt, 8)
    m.import_prompt("r", rows, {0: torch.randn(prompt, 2, dtype=torch.float64)})
    m.poll()  # hisparse: the prompt now lives on host only
    before = m.stats()
    step = m.begin_step(["r"], 5)
    new = torch.randn(1, 5, 4, dtype=torch.float64)
    for layer in (0, 1):
        step.write(layer, new, torch.randn(1, 5, 2, dtype=torch.float64) if layer == 0 else None)
    # five queries, twenty selections, but only six distinct history rows (plus tail rows that are direct)
    selection = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3, 9], [0, 9, 17, 40], [3, 9, 17, 44]]])
    got0 = step.gather(0, selection)
    got1 = step.gather(1, selection)  # shared layer of the group: resolved and prefetched with layer 0
    m.end_step({"r": 5})
    after = m.stats()
    distinct_history = {0, 1, 2, 3, 9, 17}
    fetched = after["kv_host_fetched_rows"] - before["kv_host_fetched_rows"]
    assert fetched == 2 * len(distinct_history)  # once per row and source, although selected up to 4 times
    assert after["kv_host_fetched_bytes"] - before["kv_host_fetched_bytes"] == fetched * 4 * 8
    full = {0: torch.cat([rows[0], new[0]]), 1: torch.cat([rows[1], new[0]])}
    assert torch.equal(got0[0], full[0][selection[0]])
    assert torch.equal(got1[0], full[1][selection[0]])
    # the next step finds them in the hot cache: nothing fetched again
    step = m.begin_step(["r"], 5)
    for layer in (0, 1):
        step.write(layer, new, torch.randn(1, 5, 2, dtype=torch.float64) if layer == 0 else None)
    again = torch.tensor([[[0, 1, 2, 3]] * 5])
    step.gather(0, again)
    step.gather(1, again)
    m.end_step({"r": 1})
    assert m.stats()["kv_host_fetched_rows"] == after["kv_host_fetched_rows"]
    m.release("r")
    m.poll()
    m.check_invariants()
    assert m.stats()["kv_required_bytes"] == 0

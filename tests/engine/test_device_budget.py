"""One device budget: what the KV side keeps on the device is the arena (``pool_bytes``, where requests' pages and
their indexer keys live) plus a fixed state that is part of the workspace bound printed at start (the persistent
batch state, the draft ring, the arena's scratch and zero pages). Measured with torch's memory profiler on CPU
while the KV manager is built and while requests run; with many slots and a long ``max_model_len`` the per-slot
indexer keys of earlier versions (``max_batch_size * max_model_len`` keys per indexer layer beside the pool) would
exceed the arena and fixed state together. Paged keys change no token."""

from __future__ import annotations

import torch
from memory_peak import peak_bytes
from tiny_models import build_spec_engine, random_prompts

from dhisparse import LLM, SamplingParams
from dhisparse.kv.batch_state import BatchState
from dhisparse.kv.factory import make_kv_store


def _old_key_slots_bytes(kv) -> int:
    """The dense per-slot indexer keys of earlier versions: every slot, every position of max_model_len."""
    layout, cfg = kv.layout, kv.config
    positions = BatchState(layout, cfg, torch.device("cpu"), 0).pages_for(cfg.max_model_len) * cfg.page_rows
    return cfg.max_batch_size * positions * len(layout.indexer_layers) * layout.index_key_bytes


def test_kv_state_is_the_pool_plus_the_fixed_part_of_the_bound(tiny_engine) -> None:
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    options = dict(kv_policy="adaptive", max_batch_size=32, page_rows=16, max_model_len=1024)
    probe = LLM(engine_dir, **options)
    pool = 3 * probe.engine.kv.required_bytes(200, 12)  # three long requests at once
    llm = LLM(engine_dir, pool_bytes=pool, **options)
    engine, kv = llm.engine, llm.engine.kv
    bound = engine.workspace
    # Building the KV side allocates the arena and the fixed state, nothing else, and the bound counts the latter.
    made = []
    kv_config = engine.cfg.kv_config(engine.executor.query_len, 0, engine.max_model_len)
    built = peak_bytes(lambda: made.append(make_kv_store(engine.model.cfg, policy=engine.cfg.kv_policy,
                                                         dtype=engine.cfg.torch_dtype, device=engine.model.device,
                                                         kv_config=kv_config)))
    assert made[0].batch.nbytes == kv.batch.nbytes == BatchState.size_bytes(kv.layout, kv.config)
    assert built <= pool + bound.kv_fixed_bytes, (built, pool, bound.kv_fixed_bytes)
    assert kv.pool.num_pages * kv.pool.page_bytes <= pool
    # Earlier versions kept max_batch_size x max_model_len keys per indexer layer beside the pool: alone more than the
    # arena and the fixed state together at this configuration (at real scale, 32 slots x 128K positions x 61
    # indexer layers, about 64 GB; the tiny model's forward temporaries dominate the rest of its bound).
    assert _old_key_slots_bytes(kv) > pool + bound.kv_fixed_bytes
    # Requests' keys are arena pages charged at admission.
    fp = kv.footprint(200, 12)
    per_page = kv.pool.keys_per_page
    assert fp.key_blocks == -(-fp.capacity_rows // per_page)
    assert fp.index_key_bytes == len(kv.layout.indexer_layers) * fp.key_blocks * kv.pool.page_bytes
    # Running requests (irregular lengths, more than fit at once): the tokens of the dense store, and every
    # allocation beyond the arena and fixed state within the rest of the bound.
    lengths = [200, 37, 181, 129]
    prompts = random_prompts(lengths, 96, seed=5)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in LLM(engine_dir, kv_policy="dense").generate(prompts, params)]
    llm.generate(random_prompts([20], 96, seed=1), SamplingParams(max_tokens=2, ignore_eos=True))  # host chunk
    got: list = []
    peak = peak_bytes(lambda: got.extend(o.token_ids for o in llm.generate(prompts, params)))
    assert got == want
    assert peak <= bound.total_bytes - bound.kv_fixed_bytes, (peak, bound.describe())
    assert llm.stats()["kv_admissions_waited"] >= 1  # the pool really bounded the batch
    kv.poll()
    kv.check_invariants()
    assert kv.pool.free_pages == kv.pool.num_pages  # every key page came back


def test_speculative_step_stays_within_the_bound_and_the_ring_is_counted(tiny_checkpoint, tmp_path) -> None:
    engine_dir = build_spec_engine(tmp_path, tiny_checkpoint("glm_fsfs_sparse"), dtype="float32")
    options = dict(kv_policy="hisparse", max_batch_size=4, page_rows=8, speculative="dflash2", num_draft_tokens=3)
    pool = 2 * LLM(engine_dir, **options).engine.kv.required_bytes(96, 10)
    llm = LLM(engine_dir, pool_bytes=pool, **options)
    engine = llm.engine
    ring = engine.spec.ring
    ring_bytes = ring.rows.numel() * ring.rows.element_size() + ring.count.numel() * ring.count.element_size()
    assert engine.workspace.kv_fixed_bytes == engine.kv.batch.nbytes + ring_bytes + (
        2 * engine.kv.config.page_rows) * engine.kv.layout.row_bytes
    prompts = random_prompts([96, 33, 61], 96, seed=9)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in LLM(engine_dir, kv_policy="dense").generate(prompts, params)]
    llm.generate(random_prompts([20], 96, seed=1), SamplingParams(max_tokens=2, ignore_eos=True))
    got: list = []
    peak = peak_bytes(lambda: got.extend(o.token_ids for o in llm.generate(prompts, params)))
    assert got == want
    assert llm.stats()["verify_steps"] > 0
    bound = engine.workspace
    assert peak <= bound.total_bytes - bound.kv_fixed_bytes, (peak, bound.describe())

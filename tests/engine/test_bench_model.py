"""scripts/bench_model.py measures what it says: in lockstep, each store takes exactly ``decode_steps`` pure decode
steps after the step that prefills, every step is timed, the direct-path share is recorded, the tokens of both
stores are compared, and the engines are left as they were (no timing hook stays installed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from dhisparse import LLM

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_model.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_model", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_lockstep_runs_time_every_pure_decode_step(tiny_engine) -> None:
    bench = _bench_module()
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    # 4-row pages: decode pages leave the tail, so later adaptive steps run the full resolver.
    llms = {p: LLM(engine_dir, kv_policy=p, max_batch_size=4, page_rows=4) for p in bench.POLICIES}
    engines = {p: bench._TimedEngine(llm) for p, llm in llms.items()}
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, llms["dense"].vocab_size, (n,), generator=g).tolist() for n in (21, 24)]
    decode_steps = 9
    runs = bench.run_lockstep(engines, prompts, decode_steps, ("adaptive", "dense"))
    for p, run in runs.items():
        assert len(run.decode_cpu_s) == len(run.decode_wall_s) == decode_steps, p
        assert run.decode_tokens == decode_steps * len(prompts)
        assert run.prefill_s > 0 and all(t >= 0 for t in run.decode_wall_s)
        assert [len(t) for t in run.tokens] == [decode_steps + 2] * len(prompts)
        assert "begin_step" not in vars(llms[p].engine.kv)  # the hook is gone
        assert not llms[p].engine.requests
    assert runs["adaptive"].tokens == runs["dense"].tokens
    assert runs["dense"].direct_steps == decode_steps  # no hierarchy: counted as direct
    assert 0 < runs["adaptive"].direct_steps < decode_steps  # some steps went through the resolver

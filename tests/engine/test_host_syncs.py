"""A decode step reads the device on the host a constant number of times, whatever the number of layers and
requests: counted by the one helper every read goes through (``kv_host_syncs``), and audited — no per-layer KV
call reads a tensor value on the host outside that helper. (Engine level over 2 and 4 layers here; the KV side
alone over 2 and 12 layers in tests/kv/test_kv_deferred_checks.py; verification steps in tests/spec.)"""

from __future__ import annotations

import torch
from tiny_models import random_prompts
from torch.overrides import TorchFunctionMode

from dhisparse import LLM, SamplingParams
from dhisparse.host_values import HostSync

# Tensor operations that hand a value to the host (a device synchronisation on a GPU).
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy, torch.equal,
          torch.Tensor.nonzero, torch.nonzero, torch.Tensor.unique, torch.unique, torch.Tensor.masked_select}


class _ReadAudit(TorchFunctionMode):
    """Counts host reads of tensor values that do not go through a :class:`HostSync`."""

    def __init__(self, sync: HostSync) -> None:
        super().__init__()
        self.sync, self.reads = sync, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.sync.active:
            bool_index = func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor) and (
                args[1].dtype == torch.bool)
            if func in _READS or bool_index:
                self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _audited(step, audit: _ReadAudit):
    """Wrap the per-layer calls of a StepKV so that they run under the audit."""
    for name in ("write", "index_keys", "gather"):
        inner = getattr(step, name)

        def call(*a, _inner=inner, **k):
            with audit:
                return _inner(*a, **k)
        setattr(step, name, call)
    return step


def test_decode_step_reads_the_host_a_constant_number_of_times(tiny_engine) -> None:
    per_step: dict[tuple[str, int], frozenset[int]] = {}
    prompts = random_prompts([30, 23, 37, 31, 28, 19, 36, 25], 96, seed=5)
    for name in ("glm_fsfs_2layer", "glm_fsfs_sparse"):
        engine_dir = tiny_engine(name, "float32")
        for batch in (1, 8):
            # hisparse: most selected rows are fetched from host (the fixed-shape copy path runs every step).
            # kernels="torch": the device-generic path, the one a GPU runs. (On a CPU device "auto" resolves
            # through the native library, which reads its own CPU outputs: tests/kv/test_kv_native_resolver.py.)
            llm = LLM(engine_dir, kv_policy="hisparse", page_rows=4, max_batch_size=8, kernels="torch")
            engine = llm.engine
            audit = _ReadAudit(engine.kv.sync)
            begin = engine.kv.begin_step
            engine.kv.begin_step = lambda ids, q, _b=begin, _a=audit: _audited(_b(ids, q), _a)
            for p in prompts[:batch]:
                engine.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True))
            engine.step()  # admission and prefill of every request, then the first decode step
            counts = []
            while engine.has_unfinished():
                before = engine.kv.sync.reads
                engine.step()
                counts.append(engine.kv.sync.reads - before)
            per_step[(name, batch)] = frozenset(counts)
            assert audit.reads == [], f"{name} batch {batch}: KV per-layer calls read the host: {audit.reads[:5]}"
            stats = llm.stats()
            assert stats["kv_rows_host"] > 0  # the fixed-shape host fetch path ran
    assert set(per_step.values()) == {frozenset({1})}, per_step  # one read per decode step everywhere



def test_model_forward_reads_nothing_on_the_host(tiny_engine) -> None:
    """The whole decode forward — attention, indexer, MoE dispatch (grouped in float32, masked in float64) and the
    KV calls — reads no tensor value on the host: the step's one read is the engine's token read."""
    prompts = random_prompts([30, 23, 37], 96, seed=6)
    for dtype in ("float32", "float64"):
        llm = LLM(tiny_engine("glm_fsfs_sparse", dtype), kv_policy="hisparse", page_rows=4, max_batch_size=4,
                  kernels="torch")  # the device-generic path (see above)
        engine = llm.engine
        audit = _ReadAudit(engine.kv.sync)
        forward = engine.model.forward

        def audited(*a, _f=forward, _a=audit, **k):
            with _a:
                return _f(*a, **k)
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
        engine.step()  # prefill (the MoE's one-off grouped-matmul probe runs here) and the first decode step
        engine.model.forward = audited
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        assert steps >= 2
        assert audit.reads == [], f"{dtype}: the decode forward read the host: {audit.reads[:5]}"

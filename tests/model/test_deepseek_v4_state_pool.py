"""The batched V4 state (slot-indexed pool) computes what the per-request state computes: decode and
verification steps with partial acceptance over a pool that had to grow its slots and entry tables."""

from __future__ import annotations

import torch
from tiny_v4 import BASE

from dhisparse.model.deepseek_v4.config import DeepseekV4Config
from dhisparse.model.deepseek_v4.kv_state import V4StepKV
from dhisparse.model.deepseek_v4.model import DeepseekV4Model
from dhisparse.model.deepseek_v4.state_pool import V4PooledStepKV, V4StatePool
from dhisparse.model.deepseek_v4.weights import expected_shapes


def _random_model() -> DeepseekV4Model:
    cfg = DeepseekV4Config.from_hf_dict({**BASE, "model_type": "deepseek_v4"})
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("tid2eid"):
            weights[name] = torch.randint(0, cfg.n_routed_experts, shape, generator=g)
        elif name.endswith(("norm.weight", "layernorm.weight", ".scale", "hc_scale")):
            weights[name] = 1 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            weights[name] = 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
    return DeepseekV4Model(cfg, weights, torch.float64, torch.device("cpu"))


def test_pooled_steps_equal_per_request_steps():
    model = _random_model()
    prompts = [[5, 9, 1], list(range(3, 30)), [7] * 13, list(range(40, 57))]
    reference = [model.prefill(p, chunk_tokens=8).state for p in prompts]
    pool = V4StatePool(model.cfg, torch.float64, model.device, slots=1)  # must grow to 4 slots
    slots = [pool.load(model.prefill(p, chunk_tokens=8).state) for p in prompts]
    assert pool.slots >= 4 and sorted(slots) == [0, 1, 2, 3]
    gen = torch.Generator().manual_seed(1)
    # plain decode steps, then verification blocks of 3 with partial acceptance, past several windows
    for q, accepted in [(1, None), (1, None), (3, [1, 3, 2, 1]), (3, [3, 3, 1, 2]), (1, None), (3, [2, 1, 3, 3])]:
        ids = torch.randint(0, model.cfg.vocab_size, (len(prompts), q), generator=gen)
        ref_step = V4StepKV(reference, q, model.device)
        ref = model.forward(ids, None, ref_step, all_logits=True).logits
        ref_step.commit(accepted)
        step = V4PooledStepKV(pool, slots, q, model.device)
        got = model.forward(ids, None, step, all_logits=True).logits
        step.commit(accepted)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    assert pool.length[slots].tolist() == [s.length for s in reference]
    for slot, state in zip(slots, reference, strict=True):
        assert pool.nbytes(slot)["csa_entries"] == state.nbytes()["csa_entries"] > 0

"""The KV step's native CPU resolution (``kernels="auto"`` on a CPU device): the step resolves a source, or an index
group's sources, with one call of ``libdhisparse_cpu.so`` (the resolver shared with the CUDA kernel) instead of
dozens of torch operations. Checked here: the selection and its start-up self-check, the failed-check fallback,
the deferred overflow check, and whole engine runs against the torch resolver — same greedy tokens and the same
residency statistics (direct / hot / host rows) on random prompts of irregular lengths, with host fetches.
The KV-level property test (tests/kv/test_kv_properties.py) and the per-step host-read test draw the native path
too."""

from __future__ import annotations

import pytest
import torch
from kv_driver import KVDriver, make_layout, make_manager
from tiny_models import build_spec_engine, make_checkpoint, random_prompts

from dhisparse import LLM, SamplingParams, native
from dhisparse.kernels.selection import check_native_resolver, select_kernels
from dhisparse.kernels.self_check import CheckResult
from dhisparse.kv.resolver import HotCacheOverflowError

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU library not built (setup_native.sh)")


def test_auto_on_cpu_resolves_natively_after_its_self_check() -> None:
    sel = select_kernels("auto", "cpu")
    assert sel.native_resolver is not None and sel.name == "torch" and not sel.on_device
    assert sel.self_check and all(r.ok for r in sel.self_check)
    assert sel.stats()["kernels_native_resolver"] == 1.0
    assert select_kernels("torch", "cpu").native_resolver is None  # torch means the torch resolver
    assert all(r.ok for r in check_native_resolver(native.load(), seed=3))


def test_a_failed_self_check_falls_back_to_the_torch_resolver(caplog) -> None:
    bad = [CheckResult("resolver", "R=1", "locations differ at [0, 0]")]
    sel = select_kernels("auto", "cpu", native_check=lambda lib: bad)
    assert sel.native_resolver is None and "self-check failed" in sel.reason
    assert "disagrees" in caplog.text


@pytest.mark.parametrize("native_path", [False, True], ids=["torch-resolver", "native-resolver"])
def test_a_hot_cache_overflow_is_raised_at_the_end_of_the_step(native_path) -> None:
    """A selection wider than the hot cache (six distinct missing positions, four hot-cache rows, no staging):
    both resolvers flag the overflow and the step raises it when its report is read, not at the resolution."""
    m = make_manager(make_layout("deepseek"), "hisparse", 1 << 20, hot_rows=4, page_rows=2, native=native_path)
    d = KVDriver(m)
    assert d.submit("a", 14, 4)
    m.poll()
    step = m.begin_step(["a"], 1)
    step.gather(0, torch.tensor([[[0, 2, 4, 6, 8, 10]]]))
    assert m.sync.reads == 0
    with pytest.raises(HotCacheOverflowError):
        m.end_step({"a": 1})


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("native_step")
    return build_spec_engine(tmp, make_checkpoint(tmp, "glm_fsfs_sparse"), dtype="float32")


STATS = ("kv_rows_direct", "kv_rows_hot", "kv_rows_host", "kv_resolver_calls", "kv_host_syncs")


@pytest.mark.parametrize("policy, speculative, page_rows", [
    ("hisparse", None, 4), ("adaptive", None, 8), ("adaptive", "dflash2", 4), ("hisparse", "dspark", 8),
])
def test_engine_tokens_and_residency_match_the_torch_resolver(engine_dir, policy, speculative, page_rows) -> None:
    prompts = random_prompts([37, 203, 118, 5], 96, seed=page_rows + len(policy))
    params = SamplingParams(max_tokens=19, ignore_eos=True)
    runs = {}
    for kernels in ("torch", "auto"):
        llm = LLM(engine_dir, kernels=kernels, kv_policy=policy, page_rows=page_rows, pool_bytes=120_000,
                  speculative=speculative, max_batch_size=4)
        outs = llm.generate(prompts, params)
        stats = llm.stats()
        runs[kernels] = ([o.token_ids for o in outs], {k: stats.get(k) for k in STATS},
                         stats["kv_kernels_native_resolver"])
    (torch_tokens, torch_stats, torch_native), (auto_tokens, auto_stats, auto_native) = runs["torch"], runs["auto"]
    assert (torch_native, auto_native) == (0.0, 1.0)
    assert auto_tokens == torch_tokens
    assert auto_stats == torch_stats
    assert auto_stats["kv_rows_host"] > 0  # the runs fetched from host: the fetch lists were exercised

"""The KV step's device-kernel path (``dhisparse.kv.resolution.cuda``) driven on CPU by stand-ins.

On a GPU the step resolves each index group with one step-resolver launch (hot state updated in the batch state's
slots, fetch lists, counts and flags written by the kernel), issues one row-copy launch per source on the copy
stream (``CopyEngine.issue_gather``), lets readers wait on the copy instead of the host, and attends with the
sparse MLA kernel over arena locations. Here the same plumbing runs with stand-ins: the step resolver is **the
kernel's own block code** executed on the CPU by the native library (``abi.emulate_launch``), the row copy and
attention are torch. Any mistake in the plumbing or the kernel — wrong host row, wrong slot, lost hot-cache update,
a fetch read before it is done, a staging row misplaced — changes the tokens or the statistics.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompts

from dhisparse import LLM, SamplingParams
from dhisparse.errors import ConfigError, RequestFailedError
from dhisparse.kernels import abi, native, selection
from dhisparse.kernels.resolver import HotCacheOverflowError
from dhisparse.kernels.selection import KernelSelection
from dhisparse.kernels.torch_kernels import TorchKernels

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU library not built (the step resolver's "
                                "block code runs on the CPU through it); run scripts/setup_native.sh")


class DevicePathStandIn(TorchKernels):
    """Kernel outputs computed by torch, selected as if they ran on the device."""

    name = "standin"
    on_device = True

    def __init__(self) -> None:
        self.calls = {"resolve_step": 0, "copy_rows": 0, "sparse_mla": 0}
        self.groups: list[int] = []  # sources per step-resolver launch
        self.hosts: list[torch.Tensor] = []  # what each row copy read from

    def resolve_step(self, stamp, positions, lengths, sources, slots, page_table, hot_pos, hot_stamp, hot_loc,
                     host_pages, staging, page_rows, out) -> None:
        """The CUDA step resolver's block code, run on the CPU over the same tensors (``dhs_emulate_launch``)."""
        self.calls["resolve_step"] += 1
        self.groups.append(sources.numel())
        args = abi.pack_step_resolver(stamp, positions, lengths, sources, slots, page_table, hot_pos, hot_stamp,
                                      hot_loc, host_pages, staging, page_rows, out)
        assert abi.emulate_launch(abi.KIND_STEP_RESOLVER, args) == abi.PLAN_OK

    def copy_rows(self, host_rows, device_rows, src_rows, dst_rows, stream=None) -> None:
        self.calls["copy_rows"] += 1
        self.hosts.append(host_rows)
        keep = src_rows >= 0
        device_rows[dst_rows[keep]] = host_rows[src_rows[keep]]

    def sparse_mla(self, q_lat, q_pe, kv, locations, softmax_scale, kv_format=None) -> torch.Tensor:
        """The model's attention arithmetic (``IndexedMLA``) over rows read by location."""
        self.calls["sparse_mla"] += 1
        rank = q_lat.shape[-1]
        rows = kv[locations.clamp(min=0)].masked_fill((locations < 0).unsqueeze(-1), 0)
        latent, pe = rows[..., :rank], rows[..., rank:]
        scores = torch.einsum("bqhr,bqkr->bqhk", q_lat, latent) + torch.einsum("bqhp,bqkp->bqhk", q_pe, pe)
        scores = (scores * softmax_scale).masked_fill((locations < 0).unsqueeze(2), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
        return torch.einsum("bqhk,bqkr->bqhr", probs, latent)


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> DevicePathStandIn:
    kernels = DevicePathStandIn()
    real = selection.select_kernels
    monkeypatch.setattr(selection, "select_kernels", lambda option, device: real(option, device)
                        if option == "torch" else KernelSelection(option, kernels, "test stand-in"))
    return kernels


def test_device_path_gives_the_torch_path_tokens_and_statistics(tiny_engine, standin) -> None:
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    prompts = random_prompts([9, 61], 96, seed=3)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    options = {"kv_policy": "adaptive", "page_rows": 4, "refill_pages_per_step": 2}
    probe = LLM(engine_dir, kernels="torch", **options)
    pool = 2 * probe.engine.kv.required_bytes(61, 8)  # tight: most prompt pages live on the host
    ref_llm = LLM(engine_dir, kernels="torch", pool_bytes=pool, **options)
    expected = [o.token_ids for o in ref_llm.generate(prompts, params)]
    llm = LLM(engine_dir, pool_bytes=pool, **options)
    assert llm.engine.kv.kernels.kernels is standin and ref_llm.engine.kv.kernels.name == "torch"
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    ref, now = ref_llm.stats(), llm.stats()
    for name in ("kv_rows_direct", "kv_rows_hot", "kv_rows_host", "kv_resolver_calls"):
        assert now[name] == ref[name], name
    assert now["kv_rows_host"] > 0  # the fetch path really ran
    assert all(count > 0 for count in standin.calls.values()), standin.calls
    assert sum(standin.groups) == now["kv_resolver_calls"]  # every source resolved by a launch …
    assert standin.calls["resolve_step"] < now["kv_resolver_calls"] and max(standin.groups) == 2  # … a group per launch
    llm.engine.kv.poll()
    llm.engine.kv.check_invariants()


def test_device_path_reads_a_many_chunk_host_store_with_one_launch_per_fetch(tiny_engine, standin,
                                                                             monkeypatch) -> None:
    """A host store of many small chunks (at real scale: 64 MiB chunks, hundreds of GB): each fetch is one row-copy
    launch over the store's mapped view (every chunk as one span), its rows translated to span rows on the device
    — not one launch per chunk — and the tokens and statistics stay the torch path's."""
    from dhisparse.kv import host_store

    defaults = host_store.HostStore.__init__.__defaults__
    monkeypatch.setattr(host_store.HostStore.__init__, "__defaults__", (*defaults[:-1], 4 << 10))  # 4 KiB chunks
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    prompts = random_prompts([9, 61, 40], 96, seed=5)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    options = {"kv_policy": "adaptive", "page_rows": 4, "refill_pages_per_step": 2}
    probe = LLM(engine_dir, kernels="torch", **options)
    pool = 2 * probe.engine.kv.required_bytes(61, 8)
    ref_llm = LLM(engine_dir, kernels="torch", pool_bytes=pool, **options)
    expected = [o.token_ids for o in ref_llm.generate(prompts, params)]
    llm = LLM(engine_dir, pool_bytes=pool, **options)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    ref, now = ref_llm.stats(), llm.stats()
    for name in ("kv_rows_direct", "kv_rows_hot", "kv_rows_host", "kv_resolver_calls"):
        assert now[name] == ref[name], name
    store = llm.engine.kv.host.rows
    assert len(store.chunks) > 8 and now["kv_rows_host"] > 0
    span = store.mapped(torch.device("cpu")).span
    assert 0 < standin.calls["copy_rows"] <= sum(standin.groups)  # one launch per source's fetch, not per chunk
    assert all(h.data_ptr() == span.data_ptr() and h.shape == span.shape for h in standin.hosts)
    llm.engine.kv.poll()
    llm.engine.kv.check_invariants()


def test_device_path_speculative_steps_stage_rows_like_the_torch_path(tiny_checkpoint, tmp_path, standin) -> None:
    """Verification steps (γ + 1 queries, a union larger than the hot cache): the step resolver takes staging rows
    for the misses past the evictable slots, as the torch resolver does: same tokens, same statistics."""
    from tiny_models import build_spec_engine

    engine_dir = build_spec_engine(tmp_path, tiny_checkpoint("glm_fsfs_sparse"))
    prompts = random_prompts([23, 70], 96, seed=8)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    options = {"kv_policy": "hisparse", "page_rows": 4, "speculative": "dflash2", "num_draft_tokens": 3}
    ref_llm = LLM(engine_dir, kernels="torch", **options)
    expected = [o.token_ids for o in ref_llm.generate(prompts, params)]
    llm = LLM(engine_dir, **options)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    ref, now = ref_llm.stats(), llm.stats()
    for name in ("kv_rows_direct", "kv_rows_hot", "kv_rows_host", "kv_rows_staged", "kv_resolver_calls"):
        assert now.get(name) == ref.get(name), name
    assert now["kv_rows_staged"] > 0 and standin.calls["resolve_step"] > 0  # staging really ran, on the kernel
    llm.engine.kv.poll()
    llm.engine.kv.check_invariants()


def test_device_path_reports_a_hot_cache_overflow_at_the_end_of_the_step(tiny_engine) -> None:
    class Overflowing(DevicePathStandIn):
        def resolve_step(self, *args, **kwargs):
            super().resolve_step(*args, **kwargs)
            args[-1]["flags"] |= native.STEP_HOT_CACHE_OVERFLOW  # what the kernel sets when a row overflows

    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    kernels = Overflowing()
    llm = LLM(engine_dir, kv_policy="hisparse", page_rows=4)
    llm.engine.kv.kernels = KernelSelection("cuda", kernels, "test stand-in")
    prompt = random_prompts([40], 96, seed=4)[0]
    with pytest.raises(RequestFailedError) as failure:  # the engine ends the request with the overflow's message
        llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    out = failure.value.outputs[0]
    assert out.finish_reason == "error"
    assert HotCacheOverflowError.__name__ in out.error and "hot cache overflowed" in out.error


def test_the_engine_selects_torch_on_cpu_and_refuses_cuda_kernels(tiny_engine) -> None:
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    with pytest.raises(ConfigError, match=r"kernels='cuda' needs device='cuda'"):
        LLM(engine_dir, kernels="cuda")
    with pytest.raises(ConfigError, match=r"kernels='cuda'"):
        LLM(engine_dir, kernels="cuda", kv_policy="dense")
    stats = LLM(engine_dir, kv_policy="adaptive").stats()
    assert stats["kv_kernels_cuda"] == 0.0 and stats["kv_kernels_fallback"] == 0.0

"""Self-check of a kernel set against the torch reference, run before an engine serves on a GPU.

Each kernel runs on small random inputs of irregular sizes (odd batch, selection and row counts, duplicates,
unused ``-1`` entries, pages that are and are not resident, masked attention entries, a fully masked query)
and is compared with :class:`dhisparse.kernels.torch_kernels.TorchKernels`: the resolver and the row copy
exactly (every output, every byte), attention within a tolerance of its dtype. The comparison functions are
pure and tested on CPU with deliberately wrong stand-ins, so that an untested kernel can never silently
corrupt output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dhisparse.host_values import to_device
from dhisparse.kernels.resolver import Resolution, resolve
from dhisparse.kernels.torch_kernels import TorchKernels

RESOLUTION_FIELDS = ("locations", "steps", "hot_pos", "hot_stamp", "copy_request", "copy_position", "copy_slot",
                     "copy_location", "counts")
ATTENTION_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


class KernelSelfCheckError(RuntimeError):
    """A kernel disagreed with the torch reference at start."""


@dataclass(frozen=True)
class CheckResult:
    kernel: str  # "resolver", "row_copy", "sparse_mla"
    case: str  # what was run, e.g. "R=3 N=211 B=260 int64"
    mismatch: str | None  # None: equal to the reference; else what differs, first place first

    @property
    def ok(self) -> bool:
        return self.mismatch is None


def compare_resolutions(got: Resolution, want: Resolution) -> str | None:
    """``None`` when every field is identical (values and shapes, compared as int64 on the CPU)."""
    for name in RESOLUTION_FIELDS:
        a, b = getattr(got, name).detach().cpu().long(), getattr(want, name).detach().cpu().long()
        if a.shape != b.shape:
            return f"{name}: shape {list(a.shape)} != reference {list(b.shape)}"
        diff = torch.nonzero(a != b)
        if diff.numel():
            at = tuple(int(i) for i in diff[0])
            return f"{name}{list(at)}: {int(a[at])} != reference {int(b[at])} ({diff.shape[0]} entries differ)"
    return None


def compare_rows(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """``None`` when the two ``[rows, ...]`` tensors are bitwise equal; else the first differing row."""
    a, b = got.detach().cpu(), want.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"rows: {list(a.shape)} {a.dtype} != reference {list(b.shape)} {b.dtype}"
    bad = (a.reshape(a.shape[0], -1).view(torch.uint8) != b.reshape(b.shape[0], -1).view(torch.uint8)).any(dim=1)
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten()
        return f"row {int(rows[0])} differs from the reference ({rows.numel()} rows differ)"
    return None


def compare_attention(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> str | None:
    """``None`` when ``|got - want| <= tolerance * (1 + |want|)`` everywhere (and no NaN / inf)."""
    a, b = got.detach().float().cpu(), want.detach().float().cpu()
    if a.shape != b.shape:
        return f"out_lat: shape {list(a.shape)} != reference {list(b.shape)}"
    err = (a - b).abs()
    bad = ~(err <= tolerance * (1 + b.abs()))  # NaN compares false: caught here
    if bool(bad.any()):
        at = tuple(int(i) for i in torch.nonzero(bad)[0])
        return (f"out_lat{list(at)}: {float(a[at]):.6g} != reference {float(b[at]):.6g} "
                f"(tolerance {tolerance}, {int(bad.sum())} values off)")
    return None


def _randint(g: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high, (1,), generator=g))


def resolver_case(g: torch.Generator, requests: int, n: int, pages: int, page_rows: int, slots: int
                  ) -> tuple[torch.Tensor, ...]:
    """Random resolver inputs (CPU int64): about half the pages resident, 10 % unused entries, duplicates,
    a half-filled hot cache with small stamps; ``slots >= n`` so that no request overflows."""
    ready = torch.rand(requests, pages, generator=g) < 0.5
    page_table = torch.where(ready, torch.randperm(requests * pages, generator=g).view(requests, pages), -1)
    positions = torch.randint(0, pages * page_rows, (requests, n), generator=g)
    positions[torch.rand(requests, n, generator=g) < 0.1] = -1
    hot_pos = torch.full((requests, slots), -1, dtype=torch.int64)
    filled = torch.randperm(pages * page_rows, generator=g)[: slots // 2]
    hot_pos[:, : filled.numel()] = filled
    hot_stamp = torch.randint(0, 5, (requests, slots), generator=g)
    hot_loc = 10**6 + torch.arange(requests * slots).view(requests, slots)
    return positions, page_table, hot_pos, hot_stamp, hot_loc


def check_resolver(kernels: Any, device: torch.device, g: torch.Generator, cases: int = 4) -> list[CheckResult]:
    reference, results = TorchKernels(), []
    for _ in range(cases):
        r, n, pages, page_rows = _randint(g, 1, 6), _randint(g, 1, 300), _randint(g, 1, 24), _randint(g, 1, 40)
        slots = n + _randint(g, 0, 100)
        case = resolver_case(g, r, n, pages, page_rows, slots)
        want = reference.resolve(*case, stamp=7, page_rows=page_rows)
        got = kernels.resolve(*(t.to(device) for t in case), stamp=7, page_rows=page_rows)
        results.append(CheckResult("resolver", f"R={r} N={n} M={pages} P={page_rows} B={slots}",
                                   compare_resolutions(got, want)))
    return results


def check_step_resolution(native_module: Any, lib: Any, g: torch.Generator, cases: int = 4) -> list[CheckResult]:
    """The native library's whole-step resolution (``native.resolve_step``: an index group's sources for a batch
    whose requests sit in scattered slots of the batch state) against the torch resolver run per request and
    source: locations, the hot state left in the slots, the counts and each source's host → arena copy list; and its
    direct-only form (page-table lookups of a fully mapped table) against what ``resolve`` finds there. Every other
    case has verification staging (a hot cache smaller than the selection, a staging slot per group member): rows past
    the evictable slots are staged, as the reference stages them."""
    results = []
    for case in range(cases):
        batch, sources, n = _randint(g, 1, 5), _randint(g, 1, 5), _randint(g, 1, 120)
        groups, pages, page_rows = _randint(g, 1, sources + 1), _randint(g, 1, 12), _randint(g, 1, 20)
        staged_case = case % 2 == 1
        num_slots, hot_rows = batch + _randint(g, 0, 3), (_randint(g, 1, n + 1) if staged_case
                                                          else n + _randint(g, 0, 40))
        rows = num_slots * sources
        _, table, hot_pos, hot_stamp, hot_loc = (t.view(num_slots, sources, -1) for t in resolver_case(
            g, rows, n, pages, page_rows, hot_rows))
        positions = resolver_case(g, batch, n, pages, page_rows, 1)[0]
        host_pages = torch.randperm(rows * pages, generator=g).view(num_slots, sources, pages)
        slots = torch.randperm(num_slots, generator=g)[:batch]
        chosen = torch.randperm(sources, generator=g)[:groups]
        snapshot = table[slots].clone()  # the step's page-table snapshot, by request
        staging_loc = 2 * 10**6 + torch.arange(num_slots * groups * n).view(num_slots, groups, n)
        want_pos, want_stamp = hot_pos.clone(), hot_stamp.clone()
        want_loc = torch.empty(groups, batch, n, dtype=torch.int64)
        want_counts = torch.zeros(batch, 3, dtype=torch.int64)
        want_staged = torch.zeros(batch, dtype=torch.int64)
        want_fetch: list[tuple[list[int], list[int]]] = []
        for gi, source in enumerate(chosen.tolist()):
            src: list[int] = []
            dst: list[int] = []
            for b, slot in enumerate(slots.tolist()):
                res = resolve(positions[b: b + 1], snapshot[b, source][None], want_pos[slot, source][None],
                              want_stamp[slot, source][None], hot_loc[slot, source][None], 7, page_rows,
                              staging_loc[slot, gi][None] if staged_case else None)
                want_loc[gi, b] = res.locations[0]
                want_pos[slot, source], want_stamp[slot, source] = res.hot_pos[0], res.hot_stamp[0]
                want_counts[b] += res.counts[0]
                want_staged[b] += res.staged[0]
                host_page = host_pages[slot, source][res.copy_position // page_rows]
                src += (host_page * page_rows + res.copy_position % page_rows).tolist()
                dst += res.copy_location.tolist()
            want_fetch.append((src, dst))
        counts = torch.zeros(batch, 3, dtype=torch.int64)
        staged = torch.zeros(batch, dtype=torch.int64)
        staging = (staging_loc, list(range(groups)), staged) if staged_case else None
        out = native_module.resolve_step(lib, positions, torch.full((batch,), pages * page_rows), chosen, slots,
                                         snapshot, hot_pos, hot_stamp, hot_loc, host_pages, counts, 7, page_rows,
                                         staging=staging)
        got_fetch = [(out.fetch_src[gi, :c].tolist(), out.fetch_dst[gi, :c].tolist())
                     for gi, c in enumerate(out.fetch_count)]
        problem = None
        for name, a, b in (("flags", torch.tensor(out.flags), torch.tensor(0)), ("locations", out.locations, want_loc),
                           ("hot_pos", hot_pos, want_pos), ("hot_stamp", hot_stamp, want_stamp),
                           ("counts", counts, want_counts), ("staged", staged, want_staged)):
            if not torch.equal(a, b):
                problem = f"{name} differ from the reference"
                break
        if problem is None and got_fetch != want_fetch:
            problem = "copy lists differ from the reference"
        if problem is None:  # direct_only on the same positions over a fully mapped table: what resolve() finds
            full = torch.randperm(batch * sources * pages, generator=g).view(batch, sources, pages)
            direct_counts = torch.zeros(batch, 3, dtype=torch.int64)
            got = native_module.resolve_step(lib, positions, torch.full((batch,), pages * page_rows), chosen, slots,
                                             full, hot_pos, hot_stamp, hot_loc, host_pages, direct_counts, 7,
                                             page_rows, direct_only=True)
            for gi, source in enumerate(chosen.tolist()):
                res = resolve(positions, full[:, source], hot_pos[slots, source], hot_stamp[slots, source],
                              hot_loc[slots, source], 7, page_rows)
                if got.flags or not torch.equal(got.locations[gi], res.locations):
                    problem = "direct-only locations differ from the reference"
                direct_counts[:, 0] -= res.counts[:, 0]
            if problem is None and (direct_counts.any() or any(got.fetch_count) or not torch.equal(hot_pos, want_pos)
                                    or not torch.equal(hot_stamp, want_stamp)):
                problem = "direct-only counts, copies or hot state differ from the reference"
        results.append(CheckResult("step_resolution", f"B={batch} S={sources} G={groups} N={n} M={pages} "
                                   f"P={page_rows} H={hot_rows} slots={num_slots} staging={staged_case}", problem))
    return results


def check_step_resolver(kernels: Any, device: torch.device, g: torch.Generator) -> list[CheckResult]:
    """The one-launch step resolver (``resolve_step``: an index group for the whole batch, scattered slots, host
    fetch lists, staging) against :meth:`TorchKernels.resolve_step` on random traces: every output and the hot state
    left behind, exactly."""
    from dhisparse.kernels.resolver_traces import step_outputs, step_trace

    results = []
    for staging, miss in ((0, 0.1), (0, 0.5), (90, 0.5)):
        trace = step_trace(_randint(g, 0, 1 << 30), batch=_randint(g, 1, 6), sources=_randint(g, 2, 6), groups=2,
                           queries=3 if staging else _randint(g, 1, 3), topk=_randint(g, 20, 70),
                           hot_rows=50 if staging else 160, miss_rate=miss, page_rows=_randint(g, 2, 17),
                           staging_rows=staging)
        want, got = trace.clone(), trace.to(device)
        want_out, got_out = step_outputs(want), step_outputs(got)
        for kernel_set, state, out in ((TorchKernels(), want, want_out), (kernels, got, got_out)):
            kernel_set.resolve_step(to_device([trace.stamp], torch.int64, state.positions.device), state.positions,
                                    state.lengths, state.sources, state.slots, state.page_table, state.hot_pos,
                                    state.hot_stamp, state.hot_loc, state.host_pages, state.staging,
                                    trace.page_rows, out)
        problem = None
        for name in ("locations", "fetch_src", "fetch_dst", "counts", "staged", "flags"):
            if not torch.equal(got_out[name].cpu(), want_out[name]):
                problem = f"{name} differs from the reference"
                break
        for name in ("hot_pos", "hot_stamp"):
            if problem is None and not torch.equal(getattr(got, name).cpu(), getattr(want, name)):
                problem = f"{name} left differs from the reference"
        results.append(CheckResult("step_resolver", f"B={trace.positions.shape[0]} N={trace.positions.shape[1]} "
                                   f"staging={staging} miss={miss}", problem))
    return results


def check_row_copy(kernels: Any, device: torch.device, g: torch.Generator) -> list[CheckResult]:
    results = []
    for requests, per, row_values, dtype in ((3, 17, 576, torch.bfloat16), (7, 5, 81, torch.float32),
                                             (1, 1, 3, torch.bfloat16)):  # 16-, 4- and 1-byte accesses
        host = torch.randn(997, row_values, generator=g).to(dtype)
        if device.type == "cuda":
            host = host.pin_memory()
        arena = torch.randn(1301, row_values, generator=g).to(dtype).to(device)
        src = torch.randint(0, host.shape[0], (requests, per), generator=g)
        src[torch.rand(requests, per, generator=g) < 0.2] = -1
        dst = torch.randperm(arena.shape[0], generator=g)[: requests * per].view(requests, per)
        expected = arena.cpu().clone()
        TorchKernels().copy_rows(host.cpu(), expected, src, dst)
        got = arena.clone()
        kernels.copy_rows(host, got, src.to(device), dst.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        results.append(CheckResult("row_copy", f"R={requests} M={per} row={row_values} {dtype}",
                                   compare_rows(got, expected)))
    return results


def check_sparse_mla(kernels: Any, device: torch.device, g: torch.Generator,
                     dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> list[CheckResult]:
    results = []
    for dtype, (b, q, h, k, rank, rope, rows) in zip(dtypes, ((3, 2, 5, 37, 96, 32, 211), (2, 3, 7, 61, 64, 16, 150)),
                                                     strict=False):
        kv = torch.randn(rows, rank + rope, generator=g).to(dtype)
        q_lat = torch.randn(b, q, h, rank, generator=g).to(dtype)
        q_pe = torch.randn(b, q, h, rope, generator=g).to(dtype)
        # A query's rows are distinct (its top-k); the queries of a request share most of them.
        shared = torch.randperm(rows, generator=g)[:k]
        mixed = [torch.where(torch.rand(k, generator=g) < 0.7, shared, torch.randperm(rows, generator=g)[:k])
                 for _ in range(b * q)]
        locations = torch.stack([_distinct(row, rows, g) for row in mixed]).view(b, q, k)
        locations[torch.rand(b, q, k, generator=g) < 0.15] = -1
        locations[0, q - 1] = -1  # a fully masked query: zeros
        scale = (rank + rope) ** -0.5
        want = TorchKernels().sparse_mla(q_lat.float(), q_pe.float(), kv.float(), locations, scale)
        got = kernels.sparse_mla(q_lat.to(device), q_pe.to(device), kv.to(device), locations.to(device), scale)
        results.append(CheckResult("sparse_mla", f"B={b} Q={q} H={h} K={k} rank={rank} rope={rope} {dtype}",
                                   compare_attention(got, want, ATTENTION_TOLERANCE[dtype])))
    return results


def _distinct(row: torch.Tensor, rows: int, g: torch.Generator) -> torch.Tensor:
    """``row`` with repeated values replaced by unused rows (a query selects each row once)."""
    out = row.clone()
    seen: set[int] = set()
    spare = iter(torch.randperm(rows, generator=g).tolist())
    for i, value in enumerate(out.tolist()):
        while value in seen:
            value = next(spare)
        seen.add(value)
        out[i] = value
    return out


def run_self_check(kernels: Any, device: torch.device, seed: int = 0) -> list[CheckResult]:
    """Every kernel of ``kernels`` on random irregular inputs against the torch reference."""
    g = torch.Generator().manual_seed(seed)
    return [*check_resolver(kernels, device, g), *check_step_resolver(kernels, device, g),
            *check_row_copy(kernels, device, g), *check_sparse_mla(kernels, device, g)]


def failures(results: list[CheckResult]) -> str | None:
    """One line per failed check, or ``None`` when every check passed."""
    bad = [f"{r.kernel} ({r.case}): {r.mismatch}" for r in results if not r.ok]
    return "; ".join(bad) if bad else None

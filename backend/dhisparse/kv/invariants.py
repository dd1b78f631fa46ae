"""check_invariants(): the KV hierarchy's invariants, checked by code (tests call it after every operation)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dhisparse.kv.host_store import HOST_PENDING, HOST_VALID
from dhisparse.kv.index_keys import request_keys
from dhisparse.kv.prefix_cache import check_cache
from dhisparse.kv.request_state import (
    OPT_ABSENT,
    OPT_BACKING_UP,
    OPT_ON_DEVICE,
    OPT_READY,
    OPT_REFILL_CANCELLED,
    OPT_REFILLING,
    OPT_RETIRED,
    OPT_SHARED,
    RequestKV,
)

if TYPE_CHECKING:
    from dhisparse.kv.manager import KVManager


class InvariantError(AssertionError):
    """An invariant of the KV hierarchy is broken; the message names it."""


def _fail(name: str, detail: str) -> None:
    raise InvariantError(f"invariant '{name}' broken: {detail}")


def _isin(state: torch.Tensor, values: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros_like(state, dtype=torch.bool)
    for v in values:
        out |= state == v
    return out


def check_manager_invariants(m: KVManager) -> None:
    pool, cfg = m.pool, m.config
    if pool.used_bytes > pool.pool_bytes:
        _fail("budget", f"required {pool.required_bytes} + optional {pool.optional_bytes} + reserve "
                        f"{pool.reserve_bytes} > pool {pool.pool_bytes}")
    alive = [*m.requests.values(), *(r for r, _ in m.releasing)]
    required = sum(r.footprint.required_bytes for r in alive)
    if required != pool.required_bytes:
        _fail("required accounting", f"pool says {pool.required_bytes}, requests hold {required}")
    prefix = m.prefix
    cached_device = prefix.device.resident_pages() + prefix.device.retiring_pages
    optional = (sum(r.optional_pages_on_device() for r in alive) + cached_device) * pool.page_bytes
    if optional != pool.optional_bytes:
        _fail("optional accounting", f"pool says {pool.optional_bytes}, requests and the prefix cache hold {optional}")
    owned = [torch.cat([r.tail_ring.reshape(-1), r.hot_pages.reshape(-1), r.staging_pages, r.key_page_ids,
                        r.opt_page[r.opt_page >= 0]])
             for r in alive]
    owned += list(prefix.device.owned_pages())
    owned_pages = torch.cat(owned) if owned else torch.zeros(0, dtype=torch.int64)
    if owned_pages.unique().numel() != owned_pages.numel():
        _fail("page ownership", "an arena page is owned twice")
    if bool(pool.is_free(owned_pages).any()):
        _fail("page ownership", "an owned arena page is in the free list")
    if pool.num_pages - pool.free_pages != owned_pages.numel():
        _fail("page ownership", f"{pool.num_pages - pool.free_pages} pages allocated, "
                                f"{owned_pages.numel()} owned")
    if cfg.uses_host:  # a request owns its pages past its prefix-cache holds; the cache owns its entries' pages
        host = torch.cat([r.host_pages[:, len(r.prefix_held):].reshape(-1) for r in alive if r.host_pages is not None]
                         + [prefix.owned_host_pages()])
        if host.unique().numel() != host.numel() or host.numel() != m.host.used_pages:
            _fail("host ownership", f"{m.host.used_pages} host pages used, {host.numel()} owned")
    _check_prefix_cache(m, alive)
    _check_slots(m)
    for req in m.requests.values():
        _check_request(m, req)
    if not alive and not m.waiting:
        cached = torch.cat(list(prefix.device.owned_pages()) or [torch.zeros(0, dtype=torch.int64)])
        if pool.required_bytes or pool.optional_bytes != cached.numel() * pool.page_bytes or \
                pool.free_pages != pool.num_pages - cached.numel():
            _fail("empty pool", "no request is alive but the pool holds more than the prefix cache's pages")
        if m.host.used_pages != prefix.owned_host_pages().numel():
            _fail("empty pool", "no request is alive but host pages beyond the prefix cache's are in use")


def _check_prefix_cache(m: KVManager, alive: list[RequestKV]) -> None:
    """Prefix reuse: the index agrees with the requests' holds (reference counts, parents, prefixes); a held page's
    host pages are the entry's and host-valid; shared device copies are mapped exactly by the requests whose state
    says so (``mappers``), never by a released one; with ``verify`` (tests) no entry's host rows ever changed
    (copy-on-write)."""
    prefix = m.prefix
    problem = check_cache(prefix.cache, [r.prefix_held for r in alive])
    if problem is not None:
        _fail("prefix cache", problem)
    mappers: dict[int, int] = {}
    for req in alive:
        held = req.prefix_held
        if held and req.host_pages is not None:
            want = torch.stack([e.host_pages for e in held], 1)
            if not torch.equal(req.host_pages[:, : len(held)], want):
                _fail("prefix cache", f"{req.request_id}: a held page's host pages are not the entry's")
            if bool((req.host_state[:, : len(held)] != HOST_VALID).any()):
                _fail("prefix cache", f"{req.request_id}: a held page is not host-valid")
        shared = req.opt_state == OPT_SHARED
        if not bool(shared.any()):
            continue
        if req.request_id not in m.requests:
            _fail("prefix cache", f"{req.request_id}: a released request still maps a shared device copy")
        table = req.page_table.cpu()
        for i in torch.nonzero(shared.any(0)).flatten().tolist():
            entry = held[i] if i < len(held) else None
            if entry is None or entry.device_pages is None:
                _fail("prefix cache", f"{req.request_id}: page {i} maps a shared copy its entry does not have")
                return
            cols = shared[:, i]
            if not torch.equal(table[cols, i], entry.device_pages[cols]):
                _fail("prefix cache", f"{req.request_id}: page {i} maps another page than its entry's copy")
            mappers[id(entry)] = mappers.get(id(entry), 0) + 1
    holders = {id(e) for e in prefix.cache.entries.values() if e.device_pages is not None}
    if holders != set(prefix.device.holders):
        _fail("prefix cache", "the device copies the cache tracks are not the entries holding one")
    for e in prefix.cache.entries.values():
        if e.mappers != mappers.get(id(e), 0):
            _fail("prefix cache", f"page {e.depth}'s copy counts {e.mappers} mappers, {mappers.get(id(e), 0)} map it")
        if e.snapshot is not None and not torch.equal(prefix.entry_rows(e), e.snapshot):
            _fail("copy-on-write", f"cached page {e.depth}'s host rows or keys changed after it was registered")


def _check_slots(m: KVManager) -> None:
    """Persistent batch state: every running request owns one slot and its state tensors are views of that slot;
    free slots are empty; indexer keys are zero past each request's length (between steps)."""
    batch = m.batch
    used = [r.slot for r in m.requests.values()]
    if len(set(used)) != len(used) or any(not 0 <= s < batch.num_slots for s in used):
        _fail("batch slots", f"running requests hold slots {sorted(used)} (of {batch.num_slots})")
    if set(used) & set(batch.free_slots) or len(used) + len(batch.free_slots) != batch.num_slots:
        _fail("batch slots", f"used slots {sorted(used)} and free slots {sorted(batch.free_slots)} do not "
                             f"partition {batch.num_slots}")
    for req in m.requests.values():
        slot = req.slot
        if batch.owner[slot] != req.request_id:
            _fail("batch slots", f"{req.request_id}: slot {slot} belongs to {batch.owner[slot]!r}")
        views = [(req.page_table, batch.page_table), (req.hot_pos, batch.hot_pos),
                 (req.hot_stamp, batch.hot_stamp), (req.hot_loc, batch.hot_loc), (req.key_pages, batch.key_pages)]
        if any(view.data_ptr() != full[slot].data_ptr() for view, full in views):
            _fail("batch slots", f"{req.request_id}: its state is not a view of slot {slot}")
        blocks = req.footprint.key_blocks
        want = req.key_page_ids.view(-1, blocks) if blocks else req.key_page_ids.view(len(batch.layer_index), 0)
        if not torch.equal(batch.key_pages[slot, :, :blocks].cpu(), want) or \
                bool((batch.key_pages[slot, :, blocks:] != batch.zero_page).any()):
            _fail("batch slots", f"{req.request_id}: key-page table of slot {slot} is not its key pages")
        if m.step is None and blocks:
            keys = request_keys(m.pool, req.key_pages, blocks * m.pool.keys_per_page)
            known = req.length if req.imported else req.prefix_reused_tokens  # a hit's keys are in before import
            if bool(keys[:, known:].any()):
                _fail("index keys", f"{req.request_id}: indexer keys past the length are not zero")
    free = batch.free_slots
    if free:
        empty = [bool((batch.page_table[free] < 0).all()), bool((batch.hot_pos[free] < 0).all()),
                 bool((batch.host_pages[free] < 0).all()), bool((batch.key_pages[free] == batch.zero_page).all())]
        if not all(empty):
            _fail("batch slots", f"a free slot of {sorted(free)} is not empty")
    zero = m.pool.arena[m.pool.zero_page * m.pool.page_rows:]
    if bool(zero.any()):
        _fail("zero page", "the pool's zero page (zero row, unowned key blocks) is not zero")


def _check_request(m: KVManager, req: RequestKV) -> None:
    rid, page_rows = req.request_id, m.config.page_rows
    table = req.page_table.cpu()
    mapped = table >= 0
    step_open = m.step is not None and any(r is req for r in m.step.requests)
    if not req.imported:
        if bool(mapped.any()):
            _fail("page table", f"{rid}: pages mapped before import")
        return
    used_pages = -(-req.length // page_rows)
    # Tail pages map to their ring slot.
    for i in range(req.tail_first, used_pages):
        if not torch.equal(table[:, i], req.tail_ring[:, i % req.tail_pages]):
            _fail("tail map", f"{rid}: page {i} is not mapped to ring slot {i % req.tail_pages}")
    if not step_open and bool(mapped[:, used_pages:].any()):
        _fail("tail map", f"{rid}: a page past the accepted length is mapped between steps")
    # Optional pages: mapped exactly when ready (or ready and being backed up, or a shared prefix copy).
    state = req.opt_state
    should_map = _isin(state, (OPT_READY, OPT_BACKING_UP, OPT_SHARED))
    own = _isin(state, (OPT_READY, OPT_BACKING_UP))
    pp = req.prompt_pages
    if pp:
        if not torch.equal(mapped[:, :pp], should_map):
            _fail("optional map", f"{rid}: mapped optional pages differ from ready ones")
        if not torch.equal(table[:, :pp][own], req.opt_page[own]):
            _fail("optional map", f"{rid}: page table points at another arena page than opt_page")
        on = _isin(state, OPT_ON_DEVICE)
        if not torch.equal(on, req.opt_page >= 0):
            _fail("optional state", f"{rid}: arena page held in a state that holds none (or vice versa)")
        hstate = req.host_state[:, :pp]
        if bool((_isin(state, (OPT_REFILLING, OPT_RETIRED, OPT_REFILL_CANCELLED)) & (hstate != HOST_VALID)).any()):
            _fail("optional state", f"{rid}: refilling or retired page without a valid host copy")
        if bool(((state == OPT_BACKING_UP) & (hstate != HOST_PENDING)).any()):
            _fail("optional state", f"{rid}: page backing up without a pending host copy")
        if bool((state == OPT_RETIRED).any()) and not req.retired_pending:
            _fail("optional state", f"{rid}: a retired page is not flagged for freeing")
        if bool(((state == OPT_ABSENT) & (hstate == HOST_VALID)).any()) and not req.may_refill:
            _fail("optional state", f"{rid}: a refillable page is not flagged for refill")
    elif req.tail_first > 0 and bool(mapped[:, : req.tail_first].any()):
        _fail("page table", f"{rid}: a page before the tail is mapped without being optional")
    if not m.config.uses_host:
        if not bool(mapped[:, :used_pages].all()):
            _fail("resident", f"{rid}: a page of the history is not on device")
        return
    # Every row is ready on device or has a host copy (or is being imported from the held prefill rows).
    hstate = req.host_state[:, :used_pages]
    importing = req.import_ticket is not None and not req.import_ticket.done
    covered = mapped[:, :used_pages] | (hstate == HOST_VALID)
    if importing:
        covered |= hstate == HOST_PENDING
    if not bool(covered.all()):
        s, i = (int(v) for v in torch.nonzero(~covered)[0])
        _fail("row coverage", f"{rid}: page {i} of source {s} is neither on device nor on host")
    # Hot cache: distinct positions of the history, each with a valid host copy.
    hot = req.hot_pos.cpu()
    for s in range(req.num_sources):
        held = hot[s][hot[s] >= 0]
        if held.unique().numel() != held.numel():
            _fail("hot cache", f"{rid}: source {s} holds a position twice")
        if held.numel() and (int(held.max()) >= req.length or
                             bool((req.host_state[s, held // page_rows] != HOST_VALID).any())):
            _fail("hot cache", f"{rid}: source {s} holds a row past the length or without a host copy")
    expected_loc = (req.hot_pages.unsqueeze(-1) * page_rows + torch.arange(page_rows)).reshape(
        req.num_sources, -1)[:, : req.hot_loc.shape[1]]
    if not torch.equal(req.hot_loc.cpu(), expected_loc):
        _fail("hot cache", f"{rid}: slot locations are not the rows of its hot pages")

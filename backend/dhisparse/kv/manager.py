"""KVManager: the engine's one interface to the KV hierarchy (admission, steps, release, progress).

Tiers: :class:`HostStore` (full history), :class:`DevicePool` (arena + byte accounting), per request and
source a hot cache of ``B`` rows, a tail ring and (adaptive) optional pages; copies between them are
two-phase (:class:`CopyEngine`), frees are fenced by reader epochs (:class:`ReaderFence`).

Call protocol (single-threaded, the engine loop):
``try_admit`` → (prefill) → ``import_prompt`` → repeatedly ``begin_step`` → per layer ``write`` /
``index_keys`` / ``gather`` → ``end_step`` → ``poll`` … → ``release``. ``try_admit`` and ``release`` may be
called between steps; at most one step is open at a time.

Reclaim order (adaptive, when an admission's required memory does not fit): running requests holding
reclaimable optional pages, fewest remaining decode tokens (``max_new_tokens - generated``) first, ties
by most recently admitted first; *all* optional pages of one request at a time until the pages already
leaving the device plus those taken cover the deficit. Between steps ``try_admit`` then completes the
outstanding copies (the deferred backups) and admits at once; during an open step it returns False and the
memory frees after the step. If every reclaimable page together cannot cover it, nothing is reclaimed and
the admission waits (``try_admit`` returns False; the caller retries later).
While any admission waits, refill is paused.

Host tier: the host store has a fixed capacity (``KVConfig.host_bytes``); a host-backed admission also needs
host pages for the request's whole capacity and waits (``try_admit`` returns False) while they are not free.

Prefix reuse (``kv/prefix_reuse.py``): with the request's token ids (``set_token_ids``) the admission reuses the
longest cached prefix of its prompt (those host pages are shared, not allocated) and its prefill starts after it
(``cached_prefix_tokens``); cached pages nobody holds are evicted (host: LRU; device copies: before any request's
optional pages) before an admission waits.

Host reads: a step reads the device once (``end_step``), or not at all when the engine passes the values of
``StepKV.report()`` it read together with its sampled tokens; every read goes through :attr:`sync`
(``kv_host_syncs`` in ``stats()``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from dhisparse.host_values import HostSync, to_device
from dhisparse.kernels.selection import KernelSelection, torch_selection
from dhisparse.kv import history_import as history_host
from dhisparse.kv import index_keys as key_store
from dhisparse.kv import residency
from dhisparse.kv.batch_state import BatchState
from dhisparse.kv.config import AdmissionError, KVConfig, KVLayout
from dhisparse.kv.copies import CopyEngine, CopyError, ReaderFence
from dhisparse.kv.device_pool import DevicePool
from dhisparse.kv.footprint import Footprint, request_footprint
from dhisparse.kv.host_store import HostMemoryError, HostStore  # [#29] HostMemoryError
from dhisparse.kv.invariants import check_manager_invariants
from dhisparse.kv.prefill_stream import StreamedPrefillKV
from dhisparse.kv.prefix_cache import CachedPage
from dhisparse.kv.prefix_reuse import PrefixReuse
from dhisparse.kv.prefix_rows import IDENTITY, PrefixRows
from dhisparse.kv.request_state import RequestKV
from dhisparse.kv.residency import back_up_step_pages, map_step_tail_pages, unmap_rejected
from dhisparse.kv.resolution import StepResolution, choose_resolution
from dhisparse.kv.resolution.common import FLAG_MESSAGES, StepParts
from dhisparse.kv.stats import ENGINE_COUNTERS, REQUEST_COUNTERS, request_gauges
from dhisparse.kv.step import StepKV
from dhisparse.kv.store import HostRowsTarget, KVMemory, PromptRows


class KVManager:
    """Load-adaptive KV hierarchy for one model (see the module docstring for the protocol)."""

    def __init__(self, layout: KVLayout, config: KVConfig, device: torch.device | str = "cpu",
                 poison_freed: bool = False, debug_checks: bool = False, host_chunk_bytes: int | None = None,
                 kernels: KernelSelection | None = None, stream_prefill: bool = True,
                 copy_fault_hook: Callable[[str], None] | None = None, prefix_rows: PrefixRows = IDENTITY) -> None:
        config.validate_for(layout)
        # Which kernels run the request path (dhisparse.kernels.selection; torch by default) and, from them, which
        # implementation resolves a step (kv/resolution/), chosen once here (and again if the selection is replaced).
        if kernels is None:
            kernels = torch_selection("default")
        self.resolution: StepResolution = choose_resolution(kernels)
        self._kernels = kernels
        self._on_device = kernels.on_device
        self.layout, self.config = layout, config
        self.policy = config.kv_policy  # owns the policy decisions (dhisparse.kv.policies)
        self.device = torch.device(device)
        self.indexer_layers = frozenset(layout.indexer_layers)
        self.pool = DevicePool(layout, config, self.device, poison_freed)
        chunk = {} if host_chunk_bytes is None else {"chunk_bytes": host_chunk_bytes}
        self.host = HostStore(layout, config.page_rows, self.device, poison_freed, config.host_bytes, **chunk)
        self.debug_checks = debug_checks  # read and raise the step's checks at once (one read per check)
        self.sync = HostSync()
        self.copies = CopyEngine(self.device, self.sync)
        self.copies.fault_hook = copy_fault_hook
        # Prompts stream into their host pages chunk by chunk (prefill_kv): a host store and native rows needed.
        self.stream_prefill = stream_prefill and self.policy.uses_host and layout.row_format == "native"
        self._keys_in_place: set[str] = set()  # requests whose prefill store writes their keys in place
        self.fence = ReaderFence(self.device)
        self.requests: dict[str, RequestKV] = {}
        self.releasing: list[tuple[RequestKV, int]] = []  # (request, epoch at release)
        self.waiting: dict[str, tuple[float, int]] = {}  # id -> (time, step) the wait began
        self.counters: dict[str, float] = dict.fromkeys(ENGINE_COUNTERS, 0.0)
        self._admissions = 0
        self._steps = 0
        self._refill_cursor = 0
        self.step: StepKV | None = None
        # persistent per-slot state (kv/batch_state.py); its key-page tables point at the pool's zero page when empty
        self.batch = BatchState(layout, config, self.device, self.pool.zero_page)
        # Steps whose requests' slots are not consecutive (in step order) first compact them (BatchState.compact), so
        # the step reads the batch state as views; False keeps the slots (the step gathers and scatters back).
        self.compact_slots = True
        self._reports: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._row_bytes = layout.row_bytes
        self._staging = config.staging_rows(layout) > 0
        # Per layer, the layout's answers a step needs (precomputed: a step's per-layer calls stay in the step).
        key_index = {layer: i for i, layer in enumerate(layout.indexer_layers)}
        self._key_layer = tuple(key_index.get(layer, -1) for layer in range(layout.num_layers))
        self._group_of_layer = tuple(layout.group_of_layer(layer) for layer in range(layout.num_layers))
        self._staging_slot_of_layer = tuple(layout.staging_slot_of_layer(layer) for layer in range(layout.num_layers))
        # Prefix reuse where a hit is exact: the streamed prefill (host store, native rows) and native keys.
        # ``prefix_rows``: rows vs tokens in the cache, and the model state a page carries (kv/prefix_rows.py).
        self.prefix = PrefixReuse(layout, config, self.pool, self.host, verify=poison_freed, enabled=(
            config.prefix_reuse and self.stream_prefill and layout.index_key_format == "native"), rows=prefix_rows)

    # ---------------------------------------------------------------------------------------- admission
    def footprint(self, prompt_len: int, max_new_tokens: int) -> Footprint:
        """What a request of this size reserves at admission (non-speculative and speculative parts)."""
        return request_footprint(self.layout, self.config, prompt_len, max_new_tokens)

    def required_bytes(self, prompt_len: int, max_new_tokens: int) -> int:
        """Device bytes a request reserves at admission under the configured policy."""
        return self.footprint(prompt_len, max_new_tokens).required_bytes

    def host_pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """Host pages a request owns while admitted (0 for ``resident``)."""
        if not self.config.uses_host:
            return 0
        fp = request_footprint(self.layout, self.config, prompt_len, max_new_tokens)
        return self.layout.num_sources * fp.num_pages

    def never_admissible(self, prompt_len: int, max_new_tokens: int) -> str | None:
        """Why a request of this size could never be admitted even on an empty pool (``None``: it can be)."""
        need = self.required_bytes(prompt_len, max_new_tokens)
        host_pages = self.host_pages_needed(prompt_len, max_new_tokens)
        if host_pages > self.host.num_pages:
            return (f"the request needs {host_pages} host pages but host_bytes {self.host.host_bytes} holds "
                    f"{self.host.num_pages}; raise host_bytes or lower max_new_tokens")
        if need + self.config.reserve_bytes <= self.config.pool_bytes:
            return None
        return (
            f"the request needs {need} device bytes ({self.config.policy}: prompt {prompt_len} + max_new_tokens "
            f"{max_new_tokens}) but pool_bytes {self.config.pool_bytes} - reserve_bytes {self.config.reserve_bytes} "
            f"leaves {self.config.pool_bytes - self.config.reserve_bytes}; raise pool_bytes, lower reserve_bytes or "
            "max_new_tokens" + self.policy.admission_hint
        )

    def try_admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> bool:
        """Reserve the request's required memory; False = not now (keep it queued).

        Raises :class:`AdmissionError` if it could never be admitted, even on an empty pool."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already admitted")
        try:
            return self._try_admit(request_id, prompt_len, max_new_tokens)
        except Exception:
            if request_id not in self.requests:
                self.prefix.forget(request_id)  # the caller ends it without a release
            raise

    def _try_admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> bool:
        fp = request_footprint(self.layout, self.config, prompt_len, max_new_tokens)
        reason = self.never_admissible(prompt_len, max_new_tokens)
        if reason is not None:
            raise AdmissionError(f"request {request_id!r}: {reason}")
        self._free_safe()
        deficit = fp.required_bytes - self.pool.spare_bytes
        if deficit > 0 and self.policy.reclaims:
            if self._reclaim_for(deficit) and self.step is None:
                # Between steps the freed memory need not wait for the next poll: complete the outstanding
                # copies (backups) and wait for the last step's readers, as a GPU would wait on its streams.
                self.copies.wait_all()
                self.fence.wait(self.fence.issued)
            self._free_safe()
            deficit = fp.required_bytes - self.pool.spare_bytes
        hit = self.prefix.lookup(request_id, prompt_len)  # the longest cached prefix (its host pages are shared)
        host_needed = self.host_pages_needed(prompt_len, max_new_tokens) - self.layout.num_sources * len(hit)
        if deficit > 0:
            self.counters["admission_refusals_device"] += 1
        elif not self._host_pages_free(host_needed, hit):
            deficit = 1  # host pages are short: wait for a release
            self.counters["admission_refusals_host"] += 1
        if deficit <= 0 and self.policy.uses_host and not self._host_memory_backed(host_needed, hit):  # [#29]
            deficit = 1  # [#29] the OS refused host memory: wait for other requests' host pages to come back
        if deficit > 0:
            self.waiting.setdefault(request_id, (time.monotonic(), self._steps))
            self.check_budget()
            return False
        self._admit(request_id, prompt_len, max_new_tokens, fp, hit)
        return True

    def _host_memory_backed(self, count: int, hit: list[CachedPage]) -> bool:
        """[#29] Allocate the host memory of the ``count`` pages this admission takes before anything is reserved.
        Refused by the OS: evict the cached pages nobody holds (never ``hit``; their memory is reused) and try again.
        False: still refused while requests hold host pages (the admission waits for theirs); with none held but the
        cache's, the :class:`HostMemoryError` is raised and fails this request only (nothing was taken)."""
        try:
            self.host.back(count)
        except HostMemoryError:
            with self.prefix.pinned(hit):
                evicted = self.prefix.evict_all()
            try:
                if not evicted:
                    raise
                self.host.back(count)
            except HostMemoryError:
                if self.host.used_pages <= self.prefix.host_pages_owned():
                    raise
                return False
        return True

    def _host_pages_free(self, count: int, hit: list[CachedPage]) -> bool:
        """Whether ``count`` host pages are free; first evict cached pages nobody holds (least recently used first,
        never the admission's own ``hit``), then, between steps, finish the releases whose copies and readers are
        the only thing keeping their pages (as a GPU would wait on its streams)."""
        if count <= self.host.free_pages:
            return True
        with self.prefix.pinned(hit):  # the hit's entries stay cached whatever is evicted or registered meanwhile
            if self.prefix.make_host_room(count):
                return True
            if self.releasing and self.step is None:
                self.copies.wait_all()
                self.fence.wait(self.fence.issued)
                self._free_safe()
                self.prefix.make_host_room(count)
        return count <= self.host.free_pages

    def _reclaim_for(self, deficit: int) -> bool:
        """Reclaim whole requests' optional pages in reclaim order until the memory on its way out covers
        ``deficit``. Returns whether it is covered (False: nothing was reclaimed, the admission waits)."""
        page_bytes = self.pool.page_bytes
        coming = page_bytes * sum(residency.outgoing_pages(r) for r in self.requests.values())
        coming += sum(r.footprint.required_bytes for r, _ in self.releasing)
        coming += page_bytes * self.prefix.device.retiring_pages
        if coming >= deficit:
            return True
        order = sorted(
            (r for r in self.requests.values() if residency.holds_device_pages(r)),
            key=lambda r: (r.prompt_len + r.max_new_tokens - r.length, -r.admit_order),
        )
        reclaimable = sum(residency.reclaimable_pages(r) for r in order)
        reclaimable += self.prefix.device.resident_pages()  # shared copies, mapped or not
        if coming + page_bytes * reclaimable < deficit:
            return False  # optional pages cannot cover it: the admission waits, nothing is reclaimed
        # Cached device copies nobody maps go first (least recently used first), then whole requests' pages.
        coming += page_bytes * self.prefix.evict_device(-(-(deficit - coming) // page_bytes))
        for req in order:
            if coming >= deficit:
                break
            taken = residency.reclaim_request(req, self.pool, self.host, self.copies, self.fence)
            self.counters["optional_pages_reclaimed"] += taken
            self.counters["reclaim_events"] += 1
            coming += taken * page_bytes
            if coming < deficit:  # shared copies the reclaim left unmapped
                coming += page_bytes * self.prefix.evict_device(-(-(deficit - coming) // page_bytes))
        return True

    def _admit(self, request_id: str, prompt_len: int, max_new_tokens: int, fp: Footprint,
               hit: list[CachedPage]) -> None:
        layout, cfg, dev = self.layout, self.config, self.device
        sources = layout.num_sources
        self.pool.reserve_required(fp.required_bytes)
        pages = self.pool.allocate(sources * fp.device_pages).view(sources, fp.device_pages)
        hot_pages = pages[:, fp.tail_pages :].contiguous()
        hot_rows = cfg.hot_rows_for(layout)
        hot_loc = self.pool.page_rows_of(hot_pages.reshape(-1)).view(sources, -1)[:, :hot_rows].contiguous()
        staging_pages = self.pool.allocate(fp.staging_pages)
        indexers = len(layout.indexer_layers)
        key_pages = self.pool.allocate(indexers * fp.key_blocks)  # the keys' pages (kv/index_keys.py), zeroed
        key_store.zero_pages(self.pool, key_pages)
        staging_loc = fp.staging_locations(cfg.page_rows, to_device(staging_pages, None, dev))
        host_pages = None
        if self.policy.uses_host:  # a prefix hit's pages are the cache's (shared), the rest the request's own
            taken = self.host.allocate(sources * (fp.num_pages - len(hit)))
            assert taken is not None, "try_admit checked the free host pages"
            host_pages = torch.cat([torch.stack([e.host_pages for e in hit], 1) if hit else
                                    torch.zeros(sources, 0, dtype=torch.int64), taken.view(sources, -1)], 1)
        prompt_pages = self.policy.optional_prompt_pages(prompt_len, cfg.page_rows)
        slot = self.batch.acquire(request_id, fp.num_pages, list(self.requests.values()))
        req = RequestKV(
            request_id=request_id, prompt_len=prompt_len, max_new_tokens=max_new_tokens, footprint=fp,
            admit_order=self._admissions, slot=slot,
            page_table=self.batch.page_table[slot, :, : fp.num_pages],
            tail_ring=pages[:, : fp.tail_pages].contiguous(), hot_pages=hot_pages,
            hot_pos=self.batch.hot_pos[slot], hot_stamp=self.batch.hot_stamp[slot], hot_loc=self.batch.hot_loc[slot],
            host_pages=host_pages,
            host_state=torch.zeros((sources, fp.num_pages), dtype=torch.int8),
            opt_state=torch.zeros((sources, prompt_pages), dtype=torch.int8),
            opt_page=torch.full((sources, prompt_pages), -1, dtype=torch.int64),
            opt_retire_epoch=torch.zeros((sources, prompt_pages), dtype=torch.int64),
            key_pages=self.batch.key_pages[slot, :, : fp.key_blocks], key_page_ids=key_pages,
            ring_free_epoch=torch.zeros(fp.tail_pages, dtype=torch.int64),
            staging_pages=staging_pages,
        )
        self.batch.bind(req)  # the state tensors are views of the slot (free slots are empty)
        self.batch.hot_loc[slot] = to_device(hot_loc, None, dev)
        self.batch.staging_loc[slot] = staging_loc
        self.batch.key_pages[slot, :, : fp.key_blocks] = to_device(key_pages.view(indexers, fp.key_blocks), None, dev)
        if host_pages is not None:
            self.batch.host_pages[slot, :, : fp.num_pages] = to_device(host_pages, None, dev)
        self.prefix.admit(req, hit)  # holds the hit, copies its indexer keys into the request's key pages
        self._admissions += 1
        self.requests[request_id] = req
        self.counters["admissions"] += 1
        self.counters["staging_bytes_charged"] += fp.staging_bytes
        began = self.waiting.pop(request_id, None)
        if began is not None:
            waited_s = time.monotonic() - began[0]
            self.counters["admissions_waited"] += 1
            self.counters["admission_wait_seconds"] += waited_s
            self.counters["admission_wait_steps"] += self._steps - began[1]
            req.add_stat("admission_wait_seconds", waited_s)
        self.check_budget()

    def prefill_kv(self, request_id: str, chunk_tokens: int) -> StreamedPrefillKV | None:
        """A store that streams the admitted request's prompt into its host pages chunk by chunk
        (``kv/prefill_stream.py``), when the policy keeps a host store, rows are native and ``stream_prefill`` is
        on; else ``None`` (the prefill runs over a local store and hands its rows to :meth:`import_prompt`)."""
        if not self.stream_prefill:
            return None
        req = self._running(request_id)
        keys = self._request_keys(req)
        if keys is not None:
            self._keys_in_place.add(request_id)
        return StreamedPrefillKV(self.layout, self.host.rows, history_host.history_host_rows(req, self.host),
                                 chunk_tokens, self.layout.dtype, self.device, keys, start=req.prefix_reused_tokens)

    def set_token_ids(self, request_id: str, token_ids: Sequence[int], reuse: bool = True) -> None:
        """The token ids of the request's rows: its prompt before ``try_admit`` (prefix lookup unless ``reuse`` is
        False), its whole sequence before ``release`` (complete pages are kept in the prefix cache). Ignored when
        prefix reuse is off (``kv_prefix_reuse_enabled`` 0)."""
        self.prefix.set_token_ids(request_id, token_ids, reuse)

    def cached_prefix_tokens(self, request_id: str) -> int:
        """Prompt tokens of the admitted request found in the prefix cache: its prefill starts there."""
        return self._running(request_id).prefix_reused_tokens

    def import_target(self, request_id: str) -> HostRowsTarget | None:
        """Where an external transfer (disaggregated prefill) writes the admitted request's prompt rows before
        ``import_prompt(request_id, None, keys)``: its host pages, or ``None`` when the policy keeps no host store
        (``resident``: hand the rows to :meth:`import_prompt`)."""
        req = self._running(request_id)
        if not self.policy.uses_host:
            return None
        return HostRowsTarget(history_host.history_host_rows(req, self.host), self.host.rows, self.host.page_rows,
                              cached_rows=req.prefix_reused_tokens)

    def import_prompt(self, request_id: str, rows: PromptRows | None,
                      index_keys: Mapping[int, torch.Tensor] | None) -> None:
        """Import the admitted request's prompt (see :meth:`KVStore.import_prompt`).

        ``rows [num_sources, T, row_dim]`` (``T == prompt_len``): the manager may keep a reference until its host
        copy is done (next ``poll``/step); do not modify it in place. ``rows=None``: the rows are already in the
        request's host pages (written by :meth:`prefill_kv`'s store or through :meth:`import_target`) — host pages
        become valid, the partial page goes to the tail and, adaptive, complete pages stay on device as optional
        pages while the budget allows (``kv/history_import.py``). ``index_keys=None``: the prompt's keys were written
        in place (the streamed prefill with native keys)."""
        req = self._running(request_id)
        if req.imported:
            raise ValueError(f"request {request_id!r} was already imported")
        if rows is None:
            if not self.policy.uses_host:
                raise ValueError(f"import_prompt: rows are required under the {self.policy.name!r} policy (no host "
                                 "store to take them from)")
            if request_id in self._keys_in_place:  # the streamed prefill wrote them where decode reads them
                self._keys_in_place.discard(request_id)
            elif index_keys is not None:
                history_host.set_index_keys(req, index_keys, self.layout, self.pool, self.batch.layer_index)
            self.prefix.before_import(req)  # a hit's shared device copies are mapped, not copied again
            history_host.import_host_rows(req, self.policy, self.pool, self.host)
            req.imported = True
            self.prefix.after_import(req)  # the prompt's complete pages join the prefix cache
        else:
            if not isinstance(rows, torch.Tensor):
                raise TypeError("import_prompt: rows must be a tensor [num_sources, prompt_len, row_dim]")
            want = (self.layout.num_sources, req.prompt_len, self.layout.row_dim)
            if tuple(rows.shape) != want:
                raise ValueError(f"import_prompt: rows must be {list(want)}, got {list(rows.shape)}")
            history_host.set_index_keys(req, index_keys or {}, self.layout, self.pool, self.batch.layer_index,
                                        "import_prompt")
            residency.import_prompt_rows(req, self.layout.encode(rows), self.policy, self.pool, self.host, self.copies)
        req.imported = True
        self.check_budget()

    def _request_keys(self, req: RequestKV) -> key_store.RequestKeys | None:
        """The request's indexer keys to write in place before its import (native key format; ``None`` otherwise:
        the keys go to the import instead)."""
        if self.layout.index_key_format != "native" or not self.indexer_layers:
            return None
        return key_store.RequestKeys(self.pool, self.layout, req, self.batch.layer_index)

    # ---------------------------------------------------------------------------------------- steps
    def begin_step(self, request_ids: Sequence[str], query_len: int) -> StepKV:
        """Open a step of ``query_len`` new tokens for each request (positions ``len .. len+Q-1``)."""
        if self.step is not None:
            raise RuntimeError("a step is already open; call end_step first")
        if not request_ids or len(set(request_ids)) != len(request_ids):
            raise ValueError("begin_step needs a non-empty list of distinct request ids")
        if not 1 <= query_len <= self.config.max_query_len:
            raise ValueError(f"query_len must be in 1 .. max_query_len={self.config.max_query_len}")
        reqs = [self._running(rid) for rid in request_ids]
        for req in reqs:
            if not req.imported:
                raise ValueError(f"request {req.request_id!r} has no imported prompt yet")
            if req.length + query_len - 1 >= req.footprint.capacity_rows:
                raise ValueError(f"request {req.request_id!r} would exceed prompt_len + max_new_tokens")
        try:
            map_step_tail_pages(reqs, query_len, self.config.page_rows, self.copies, self.fence)
        except Exception:
            for req in reqs:  # a failed copy: no step opens, so no page past a request's length stays mapped
                unmap_rejected(req, req.length + query_len, self.config.page_rows)
            raise
        if self.compact_slots:
            slots = [r.slot for r in reqs]
            if slots != list(range(slots[0], slots[0] + len(slots))):
                self.counters["batch_slots_moved"] += self.batch.compact(reqs, list(self.requests.values()))
        self.fence.begin()
        self.sync.mark_step()
        self._steps += 1
        self.step = StepKV(self.step_parts(), self.resolution, reqs, query_len, self._steps,
                           self._report_buffer(len(reqs)))
        return self.step

    @property
    def kernels(self) -> KernelSelection:
        """The kernel selection; replacing it chooses the step's resolution again."""
        return self._kernels

    @kernels.setter
    def kernels(self, selection: KernelSelection) -> None:
        self._kernels = selection
        self._on_device = selection.on_device
        self.resolution = choose_resolution(selection)

    def step_parts(self) -> StepParts:
        """What a step works with (built per step, so a debug mode set later applies)."""
        layout, pool = self.layout, self.pool
        return StepParts(
            layout, pool, self.host, self.copies, self.batch, self.sync, self.device, self.policy.uses_host,
            self.debug_checks, self._on_device, pool.page_rows, max(1, pool.keys_per_page), self._staging,
            layout.row_format == "native", layout.index_key_format == "native",
            self._key_layer, self._group_of_layer, self._staging_slot_of_layer)

    def _report_buffer(self, requests: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step's report buffer for ``requests`` requests, zeroed: ``(buffer, counts [B, 3], staged [B], flags)``,
        the last three views of the first (one allocation per batch size, reused by later steps)."""
        cached = self._reports.get(requests)
        if cached is None:
            buffer = torch.zeros(4 * requests + len(FLAG_MESSAGES), dtype=torch.int64, device=self.device)
            cached = self._reports[requests] = (
                buffer, buffer[: 3 * requests].view(requests, 3), buffer[3 * requests: 4 * requests],
                buffer[4 * requests:])
        else:
            cached[0].zero_()
        return cached

    def end_step(self, accepted: Mapping[str, int], report: Sequence[int] | None = None) -> None:
        """Keep the first ``accepted[r]`` new rows of each request of the open step; drop the rest.

        ``report``: the values of ``step.report()`` if the caller already read them (fused into its own read);
        else they are read here (one counted host read). A check the step failed raises here."""
        step = self.step
        if step is None:
            raise RuntimeError("no step is open")
        q = step.query_len
        if set(accepted) != {r.request_id for r in step.requests}:
            raise ValueError("end_step needs an accepted count for exactly the step's requests")
        counts = step.finish(report)
        for b, req in enumerate(step.requests):
            keep = int(accepted[req.request_id])
            if not 0 <= keep <= q:
                raise ValueError(f"accepted[{req.request_id!r}] = {keep} is outside 0 .. {q}")
            start = req.length
            req.length = start + keep
            if keep < q:  # rejected rows: their keys and tail pages go (the hot cache is the slot's, in place)
                key_store.zero_request_keys(self.pool, req, start + keep, start + q)
                unmap_rejected(req, start + q, self.config.page_rows)
            direct, hot, host, staged = (float(v) for v in counts[b])
            stats, counters = req.stats, self.counters
            for name, value in (("rows_direct", direct), ("rows_hot", hot), ("rows_host", host),
                                ("rows_staged", staged),
                                ("resolved_rows", direct + hot + host), ("host_fetched_rows", host),
                                ("host_fetched_bytes", host * self._row_bytes)):
                stats[name] = stats.get(name, 0.0) + value
                counters[name] += value
        if self.policy.uses_host:
            self.counters["tail_pages_backed_up"] += back_up_step_pages(
                step.requests, self.pool, self.host, self.copies, self.fence, self.config.page_rows)
        step.closed = True
        self.step = None
        self.fence.end()
        self.counters["steps"] += 1
        self.counters["resolver_calls"] += step.resolver_calls

    def abort_step(self) -> None:
        """Roll back the open step after a fault in its forward: every provisional row is dropped (as if each
        request accepted 0 rows), no statistic is counted, nothing is backed up. The hot caches keep their
        state from before the step except the slots this step refilled (their rows changed): those are
        emptied. The step's fetches are completed first (a failed one is dropped), so no copy into a slot
        outlives the step. The step's device-side checks (deferred flags) are cleared unread: a fault's own
        error is what the caller reports. Requests stay admitted; the caller releases the ones that failed."""
        step = self.step
        if step is None:
            return
        try:
            step.wait_fetches()
        except CopyError:
            pass  # the failed copy has left the queue; the slots it targeted are emptied below
        for req in step.requests:
            start = req.length
            key_store.zero_request_keys(self.pool, req, start, start + step.query_len)
            unmap_rejected(req, start + step.query_len, self.config.page_rows)
        step.restore_hot_state()  # slots this step refilled are emptied, the others keep their old state
        step.reset_checks()  # the rolled-back step's device flags and counts are never reported
        step.closed = True
        self.step = None
        self.fence.end()
        self.counters["steps_aborted"] += 1

    def owners_of(self, failure: CopyError) -> list[str]:
        """Running requests whose memory a failed copy touched: the owner of an import, backup or refill, or
        every request of the open step for its row fetches. Empty for a released request's copies."""
        ticket = failure.ticket
        owners = [rid for rid, r in self.requests.items() if any(t is ticket for t in r.tickets)]
        if not owners and self.step is not None and ticket.kind == "fetch":
            owners = [r.request_id for r in self.step.requests]
        return owners

    # ---------------------------------------------------------------------------------------- progress
    def poll(self) -> None:
        """Complete ready copies, free what is safe to free, refill optional pages (bounded, round-robin)."""
        self.copies.poll()
        self.fence.tick()  # the step boundary of agreed completion (kv/copies.py)
        self._free_safe()
        if self.policy.refills and not self.waiting and self.step is None:
            self._refill()
        self.check_budget()

    def _refill(self) -> None:
        budget = self.config.refill_pages_per_step
        if budget == 0 or not any(r.may_refill for r in self.requests.values()):
            return  # nothing to refill (a request may refill again once a page of it is absent with a host copy)
        order = sorted(self.requests.values(), key=lambda r: r.admit_order)
        if self.pool.spare_bytes < self.pool.page_bytes:
            self.prefix.evict_device(1)  # a cached device copy nobody maps makes room (freed after its readers)
        idle = 0
        i = self._refill_cursor % len(order)
        while budget > 0 and idle < len(order):
            req = order[i]
            i = (i + 1) % len(order)
            if req.imported and req.may_refill and residency.refill_one_page(req, self.pool, self.host, self.copies,
                                                                              self.fence):
                budget -= 1
                idle = 0
                self.counters["optional_pages_refill_issued"] += 1
            else:
                idle += 1
            if self.pool.spare_bytes < self.pool.page_bytes:
                break
        self._refill_cursor = i

    def _free_safe(self) -> None:
        if self.prefix.device.retiring:  # the prefix cache's retired device copies (none: nothing to ask)
            self.prefix.free_retired(self.fence)
        for req in self.requests.values():
            if req.retired_pending:
                residency.free_retired_pages(req, self.pool, self.fence)
        still = []
        for req, epoch in self.releasing:
            if req.live_tickets() or not self.fence.finished(epoch):
                still.append((req, epoch))
            else:
                self._free_request(req)
        self.releasing = still

    def release(self, request_id: str) -> None:
        """Finish or cancel: a waiting request is forgotten; an admitted one gives back every tier once its
        copies are done and the readers issued before now have finished."""
        if request_id not in self.requests:
            self.prefix.forget(request_id)
        if request_id in self.waiting and request_id not in self.requests:
            del self.waiting[request_id]
            return
        req = self._running(request_id)
        if self.step is not None and any(r is req for r in self.step.requests):
            raise RuntimeError(f"request {request_id!r} is part of the open step; end the step first")
        del self.requests[request_id]
        self.prefix.on_release(req, self.fence)  # shared device copies stay cached, unmapped
        slot = req.slot
        self.batch.detach(req)  # private copies for what the release still reads; the slot is free at once
        self.batch.release(slot)
        self.releasing.append((req, self.fence.issued))
        self.counters["releases"] += 1
        self._free_safe()

    def _free_request(self, req: RequestKV) -> None:
        self.counters["optional_pages_refilled"] += req.stats.get("optional_pages_refilled", 0.0)
        # The pages decoding completed join the prefix cache (their keys are read before the key pages go).
        private_host = self.prefix.on_free(req)
        residency.free_retired_pages(req, self.pool, self.fence)
        on_device = req.opt_page[req.opt_page >= 0]
        self.pool.free(on_device, optional=True)
        self.pool.free(torch.cat([req.tail_ring.reshape(-1), req.hot_pages.reshape(-1), req.staging_pages,
                                  req.key_page_ids]))
        if private_host is not None:
            self.host.free(private_host)
        self.pool.release_required(req.footprint.required_bytes)

    # ---------------------------------------------------------------------------------------- reporting
    def stats(self) -> dict[str, float]:
        """Engine-wide counters and gauges, every name prefixed ``kv_`` (names and units in docs/kv.md)."""
        out = dict(self.counters)
        out["required_bytes"] = float(self.pool.required_bytes)
        out["optional_bytes"] = float(self.pool.optional_bytes)
        out["reserve_bytes"] = float(self.pool.reserve_bytes)
        out["pool_bytes"] = float(self.pool.pool_bytes)
        alive_fps = [r.footprint for r in (*self.requests.values(), *(r for r, _ in self.releasing))]
        out["ring_bytes"] = float(sum(fp.ring_bytes for fp in alive_fps))
        out["staging_bytes"] = float(sum(fp.staging_bytes for fp in alive_fps))
        out["speculative_bytes"] = float(sum(fp.speculative_bytes for fp in alive_fps))
        out["spare_bytes"] = float(self.pool.spare_bytes)
        out["optional_pages_resident"] = float(sum(request_gauges(r)["optional_pages_resident"]
                                                   for r in self.requests.values()))
        alive = [*self.requests.values(), *(r for r, _ in self.releasing)]
        out["optional_pages_refilled"] += sum(r.stats.get("optional_pages_refilled", 0.0) for r in alive)
        out["requests_running"] = float(len(self.requests))
        out["requests_waiting"] = float(len(self.waiting))
        out["requests_releasing"] = float(len(self.releasing))
        out["copies_pending"] = float(self.copies.num_pending)
        out["copies_failed"] = float(self.copies.copies_failed)
        # agreed completion (kv/copies.py): completions that waited on a device event; timing, not a decision
        out["copies_agreed"] = float(self.copies.agreed)
        out["copy_agreed_stalls"] = float(self.copies.agreed_stalls + self.fence.agreed_stalls)
        out["host_pages_used"] = float(self.host.used_pages)
        out["host_pages"] = float(self.host.num_pages)
        out["host_bytes_allocated"] = float(self.host.rows.nbytes)
        out["host_syncs"] = float(self.sync.reads)
        out["batch_state_bytes"] = float(self.batch.nbytes)
        out["batch_slots_used"] = float(self.batch.num_slots - len(self.batch.free_slots))
        out.update(self.prefix.counters)
        out.update(self.prefix.gauges())
        out.update(self.kernels.stats())
        return {f"kv_{name}": value for name, value in out.items()}

    def request_stats(self, request_id: str) -> dict[str, float]:
        """Per-request counters and gauges, every name prefixed ``kv_`` (names and units in docs/kv.md)."""
        req = self._running(request_id)
        out = {name: req.stats.get(name, 0.0) for name in REQUEST_COUNTERS}
        out.update(request_gauges(req))
        return {f"kv_{name}": value for name, value in out.items()}

    def memory(self) -> KVMemory:
        """Pool figures and what requests are charged for their speculative state: the draft ring (fixed by the
        config) and verification staging, the mean of what each admitted request was charged (its
        ``kv_staging_bytes``; the block's provisional rows depend a little on the request's length)."""
        admitted = self.counters["admissions"]
        staging = round(self.counters["staging_bytes_charged"] / admitted) if admitted else 0
        return KVMemory(pool_bytes=self.pool.pool_bytes, required_bytes=self.pool.required_bytes,
                        optional_bytes=self.pool.optional_bytes, reserve_bytes=self.pool.reserve_bytes,
                        staging_bytes_per_request=staging, ring_bytes_per_request=self.config.draft_ring_bytes)

    def read(self, *tensors: torch.Tensor) -> list[list[int]]:
        """One counted device→host read (:class:`HostSync`)."""
        return self.sync.read(*tensors)

    def corrupt_accounting(self) -> None:
        """Fault drills only: one byte of required memory nobody holds (``check_invariants`` then fails)."""
        self.pool.required_bytes += 1

    def check_budget(self) -> None:
        self.pool.check_budget()

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` naming the first broken invariant (see invariants.py)."""
        check_manager_invariants(self)

    def _running(self, request_id: str) -> RequestKV:
        try:
            return self.requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not admitted") from None

"""The host store: full history of every request and KV source, page-granular, in (pinned) host memory."""

from __future__ import annotations

import heapq

import torch

from dhisparse.errors import DHiSparseError
from dhisparse.kv.config import KVLayout
from dhisparse.kv.host_memory import check_host_bytes, default_host_bytes
from dhisparse.kv.mapped_host import MappedRows, map_chunks
from dhisparse.kv.pinned_memory import Progress, touch_and_pin, unpin

HOST_EMPTY = 0  # no copy of the page on host yet
HOST_PENDING = 1  # a copy into the page is issued, not done
HOST_VALID = 2  # the page holds its rows (write-once: a valid page never changes until freed)

DEFAULT_CHUNK_BYTES = 64 << 20


class HostMemoryError(DHiSparseError):
    """The host store could not allocate a chunk (the OS refused the memory); nothing was taken."""


def _empty_host_cache() -> None:
    """Return torch's cached pinned blocks to the system (the caching host allocator keeps freed ones); the call's
    name differs across torch releases."""
    accelerator = getattr(torch, "accelerator", None)
    for fn in (getattr(accelerator, "empty_host_cache", None), getattr(torch._C, "_host_emptyCache", None),
               getattr(torch._C, "_accelerator_emptyHostCache", None)):
        if fn is not None:
            fn()
            return


class ChunkedRows:
    """Rows ``[capacity_rows, row_dim]`` held in fixed chunks of ``chunk_rows`` rows that never move.

    A chunk is allocated (pinned on CUDA) the first time a page inside it is handed out and stays until the
    store is dropped, so growing the store never copies rows and the tensors a pending copy references stay
    valid. It offers the two row operations copies use (``index_select`` / ``index_copy_`` along dim 0) over
    global row indices; a gather touches each allocated chunk once with a fixed-shape ``where`` (no index is
    read on the host).
    """

    def __init__(self, capacity_rows: int, chunk_rows: int, row_dim: int, dtype: torch.dtype, pinned: bool) -> None:
        self.capacity_rows, self.chunk_rows, self.row_dim = capacity_rows, chunk_rows, row_dim
        self.dtype, self.pinned = dtype, pinned
        self.device = torch.device("cpu")
        self.chunks: list[torch.Tensor] = []
        self._allocations: list[torch.Tensor] = []  # each chunk's memory, one spare row included
        self._registered: list[torch.Tensor] = []  # allocations pinned by preallocate (cudaHostRegister)
        self._mapped: dict[torch.device, MappedRows | None] = {}
        self.closed = False

    @property
    def allocated_rows(self) -> int:
        return sum(c.shape[0] for c in self.chunks)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self._allocations)

    def ensure(self, rows: int) -> None:
        """Allocate chunks until global rows ``0 .. rows-1`` exist (never beyond the capacity). A new chunk starts
        at a multiple of the row size; views made by :meth:`mapped` before it are dropped (the next call includes
        it). Raises :class:`HostMemoryError` when the OS refuses a chunk (the chunks allocated before stay)."""
        if self.closed:
            raise RuntimeError("the host store was closed")
        while self.allocated_rows < min(rows, self.capacity_rows):
            n = min(self.chunk_rows, self.capacity_rows - self.allocated_rows)
            try:
                memory = torch.zeros((n + 1) * self.row_dim, dtype=self.dtype, pin_memory=self.pinned)
            except (RuntimeError, MemoryError) as error:  # torch: "DefaultCPUAllocator: can't allocate memory"
                raise HostMemoryError(f"the host store could not allocate a chunk of {(n + 1) * self.row_dim} "
                                      f"values ({error})") from error
            self._add_chunk(memory, n)

    def _add_chunk(self, memory: torch.Tensor, rows: int) -> None:
        """Chunk of ``rows`` rows inside ``memory`` (``rows + 1`` rows long), starting at a multiple of the row size."""
        row_bytes = self.row_dim * memory.element_size()
        skip = (-memory.data_ptr()) % row_bytes // memory.element_size()
        self._allocations.append(memory)
        self.chunks.append(memory[skip:skip + rows * self.row_dim].view(rows, self.row_dim))
        self._mapped.clear()

    def preallocate(self, workers: int | None = None, progress: Progress | None = None) -> None:
        """Allocate every chunk up to the capacity now (a server's start, not its first admissions): pageable memory
        first-touched by ``workers`` threads and, on CUDA, page-locked chunk by chunk
        (:func:`~dhisparse.kv.pinned_memory.touch_and_pin`); ``progress(bytes_done, bytes_total)`` after each chunk."""
        if self.closed:
            raise RuntimeError("the host store was closed")
        sizes, rows = [], self.allocated_rows
        while rows < self.capacity_rows:
            sizes.append(min(self.chunk_rows, self.capacity_rows - rows))
            rows += sizes[-1]
        memories = [torch.empty((n + 1) * self.row_dim, dtype=self.dtype) for n in sizes]
        pinned: list[torch.Tensor] = []
        try:
            touch_and_pin(memories, self.pinned, workers, progress, pinned)
        except BaseException:
            for memory in pinned:
                unpin(memory)
            raise
        self._registered.extend(pinned)
        for memory, n in zip(memories, sizes, strict=True):
            self._add_chunk(memory, n)

    def close(self) -> None:
        """Release every chunk now (shutdown): chunks pinned by :meth:`preallocate` are unregistered before their
        memory is freed, and torch's cache of pinned blocks (the lazily allocated chunks) is emptied. Views made by
        :meth:`mapped` must not be used afterwards; the store refuses further growth."""
        self.closed = True
        self._mapped.clear()
        self.chunks.clear()
        registered, self._registered = self._registered, []
        for memory in registered:
            unpin(memory)
        lazily_pinned = self.pinned and len(self._allocations) > len(registered)
        self._allocations.clear()
        if lazily_pinned and torch.cuda.is_initialized():
            _empty_host_cache()


    def mapped(self, device: torch.device) -> MappedRows | None:
        """Every allocated chunk as one view on ``device`` (``None`` where it cannot be made: see
        :func:`~dhisparse.kv.mapped_host.map_chunks`); made once per device and growth of the store."""
        if device not in self._mapped:
            self._mapped[device] = map_chunks(self.chunks, self.chunk_rows, device)
        return self._mapped[device]

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        assert dim == 0
        index = index.to(self.device, torch.int64)
        if len(self.chunks) == 1:
            return self.chunks[0].index_select(0, index)
        chunk_of = index // self.chunk_rows
        if not self.pinned:
            return self._index_select_host(index, chunk_of)
        out = torch.zeros(index.numel(), self.row_dim, dtype=self.dtype)
        for k, chunk in enumerate(self.chunks):
            local = (index - k * self.chunk_rows).clamp(0, chunk.shape[0] - 1)
            out = torch.where((chunk_of == k).unsqueeze(1), chunk.index_select(0, local), out)
        return out

    def _index_select_host(self, index: torch.Tensor, chunk_of: torch.Tensor) -> torch.Tensor:
        """:meth:`index_select` of a store that lives on the CPU alone (no device): the indices are host values,
        so each chunk gathers only its own rows (the same result as the fixed-shape pass over every chunk, whose
        cost grows with the number of chunks)."""
        out = torch.zeros(index.numel(), self.row_dim, dtype=self.dtype)
        n_chunks = len(self.chunks)
        chunk_of = torch.where((chunk_of >= 0) & (chunk_of < n_chunks), chunk_of, n_chunks)  # n_chunks: none
        order = torch.argsort(chunk_of, stable=True)
        counts = torch.bincount(chunk_of, minlength=n_chunks + 1).tolist()
        begin = 0
        for k, chunk in enumerate(self.chunks):
            if counts[k]:
                at = order[begin:begin + counts[k]]
                local = (index[at] - k * self.chunk_rows).clamp(0, chunk.shape[0] - 1)
                out.index_copy_(0, at, chunk.index_select(0, local))
            begin += counts[k]
        return out

    def index_copy_(self, dim: int, index: torch.Tensor, values: torch.Tensor) -> ChunkedRows:
        assert dim == 0
        index = index.to(self.device, torch.int64)
        values = values.to(self.dtype)
        if len(self.chunks) == 1:
            self.chunks[0].index_copy_(0, index, values)
            return self
        chunk_of = index // self.chunk_rows
        # host indices: writes into the host store always have them on the host; visit only the chunks written
        for k in torch.unique(chunk_of).tolist():
            if 0 <= k < len(self.chunks):
                sel = chunk_of == k
                self.chunks[k].index_copy_(0, index[sel] - k * self.chunk_rows, values[sel])
        return self

    def fill_rows_(self, index: torch.Tensor, value: float) -> None:
        self.index_copy_(0, index, torch.full((index.numel(), self.row_dim), value, dtype=self.dtype))

    def zero_(self) -> ChunkedRows:
        for c in self.chunks:
            c.zero_()
        return self


class HostStore:
    """Host rows (:class:`ChunkedRows`) of a fixed capacity and a page allocator.

    Contract:
        - Host page ``h`` is rows ``h*page_rows .. (h+1)*page_rows - 1`` of :attr:`rows`. Requests own host
          pages for their whole capacity from admission to release; which of them hold data is tracked by
          the request (``HOST_EMPTY / HOST_PENDING / HOST_VALID`` per page and source).
        - The capacity is ``host_bytes // page_bytes`` pages, fixed at construction. Memory is allocated in
          chunks of ``chunk_bytes`` (pinned when the device is CUDA) as pages are first handed out; a chunk
          never moves, so nothing is ever copied to grow the store. :meth:`allocate` refuses (returns
          ``None``) when fewer pages are free than asked for: admission then waits. A chunk the OS refuses raises
          :class:`HostMemoryError` from :meth:`back` / :meth:`allocate` with nothing taken.
        - A configured ``host_bytes`` beyond the memory this process may use (physical, or its cgroup's limit) is
          refused at construction; 0 means half of that (``kv/host_memory.py``).
        - Freed pages are overwritten with NaN when ``poison_freed`` (tests).
    """

    def __init__(self, layout: KVLayout, page_rows: int, device: torch.device, poison_freed: bool = False,
                 host_bytes: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.page_rows = page_rows
        self.row_dim = layout.storage_dim
        self.dtype = layout.storage_dtype
        self.pinned = device.type == "cuda"
        self.poison_freed = poison_freed
        page_bytes = page_rows * layout.row_bytes
        if host_bytes:
            check_host_bytes(host_bytes)  # ConfigError at start, naming host_bytes and the limit
        self.host_bytes = host_bytes or default_host_bytes()
        self.num_pages = self.host_bytes // page_bytes
        # Pinned: a chunk and its spare alignment row stay within ``chunk_bytes`` (torch's pinned allocator rounds
        # an allocation up to a power of two, which a default-sized chunk plus one row would double).
        spare = layout.row_bytes if self.pinned else 0
        chunk_pages = max(1, min(self.num_pages, (chunk_bytes - spare) // page_bytes))
        self.rows = ChunkedRows(self.num_pages * page_rows, chunk_pages * page_rows, self.row_dim, self.dtype,
                                self.pinned)
        # Free pages: the freed ids (a heap, all below the frontier) and every id from the frontier up (never used),
        # so a large store costs nothing until it is used.
        self._freed: list[int] = []
        self._frontier = 0

    def preallocate(self, workers: int | None = None, progress: Progress | None = None) -> None:
        """Allocate (and on CUDA pin) the whole capacity now, in parallel: :meth:`ChunkedRows.preallocate`."""
        self.rows.preallocate(workers, progress)

    def close(self) -> None:
        """Release the host memory (:meth:`ChunkedRows.close`); the store cannot be used afterwards."""
        self.rows.close()

    @property
    def used_pages(self) -> int:
        return self._frontier - len(self._freed)

    @property
    def free_pages(self) -> int:
        return self.num_pages - self.used_pages

    def _take(self) -> int:
        if self._freed:
            return heapq.heappop(self._freed)
        self._frontier += 1
        return self._frontier - 1

    def back(self, count: int) -> None:
        """Make sure the next ``count`` pages :meth:`allocate` hands out have memory (allocating chunks now), so an
        admission can find out before it reserves anything else. Raises :class:`HostMemoryError`."""
        if 0 < count <= self.free_pages:
            reused = min(count, len(self._freed))  # freed ids lie below the frontier: their chunks exist
            self.rows.ensure((self._frontier + count - reused) * self.page_rows)

    def allocate(self, count: int) -> torch.Tensor | None:
        """Take ``count`` pages (lowest ids first) as int64 page ids on CPU, or ``None`` if fewer are free. Raises
        :class:`HostMemoryError` (with every page given back) when their memory cannot be allocated."""
        if count > self.free_pages:
            return None
        ids = [self._take() for _ in range(count)]
        if ids:
            try:
                self.rows.ensure((max(ids) + 1) * self.page_rows)
            except HostMemoryError:
                for page in ids:  # nothing taken: the store is as before
                    heapq.heappush(self._freed, page)
                self._fold_frontier()
                raise
        return torch.tensor(ids, dtype=torch.int64)

    def _fold_frontier(self) -> None:
        """Freed ids just below the frontier become never-used again (keeps ``_freed`` below the frontier small)."""
        freed = set(self._freed)
        while self._frontier - 1 in freed:
            self._frontier -= 1
            freed.discard(self._frontier)
        self._freed = sorted(freed)
        heapq.heapify(self._freed)

    def free(self, pages: torch.Tensor) -> None:
        ids = pages.flatten().tolist()
        for p in ids:
            heapq.heappush(self._freed, p)
        if self.poison_freed and ids:
            rows = (torch.tensor(ids).unsqueeze(1) * self.page_rows + torch.arange(self.page_rows)).reshape(-1)
            self.rows.fill_rows_(rows, float("nan") if self.dtype.is_floating_point else 255)

    def rows_of(self, pages: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Host row index of each position given the request's host page ids (same leading shape)."""
        return pages * self.page_rows + positions % self.page_rows

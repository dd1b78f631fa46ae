"""Streamed prefill: a prompt's rows go into the request's host-store pages chunk by chunk, so the prefill keeps only
the current chunk's rows on the device (not the whole prompt's, as a ``LocalKV`` does). For the hierarchy policies
with a host store (``hisparse``, ``adaptive``) the manager reserves host pages for the whole request at admission
(``history_import.history_host_rows`` names the prompt's rows in them; :meth:`KVManager.prefill_kv` builds this
store). The prefill runs chunk after chunk over a :class:`StreamedPrefillKV`:

- ``write`` puts the chunk's rows in a device buffer of ``prefill_chunk_tokens`` rows per source and its indexer
  keys straight into the request's key pages in the arena (:class:`dhisparse.kv.index_keys.RequestKeys`; with FP8
  keys, whose stored form is quantized, into a buffer of the prompt's keys instead, imported afterwards);
- ``gather`` serves positions of the current chunk from that buffer and earlier positions from the host store
  (the distinct positions the chunk's queries selected, one host→device copy per layer and query tile);
- ``end`` (after each chunk's forward) copies the chunk's rows into the host pages.

The manager then imports the prompt as a history already in its host pages (``import_prompt`` with ``rows=None``,
the path of disaggregated prefill: tail and, ``adaptive``, optional pages are filled from host). Rows round-trip
through the host in the layout's native format unchanged (same dtype), so tokens are exactly those of the
``LocalKV`` prefill; FP8 rows would let later chunks attend to quantized earlier rows, so ``kv_dtype='fp8'`` keeps
the ``LocalKV``.

With native keys nothing of the prefill's own KV scales with the prompt on the device: the keys are where decode
reads them (charged at admission with the request's other pages). With FP8 keys the prompt's keys (``[T,
index_head_dim]`` per indexer layer) are held here until the import quantizes them into the request's key pages, so
the prefill's indexer scores the exact keys as the ``LocalKV`` prefill does.
"""

from __future__ import annotations

import torch

from dhisparse.host_values import to_device
from dhisparse.kv.config import KVLayout
from dhisparse.kv.host_store import ChunkedRows
from dhisparse.kv.index_keys import RequestKeys


class StreamedPrefillKV:
    """``StepKV`` of one request's prefill (B = 1) whose committed rows live in host-store rows ``host_rows`` at
    ``row_index [num_sources, prompt_len]`` (CPU int64); ``chunk_tokens`` rows per source on ``device``.
    ``request_keys``: the request's key pages (native keys), written and read in place; ``None``: a key buffer of
    the whole prompt (:attr:`keys`, empty when the keys are written in place)."""

    query_tiled_gather = True  # gather is a lookup with no per-layer state: attention may read it per query tile
    device_attention = False

    def __init__(self, layout: KVLayout, host_rows: ChunkedRows, row_index: torch.Tensor, chunk_tokens: int,
                 dtype: torch.dtype, device: torch.device, request_keys: RequestKeys | None = None) -> None:
        if layout.row_format != "native":
            raise ValueError(f"a streamed prefill needs native rows (row_format {layout.row_format!r})")
        self.layout, self.host_rows, self.row_index = layout, host_rows, row_index
        self.source_of_layer = layout.source_of_layer
        sources, prompt_len = row_index.shape
        self.buffer = torch.zeros(sources, chunk_tokens, layout.row_dim, dtype=dtype, device=device)
        self.request_keys = request_keys
        self.keys = {} if request_keys is not None else {
            i: torch.zeros(prompt_len, layout.index_key_dim, dtype=dtype, device=device) for i in layout.indexer_layers}
        self.length = 0  # rows committed to the host store
        self.query_len = 0
        self.lengths = torch.zeros(1, dtype=torch.int64, device=device)
        self.max_length = 0

    def begin(self, query_len: int) -> StreamedPrefillKV:
        if query_len > self.buffer.shape[1]:
            raise ValueError(f"a prefill chunk of {query_len} tokens exceeds chunk_tokens={self.buffer.shape[1]}")
        self.query_len = query_len
        self.max_length = self.length + query_len
        self.lengths = to_device([self.max_length], torch.int64, self.buffer.device)
        return self

    def end(self) -> None:
        """Copy the chunk's rows into their host pages (every source at once)."""
        q, start = self.query_len, self.length
        index = self.row_index[:, start:start + q].reshape(-1)
        self.host_rows.index_copy_(0, index, self.layout.encode(self.buffer[:, :q]).reshape(q * len(self.buffer), -1)
                                   .to(self.host_rows.device))
        self.length += q
        self.query_len = 0

    def write(self, layer: int, rows: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        self.buffer[self.source_of_layer[layer], : self.query_len] = rows[0]
        if index_keys is None:
            return
        if self.request_keys is not None:
            self.request_keys.write(layer, self.length, index_keys[0])
        else:
            self.keys[layer][self.length:self.length + self.query_len] = index_keys[0]

    def index_keys(self, layer: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.max_length if stop is None else stop
        if self.request_keys is not None:
            return self.request_keys.read(layer, start, stop).unsqueeze(0)
        return self.keys[layer][start:stop].unsqueeze(0)

    def attend(self, layer: int, positions: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor,
               softmax_scale: float) -> None:
        return None  # the model attends over the gathered rows

    def gather(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        source = self.source_of_layer[layer]
        pos = positions.clamp(min=0)
        out = self.buffer[source][(pos - self.length).clamp(min=0)]
        if self.length > 0:
            # Earlier chunks: the distinct selected positions, read from the host store in one gather. On a GPU
            # the selection is read on the host here (prefill only; a decode step never takes this path).
            earlier = pos.clamp(max=self.length - 1).reshape(-1).cpu()
            wanted, inverse = torch.unique(earlier, return_inverse=True)
            fetched = self.layout.decode(self.host_rows.index_select(0, self.row_index[source, wanted]))
            past = to_device(fetched, out.dtype, out.device)[to_device(inverse, None, out.device)].view_as(out)
            out = torch.where((pos < self.length).unsqueeze(-1), past, out)
        return out.masked_fill((positions < 0).unsqueeze(-1), 0)

"""DeepSeek-V4's pages in the prefix cache (``kv/prefix_rows.py``): what a cached page holds, what a hit recomputes.

**Rows and spans.** The V4 hierarchy's rows are CSA compressed entries (``kv/deepseek_v4.py``): row 0 is a zero row,
row ``j + 1`` is entry ``j``, which tokens ``j·r … (j+1)·r - 1`` complete (``r = compress_rate_csa``). So
``tokens_per_row = r``, ``lead_rows = 1``, and page ``i`` spans tokens ``E(i) … E(i+1) - 1`` with ``E(i) = max(0,
(i·page_rows - 1)·r)``; its key is chained over the token ids of that span (every entry of the page depends on them
and on everything before).

**Stored with a page** (besides its rows, one per CSA KV source): the entries the V4 store keeps outside the
hierarchy, of every window that completes within the page's span — each CSA compressor's indexer keys
(``index_head_dim`` per entry) and each HCA compressor's KV entries (``head_dim``), at most ``ceil(page_rows·r /
rate)`` per compressor (slots padded with zeros) — packed after the page's (absent) indexer keys in the entry's host
pages. A hit on ``n`` pages therefore restores every compressed entry complete within ``E(n)`` tokens.

**Recomputed**: each layer's sliding window and the compressors' pending projections at ``E(n)``. The prefill
restarts at ``model.deepseek_v4.prefix.restart_position(E(n))`` (about ``num_layers · (sliding_window - 1)`` tokens
earlier, see there) and keeps the restored entries; a hit that leaves nothing to save is not taken. The tokens a
request reuses (``kv_prefix_reused_tokens``) are that restart position, not ``E(n)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from dhisparse.kv.prefix_rows import PrefixRows
from dhisparse.model.deepseek_v4.config import CSA, DeepseekV4Config
from dhisparse.model.deepseek_v4.kv_state import Key, state_keys
from dhisparse.model.deepseek_v4.prefix import restart_position


class V4PrefixRows(PrefixRows):
    """V4's scheme (see the module docstring). ``entries_of(request)``: the request's entry tables (``{key: [≥ n,
    d]}``, every compressor whose entries live outside the hierarchy) while the manager may register its pages;
    ``forgotten(request)``: the manager is done with it (the store frees what it kept for registration)."""

    def __init__(self, cfg: DeepseekV4Config, page_rows: int,
                 entries_of: Callable[[str], Mapping[Key, torch.Tensor]], forgotten: Callable[[str], None]) -> None:
        self.cfg, self.page_rows = cfg, page_rows
        self.tokens_per_row, self.lead_rows = cfg.compress_rate_csa, 1
        self.entries_of, self.forgotten = entries_of, forgotten
        span = page_rows * cfg.compress_rate_csa
        # (key, rate, slots per page, width) of every compressor whose entries a page carries as state
        self.parts: list[tuple[Key, int, int, int]] = []
        for key, (rate, pending, width) in state_keys(cfg).items():
            if key[1] == "kv" and cfg.layer_types[key[0]] == CSA:
                continue  # the page's rows
            self.parts.append((key, rate, -(-span // rate), width // 2 if pending == 2 * rate else width))
        self.state_values = sum(slots * width for _, _, slots, width in self.parts)
        self.hits: dict[str, torch.Tensor] = {}  # request -> its hit's state [n, state_values] until its prefill

    def describe(self) -> tuple[object, ...]:
        return (*super().describe(), tuple(self.parts))

    def reused_tokens(self, hit_tokens: int) -> int:
        return restart_position(self.cfg, hit_tokens)

    def save_state(self, request_id: str, page: int) -> torch.Tensor:
        tables = self.entries_of(request_id)
        begin, end = self.page_end(page, self.page_rows), self.page_end(page + 1, self.page_rows)
        out = []
        for key, rate, slots, width in self.parts:
            lo, hi = begin // rate, end // rate
            part = torch.zeros(slots, width, dtype=tables[key].dtype, device=tables[key].device)
            part[: hi - lo] = tables[key][lo:hi]
            out.append(part.reshape(-1))
        return torch.cat(out).cpu() if out else torch.zeros(0)

    def load_state(self, request_id: str, values: torch.Tensor) -> None:
        self.hits[request_id] = values

    def take_hit(self, request_id: str) -> tuple[int, dict[Key, torch.Tensor]] | None:
        """The request's hit, once: ``(hit tokens E(n), {key: the entries [E(n) // rate, d] of every compressor
        whose entries a page carries})`` (CPU), or ``None`` without a hit."""
        values = self.hits.pop(request_id, None)
        if values is None:
            return None
        n = values.shape[0]
        ends = torch.tensor([self.page_end(i, self.page_rows) for i in range(n + 1)])
        entries, offset = {}, 0
        for key, rate, slots, width in self.parts:
            block = values[:, offset:offset + slots * width].reshape(n, slots, width)
            counts = torch.div(ends[1:], rate, rounding_mode="floor") - torch.div(ends[:-1], rate,
                                                                                   rounding_mode="floor")
            entries[key] = block[torch.arange(slots) < counts.unsqueeze(1)]  # page-major: entries 0 .. E(n)//rate-1
            offset += slots * width
        return int(ends[-1]), entries

    def forget(self, request_id: str) -> None:
        self.hits.pop(request_id, None)
        self.forgotten(request_id)

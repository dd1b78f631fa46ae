"""A reference driver for KVManager tests: plays the engine and the model with random rows and keeps a
plain copy of every request's history, so every gather and index_keys call can be checked exactly.

Token-driven requests (:meth:`KVDriver.submit_tokens`) play prefix reuse: every row and indexer key is a fixed random
function of the token ids up to its position (:meth:`KVDriver.content`), as a model's would be, so a page another
request cached must read back as exactly the rows this request's own tokens define. Their prompts stream in through
``prefill_kv`` starting after the cached prefix, their decode tokens are drawn from a small vocabulary (sequences
meet), and their whole sequence is named before ``release`` (its complete pages join the cache)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from dhisparse.kv.config import KVConfig, KVLayout
from dhisparse.kv.manager import KVManager


@dataclass
class RefRequest:
    prompt_len: int
    max_new_tokens: int
    rows: list[torch.Tensor]  # per source [length, row_dim]
    keys: dict[int, torch.Tensor]  # per indexer layer [length, index_key_dim]
    finished_steps: int = 0
    tokens: list[int] | None = None  # token-driven requests: the token id of every row

    @property
    def length(self) -> int:
        return self.rows[0].shape[0]

    @property
    def last_length(self) -> int:
        """Length after which the engine stops stepping (max_new_tokens - 1 decode rows)."""
        return self.prompt_len + self.max_new_tokens - 1


@dataclass
class KVDriver:
    manager: KVManager
    seed: int = 0
    check_every_op: bool = True
    refs: dict[str, RefRequest] = field(default_factory=dict)
    queued: dict[str, tuple[int, int]] = field(default_factory=dict)
    queued_tokens: dict[str, list[int]] = field(default_factory=dict)
    vocab: int = 3
    chunk_tokens: int = 3
    sequences: list[list[int]] = field(default_factory=list)  # token sequences seen (prompts to extend)
    _content: dict[tuple[int, ...], tuple[torch.Tensor, dict[int, torch.Tensor]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.gen = torch.Generator().manual_seed(self.seed)

    @property
    def layout(self) -> KVLayout:
        return self.manager.layout

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64).to(self.layout.dtype)

    def check(self) -> None:
        if self.check_every_op:
            self.manager.check_invariants()

    # ------------------------------------------------------------------------------------------ engine ops
    def submit(self, rid: str, prompt_len: int, max_new_tokens: int, import_now: bool = True) -> bool:
        """try_admit (+ prefill import on success unless ``import_now`` is False: then call
        :meth:`import_prompt` later); a refused request stays queued."""
        ok = self.manager.try_admit(rid, prompt_len, max_new_tokens)
        self.check()
        if not ok:
            self.queued[rid] = (prompt_len, max_new_tokens)
            return False
        self.queued.pop(rid, None)
        if import_now:
            self.import_prompt(rid, prompt_len, max_new_tokens)
        return True

    def import_prompt(self, rid: str, prompt_len: int, max_new_tokens: int) -> None:
        lay = self.layout
        rows = self._rand(lay.num_sources, prompt_len, lay.row_dim)
        keys = {layer: self._rand(prompt_len, lay.index_key_dim) for layer in lay.indexer_layers}
        self.manager.import_prompt(rid, rows, keys)
        self.refs[rid] = RefRequest(prompt_len, max_new_tokens, list(rows.clone()),
                                    {k: v.clone() for k, v in keys.items()})
        self.check()

    def retry_queued(self) -> None:
        for rid, (p, n) in list(self.queued.items()):
            if rid in self.queued_tokens:
                self.submit_tokens(rid, self.queued_tokens[rid], n)
            else:
                self.submit(rid, p, n)

    # ------------------------------------------------------------------------------------------ prefix reuse
    def content(self, tokens: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The row of every source ``[S, row_dim]`` and the indexer keys ``{layer: [index_key_dim]}`` of the last
        position of ``tokens`` (a fixed random function of the whole prefix)."""
        key = tuple(tokens)
        if key not in self._content:
            lay = self.layout
            self._content[key] = (self._rand(lay.num_sources, lay.row_dim),
                                  {layer: self._rand(lay.index_key_dim) for layer in lay.indexer_layers})
        return self._content[key]

    def _rows_of(self, tokens: list[int], start: int, stop: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Rows ``[S, stop - start, row_dim]`` and keys ``{layer: [stop - start, d]}`` of positions ``start ..``."""
        lay = self.layout
        parts = [self.content(tokens[: p + 1]) for p in range(start, stop)]
        if not parts:
            return (torch.zeros(lay.num_sources, 0, lay.row_dim, dtype=lay.dtype),
                    {layer: torch.zeros(0, lay.index_key_dim, dtype=lay.dtype) for layer in lay.indexer_layers})
        rows = torch.stack([r for r, _ in parts], 1)
        keys = {layer: torch.stack([k[layer] for _, k in parts]) for layer in lay.indexer_layers}
        return rows, keys

    def submit_tokens(self, rid: str, tokens: list[int], max_new_tokens: int) -> bool:
        """Name the prompt's tokens, try_admit, and on success stream the prompt in after its cached prefix."""
        m = self.manager
        m.set_token_ids(rid, tokens)
        refusals = m.counters["admission_refusals_host"]
        ok = m.try_admit(rid, len(tokens), max_new_tokens)
        self.check()
        if not ok:
            if m.counters["admission_refusals_host"] > refusals:  # cached pages never make an admission wait
                hit = {id(e) for e in m.prefix.lookup(rid, len(tokens))}  # (its own hit stays, to be reused)
                assert all(e.refs > 0 or id(e) in hit for e in m.prefix.cache.entries.values()), \
                    "an admission waited for host pages while cached pages nobody holds remained"
            self.queued[rid] = (len(tokens), max_new_tokens)
            self.queued_tokens[rid] = tokens
            return False
        self.queued.pop(rid, None)
        self.queued_tokens.pop(rid, None)
        self.sequences.append(list(tokens))
        self._prefill(rid, tokens, max_new_tokens)
        return True

    def _prefill(self, rid: str, tokens: list[int], max_new_tokens: int) -> None:
        m, lay = self.manager, self.layout
        cached = m.cached_prefix_tokens(rid)
        assert cached % m.config.page_rows == 0 and cached < len(tokens)
        rows, keys = self._rows_of(tokens, 0, len(tokens))
        store = m.prefill_kv(rid, self.chunk_tokens)
        if store is None:  # no streamed prefill (resident): no reuse either
            assert cached == 0
            m.import_prompt(rid, rows, keys)
        else:
            if cached:  # the cached prefix reads back as exactly this prompt's rows and keys
                store.begin(1)
                positions = torch.arange(cached).view(1, 1, -1)
                for layer in range(lay.num_layers):
                    got = store.gather(layer, positions)[0, 0]
                    assert torch.equal(got, rows[lay.source_of_layer[layer], :cached]), "cached rows differ"
                    if layer in lay.indexer_layers:
                        assert torch.equal(store.index_keys(layer, 0, cached)[0], keys[layer][:cached]), \
                            "cached indexer keys differ"
                store.query_len = 0
            for begin in range(cached, len(tokens), self.chunk_tokens):
                end = min(len(tokens), begin + self.chunk_tokens)
                store.begin(end - begin)
                for layer in range(lay.num_layers):
                    source = lay.source_of_layer[layer]
                    new_keys = keys[layer][begin:end].unsqueeze(0) if layer in lay.indexer_layers else None
                    store.write(layer, rows[source, begin:end].unsqueeze(0), new_keys)
                store.end()
            m.import_prompt(rid, None, None)
        self.refs[rid] = RefRequest(len(tokens), max_new_tokens, list(rows.clone()),
                                    {k: v.clone() for k, v in keys.items()}, tokens=list(tokens))
        self.check()

    def steppable(self) -> list[str]:
        return [rid for rid, ref in self.refs.items() if ref.length < ref.last_length]

    def step(self, rids: list[str], query_len: int, accept: dict[str, int] | None = None,
             mid_step: Callable[[], None] | None = None) -> None:
        """One batched step with random rows, checking index_keys and gather against the reference."""
        m, lay = self.manager, self.layout
        step = m.begin_step(rids, query_len)
        self.check()
        refs = [self.refs[r] for r in rids]
        starts = [ref.length for ref in refs]
        assert step.lengths.tolist() == [s + query_len for s in starts]
        new_rows = self._rand(lay.num_sources, len(rids), query_len, lay.row_dim)
        new_tokens: list[list[int]] = []
        token_keys: dict[int, torch.Tensor] = {}  # indexer layer -> [B, Q, d] keys of token-driven requests
        for b, ref in enumerate(refs):
            drawn = [self.rng.randrange(self.vocab) for _ in range(query_len)]
            new_tokens.append(drawn)
            if ref.tokens is not None:
                t_rows, t_keys = self._rows_of(ref.tokens + drawn, ref.length, ref.length + query_len)
                new_rows[:, b] = t_rows
                for layer, k in t_keys.items():
                    token_keys.setdefault(layer, self._rand(len(rids), query_len, lay.index_key_dim))[b] = k
        full = {s: [torch.cat([ref.rows[s], new_rows[s, b]]) for b, ref in enumerate(refs)]
                for s in range(lay.num_sources)}
        leader_positions: dict[int, torch.Tensor] = {}
        for layer in range(lay.num_layers):
            source = lay.source_of_layer[layer]
            keys = None
            if layer in lay.indexer_layers:
                keys = self._rand(len(rids), query_len, lay.index_key_dim)
                if layer in token_keys:
                    keys = torch.where(torch.tensor([r.tokens is not None for r in refs]).view(-1, 1, 1),
                                       token_keys[layer], keys)
            step.write(layer, new_rows[source], keys)
            if keys is not None:
                got = step.index_keys(layer)
                for b, ref in enumerate(refs):
                    want = torch.cat([ref.keys[layer], keys[b]])
                    assert torch.equal(got[b, : want.shape[0]], want), f"index keys of layer {layer}"
                    assert not bool(got[b, want.shape[0]:].any()), "index keys past the length must be 0"
                    ref.keys[layer] = want  # provisional; truncated after end_step
            leader = self._leader(layer)
            if leader is not None and leader in leader_positions:
                positions = leader_positions[leader]
            else:
                positions = self._positions(starts, query_len)
                leader_positions[layer] = positions
            if mid_step is not None and layer == lay.num_layers // 2:
                mid_step()
            got = step.gather(layer, positions)
            want = torch.zeros_like(got)
            for b in range(len(rids)):
                sel = positions[b]
                ok = sel >= 0
                want[b][ok] = full[source][b][sel[ok]]
            assert torch.equal(got, want), f"gather of layer {layer} returned other rows than were written"
        if accept is None:
            accept = {}
            for rid, ref in zip(rids, refs, strict=True):
                cap = min(query_len, ref.last_length - ref.length)
                accept[rid] = self.rng.randint(0 if self.rng.random() < 0.1 else min(1, cap), cap)
        m.end_step(accept)
        for b, (rid, ref) in enumerate(zip(rids, refs, strict=True)):
            if ref.tokens is not None:
                ref.tokens = ref.tokens + new_tokens[b][: accept[rid]]
            keep = ref.length + accept[rid]
            ref.rows = [full[s][b][:keep] for s in range(lay.num_sources)]
            ref.keys = {k: v[:keep] for k, v in ref.keys.items()}
        self.check()

    def _leader(self, layer: int) -> int | None:
        for group in self.layout.index_groups:
            if layer in group[1:]:
                return group[0]
        return None

    def _positions(self, starts: list[int], query_len: int) -> torch.Tensor:
        """Causal random selections: query q of request b picks <= index_topk distinct positions
        among ``0 .. starts[b] + q``, padded with -1 and shuffled."""
        k = self.layout.index_topk
        out = torch.full((len(starts), query_len, k), -1, dtype=torch.int64)
        for b, start in enumerate(starts):
            for q in range(query_len):
                visible = start + q + 1
                n = self.rng.randint(0, min(k, visible))
                picked = self.rng.sample(range(visible), n) + [-1] * (k - n)
                self.rng.shuffle(picked)
                out[b, q] = torch.tensor(picked)
        return out

    def finish(self, rid: str, failed: bool = False) -> None:
        """Release ``rid``; a token-driven request names its whole sequence first (plus the last sampled token,
        which has no row, as the engine does) unless it ``failed``."""
        ref = self.refs.get(rid)
        if ref is not None and ref.tokens is not None and not failed:
            self.manager.set_token_ids(rid, ref.tokens + [self.rng.randrange(self.vocab)])
            self.sequences.append(list(ref.tokens))
        self.manager.release(rid)
        self.refs.pop(rid, None)
        self.queued.pop(rid, None)
        self.queued_tokens.pop(rid, None)
        self.check()

    def poll(self) -> None:
        self.manager.poll()
        self.check()

    def drain(self) -> None:
        """Release everything and poll until the pool is empty."""
        for rid in list(self.refs) + list(self.queued):
            self.finish(rid)
        for _ in range(3):
            self.poll()


def make_layout(kind: str, dtype: torch.dtype = torch.float32, topk: int = 4) -> KVLayout:
    """Tiny layouts: ``deepseek`` (indexer per layer), ``glm`` (groups FSFS), ``shared`` (shared sources)."""
    if kind == "deepseek":
        return KVLayout(3, [0, 1, 2], 5, dtype, [0, 1, 2], 3, topk)
    if kind == "glm":
        return KVLayout(4, [0, 1, 2, 3], 5, dtype, [0, 2], 3, topk, [[0, 1], [2, 3]])
    if kind == "shared":
        return KVLayout(4, [0, 0, 1, 1], 5, dtype, [0, 2], 3, topk, [[0, 1], [2, 3]])
    raise ValueError(kind)


def make_manager(layout: KVLayout, policy: str, pool_bytes: int, hot_rows: int = 8, page_rows: int = 4,
                 max_query_len: int = 1, reserve_bytes: int = 0, refill: int = 2, host_bytes: int = 1 << 20,
                 host_chunk_bytes: int | None = None, debug_checks: bool = False, native: bool = False
                 ) -> KVManager:
    """``native``: the step resolves through the native CPU library (``kernels="auto"`` on a CPU device)
    instead of the torch resolver (the manager's default selection)."""
    cfg = KVConfig(policy=policy, pool_bytes=pool_bytes, hot_rows=hot_rows, page_rows=page_rows,
                   reserve_bytes=reserve_bytes, refill_pages_per_step=refill, max_query_len=max_query_len,
                   host_bytes=host_bytes)
    kernels = None
    if native:
        from dhisparse.kernels.selection import select_kernels

        kernels = select_kernels("auto", "cpu")
        if kernels.native_resolver is None:
            pytest.skip(f"native CPU resolver unavailable: {kernels.reason}")
    return KVManager(layout, cfg, torch.device("cpu"), poison_freed=True, debug_checks=debug_checks,
                     host_chunk_bytes=host_chunk_bytes, kernels=kernels)

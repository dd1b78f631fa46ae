"""Prefix reuse in multi-turn chat (issue 26): hit rate → prefill work and TTFT on one GPU rank.

Workload: ``clients`` closed-loop clients, each running ``sessions_per_client`` sessions of ``turns`` turns back to
back. Turn 1's prompt is ``context_tokens`` (document / system prompt + first message); every later prompt is the
whole history (previous prompt + previous reply) plus a new user message of ``turn_tokens``. A reply is
``reply_tokens``; a client sends its next turn when the reply ends plus a think time (exponential with mean
``think_s``, drawn per session and turn from ``seed``: a constant one would keep the clients in lockstep).
Sessions share nothing.

Decisions follow the runtime (``docs/prefix_reuse.md``) and use its own index, :class:`dhisparse.kv.prefix_cache.
PrefixCache` (reference counts, LRU of unreferenced leaves, deepest first within one use):

- **Hit**: the longest cached prefix of the prompt in whole ``page_rows`` pages, at most ``prompt − window`` tokens
  (``window``: ``max(1, drafter window)``).
- **Registration** at release: the full pages of the rows the turn wrote (``prompt + reply − 1``: the last
  generated token is never fed back), so turn ``t + 1`` can reuse turn ``t``'s prompt and reply.
- **Host capacity**: a cached page holds ``S + ceil(I × key_bytes / row_bytes)`` host pages (one per KV source, the
  indexer keys packed into pages of the same store); running requests hold their own pages (prompt + reply) in the
  host store (``hisparse`` / ``adaptive``). An admission that lacks host pages evicts unreferenced leaves LRU, and
  waits (FIFO) only when none is left. Capacity is ``host_bytes`` per rank (default the hardware's
  ``host_bytes_per_gpu``: a rank's host store holds its requests' histories under either attention shape).

Time, per real engine step (chunked prefill as the engine does it): the prefill lane gets
``max_prefill_tokens_per_step`` prompt tokens per step, FIFO; a step costs the decode step of the requests decoding
(:func:`dhisparse_planner.timing.decode_step_seconds` at their contexts, every selected row on device: the KV
policy's host fetches are the main planner's subject) plus its prefill chunks (:func:`prefill_chunk_seconds`: the
prefill FLOPs of positions ``[start, end)``) plus, on a hit, one host → device copy of the reused indexer keys over
the host link. TTFT = from arrival to the end of the step that prefilled the prompt's last chunk (admission wait,
lane queue and prefill included). Not modelled: the device KV pool (a session's device footprint under
``adaptive`` / ``hisparse`` is the main planner's), speculation, shared prefixes across sessions.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from dataclasses import dataclass, field

import torch

from dhisparse import defaults
from dhisparse.kv.prefix_cache import CachedPage, PrefixCache
from dhisparse_planner.specs import HardwareSpec, ModelSpec
from dhisparse_planner.timing import StepLoad, decode_step_seconds

_EMPTY = torch.empty(0, dtype=torch.int64)  # cached pages carry no data here: only their count matters


@dataclass(frozen=True)
class MultiTurnSpec:
    """A multi-turn workload and the engine settings it runs under (all real tokens).

    Attributes:
        context_tokens: turn 1's prompt.
        turn_tokens: the new user message of every later turn.
        reply_tokens: tokens generated per turn (ASSUMED workload figure; a parameter, reported with the table).
        turns: turns per session; clients: closed-loop clients (sessions at once); sessions_per_client: sessions
            each client runs back to back (the first is the warm-up, see :func:`per_turn`).
        reuse: prefix reuse on (the runtime's ``prefix_reuse``).
        page_rows: rows per KV page (the hit granularity); window: prompt tokens never reused (``max(1, drafter
            window)``).
        max_prefill_tokens_per_step: the engine's prefill budget per step.
        host_bytes: host store per rank (bytes; ``None``: the hardware's ``host_bytes_per_gpu``).
        think_s: mean user time between a reply and the next turn (seconds; exponential, ``seed``).
    """

    context_tokens: int
    turn_tokens: int
    reply_tokens: int = 512
    turns: int = 6
    clients: int = 16
    sessions_per_client: int = 2
    reuse: bool = True
    page_rows: int = defaults.PAGE_ROWS
    window: int = 1
    max_prefill_tokens_per_step: int = defaults.MAX_PREFILL_TOKENS_PER_STEP
    host_bytes: float | None = None
    think_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("context_tokens", "turn_tokens", "reply_tokens", "turns", "clients", "sessions_per_client",
                     "page_rows", "window", "max_prefill_tokens_per_step"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"MultiTurnSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.host_bytes is not None and self.host_bytes < 0:
            raise ValueError(f"MultiTurnSpec.host_bytes must be >= 0, got {self.host_bytes}")
        if self.think_s < 0:
            raise ValueError(f"MultiTurnSpec.think_s must be >= 0, got {self.think_s}")

    def prompt(self, turn: int) -> int:
        """Prompt tokens of turn ``turn`` (1-based)."""
        return self.context_tokens + (turn - 1) * (self.reply_tokens + self.turn_tokens)


def cached_page_bytes(model: ModelSpec, page_rows: int) -> int:
    """Host bytes of one cached page: one host page per KV source plus the page's indexer keys packed into host
    pages of the same store (``S + ceil(I × key_bytes / row_bytes)`` pages of ``page_rows`` rows)."""
    key_pages = -(-model.num_indexers * model.index_key_bytes // model.row_bytes)
    return (model.num_layers + key_pages) * page_rows * model.row_bytes


def _sum_positions(a: int, b: int) -> float:
    """Σ (p + 1) for p in [a, b): keys a query at position p scores."""
    return (b * (b + 1) - a * (a + 1)) / 2.0


def _sum_selected(a: int, b: int, topk: int) -> float:
    """Σ min(topk, p + 1) for p in [a, b): rows a query at position p attends."""
    def upto(n: int) -> float:
        return n * (n + 1) / 2.0 if n <= topk else topk * (topk + 1) / 2.0 + (n - topk) * topk
    return upto(b) - upto(a)


def prefill_chunk_seconds(hw: HardwareSpec, model: ModelSpec, start: int, end: int) -> float:
    """Prefill time of prompt positions ``[start, end)`` after ``start`` cached ones (seconds): the FLOPs of
    :func:`dhisparse_planner.timing.prefill_seconds` summed per position (a query at position ``p`` scores ``p + 1``
    indexer keys and attends ``min(topk, p + 1)`` rows), so chunks add up to the whole prompt."""
    if end <= start:
        return 0.0
    flops = (2.0 * model.active_params * (end - start)
             + model.num_indexers * 2.0 * model.index_heads * model.index_head_dim * _sum_positions(start, end)
             + model.num_layers * model.attn_flops_per_head_row * model.attn_heads * model.gpus
             * _sum_selected(start, end, model.index_topk))
    return flops / model.attn_tp / (hw.flops_per_s * hw.mfu)


def hit_copy_seconds(hw: HardwareSpec, model: ModelSpec, reused: int) -> float:
    """One host → device copy of the reused prefix's indexer keys (seconds)."""
    return reused * model.num_indexers * model.index_key_bytes / hw.host_link_bytes_per_s


@dataclass
class Turn:
    """One request: a session's turn and what happened to it (times in seconds, tokens real)."""

    client: int
    session: int
    turn: int
    prompt: int
    arrival_s: float
    reused: int = 0
    prefilled: int = 0  # prompt tokens prefilled so far
    generated: int = 0
    own_pages: int = 0  # host pages it allocated (beyond the cached ones it holds)
    held: list[CachedPage] = field(default_factory=list)
    admitted_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def ttft_s(self) -> float:
        return (self.first_token_s or math.nan) - self.arrival_s


@dataclass
class MultiTurnResult:
    spec: MultiTurnSpec
    turns: list[Turn]
    host_pages: int  # capacity in cached-page units
    page_bytes: int
    cached_bytes_mean: float  # host bytes of cached pages, time-weighted over the run
    cached_bytes_max: float
    evicted_pages: int
    duration_s: float


def _key(session: int, page: int) -> bytes:
    return session.to_bytes(8, "little") + page.to_bytes(8, "little")


class _Engine:
    """Step-level simulation of one rank (module docstring)."""

    def __init__(self, hw: HardwareSpec, model: ModelSpec, spec: MultiTurnSpec) -> None:
        self.hw, self.model, self.spec = hw, model, spec
        self.page_bytes = cached_page_bytes(model, spec.page_rows)
        host = hw.host_bytes_per_gpu if spec.host_bytes is None else spec.host_bytes
        self.capacity = int(host // self.page_bytes)
        self.cache = PrefixCache()
        self.own = 0  # host pages held by running requests beyond cached entries
        self.evicted = 0
        self.clock = 0.0
        self.waiting: deque[Turn] = deque()
        self.prefilling: deque[Turn] = deque()
        self.decoding: list[Turn] = []
        self.pending: list[Turn] = []  # issued, arriving later (think time)
        self.done: list[Turn] = []

    # admission -----------------------------------------------------------------------------------------------
    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.spec.page_rows)

    def _try_admit(self, t: Turn) -> bool:
        spec = self.spec
        held: list[CachedPage] = []
        if spec.reuse:
            cap = max(0, t.prompt - spec.window) // spec.page_rows
            held = self.cache.match(_key(t.session, i) for i in range(cap))
            self.cache.pin(held)
        need = self._pages(t.prompt + spec.reply_tokens) - len(held)
        while self.capacity - self.own - len(self.cache) < need:
            if self.cache.evict_one() is None:
                self.cache.drop(held)
                return False
            self.evicted += 1
        self.cache.touch(held)
        t.held, t.reused, t.own_pages = held, len(held) * spec.page_rows, need
        t.prefilled = t.reused
        self.own += need
        t.admitted_s = self.clock
        return True

    def _release(self, t: Turn) -> None:
        spec = self.spec
        self.own -= t.own_pages
        if spec.reuse:
            full = (t.prompt + spec.reply_tokens - 1) // spec.page_rows
            parent = t.held[-1] if t.held else None
            mine: list[CachedPage] = []
            for i in range(len(t.held), full):
                key = _key(t.session, i)
                entry = self.cache.entries.get(key)
                if entry is None:  # the page moves from the request's pages into the cache
                    entry = self.cache.insert(key, parent, _EMPTY, _EMPTY)
                    mine.append(entry)
                parent = entry
            self.cache.drop(t.held + mine)
        t.held = []

    def _think(self, t: Turn) -> float:
        """Think time after ``t``: drawn per (seed, session, turn), so reuse on and off see the same ones."""
        if self.spec.think_s <= 0:
            return 0.0
        return random.Random(f"{self.spec.seed}/{t.session}/{t.turn}").expovariate(1.0 / self.spec.think_s)

    # the loop ------------------------------------------------------------------------------------------------
    def _issue(self, client: int, session_index: int, turn: int, at: float) -> None:
        session = client * self.spec.sessions_per_client + session_index
        t = Turn(client, session, turn, self.spec.prompt(turn), at)
        (self.pending if at > self.clock else self.waiting).append(t)

    def _step_seconds(self, chunks: list[tuple[Turn, int, int]]) -> float:
        m, hw = self.model, self.hw
        n = len(self.decoding)
        if n:
            ctx = [t.prompt + t.generated for t in self.decoding]
            load = StepLoad(batch=n, query_tokens=n,
                            attention_rows=float(m.num_layers * sum(min(m.index_topk, c) for c in ctx)),
                            index_keys_scanned=float(m.num_indexers * sum(ctx)),
                            index_keys_read=float(m.num_indexers * sum(ctx)), host_bytes=0.0)
            step = decode_step_seconds(hw, m, load)["total"]
        else:
            step = hw.step_overhead_s
        for t, a, b in chunks:
            step += prefill_chunk_seconds(hw, m, a, b)
            if a == t.reused and t.reused:
                step += hit_copy_seconds(hw, m, t.reused)
        return step

    def run(self) -> MultiTurnResult:
        spec = self.spec
        for c in range(spec.clients):
            self._issue(c, 0, 1, 0.0)
        cached_area, cached_max = 0.0, 0.0
        total = spec.clients * spec.sessions_per_client * spec.turns
        while len(self.done) < total:
            arrived = [t for t in self.pending if t.arrival_s <= self.clock]
            self.pending = [t for t in self.pending if t.arrival_s > self.clock]
            self.waiting.extend(sorted(arrived, key=lambda t: t.arrival_s))
            while self.waiting and self._try_admit(self.waiting[0]):
                self.prefilling.append(self.waiting.popleft())
            if not self.prefilling and not self.decoding:
                if not self.pending:
                    raise RuntimeError("multi-turn: a turn can never be admitted: the host store is smaller than "
                                       f"one request ({self.capacity} pages of {self.page_bytes} bytes)")
                self.clock = min(t.arrival_s for t in self.pending)
                continue
            budget, chunks = spec.max_prefill_tokens_per_step, []
            for t in self.prefilling:
                if budget <= 0:
                    break
                take = min(budget, t.prompt - t.prefilled)
                chunks.append((t, t.prefilled, t.prefilled + take))
                budget -= take
            step = self._step_seconds(chunks)
            cached = len(self.cache) * self.page_bytes
            cached_area += cached * step
            cached_max = max(cached_max, cached)
            self.clock += step
            for t in self.decoding:
                t.generated += 1
            for t, _, b in chunks:
                t.prefilled = b
                if b == t.prompt:
                    t.first_token_s, t.generated = self.clock, 1
                    self.prefilling.remove(t)
                    self.decoding.append(t)
            for t in [t for t in self.decoding if t.generated >= spec.reply_tokens]:
                self.decoding.remove(t)
                t.finish_s = self.clock
                self._release(t)
                self.done.append(t)
                s_index = t.session - t.client * spec.sessions_per_client
                think = self._think(t)
                if t.turn < spec.turns:
                    self._issue(t.client, s_index, t.turn + 1, self.clock + think)
                elif s_index + 1 < spec.sessions_per_client:
                    self._issue(t.client, s_index + 1, 1, self.clock + think)
        return MultiTurnResult(spec, self.done, self.capacity, self.page_bytes,
                               cached_area / self.clock if self.clock else 0.0, cached_max, self.evicted, self.clock)


def simulate_multi_turn(hw: HardwareSpec, model: ModelSpec, spec: MultiTurnSpec) -> MultiTurnResult:
    """Run ``spec`` on one rank of ``model`` on ``hw`` (module docstring)."""
    return _Engine(hw, model, spec).run()


def per_turn(result: MultiTurnResult, skip_first_session: bool = True) -> list[dict[str, float]]:
    """Per turn: mean prompt, reused and prefilled tokens, hit rate (reused / prompt tokens) and mean TTFT over the
    sessions (by default without each client's first session: every client starts at once, so the first wave's
    turns arrive in lockstep; later sessions are the closed loop's steady state)."""
    spec = result.spec
    keep = [t for t in result.turns
            if not skip_first_session or spec.sessions_per_client == 1 or t.session % spec.sessions_per_client]
    out = []
    for turn in range(1, spec.turns + 1):
        ts = [t for t in keep if t.turn == turn]
        prompt = sum(t.prompt for t in ts)
        reused = sum(t.reused for t in ts)
        out.append({"turn": turn, "prompt_tokens": prompt / len(ts), "reused_tokens": reused / len(ts),
                    "prefill_tokens": (prompt - reused) / len(ts), "hit_rate": reused / prompt,
                    "mean_ttft_s": sum(t.ttft_s for t in ts) / len(ts)})
    return out


def with_reuse(spec: MultiTurnSpec, reuse: bool) -> MultiTurnSpec:
    return dataclasses.replace(spec, reuse=reuse)

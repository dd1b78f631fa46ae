"""What logit processing needs from one request's parameters, built once per request instead of every step.

A request's bad words, its min_tokens stop set and its embedding bias never change while it runs, so their device
tensors are built the first time a step processes the request and reused by every later step (and by every
sequence sharing the parameters object): a request with K bad words then costs each step only a device-side pad
and compare over ``[K, W]``, never a Python walk over its words. Tables are keyed by the parameters object's
identity (hashing a frozen ``SamplingParams`` would walk every word each time) and dropped with it.

Shapes: ``bad_prefix [K, W]`` int64, each word's tokens before its last, right-aligned and padded with -1 (any
token); ``bad_last [K]`` int64; ``stop_ids [S]`` int64, the tokens banned before ``min_tokens``; ``bias [V]``
float32.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dhisparse.host_values import to_device
from dhisparse.sampling.params import SamplingParams


@dataclass
class RequestTables:
    """One request's processing tables, per device (see the module docstring). Holds the parameters' fields, not the
    parameters object (whose lifetime decides the tables')."""

    bad_words: tuple[tuple[int, ...], ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logit_bias: tuple[tuple[int, float], ...]
    owner: weakref.ref
    _bad: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _stops: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)
    _bias: dict[tuple[torch.device, int], torch.Tensor] = field(default_factory=dict)

    @property
    def bad_width(self) -> int:
        """W: the longest bad word's prefix (tokens before its last)."""
        return max((len(word) - 1 for word in self.bad_words), default=0)

    def bad_word_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bad_prefix [K, W], bad_last [K])`` on ``device``."""
        if device not in self._bad:
            words, w = self.bad_words, self.bad_width
            prefix = [[-1] * (w - len(word) + 1) + list(word[:-1]) for word in words]
            self._bad[device] = (to_device(prefix, torch.int64, device).view(len(words), w),
                                 to_device([word[-1] for word in words], torch.int64, device))
        return self._bad[device]

    def stop_ids(self, eos_token_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        """``[S]``: the request's stop tokens and (unless it ignores EOS) the model's EOS tokens."""
        key = (device, tuple(eos_token_ids))
        if key not in self._stops:
            stops = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
            self._stops[key] = to_device(sorted(stops), torch.int64, device)
        return self._stops[key]

    def bias(self, vocab: int, device: torch.device) -> torch.Tensor:
        """Dense ``[V]`` float32 bias of the request's ``(token id, bias)`` pairs."""
        key = (device, vocab)
        if key not in self._bias:
            bias = torch.zeros(vocab, dtype=torch.float32, device=device)
            pairs = self.logit_bias
            if pairs:
                ids = to_device([t for t, _ in pairs], torch.int64, device)
                bias.index_add_(0, ids, to_device([b for _, b in pairs], torch.float32, device))
            self._bias[key] = bias
        return self._bias[key]


_TABLES: dict[int, RequestTables] = {}
_LOCK = threading.Lock()


def tables_of(params: SamplingParams) -> RequestTables:
    """The tables of ``params`` (made on first use, dropped when ``params`` is garbage collected)."""
    key = id(params)
    found = _TABLES.get(key)
    if found is not None and found.owner() is params:
        return found
    tables = RequestTables(params.bad_words, params.stop_token_ids, params.ignore_eos, params.logit_bias,
                           weakref.ref(params))
    with _LOCK:
        _TABLES[key] = tables
    weakref.finalize(params, _drop, key, weakref.ref(tables))
    return tables


def _drop(key: int, tables: weakref.ref) -> None:
    with _LOCK:
        if _TABLES.get(key) is tables():
            del _TABLES[key]

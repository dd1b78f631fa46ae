"""How a model's hierarchy rows relate to its token ids in the prefix cache, and what else a cached page carries.

The prefix cache (``kv/prefix_cache.py``, ``kv/prefix_reuse.py``) keys and counts pages of *rows*. For the DSA
families a row is one token's KV, a page ``page_rows`` tokens, and a hit's tokens are all reused: the base
:class:`PrefixRows`. A model whose rows are not tokens, or whose state after a prefix is not only its rows and
indexer keys, describes that with a subclass (DeepSeek-V4: ``kv/prefix_v4.py``):

- ``tokens_per_row`` / ``lead_rows``: row ``lead_rows + j`` holds what tokens ``j·tokens_per_row … (j+1)·
  tokens_per_row - 1`` complete (V4: one compressed entry per ``compress_rate_csa`` tokens after a zero row), so
  ``pages`` complete pages cover the first :meth:`PrefixRows.page_end` tokens; a page's key is chained over the token
  ids of its span (``prefix_cache.page_keys``).
- :meth:`PrefixRows.reused_tokens`: of a hit's tokens, how many the prefill need not compute (V4 recomputes a margin
  before the hit, ``model/deepseek_v4/prefix.py``); a hit that saves nothing is not taken.
- ``state_values``: values of further model state per page (row dtype), packed after the page's indexer keys in the
  entry's host pages (``kv/prefix_keys.py``): :meth:`PrefixRows.save_state` gives them at registration and
  :meth:`PrefixRows.load_state` receives a hit's at admission. :meth:`PrefixRows.forget` is called when the manager
  is done with a request (its memory freed, or it ended before admission).
"""

from __future__ import annotations

import torch


class PrefixRows:
    """One row per token, nothing besides rows and indexer keys (see the module docstring)."""

    tokens_per_row = 1
    lead_rows = 0
    state_values = 0

    def describe(self) -> tuple[object, ...]:
        """What of this scheme decides a page's content (part of the page keys' salt)."""
        return (type(self).__name__, self.tokens_per_row, self.lead_rows, self.state_values)

    def rows(self, tokens: int) -> int:
        """Rows the first ``tokens`` tokens complete."""
        return self.lead_rows + tokens // self.tokens_per_row

    def page_end(self, pages: int, page_rows: int) -> int:
        """Tokens whose rows fill the first ``pages`` complete pages (page ``i`` spans tokens ``page_end(i) …
        page_end(i + 1) - 1``)."""
        return max(0, (pages * page_rows - self.lead_rows) * self.tokens_per_row)

    def pages_within(self, tokens: int, page_rows: int) -> int:
        """Complete pages the first ``tokens`` tokens fill."""
        return self.rows(tokens) // page_rows

    def reused_tokens(self, hit_tokens: int) -> int:
        """Tokens a prefill need not compute after a hit on the first ``hit_tokens`` tokens."""
        return hit_tokens

    def save_state(self, request_id: str, page: int) -> torch.Tensor:
        """The model state of ``request_id``'s page ``page`` (``[state_values]``, CPU)."""
        return torch.zeros(0)

    def load_state(self, request_id: str, values: torch.Tensor) -> None:
        """An admission hit the request's first ``n`` pages: ``values [n, state_values]`` (CPU) is their state."""

    def forget(self, request_id: str) -> None:
        """The manager is done with the request."""


IDENTITY = PrefixRows()

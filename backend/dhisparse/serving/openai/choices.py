"""One choice's text as it streams in: incremental detokenisation, stop strings, per-token log-probabilities.

Tokens are decoded one by one into whole characters (`TextDecoder`: an incomplete UTF-8 tail waits for its next
bytes). Stop strings are matched on the text, as OpenAI does: the text ends just before the first occurrence of any
of them and the choice finishes with ``stop``; until a match is ruled out, the last ``len(longest stop) - 1``
characters are held back, so streamed text never has to be taken back. Each token's entry (its text, bytes,
log-probability and top alternatives) is released with the text it ends in; after a stop match, tokens that start
inside the stop string are dropped. `completion_tokens` counts the tokens consumed, up to the one that completed
a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dhisparse.serving.openai.engine_client import SequenceChunk
from dhisparse.serving.tokenization import TextDecoder, TokenBytes


@dataclass(frozen=True)
class TokenEntry:
    """One generated token: id, its own bytes, where its text starts in the choice's text (characters), its
    log-probability and the top alternatives ``(token id, log-prob)`` when they were asked for."""

    token_id: int
    raw: bytes
    start: int
    log_prob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Delta:
    """What a choice releases at once: text and the entries of the tokens that text completes."""

    text: str = ""
    tokens: list[TokenEntry] = field(default_factory=list)


class ChoiceText:
    """Accumulates one choice. `feed` each chunk; `stopped` turns true on a stop-string match (stop feeding then);
    `release` gives what may be sent now; after the sequence ends, `release(final=True)` gives the rest.

    Args:
        token_bytes: the tokenizer's per-token bytes.
        stops: stop strings (empty strings are ignored).
    """

    def __init__(self, token_bytes: TokenBytes, stops: tuple[str, ...] = ()) -> None:
        self._token_bytes = token_bytes
        self._decoder = TextDecoder(token_bytes)
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self.entries: list[TokenEntry] = []
        self.completion_tokens = 0
        self.stopped = False
        self._sent_text = 0  # characters released
        self._sent_entries = 0

    def feed(self, chunk: SequenceChunk) -> None:
        """Take a streamed chunk's tokens, one by one, until a stop string matches."""
        for i, token in enumerate(chunk.token_ids):
            if self.stopped:
                return
            top = tuple(chunk.top[i]) if chunk.top is not None else ()
            log_prob = chunk.log_probs[i] if chunk.log_probs is not None else None
            self.entries.append(TokenEntry(token, self._token_bytes.decode([token]), len(self.text), log_prob, top))
            self.completion_tokens += 1
            self._append(self._decoder.feed([token]))

    def _append(self, piece: str) -> None:
        if not piece:
            return
        search_from = max(0, len(self.text) - self._hold)
        self.text += piece
        found = [i for stop in self._stops if (i := self.text.find(stop, search_from)) >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def release(self, final: bool = False) -> Delta:
        """Text that can no longer change (all of it when `final` or stopped) and the entries it completes."""
        if final and not self.stopped:
            self._append(self._decoder.flush())
        done = final or self.stopped
        end = len(self.text) if done else max(self._sent_text, len(self.text) - self._hold)
        delta = Delta(self.text[self._sent_text:end])
        self._sent_text = end
        while self._sent_entries < len(self.entries):
            index = self._sent_entries
            following = self.entries[index + 1].start if index + 1 < len(self.entries) else None
            entry = self.entries[index]
            if done:
                if self.stopped and entry.start >= len(self.text):
                    break  # starts inside the stop string
            elif following is None or following > end:
                break  # its text is not all released yet
            delta.tokens.append(entry)
            self._sent_entries += 1
        if done:
            self._sent_entries = len(self.entries)
        return delta

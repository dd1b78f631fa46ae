"""Multi-token stop sequences, matched on the generated tokens as they stream out.

The engine stops on single tokens (`SamplingParams.stop_token_ids`); a stop word that tokenises into
several tokens is matched here. The output keeps the stop sequence itself (as TensorRT-LLM does), and
nothing after it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopSequenceMatcher:
    """Feeds generated tokens in chunks and reports where the first stop sequence ends.

    Args:
        sequences: stop sequences, each a non-empty tuple of token ids.
        min_tokens: a stop sequence completed within the first `min_tokens` generated tokens does not count
            (`SamplingParams.min_tokens`: the engine bans single stop tokens that early; this holds back the rest).
    """

    def __init__(self, sequences: Sequence[tuple[int, ...]], min_tokens: int = 0) -> None:
        if any(len(s) == 0 for s in sequences):
            raise ValueError("stop sequences must be non-empty")
        self.sequences = tuple(tuple(s) for s in sequences)
        # Sequences by length: each fed token costs one set lookup per distinct length, not a walk over every word.
        self._by_length: dict[int, set[tuple[int, ...]]] = {}
        for sequence in self.sequences:
            self._by_length.setdefault(len(sequence), set()).add(sequence)
        self._lengths = sorted(self._by_length)
        self._min_tokens, self._fed = min_tokens, 0
        self._keep = max((len(s) for s in self.sequences), default=1) - 1
        self._tail: list[int] = []
        self.stopped = False

    def feed(self, new_tokens: Sequence[int]) -> int | None:
        """Append `new_tokens`; return how many of them to keep if a stop sequence ended among them.

        Returns None when no stop sequence has completed yet. After a match the matcher is `stopped`.
        """
        if self.stopped:
            raise RuntimeError("feed() after a stop sequence matched")
        if not self.sequences:
            return None
        for index, token in enumerate(new_tokens):
            self._tail.append(int(token))
            self._fed += 1
            tail = self._tail
            ended = any(n <= len(tail) and tuple(tail[-n:]) in self._by_length[n] for n in self._lengths)
            if ended and self._fed > self._min_tokens:
                self.stopped = True
                return index + 1
            if len(self._tail) > self._keep:
                del self._tail[: len(self._tail) - self._keep]
        return None

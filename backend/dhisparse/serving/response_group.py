"""Several generated sequences answering one Triton request through its one response sender.

A Triton request with B prompts and `num_return_sequences = n` becomes B·n engine requests. Each is served as if
it had the sender to itself (`member()` hands out a sender-like object per sequence); the group turns their
"final" responses into ordinary ones until the last sequence finishes, whose response carries the
COMPLETE_FINAL flag. An error from any member is sent at once as the final response (the client sees it;
the group is closed and later sends are dropped), and `on_error` is called so the other members can be stopped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class ResponseGroup:
    """Args: sender: the Triton response sender; size: members; final_flag: `TRITONSERVER_RESPONSE_COMPLETE_FINAL`;
    is_error: tells an error response from a data response; on_error: called once when a member fails."""

    def __init__(self, sender: Any, size: int, final_flag: int, is_error: Callable[[Any], bool],
                 on_error: Callable[[], None] = lambda: None) -> None:
        self.sender, self._final_flag, self._is_error, self._on_error = sender, final_flag, is_error, on_error
        self._open = size
        self._closed = False
        self._sent_any = False
        self._lock = threading.Lock()

    def member(self) -> GroupMember:
        return GroupMember(self)

    def _send(self, response: Any, flags: int) -> None:
        final = bool(flags & self._final_flag)
        with self._lock:
            if self._closed:
                return
            failed = response is not None and self._is_error(response)
            if final:
                self._open -= 1
            last = failed or (final and self._open == 0)
            if last:
                self._closed = True
            if response is None and not last:
                return  # a member's flags-only end: nothing to tell the client yet
            if response is None:
                self.sender.send(flags=self._final_flag)
            elif failed and self._sent_any:
                # After streamed responses an error-carrying *final* response never reaches a BLS caller on
                # Triton 2.51 (its stream stalls): the error goes first, a flags-only final after it.
                self.sender.send(response, flags=0)
                self.sender.send(flags=self._final_flag)
            else:
                self.sender.send(response, flags=self._final_flag if last else 0)
                self._sent_any = True
        if failed and self._open > 0:
            self._on_error()

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self._closed and self.sender.is_cancelled()


class GroupMember:
    """What one member sees: `send(response=None, flags=0)` and `is_cancelled()` like a Triton sender."""

    def __init__(self, group: ResponseGroup) -> None:
        self._group = group

    def send(self, response: Any = None, flags: int = 0) -> None:
        self._group._send(response, flags)

    def is_cancelled(self) -> bool:
        return self._group.is_cancelled()
